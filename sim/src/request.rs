//! Parsing OpenAI requests into what the engine needs: prompt token ids, vLLM's `cache_salt` and
//! generation options.
//!
//! The `cache_salt` (per-tenant cache isolation) leaves the token ids as rendered: it is the
//! extra key of the prompt's first block in the prefix cache ([`crate::prefix_cache`]), as in
//! vLLM, so requests with different salts share no cached block while requests with the same
//! salt share as usual.

use std::borrow::Cow;

use crate::bpe::Vocab;
use crate::chat_template;
use kvroute::template::Templates;
use serde_json::Value;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completion,
}

impl Endpoint {
    /// The endpoint a request path targets (also accepts the `/render` variants).
    pub fn from_path(path: &str) -> Option<Self> {
        match path.trim_end_matches("/render") {
            "/v1/chat/completions" => Some(Endpoint::Chat),
            "/v1/completions" => Some(Endpoint::Completion),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct GenRequest {
    pub endpoint: Endpoint,
    pub model: Option<String>,
    pub prompt_tokens: Vec<u32>,
    /// vLLM's `cache_salt`: the first prompt block's extra key.
    pub cache_salt: Option<String>,
    pub max_tokens: Option<usize>,
    pub stream: bool,
    pub include_usage: bool,
    pub ignore_eos: bool,
}

/// Prompt token ids of a request body, with the rendered text when there was text. Its
/// `cache_salt` is not in them: see [`cache_salt`].
pub fn prompt_tokens(
    endpoint: Endpoint,
    body: &Value,
) -> Result<(Vec<u32>, Option<String>), String> {
    prompt_tokens_in(&Vocab::Hash, endpoint, body)
}

/// [`prompt_tokens`] with the tokenizer `vocab`.
pub fn prompt_tokens_in(
    vocab: &Vocab,
    endpoint: Endpoint,
    body: &Value,
) -> Result<(Vec<u32>, Option<String>), String> {
    prompt_tokens_with(&Frontend::of(vocab), endpoint, body, None)
}

/// What turns a request into prompt tokens: the tokenizer, and the chat template chat prompts
/// are rendered with, if any (else the built-in renderer, [`chat_template::render`]).
#[derive(Clone, Copy)]
pub struct Frontend<'a> {
    pub vocab: &'a Vocab,
    pub template: Option<&'a Templates>,
}

impl<'a> Frontend<'a> {
    /// The tokenizer `vocab` and the built-in renderer.
    pub fn of(vocab: &'a Vocab) -> Self {
        Frontend {
            vocab,
            template: None,
        }
    }
}

/// [`prompt_tokens`] through `frontend`. `raw` is the body as sent: a template is rendered over
/// it, as the filter renders it (the request's own key order, e.g. of `tools` printed by
/// `tojson`); without it, `body` is written back.
pub fn prompt_tokens_with(
    frontend: &Frontend,
    endpoint: Endpoint,
    body: &Value,
    raw: Option<&[u8]>,
) -> Result<(Vec<u32>, Option<String>), String> {
    let vocab = frontend.vocab;
    match (frontend.template, endpoint) {
        (Some(template), Endpoint::Chat) => {
            let raw = match raw {
                Some(raw) => Cow::Borrowed(raw),
                None => Cow::Owned(serde_json::to_vec(body).map_err(|e| e.to_string())?),
            };
            let text = rendered(template, &raw)?;
            Ok((vocab.tokenize(&text), Some(text)))
        }
        _ => builtin_tokens(vocab, endpoint, body),
    }
}

/// A request body's `cache_salt`, if it has one: a non-empty string, as vLLM requires.
pub fn cache_salt(body: &Value) -> Result<Option<String>, String> {
    match body.get("cache_salt") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if !s.is_empty() => Ok(Some(s.clone())),
        Some(_) => Err("'cache_salt' must be a non-empty string".into()),
    }
}

/// A chat request's prompt as its model's chat template renders it: the filter's own rendering
/// (kvroute's template module), so the two agree by construction.
fn rendered(template: &Templates, raw: &[u8]) -> Result<String, String> {
    let prompt = template
        .render(raw)
        .map_err(|e| format!("the chat template did not render the request: {e:?}"))?;
    String::from_utf8(prompt.text).map_err(|_| "the rendered prompt is not UTF-8".to_string())
}

fn builtin_tokens(
    vocab: &Vocab,
    endpoint: Endpoint,
    body: &Value,
) -> Result<(Vec<u32>, Option<String>), String> {
    match endpoint {
        Endpoint::Chat => {
            let messages = body
                .get("messages")
                .and_then(Value::as_array)
                .ok_or("'messages' must be an array")?;
            if messages.is_empty() {
                return Err("'messages' must not be empty".into());
            }
            let tools = body
                .get("tools")
                .and_then(Value::as_array)
                .map(Vec::as_slice);
            let add_generation_prompt = body
                .get("add_generation_prompt")
                .and_then(Value::as_bool)
                .unwrap_or(true);
            let text = chat_template::render(messages, tools, add_generation_prompt)?;
            Ok((vocab.tokenize(&text), Some(text)))
        }
        Endpoint::Completion => match body.get("prompt") {
            Some(Value::String(text)) => Ok((vocab.tokenize(text), Some(text.clone()))),
            Some(Value::Array(items)) => match items.as_slice() {
                [Value::String(text)] => Ok((vocab.tokenize(text), Some(text.clone()))),
                [Value::Array(ids)] => Ok((token_ids(ids)?, None)),
                ids if !ids.is_empty() && ids.iter().all(Value::is_number) => {
                    Ok((token_ids(ids)?, None))
                }
                _ => Err(
                    "'prompt' must be a string, a token id array, or a one-element list of \
                          either (batched prompts are not simulated)"
                        .into(),
                ),
            },
            _ => Err("'prompt' is required".into()),
        },
    }
}

fn token_ids(ids: &[Value]) -> Result<Vec<u32>, String> {
    ids.iter()
        .map(|v| {
            v.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| "token ids must be non-negative integers".to_string())
        })
        .collect()
}

/// A generation request (`/v1/chat/completions` or `/v1/completions`).
pub fn parse(endpoint: Endpoint, body: &Value) -> Result<GenRequest, String> {
    parse_in(&Vocab::Hash, endpoint, body)
}

/// [`parse`] with the tokenizer `vocab`.
pub fn parse_in(vocab: &Vocab, endpoint: Endpoint, body: &Value) -> Result<GenRequest, String> {
    parse_with(&Frontend::of(vocab), endpoint, body, None)
}

/// [`parse`] through `frontend`, `raw` the body as sent (see [`prompt_tokens_with`]).
pub fn parse_with(
    frontend: &Frontend,
    endpoint: Endpoint,
    body: &Value,
    raw: Option<&[u8]>,
) -> Result<GenRequest, String> {
    let cache_salt = cache_salt(body)?;
    let (prompt_tokens, _) = prompt_tokens_with(frontend, endpoint, body, raw)?;
    if prompt_tokens.is_empty() {
        return Err("the prompt is empty".into());
    }
    let max_tokens = match body
        .get("max_tokens")
        .or_else(|| body.get("max_completion_tokens"))
    {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_u64() {
            Some(n) if n >= 1 => Some(n as usize),
            _ => return Err("'max_tokens' must be a positive integer".into()),
        },
    };
    let flag = |name: &str| body.get(name).and_then(Value::as_bool).unwrap_or(false);
    let include_usage = body
        .get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    Ok(GenRequest {
        endpoint,
        model: body
            .get("model")
            .and_then(Value::as_str)
            .map(str::to_string),
        prompt_tokens,
        cache_salt,
        max_tokens,
        stream: flag("stream"),
        include_usage,
        ignore_eos: flag("ignore_eos"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::tokenize;
    use serde_json::json;

    #[test]
    fn chat_request_is_templated_and_options_parsed() {
        let body = json!({"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":7,
                          "stream":true,"stream_options":{"include_usage":true},"ignore_eos":true});
        let req = parse(Endpoint::Chat, &body).unwrap();
        assert_eq!(req.max_tokens, Some(7));
        assert!(req.stream && req.include_usage && req.ignore_eos);
        assert_eq!(
            req.prompt_tokens,
            tokenize("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
        );
    }

    #[test]
    fn a_chat_template_renders_as_the_filter_does_over_the_body_as_sent() {
        let mut templates = Templates::default();
        let source = "{% for t in tools %}{{ t | tojson }}\n{% endfor %}\
            {% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}";
        templates
            .set_default(&kvroute::template::spec_of_file(source))
            .unwrap();
        let frontend = Frontend {
            vocab: &Vocab::Hash,
            template: Some(&templates),
        };
        // The parameters' keys out of order: the template prints them as sent, the tool as
        // vLLM passes it.
        let raw = br#"{"model":"m","tools":[{"type":"function","function":{"name":"f","parameters":{"z":1,"a":2}}}],"messages":[{"role":"user","content":"hi"}]}"#;
        let body: Value = serde_json::from_slice(raw).unwrap();
        let (tokens, text) =
            prompt_tokens_with(&frontend, Endpoint::Chat, &body, Some(raw)).unwrap();
        let text = text.unwrap();
        assert_eq!(
            text,
            "{\"type\": \"function\", \"function\": {\"name\": \"f\", \"description\": null, \
             \"parameters\": {\"z\": 1, \"a\": 2}}}\n[user] hi\n"
        );
        assert_eq!(text.as_bytes(), templates.render(raw).unwrap().text);
        assert_eq!(tokens, Vocab::Hash.tokenize(&text));
        // Without a template, the built-in renderer, as before.
        let (_, builtin) = prompt_tokens_in(&Vocab::Hash, Endpoint::Chat, &body).unwrap();
        assert!(builtin.unwrap().starts_with("<|im_start|>system\n# Tools"));
        // A completion has no template to go through.
        let completion = json!({"model":"m","prompt":"a b"});
        let (_, text) =
            prompt_tokens_with(&frontend, Endpoint::Completion, &completion, None).unwrap();
        assert_eq!(text.as_deref(), Some("a b"));
        // A template that refuses the request is the request's error.
        let mut refusing = Templates::default();
        refusing
            .set_default(&kvroute::template::spec_of_file(
                "{{ raise_exception('no') }}",
            ))
            .unwrap();
        let frontend = Frontend {
            template: Some(&refusing),
            ..frontend
        };
        assert!(prompt_tokens_with(&frontend, Endpoint::Chat, &body, Some(raw)).is_err());
    }

    #[test]
    fn completion_prompt_forms() {
        let text = parse(Endpoint::Completion, &json!({"prompt":"a b"})).unwrap();
        assert_eq!(text.prompt_tokens, tokenize("a b"));
        let ids = parse(Endpoint::Completion, &json!({"prompt":[1,2,3]})).unwrap();
        assert_eq!(ids.prompt_tokens, vec![1, 2, 3]);
        assert!(parse(Endpoint::Completion, &json!({"prompt":["a","b"]})).is_err());
        assert!(parse(Endpoint::Completion, &json!({})).is_err());
    }

    #[test]
    fn the_cache_salt_keys_the_first_block_and_leaves_the_tokens_as_rendered() {
        use crate::prefix_cache::block_hashes;
        let doc = "a long shared document ".repeat(20);
        let body = |salt: Option<&str>| {
            let mut b = json!({"messages":[{"role":"user","content":doc}]});
            if let Some(s) = salt {
                b["cache_salt"] = json!(s);
            }
            parse(Endpoint::Chat, &b).unwrap()
        };
        let (plain, a, a2, b) = (
            body(None),
            body(Some("a")),
            body(Some("a")),
            body(Some("b")),
        );
        assert_eq!(plain.cache_salt, None);
        assert_eq!(a.cache_salt.as_deref(), Some("a"));
        for salted in [&a, &b] {
            assert_eq!(salted.prompt_tokens, plain.prompt_tokens);
        }
        let blocks = |r: &GenRequest| block_hashes(&r.prompt_tokens, 16, r.cache_salt.as_deref());
        assert_eq!(blocks(&a), blocks(&a2), "the same salt shares every block");
        for (x, y) in [(&a, &b), (&a, &plain), (&b, &plain)] {
            let (hx, hy) = (blocks(x), blocks(y));
            assert!(!hx.is_empty() && hx.iter().all(|h| !hy.contains(h)));
        }
        for bad in [json!(""), json!(7)] {
            let body = json!({"messages":[{"role":"user","content":"x"}],"cache_salt":bad});
            assert!(parse(Endpoint::Chat, &body).is_err());
        }
    }

    #[test]
    fn invalid_fields_are_errors() {
        assert!(parse(Endpoint::Chat, &json!({"messages":[]})).is_err());
        assert!(parse(Endpoint::Chat, &json!({"messages":"hi"})).is_err());
        let zero = json!({"prompt":"x","max_tokens":0});
        assert!(parse(Endpoint::Completion, &zero).is_err());
    }

    #[test]
    fn endpoint_from_path_accepts_render_variants() {
        assert_eq!(
            Endpoint::from_path("/v1/chat/completions/render"),
            Some(Endpoint::Chat)
        );
        assert_eq!(
            Endpoint::from_path("/v1/completions"),
            Some(Endpoint::Completion)
        );
        assert_eq!(Endpoint::from_path("/v1/embeddings"), None);
    }
}
