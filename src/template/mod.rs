//! The model's chat template, rendered in the filter, so prompts are keyed as the engine renders them.
//!
//! A served model's Hugging Face chat template (the Jinja `chat_template` of its
//! `tokenizer_config.json`) is compiled once per VM ([`Templates`], from the config's
//! `chat_template` and `models`) and renders each chat request as vLLM's chat endpoint does:
//! the messages prepared as vLLM prepares them ([`messages`]), the request's `tools`,
//! `documents`, `add_generation_prompt` (true unless the request says otherwise),
//! `continue_final_message` and `chat_template_kwargs`, and the tokenizer config's special tokens
//! (`bos_token`, `eos_token`, ...), under transformers' Jinja semantics ([`jinja`]). The keys are
//! then over those bytes, so they meet the engine's blocks, and they see what the template does to
//! a conversation's prefix (a date in the system header, earlier turns' reasoning dropped, tools
//! before the last user turn).
//!
//! A request whose model has no template, or that its template fails to render, is rendered as
//! before ([`request::parse_with`]); each outcome is returned, for the gateway to count
//! (`kvroute.template.*`).

mod clock;
pub mod developer;
pub mod jinja;
pub mod messages;
mod prompt;
pub mod pyjson;
pub mod tools;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use minijinja::{Environment, Value};
use serde_json::Value as Json;
use strum::{EnumCount, IntoStaticStr, VariantArray};
use xxhash_rust::xxh3::xxh3_64;

use crate::request::{self, Api, ParseError, Prompt, ToolsAt};
pub use messages::ContentFormat;
pub use prompt::RenderError;

/// The named special tokens transformers gives a template (its `special_tokens_map`).
const SPECIAL_TOKENS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// One model's compiled chat template and the values its tokenizer config gives it.
pub struct Template {
    env: Environment<'static>,
    /// Whether the source names `content` (transformers' condition for continuing a message).
    names_content: bool,
    /// Whether the source names the developer role (else vLLM passes developer messages as
    /// system ones: [`developer`]).
    names_developer: bool,
    format: ContentFormat,
    /// `bos_token`, `eos_token`, ...: what transformers passes a template from the tokenizer.
    tokens: Vec<(String, Value)>,
    /// Hash of the source and tokens, to compare configs.
    id: u64,
    /// Renderings of heads with a probe message after them, by what they were rendered from
    /// (`prompt::head`): a group's requests render their head once per VM.
    probes: Mutex<HashMap<u64, Arc<[u8]>>>,
}

/// Head renderings kept per template: enough for the groups a gateway sees at once; past it,
/// the oldest are dropped.
const PROBES: usize = 128;

impl Template {
    fn probe(&self, key: u64) -> Option<Arc<[u8]>> {
        self.probes.lock().ok()?.get(&key).cloned()
    }

    fn keep_probe(&self, key: u64, probe: Arc<[u8]>) {
        if let Ok(mut probes) = self.probes.lock() {
            if probes.len() >= PROBES {
                probes.clear();
            }
            probes.insert(key, probe);
        }
    }
}

impl Template {
    /// Compiles `spec`: the template's Jinja source as a string, or an object of a
    /// `tokenizer_config.json`'s shape (`chat_template`, `bos_token`, `eos_token`, ...; other keys
    /// are ignored).
    pub fn from_spec(spec: &Json) -> Result<Template, String> {
        let (source, tokens) = match spec {
            Json::String(s) => (s.clone(), Vec::new()),
            Json::Object(map) => {
                let source = match map.get("chat_template") {
                    Some(Json::String(s)) => s.clone(),
                    Some(Json::Array(named)) => named
                        .iter()
                        .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
                        .or_else(|| named.first())
                        .and_then(|t| t.get("template"))
                        .and_then(Json::as_str)
                        .ok_or("`chat_template`: a list of {name, template} without a template")?
                        .to_string(),
                    _ => return Err("needs a `chat_template` string".into()),
                };
                let mut tokens = Vec::new();
                for key in SPECIAL_TOKENS {
                    let token = match map.get(key) {
                        Some(Json::String(s)) => Some(s.as_str()),
                        Some(Json::Object(t)) => t.get("content").and_then(Json::as_str),
                        _ => None,
                    };
                    if let Some(token) = token {
                        tokens.push((key.to_string(), Value::from(token)));
                    }
                }
                (source, tokens)
            }
            _ => return Err("must be a template string or an object with `chat_template`".into()),
        };
        let id = xxh3_64(format!("{source}\u{0}{tokens:?}").as_bytes());
        let format = ContentFormat::detect(&source);
        let names_content = source.contains("content");
        let names_developer = developer::named(&source);
        let env = jinja::environment(source).map_err(|e| format!("does not compile: {e}"))?;
        Ok(Template {
            env,
            names_content,
            names_developer,
            format,
            tokens,
            id,
            probes: Mutex::new(HashMap::new()),
        })
    }

    /// The content format vLLM would pass this template.
    pub fn format(&self) -> ContentFormat {
        self.format
    }
}

/// The template spec a file holds: a `tokenizer_config.json` (an object with `chat_template`)
/// as it is, any other text as a template's source.
pub fn spec_of_file(text: &str) -> Json {
    match serde_json::from_str::<Json>(text) {
        Ok(v @ Json::Object(_)) if v.get("chat_template").is_some() => v,
        _ => Json::String(text.to_string()),
    }
}

/// What became of a chat request under templates: each a counter (`kvroute.template.<name>`),
/// which the gateway counts from what [`Templates::parse`] returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, IntoStaticStr, VariantArray, EnumCount)]
#[strum(serialize_all = "snake_case")]
pub enum Outcome {
    /// Rendered by its model's template.
    Rendered,
    /// Its model has no template: rendered as before.
    NoTemplate,
    /// Its template failed to render it (or vLLM would refuse its messages): rendered as before.
    Failed,
}

impl Outcome {
    pub fn name(self) -> &'static str {
        self.into()
    }
}

/// Two templates are the same when compiled from the same source and special tokens.
impl PartialEq for Template {
    fn eq(&self, other: &Template) -> bool {
        self.id == other.id
    }
}

/// The configured templates: one for every model (`chat_template`) and/or one per model
/// (`models`).
#[derive(Clone, Default, PartialEq)]
pub struct Templates {
    default: Option<Arc<Template>>,
    models: HashMap<String, Arc<Template>>,
}

impl std::fmt::Debug for Templates {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut models: Vec<&String> = self.models.keys().collect();
        models.sort();
        f.debug_struct("Templates")
            .field("default", &self.default.is_some())
            .field("models", &models)
            .finish()
    }
}

/// A request's prompt as [`Templates::parse`] renders it, and what became of it under the
/// templates: `None` when no template was looked for (no template configured, not a chat
/// request, or a body that is not one).
#[derive(Debug)]
pub struct Parsed {
    pub prompt: Result<Prompt, ParseError>,
    pub outcome: Option<Outcome>,
}

impl Templates {
    /// No template: every request is rendered as before.
    pub fn is_empty(&self) -> bool {
        self.default.is_none() && self.models.is_empty()
    }

    /// Config `chat_template`: the template of every model without one of its own.
    pub fn set_default(&mut self, spec: &Json) -> Result<(), String> {
        self.default = Some(Arc::new(Template::from_spec(spec)?));
        Ok(())
    }

    /// Config `models`: an object of model name → template spec. Errors name the model.
    pub fn set_models(&mut self, models: &Json) -> Result<(), String> {
        let Json::Object(map) = models else {
            return Err("must be an object of model name → template".into());
        };
        for (model, spec) in map {
            let template = Template::from_spec(spec).map_err(|e| format!("`{model}`: {e}"))?;
            self.models.insert(model.clone(), Arc::new(template));
        }
        Ok(())
    }

    /// The template for `model`: its own, or the one for every model.
    pub fn for_model(&self, model: &str) -> Option<&Template> {
        self.models
            .get(model)
            .or(self.default.as_ref())
            .map(|t| &**t)
    }

    /// The prompt of a request, rendered by its model's template where there is one, else (or
    /// when the template fails) as [`request::parse_with`] renders it, with the outcome for the
    /// caller to count. The body is read once, for both.
    pub fn parse(&self, api: Api, body: &[u8], tools: ToolsAt) -> Parsed {
        if self.is_empty() || api != Api::Chat {
            let prompt = request::parse_with(api, body, tools);
            return Parsed {
                prompt,
                outcome: None,
            };
        }
        self.parse_chat(body, tools).unwrap_or_else(|e| Parsed {
            prompt: Err(e),
            outcome: None,
        })
    }

    /// [`parse`](Self::parse) of a chat request; `Err` when its body is not one (no model, no
    /// messages), which no template is looked for.
    fn parse_chat(&self, body: &[u8], tools: ToolsAt) -> Result<Parsed, ParseError> {
        let req = request::read_chat(body)?;
        let model = req.model()?;
        req.messages()?;
        let (prompt, outcome) = match self.for_model(&model) {
            None => (request::render_chat(&req, tools), Some(Outcome::NoTemplate)),
            Some(template) => match prompt::render(template, &req, model) {
                Ok(prompt) => (Ok(prompt), Some(Outcome::Rendered)),
                Err(RenderError::Body) => (request::render_chat(&req, tools), None),
                Err(
                    RenderError::NoTemplate | RenderError::Refused(_) | RenderError::Template(_),
                ) => (request::render_chat(&req, tools), Some(Outcome::Failed)),
            },
        };
        Ok(Parsed { prompt, outcome })
    }

    /// The prompt of a chat request as its model's template renders it, or why not.
    pub fn render(&self, body: &[u8]) -> Result<Prompt, RenderError> {
        let req = request::read_chat(body).map_err(|_| RenderError::Body)?;
        let model = req.model().map_err(|_| RenderError::Body)?;
        req.messages().map_err(|_| RenderError::Body)?;
        let template = self.for_model(&model).ok_or(RenderError::NoTemplate)?;
        prompt::render(template, &req, model)
    }
}
