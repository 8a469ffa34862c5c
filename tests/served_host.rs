//! The host that served a request is the one kvroute settles on: when the chosen replica refuses
//! the connection and Envoy retries on the fallback address, the in-flight count moves to the
//! fallback while the response streams, and the mismatch is counted.

use crate::common;

use kvroute::gateway::stat_names::{self, Counter};
use kvroute_sim::engine::Faults;
use kvroute_sim::spec::FleetSpec;
use std::time::Duration;

fn gauge(stats: &std::collections::HashMap<String, u64>, addr: std::net::SocketAddr) -> u64 {
    let name = common::inflight_gauge_name(addr);
    stats
        .iter()
        .find(|(k, _)| k.ends_with(&name))
        .map_or(0, |(_, v)| *v)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_to_the_fallback_host_moves_the_in_flight_count() {
    // Streamed answers of 400 tokens take about two seconds (headers first, then tokens), long
    // enough to look.
    let spec = FleetSpec {
        replicas: 2,
        time_scale: 0.05,
        ..FleetSpec::default()
    };
    let (sim, envoy) = common::kvroute_over_sim(spec).await;
    let http = reqwest::Client::new();
    let url = format!("{}/v1/chat/completions", envoy.url());
    let body = |q, max_tokens| common::sim_question(&sim.spec.model, q, max_tokens, true);
    let replica = |resp: &reqwest::Response| -> usize {
        let h = resp.headers().get("x-sim-replica").expect("x-sim-replica");
        h.to_str().unwrap().parse().unwrap()
    };
    let first = http.post(&url).json(&body(0, 1)).send().await.unwrap();
    let home = replica(&first);
    first.bytes().await.unwrap();
    assert_eq!(
        envoy.stat(Counter::ServedElsewhere.name()).await.unwrap(),
        Some(0)
    );
    // The group's home stops listening (refused connections) before Envoy's health check or
    // kvroute's poll can notice: Envoy retries on the fallback address kvroute listed.
    let victim = &sim.replicas[home].replica;
    victim.set_faults(Faults {
        stopped: true,
        ..victim.faults()
    });
    // Wait for the stop itself: the home's listener refuses connections.
    let home_addr = sim.replicas[home].addr;
    let mut refused = false;
    for _ in 0..200 {
        if tokio::net::TcpStream::connect(home_addr).await.is_err() {
            refused = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(refused, "the stopped replica still accepts connections");
    let resp = http.post(&url).json(&body(1, 400)).send().await.unwrap();
    if resp.status() != 200 {
        let status = resp.status();
        let from = resp.headers().get("x-sim-replica").cloned();
        let text = resp.text().await.unwrap_or_default();
        panic!("status {status} from replica {from:?} (home {home}): {text}");
    }
    let other = 1 - home;
    assert_eq!(replica(&resp), other, "the retry went to the fallback");
    // Response headers are in, the body is streaming: the count is where the request is, as the
    // gauges show it from the next tick (every 100 ms at most) while the stream lasts.
    let mut during = (u64::MAX, u64::MAX);
    for _ in 0..20 {
        let stats = envoy.stats(stat_names::INFLIGHT_PREFIX).await.unwrap();
        during = (
            gauge(&stats, sim.replicas[home].addr),
            gauge(&stats, sim.replicas[other].addr),
        );
        if during == (0, 1) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    resp.bytes().await.unwrap();
    assert_eq!(during, (0, 1), "in flight (home, fallback) while streaming");
    envoy
        .wait_for_stat(
            Counter::ServedElsewhere.name(),
            |v| v == 1,
            Duration::from_secs(10),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    // The gauges follow on the next tick.
    let mut after = envoy.stats(stat_names::INFLIGHT_PREFIX).await.unwrap();
    for _ in 0..100 {
        if after.values().all(|v| *v == 0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        after = envoy.stats(stat_names::INFLIGHT_PREFIX).await.unwrap();
    }
    assert!(
        after.values().all(|v| *v == 0),
        "counts settle to zero: {after:?}"
    );
}
