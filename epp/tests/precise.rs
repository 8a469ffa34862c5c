//! Precise mode in kvroute-epp's own process, every part real: a simulated fleet publishing
//! vLLM's KV events, followed by the indexer's code inside the picker (`--engine`; no
//! kvroute-indexer runs), and a real Envoy asking the picker, all on 127.0.0.1. A prompt a replica
//! cached, sent there directly, draws the request there through Envoy (decision `engine`), and
//! the index is served on the picker's metrics listener.

use crate::common;

use common::{start_envoy_over, start_epp_with, wait_for_stat, wait_ready, Shape};
use kvroute::gateway::stat_names::{self, Counter};
use kvroute::policy::Decision;
use kvroute_harness::precise::{body, eventually, keys_held, post, BpeFleet, CHATML};
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_an_engine_cached_is_picked_there_from_events_followed_in_process() {
    let fleet = BpeFleet::start(3, "epp-precise").await;
    let config = json!({
        "policy": "cache_aware",
        "clusters": ["inference_pool"],
        "admin_cluster": "kvroute_admin",
        "engine_metrics_cluster": "inference_pool",
        "index_cluster": "kvroute_indexer",
        "chat_template": CHATML,
        "stats_interval_ms": 200
    });
    let events = fleet.indexer_config().events;
    let epp = start_epp_with(&fleet.backends(), &config.to_string(), |args| {
        args.events = Some(events)
    })
    .await;
    wait_ready(&epp).await;
    let metrics = epp.metrics_addr.expect("a metrics listener");
    let index_url = format!("http://{metrics}/index");
    fleet.until_heard(std::slice::from_ref(&index_url)).await;
    let envoy = start_envoy_over(fleet.backends(), epp.addr, Shape::default()).await;
    let client = reqwest::Client::new();

    for (n, replica) in fleet.sim.replicas.iter().enumerate() {
        // Cached at this replica, not by kvroute: only its events can tell the picker.
        let body = body(&format!("kitchen {n}"));
        post(&format!("{}/v1/chat/completions", replica.url()), &body).await;
        let cached = replica.addr.to_string();
        eventually("the index holds the prompt", || async {
            keys_held(&index_url, &cached).await >= 2
        })
        .await;
        // Two of the gateway's index polls since: every worker has read it.
        let polled = epp.stats.value(Counter::IndexPollOk.name());
        wait_for_stat(&epp, Counter::IndexPollOk.name(), |v| v >= polled + 2).await;
        let engine = epp.stats.value(&stat_names::routed(Decision::Engine));
        let response = client
            .post(format!("{}/v1/chat/completions", envoy.url()))
            .json(&body)
            .send()
            .await
            .expect("Envoy answers");
        assert_eq!(response.status(), 200);
        let served = response.headers().get("x-sim-replica").cloned();
        let answer: Value = response.json().await.expect("a completion");
        assert_eq!(
            served.as_ref().and_then(|v| v.to_str().ok()),
            Some(replica.replica.id.to_string().as_str()),
            "replica {n}'s prompt served elsewhere"
        );
        assert!(
            answer["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() > Some(0),
            "no cache hit: {answer}"
        );
        wait_for_stat(&epp, &stat_names::routed(Decision::Engine), |v| {
            v == engine + 1
        })
        .await;
    }
    assert_eq!(epp.stats.value(Counter::IndexPollFailed.name()), 0);

    // The index's own metrics beside the gateway's.
    let text = client
        .get(format!("http://{metrics}/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    assert!(text.contains("kvroute_routed_engine"), "{text}");
    assert!(text.contains("kvroute_indexer_"), "{text}");
}
