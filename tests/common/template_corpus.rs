//! The chat requests and templates the template conformance tests render: against transformers
//! (tests/template_conformance.rs) and against a real vLLM's `/tokenize` (tests/real_vllm.rs).

use serde_json::{json, Value};

/// The packaged templates the conformance covers (trl's copies of the Hub's, axolotl's Mistral).
pub const PACKAGED: [&str; 16] = [
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
pub const WRITTEN: [(&str, &str); 2] = [
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

pub fn words(tag: &str, n: usize) -> String {
    (0..n)
        .map(|i| format!("{tag}{}", (i * 31 + tag.len()) % 97))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Tools as a client writes them, keys in its own order.
pub fn tools() -> Value {
    serde_json::from_str(
        r#"[{"type":"function","function":{"name":"get_weather","description":"Weather in a city, today or on a date","parameters":{"type":"object","properties":{"city":{"type":"string","description":"City name, e.g. Zürich"},"date":{"type":"string"},"units":{"type":"string","enum":["metric","imperial"]}},"required":["city"]}}},
            {"type":"function","function":{"name":"search","description":"Search the handbook","parameters":{"type":"object","properties":{"query":{"type":"string"},"limit":{"type":"integer","minimum":1,"maximum":20}},"required":["query"]}}}]"#,
    )
    .unwrap()
}

pub fn call(id: &str, name: &str, args: &str) -> Value {
    json!({"id": id, "type": "function", "function": {"name": name, "arguments": args}})
}

/// Conversations (without the system message), each exercising something templates do.
pub fn conversations() -> Vec<(&'static str, Vec<Value>)> {
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

pub fn systems() -> Vec<Option<Value>> {
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
pub fn corpus() -> Vec<(&'static str, Value)> {
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
