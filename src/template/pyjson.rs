//! Template values printed as Python prints them: `json.dumps` (transformers' `tojson`) and `str()`.

use std::fmt::Write;

use minijinja::value::{Value, ValueKind};
use minijinja::{Error, ErrorKind};

/// How `json.dumps` lays a value out: `indent` (None: one line), its separators, `sort_keys`.
pub struct Layout {
    pub indent: Option<String>,
    pub item_sep: String,
    pub key_sep: String,
    pub sort_keys: bool,
    pub ensure_ascii: bool,
}

impl Layout {
    /// `json.dumps`'s defaults for an indent: items end with "," and a newline when indented,
    /// ", " on one line.
    pub fn new(indent: Option<String>) -> Layout {
        let item_sep = if indent.is_some() { "," } else { ", " };
        Layout {
            indent,
            item_sep: item_sep.to_string(),
            key_sep: ": ".to_string(),
            sort_keys: false,
            ensure_ascii: false,
        }
    }
}

/// `json.dumps(value, ...)` as Python writes it.
pub fn dumps(value: &Value, layout: &Layout) -> Result<String, Error> {
    let mut out = String::new();
    write_json(&mut out, value, layout, 0)?;
    Ok(out)
}

fn newline(out: &mut String, layout: &Layout, depth: usize) {
    if let Some(indent) = &layout.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(indent);
        }
    }
}

fn write_json(out: &mut String, v: &Value, layout: &Layout, depth: usize) -> Result<(), Error> {
    match v.kind() {
        ValueKind::Undefined => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "Object of type Undefined is not JSON serializable",
            ))
        }
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => write_number(out, v, true),
        ValueKind::String => json_string(out, v.as_str().unwrap_or_default(), layout.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&layout.item_sep);
                }
                newline(out, layout, depth + 1);
                write_json(out, item, layout, depth + 1)?;
            }
            newline(out, layout, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if layout.sort_keys {
                keys.sort();
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&layout.item_sep);
                }
                newline(out, layout, depth + 1);
                match key.kind() {
                    ValueKind::String => {
                        json_string(out, key.as_str().unwrap_or_default(), layout.ensure_ascii)
                    }
                    ValueKind::None => out.push_str("\"null\""),
                    ValueKind::Bool => out.push_str(if key.is_true() {
                        "\"true\""
                    } else {
                        "\"false\""
                    }),
                    ValueKind::Number => {
                        out.push('"');
                        write_number(out, key, true);
                        out.push('"');
                    }
                    _ => {
                        return Err(Error::new(
                            ErrorKind::InvalidOperation,
                            "keys must be str, int, float, bool or None",
                        ))
                    }
                }
                out.push_str(&layout.key_sep);
                write_json(out, &v.get_item(key)?, layout, depth + 1)?;
            }
            newline(out, layout, depth);
            out.push('}');
        }
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("Object of type {} is not JSON serializable", v.kind()),
            ))
        }
    }
    Ok(())
}

/// A number: an integer as its digits, a float as Python's `repr` (`1.0`, `1e-05`, `1e+16`);
/// JSON writes NaN and infinities as Python's `json` module does.
fn write_number(out: &mut String, v: &Value, json: bool) {
    if v.is_integer() {
        let _ = write!(out, "{v}");
        return;
    }
    let x = f64::try_from(v.clone()).unwrap_or(f64::NAN);
    out.push_str(&float_repr(x, json));
}

/// Python's `repr(float)`: the shortest digits that read back, in fixed notation for decimal
/// exponents from -4 to 15, else scientific with a signed exponent of at least two digits.
pub fn float_repr(x: f64, json: bool) -> String {
    if x.is_nan() {
        return if json { "NaN" } else { "nan" }.to_string();
    }
    if x.is_infinite() {
        let s = if json { "Infinity" } else { "inf" };
        return if x < 0.0 {
            format!("-{s}")
        } else {
            s.to_string()
        };
    }
    if x == 0.0 {
        return if x.is_sign_negative() { "-0.0" } else { "0.0" }.to_string();
    }
    let sci = format!("{x:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exp) {
        let point = exp + 1; // digits before the decimal point
        let s = if point <= 0 {
            format!("0.{}{digits}", "0".repeat((-point) as usize))
        } else if point as usize >= digits.len() {
            format!("{digits}{}.0", "0".repeat(point as usize - digits.len()))
        } else {
            let (a, b) = digits.split_at(point as usize);
            format!("{a}.{b}")
        };
        format!("{sign}{s}")
    } else {
        let (first, rest) = digits.split_at(1);
        let m = if rest.is_empty() {
            first.to_string()
        } else {
            format!("{first}.{rest}")
        };
        let e_sign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{m}e{e_sign}{:02}", exp.abs())
    }
}

/// A JSON string as Python's `json` writes it: quotes, backslashes and control characters
/// escaped, everything else as it is (or as `\uXXXX` with `ensure_ascii`).
fn json_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && !c.is_ascii() => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{u:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `str(value)`, which Jinja2 prints: `None`, `True`, `1.0`, `['a', {'b': 1}]`.
pub fn py_str(out: &mut String, v: &Value) {
    match v.kind() {
        ValueKind::Undefined => {}
        ValueKind::String => out.push_str(v.as_str().unwrap_or_default()),
        _ => py_repr(out, v),
    }
}

fn py_repr(out: &mut String, v: &Value) {
    match v.kind() {
        ValueKind::Undefined => {}
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if v.is_true() { "True" } else { "False" }),
        ValueKind::Number => write_number(out, v, false),
        ValueKind::String => repr_string(out, v.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            for (i, item) in v.try_iter().into_iter().flatten().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(out, &item);
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in v.try_iter().into_iter().flatten().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(out, &key);
                out.push_str(": ");
                py_repr(out, &v.get_item(&key).unwrap_or_default());
            }
            out.push('}');
        }
        _ => {
            let _ = write!(out, "{v}");
        }
    }
}

/// Python's `repr(str)`: single quotes unless the text has one and no double quote.
fn repr_string(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json(text: &str, indent: Option<&str>) -> String {
        let v: Value = serde_json::from_str(text).unwrap();
        dumps(&v, &Layout::new(indent.map(str::to_string))).unwrap()
    }

    #[test]
    fn dumps_like_python() {
        assert_eq!(
            json(r#"{"b":1,"a":[true,null,"é\n"]}"#, None),
            r#"{"b": 1, "a": [true, null, "é\n"]}"#
        );
        assert_eq!(
            json(r#"{"a":[1,{}],"b":[]}"#, Some("  ")),
            "{\n  \"a\": [\n    1,\n    {}\n  ],\n  \"b\": []\n}"
        );
        assert_eq!(
            json(r#"[1.0, 1e-5, 1e16, 0.1, 123.456, -2.5e-7]"#, None),
            "[1.0, 1e-05, 1e+16, 0.1, 123.456, -2.5e-07]"
        );
        assert_eq!(
            json(r#""<tag> & 'q' \u0001""#, None),
            r#""<tag> & 'q' \u0001""#
        );
    }

    #[test]
    fn str_like_python() {
        let v: Value = serde_json::from_str(r#"{"a":[true,null,"it's",1.5]}"#).unwrap();
        let mut out = String::new();
        py_str(&mut out, &v);
        assert_eq!(out, r#"{'a': [True, None, "it's", 1.5]}"#);
    }
}
