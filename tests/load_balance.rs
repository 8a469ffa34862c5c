//! An overloaded backend sheds new requests of its own prefix to others, and gets them back once
//! its load drops: affinity yields to balance only while the thresholds are exceeded. (The test
//! follows one conversation: a lone group's conversations split between replicas.)

use crate::common;

use common::{chat_body, served_by, system_prompt, wait_for_fresh_poll, warm_up, Fleet};
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overloaded_backend_sheds_its_prefix_and_affinity_resumes_when_load_drops() {
    let config =
        json!({ "debug_header": true, "stats_interval_ms": 200, "balance_abs_threshold": 4 });
    let fleet = Arc::new(Fleet::kvroute(4, config, |_| {}).await);
    let prompt = system_prompt(7);
    // Placed by the balanced assignment from now on, as a gateway that has seen the group.
    warm_up(&fleet, 7..8).await;
    let first = fleet.chat(&chat_body(&prompt, QUESTION, false)).await;
    let home = served_by(&fleet, &first);

    // Pile up requests of the prefix on its home backend.
    fleet.backends[home].set_delay(Duration::from_secs(4));
    let mut pile = Vec::new();
    for i in 0..12 {
        let (fleet, prompt) = (fleet.clone(), prompt.clone());
        pile.push(tokio::spawn(async move {
            let mut body = chat_body(&prompt, QUESTION, false);
            body["seed"] = json!(i);
            fleet.chat(&body).await
        }));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Once the pile has arrived the home is over the absolute threshold (4); kvroute itself sends
    // the rest of the pile elsewhere, so that is as loaded as it gets.
    let arrived = || fleet.backends.iter().map(|b| b.received()).sum::<u64>() >= 15;
    wait_until(
        || arrived() && fleet.backends[home].in_flight() > 4,
        "home backend never got loaded",
    )
    .await;
    let shed = ask_eight(&fleet, &prompt, "while loaded").await;
    assert!(
        shed.iter().all(|(b, _)| *b != home),
        "overloaded backend {home} still chosen: {shed:?}"
    );

    for reply in pile {
        assert_eq!(reply.await.unwrap().status, 200);
    }
    fleet.backends[home].set_delay(Duration::ZERO);
    wait_until(
        || fleet.backends[home].in_flight() == 0,
        "home backend never drained",
    )
    .await;
    // Let kvroute's poll of Envoy's per-host load see the drained backend.
    wait_for_fresh_poll(&fleet).await;
    let back = ask_eight(&fleet, &prompt, "after load").await;
    assert!(
        back.iter().all(|(b, _)| *b == home),
        "affinity to {home} did not resume: {back:?}"
    );
}

/// Polls `cond` every 20 ms for up to 30 s.
async fn wait_until(cond: impl Fn() -> bool, what: &str) {
    for _ in 0..1500 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{what}");
}

/// The conversation the test follows.
const QUESTION: &str = "how do I reset it";

/// The question on `prompt` eight times, one at a time: (backend that served, kvroute's decision)
/// each.
async fn ask_eight(fleet: &Fleet, prompt: &str, label: &str) -> Vec<(usize, Option<String>)> {
    let mut out = Vec::new();
    for i in 0..8 {
        let mut body = chat_body(prompt, QUESTION, false);
        body["metadata"] = json!({ "round": format!("{label} {i}") });
        let reply = fleet.chat(&body).await;
        out.push((served_by(fleet, &reply), reply.decision));
    }
    out
}
