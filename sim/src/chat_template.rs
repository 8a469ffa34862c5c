//! A ChatML (Qwen-style) chat template: OpenAI messages and tools rendered to one prompt string.
//!
//! Every message is rendered independently and joined, so conversations that share their
//! first messages share a text prefix, hence (see `tokenizer`) a token prefix: exactly the
//! property multi-turn prefix caching relies on in vLLM.
//!
//! The order is Qwen's (Qwen 2.5/3): the system prompt, then the tool list in the same system
//! message, then the turns; an assistant's tool calls render as `<tool_call>` blocks of the
//! function's name and arguments (not the call id), tool results as `<tool_response>` user turns.
//! Content given as parts renders like vLLM renders it for string-content templates: text parts
//! joined by a newline. An image renders as [`IMAGE_TOKENS`] placeholder tokens, a fixed number as
//! for a fixed-size image in Qwen2-VL; vLLM tells images apart in its prefix cache by a hash of the
//! image mixed into the hash of the blocks that hold its placeholders, which here is the
//! placeholder token itself being named by the image's hash.

use serde_json::Value;
use xxhash_rust::xxh3::xxh3_64;

/// Placeholder tokens per image (Qwen2-VL spends 256 on a 448×448 image).
pub const IMAGE_TOKENS: usize = 256;

/// Renders `messages` (and optional `tools`) the way Qwen's template does, ending with the
/// assistant header when `add_generation_prompt` is set.
pub fn render(
    messages: &[Value],
    tools: Option<&[Value]>,
    add_generation_prompt: bool,
) -> Result<String, String> {
    let mut out = String::new();
    let tools = tools.filter(|t| !t.is_empty());
    let first_is_system = messages
        .first()
        .and_then(|m| m.get("role"))
        .and_then(Value::as_str)
        .is_some_and(|r| r == "system" || r == "developer");
    if let Some(tools) = tools {
        // Qwen puts the tool list into the (possibly synthesised) system message.
        out.push_str("<|im_start|>system\n");
        if first_is_system {
            out.push_str(&content_text(&messages[0])?);
            out.push_str("\n\n");
        }
        out.push_str("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n<tools>");
        for tool in tools {
            out.push('\n');
            out.push_str(&tool.to_string());
        }
        out.push_str("\n</tools><|im_end|>\n");
    }
    for (i, message) in messages.iter().enumerate() {
        if i == 0 && first_is_system && tools.is_some() {
            continue;
        }
        let role = message
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| format!("messages[{i}]: missing 'role'"))?;
        let role = if role == "developer" { "system" } else { role };
        match role {
            "system" | "user" | "assistant" => {
                out.push_str("<|im_start|>");
                out.push_str(role);
                out.push('\n');
                out.push_str(&content_text(message)?);
                if let Some(calls) = message.get("tool_calls").and_then(Value::as_array) {
                    for call in calls {
                        let function = call.get("function").unwrap_or(call);
                        out.push_str("\n<tool_call>\n");
                        out.push_str(&function.to_string());
                        out.push_str("\n</tool_call>");
                    }
                }
                out.push_str("<|im_end|>\n");
            }
            "tool" => {
                out.push_str("<|im_start|>user\n<tool_response>\n");
                out.push_str(&content_text(message)?);
                out.push_str("\n</tool_response><|im_end|>\n");
            }
            other => return Err(format!("messages[{i}]: unknown role '{other}'")),
        }
    }
    if add_generation_prompt {
        out.push_str("<|im_start|>assistant\n");
    }
    Ok(out)
}

/// The text of a message: a string, or its content parts joined by newlines. Non-text parts
/// (images, audio, video) become [`IMAGE_TOKENS`] placeholders named by a hash of their data.
fn content_text(message: &Value) -> Result<String, String> {
    match message.get("content") {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (i, part) in parts.iter().enumerate() {
                if i > 0 {
                    text.push('\n');
                }
                let kind = part
                    .get("type")
                    .and_then(Value::as_str)
                    .ok_or("content part without 'type'")?;
                match kind {
                    "text" => text.push_str(part.get("text").and_then(Value::as_str).unwrap_or("")),
                    _ => push_media(&mut text, part.get(kind).unwrap_or(part)),
                }
            }
            Ok(text)
        }
        Some(_) => Err("'content' must be a string or an array of parts".into()),
    }
}

/// An image's placeholder tokens. `{"url": ...}` is the image by its URL (data URLs carry the
/// image itself); a `detail` hint does not change it.
fn push_media(text: &mut String, data: &Value) {
    let hash = match data.get("url").and_then(Value::as_str) {
        Some(url) => xxh3_64(url.as_bytes()),
        None => xxh3_64(data.to_string().as_bytes()),
    };
    let pad = format!("<|image_{hash:016x}|>");
    text.push_str("<|vision_start|>");
    for _ in 0..IMAGE_TOKENS {
        text.push_str(&pad);
    }
    text.push_str("<|vision_end|>");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::tokenize;
    use serde_json::json;

    #[test]
    fn renders_chatml_with_generation_prompt() {
        let msgs = [
            json!({"role":"system","content":"Be brief."}),
            json!({"role":"user","content":"Hi"}),
        ];
        assert_eq!(
            render(&msgs, None, true).unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn tools_go_into_the_system_message() {
        let msgs = [json!({"role":"user","content":"weather?"})];
        let tools = [json!({"type":"function","function":{"name":"get_weather"}})];
        let text = render(&msgs, Some(&tools), true).unwrap();
        assert!(text.starts_with("<|im_start|>system\n# Tools"));
        assert!(text.contains("get_weather"));
    }

    #[test]
    fn a_longer_conversation_extends_the_token_prefix_of_a_shorter_one() {
        let turn1 = vec![
            json!({"role":"system","content":"You are a helpful assistant."}),
            json!({"role":"user","content":"Explain prefix caching."}),
        ];
        let mut turn2 = turn1.clone();
        turn2.push(json!({"role":"assistant","content":"the cache of a block"}));
        turn2.push(json!({"role":"user","content":"And eviction?"}));
        let t1 = tokenize(&render(&turn1, None, true).unwrap());
        let t2 = tokenize(&render(&turn2, None, true).unwrap());
        assert_eq!(&t2[..t1.len()], &t1[..]);
    }

    #[test]
    fn text_parts_render_like_the_joined_string_and_bad_content_is_an_error() {
        let parts = json!({"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]});
        let string = json!({"role":"user","content":"a\nb"});
        assert_eq!(
            render(&[parts], None, false).unwrap(),
            render(&[string], None, false).unwrap()
        );
        assert!(render(&[json!({"role":"user","content":5})], None, false).is_err());
        assert!(render(&[json!({"content":"x"})], None, false).is_err());
    }

    #[test]
    fn an_image_is_a_fixed_number_of_tokens_named_by_its_hash() {
        let with = |url: &str| {
            let m = json!({"role":"user","content":[{"type":"image_url","image_url":{"url":url}},{"type":"text","text":"what is it?"}]});
            tokenize(&render(&[m], None, false).unwrap())
        };
        let (a, a2, b) = (
            with("data:a"),
            with("data:a"),
            with(&format!("data:{}", "b".repeat(100_000))),
        );
        assert_eq!(a, a2);
        assert_eq!(
            a.len(),
            b.len(),
            "the image's size does not change its cost"
        );
        assert!(a.len() > IMAGE_TOKENS);
        let differ = a.iter().zip(&b).position(|(x, y)| x != y).unwrap();
        assert!(
            differ < 8,
            "different images diverge where the image starts"
        );
    }
}
