//! OpenAI-compatible request bodies → the prompt text an engine will see, in the engine's order.
//!
//! The text only has to be *prefix-stable*: two requests whose leading parts are equal (same tools,
//! same system prompt, same first turns) must produce texts with an equal leading part, so they
//! share their first chunk keys. It need not match the engine's chat template byte for byte.

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;

/// The two APIs kvroute routes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    Chat,
    Completions,
}

impl Api {
    /// The API served at `path` (query string ignored), if kvroute routes it.
    pub fn from_path(path: &str) -> Option<Api> {
        match path.split('?').next().unwrap_or(path) {
            "/v1/chat/completions" => Some(Api::Chat),
            "/v1/completions" => Some(Api::Completions),
            _ => None,
        }
    }
}

/// What kvroute needs from a request: the model (namespaces all keys) and the prompt text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prompt {
    pub model: String,
    pub text: String,
}

/// Why a body cannot be routed. Each reason is a counter, so these names are stable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParseError {
    Empty,
    BadUtf8,
    BadJson,
    NoModel,
    NoPrompt,
}

impl ParseError {
    pub fn reason(self) -> &'static str {
        match self {
            ParseError::Empty => "empty_body",
            ParseError::BadUtf8 => "bad_utf8",
            ParseError::BadJson => "bad_json",
            ParseError::NoModel => "no_model",
            ParseError::NoPrompt => "no_prompt",
        }
    }
}

// Separators that cannot appear unescaped in JSON strings' decoded text by accident often enough to
// matter; they keep "ab"+"c" and "a"+"bc" apart.
const FIELD: char = '\u{1f}';
const RECORD: char = '\u{1e}';

#[derive(Deserialize)]
struct ChatRequest<'a> {
    #[serde(borrow)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow)]
    messages: Option<Vec<Message<'a>>>,
    #[serde(borrow)]
    tools: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow)]
    role: Option<Cow<'a, str>>,
    #[serde(borrow)]
    content: Option<&'a RawValue>,
    #[serde(borrow)]
    name: Option<Cow<'a, str>>,
    #[serde(borrow)]
    tool_calls: Option<&'a RawValue>,
}

/// A content part: text parts contribute their text, others (images, audio) their JSON.
#[derive(Deserialize)]
struct Part<'a> {
    #[serde(borrow, rename = "type")]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow)]
    text: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct CompletionRequest<'a> {
    #[serde(borrow)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow)]
    prompt: Option<&'a RawValue>,
}

/// Parses a request body of `api` into its [`Prompt`].
pub fn parse(api: Api, body: &[u8]) -> Result<Prompt, ParseError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(ParseError::Empty);
    }
    let body = std::str::from_utf8(body).map_err(|_| ParseError::BadUtf8)?;
    match api {
        Api::Chat => parse_chat(body),
        Api::Completions => parse_completion(body),
    }
}

fn model(model: Option<Cow<'_, str>>) -> Result<String, ParseError> {
    match model {
        Some(m) if !m.is_empty() => Ok(m.into_owned()),
        _ => Err(ParseError::NoModel),
    }
}

fn parse_chat(body: &str) -> Result<Prompt, ParseError> {
    let req: ChatRequest = serde_json::from_str(body).map_err(|_| ParseError::BadJson)?;
    let model = model(req.model)?;
    let messages = req.messages.ok_or(ParseError::NoPrompt)?;
    let mut text = String::with_capacity(body.len());
    // Tools come first: chat templates render them into the system part, ahead of every message.
    if let Some(tools) = req.tools {
        text.push_str(tools.get());
        text.push(RECORD);
    }
    for m in &messages {
        text.push_str(m.role.as_deref().unwrap_or(""));
        text.push(FIELD);
        if let Some(name) = &m.name {
            text.push_str(name);
            text.push(FIELD);
        }
        if let Some(content) = m.content {
            push_content(&mut text, content)?;
        }
        if let Some(calls) = m.tool_calls {
            text.push(FIELD);
            text.push_str(calls.get());
        }
        text.push(RECORD);
    }
    Ok(Prompt { model, text })
}

/// Message content is a string, an array of parts (text parts contribute their text, others such as
/// images their JSON), or null.
fn push_content(text: &mut String, content: &RawValue) -> Result<(), ParseError> {
    let raw = content.get();
    match raw.as_bytes().first() {
        Some(b'"') => text.push_str(&json_string(raw)?),
        Some(b'[') => {
            let parts: Vec<&RawValue> =
                serde_json::from_str(raw).map_err(|_| ParseError::BadJson)?;
            for part in parts {
                let parsed: Part =
                    serde_json::from_str(part.get()).map_err(|_| ParseError::BadJson)?;
                match (parsed.kind.as_deref(), parsed.text) {
                    (Some("text") | None, Some(t)) => text.push_str(&t),
                    _ => text.push_str(part.get()),
                }
                text.push(FIELD);
            }
        }
        _ => text.push_str(raw),
    }
    Ok(())
}

/// Decodes a raw JSON string. The common case, no escapes, borrows the text between the quotes
/// without scanning it a second time.
fn json_string(raw: &str) -> Result<Cow<'_, str>, ParseError> {
    match raw.get(1..raw.len().saturating_sub(1)) {
        Some(inner) if !inner.contains('\\') => Ok(Cow::Borrowed(inner)),
        _ => serde_json::from_str(raw).map_err(|_| ParseError::BadJson),
    }
}

fn parse_completion(body: &str) -> Result<Prompt, ParseError> {
    let req: CompletionRequest = serde_json::from_str(body).map_err(|_| ParseError::BadJson)?;
    let model = model(req.model)?;
    let prompt = req.prompt.ok_or(ParseError::NoPrompt)?;
    let raw = prompt.get();
    let text = match raw.as_bytes().first() {
        Some(b'"') => json_string(raw)?.into_owned(),
        // A batch of strings, or token ids: equal leading elements give an equal leading text
        // because each element is closed by a separator.
        Some(b'[') => {
            let items: Vec<&RawValue> =
                serde_json::from_str(raw).map_err(|_| ParseError::BadJson)?;
            let mut text = String::with_capacity(raw.len());
            for item in items {
                match serde_json::from_str::<Cow<str>>(item.get()) {
                    Ok(s) => text.push_str(&s),
                    Err(_) => text.push_str(item.get()),
                }
                text.push(FIELD);
            }
            text
        }
        _ => return Err(ParseError::NoPrompt),
    };
    Ok(Prompt { model, text })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: &str) -> Result<Prompt, ParseError> {
        parse(Api::Chat, body.as_bytes())
    }

    #[test]
    fn paths_select_the_api_and_ignore_the_query() {
        assert_eq!(Api::from_path("/v1/chat/completions"), Some(Api::Chat));
        assert_eq!(
            Api::from_path("/v1/completions?x=1"),
            Some(Api::Completions)
        );
        assert_eq!(Api::from_path("/v1/models"), None);
        assert_eq!(Api::from_path("/v1/chat/completions/render"), None);
    }

    #[test]
    fn chat_requests_sharing_leading_messages_share_a_text_prefix() {
        let a = chat(r#"{"model":"m","messages":[{"role":"system","content":"You are kind."},{"role":"user","content":"Hi"}]}"#).unwrap();
        let b = chat(r#"{"model":"m","messages":[{"role":"system","content":"You are kind."},{"role":"user","content":"Bye"}]}"#).unwrap();
        let common = a
            .text
            .bytes()
            .zip(b.text.bytes())
            .take_while(|(x, y)| x == y)
            .count();
        assert!(a.text[..common].contains("You are kind."));
        assert_ne!(a.text, b.text);
        assert_eq!(a.model, "m");
    }

    #[test]
    fn text_parts_and_string_content_give_the_same_text_body() {
        let parts = chat(r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hello"},{"type":"image_url","image_url":{"url":"u"}}]}]}"#).unwrap();
        assert!(parts.text.contains("hello"));
        assert!(parts.text.contains("image_url"));
    }

    #[test]
    fn tools_come_before_messages() {
        let p = chat(r#"{"model":"m","tools":[{"type":"function","function":{"name":"f"}}],"messages":[{"role":"user","content":"x"}]}"#).unwrap();
        assert!(p.text.find("function").unwrap() < p.text.find("user").unwrap());
    }

    #[test]
    fn escaped_strings_are_decoded() {
        let p =
            chat(r#"{"model":"m","messages":[{"role":"user","content":"a\"b\u00e9"}]}"#).unwrap();
        assert!(p.text.contains("a\"bé"));
    }

    #[test]
    fn completions_accept_string_and_array_prompts() {
        let s = parse(Api::Completions, br#"{"model":"m","prompt":"once upon"}"#).unwrap();
        assert_eq!(s.text, "once upon");
        let a = parse(Api::Completions, br#"{"model":"m","prompt":["one","two"]}"#).unwrap();
        assert!(a.text.starts_with("one"));
        let t1 = parse(Api::Completions, br#"{"model":"m","prompt":[1,2,3]}"#).unwrap();
        let t2 = parse(Api::Completions, br#"{"model":"m","prompt":[1,2,4]}"#).unwrap();
        assert!(t2.text.starts_with(&t1.text[..4]));
    }

    #[test]
    fn bad_bodies_give_their_reason() {
        assert_eq!(chat(""), Err(ParseError::Empty));
        assert_eq!(
            parse(Api::Chat, b"{\"model\":\"\xff\"}"),
            Err(ParseError::BadUtf8)
        );
        assert_eq!(chat("not json"), Err(ParseError::BadJson));
        assert_eq!(chat(r#"{"messages":[]}"#), Err(ParseError::NoModel));
        assert_eq!(chat(r#"{"model":"m"}"#), Err(ParseError::NoPrompt));
        assert_eq!(
            chat(r#"{"model":"m","messages":"x"}"#),
            Err(ParseError::BadJson)
        );
        let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
        assert_eq!(
            chat(&format!(r#"{{"model":"m","messages":{deep}}}"#)),
            Err(ParseError::BadJson)
        );
        assert_eq!(
            parse(Api::Completions, br#"{"model":"m","prompt":5}"#),
            Err(ParseError::NoPrompt)
        );
    }
}
