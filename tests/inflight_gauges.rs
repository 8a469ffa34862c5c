//! kvroute's per-backend in-flight counts return to zero after a burst, including requests the
//! client gave up on mid-flight; a leak here would slowly steer traffic away from a backend.

use crate::common;

use common::{
    chat_body, debug_config, inflight_gauge_name, inflight_gauges, kv_stat, system_prompt, Fleet,
};
use kvroute::gateway::stat_names::{Counter, Gauge};
use kvroute_harness::Lb;
use std::sync::Arc;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inflight_gauges_return_to_zero_after_burst_with_client_aborts() {
    let fleet = Arc::new(Fleet::kvroute(4, debug_config(), |_| {}).await);
    burst_with_aborts_settles(fleet).await;
}

/// The same with Envoy's admin polled only every 20 s: the correction against `rq_active` needs
/// three polls in a row that see an excess, so it cannot act on a burst that is over in a second or
/// two, and only the filter's own settling (Envoy calls `on_log` and `on_done` for a reset stream
/// too) brings the gauges back to zero.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborted_streams_are_settled_by_the_filter_not_by_the_correction() {
    let mut config = debug_config();
    config["stats_interval_ms"] = 20_000.into();
    let fleet = Fleet::start(
        4,
        Lb::Kvroute {
            plugin_config: config,
        },
        |_| {},
    )
    .await;
    // The first poll may precede the health checks: then the second, 20 s on, sees all four.
    let known = fleet.envoy.wait_for_stat(
        Gauge::EndpointsKnown.name(),
        |v| v == 4,
        Duration::from_secs(60),
    );
    known.await.unwrap_or_else(|e| panic!("{e}"));
    let fleet = Arc::new(fleet);
    burst_with_aborts_settles(fleet.clone()).await;
    assert_eq!(kv_stat(&fleet, Counter::InflightCorrected.name()).await, 0);
}

async fn burst_with_aborts_settles(fleet: Arc<Fleet>) {
    for b in &fleet.backends {
        b.set_delay(Duration::from_millis(400));
    }
    let mut burst = Vec::new();
    for i in 0..64 {
        let fleet = fleet.clone();
        burst.push(tokio::spawn(async move {
            let body = chat_body(&system_prompt(i % 6), &format!("burst {i}"), i % 3 == 0);
            let request = fleet.chat(&body);
            if i % 2 == 0 {
                // The client gives up: dropping the future resets the connection.
                let _ = tokio::time::timeout(Duration::from_millis(50), request).await;
            } else {
                request.await;
            }
        }));
    }
    // While the burst is held at the backends (400 ms, four of kvroute's ticks at most) the gauges
    // must show it, or the final check proves nothing.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while fleet.backends.iter().all(|b| b.in_flight() == 0) {
        assert!(
            std::time::Instant::now() < deadline,
            "the burst never reached a backend"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut peak = 0;
    while peak == 0 && fleet.backends.iter().any(|b| b.in_flight() > 0) {
        peak = peak.max(inflight_gauges(&fleet).await.values().sum::<u64>());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        peak > 0,
        "in-flight gauges never moved while the burst was held"
    );
    for task in burst {
        task.await.unwrap();
    }
    for _ in 0..300 {
        if fleet.backends.iter().all(|b| b.in_flight() == 0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut gauges = inflight_gauges(&fleet).await;
    for _ in 0..100 {
        if gauges.values().all(|v| *v == 0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        gauges = inflight_gauges(&fleet).await;
    }
    for b in fleet.backends.iter().filter(|b| b.received() > 0) {
        let name = inflight_gauge_name(b.addr());
        assert!(
            gauges.keys().any(|k| k.ends_with(&name)),
            "no gauge {name} in {gauges:?}"
        );
    }
    assert!(
        gauges.values().all(|v| *v == 0),
        "in-flight gauges leaked: {gauges:?}"
    );
}
