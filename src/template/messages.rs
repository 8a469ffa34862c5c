//! A chat request's messages prepared as vLLM hands them to a chat template.
//!
//! vLLM renders not the messages a client sent but a conversation it builds from them
//! (`parse_chat_messages`): content becomes one string (text parts joined by a newline) for a
//! template that prints content, or a list of `{"type": "text", "text": ...}` parts for one that
//! loops over it (see [`ContentFormat`]); a tool message's text parts are joined into one string;
//! of a message only its role, content, `name`, a tool message's `tool_call_id`, an assistant's
//! `tool_calls` and `reasoning` (also given as `reasoning_content`), `task` and a developer
//! message's `tools` are kept; and each tool call's `arguments`, a JSON string in the API, is
//! parsed into its value (`{}` when it is not JSON), as templates expect.
//!
//! Media are where vLLM and the filter part: the engine renders a model-specific placeholder and
//! tells images apart by a hash of the image, which no text carries. Here every image (audio,
//! video, file) is the text [`media_marker`]: `<|kvroute_image:<16 hex digits>|>`, the hex being
//! xxh3 of its URL (of its data for `input_audio`, of its JSON otherwise). A string-content
//! template gets the markers where vLLM puts placeholders (first, then the text, joined by
//! newlines); a parts template gets the part vLLM passes (`{"type": "image"}`) followed by a text
//! part holding the marker.

use std::sync::Arc;

use minijinja::value::{Enumerator, Object, Value, ValueKind};
use serde_json::value::RawValue;
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use crate::request::{Field, Media, Message, Part as Sent, Text};

/// A hash of everything of `message` a template can see, chained onto `seed`.
pub(crate) fn fingerprint(message: &Message, seed: u64) -> u64 {
    let raw =
        |v: Option<&RawValue>, h: u64| xxh3_64_with_seed(v.map_or("", RawValue::get).as_bytes(), h);
    let mut h = xxh3_64_with_seed(message.role.as_deref().unwrap_or("\u{0}").as_bytes(), seed);
    match &message.content {
        Some(Field::Text(t)) => h = xxh3_64_with_seed(&t.0, h),
        Some(Field::List(parts)) => {
            for p in parts {
                h = raw(p.kind, h);
                h = xxh3_64_with_seed(p.text.as_ref().map_or(&b"\x00"[..], |t| &t.0), h);
                for m in [&p.image_url, &p.input_audio, &p.video_url, &p.file] {
                    h = raw(m.as_ref().map(|m| m.raw), h);
                }
                for v in [
                    p.refusal,
                    p.thinking,
                    p.image_embeds,
                    p.image_pil,
                    p.audio_url,
                    p.audio_embeds,
                ] {
                    h = raw(v, h);
                }
            }
        }
        None => h ^= 1,
    }
    for v in [
        &message.reasoning,
        &message.name,
        &message.tool_call_id,
        &message.task,
    ] {
        h = xxh3_64_with_seed(v.as_ref().map_or(&b"\x00"[..], |t| &t.0), h);
    }
    for v in [message.tool_calls, message.tools] {
        h = raw(v, h);
    }
    h
}

/// A field kept as JSON text, as a template value (undefined when absent).
fn value(raw: Option<&RawValue>) -> Result<Value, Refused> {
    match raw {
        None => Ok(Value::UNDEFINED),
        Some(raw) => serde_json::from_str(raw.get()).map_err(|_| Refused("a field is not JSON")),
    }
}

/// A text the client sent, as a template string: UTF-8, which minijinja needs (an engine
/// refuses a body that is not).
fn text(t: &Text) -> Result<Value, Refused> {
    std::str::from_utf8(&t.0)
        .map(Value::from)
        .map_err(|_| Refused("text is not UTF-8"))
}

/// A prepared message: its fields in vLLM's order, looked up without a map.
#[derive(Debug)]
struct Prepared(Vec<(&'static str, Value)>);

impl Object for Prepared {
    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        let key = key.as_str()?;
        self.0
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.clone())
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        let keys: Vec<Value> = self.0.iter().map(|(k, _)| Value::from(*k)).collect();
        Enumerator::Iter(Box::new(keys.into_iter()))
    }
}

/// How a template expects message content (vLLM's "content format").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContentFormat {
    /// Content is printed as a string.
    String,
    /// Content is looped over as OpenAI-style parts.
    OpenAi,
}

impl ContentFormat {
    /// What `source` expects, as vLLM detects it: a template that loops over a message's
    /// content (`{% for part in message['content'] %}`, or over a variable named `content`)
    /// gets parts, any other gets strings.
    pub fn detect(source: &str) -> ContentFormat {
        let mut rest = source;
        while let Some(at) = rest.find("{%") {
            rest = &rest[at + 2..];
            let end = rest.find("%}").unwrap_or(rest.len());
            let tag = rest[..end].trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
            if let Some(header) = tag.strip_prefix("for ") {
                if let Some((_, iterable)) = header.split_once(" in ") {
                    let iterable = iterable.split('|').next().unwrap_or("").trim();
                    let iterable = iterable.split(" if ").next().unwrap_or("").trim();
                    if iterable == "content"
                        || iterable.ends_with(".content")
                        || iterable.ends_with("['content']")
                        || iterable.ends_with("[\"content\"]")
                    {
                        return ContentFormat::OpenAi;
                    }
                }
            }
        }
        ContentFormat::String
    }
}

/// Why a request's messages cannot be prepared (vLLM would refuse it).
#[derive(Debug)]
pub struct Refused(pub &'static str);

/// The marker an image (audio, video, file) renders as, named by `hash`.
pub fn media_marker(kind: &str, hash: u64) -> String {
    format!("<|kvroute_{kind}:{hash:016x}|>")
}

fn text_part(text: Value) -> Value {
    Value::from_iter([("type", Value::from("text")), ("text", text)])
}

fn get(v: &Value, key: &str) -> Value {
    v.get_attr(key).unwrap_or_default()
}

fn present(v: &Value) -> bool {
    !v.is_undefined() && !v.is_none()
}

/// What one content part is: text, or a medium (its kind and hash).
enum Part {
    Text(Value),
    Media(&'static str, u64),
    Skip,
}

fn hash_of(v: &Value) -> u64 {
    match v.as_str() {
        Some(s) => xxh3_64(s.as_bytes()),
        None => {
            let url = get(v, "url");
            match url.as_str() {
                Some(s) => xxh3_64(s.as_bytes()),
                None => xxh3_64(v.to_string().as_bytes()),
            }
        }
    }
}

/// The hash of a medium given as `{"url": ...}` (its URL's bytes, read as the body's one pass
/// read them), a string, or any other value.
fn media_hash(m: &Media) -> Result<u64, Refused> {
    if m.url {
        return Ok(xxh3_64(&m.key));
    }
    Ok(hash_of(&value(Some(m.raw))?))
}

fn raw_hash(raw: Option<&RawValue>) -> Result<u64, Refused> {
    Ok(hash_of(&value(raw)?))
}

fn part(p: &Sent) -> Result<Part, Refused> {
    let kind = p
        .kind
        .and_then(|k| serde_json::from_str::<std::borrow::Cow<str>>(k.get()).ok());
    let media = |kind: &'static str, m: &Option<Media>| -> Result<Part, Refused> {
        Ok(Part::Media(
            kind,
            match m {
                Some(m) => media_hash(m)?,
                None => hash_of(&Value::UNDEFINED),
            },
        ))
    };
    let raw_media = |kind: &'static str, v: Option<&RawValue>| Ok(Part::Media(kind, raw_hash(v)?));
    let some_text = |v: Option<&RawValue>| -> Result<Part, Refused> {
        let v = value(v)?;
        Ok(if present(&v) {
            Part::Text(v)
        } else {
            Part::Skip
        })
    };
    match kind.as_deref() {
        Some("text" | "input_text" | "output_text") => match &p.text {
            Some(t) => Ok(Part::Text(text(t)?)),
            None => Ok(Part::Skip),
        },
        Some("refusal") => some_text(p.refusal),
        Some("thinking") => Ok(Part::Text(value(p.thinking)?)),
        Some("image_url" | "input_image") => media("image", &p.image_url),
        Some("image_embeds") => raw_media("image", p.image_embeds),
        Some("image_pil") => raw_media("image", p.image_pil),
        Some("audio_url") => raw_media("audio", p.audio_url),
        Some("audio_embeds") => raw_media("audio", p.audio_embeds),
        Some("input_audio") => {
            let audio = value(p.input_audio.as_ref().map(|m| m.raw))?;
            Ok(Part::Media("audio", hash_of(&get(&audio, "data"))))
        }
        Some("video_url") => media("video", &p.video_url),
        Some("file") => media("file", &p.file),
        Some(_) => Err(Refused("unsupported content part type")),
        None if p.image_url.is_some() => media("image", &p.image_url),
        None if p.audio_url.is_some_and(|a| a.get() != "null") => raw_media("audio", p.audio_url),
        None if p.video_url.is_some() => media("video", &p.video_url),
        None => Err(Refused("content part without a type")),
    }
}

/// A message's content as the template gets it.
fn content(content: Option<&Field<Sent>>, format: ContentFormat) -> Result<Value, Refused> {
    let parts: Vec<Part> = match content {
        None => Vec::new(),
        Some(Field::Text(t)) => match format {
            // The common case: a string stays one.
            ContentFormat::String => return text(t),
            ContentFormat::OpenAi => vec![Part::Text(text(t)?)],
        },
        Some(Field::List(p)) => p.iter().map(part).collect::<Result<_, _>>()?,
    };
    let mut texts: Vec<Value> = Vec::new();
    let mut markers: Vec<String> = Vec::new();
    let mut out: Vec<Value> = Vec::new();
    for p in parts {
        match p {
            Part::Skip => {}
            Part::Text(t) => match format {
                ContentFormat::String => texts.push(t),
                ContentFormat::OpenAi => out.push(text_part(t)),
            },
            Part::Media(kind, hash) => match format {
                ContentFormat::String => markers.push(media_marker(kind, hash)),
                ContentFormat::OpenAi => {
                    out.push(Value::from_iter([("type", Value::from(kind))]));
                    out.push(text_part(Value::from(media_marker(kind, hash))));
                }
            },
        }
    }
    Ok(match format {
        ContentFormat::OpenAi => Value::from(out),
        ContentFormat::String => {
            let mut joined: Vec<String> = markers;
            let text = join_texts(&texts);
            if !text.is_empty() || joined.is_empty() {
                joined.push(text);
            }
            Value::from(joined.join("\n"))
        }
    })
}

fn join_texts(texts: &[Value]) -> String {
    let mut s = String::new();
    for (i, t) in texts.iter().enumerate() {
        if i > 0 {
            s.push('\n');
        }
        crate::template::pyjson::py_str(&mut s, t);
    }
    s
}

/// A tool call with its function's `arguments` parsed from JSON, the rest kept in its order.
fn tool_call(call: &Value) -> Value {
    if call.kind() != ValueKind::Map {
        return call.clone();
    }
    let function = get(call, "function");
    if function.kind() != ValueKind::Map {
        return call.clone();
    }
    let arguments = get(&function, "arguments");
    let parsed = match arguments.kind() {
        ValueKind::String => serde_json::from_str::<Value>(arguments.as_str().unwrap_or_default())
            .unwrap_or_else(|_| Value::from_iter(std::iter::empty::<(Value, Value)>())),
        ValueKind::Map | ValueKind::Seq => arguments,
        _ => Value::from_iter(std::iter::empty::<(Value, Value)>()),
    };
    let function = replace(&function, "arguments", parsed);
    replace(call, "function", function)
}

/// `map` with `key`'s value replaced (or added at the end), in the map's order.
pub(crate) fn replace(map: &Value, key: &str, value: Value) -> Value {
    let mut entries: Vec<(Value, Value)> = Vec::new();
    let mut found = false;
    for k in map.try_iter().into_iter().flatten() {
        if k.as_str() == Some(key) {
            entries.push((k, value.clone()));
            found = true;
        } else {
            let v = map.get_item(&k).unwrap_or_default();
            entries.push((k, v));
        }
    }
    if !found {
        entries.push((Value::from(key), value));
    }
    Value::from_iter(entries)
}

/// One message as vLLM passes it to the template.
pub(crate) fn prepare(message: &Message, format: ContentFormat) -> Result<Value, Refused> {
    let Some(role_str) = message.role.as_deref() else {
        return Err(Refused("message without a role"));
    };
    let role = Value::from(role_str);
    let mut content = content(message.content.as_ref(), format)?;
    let field = |v: &Option<&RawValue>| value(*v);
    let string = |v: &Option<Text>| v.as_ref().map_or(Ok(Value::UNDEFINED), text);
    let mut out: Vec<(&'static str, Value)> = Vec::with_capacity(6);
    match role_str {
        "assistant" => {
            out.push(("role", role));
            out.push(("content", content));
            let calls = field(&message.tool_calls)?;
            if calls.kind() == ValueKind::Seq && calls.len() != Some(0) {
                let calls: Vec<Value> = calls
                    .try_iter()
                    .into_iter()
                    .flatten()
                    .map(|c| tool_call(&c))
                    .collect();
                out.push(("tool_calls", Value::from(calls)));
            } else if present(&calls) && calls.kind() != ValueKind::Seq {
                out.push(("tool_calls", calls));
            }
            let reasoning = string(&message.reasoning)?;
            if present(&reasoning) {
                out.push(("reasoning", reasoning.clone()));
                out.push(("reasoning_content", reasoning));
            }
        }
        "tool" => {
            if content.kind() == ValueKind::Seq {
                let parts: Vec<Value> = content.try_iter().into_iter().flatten().collect();
                if parts
                    .iter()
                    .all(|p| get(p, "type").as_str() == Some("text"))
                {
                    let texts: Vec<Value> = parts.iter().map(|p| get(p, "text")).collect();
                    content = Value::from(join_texts(&texts));
                }
            }
            out.push(("role", role));
            out.push(("content", content));
            out.push(("tool_call_id", string(&message.tool_call_id)?));
        }
        _ => {
            out.push(("role", role));
            out.push(("content", content));
        }
    }
    let name = string(&message.name)?;
    if name.kind() == ValueKind::String {
        out.push(("name", name));
    }
    let task = string(&message.task)?;
    if task.kind() == ValueKind::String {
        out.push(("task", task));
    }
    if role_str == "developer" {
        out.push(("tools", field(&message.tools)?));
    }
    Ok(Value::from_object(Prepared(out)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(text: &str) -> Message<'_> {
        serde_json::from_str(text).unwrap()
    }

    #[test]
    fn detects_templates_that_loop_over_content() {
        assert_eq!(
            ContentFormat::detect("{{ message['content'] }}"),
            ContentFormat::String
        );
        assert_eq!(
            ContentFormat::detect(
                "{%- for part in message['content'] %}{{ part.text }}{% endfor %}"
            ),
            ContentFormat::OpenAi
        );
        assert_eq!(
            ContentFormat::detect("{% for c in message.content | selectattr('type') %}"),
            ContentFormat::OpenAi
        );
        assert_eq!(
            ContentFormat::detect("{% for m in messages %}"),
            ContentFormat::String
        );
    }

    #[test]
    fn content_and_tool_calls_as_vllm_passes_them() {
        let m = prepare(&v(r#"{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}],"extra":1}"#), ContentFormat::String).unwrap();
        assert_eq!(m.to_string(), r#"{"role": "user", "content": "a\nb"}"#);
        let m = prepare(
            &v(r#"{"role":"user","content":"hi"}"#),
            ContentFormat::OpenAi,
        )
        .unwrap();
        assert_eq!(
            get(&m, "content").to_string(),
            r#"[{"type": "text", "text": "hi"}]"#
        );
        let m = prepare(&v(r#"{"role":"assistant","content":null,"tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{\"z\":1,\"a\":2}"}}]}"#), ContentFormat::String).unwrap();
        let calls = get(&m, "tool_calls");
        let first = calls.get_item_by_index(0).unwrap();
        let args = get(&get(&first, "function"), "arguments");
        assert_eq!(args.to_string(), r#"{"z": 1, "a": 2}"#);
        assert_eq!(get(&m, "content").as_str(), Some(""));
        let bad = prepare(&v(r#"{"role":"assistant","tool_calls":[{"function":{"name":"f","arguments":"not json"}}]}"#), ContentFormat::String).unwrap();
        let first = get(&bad, "tool_calls").get_item_by_index(0).unwrap();
        assert_eq!(get(&get(&first, "function"), "arguments").to_string(), "{}");
    }

    #[test]
    fn an_image_is_a_marker_named_by_its_hash() {
        let image = |url: &str| {
            let m = format!(
                r#"{{"role":"user","content":[{{"type":"text","text":"look"}},{{"type":"image_url","image_url":{{"url":"{url}"}}}}]}}"#
            );
            get(&prepare(&v(&m), ContentFormat::String).unwrap(), "content").to_string()
        };
        let a = image("data:a");
        assert_eq!(
            a,
            format!("{}\nlook", media_marker("image", xxh3_64(b"data:a")))
        );
        assert_ne!(a, image("data:b"));
    }
}
