//! Rules of the engine's rendering that change where a real Envoy with kvroute sends requests:
//! tenants (`cache_salt`) never share a group or a history, apps that share a tool list but not
//! a system prompt are different groups, and a turn sent as content parts follows the history it
//! continues.

use crate::common;

use common::{debug_config, served_by, Fleet, Reply};
use serde_json::{json, Value};
use std::collections::{HashMap, HashSet};

/// A long shared document (several chunks), the same for every tenant.
fn document() -> String {
    (0..60)
        .map(|i| format!("Clause {i} of the shared handbook: keep records for {i} years. "))
        .collect()
}

/// A long user turn, so a conversation's history reaches well past its head.
fn turn(tag: &str) -> String {
    (0..30)
        .map(|i| format!("{tag} detail {i}: the numbers look different this quarter. "))
        .collect()
}

fn salted(salt: &str, messages: Value) -> Value {
    json!({"model": "test", "stream": false, "cache_salt": salt, "messages": messages})
}

/// Sends each body twice, then waits until the gateway places one group per body by its
/// balanced assignment and every worker has seen them.
async fn warm_up(fleet: &Fleet, bodies: &[Value]) {
    let groups: Vec<Vec<Value>> = bodies.iter().map(|b| vec![b.clone(), b.clone()]).collect();
    common::warm_up_with(fleet, &groups).await;
}

fn decision(reply: &Reply) -> &str {
    reply.decision.as_deref().unwrap_or("")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_with_the_same_document_are_groups_of_their_own_and_share_no_history() {
    let fleet = Fleet::kvroute(4, debug_config(), |o| o.concurrency = 2).await;
    let tenants = ["tenant-a", "tenant-b", "tenant-c", "tenant-d"];
    let ask = |salt: &str, q: usize| {
        salted(
            salt,
            json!([{"role": "system", "content": document()},
                   {"role": "user", "content": format!("question {q}")}]),
        )
    };
    let bodies: Vec<Value> = tenants.iter().map(|t| ask(t, 0)).collect();
    warm_up(&fleet, &bodies).await;
    let mut served: HashMap<&str, HashSet<usize>> = HashMap::new();
    for q in 1..6 {
        for t in tenants {
            let reply = fleet.chat(&ask(t, q)).await;
            served
                .entry(t)
                .or_default()
                .insert(served_by(&fleet, &reply));
        }
    }
    let homes: HashSet<usize> = served.values().flatten().copied().collect();
    assert!(
        served.values().all(|b| b.len() == 1),
        "each tenant sticks to one backend: {served:?}"
    );
    assert_eq!(homes.len(), 4, "four tenants, four homes: {served:?}");

    // Tenant a's conversation continues where it was served; tenant b sending the very same
    // conversation has no cached history anywhere, so it is not sent there by affinity.
    let conversation = json!([
        {"role": "system", "content": document()},
        {"role": "user", "content": turn("first")},
        {"role": "assistant", "content": turn("answer")},
        {"role": "user", "content": "and then?"},
    ]);
    let opening = json!([conversation[0], conversation[1]]);
    served_by(&fleet, &fleet.chat(&salted("tenant-a", opening)).await);
    let a = fleet.chat(&salted("tenant-a", conversation.clone())).await;
    served_by(&fleet, &a);
    assert_eq!(decision(&a), "affinity", "tenant a follows its own history");
    let b = fleet.chat(&salted("tenant-b", conversation)).await;
    served_by(&fleet, &b);
    assert_eq!(decision(&b), "home", "tenant b has no history to follow");
}

/// An app: a shared tool list of several KB (more than `group_bytes`), its own system prompt.
fn app_request(app: usize, task: &str) -> Value {
    let tools: Vec<Value> = (0..12)
        .map(|t| {
            json!({"type": "function", "function": {"name": format!("shared_tool_{t}"),
                "description": "Looks things up in the company knowledge base. ".repeat(10),
                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}})
        })
        .collect();
    json!({"model": "test", "stream": false, "tools": tools, "messages": [
        {"role": "system", "content": format!("You are agent {app}. {}", turn(&format!("app {app} rule")))},
        {"role": "user", "content": task},
    ]})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apps_sharing_a_tool_list_are_told_apart_by_their_system_prompt() {
    let fleet = Fleet::kvroute(4, debug_config(), |o| o.concurrency = 2).await;
    let bodies: Vec<Value> = (0..4).map(|a| app_request(a, "warm up")).collect();
    assert!(bodies[0]["tools"].to_string().len() > 4096);
    warm_up(&fleet, &bodies).await;
    let mut served: HashMap<usize, HashSet<usize>> = HashMap::new();
    for task in 0..5 {
        for app in 0..4 {
            let reply = fleet.chat(&app_request(app, &format!("task {task}"))).await;
            served
                .entry(app)
                .or_default()
                .insert(served_by(&fleet, &reply));
        }
    }
    let homes: HashSet<usize> = served.values().flatten().copied().collect();
    assert!(served.values().all(|b| b.len() == 1), "{served:?}");
    assert_eq!(homes.len(), 4, "four apps, four homes: {served:?}");

    // An agent's next step (a tool call and its result) follows the step before it, and so does
    // a step whose task comes as content parts instead of a string.
    let mut step = app_request(0, &turn("task"));
    let first = fleet.chat(&step).await;
    let home = served_by(&fleet, &first);
    let messages = step["messages"].as_array_mut().unwrap();
    messages.push(
        json!({"role": "assistant", "content": null, "tool_calls": [{"id": "call_1",
        "type": "function", "function": {"name": "shared_tool_3", "arguments": "{\"q\":\"x\"}"}}]}),
    );
    messages.push(json!({"role": "tool", "tool_call_id": "call_1", "content": turn("result")}));
    let next = fleet.chat(&step).await;
    assert_eq!(
        (served_by(&fleet, &next), decision(&next)),
        (home, "affinity")
    );
    step["messages"][1]["content"] = json!([{"type": "text", "text": turn("task")}]);
    step["messages"][2]["tool_calls"][0]["id"] = json!("call_other_id");
    let parts = fleet.chat(&step).await;
    assert_eq!(
        (served_by(&fleet, &parts), decision(&parts)),
        (home, "affinity")
    );
}
