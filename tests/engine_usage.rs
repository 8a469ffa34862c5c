//! What the engines say they cached reaches Envoy's stats: kvroute reads `usage` from streamed
//! and plain responses of a simulated vLLM fleet, and its per-endpoint prompt and cached token
//! counters agree with the fleet's own prefix-cache counters.

use crate::common;

use kvroute::gateway::stat_names::Counter;
use kvroute_sim::spec::FleetSpec;
use serde_json::json;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_token_stats_match_the_fleets_own_counters() {
    let spec = FleetSpec {
        replicas: 3,
        time_scale: 0.01,
        ..FleetSpec::default()
    };
    let (sim, envoy) = common::kvroute_over_sim(spec).await;
    let model = sim.spec.model.clone();
    let http = reqwest::Client::new();
    let url = format!("{}/v1/chat/completions", envoy.url());
    let mut sent = 0u64;
    for turn in 0..3 {
        for g in 0..6 {
            let system = format!("[group {g}] ") + &"shared words of the system prompt ".repeat(80);
            let stream = (g + turn) % 2 == 0;
            let body = json!({
                "model": model, "max_tokens": 4, "stream": stream,
                "stream_options": {"include_usage": true},
                "messages": [{"role": "system", "content": system},
                             {"role": "user", "content": format!("question {turn}")}],
            });
            let resp = http.post(&url).json(&body).send().await.expect("request");
            assert_eq!(resp.status(), 200);
            resp.bytes().await.expect("body");
            sent += 1;
        }
    }
    envoy
        .wait_for_stat(
            Counter::UsageResponses.name(),
            |v| v == sent,
            Duration::from_secs(30),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let stats = envoy.stats("").await.unwrap();
    let stat = |name: &str| {
        stats
            .iter()
            .find(|(k, _)| k.ends_with(name))
            .map_or(0, |(_, v)| *v)
    };
    let (mut fleet_hits, mut fleet_queries) = (0, 0);
    for r in &sim.replicas {
        let s = r.replica.snapshot();
        let seg = common::endpoint_segment(r.addr);
        let prompt = stat(&Counter::UsagePromptTokens.of_endpoint(&seg));
        let cached = stat(&Counter::UsageCachedTokens.of_endpoint(&seg));
        assert_eq!(prompt, s.prefix_queries_tokens, "replica {}", r.replica.id);
        let (engine, ours) = (
            s.prefix_hits_tokens as f64 / s.prefix_queries_tokens.max(1) as f64,
            cached as f64 / prompt.max(1) as f64,
        );
        assert!(
            (engine - ours).abs() <= 0.03,
            "replica {}: {ours} vs {engine}",
            r.replica.id
        );
        fleet_hits += s.prefix_hits_tokens;
        fleet_queries += s.prefix_queries_tokens;
    }
    assert!(fleet_hits > 0, "the workload reuses prefixes");
    assert_eq!(stat(Counter::UsagePromptTokens.name()), fleet_queries);
    let total = stat(Counter::UsageCachedTokens.name()) as f64 / fleet_queries as f64;
    let fleet = fleet_hits as f64 / fleet_queries as f64;
    assert!((total - fleet).abs() <= 0.03, "{total} vs {fleet}");
}
