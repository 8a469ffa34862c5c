//! Precise mode end to end, every part real: a simulated fleet tokenizing with a byte-level BPE
//! and publishing vLLM's KV events, kvroute-indexer subscribed to it, and Envoy with kvroute
//! rendering prompts with the engines' chat template and polling the indexer. A prompt a replica
//! cached draws the request there (decision `engine`), whichever replica its group would go
//! to; once that replica's cache is reset, the request is placed by its group again. A prompt
//! cached under vLLM's `cache_salt` draws the same tenant's next request, and only its.

use crate::common;

use common::precise::{body, cached_then_decided, eventually, keys_held, post, BpeFleet, CHATML};
use kvroute_harness::Envoy;
use serde_json::json;

/// Three replicas, an indexer following them (once it has heard each) and Envoy with kvroute
/// polling it, rendering with the engines' template: the fleet, the indexer (running while held),
/// its URL and Envoy.
async fn following(name: &str) -> (BpeFleet, kvroute_indexer::Running, String, Envoy) {
    let fleet = BpeFleet::start(3, name).await;
    let indexer = kvroute_indexer::start(fleet.indexer_config())
        .await
        .expect("indexer starts");
    let index_url = format!("http://{}", indexer.addr);
    fleet.until_heard(std::slice::from_ref(&index_url)).await;
    let backends = fleet.sim.replicas.iter().map(|r| r.addr).collect();
    let config = json!({"debug_header": true, "stats_interval_ms": 200,
                        "index_cluster": "kvroute_indexer", "chat_template": CHATML});
    let envoy = common::kvroute_with_indexer(backends, indexer.addr, config).await;
    (fleet, indexer, index_url, envoy)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_replica_whose_engine_cached_the_prompt_draws_it_until_it_evicts_it() {
    let (fleet, _indexer, index_url, envoy) = following("precise-e2e").await;
    let sim = &fleet.sim;

    // Each of three prompts cached by a replica chosen here, not by kvroute: each goes there.
    for (n, r) in sim.replicas.iter().enumerate() {
        let tag = format!("shop {n}");
        assert_eq!(
            cached_then_decided(&envoy, &index_url, r, &body(&tag)).await,
            ("engine".to_string(), r.addr.to_string()),
            "prompt {n}"
        );
    }

    // The first replica's engine drops everything: its prompt is placed by its group again.
    let first = sim.replicas[0].addr.to_string();
    sim.replicas[0].replica.reset_prefix_cache();
    let emptied = || async { keys_held(&index_url, &first).await == 0 };
    eventually("the indexer drops the reset replica's keys", emptied).await;
    common::index_applied(&envoy, 3).await;
    let (decision, _) = common::decided(&envoy, &body("shop 0")).await;
    assert_ne!(
        decision, "engine",
        "the evicted prompt still drew the request"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_salted_prompt_draws_its_tenants_next_request_only() {
    let (fleet, _indexer, index_url, envoy) = following("precise-e2e-salt").await;
    let sim = &fleet.sim;
    let salted = |salt: &str| {
        let mut b = body("tenant shop");
        b["cache_salt"] = json!(salt);
        b
    };

    // Tenant 1's prompt cached by a replica chosen here, not by kvroute.
    let r = &sim.replicas[1];
    let cached = r.addr.to_string();
    post(
        &format!("{}/v1/chat/completions", r.url()),
        &salted("tenant-1"),
    )
    .await;
    let indexed = || async { keys_held(&index_url, &cached).await >= 2 };
    eventually("the indexer holds the salted prompt", indexed).await;
    common::index_applied(&envoy, 3).await;
    // Another tenant's request and an unsalted one share none of its blocks: the index has
    // nothing of theirs, and they are placed as without it.
    for other in [salted("tenant-2"), body("tenant shop")] {
        let (decision, _) = common::decided(&envoy, &other).await;
        assert_ne!(decision, "engine", "cache_salt {}", other["cache_salt"]);
    }
    // The same tenant's next request goes where its salted prefix is.
    assert_eq!(
        common::decided(&envoy, &salted("tenant-1")).await,
        ("engine".to_string(), cached)
    );
}
