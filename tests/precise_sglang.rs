//! Precise mode over a mixed fleet, every part real: two simulated vLLM replicas and two SGLang
//! ones (SGLang's KV events, one per token: its default page size of 1), one kvroute-indexer
//! reading each in its own dialect, and Envoy with kvroute polling it and the engines' load. A
//! prompt any replica cached, vLLM or SGLang, draws the request there (decision `engine`), and the
//! SGLang replicas' load snapshots are read for the prefill queued there.

use crate::common;

use common::precise::{body, cached_then_decided, health, BpeFleet, CHATML};
use kvroute::gateway::stat_names::Counter;
use kvroute_sim::spec::{EngineKind, EngineKinds};
use serde_json::json;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mixed_fleets_vllm_and_sglang_replicas_each_draw_the_prompts_they_cached() {
    use EngineKind::{Sglang, Vllm};
    let fleet = BpeFleet::start_with(4, "precise-sglang", |spec| {
        spec.engine_kind = EngineKinds::Each(vec![Vllm, Vllm, Sglang, Sglang]);
        spec.page_size = Some(1);
    })
    .await;
    let indexer = kvroute_indexer::start(fleet.indexer_config())
        .await
        .expect("indexer starts");
    let index_url = format!("http://{}", indexer.addr);
    fleet.until_heard(std::slice::from_ref(&index_url)).await;
    let kinds: Vec<String> = health(&index_url).await["streams"]
        .as_array()
        .expect("streams")
        .iter()
        .map(|s| s["kind"].as_str().unwrap_or_default().to_owned())
        .collect();
    assert_eq!(kinds, ["vllm", "vllm", "sglang", "sglang"]);
    let config = json!({"debug_header": true, "stats_interval_ms": 200,
                        "index_cluster": "kvroute_indexer", "chat_template": CHATML,
                        "engine_metrics_cluster": "inference_pool"});
    let envoy = common::kvroute_with_indexer(fleet.backends(), indexer.addr, config).await;

    // Each replica caches a prompt of its own, sent there directly (not by kvroute): each
    // prompt then goes where it is cached, SGLang's replicas as vLLM's.
    for (n, r) in fleet.sim.replicas.iter().enumerate() {
        let tag = format!("{} kitchen {n}", r.kind().name());
        assert_eq!(
            cached_then_decided(&envoy, &index_url, r, &body(&tag)).await,
            ("engine".to_string(), r.addr.to_string()),
            "replica {n} ({})",
            r.kind().name()
        );
    }

    // Both SGLang replicas' load snapshots answered, in two poll rounds at least.
    envoy
        .wait_for_stat(
            Counter::LoadsPollOk.name(),
            |v| v >= 4,
            Duration::from_secs(30),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
}
