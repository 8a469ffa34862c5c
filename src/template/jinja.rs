//! A minijinja environment with the semantics transformers renders chat templates under.
//!
//! transformers compiles a chat template in a sandboxed Jinja2 environment with `trim_blocks` and
//! `lstrip_blocks`, loop controls, a `tojson` that is Python's `json.dumps` (non-ASCII kept, key
//! order kept, `indent`), and two globals, `raise_exception` and `strftime_now`. Templates also
//! call Python's string and dict methods (`minijinja-contrib`'s `pycompat`), and Jinja2 prints
//! values as Python's `str()` does (`None`, `True`, `{'a': 1}`).

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind, State};

use super::clock;
use super::pyjson::{self, Layout};

/// The name the one template of an environment is kept under.
pub const NAME: &str = "chat_template";

/// An environment holding `source`, compiled once.
pub fn environment(source: String) -> Result<Environment<'static>, Error> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_recursion_limit(200);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_formatter(|out, _state, value| {
        if let Some(s) = value.as_str() {
            return out.write_str(s).map_err(Error::from);
        }
        let mut text = String::new();
        pyjson::py_str(&mut text, value);
        out.write_str(&text).map_err(Error::from)
    });
    env.add_filter("tojson", tojson);
    // Jinja2's `trim` strips Python's `str()` of any value (a list prints as its repr).
    env.add_filter("trim", |v: Value, chars: Option<String>| {
        let mut text = String::new();
        pyjson::py_str(&mut text, &v);
        match chars {
            Some(chars) => text.trim_matches(|c| chars.contains(c)).to_string(),
            None => text.trim().to_string(),
        }
    });
    env.add_filter("string", |v: Value| {
        let mut text = String::new();
        pyjson::py_str(&mut text, &v);
        text
    });
    env.add_function(
        "raise_exception",
        |message: String| -> Result<Value, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, message))
        },
    );
    env.add_function("strftime_now", |format: String| {
        clock::strftime_now(&format)
    });
    env.add_template_owned(NAME, source)?;
    Ok(env)
}

/// transformers' `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
fn tojson(_state: &State, value: Value, args: Vec<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let positional = |i: usize, name: &str| -> Result<Option<Value>, Error> {
        match (args.get(i), kwargs.get::<Option<Value>>(name)?) {
            (Some(v), _) => Ok(Some(v.clone())),
            (None, v) => Ok(v),
        }
    };
    let ensure_ascii = positional(0, "ensure_ascii")?.is_some_and(|v| v.is_true());
    let indent = match positional(1, "indent")? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.kind() {
            ValueKind::String => Some(v.as_str().unwrap_or_default().to_string()),
            ValueKind::Number => Some(" ".repeat(v.as_i64().unwrap_or(0).max(0) as usize)),
            _ => return Err(Error::new(ErrorKind::InvalidOperation, "bad indent")),
        },
    };
    let mut layout = Layout::new(indent);
    layout.ensure_ascii = ensure_ascii;
    if let Some(seps) = positional(2, "separators")?.filter(|v| !v.is_none()) {
        let seps: Vec<Value> = seps.try_iter()?.collect();
        if let [item, key] = &seps[..] {
            layout.item_sep = item.as_str().unwrap_or_default().to_string();
            layout.key_sep = key.as_str().unwrap_or_default().to_string();
        }
    }
    layout.sort_keys = positional(3, "sort_keys")?.is_some_and(|v| v.is_true());
    kwargs.assert_all_used()?;
    Ok(Value::from(pyjson::dumps(&value, &layout)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(source: &str, ctx: Value) -> Result<String, Error> {
        let env = environment(source.to_string())?;
        let out = env.get_template(NAME)?.render(ctx);
        out
    }

    #[test]
    fn hugging_face_semantics() {
        let ctx: Value =
            serde_json::from_str(r#"{"x":{"b":"é<","a":[1,2]},"s":"  hi  ","n":null,"t":true}"#)
                .unwrap();
        assert_eq!(
            render("{{ x|tojson }}|{{ x|tojson(indent=2) }}", ctx.clone()).unwrap(),
            "{\"b\": \"é<\", \"a\": [1, 2]}|{\n  \"b\": \"é<\",\n  \"a\": [\n    1,\n    2\n  ]\n}"
        );
        assert_eq!(
            render(
                "{{ n }} {{ t }} {{ x }} [{{ s.strip() }}] {{ 'a,b'.split(',') }}",
                ctx.clone()
            )
            .unwrap(),
            "None True {'b': 'é<', 'a': [1, 2]} [hi] ['a', 'b']"
        );
        assert_eq!(
            render(
                "{% for k, v in x.items() %}{{ k }}{% endfor %}",
                ctx.clone()
            )
            .unwrap(),
            "ba",
            "key order is kept"
        );
        let err = render("{{ raise_exception('no') }}", ctx.clone()).unwrap_err();
        assert!(err.to_string().contains("no"));
        assert_eq!(
            render("{% if true %}\n  a\n{% endif %}\nb\n", ctx).unwrap(),
            "  a\nb",
            "trim_blocks, lstrip_blocks, no trailing newline"
        );
    }
}
