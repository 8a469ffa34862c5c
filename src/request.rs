//! OpenAI-compatible request bodies → the prompt text an engine will see, in the engine's order.
//!
//! The text only has to be *prefix-stable* and *render-equivalent*: two requests whose rendered
//! prompts share a leading part (same system prompt, same tools, same first turns, same cache
//! salt) must produce texts with an equal leading part, so they share their first chunk keys; two
//! requests the engine renders alike must produce the same text. It need not match the engine's
//! chat template byte for byte. What chat templates do, and so what this follows:
//! - tools render next to the system prompt (where exactly is [`ToolsAt`], a config choice);
//! - a message's role and content render, its `name` and a tool result's `tool_call_id` do not,
//!   and of an assistant's `tool_calls` only each function's name and arguments;
//! - content given as a list of parts renders like the same text as one string (text parts
//!   joined by a newline, as vLLM joins them for string-content templates);
//! - an image (audio, file) becomes placeholder tokens, a fixed number per image, which the
//!   engine's cache tells apart by a hash of the image: here [`MEDIA_BYTES`] bytes naming that
//!   hash, not the image's base64 (which would use up `max_chunks` and outweigh the text);
//! - vLLM's `cache_salt` isolates tenants: it is returned apart from the text and seeds the keys.

use std::borrow::Cow;
use std::marker::PhantomData;

use serde::de::{self, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};
use serde_json::value::RawValue;
use strum::{EnumString, VariantNames};
use xxhash_rust::xxh3::xxh3_64;

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

/// Where the model's chat template renders the tool list (config `tools_position`, by its
/// snake_case name). The rest of the order is common to the templates in use: system prompt
/// first, then the turns in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, EnumString, VariantNames)]
#[strum(serialize_all = "snake_case")]
pub enum ToolsAt {
    /// After the system prompt, before the first turn: Qwen 2.5/3 (tools appended to the system
    /// message), Llama 3.1–3.3 (tools in the first user turn, after the system message),
    /// DeepSeek V3.1, gpt-oss (harmony: developer instructions, then tools), Granite 3.
    #[default]
    AfterSystem,
    /// Before the system prompt: templates that open with a tool-calling preamble and render the
    /// caller's system message after it (Hermes 2 Pro / Hermes 3 style).
    BeforeSystem,
    /// Just before the last user message: Mistral's templates (`[AVAILABLE_TOOLS]`). Tools then
    /// move with every turn, so they are never part of a request's head.
    BeforeLastUser,
}

/// What kvroute needs from a request: the model (namespaces all keys) and the prompt text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prompt {
    pub model: String,
    /// The rendered prompt, as bytes: it is only hashed. UTF-8 as a client sends it, but for a
    /// lone surrogate it escaped (`\ud800`), which stays in it as the three bytes JSON parsers give
    /// it (WTF-8), and for invalid UTF-8 it sent raw, kept as sent (its engine refuses it).
    pub text: Vec<u8>,
    /// Bytes of `text` that make the request's head: the tools and the system (or developer)
    /// messages that open a chat, or its first message when there are neither; a whole completion
    /// prompt. Requests of one group (one app, one document, one conversation) share it; it keys
    /// placement.
    pub head: usize,
    /// Bytes of `text` of the first message after the head (empty when there is none): what
    /// opens the conversation, the same in all its later turns.
    pub opener: std::ops::Range<usize>,
    /// Whether earlier turns follow the head (more than one message after the head's own): only
    /// then is what follows the head cached somewhere already.
    pub history: bool,
    /// vLLM's `cache_salt`: the engine shares no cached block between different salts, so it
    /// seeds the keys ([`PrefixKeys::salted`](crate::prefix::PrefixKeys::salted)).
    pub salt: Option<String>,
    /// Whether the response will say what the engine used (`usage`): a whole response always
    /// does; a stream only when it asks (`stream_options.include_usage`), as OpenAI servers
    /// and vLLM stream it.
    pub usage: bool,
    /// Whether the response streams (`stream: true`): its first body byte comes with the first
    /// token, when the prompt's prefill is done.
    pub streams: bool,
}

/// Why a body cannot be routed (each is a [`Fallback`](crate::router::Fallback), and counted as one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParseError {
    Empty,
    BadJson,
    NoModel,
    NoPrompt,
}

// Separators that cannot appear unescaped in JSON strings' decoded text by accident often enough to
// matter; they keep "ab"+"c" and "a"+"bc" apart.
const FIELD: u8 = 0x1f;
const RECORD: u8 = 0x1e;
/// Opens a media placeholder: `MEDIA` kind, then the media's hash in hex, repeated to
/// [`MEDIA_BYTES`].
const MEDIA: u8 = 0x1d;
/// What an image weighs in the text: about the text of the few hundred tokens an engine spends on
/// one (Qwen2-VL: 256 for 448×448 pixels, more for larger ones), so an image's share of a prompt's
/// keys is of the order of its share of the engine's tokens.
pub const MEDIA_BYTES: usize = 1024;
/// Joins content parts, as vLLM joins text parts for string-content templates.
const PART_JOIN: u8 = b'\n';

/// A chat request body, read in one pass by both renderings: the built-in one here and a chat
/// template's ([`crate::template`]). The fields only a template reads are kept as their JSON text
/// and read when one is rendered, so a body's shape is judged alike with or without a template.
#[derive(Deserialize)]
pub(crate) struct ChatRequest<'a> {
    #[serde(borrow)]
    pub model: Option<Cow<'a, str>>,
    #[serde(borrow)]
    pub messages: Option<Vec<Message<'a>>>,
    #[serde(borrow)]
    pub tools: Option<&'a RawValue>,
    #[serde(borrow)]
    pub documents: Option<&'a RawValue>,
    #[serde(borrow)]
    pub add_generation_prompt: Option<&'a RawValue>,
    #[serde(borrow)]
    pub continue_final_message: Option<&'a RawValue>,
    #[serde(borrow)]
    pub chat_template_kwargs: Option<&'a RawValue>,
    #[serde(borrow)]
    pub cache_salt: Option<&'a RawValue>,
    #[serde(borrow)]
    pub stream: Option<&'a RawValue>,
    #[serde(borrow)]
    pub stream_options: Option<&'a RawValue>,
}

/// A message: its role and content typed (the bulk of a body, read once), the rest as JSON text.
#[derive(Deserialize)]
pub(crate) struct Message<'a> {
    #[serde(borrow)]
    pub role: Option<Cow<'a, str>>,
    #[serde(borrow)]
    pub content: Option<Field<'a, Part<'a>>>,
    /// A list of calls; of each, the built-in rendering keeps the function's name and arguments
    /// ([`ToolCall`]), a template gets all of it.
    #[serde(borrow)]
    pub tool_calls: Option<&'a RawValue>,
    #[serde(borrow)]
    pub reasoning: Option<Text<'a>>,
    #[serde(borrow)]
    pub name: Option<Text<'a>>,
    #[serde(borrow)]
    pub tool_call_id: Option<Text<'a>>,
    #[serde(borrow)]
    pub task: Option<Text<'a>>,
    #[serde(borrow)]
    pub tools: Option<&'a RawValue>,
}

/// Of a tool call, templates render the function's name and arguments, not the call's id.
#[derive(Deserialize)]
struct ToolCall<'a> {
    #[serde(borrow)]
    function: Option<Function<'a>>,
}

#[derive(Deserialize)]
struct Function<'a> {
    #[serde(borrow)]
    name: Option<Cow<'a, str>>,
    #[serde(borrow)]
    arguments: Option<&'a RawValue>,
}

/// A content part: text parts contribute their text, others (images, audio, files) the hash of
/// their data. The fields only a template reads (its `type`, other texts and media) are JSON text.
#[derive(Deserialize)]
pub(crate) struct Part<'a> {
    #[serde(borrow, rename = "type")]
    pub kind: Option<&'a RawValue>,
    #[serde(borrow)]
    pub text: Option<Text<'a>>,
    #[serde(borrow)]
    pub image_url: Option<Media<'a>>,
    #[serde(borrow)]
    pub input_audio: Option<Media<'a>>,
    #[serde(borrow)]
    pub video_url: Option<Media<'a>>,
    #[serde(borrow)]
    pub file: Option<Media<'a>>,
    #[serde(borrow)]
    pub refusal: Option<&'a RawValue>,
    #[serde(borrow)]
    pub thinking: Option<&'a RawValue>,
    #[serde(borrow)]
    pub image_embeds: Option<&'a RawValue>,
    #[serde(borrow)]
    pub image_pil: Option<&'a RawValue>,
    #[serde(borrow)]
    pub audio_url: Option<&'a RawValue>,
    #[serde(borrow)]
    pub audio_embeds: Option<&'a RawValue>,
}

/// A media reference: `{"url": ...}` is keyed by its URL alone (a `detail` hint does not change
/// the image); any other shape by its JSON text (`raw`).
pub(crate) struct Media<'a> {
    pub key: Cow<'a, [u8]>,
    /// Its URL, when it is `{"url": "..."}`.
    pub url: bool,
    pub raw: &'a RawValue,
}

impl<'de: 'a, 'a> Deserialize<'de> for Media<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        struct Url<'a> {
            #[serde(borrow)]
            url: Text<'a>,
        }
        let raw: &'de RawValue = Deserialize::deserialize(d)?;
        Ok(match serde_json::from_str::<Url>(raw.get()) {
            Ok(u) => Media {
                key: u.url.0,
                url: true,
                raw,
            },
            Err(_) => Media {
                key: Cow::Borrowed(raw.get().as_bytes()),
                url: false,
                raw,
            },
        })
    }
}

#[derive(Deserialize)]
struct CompletionRequest<'a> {
    #[serde(borrow)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow)]
    prompt: Option<Field<'a, &'a RawValue>>,
    #[serde(borrow)]
    cache_salt: Option<&'a RawValue>,
    #[serde(borrow)]
    stream: Option<&'a RawValue>,
    #[serde(borrow)]
    stream_options: Option<&'a RawValue>,
}

/// A JSON string's text, as its bytes. serde_json hands a string over as bytes after a SIMD search
/// for its closing quote (`memchr`, 16 bytes a step in wasm), where a `str` costs a scan of 8
/// bytes a step for control characters too, and no UTF-8 check (the bytes are only hashed).
/// This is most of the bytes of a request, so it is most of kvroute's time. A string without
/// escapes is borrowed, never copied.
pub(crate) struct Text<'a>(pub Cow<'a, [u8]>);

struct TextVisitor;

impl<'de> Visitor<'de> for TextVisitor {
    type Value = Text<'de>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a string")
    }
    fn visit_borrowed_bytes<E: de::Error>(self, v: &'de [u8]) -> Result<Self::Value, E> {
        Ok(Text(Cow::Borrowed(v)))
    }
    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Self::Value, E> {
        Ok(Text(Cow::Owned(v.to_vec())))
    }
    fn visit_byte_buf<E: de::Error>(self, v: Vec<u8>) -> Result<Self::Value, E> {
        Ok(Text(Cow::Owned(v)))
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Text<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_bytes(TextVisitor)
    }
}

/// A field that is a string or a list (message content, completion prompt), read in one pass over
/// the body. Anything else is not an OpenAI request (`bad_json`).
pub(crate) enum Field<'a, T> {
    Text(Text<'a>),
    List(Vec<T>),
}

impl<'de: 'a, 'a, T: Deserialize<'de>> Deserialize<'de> for Field<'a, T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct FieldVisitor<'a, T>(PhantomData<(&'a (), T)>);

        impl<'de: 'a, 'a, T: Deserialize<'de>> Visitor<'de> for FieldVisitor<'a, T> {
            type Value = Field<'a, T>;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string or a list")
            }
            fn visit_borrowed_bytes<E: de::Error>(self, v: &'de [u8]) -> Result<Self::Value, E> {
                TextVisitor.visit_borrowed_bytes(v).map(Field::Text)
            }
            fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Self::Value, E> {
                TextVisitor.visit_bytes(v).map(Field::Text)
            }
            fn visit_byte_buf<E: de::Error>(self, v: Vec<u8>) -> Result<Self::Value, E> {
                TextVisitor.visit_byte_buf(v).map(Field::Text)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut items = Vec::new();
                while let Some(item) = seq.next_element()? {
                    items.push(item);
                }
                Ok(Field::List(items))
            }
        }

        d.deserialize_bytes(FieldVisitor(PhantomData))
    }
}

/// Parses a request body of `api` into its [`Prompt`], tools where most templates put them.
pub fn parse(api: Api, body: &[u8]) -> Result<Prompt, ParseError> {
    parse_with(api, body, ToolsAt::default())
}

/// Parses a request body of `api` into its [`Prompt`], tools rendered at `tools`.
pub fn parse_with(api: Api, body: &[u8], tools: ToolsAt) -> Result<Prompt, ParseError> {
    match api {
        Api::Chat => render_chat(&read_chat(body)?, tools),
        Api::Completions => parse_completion(body),
    }
}

fn not_empty(body: &[u8]) -> Result<(), ParseError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(ParseError::Empty);
    }
    Ok(())
}

/// Reads a chat request body into the one shape both renderings read.
///
/// The strings kvroute keeps are taken as bytes ([`Text`]) and never checked for UTF-8: an
/// engine refuses a body that is not, and hashing its bytes costs no pass over the body. The
/// fields read as `str` (model, roles, names) are checked by the parser.
pub(crate) fn read_chat(body: &[u8]) -> Result<ChatRequest<'_>, ParseError> {
    not_empty(body)?;
    serde_json::from_slice(body).map_err(|_| ParseError::BadJson)
}

impl Message<'_> {
    /// About the bytes it renders to, to size the text once.
    pub(crate) fn size(&self) -> usize {
        let content = match &self.content {
            Some(Field::Text(t)) => t.0.len(),
            Some(Field::List(parts)) => parts.len() * MEDIA_BYTES,
            None => 0,
        };
        content + self.tool_calls.map_or(0, |c| c.get().len()) + 16
    }
}

impl<'a> ChatRequest<'a> {
    /// The model the request names (all its keys are namespaced by it).
    pub(crate) fn model(&self) -> Result<String, ParseError> {
        model(self.model.clone())
    }

    /// Its messages, which a chat request must have.
    pub(crate) fn messages(&self) -> Result<&[Message<'a>], ParseError> {
        self.messages.as_deref().ok_or(ParseError::NoPrompt)
    }

    /// vLLM's `cache_salt` (see [`Prompt::salt`]).
    pub(crate) fn salt(&self) -> Option<String> {
        salt(self.cache_salt)
    }

    /// Whether the response will report `usage` (see [`Prompt::usage`]).
    pub(crate) fn usage(&self) -> bool {
        reports_usage(self.stream, self.stream_options)
    }

    /// Whether the response streams (see [`Prompt::streams`]).
    pub(crate) fn streams(&self) -> bool {
        streams(self.stream)
    }
}

fn model(model: Option<Cow<'_, str>>) -> Result<String, ParseError> {
    match model {
        Some(m) if !m.is_empty() => Ok(m.into_owned()),
        _ => Err(ParseError::NoModel),
    }
}

/// vLLM refuses a salt that is not a non-empty string; such a request is not worth keying apart.
pub(crate) fn salt(salt: Option<&RawValue>) -> Option<String> {
    salt.and_then(|s| serde_json::from_str::<Cow<str>>(s.get()).ok())
        .filter(|s| !s.is_empty())
        .map(Cow::into_owned)
}

/// Whether a request's response streams (see [`Prompt::streams`]).
pub(crate) fn streams(stream: Option<&RawValue>) -> bool {
    stream.map(RawValue::get) == Some("true")
}

/// Whether a request's response carries `usage` (see [`Prompt::usage`]). Read leniently: a
/// `stream` or `stream_options` of another shape is the engine's to refuse, not a parse error.
pub(crate) fn reports_usage(stream: Option<&RawValue>, options: Option<&RawValue>) -> bool {
    #[derive(Deserialize)]
    struct Options {
        include_usage: Option<bool>,
    }
    if !streams(stream) {
        return true;
    }
    options
        .and_then(|o| serde_json::from_str::<Options>(o.get()).ok())
        .and_then(|o| o.include_usage)
        == Some(true)
}

/// One rendered piece of a chat, in the template's order.
#[derive(Clone, Copy, PartialEq)]
enum Item {
    Tools,
    Message(usize),
}

/// The built-in rendering of a chat request (see the module's doc).
pub(crate) fn render_chat(req: &ChatRequest, tools_at: ToolsAt) -> Result<Prompt, ParseError> {
    let model = req.model()?;
    let messages = req.messages()?;
    let salt = req.salt();
    let usage = req.usage();
    let streams = req.streams();
    let lead = messages
        .iter()
        .take_while(|m| matches!(m.role.as_deref(), Some("system" | "developer")))
        .count();
    let mut items: Vec<Item> = (0..messages.len()).map(Item::Message).collect();
    let tools = req.tools.filter(|t| !matches!(t.get(), "null" | "[]"));
    if tools.is_some() {
        let at = match tools_at {
            ToolsAt::AfterSystem => lead,
            ToolsAt::BeforeSystem => 0,
            ToolsAt::BeforeLastUser => messages
                .iter()
                .rposition(|m| m.role.as_deref() == Some("user"))
                .unwrap_or(messages.len()),
        };
        items.insert(at, Item::Tools);
    }
    // The head: the leading instructions, with the tools when they render beside them; else the
    // first message.
    let in_head = |item: &Item| match item {
        Item::Tools => tools_at != ToolsAt::BeforeLastUser,
        Item::Message(i) => *i < lead,
    };
    let head_items = match items.iter().take_while(|i| in_head(i)).count() {
        0 => 1,
        n => n,
    };
    let head_messages = items[..head_items.min(items.len())]
        .iter()
        .filter(|i| matches!(i, Item::Message(_)))
        .count();
    let mut text = Vec::with_capacity(
        req.tools.map_or(0, |t| t.get().len()) + messages.iter().map(Message::size).sum::<usize>(),
    );
    let (mut head, mut opener) = (None, None);
    for (n, item) in items.iter().enumerate() {
        match *item {
            Item::Tools => {
                if let Some(tools) = tools {
                    text.extend_from_slice(tools.get().as_bytes());
                    text.push(RECORD);
                }
            }
            Item::Message(i) => {
                let start = text.len();
                push_message(&mut text, &messages[i])?;
                if n >= head_items && opener.is_none() {
                    opener = Some(start..text.len());
                }
            }
        }
        if n + 1 == head_items {
            head = Some(text.len());
        }
    }
    let head = head.unwrap_or(text.len());
    let opener = opener.unwrap_or(head..head);
    let history = messages.len().saturating_sub(head_messages) > 1;
    Ok(Prompt {
        model,
        text,
        head,
        opener,
        history,
        salt,
        usage,
        streams,
    })
}

fn push_message(text: &mut Vec<u8>, m: &Message) -> Result<(), ParseError> {
    // A developer message is the system prompt of newer APIs; templates render it as one.
    let role = match m.role.as_deref() {
        Some("developer") => "system",
        Some(role) => role,
        None => "",
    };
    text.extend_from_slice(role.as_bytes());
    text.push(FIELD);
    match &m.content {
        Some(Field::Text(t)) => text.extend_from_slice(&t.0),
        Some(Field::List(parts)) => {
            for (i, part) in parts.iter().enumerate() {
                if i > 0 {
                    text.push(PART_JOIN);
                }
                push_part(text, part);
            }
        }
        None => {}
    }
    let calls: Option<Vec<ToolCall>> = m
        .tool_calls
        .map(|c| serde_json::from_str(c.get()))
        .transpose()
        .map_err(|_| ParseError::BadJson)?;
    for call in calls.iter().flatten() {
        text.push(FIELD);
        if let Some(f) = &call.function {
            text.extend_from_slice(f.name.as_deref().unwrap_or("").as_bytes());
            text.push(FIELD);
            text.extend_from_slice(f.arguments.map_or("", RawValue::get).as_bytes());
        }
    }
    text.push(RECORD);
    Ok(())
}

fn push_part(text: &mut Vec<u8>, part: &Part) {
    if let Some(t) = &part.text {
        text.extend_from_slice(&t.0);
    }
    let media = [
        ("image", &part.image_url),
        ("audio", &part.input_audio),
        ("video", &part.video_url),
        ("file", &part.file),
    ];
    for (kind, data) in media {
        if let Some(Media { key: data, .. }) = data {
            // The engine caches an image by its hash and spends a fixed number of tokens on it;
            // its base64 length says nothing about either.
            let start = text.len();
            text.push(MEDIA);
            text.extend_from_slice(kind.as_bytes());
            let hash = format!("{:016x}", xxh3_64(data));
            while text.len() - start < MEDIA_BYTES {
                text.extend_from_slice(hash.as_bytes());
            }
            text.truncate(start + MEDIA_BYTES);
        }
    }
}

fn parse_completion(body: &[u8]) -> Result<Prompt, ParseError> {
    not_empty(body)?;
    let req: CompletionRequest = serde_json::from_slice(body).map_err(|_| ParseError::BadJson)?;
    let model = model(req.model)?;
    let salt = salt(req.cache_salt);
    let usage = reports_usage(req.stream, req.stream_options);
    let streams = streams(req.stream);
    let text = match req.prompt.ok_or(ParseError::NoPrompt)? {
        Field::Text(t) => t.0.into_owned(),
        // A batch of strings, or token ids: equal leading elements give an equal leading text
        // because each element is closed by a separator.
        Field::List(items) => {
            let mut text = Vec::with_capacity(body.len());
            for item in items {
                match serde_json::from_str::<Text>(item.get()) {
                    Ok(s) => text.extend_from_slice(&s.0),
                    Err(_) => text.extend_from_slice(item.get().as_bytes()),
                }
                text.push(FIELD);
            }
            text
        }
    };
    let head = text.len();
    Ok(Prompt {
        model,
        text,
        head,
        opener: head..head,
        history: false,
        salt,
        usage,
        streams,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: &str) -> Result<Prompt, ParseError> {
        parse(Api::Chat, body.as_bytes())
    }

    impl Prompt {
        /// The text as a string, for the tests' searches (their prompts are UTF-8).
        fn text(&self) -> &str {
            std::str::from_utf8(&self.text).expect("UTF-8 text")
        }
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
            .text()
            .bytes()
            .zip(b.text().bytes())
            .take_while(|(x, y)| x == y)
            .count();
        assert!(a.text()[..common].contains("You are kind."));
        assert_ne!(a.text(), b.text());
        assert_eq!(a.model, "m");
    }

    #[test]
    fn the_head_is_the_leading_instructions_or_else_the_first_message() {
        let with_system = chat(r#"{"model":"m","messages":[{"role":"system","content":"S1"},{"role":"developer","content":"S2"},{"role":"user","content":"question"}]}"#).unwrap();
        let head = &with_system.text()[..with_system.head];
        assert!(head.contains("S1") && head.contains("S2") && !head.contains("question"));
        let later_turn = chat(r#"{"model":"m","messages":[{"role":"system","content":"S1"},{"role":"developer","content":"S2"},{"role":"user","content":"other"},{"role":"assistant","content":"a"},{"role":"user","content":"b"}]}"#).unwrap();
        assert_eq!(later_turn.text()[..later_turn.head], *head);
        assert!(later_turn.history && !with_system.history);
        let no_system = chat(r#"{"model":"m","messages":[{"role":"user","content":"first"},{"role":"assistant","content":"reply"}]}"#).unwrap();
        let head = &no_system.text()[..no_system.head];
        assert!(head.contains("first") && !head.contains("reply"));
        let completion = parse(Api::Completions, br#"{"model":"m","prompt":"all of it"}"#).unwrap();
        assert_eq!(completion.head, completion.text().len());
    }

    #[test]
    fn text_parts_and_string_content_give_the_same_text_body() {
        let string =
            chat(r#"{"model":"m","messages":[{"role":"user","content":"hello\nworld"}]}"#).unwrap();
        let one = chat(r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hello\nworld"}]}]}"#).unwrap();
        let two = chat(r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hello"},{"type":"text","text":"world"}]}]}"#).unwrap();
        assert_eq!(one.text(), string.text());
        assert_eq!(
            two.text(),
            string.text(),
            "text parts join like vLLM joins them"
        );
    }

    fn image(url: &str) -> String {
        format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"text","text":"look"}},{{"type":"image_url","image_url":{{"url":"{url}","detail":"high"}}}}]}}]}}"#
        )
    }

    #[test]
    fn an_image_costs_a_few_bytes_named_by_its_hash() {
        let small = chat(&image("data:image/png;base64,AAAA")).unwrap();
        let big = chat(&image(&format!(
            "data:image/png;base64,{}",
            "B".repeat(200_000)
        )))
        .unwrap();
        let other = chat(&image("data:image/png;base64,AAAB")).unwrap();
        assert_eq!(
            small.text().len(),
            big.text().len(),
            "cost does not grow with the image"
        );
        assert!(big.text().len() < MEDIA_BYTES + 32, "{}", big.text().len());
        assert_ne!(
            small.text(),
            other.text(),
            "different images are different prompts"
        );
        assert_eq!(
            small.text(),
            chat(&image("data:image/png;base64,AAAA")).unwrap().text()
        );
        assert!(
            !small.text().contains("AAAA"),
            "the image's data is hashed, not copied"
        );
    }

    #[test]
    fn tools_render_after_the_system_prompt_by_default_and_where_configured() {
        let body = |tools: &str, system: &str| {
            format!(
                r#"{{"model":"m","tools":[{{"type":"function","function":{{"name":"{tools}"}}}}],"messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"x"}},{{"role":"assistant","content":"y"}},{{"role":"user","content":"z"}}]}}"#
            )
        };
        let p = chat(&body("TOOL", "SYS")).unwrap();
        let (sys, tool, user) = (
            p.text().find("SYS").unwrap(),
            p.text().find("TOOL").unwrap(),
            p.text().find("x").unwrap(),
        );
        assert!(sys < tool && tool < user, "{:?}", p.text());
        assert!(p.text()[..p.head].contains("SYS") && p.text()[..p.head].contains("TOOL"));
        assert!(!p.text()[..p.head].contains('x'));
        let before = parse_with(
            Api::Chat,
            body("TOOL", "SYS").as_bytes(),
            ToolsAt::BeforeSystem,
        )
        .unwrap();
        assert!(before.text().find("TOOL") < before.text().find("SYS"));
        assert_eq!(before.head, p.head);
        let last = parse_with(
            Api::Chat,
            body("TOOL", "SYS").as_bytes(),
            ToolsAt::BeforeLastUser,
        )
        .unwrap();
        let tool = last.text().find("TOOL").unwrap();
        assert!(last.text().find('y').unwrap() < tool && tool < last.text().find('z').unwrap());
        assert!(
            !last.text()[..last.head].contains("TOOL"),
            "tools that move are not the head"
        );
        // Same system prompt, other tools: the system prompt is a shared prefix.
        let other_tools = chat(&body("OTHER", "SYS")).unwrap();
        assert!(other_tools.text().starts_with(&p.text()[..sys + 3]));
    }

    #[test]
    fn tool_calls_and_results_render_as_templates_do() {
        let step = |call_id: &str, name: &str| {
            format!(
                r#"{{"model":"m","messages":[{{"role":"user","content":"go","name":"{name}"}},{{"role":"assistant","content":null,"tool_calls":[{{"id":"{call_id}","type":"function","function":{{"name":"search","arguments":"{{\"q\":1}}"}}}}]}},{{"role":"tool","tool_call_id":"{call_id}","content":"RESULT"}}]}}"#
            )
        };
        let a = chat(&step("call_1", "ann")).unwrap();
        let b = chat(&step("call_2", "bob")).unwrap();
        assert_eq!(a.text(), b.text(), "call ids and names do not render");
        assert!(a.text().contains("search") && a.text().contains(r#"{\"q\":1}"#));
        assert!(a.text().find("search") < a.text().find("RESULT"));
        assert!(a.history, "a tool result after a call is history");
    }

    #[test]
    fn every_turn_of_a_conversation_has_the_same_opener() {
        let turn1 = chat(r#"{"model":"m","messages":[{"role":"system","content":"S"},{"role":"user","content":"q1"}]}"#).unwrap();
        let turn2 = chat(r#"{"model":"m","messages":[{"role":"system","content":"S"},{"role":"user","content":"q1"},{"role":"assistant","content":"a1"},{"role":"user","content":"q2"}]}"#).unwrap();
        let other = chat(r#"{"model":"m","messages":[{"role":"system","content":"S"},{"role":"user","content":"q9"}]}"#).unwrap();
        let opener = |p: &Prompt| p.text()[p.opener.clone()].to_string();
        assert!(opener(&turn1).contains("q1") && !opener(&turn2).contains("a1"));
        assert_eq!(opener(&turn1), opener(&turn2));
        assert_ne!(opener(&turn1), opener(&other));
        // Tools rendered before the last user message are not what opens the conversation.
        let tools = r#""tools":[{"type":"function","function":{"name":"f"}}]"#;
        let with_tools = |messages: &str| {
            let body = format!(r#"{{"model":"m",{tools},"messages":[{messages}]}}"#);
            parse_with(Api::Chat, body.as_bytes(), ToolsAt::BeforeLastUser).unwrap()
        };
        let t1 = with_tools(r#"{"role":"system","content":"S"},{"role":"user","content":"q1"}"#);
        let t2 = with_tools(
            r#"{"role":"system","content":"S"},{"role":"user","content":"q1"},{"role":"assistant","content":"a1"},{"role":"user","content":"q2"}"#,
        );
        assert_eq!(opener(&t1), opener(&t2));
        let completion = parse_with(
            Api::Completions,
            br#"{"model":"m","prompt":"p"}"#,
            ToolsAt::default(),
        )
        .unwrap();
        assert!(completion.opener.is_empty());
    }

    #[test]
    fn tools_without_a_system_prompt_are_the_head() {
        let first = chat(r#"{"model":"m","tools":[{"type":"function","function":{"name":"f"}}],"messages":[{"role":"user","content":"task"}]}"#).unwrap();
        assert!(
            first.text()[..first.head].contains('f')
                && !first.text()[..first.head].contains("task")
        );
        assert!(!first.history);
        let step = chat(r#"{"model":"m","tools":[{"type":"function","function":{"name":"f"}}],"messages":[{"role":"user","content":"task"},{"role":"assistant","tool_calls":[{"function":{"name":"f","arguments":"{}"}}]},{"role":"tool","content":"r"}]}"#).unwrap();
        assert_eq!(step.text()[..step.head], first.text()[..first.head]);
        assert!(step.history);
    }

    #[test]
    fn the_cache_salt_is_kept_apart_from_the_text() {
        let salted = chat(
            r#"{"model":"m","cache_salt":"tenant-a","messages":[{"role":"user","content":"x"}]}"#,
        )
        .unwrap();
        let plain = chat(r#"{"model":"m","messages":[{"role":"user","content":"x"}]}"#).unwrap();
        assert_eq!(salted.salt.as_deref(), Some("tenant-a"));
        assert_eq!(salted.text(), plain.text());
        assert_eq!(plain.salt, None);
        let empty =
            chat(r#"{"model":"m","cache_salt":"","messages":[{"role":"user","content":"x"}]}"#)
                .unwrap();
        assert_eq!(empty.salt, None);
        let odd = chat(
            r#"{"model":"m","cache_salt":{"a":1},"messages":[{"role":"user","content":"x"}]}"#,
        )
        .unwrap();
        assert_eq!(odd.salt, None);
        let completion = parse(
            Api::Completions,
            br#"{"model":"m","prompt":"p","cache_salt":"t"}"#,
        )
        .unwrap();
        assert_eq!(completion.salt.as_deref(), Some("t"));
    }

    #[test]
    fn escaped_strings_are_decoded() {
        let p =
            chat(r#"{"model":"m","messages":[{"role":"user","content":"a\"b\u00e9"}]}"#).unwrap();
        assert!(p.text().contains("a\"bé"));
    }

    #[test]
    fn completions_accept_string_and_array_prompts() {
        let s = parse(Api::Completions, br#"{"model":"m","prompt":"once upon"}"#).unwrap();
        assert_eq!(s.text(), "once upon");
        let a = parse(Api::Completions, br#"{"model":"m","prompt":["one","two"]}"#).unwrap();
        assert!(a.text().starts_with("one"));
        let t1 = parse(Api::Completions, br#"{"model":"m","prompt":[1,2,3]}"#).unwrap();
        let t2 = parse(Api::Completions, br#"{"model":"m","prompt":[1,2,4]}"#).unwrap();
        assert!(t2.text().starts_with(&t1.text()[..4]));
    }

    #[test]
    fn a_stream_reports_usage_only_when_it_asks() {
        let usage = |extra: &str| {
            chat(&format!(
                r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}}]{extra}}}"#
            ))
            .unwrap()
            .usage
        };
        assert!(usage(""));
        assert!(usage(r#","stream":false"#));
        assert!(!usage(r#","stream":true"#));
        assert!(!usage(
            r#","stream":true,"stream_options":{"include_usage":false}"#
        ));
        assert!(usage(
            r#","stream":true,"stream_options":{"include_usage":true}"#
        ));
        // Shapes the engine refuses are not kvroute's parse errors.
        assert!(usage(r#","stream":"yes""#));
        assert!(!usage(r#","stream":true,"stream_options":"x""#));
        let completion = |body: &[u8]| parse(Api::Completions, body).unwrap().usage;
        assert!(completion(br#"{"model":"m","prompt":"p"}"#));
        assert!(!completion(br#"{"model":"m","prompt":"p","stream":true}"#));
    }

    #[test]
    fn bad_bodies_give_their_reason() {
        assert_eq!(chat(""), Err(ParseError::Empty));
        // Invalid UTF-8 in a field kvroute reads as text (the model, a role) is no JSON string.
        assert_eq!(
            parse(Api::Chat, b"{\"model\":\"\xff\"}"),
            Err(ParseError::BadJson)
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
        // Content or a prompt that is neither a string nor a list is no OpenAI request.
        assert_eq!(
            parse(Api::Completions, br#"{"model":"m","prompt":5}"#),
            Err(ParseError::BadJson)
        );
        assert_eq!(
            chat(r#"{"model":"m","messages":[{"role":"user","content":{"a":1}}]}"#),
            Err(ParseError::BadJson)
        );
    }

    #[test]
    fn invalid_utf8_in_content_is_hashed_as_its_bytes() {
        // The engine refuses such a body; kvroute does not pay a pass over every body to say so.
        let content = parse(
            Api::Chat,
            b"{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"a\xff\xfeb\"}]}",
        )
        .unwrap();
        assert!(content.text.windows(4).any(|w| w == b"a\xff\xfeb"));
        let prompt = parse(
            Api::Completions,
            b"{\"model\":\"m\",\"prompt\":\"caf\xe9\"}",
        )
        .unwrap();
        assert!(prompt.text.ends_with(b"caf\xe9"));
        // In a field kvroute skips, it changes nothing.
        let skipped = |user: &[u8]| {
            let mut body = b"{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"user\":\"".to_vec();
            body.extend_from_slice(user);
            body.extend_from_slice(b"\"}");
            parse(Api::Chat, &body).unwrap().text
        };
        assert_eq!(skipped(b"\xc3"), skipped(b"ok"));
    }

    #[test]
    fn an_escaped_lone_surrogate_is_hashed_as_its_bytes() {
        let lone = chat(r#"{"model":"m","messages":[{"role":"user","content":"a\ud800b"}]}"#);
        let other = chat(r#"{"model":"m","messages":[{"role":"user","content":"a\udbffb"}]}"#);
        let (lone, other) = (lone.unwrap(), other.unwrap());
        assert!(std::str::from_utf8(&lone.text).is_err());
        assert_ne!(lone.text, other.text);
    }
}
