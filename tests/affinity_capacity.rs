//! A flood of unique prompts cannot grow kvroute's shared-data affinity map past
//! `affinity_capacity` slots: memory stays bounded however many prefixes it sees.

use crate::common;

use common::{kv_stat, Fleet};
use kvroute::gateway::stat_names::{self, Gauge};
use serde_json::json;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

const CAPACITY: u64 = 256;
/// Unique prompts sent: about 40 times the capacity.
const FLOOD: usize = 10_000;
const CONCURRENCY: usize = 64;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flood_of_unique_prefixes_stays_within_affinity_capacity() {
    let config = json!({ "affinity_capacity": CAPACITY, "stats_interval_ms": 200 });
    let fleet = Arc::new(Fleet::kvroute(4, config, |_| {}).await);
    for b in &fleet.backends {
        b.set_recording(false);
    }
    let next = Arc::new(AtomicUsize::new(0));
    let workers: Vec<_> = (0..CONCURRENCY)
        .map(|_| {
            let (fleet, next) = (fleet.clone(), next.clone());
            tokio::spawn(async move {
                let url = format!("{}/v1/completions", fleet.envoy.url());
                let mut failed = 0;
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= FLOOD {
                        return failed;
                    }
                    let body = format!(
                        r#"{{"model":"m","prompt":"unique prompt number {i} {}"}}"#,
                        i * 7919
                    );
                    let sent = fleet
                        .client
                        .post(&url)
                        .header("content-type", "application/json")
                        .body(body)
                        .send()
                        .await;
                    if !sent.is_ok_and(|r| r.status() == 200) {
                        failed += 1;
                    }
                }
            })
        })
        .collect();
    let mut failed = 0;
    for w in workers {
        failed += w.await.unwrap();
    }
    assert_eq!(
        failed,
        0,
        "requests failed during the flood\n{}",
        fleet.envoy.log_tail()
    );
    let routed = fleet
        .stat_sum_reaching(stat_names::ROUTED_PREFIX, (FLOOD * 9 / 10) as u64)
        .await;
    assert!(
        routed as usize >= FLOOD * 9 / 10,
        "the flood was not routed by kvroute: {routed}"
    );
    let used = kv_stat(&fleet, Gauge::SlotsUsed.name()).await;
    assert!(
        used <= CAPACITY,
        "{used} affinity slots used, capacity {CAPACITY}"
    );
    assert!(
        used >= CAPACITY / 2,
        "only {used} slots used: the flood did not exercise the map"
    );
}
