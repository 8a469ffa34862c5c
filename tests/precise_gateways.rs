//! Precise mode as shipped (`envoy/kvroute-precise.yaml`), several gateways over one simulated
//! fleet that tokenizes with the repository's byte-level BPE and publishes vLLM's KV events: three
//! Envoys sharing one kvroute-indexer, and three each with its own. Every gateway sees the same
//! holders: a prompt a replica cached goes there from every gateway (decision `engine`); once that
//! replica's cache is reset, none sends it there, and wherever one gateway then places it, the
//! others follow. With its indexer killed, a gateway routes as it does without one: every request
//! answered, none failed.

use crate::common;

use common::precise::{body, eventually, keys_held, post, BpeFleet, IndexerProcess};
use kvroute::gateway::stat_names::Counter;
use kvroute_harness::paths::precise_bootstrap;
use kvroute_harness::Envoy;
use serde_json::json;

/// A gateway on the shipped precise config polling the indexer at `indexer`; the test adds only
/// the decision header and a quicker poll.
async fn gateway(fleet: &BpeFleet, indexer: std::net::SocketAddr) -> Envoy {
    let config = json!({"debug_header": true, "stats_interval_ms": 200});
    let bootstrap = Some(precise_bootstrap());
    common::kvroute_with_indexer_from(bootstrap, fleet.backends(), indexer, config).await
}

/// Each replica caches a prompt of its own (sent to it directly, not through a gateway): every
/// gateway sends that prompt to it. Then the first replica's cache is reset: no gateway does, and
/// where the first gateway places it next, every other gateway sends it.
async fn every_gateway_follows_the_engines(fleet: &BpeFleet, gateways: &[(Envoy, String)]) {
    for (n, r) in fleet.sim.replicas.iter().enumerate() {
        let tag = format!("shop {n}");
        let cached = r.addr.to_string();
        post(&format!("{}/v1/chat/completions", r.url()), &body(&tag)).await;
        for (_, index) in gateways {
            let indexed = || async { keys_held(index, &cached).await >= 2 };
            eventually("the indexer holds the prompt", indexed).await;
        }
        for (g, (envoy, _)) in gateways.iter().enumerate() {
            common::index_applied(envoy, 3).await;
            assert_eq!(
                common::decided(envoy, &body(&tag)).await,
                ("engine".to_string(), cached.clone()),
                "gateway {g}, prompt {n}"
            );
        }
    }

    let first = fleet.sim.replicas[0].addr.to_string();
    fleet.sim.replicas[0].replica.reset_prefix_cache();
    for (_, index) in gateways {
        let emptied = || async { keys_held(index, &first).await == 0 };
        eventually("the indexer drops the reset replica's keys", emptied).await;
    }
    for (envoy, _) in gateways {
        common::index_applied(envoy, 3).await;
    }
    // No engine holds it now: the first gateway places it as without an index, and the replica
    // it lands on caches it. Every other gateway then sends it to that one, by the index.
    let before: Vec<Vec<u64>> = keys_per_replica(fleet, gateways).await;
    let (decision, placed) = common::decided(&gateways[0].0, &body("shop 0")).await;
    assert_ne!(
        decision, "engine",
        "gateway 0: the evicted prompt drew the request"
    );
    let at = fleet
        .backends()
        .iter()
        .position(|a| a.to_string() == placed)
        .expect("a replica served it");
    for (g, (_, index)) in gateways.iter().enumerate() {
        let cached = || async { keys_held(index, &placed).await > before[g][at] };
        eventually("the indexer holds the prompt where it was placed", cached).await;
    }
    for (g, (envoy, _)) in gateways.iter().enumerate().skip(1) {
        common::index_applied(envoy, 3).await;
        assert_eq!(
            common::decided(envoy, &body("shop 0")).await,
            ("engine".to_string(), placed.clone()),
            "gateway {g} follows the prompt to its new holder"
        );
    }
}

/// Keys each gateway's indexer says each replica holds.
async fn keys_per_replica(fleet: &BpeFleet, gateways: &[(Envoy, String)]) -> Vec<Vec<u64>> {
    let mut all = Vec::new();
    for (_, index) in gateways {
        let mut per = Vec::new();
        for addr in fleet.backends() {
            per.push(keys_held(index, &addr.to_string()).await);
        }
        all.push(per);
    }
    all
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_gateways_sharing_one_indexer_send_a_cached_prompt_to_its_engine() {
    let fleet = BpeFleet::start(3, "precise-shared").await;
    let indexer = kvroute_indexer::start(fleet.indexer_config())
        .await
        .expect("indexer starts");
    let url = format!("http://{}", indexer.addr);
    fleet.until_heard(std::slice::from_ref(&url)).await;
    let mut gateways = Vec::new();
    for _ in 0..3 {
        gateways.push((gateway(&fleet, indexer.addr).await, url.clone()));
    }
    every_gateway_follows_the_engines(&fleet, &gateways).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_gateways_each_with_its_own_indexer_send_a_cached_prompt_to_its_engine() {
    let fleet = BpeFleet::start(3, "precise-own").await;
    let mut indexers = Vec::new();
    for _ in 0..3 {
        let indexer = kvroute_indexer::start(fleet.indexer_config())
            .await
            .expect("indexer starts");
        indexers.push(indexer);
    }
    let urls: Vec<String> = indexers
        .iter()
        .map(|i| format!("http://{}", i.addr))
        .collect();
    fleet.until_heard(&urls).await;
    let mut gateways = Vec::new();
    for (indexer, url) in indexers.iter().zip(&urls) {
        gateways.push((gateway(&fleet, indexer.addr).await, url.clone()));
    }
    every_gateway_follows_the_engines(&fleet, &gateways).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_indexer_leaves_routing_as_without_one_and_no_request_fails() {
    let fleet = BpeFleet::start(3, "precise-killed").await;
    let mut indexer = IndexerProcess::start(&fleet.indexer_config()).await;
    fleet.until_heard(&[indexer.url()]).await;
    let envoy = gateway(&fleet, indexer.addr).await;

    // The built binary, as deployed, feeds the gateway: a cached prompt goes to its engine.
    let r = &fleet.sim.replicas[1];
    let cached = r.addr.to_string();
    post(&format!("{}/v1/chat/completions", r.url()), &body("kiosk")).await;
    let indexed = || async { keys_held(&indexer.url(), &cached).await >= 2 };
    eventually("the indexer holds the prompt", indexed).await;
    common::index_applied(&envoy, 3).await;
    assert_eq!(
        common::decided(&envoy, &body("kiosk")).await,
        ("engine".to_string(), cached.clone())
    );

    // The indexer dies mid-run, and nothing listens at its address any more.
    let failed = envoy
        .stat(Counter::IndexPollFailed.name())
        .await
        .ok()
        .flatten()
        .unwrap_or(0);
    indexer.child.start_kill().expect("kill the indexer");
    indexer.child.wait().await.expect("the indexer exits");
    // Requests keep being answered while kvroute notices (each one bounded by the client's 60 s
    // timeout: a hang fails the test); `decided` asserts every status is 200.
    let polls_failed = || async {
        let now = envoy
            .stat(Counter::IndexPollFailed.name())
            .await
            .ok()
            .flatten();
        now.unwrap_or(0) >= failed + 5
    };
    let mut answered = 0;
    eventually("kvroute counts the failed polls", || {
        answered += 1;
        let envoy = &envoy;
        async move {
            common::decided(envoy, &body(&format!("walk-in {answered}"))).await;
            polls_failed().await
        }
    })
    .await;
    // Stale now: the prompt the engine holds is placed as without an index, and every request
    // is answered.
    let (decision, _) = common::decided(&envoy, &body("kiosk")).await;
    assert_ne!(
        decision, "engine",
        "a dead indexer's holders still drew the request"
    );
    for i in 0..12 {
        let (decision, _) = common::decided(&envoy, &body(&format!("after {i}"))).await;
        assert_ne!(decision, "engine", "request {i} after the kill");
    }
}
