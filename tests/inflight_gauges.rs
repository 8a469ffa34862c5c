#![cfg(not(target_arch = "wasm32"))]
//! kvroute's per-backend in-flight counts return to zero after a burst, including requests the
//! client gave up on mid-flight; a leak here would slowly steer traffic away from a backend.

mod common;

use common::{chat_body, debug_config, inflight_gauge_name, inflight_gauges, system_prompt, Fleet};
use std::sync::Arc;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inflight_gauges_return_to_zero_after_burst_with_client_aborts() {
    let fleet = Arc::new(Fleet::kvroute(4, debug_config(), |_| {}).await);
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
    // While the burst is in flight the gauges must show it, or the final check proves nothing.
    let mut peak = 0;
    for _ in 0..20 {
        peak = peak.max(inflight_gauges(&fleet).await.values().sum::<u64>());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(peak > 0, "in-flight gauges never moved during the burst");
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
