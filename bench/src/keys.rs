//! `kvroute-bench keys`: one request rendered by a chat template, and the prefix keys kvroute
//! computes over it, for whoever keys the engine's blocks to compare against.

use std::path::Path;

use kvroute::config::Config;
use kvroute::prefix::{PrefixKeys, Shape};
use kvroute::request::Prompt;
use kvroute::template::Templates;
use serde_json::{json, Value};

/// What `keys` is given.
pub struct KeysArgs<'a> {
    /// A raw Jinja template, or a `tokenizer_config.json` holding one.
    pub chat_template: &'a Path,
    /// A chat completion request body (JSON).
    pub request: &'a Path,
    pub chunk_size: usize,
    /// Seeds the keys instead of the request's model.
    pub model: Option<&'a str>,
    /// A `tokenizer_config.json` whose special tokens a raw template is rendered with.
    pub tokenizer_config: Option<&'a Path>,
}

fn read(path: &Path) -> Result<String, String> {
    std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))
}

/// The template spec of a file: a tokenizer config as it is, a raw template as its source,
/// with the special tokens of `tokenizer_config` when given.
fn spec(template: &Path, tokenizer_config: Option<&Path>) -> Result<Value, String> {
    let text = read(template)?;
    let mut spec = match serde_json::from_str::<Value>(&text) {
        Ok(v @ Value::Object(_)) if v.get("chat_template").is_some() => v,
        _ => json!({ "chat_template": text }),
    };
    if let Some(config) = tokenizer_config {
        let config: Value = serde_json::from_str(&read(config)?)
            .map_err(|e| format!("{}: {e}", config.display()))?;
        if let (Value::Object(spec), Value::Object(config)) = (&mut spec, config) {
            for (k, v) in config {
                if k != "chat_template" {
                    spec.entry(k).or_insert(v);
                }
            }
        }
    }
    Ok(spec)
}

/// The prompt a request body renders to under `templates`, and the prefix keys kvroute computes
/// over it, in chunks of `chunk_size` bytes, seeded by `model` when given (else the request's).
pub fn prompt_keys(
    templates: &Templates,
    body: &[u8],
    chunk_size: usize,
    model: Option<&str>,
) -> Result<(Prompt, PrefixKeys), String> {
    let prompt = templates
        .render(body)
        .map_err(|e| format!("not rendered: {e:?}"))?;
    let defaults = Config::default();
    let shape = Shape {
        chunk_size,
        max_chunks: defaults.max_chunks,
        group_bytes: defaults.group_bytes,
    };
    let keys = PrefixKeys::salted(
        prompt.salt.as_deref(),
        model.unwrap_or(&prompt.model),
        &prompt.text,
        prompt.head,
        prompt.history,
        shape,
    );
    Ok((prompt, keys))
}

/// Renders the request and prints `{"rendered": ..., "keys": [...]}`.
pub fn keys(args: &KeysArgs) -> Result<(), String> {
    let mut templates = Templates::default();
    templates
        .set_default(&spec(args.chat_template, args.tokenizer_config)?)
        .map_err(|e| format!("{}: {e}", args.chat_template.display()))?;
    let body = read(args.request)?;
    let (prompt, keys) = prompt_keys(&templates, body.as_bytes(), args.chunk_size, args.model)
        .map_err(|e| format!("{}: {e}", args.request.display()))?;
    // Written by hand to keep the documented key order.
    let rendered = Value::from(String::from_utf8_lossy(&prompt.text));
    let keys: Vec<Value> = keys
        .keys
        .iter()
        .map(|k| format!("{k:016x}").into())
        .collect();
    println!(r#"{{"rendered":{rendered},"keys":{}}}"#, Value::from(keys));
    Ok(())
}
