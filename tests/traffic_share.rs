//! Three gateways over one simulated vLLM fleet, each seeing a third of the traffic: each learns
//! its share from the engines' own finished-request counters and counts a group from a third of
//! the requests a lone gateway needs, so all three place the same groups as early as one would.

use crate::common;

use kvroute::gateway::stat_names::{Counter, Gauge};
use kvroute_sim::spec::FleetSpec;
use serde_json::{json, Value};
use std::time::Duration;

const MODEL: &str = "Qwen/Qwen3-32B";
const GATEWAYS: usize = 3;
const GROUPS: usize = 8;

fn body(group: usize, gateway: usize) -> Value {
    json!({"model": MODEL, "max_tokens": 2, "stream": false, "messages": [
        {"role": "system", "content": common::system_prompt(group)},
        {"role": "user", "content": format!("question {gateway}")}]})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateways_that_each_see_a_third_count_a_group_from_its_first_request_there() {
    let spec = FleetSpec {
        replicas: 4,
        time_scale: 0.05,
        ..FleetSpec::default()
    };
    let sim = kvroute_sim::fleet::Fleet::start(spec, 0, 0)
        .await
        .expect("sim fleet starts");
    let mut gateways = Vec::new();
    for _ in 0..GATEWAYS {
        let envoy = common::kvroute_envoy_over(&sim, json!({ "stats_interval_ms": 200 })).await;
        // The engines' counters are known (the baseline) before any traffic.
        envoy
            .wait_for_stat(
                Counter::EnginePollOk.name(),
                |v| v >= 8,
                Duration::from_secs(30),
            )
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        common::wait_for_fresh_poll_of(&envoy).await;
        gateways.push(envoy);
    }

    // Every group once at every gateway: 24 requests finished by the fleet, 8 seen by each.
    let client = common::client();
    for group in 0..GROUPS {
        for (g, envoy) in gateways.iter().enumerate() {
            let resp = client
                .post(format!("{}/v1/chat/completions", envoy.url()))
                .json(&body(group, g))
                .send()
                .await
                .expect("request");
            assert_eq!(resp.status(), 200);
            resp.bytes().await.expect("body");
        }
    }

    // A lone gateway would need a second request of each group; a gateway that sees a third of
    // the traffic counts each from the one it saw.
    for envoy in &gateways {
        envoy
            .wait_for_stat(
                Gauge::GroupsPlaced.name(),
                |v| v == GROUPS as u64,
                Duration::from_secs(30),
            )
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }
}
