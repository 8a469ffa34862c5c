//! Server-sent-event chunks for streaming completions, shaped like vLLM's.

use crate::request::Endpoint;
use bytes::Bytes;
use serde_json::{json, Value};

/// Formats the chunks of one streamed response.
pub struct ChunkWriter {
    pub endpoint: Endpoint,
    pub id: String,
    pub created: u64,
    pub model: String,
}

impl ChunkWriter {
    fn frame(&self, choices: Value, usage: Option<&Value>) -> Bytes {
        let object = match self.endpoint {
            Endpoint::Chat => "chat.completion.chunk",
            Endpoint::Completion => "text_completion",
        };
        let mut chunk = json!({
            "id": self.id, "object": object, "created": self.created,
            "model": self.model, "choices": choices,
        });
        if let Some(usage) = usage {
            chunk["usage"] = usage.clone();
        }
        Bytes::from(format!("data: {chunk}\n\n"))
    }

    /// The chat stream's opening chunk, announcing the assistant role (none for completions).
    pub fn role(&self) -> Option<Bytes> {
        (self.endpoint == Endpoint::Chat).then(|| {
            self.frame(
                json!([{"index": 0, "delta": {"role": "assistant", "content": ""},
                        "logprobs": null, "finish_reason": null}]),
                None,
            )
        })
    }

    /// One output token; the last one carries the finish reason, as in vLLM.
    pub fn token(&self, text: &str, finish_reason: Option<&str>) -> Bytes {
        let choice = match self.endpoint {
            Endpoint::Chat => json!({"index": 0, "delta": {"content": text},
                                     "logprobs": null, "finish_reason": finish_reason}),
            Endpoint::Completion => json!({"index": 0, "text": text, "logprobs": null,
                                           "finish_reason": finish_reason, "stop_reason": null}),
        };
        self.frame(json!([choice]), None)
    }

    /// The final usage-only chunk sent when `stream_options.include_usage` is set.
    pub fn usage(&self, usage: &Value) -> Bytes {
        self.frame(json!([]), Some(usage))
    }

    pub fn error(message: &str, code: u16) -> Bytes {
        let body = json!({"error": {"message": message, "type": "BadRequestError", "code": code}});
        Bytes::from(format!("data: {body}\n\n"))
    }

    pub fn done() -> Bytes {
        Bytes::from_static(b"data: [DONE]\n\n")
    }
}

/// OpenAI `usage` object as vLLM 0.32 writes it with `--enable-prompt-tokens-details`:
/// `prompt_tokens_details` has `cached_tokens` and `created_cache_tokens` (the prompt's tokens
/// this request added to the prefix cache: its whole blocks not found there); a plain answer
/// (`streamed` false) also carries the fields that are null (`multimodal_tokens`,
/// `completion_tokens_details`), which a stream's usage chunk leaves out.
pub fn usage(
    prompt_tokens: usize,
    completion_tokens: usize,
    cached_tokens: usize,
    block_size: usize,
    streamed: bool,
) -> Value {
    let whole_blocks = prompt_tokens / block_size.max(1) * block_size.max(1);
    let mut u = json!({
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {
            "cached_tokens": cached_tokens,
            "created_cache_tokens": whole_blocks.saturating_sub(cached_tokens),
        },
    });
    if !streamed {
        u["prompt_tokens_details"]["multimodal_tokens"] = Value::Null;
        u["completion_tokens_details"] = Value::Null;
    }
    u
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(b: &Bytes) -> Value {
        let s = std::str::from_utf8(b).unwrap();
        let body = s
            .strip_prefix("data: ")
            .unwrap()
            .strip_suffix("\n\n")
            .unwrap();
        serde_json::from_str(body).unwrap()
    }

    #[test]
    fn chat_chunks_have_openai_shape() {
        let w = ChunkWriter {
            endpoint: Endpoint::Chat,
            id: "c1".into(),
            created: 1,
            model: "m".into(),
        };
        let role = parse(&w.role().unwrap());
        assert_eq!(role["object"], "chat.completion.chunk");
        assert_eq!(role["choices"][0]["delta"]["role"], "assistant");
        let last = parse(&w.token(" x", Some("length")));
        assert_eq!(last["choices"][0]["delta"]["content"], " x");
        assert_eq!(last["choices"][0]["finish_reason"], "length");
        let u = parse(&w.usage(&usage(40, 2, 16, 16, true)));
        assert_eq!(u["choices"], json!([]));
        assert_eq!(u["usage"]["total_tokens"], 42);
        assert_eq!(u["usage"]["prompt_tokens_details"]["cached_tokens"], 16);
        assert_eq!(
            u["usage"]["prompt_tokens_details"]["created_cache_tokens"],
            16
        );
        assert!(u["usage"].get("completion_tokens_details").is_none());
        let plain = usage(40, 2, 16, 16, false);
        assert!(plain["completion_tokens_details"].is_null());
        assert!(plain["prompt_tokens_details"]["multimodal_tokens"].is_null());
    }

    #[test]
    fn completion_chunks_carry_text_and_no_role_chunk() {
        let w = ChunkWriter {
            endpoint: Endpoint::Completion,
            id: "c".into(),
            created: 1,
            model: "m".into(),
        };
        assert!(w.role().is_none());
        let t = parse(&w.token("a", None));
        assert_eq!(t["object"], "text_completion");
        assert_eq!(t["choices"][0]["text"], "a");
        assert_eq!(&ChunkWriter::done()[..], b"data: [DONE]\n\n");
    }
}
