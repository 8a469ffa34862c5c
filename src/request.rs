//! OpenAI-compatible request bodies → the prompt text an engine will see, in the engine's order.
//!
//! The text only has to be *prefix-stable*: two requests whose leading parts are equal (same tools,
//! same system prompt, same first turns) must produce texts with an equal leading part, so they
//! share their first chunk keys. It need not match the engine's chat template byte for byte.

use std::borrow::Cow;
use std::marker::PhantomData;

use serde::de::{self, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};
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
    /// Bytes of `text` that make the request's head: the tools and the system (or developer)
    /// messages that open a chat, or its first message when none does; a whole completion prompt.
    /// Requests of one group (one app, one document, one conversation) share it; it keys placement.
    pub head: usize,
    /// Whether earlier turns follow the head (a conversation past its first turn): only then is
    /// what follows the head cached somewhere already.
    pub history: bool,
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
    content: Option<Field<'a, Part<'a>>>,
    #[serde(borrow)]
    name: Option<Cow<'a, str>>,
    #[serde(borrow)]
    tool_calls: Option<&'a RawValue>,
}

/// A content part: text parts contribute their text, others (images, audio, files) their data.
#[derive(Deserialize)]
struct Part<'a> {
    #[serde(borrow, rename = "type")]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow)]
    text: Option<Cow<'a, str>>,
    #[serde(borrow)]
    image_url: Option<&'a RawValue>,
    #[serde(borrow)]
    input_audio: Option<&'a RawValue>,
    #[serde(borrow)]
    file: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct CompletionRequest<'a> {
    #[serde(borrow)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow)]
    prompt: Option<Field<'a, &'a RawValue>>,
}

/// A field that is a string or a list (message content, completion prompt). Deserialised in one
/// pass over the body: a string without escapes is borrowed, never scanned or copied again. This
/// is most of the bytes of a request, so it is most of kvroute's time.
enum Field<'a, T> {
    Text(Cow<'a, str>),
    List(Vec<T>),
    Other,
}

impl<'de: 'a, 'a, T: Deserialize<'de>> Deserialize<'de> for Field<'a, T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct FieldVisitor<'a, T>(PhantomData<(&'a (), T)>);

        impl<'de: 'a, 'a, T: Deserialize<'de>> Visitor<'de> for FieldVisitor<'a, T> {
            type Value = Field<'a, T>;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string or a list")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Field::Text(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Field::Text(Cow::Owned(v.to_string())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(Field::Text(Cow::Owned(v)))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut items = Vec::new();
                while let Some(item) = seq.next_element()? {
                    items.push(item);
                }
                Ok(Field::List(items))
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                IgnoredAny::deserialize(de::value::MapAccessDeserializer::new(map))?;
                Ok(Field::Other)
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(Field::Other)
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
                Ok(Field::Other)
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
                Ok(Field::Other)
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
                Ok(Field::Other)
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
                Ok(Field::Other)
            }
        }

        d.deserialize_any(FieldVisitor(PhantomData))
    }
}

/// Parses a request body of `api` into its [`Prompt`].
pub fn parse(api: Api, body: &[u8]) -> Result<Prompt, ParseError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(ParseError::Empty);
    }
    let prompt = match api {
        Api::Chat => parse_chat(body),
        Api::Completions => parse_completion(body),
    };
    // The parser checks UTF-8 as it goes; only a failure pays for telling bad UTF-8 from bad JSON.
    match prompt {
        Err(ParseError::BadJson) if std::str::from_utf8(body).is_err() => Err(ParseError::BadUtf8),
        other => other,
    }
}

fn model(model: Option<Cow<'_, str>>) -> Result<String, ParseError> {
    match model {
        Some(m) if !m.is_empty() => Ok(m.into_owned()),
        _ => Err(ParseError::NoModel),
    }
}

fn parse_chat(body: &[u8]) -> Result<Prompt, ParseError> {
    let req: ChatRequest = serde_json::from_slice(body).map_err(|_| ParseError::BadJson)?;
    let model = model(req.model)?;
    let messages = req.messages.ok_or(ParseError::NoPrompt)?;
    let mut text = String::with_capacity(body.len());
    // Tools come first: chat templates render them into the system part, ahead of every message.
    if let Some(tools) = req.tools {
        text.push_str(tools.get());
        text.push(RECORD);
    }
    // The head ends after the leading instructions, or after the first message if there are none.
    let lead = messages
        .iter()
        .take_while(|m| matches!(m.role.as_deref(), Some("system" | "developer")))
        .count()
        .max(1);
    let mut head = None;
    for (i, m) in messages.iter().enumerate() {
        text.push_str(m.role.as_deref().unwrap_or(""));
        text.push(FIELD);
        if let Some(name) = &m.name {
            text.push_str(name);
            text.push(FIELD);
        }
        match &m.content {
            Some(Field::Text(t)) => text.push_str(t),
            Some(Field::List(parts)) => parts.iter().for_each(|part| push_part(&mut text, part)),
            Some(Field::Other) | None => {}
        }
        if let Some(calls) = m.tool_calls {
            text.push(FIELD);
            text.push_str(calls.get());
        }
        text.push(RECORD);
        if i + 1 == lead {
            head = Some(text.len());
        }
    }
    let head = head.unwrap_or(text.len());
    let history = messages.len() > lead + 1;
    Ok(Prompt {
        model,
        text,
        head,
        history,
    })
}

fn push_part(text: &mut String, part: &Part) {
    text.push_str(part.kind.as_deref().unwrap_or(""));
    text.push(FIELD);
    if let Some(t) = &part.text {
        text.push_str(t);
    }
    for data in [part.image_url, part.input_audio, part.file]
        .into_iter()
        .flatten()
    {
        text.push_str(data.get());
    }
    text.push(FIELD);
}

fn parse_completion(body: &[u8]) -> Result<Prompt, ParseError> {
    let req: CompletionRequest = serde_json::from_slice(body).map_err(|_| ParseError::BadJson)?;
    let model = model(req.model)?;
    let text = match req.prompt.ok_or(ParseError::NoPrompt)? {
        Field::Text(t) => t.into_owned(),
        // A batch of strings, or token ids: equal leading elements give an equal leading text
        // because each element is closed by a separator.
        Field::List(items) => {
            let mut text = String::with_capacity(body.len());
            for item in items {
                match serde_json::from_str::<Cow<str>>(item.get()) {
                    Ok(s) => text.push_str(&s),
                    Err(_) => text.push_str(item.get()),
                }
                text.push(FIELD);
            }
            text
        }
        Field::Other => return Err(ParseError::NoPrompt),
    };
    let head = text.len();
    Ok(Prompt {
        model,
        text,
        head,
        history: false,
    })
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
    fn the_head_is_the_leading_instructions_or_else_the_first_message() {
        let with_system = chat(r#"{"model":"m","messages":[{"role":"system","content":"S1"},{"role":"developer","content":"S2"},{"role":"user","content":"question"}]}"#).unwrap();
        let head = &with_system.text[..with_system.head];
        assert!(head.contains("S1") && head.contains("S2") && !head.contains("question"));
        let later_turn = chat(r#"{"model":"m","messages":[{"role":"system","content":"S1"},{"role":"developer","content":"S2"},{"role":"user","content":"other"},{"role":"assistant","content":"a"},{"role":"user","content":"b"}]}"#).unwrap();
        assert_eq!(later_turn.text[..later_turn.head], *head);
        assert!(later_turn.history && !with_system.history);
        let no_system = chat(r#"{"model":"m","messages":[{"role":"user","content":"first"},{"role":"assistant","content":"reply"}]}"#).unwrap();
        let head = &no_system.text[..no_system.head];
        assert!(head.contains("first") && !head.contains("reply"));
        let completion = parse(Api::Completions, br#"{"model":"m","prompt":"all of it"}"#).unwrap();
        assert_eq!(completion.head, completion.text.len());
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
