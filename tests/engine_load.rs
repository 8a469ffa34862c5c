#![cfg(not(target_arch = "wasm32"))]
//! An engine that reports a long queue in its own `/metrics` (traffic from other proxies, which
//! this Envoy cannot see) gets no new prefixes until the queue drains.

mod common;

use common::{chat_body, debug_config, served_by, system_prompt, wait_for_fresh_poll, Fleet};
use std::time::{Duration, Instant};

/// Sends new-prefix requests until one is decided `want`, proving every worker's view changed.
async fn until_decision(fleet: &Fleet, want: &str, tag: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    for i in 0.. {
        let reply = fleet
            .chat(&chat_body(
                &system_prompt(1000 + i),
                &format!("{tag} {i}"),
                false,
            ))
            .await;
        if reply.decision.as_deref() == Some(want) {
            // One worker saw it; two more polls and every worker has.
            wait_for_fresh_poll(fleet).await;
            return;
        }
        assert!(
            Instant::now() < deadline,
            "no `{want}` decision within 20 s"
        );
    }
}

#[tokio::test]
async fn an_engine_with_a_long_queue_gets_no_new_prefixes_until_it_drains() {
    let mut config = debug_config();
    config["engine_metrics_cluster"] = "inference_pool".into();
    let fleet = Fleet::kvroute(4, config, |_| {}).await;

    fleet.backends[0].set_engine_waiting(500);
    until_decision(&fleet, "balance", "wait for the queue").await;
    for group in 0..20 {
        let reply = fleet
            .chat(&chat_body(&system_prompt(group), "hi", false))
            .await;
        assert_ne!(
            served_by(&fleet, &reply),
            0,
            "group {group} went to the busy engine"
        );
        assert_eq!(reply.decision.as_deref(), Some("balance"));
    }

    fleet.backends[0].set_engine_waiting(0);
    until_decision(&fleet, "new_prefix", "wait for the drain").await;
    let mut to_zero = 0;
    for group in 100..120 {
        let reply = fleet
            .chat(&chat_body(&system_prompt(group), "hi", false))
            .await;
        to_zero += usize::from(served_by(&fleet, &reply) == 0);
    }
    assert!(
        to_zero >= 3,
        "only {to_zero} of 20 new prefixes went to the drained engine"
    );
}
