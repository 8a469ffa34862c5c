//! A chat request rendered by its template → the [`Prompt`] kvroute keys: the text, and where its
//! head and opening message are in it.
//!
//! The head (system and developer messages and the tools, or the first message when there are
//! neither) is what every request of the group renders alike: the bytes the request shares with
//! the same head followed by any other message. It is found by rendering the head's messages and
//! one message of the next one's role whose content is a byte no prompt holds there, and taking
//! the common prefix of the two renderings: whatever the template puts around or after the head
//! (the tools, a date, the next turn's header) is in it exactly as far as it is shared. The
//! opener is where the first message after the head renders its text.

use std::sync::Arc;

use memchr::memmem;
use minijinja::value::{Value, ValueKind};
use serde_json::value::RawValue;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::messages::{self, ContentFormat};
use super::{developer, jinja, tools, Template};
use crate::prefix::OPENER_BYTES;
use crate::request::{ChatRequest, Message, Prompt};

/// Why a request was not rendered by a template.
#[derive(Debug)]
pub enum RenderError {
    /// The body is no chat request with a model and messages (the built-in rendering says
    /// which), or a field only a template reads has a shape it cannot take.
    Body,
    /// The request's model has no template.
    NoTemplate,
    /// vLLM would refuse its messages.
    Refused(&'static str),
    /// The template failed to render it (its own `raise_exception` included).
    Template(String),
}

/// What a template is rendered with, but the messages.
struct Vars {
    tools: Value,
    documents: Value,
    kwargs: Vec<(Value, Value)>,
    /// About the bytes a rendering takes, to write it into one buffer.
    size: usize,
}

impl Template {
    /// The template rendered with `messages` and `vars`, as its UTF-8 bytes.
    fn render_messages(
        &self,
        messages: Value,
        vars: &Vars,
        add_generation_prompt: bool,
    ) -> Result<Vec<u8>, RenderError> {
        let mut ctx: Vec<(Value, Value)> = Vec::with_capacity(self.tokens.len() + 8);
        for (name, token) in &self.tokens {
            ctx.push((Value::from(name.as_str()), token.clone()));
        }
        ctx.push((Value::from("messages"), messages));
        ctx.push((Value::from("tools"), vars.tools.clone()));
        ctx.push((Value::from("documents"), vars.documents.clone()));
        ctx.push((
            Value::from("add_generation_prompt"),
            Value::from(add_generation_prompt),
        ));
        ctx.extend(vars.kwargs.iter().cloned());
        let template = self
            .env
            .get_template(jinja::NAME)
            .map_err(|e| RenderError::Template(e.to_string()))?;
        let mut out = Vec::with_capacity(vars.size);
        template
            .render_captured_to(Value::from_iter(ctx), &mut out)
            .map_err(|e| RenderError::Template(e.to_string()))?;
        Ok(out)
    }
}

/// A flag a template reads (`add_generation_prompt`, `continue_final_message`): a boolean, or
/// absent.
fn flag(raw: Option<&RawValue>) -> Result<Option<bool>, RenderError> {
    match raw.map(RawValue::get) {
        None | Some("null") => Ok(None),
        Some("true") => Ok(Some(true)),
        Some("false") => Ok(Some(false)),
        Some(_) => Err(RenderError::Body),
    }
}

/// Renders a chat request (read once, [`request::read_chat`]) of `model` by `template`.
pub(crate) fn render(
    template: &Template,
    req: &ChatRequest,
    model: String,
) -> Result<Prompt, RenderError> {
    let raw = req.messages().map_err(|_| RenderError::Body)?;
    let format = template.format;
    let messages = raw
        .iter()
        .map(|m| messages::prepare(m, format).map_err(|r| RenderError::Refused(r.0)))
        .collect::<Result<Vec<Value>, _>>()?;
    let (messages, merged) = match template.names_developer {
        true => (messages, false),
        false => developer::as_system(messages),
    };
    let parse = |v: Option<&RawValue>| -> Result<Option<Value>, RenderError> {
        v.map(|v| serde_json::from_str(v.get()).map_err(|_| RenderError::Body))
            .transpose()
    };
    // What the head's rendering depends on besides its messages.
    let mut context = [req.tools, req.documents, req.chat_template_kwargs]
        .iter()
        .fold(0u64, |h, v| {
            xxh3_64_with_seed(v.map_or("", |v| v.get()).as_bytes(), h)
        });
    if merged {
        // The first message stands for every system and developer message.
        context = raw
            .iter()
            .filter(|m| matches!(m.role.as_deref(), Some("system" | "developer")))
            .fold(context, |h, m| messages::fingerprint(m, h));
    }
    let add_generation_prompt = flag(req.add_generation_prompt)?.unwrap_or(true);
    let continue_final = flag(req.continue_final_message)?.unwrap_or(false);
    if add_generation_prompt && continue_final {
        return Err(RenderError::Refused(
            "add_generation_prompt and continue_final_message",
        ));
    }
    let mut kwargs = Vec::new();
    if let Some(k) = parse(req.chat_template_kwargs)?.filter(|k| k.kind() == ValueKind::Map) {
        for key in k.try_iter().into_iter().flatten() {
            let value = k.get_item(&key).unwrap_or_default();
            kwargs.push((key, value));
        }
    }
    let vars = Vars {
        tools: tools::as_vllm_passes(parse(req.tools)?.unwrap_or_default_none())
            .map_err(RenderError::Refused)?,
        documents: parse(req.documents)?.unwrap_or_default_none(),
        kwargs,
        size: 4096
            + req.tools.map_or(0, |t| t.get().len())
            + raw.iter().map(Message::size).sum::<usize>(),
    };
    let text = if continue_final {
        continue_final_message(template, &messages, &vars)?
    } else {
        template.render_messages(Value::from(messages.clone()), &vars, add_generation_prompt)?
    };
    let (head, head_messages) = head(template, &messages, raw, context, &vars, &text)?;
    let opener = messages
        .get(head_messages)
        .and_then(|m| opener(&text, head, m))
        .unwrap_or(head..head);
    Ok(Prompt {
        model,
        head,
        opener,
        history: messages.len().saturating_sub(head_messages) > 1,
        salt: req.salt(),
        usage: req.usage(),
        streams: req.streams(),
        text,
    })
}

trait OrNone {
    fn unwrap_or_default_none(self) -> Value;
}

impl OrNone for Option<Value> {
    /// An absent or null field is Python's `None` to the template.
    fn unwrap_or_default_none(self) -> Value {
        self.unwrap_or(Value::from(()))
    }
}

fn role(m: &Value) -> Option<String> {
    m.get_attr("role").ok()?.as_str().map(str::to_string)
}

/// Bytes of `text` that make the head, and how many messages the head holds.
/// The probe's rendering is kept per template, by the raw head messages, the next one's role and
/// `context`, so a group's requests render their head once.
fn head(
    template: &Template,
    messages: &[Value],
    raw: &[Message],
    context: u64,
    vars: &Vars,
    text: &[u8],
) -> Result<(usize, usize), RenderError> {
    let lead = messages
        .iter()
        .take_while(|m| matches!(role(m).as_deref(), Some("system" | "developer")))
        .count();
    let has_tools = !vars.tools.is_none() && vars.tools.len() != Some(0);
    let n = if lead == 0 && !has_tools { 1 } else { lead };
    let Some(next) = messages.get(n) else {
        return Ok((text.len(), messages.len()));
    };
    // A content no rendered prompt has at that place: a control byte.
    const PROBE: &str = "\u{1}";
    let content = match template.format {
        ContentFormat::String => Value::from(PROBE),
        ContentFormat::OpenAi => Value::from(vec![Value::from_iter([
            ("type", Value::from("text")),
            ("text", Value::from(PROBE)),
        ])]),
    };
    let probe_message = Value::from_iter([
        ("role", Value::from(role(next).unwrap_or_default().as_str())),
        ("content", content),
    ]);
    let next_role = role(next).unwrap_or_default();
    let key = raw[..n]
        .iter()
        .fold(xxh3_64_with_seed(next_role.as_bytes(), context), |h, m| {
            messages::fingerprint(m, h)
        });
    let probe = match template.probe(key) {
        Some(probe) => probe,
        None => {
            let mut probe: Vec<Value> = messages[..n].to_vec();
            probe.push(probe_message);
            let probe: Arc<[u8]> = template
                .render_messages(Value::from(probe), vars, false)?
                .into();
            template.keep_probe(key, probe.clone());
            probe
        }
    };
    Ok((common_prefix(text, &probe), n))
}

/// How many leading bytes `a` and `b` share, compared 16 at a time.
fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let at = a
        .chunks_exact(16)
        .zip(b.chunks_exact(16))
        .take_while(|(x, y)| x == y)
        .count()
        * 16;
    at + a[at..]
        .iter()
        .zip(&b[at..])
        .take_while(|(x, y)| x == y)
        .count()
}

/// Where the message `m` (the first after the head) renders its text: the first
/// [`OPENER_BYTES`] of its content found after the head.
fn opener(text: &[u8], head: usize, m: &Value) -> Option<std::ops::Range<usize>> {
    let content = m.get_attr("content").ok()?;
    let own: String = match content.kind() {
        ValueKind::String => content.as_str()?.to_string(),
        ValueKind::Seq => content
            .try_iter()
            .ok()?
            .find_map(|p| p.get_attr("text").ok()?.as_str().map(str::to_string))?,
        _ => return None,
    };
    let own = own.trim();
    let mut cut = own.len().min(OPENER_BYTES);
    while !own.is_char_boundary(cut) {
        cut -= 1;
    }
    let needle = &own[..cut];
    if needle.is_empty() {
        return None;
    }
    let at = head + memmem::find(text.get(head..)?, needle.as_bytes())?;
    Some(at..at + needle.len())
}

/// What transformers appends to the final message's text to find where it ends.
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// transformers' `continue_final_message`: the final message's text (its content, or the last
/// text part) is rendered with a tag after it, and the prompt ends where the tag starts (and
/// without the whitespace before it, if the template trimmed the tag's space).
fn continue_final_message(
    template: &Template,
    messages: &[Value],
    vars: &Vars,
) -> Result<Vec<u8>, RenderError> {
    let refuse = || RenderError::Refused("continue_final_message without a final text");
    let (last, earlier) = messages.split_last().ok_or_else(refuse)?;
    if !template.names_content {
        return Err(refuse());
    }
    let content = last.get_attr("content").map_err(|_| refuse())?;
    let (final_text, tagged) = match content.kind() {
        ValueKind::String => {
            let text = content.as_str().unwrap_or_default().to_string();
            let tagged = Value::from(format!("{text}{CONTINUE_TAG}"));
            (text, tagged)
        }
        ValueKind::Seq => {
            let mut parts: Vec<Value> = content.try_iter().map_err(|_| refuse())?.collect();
            let i = parts
                .iter()
                .rposition(|p| p.get_attr("text").is_ok_and(|t| !t.is_undefined()))
                .ok_or_else(refuse)?;
            let text = parts[i].get_attr("text").unwrap_or_default();
            let text = text.as_str().unwrap_or_default().to_string();
            parts[i] = messages::replace(
                &parts[i],
                "text",
                Value::from(format!("{text}{CONTINUE_TAG}")),
            );
            (text, Value::from(parts))
        }
        _ => return Err(refuse()),
    };
    let mut all = earlier.to_vec();
    all.push(messages::replace(last, "content", tagged));
    let rendered = template.render_messages(Value::from(all), vars, false)?;
    let rendered = String::from_utf8(rendered).map_err(|_| refuse())?;
    let tag = CONTINUE_TAG.trim();
    if !rendered.contains(final_text.trim()) {
        return Err(refuse());
    }
    let at = rendered.rfind(tag).ok_or_else(refuse)?;
    let mut text = rendered;
    if text[at..].starts_with(CONTINUE_TAG) {
        text.truncate(at);
    } else {
        text.truncate(text[..at].trim_end().len());
    }
    Ok(text.into_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::template::Templates;
    use serde_json::json;

    /// ChatML with tools in the system message; earlier turns' reasoning dropped.
    const CHATML: &str = r#"{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- set ns = namespace(last=-1) %}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}{% endif %}{% endfor %}
{%- for m in messages %}
{%- if m.role == 'system' and loop.first %}
{%- elif m.role == 'assistant' %}<|im_start|>assistant
{% if loop.index0 > ns.last and m.reasoning_content %}<think>{{ m.reasoning_content }}</think>
{% endif %}{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} {{ c.function.arguments | tojson }}</tool_call>{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think></think>
{% endif %}{% endif %}"#;

    fn templates() -> Templates {
        let mut t = Templates::default();
        t.set_default(&json!({"chat_template": CHATML, "eos_token": "<|im_end|>"}))
            .unwrap();
        t
    }

    fn prompt(body: serde_json::Value) -> Prompt {
        templates().render(body.to_string().as_bytes()).unwrap()
    }

    fn text(p: &Prompt) -> &str {
        std::str::from_utf8(&p.text).unwrap()
    }

    #[test]
    fn renders_the_template_with_the_generation_prompt() {
        let p = prompt(json!({"model":"m","messages":[
            {"role":"system","content":"Be brief."},{"role":"user","content":"Hi"}]}));
        assert_eq!(
            text(&p),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(
            &text(&p)[..p.head],
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
        );
        assert_eq!(&text(&p)[p.opener.clone()], "Hi");
        assert!(!p.history);
        let no_prompt = prompt(json!({"model":"m","add_generation_prompt":false,
            "chat_template_kwargs":{"enable_thinking":false},
            "messages":[{"role":"user","content":"Hi"}]}));
        assert_eq!(text(&no_prompt), "<|im_start|>user\nHi<|im_end|>\n");
        let no_thinking = prompt(
            json!({"model":"m","chat_template_kwargs":{"enable_thinking":false},
            "messages":[{"role":"user","content":"Hi"}]}),
        );
        assert!(text(&no_thinking).ends_with("<|im_start|>assistant\n<think></think>\n"));
    }

    #[test]
    fn the_head_holds_the_tools_and_is_the_same_in_every_turn() {
        // Raw bodies: the key order of the parameters is the client's; the tool is as vLLM
        // dumps it (`tools`).
        let tools = r#"[{"type":"function","function":{"name":"f","parameters":{"z":1,"a":2}}}]"#;
        let render = |messages: &str| {
            let body = format!(r#"{{"model":"m","tools":{tools},"messages":[{messages}]}}"#);
            templates().render(body.as_bytes()).unwrap()
        };
        let t1 = render(r#"{"role":"system","content":"S"},{"role":"user","content":"task"}"#);
        let t2 = render(
            r#"{"role":"system","content":"S"},{"role":"user","content":"task"},
            {"role":"assistant","content":null,"tool_calls":[{"id":"1","type":"function","function":{"name":"f","arguments":"{\"q\":\"é\"}"}}]},
            {"role":"tool","tool_call_id":"1","content":"result"}"#,
        );
        let head = &text(&t1)[..t1.head];
        assert!(
            head.contains(
                r#"{"type": "function", "function": {"name": "f", "description": null, "parameters": {"z": 1, "a": 2}}}"#
            ),
            "{head}"
        );
        assert!(!head.contains("task"));
        assert_eq!(&text(&t2)[..t2.head], head);
        assert!(t2.history);
        assert_eq!(&text(&t2)[t2.opener.clone()], "task");
        assert!(text(&t2).contains(r#"<tool_call>f {"q": "é"}</tool_call>"#));
    }

    #[test]
    fn a_second_turn_extends_the_first_up_to_its_dropped_reasoning() {
        let turn1 = prompt(json!({"model":"m","messages":[{"role":"user","content":"q1"}]}));
        let turn2 = prompt(
            json!({"model":"m","messages":[{"role":"user","content":"q1"},
            {"role":"assistant","content":"a1","reasoning":"thought"},{"role":"user","content":"q2"}]}),
        );
        assert!(text(&turn2).starts_with(text(&turn1)));
        assert!(
            !text(&turn2).contains("thought"),
            "earlier reasoning is dropped"
        );
        let last = prompt(
            json!({"model":"m","messages":[{"role":"user","content":"q1"},
            {"role":"assistant","content":"a1","reasoning":"thought"}],
            "add_generation_prompt":false,"continue_final_message":true}),
        );
        assert!(
            text(&last).ends_with("<think>thought</think>\na1"),
            "{}",
            text(&last)
        );
    }

    #[test]
    fn models_without_a_template_and_failures_are_rendered_as_before() {
        use crate::template::Outcome;
        let mut t = Templates::default();
        t.set_models(&json!({"mine": {"chat_template": "{{ raise_exception('nope') if messages|length > 1 }}{{ messages[0].content }}"}}))
            .unwrap();
        let chat = |body: serde_json::Value| {
            let parsed = t.parse(
                crate::request::Api::Chat,
                body.to_string().as_bytes(),
                Default::default(),
            );
            (parsed.prompt, parsed.outcome)
        };
        let (one, outcome) =
            chat(json!({"model":"mine","messages":[{"role":"user","content":"x"}]}));
        assert_eq!(one.unwrap().text, b"x");
        assert_eq!(outcome, Some(Outcome::Rendered));
        let (other, outcome) =
            chat(json!({"model":"other","messages":[{"role":"user","content":"x"}]}));
        let before = crate::request::parse(
            crate::request::Api::Chat,
            br#"{"model":"other","messages":[{"role":"user","content":"x"}]}"#,
        );
        assert_eq!(other, before);
        assert_eq!(outcome, Some(Outcome::NoTemplate));
        let (failed, outcome) = chat(
            json!({"model":"mine","messages":[{"role":"user","content":"x"},{"role":"user","content":"y"}]}),
        );
        assert!(failed.is_ok());
        assert_eq!(outcome, Some(Outcome::Failed));
        assert_eq!(
            chat(json!({"model":"mine"})),
            (Err(crate::request::ParseError::NoPrompt), None)
        );
    }
}
