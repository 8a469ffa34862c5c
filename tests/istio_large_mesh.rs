//! On a large mesh the gateway's admin `/clusters` lists every cluster (here 2,000 clusters, 10
//! hosts each): kvroute keeps only the cluster it routes, its decisions stay right, and requests
//! keep answering while polls of that document run. (The poll asks Envoy to filter the clusters;
//! this admin, like an Envoy without that parameter, sends all of them.)

use crate::common;

use common::{ask, client, debug_config, kv_stat, served_by, warm_up, Fleet};
use kvroute::gateway::stat_names::{Counter, Gauge};
use kvroute_harness::backend::Backend;
use kvroute_harness::mesh::{clusters_json, FakeAdmin};
use kvroute_harness::{bootstrap::POOL_CLUSTER, Envoy, EnvoyOptions, Lb};
use std::time::Instant;

const BACKENDS: usize = 4;
const OTHER_CLUSTERS: usize = 1999;
const HOSTS_PER_CLUSTER: usize = 10;
const GROUPS: usize = 6;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_2000_cluster_admin_keeps_routing_right_while_polls_run() {
    let backends = Backend::start_many(BACKENDS).await.expect("backends start");
    let addrs: Vec<_> = backends.iter().map(Backend::addr).collect();
    let document = clusters_json(POOL_CLUSTER, &addrs, OTHER_CLUSTERS, HOSTS_PER_CLUSTER);
    println!("/clusters document: {} bytes", document.len());
    let admin = FakeAdmin::start(document).await.expect("fake admin starts");
    let mut config = debug_config();
    config["clusters"] = serde_json::json!([POOL_CLUSTER]);
    config["engine_metrics_cluster"] = serde_json::Value::Null;
    config["stats_interval_ms"] = 100.into();
    let envoy = Envoy::start(EnvoyOptions {
        backends: addrs.clone(),
        lb: Lb::Kvroute {
            plugin_config: config,
        },
        admin_target: Some(admin.addr()),
        ..EnvoyOptions::default()
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let fleet = Fleet {
        backends,
        envoy,
        client: client(),
    };
    // Exactly the pool's hosts: the other 19,990 healthy hosts in the document are not kept.
    fleet.wait_endpoints_known(BACKENDS).await;

    // Once every group is placed, each stays on its home (the steady state, as in prefix_affinity).
    warm_up(&fleet, 0..GROUPS).await;
    let homes: Vec<usize> = {
        let mut homes = Vec::new();
        for g in 0..GROUPS {
            homes.push(served_by(&fleet, &fleet.chat(&ask(g, 0)).await));
        }
        homes
    };
    // Keep asking until several more polls of the big document have run under the traffic.
    let polls_before = admin.served();
    let ok_before = kv_stat(&fleet, Counter::StatsPollOk.name()).await;
    let mut latencies = Vec::new();
    let mut round = 1;
    while admin.served() < polls_before + 5 || round <= 3 {
        assert!(
            round <= 300,
            "the fake admin was polled only {} times",
            admin.served() - polls_before
        );
        for (g, home) in homes.iter().enumerate() {
            let start = Instant::now();
            // One conversation per group: 6 groups on 4 replicas split some groups'
            // conversations between two homes.
            let reply = fleet.chat(&ask(g, 0)).await;
            latencies.push(start.elapsed());
            let decision = reply.decision.clone().expect("decision header");
            // The decision and the suspect count tell a new home from a retry elsewhere.
            assert_eq!(
                served_by(&fleet, &reply),
                *home,
                "group {g} left its home in round {round} ({decision}, suspects marked: {}, \
                 Envoy retries: {:?})",
                kv_stat(&fleet, Counter::SuspectMarked.name()).await,
                fleet.envoy.stat("upstream_rq_retry").await
            );
            assert!(
                !decision.contains("fallback"),
                "group {g} round {round}: {decision}"
            );
        }
        round += 1;
    }
    let polled_ok = kv_stat(&fleet, Counter::StatsPollOk.name()).await - ok_before;
    assert!(
        polled_ok >= 3,
        "only {polled_ok} polls parsed under traffic"
    );
    // Every answer that came parsed: a poll the admin answered too late for its round (a loaded
    // machine, at a 100 ms interval) counts as failed too, but only a bad answer logs.
    assert!(
        !fleet.envoy.log().contains("stats poll failed"),
        "a /clusters answer did not parse:\n{}",
        fleet.envoy.log_tail()
    );
    assert_eq!(
        kv_stat(&fleet, Gauge::EndpointsKnown.name()).await,
        BACKENDS as u64
    );
    // It asked for the pool alone; this admin, like an Envoy without `filter`, sent everything.
    let asked = admin.last_path();
    assert!(
        asked.starts_with("/clusters?format=json&filter="),
        "{asked}"
    );
    assert!(asked.contains("inference_pool"), "{asked}");
    let distinct: std::collections::HashSet<_> = homes.iter().collect();
    assert!(distinct.len() > 1, "all groups on one backend: {homes:?}");

    latencies.sort();
    let pct = |p: usize| latencies[(latencies.len() - 1) * p / 100];
    println!(
        "{} requests while {} polls ran: latency p50 {:?}, p99 {:?}, max {:?}",
        latencies.len(),
        admin.served() - polls_before,
        pct(50),
        pct(99),
        latencies[latencies.len() - 1]
    );
}
