//! kvroute's prefix keys against the engine's rendering: requests that share a prefix the engine
//! caches (the sim's Qwen-style template, tokenizer and chained block hashes, as vLLM's prefix
//! cache) share kvroute keys, about as much of the prompt, and requests that don't, don't.

use kvroute::prefix::{PrefixKeys, Shape};
use kvroute::request::{self, Api};
use kvroute_sim::prefix_cache::block_hashes;
use kvroute_sim::request::{cache_salt, prompt_tokens, Endpoint};
use serde_json::{json, Value};

const BLOCK: usize = 16;
const SHAPE: Shape = Shape {
    chunk_size: 512,
    max_chunks: 256,
    group_bytes: 4096,
};

/// `n` words of text seeded by `tag`, about 5 bytes each.
fn words(tag: &str, n: usize) -> String {
    (0..n)
        .map(|i| format!("{tag}{}", (i * 7919 + tag.len()) % 1000))
        .collect::<Vec<_>>()
        .join(" ")
}

fn tools(app: &str) -> Value {
    let tool = |i: usize| {
        json!({"type":"function","function":{"name":format!("{app}_tool_{i}"),
            "description": words(&format!("{app}d{i}"), 60),
            "parameters":{"type":"object","properties":{"q":{"type":"string"}}}}})
    };
    Value::Array((0..6).map(tool).collect())
}

fn call(id: &str, args: &str) -> Value {
    json!({"role":"assistant","content":null,"tool_calls":[{"id":id,"type":"function",
        "function":{"name":"search","arguments":args}}]})
}

fn result(id: &str, text: &str) -> Value {
    json!({"role":"tool","tool_call_id":id,"content":text})
}

/// An agent step: tools, system prompt, task, and `steps` calls with their results.
fn agent(tools_of: &str, system: &str, steps: usize) -> Value {
    agent_with(tools_of, words(system, 700), steps)
}

fn agent_with(tools_of: &str, system: String, steps: usize) -> Value {
    let mut messages = vec![
        json!({"role":"system","content":system}),
        json!({"role":"user","content":words("task", 80)}),
    ];
    for s in 0..steps {
        let id = format!("call_{s}");
        messages.push(call(&id, &format!("{{\"q\":\"step {s}\"}}")));
        messages.push(result(&id, &words(&format!("result{s}"), 150)));
    }
    json!({"model":"m","tools":tools(tools_of),"messages":messages})
}

fn doc_chat(doc: &str, question: &str) -> Value {
    json!({"model":"m","messages":[
        {"role":"system","content":words(doc, 900)},
        {"role":"user","content":words(question, 60)}]})
}

fn salted(mut body: Value, salt: &str) -> Value {
    body["cache_salt"] = json!(salt);
    body
}

fn image(data: &str) -> Value {
    json!({"type":"image_url","image_url":{"url":format!("data:image/png;base64,{data}")}})
}

fn picture_chat(picture: &str, question: &str) -> Value {
    json!({"model":"m","messages":[
        {"role":"system","content":words("vision", 150)},
        {"role":"user","content":[image(&picture.repeat(4000)),
            {"type":"text","text":words(question, 100)}]}]})
}

/// Fraction of `a`'s cacheable blocks the engine would find cached after serving `b`.
fn engine_shared(a: &Value, b: &Value) -> f64 {
    let blocks = |v: &Value| {
        let salt = cache_salt(v).unwrap();
        block_hashes(
            &prompt_tokens(Endpoint::Chat, v).unwrap().0,
            BLOCK,
            salt.as_deref(),
        )
    };
    let (ha, hb) = (blocks(a), blocks(b));
    let shared = ha.iter().zip(&hb).take_while(|(x, y)| x == y).count();
    shared as f64 / ha.len().max(1) as f64
}

fn keys(v: &Value) -> PrefixKeys {
    let p = request::parse(Api::Chat, v.to_string().as_bytes()).unwrap();
    PrefixKeys::salted(
        p.salt.as_deref(),
        &p.model,
        &p.text,
        p.head,
        p.history,
        SHAPE,
    )
}

/// Fraction of `a`'s keys that `b` shares.
fn kvroute_shared(a: &Value, b: &Value) -> f64 {
    let (ka, kb) = (keys(a), keys(b));
    let shared = ka
        .keys
        .iter()
        .zip(&kb.keys)
        .take_while(|(x, y)| x == y)
        .count();
    shared as f64 / ka.keys.len().max(1) as f64
}

/// (what, a, b, how far kvroute's shared fraction may be from the engine's)
fn cases() -> Vec<(&'static str, Value, Value, f64)> {
    let parts = |v: &Value| {
        let mut v = v.clone();
        for m in v["messages"].as_array_mut().unwrap() {
            if let Some(text) = m["content"].as_str() {
                m["content"] = json!([{"type":"text","text":text}]);
            }
        }
        v
    };
    let renamed = {
        let mut v = agent("app1", "sysA", 3);
        for m in v["messages"].as_array_mut().unwrap() {
            if let Some(id) = m["tool_call_id"].as_str() {
                m["tool_call_id"] = json!(format!("{id}-x"));
            }
            if let Some(calls) = m["tool_calls"].as_array_mut() {
                calls[0]["id"] = json!("other");
            }
            m["name"] = json!("someone");
        }
        v
    };
    let other_args = {
        let mut v = agent("app1", "sysA", 3);
        v["messages"][4] = call("call_1", "{\"q\":\"elsewhere\"}");
        v
    };
    vec![
        (
            "same system prompt, other tools: the system prompt is shared",
            agent("app1", "sysA", 0),
            agent("app2", "sysA", 0),
            0.2,
        ),
        (
            "same tools, other system prompt: nothing is shared",
            agent("app1", "sysA", 0),
            agent("app1", "sysB", 0),
            0.0,
        ),
        (
            "an agent's next step extends its previous one",
            agent("app1", "sysA", 4),
            agent("app1", "sysA", 3),
            0.1,
        ),
        (
            "call ids and message names do not render",
            agent("app1", "sysA", 3),
            renamed,
            0.0,
        ),
        (
            "other tool call arguments diverge where they start",
            agent("app1", "sysA", 3),
            other_args,
            0.1,
        ),
        (
            "content parts render like the string",
            parts(&doc_chat("doc1", "q1")),
            doc_chat("doc1", "q1"),
            0.0,
        ),
        (
            "one document, two questions",
            doc_chat("doc1", "q1"),
            doc_chat("doc1", "q2"),
            0.15,
        ),
        (
            "one tenant shares its document",
            salted(doc_chat("doc1", "q1"), "tenant-a"),
            salted(doc_chat("doc1", "q2"), "tenant-a"),
            0.15,
        ),
        (
            "tenants never share a document",
            salted(doc_chat("doc1", "q1"), "tenant-a"),
            salted(doc_chat("doc1", "q1"), "tenant-b"),
            0.0,
        ),
        (
            "a salted request shares nothing with an unsalted one",
            salted(doc_chat("doc1", "q1"), "tenant-a"),
            doc_chat("doc1", "q1"),
            0.0,
        ),
        (
            // An image is 256 tokens to the engine and a few bytes to kvroute: the shares differ
            // in size, not in whether they reach past the image.
            "one image, two questions: shared through the image",
            picture_chat("A", "q1"),
            picture_chat("A", "q2"),
            0.35,
        ),
        (
            "two images: shared up to the image",
            picture_chat("A", "q1"),
            picture_chat("B", "q1"),
            0.2,
        ),
    ]
}

#[test]
fn requests_share_keys_as_far_as_the_engine_shares_cached_blocks() {
    let mut failures = Vec::new();
    for (what, a, b, tolerance) in cases() {
        let (engine, kvroute) = (engine_shared(&a, &b), kvroute_shared(&a, &b));
        let agree = (engine == 0.0) == (kvroute == 0.0)
            && (engine == 1.0) == (kvroute == 1.0)
            && (engine - kvroute).abs() <= tolerance;
        if !agree {
            failures.push(format!("{what}: engine {engine:.2}, kvroute {kvroute:.2}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn the_image_case_reaches_past_the_image_in_both() {
    // The cases above must be able to tell: an image alone is about a quarter of the prompt.
    let (a, b) = (picture_chat("A", "q1"), picture_chat("B", "q1"));
    let tokens = prompt_tokens(Endpoint::Chat, &a).unwrap().0.len();
    let (other, same) = (
        engine_shared(&a, &b),
        engine_shared(&a, &picture_chat("A", "q2")),
    );
    assert!(other < 0.5 && same > other + 0.2, "{other} {same}");
    let (other, same) = (
        kvroute_shared(&a, &b),
        kvroute_shared(&a, &picture_chat("A", "q2")),
    );
    assert!(other < 0.5 && same > other + 0.2, "kvroute: {other} {same}");
    assert!(tokens > 4 * BLOCK * 10);
}

#[test]
fn groups_are_the_app_the_document_and_the_tenant() {
    let group = |v: &Value| keys(v).group;
    assert_eq!(
        group(&agent("app1", "sysA", 0)),
        group(&agent("app1", "sysA", 5)),
        "every step of an app's sessions is one group"
    );
    // A short common system prompt: the tools tell the apps apart. (Apps sharing more than
    // `group_bytes` of system prompt are one group by design: they share that much cache.)
    let short = || "You are a careful agent.".to_string();
    assert_ne!(
        group(&agent_with("app1", short(), 0)),
        group(&agent_with("app2", short(), 0))
    );
    let doc = |salt| salted(doc_chat("doc1", "q1"), salt);
    assert_eq!(
        group(&doc("t1")),
        group(&salted(doc_chat("doc1", "q9"), "t1"))
    );
    assert_ne!(
        group(&doc("t1")),
        group(&doc("t2")),
        "tenants of one document are different groups"
    );
}
