//! A chat template through a real Envoy: under Qwen3's template, which drops a turn's reasoning
//! once a later user turn follows it, a conversation's next turn matches its previous turn's keys
//! exactly as far as the engine's prompt is the same, and no further.
//!
//! Turn B (a tool call with its reasoning, and the tool's result) renders the reasoning; turn C
//! (B's answer and a new question) does not, so the engine that served B has C's prompt cached
//! only up to where B's assistant turn starts. kvroute keyed over its own canonical text (where
//! reasoning never appears) would find all of B in C. Two gateways tell the depth apart: one
//! follows a match covering just under the expected depth (`affinity`), the other needs just
//! over it and so does not.

use crate::common;

use kvroute::gateway::stat_names;
use kvroute::template::Outcome;
use std::path::PathBuf;

use common::{debug_config, Fleet};
use kvroute::prefix::{PrefixKeys, Shape};
use kvroute::template::Templates;
use serde_json::{json, Value};

const CHUNK: usize = 128;

fn template() -> String {
    let dir = PathBuf::from(std::env::var_os("KVROUTE_TEMPLATES").expect(
        "KVROUTE_TEMPLATES is unset: run through `make test` (or `make template-deps` and export it)",
    ));
    std::fs::read_to_string(dir.join("qwen3.jinja")).expect("qwen3.jinja: `make template-deps`")
}

fn words(tag: &str, n: usize) -> String {
    (0..n)
        .map(|i| format!("{tag}{}", i * 7 % 101))
        .collect::<Vec<_>>()
        .join(" ")
}

fn turns() -> [Value; 3] {
    let system = json!({"role":"system","content":words("policy", 120)});
    let question = json!({"role":"user","content":words("question", 150)});
    let call = json!({"role":"assistant","content":"","reasoning":words("thinking", 200),
        "tool_calls":[{"id":"c1","type":"function","function":{"name":"lookup","arguments":"{\"q\":\"ledger\"}"}}]});
    let result = json!({"role":"tool","tool_call_id":"c1","content":words("row", 150)});
    let answer = json!({"role":"assistant","content":words("answer", 60)});
    let next = json!({"role":"user","content":"And last year?"});
    let body = |messages: Vec<Value>| json!({"model":"qwen3","stream":false,"messages":messages});
    [
        body(vec![system.clone(), question.clone()]),
        body(vec![
            system.clone(),
            question.clone(),
            call.clone(),
            result.clone(),
        ]),
        body(vec![system, question, call, result, answer, next]),
    ]
}

fn keys(templates: &Templates, body: &Value) -> (Vec<u64>, String) {
    let p = templates.render(body.to_string().as_bytes()).unwrap();
    let shape = Shape {
        chunk_size: CHUNK,
        max_chunks: 256,
        group_bytes: 4096,
    };
    let k = PrefixKeys::salted(None, &p.model, &p.text, p.head, p.history, shape);
    (k.keys, String::from_utf8(p.text).unwrap())
}

fn shared(a: &[u64], b: &[u64]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

async fn decision_of_last_turn(cache_threshold: f64) -> (String, u64) {
    let mut config = debug_config();
    config["chat_template"] = json!(template());
    config["chunk_size"] = json!(CHUNK);
    config["cache_threshold"] = json!(cache_threshold);
    let fleet = Fleet::kvroute(4, config, |o| o.concurrency = 1).await;
    let [a, b, c] = turns();
    for body in [&a, &b] {
        assert_eq!(fleet.chat(body).await.status, 200);
    }
    let reply = fleet.chat(&c).await;
    assert_eq!(reply.status, 200);
    let rendered = fleet
        .stat_sum_reaching(&stat_names::template(Outcome::Rendered), 3)
        .await;
    (reply.decision.unwrap_or_default(), rendered)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_turn_matches_the_last_as_far_as_the_engine_prompt_is_the_same() {
    let mut templates = Templates::default();
    templates.set_default(&json!(template())).unwrap();
    let [_, b, c] = turns();
    let ((kb, tb), (kc, tc)) = (keys(&templates, &b), keys(&templates, &c));
    // Where the engine's two prompts part: B's reasoning, which C no longer renders.
    let same = tb
        .bytes()
        .zip(tc.bytes())
        .take_while(|(x, y)| x == y)
        .count();
    let header = "<|im_start|>assistant\n";
    let turn = tb
        .find(&format!("{header}<think>"))
        .expect("B renders its reasoning")
        + header.len();
    assert!(!tc.contains("thinking0"), "C drops it");
    assert!(
        (turn..turn + "<think>".len()).contains(&same),
        "{}",
        &tb[same..]
    );
    let depth = shared(&kb, &kc);
    assert_eq!(
        depth,
        same / CHUNK,
        "the keys part in the chunk where the prompts do"
    );
    let fraction = depth as f64 / kc.len() as f64;
    let step = 0.5 / kc.len() as f64;

    let (followed, rendered) = decision_of_last_turn(fraction - step).await;
    assert_eq!(
        followed,
        "affinity",
        "a match of {depth} of {} chunks",
        kc.len()
    );
    assert_eq!(rendered, 3, "every turn rendered by the template");
    let (not_followed, _) = decision_of_last_turn(fraction + step).await;
    assert_ne!(
        not_followed, "affinity",
        "the match reaches no further than {depth} chunks"
    );
}
