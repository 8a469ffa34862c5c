//! The request's `tools` as vLLM hands them to a template.
//!
//! vLLM validates each tool as its `ChatCompletionToolsParam` model and gives the template the
//! model dumped back (`tool.model_dump()`), so a template that prints the tools (`tojson`) sees
//! `{"type": "function", "function": {"name", "description", "parameters"}}` in that order,
//! whatever order the client wrote them in: `description` and `parameters` null when absent,
//! `strict` and `defer_loading` only when set (a tool's `defer_loading` also on its function when
//! that has none), and fields the models do not know dropped. `parameters` is kept as the client
//! wrote it. A tool vLLM's validation refuses (not a function, no name) refuses the request.

use minijinja::value::{Value, ValueKind};

/// Why the tools would not pass vLLM's validation.
const REFUSED: &str = "a tool vLLM's validation refuses";

/// `tools` as vLLM passes them; none stays none.
pub fn as_vllm_passes(tools: Value) -> Result<Value, &'static str> {
    if tools.is_none() || tools.is_undefined() {
        return Ok(tools);
    }
    if tools.kind() != ValueKind::Seq {
        return Err(REFUSED);
    }
    let tools = tools.try_iter().map_err(|_| REFUSED)?;
    tools
        .map(|t| tool(&t))
        .collect::<Result<Vec<_>, _>>()
        .map(Value::from)
}

/// A field, `None` when absent or null.
fn get(map: &Value, key: &str) -> Option<Value> {
    map.get_attr(key)
        .ok()
        .filter(|v| !v.is_undefined() && !v.is_none())
}

/// A field that must be of `kind` when set.
fn typed(map: &Value, key: &str, kind: ValueKind) -> Result<Option<Value>, &'static str> {
    match get(map, key) {
        Some(v) if v.kind() != kind => Err(REFUSED),
        v => Ok(v),
    }
}

fn tool(t: &Value) -> Result<Value, &'static str> {
    if t.kind() != ValueKind::Map {
        return Err(REFUSED);
    }
    if get(t, "type").is_some_and(|k| k.as_str() != Some("function")) {
        return Err(REFUSED);
    }
    let f = get(t, "function")
        .filter(|f| f.kind() == ValueKind::Map)
        .ok_or(REFUSED)?;
    let name = typed(&f, "name", ValueKind::String)?.ok_or(REFUSED)?;
    let none = Value::from(());
    let defer_tool = typed(t, "defer_loading", ValueKind::Bool)?;
    let mut function = vec![
        ("name", name),
        (
            "description",
            typed(&f, "description", ValueKind::String)?.unwrap_or(none.clone()),
        ),
        (
            "parameters",
            typed(&f, "parameters", ValueKind::Map)?.unwrap_or(none),
        ),
    ];
    if let Some(strict) = typed(&f, "strict", ValueKind::Bool)? {
        function.push(("strict", strict));
    }
    if let Some(defer) = typed(&f, "defer_loading", ValueKind::Bool)?.or(defer_tool.clone()) {
        function.push(("defer_loading", defer));
    }
    let mut out = vec![
        ("type", Value::from("function")),
        ("function", Value::from_iter(function)),
    ];
    if let Some(defer) = defer_tool {
        out.push(("defer_loading", defer));
    }
    Ok(Value::from_iter(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dumped(json: &str) -> Result<String, &'static str> {
        // Straight into a template value, in the order written.
        let v: Value = serde_json::from_str(json).unwrap();
        as_vllm_passes(v).map(|v| serde_json::to_string(&v).unwrap())
    }

    #[test]
    fn tools_come_out_in_vllms_field_order_with_its_nulls() {
        assert_eq!(
            dumped(
                r#"[{"function":{"parameters":{"z":1,"a":2},"name":"f","x":1},"type":"function"},
                    {"function":{"name":"g","description":"d","strict":true}}]"#
            ),
            Ok(concat!(
                r#"[{"type":"function","function":{"name":"f","description":null,"parameters":{"z":1,"a":2}}},"#,
                r#"{"type":"function","function":{"name":"g","description":"d","parameters":null,"strict":true}}]"#
            )
            .to_string())
        );
        assert_eq!(dumped("null"), Ok("null".to_string()));
    }

    #[test]
    fn tools_vllm_refuses_are_refused() {
        assert!(dumped(r#"[{"type":"retrieval","function":{"name":"f"}}]"#).is_err());
        assert!(dumped(r#"[{"function":{"description":"no name"}}]"#).is_err());
        assert!(dumped(r#"{"function":{"name":"f"}}"#).is_err());
    }
}
