//! Developer messages under a template that does not know the role, as vLLM passes them.
//!
//! When a request has a `developer` message and its template does not name the role (the word
//! quoted, `'developer'` or `"developer"`), vLLM makes every developer message a system one
//! (without its `tools`), then, if that leaves more than one system message or one that is not
//! first, merges them all into one first system message: their non-empty texts (a list of parts
//! as its texts joined by newlines) joined by a blank line, in order, before the other messages.

use minijinja::value::{Value, ValueKind};

/// Whether the template `source` names the developer role, as vLLM tests it.
pub fn named(source: &str) -> bool {
    source.contains("\"developer\"") || source.contains("'developer'")
}

fn role(m: &Value) -> Option<String> {
    m.get_attr("role").ok()?.as_str().map(str::to_string)
}

/// `messages` with developer messages as system ones, merged as vLLM merges them; and whether
/// they were merged (the first message then stands for every system and developer message).
pub fn as_system(messages: Vec<Value>) -> (Vec<Value>, bool) {
    if !messages
        .iter()
        .any(|m| role(m).as_deref() == Some("developer"))
    {
        return (messages, false);
    }
    let converted: Vec<Value> = messages
        .into_iter()
        .map(|m| match role(&m).as_deref() {
            Some("developer") => system_of(&m),
            _ => m,
        })
        .collect();
    let systems: Vec<usize> = (0..converted.len())
        .filter(|&i| role(&converted[i]).as_deref() == Some("system"))
        .collect();
    if systems.len() < 2 && systems.first().is_none_or(|&i| i == 0) {
        return (converted, false);
    }
    let texts: Vec<String> = systems
        .iter()
        .map(|&i| text(&converted[i]))
        .filter(|t| !t.is_empty())
        .collect();
    let merged = Value::from_iter([
        ("role", Value::from("system")),
        ("content", Value::from(texts.join("\n\n"))),
    ]);
    let rest = converted
        .into_iter()
        .filter(|m| role(m).as_deref() != Some("system"));
    (std::iter::once(merged).chain(rest).collect(), true)
}

/// A developer message as a system one: its role changed, its `tools` dropped.
fn system_of(m: &Value) -> Value {
    let entries: Vec<(Value, Value)> = m
        .try_iter()
        .into_iter()
        .flatten()
        .filter(|k| k.as_str() != Some("tools"))
        .map(|k| {
            let v = match k.as_str() {
                Some("role") => Value::from("system"),
                _ => m.get_item(&k).unwrap_or_default(),
            };
            (k, v)
        })
        .collect();
    Value::from_iter(entries)
}

/// A message's text: its content string, or its parts' texts joined by newlines.
fn text(m: &Value) -> String {
    let Ok(content) = m.get_attr("content") else {
        return String::new();
    };
    match content.kind() {
        ValueKind::String => content.as_str().unwrap_or_default().to_string(),
        ValueKind::Seq => content
            .try_iter()
            .into_iter()
            .flatten()
            .filter_map(|p| match p.kind() {
                ValueKind::String => p.as_str().map(str::to_string),
                _ => p
                    .get_attr("text")
                    .ok()
                    .filter(|t| !t.is_undefined())
                    .map(|t| t.as_str().map_or_else(|| t.to_string(), str::to_string)),
            })
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msgs(json: &str) -> Vec<Value> {
        let v: Vec<Value> = serde_json::from_str(json).unwrap();
        v
    }

    fn shown(v: &[Value]) -> String {
        serde_json::to_string(v).unwrap()
    }

    #[test]
    fn the_role_is_named_only_quoted() {
        assert!(named("{% if m.role == 'developer' %}"));
        assert!(named(r#"{% if m.role in ["system", "developer"] %}"#));
        assert!(!named("{{ developer }}"));
    }

    #[test]
    fn a_first_developer_message_becomes_the_system_message() {
        let (out, merged) = as_system(msgs(
            r#"[{"role":"developer","content":"be brief","tools":null},{"role":"user","content":"hi"}]"#,
        ));
        assert!(!merged);
        assert_eq!(
            shown(&out),
            r#"[{"role":"system","content":"be brief"},{"role":"user","content":"hi"}]"#
        );
    }

    #[test]
    fn system_messages_are_merged_first_in_order() {
        let (out, merged) = as_system(msgs(
            r#"[{"role":"system","content":"a"},{"role":"user","content":"hi"},
                {"role":"developer","content":[{"type":"text","text":"b"},{"type":"text","text":"c"}]},
                {"role":"system","content":""}]"#,
        ));
        assert!(merged);
        assert_eq!(
            shown(&out),
            r#"[{"role":"system","content":"a\n\nb\nc"},{"role":"user","content":"hi"}]"#
        );
        let plain = msgs(r#"[{"role":"system","content":"a"},{"role":"system","content":"b"}]"#);
        assert_eq!(as_system(plain.clone()), (plain, false));
    }
}
