//! The closed loop, through a real Envoy over a simulated vLLM fleet: when a replica's engine
//! reports that it no longer caches a conversation kvroute sent there, kvroute stops sending that
//! replica's other old conversations there by affinity, and follows again what it recomputed.
//! (A burst on a prefix still being prefilled is no eviction: the grace rule, unit-tested in
//! `src/eviction.rs`; the sim, like vLLM, caches blocks once scheduled, so a burst here finds
//! them.)

use crate::common;

use kvroute::gateway::stat_names::{Counter, Gauge};
use kvroute_sim::fleet::Fleet;
use kvroute_sim::spec::FleetSpec;
use serde_json::{json, Value};
use std::time::Duration;

const MODEL: &str = "Qwen/Qwen3-32B";

fn system() -> String {
    (0..40)
        .map(|i| format!("Rule {i}: answer as the support desk of the shop would. "))
        .collect()
}

/// A user turn long enough that a conversation's history is most of its next request.
fn long_turn(tag: &str) -> String {
    (0..50)
        .map(|i| format!("{tag} detail {i}: the invoice lists another amount. "))
        .collect()
}

fn body(messages: Value) -> Value {
    json!({"model": MODEL, "max_tokens": 2, "stream": false, "messages": messages})
}

/// The first turn of conversation `tag`, and its second turn (the first answered).
fn turns(tag: &str) -> (Value, Value) {
    let first = json!([{"role": "system", "content": system()},
                       {"role": "user", "content": long_turn(tag)}]);
    let mut second = first.clone();
    if let Some(m) = second.as_array_mut() {
        m.push(json!({"role": "assistant", "content": "Let me check that."}));
        m.push(json!({"role": "user", "content": format!("{tag}: any news?")}));
    }
    (body(first), body(second))
}

/// Sends `body`; returns kvroute's decision and the replica that served it (requests are sent
/// one at a time, so the replica whose request count moved).
async fn send(sim: &Fleet, url: &str, body: &Value) -> (String, usize) {
    let before: Vec<u64> = sim
        .replicas
        .iter()
        .map(|r| r.replica.snapshot().requests)
        .collect();
    let resp = common::client()
        .post(url)
        .json(body)
        .send()
        .await
        .expect("request");
    assert_eq!(resp.status(), 200);
    let decision = resp
        .headers()
        .get("x-kvroute-decision")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    resp.bytes().await.expect("body");
    let served = sim
        .replicas
        .iter()
        .zip(&before)
        .position(|(r, &b)| r.replica.snapshot().requests > b)
        .expect("a replica served it");
    (decision, served)
}

async fn stat(envoy: &kvroute_harness::Envoy, name: &str) -> u64 {
    envoy.stat(name).await.expect("stats").unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_evicted_stops_drawing_its_old_conversations() {
    let spec = FleetSpec {
        replicas: 3,
        time_scale: 0.05,
        ..FleetSpec::default()
    };
    let config = json!({"stats_interval_ms": 200, "debug_header": true,
                        "eviction_grace_ms": 0});
    let (sim, envoy) = common::kvroute_over_sim_with(spec, config).await;
    let url = format!("{}/v1/chat/completions", envoy.url());

    // The gateway places the group by its balanced assignment from now on, once it has routed
    // two of its requests. A warm-up that fell back (on a stalled machine the engines' loads can
    // go stale for a moment) is not counted, so send until two were routed.
    let mut sent = 0;
    let mut routed = 0;
    while routed < 2 {
        sent += 1;
        assert!(sent <= 20, "20 warm-ups and {routed} routed by kvroute");
        let (decision, _) = send(&sim, &url, &turns(&format!("warm-up {sent}")).0).await;
        if !decision.starts_with("fallback") {
            routed += 1;
        }
    }
    envoy
        .wait_for_stat(
            Gauge::GroupsPlaced.name(),
            |v| v >= 1,
            Duration::from_secs(30),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    common::wait_for_fresh_poll_of(&envoy).await;

    // Two conversations served by one replica (a group's conversations may split between
    // several), where each second turn follows.
    sent += 1; // b1
    let (b1, b2) = turns("order 42");
    let (_, home) = send(&sim, &url, &b1).await;
    let mut n = 0;
    let a2 = loop {
        let (a1, a2) = turns(&format!("order {n}"));
        sent += 1;
        if send(&sim, &url, &a1).await.1 == home {
            break a2;
        }
        n += 1;
        assert!(n < 30, "no conversation of 30 went where order 42 did");
    };
    assert_eq!(send(&sim, &url, &a2).await, ("affinity".into(), home));

    sent += 1; // a2
               // The engine drops it all (every prefix is past the grace: zero here, so nothing counts as
               // still prefilling).
    sim.replicas[home].replica.reset_prefix_cache();
    assert_eq!(stat(&envoy, Counter::EvictionsSeen.name()).await, 0);

    // Conversation a's third turn still follows its history there, and the engine's report
    // (nothing cached of what the map predicted) shows the eviction.
    let mut a3 = a2.clone();
    if let Some(m) = a3["messages"].as_array_mut() {
        m.push(json!({"role": "assistant", "content": "Nothing yet."}));
        m.push(json!({"role": "user", "content": "And now?"}));
    }
    assert_eq!(send(&sim, &url, &a3).await, ("affinity".into(), home));
    envoy
        .wait_for_stat(
            Counter::EvictionsSeen.name(),
            |v| v == 1,
            Duration::from_secs(10),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));

    // Conversation b's history, last used on that replica before a's, is gone too (engines evict
    // the least recently used first): its second turn is placed with its group, not by affinity.
    let (decision, _) = send(&sim, &url, &b2).await;
    assert_eq!(decision, "home");
    // And a's history, which that replica just computed again, is followed again.
    let mut a4 = a3.clone();
    if let Some(m) = a4["messages"].as_array_mut() {
        m.push(json!({"role": "assistant", "content": "Still nothing."}));
        m.push(json!({"role": "user", "content": "Tomorrow?"}));
    }
    assert_eq!(send(&sim, &url, &a4).await, ("affinity".into(), home));
    sent += 3; // a3, b2, a4
    envoy
        .wait_for_stat(
            Counter::UsageResponses.name(),
            |v| v == sent,
            Duration::from_secs(10),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        stat(&envoy, Counter::EvictionsSeen.name()).await,
        1,
        "what was recomputed is no eviction"
    );
}
