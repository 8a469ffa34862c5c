//! A replica that stops while eight clients stream chat completions through kvroute costs no
//! request: the ones that reach it before anything knows are retried on another replica before
//! any response byte reaches the client. When it comes back it gets traffic again.

use crate::common;

use common::load::{assert_none_failed, fleet_under_load, wait_until};
use common::{kv_stat, pool_stat};
use kvroute::gateway::stat_names::Counter;
use std::time::{Duration, Instant};

const CLIENTS: usize = 8;
const GROUPS: usize = 12;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_stopped_under_streamed_load_fails_no_request_and_comes_back() {
    // Envoy's health check is slow here (30 s), so nothing but the failed requests themselves can
    // tell Envoy or kvroute that the replica stopped: requests certainly reach it while stopped.
    let (fleet, load) = fleet_under_load(Duration::from_secs(30), CLIENTS, GROUPS, 1).await;
    let victim = &fleet.backends[1];
    victim.stop().await;
    let retries = || pool_stat(&fleet, "upstream_rq_retry");
    let deadline = Instant::now() + Duration::from_secs(60);
    let marks = || kv_stat(&fleet, Counter::SuspectMarked.name());
    while retries().await == 0 || marks().await == 0 {
        assert!(
            Instant::now() < deadline,
            "no request reached the stopped replica: {} retries, {} suspect marks, {} requests \
             completed\n{}",
            retries().await,
            marks().await,
            load.ok(),
            fleet.envoy.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A few more seconds' worth of requests with the replica stopped.
    let ok_at_stop = load.ok();
    wait_until(
        "200 more requests completed",
        Duration::from_secs(120),
        || load.ok() >= ok_at_stop + 200,
    )
    .await;
    let refused = victim.refused();

    victim.resume().await.expect("the victim listens again");
    let served_before = victim.completed();
    let deadline = Instant::now() + Duration::from_secs(120);
    while victim.completed() < served_before + 5 {
        if Instant::now() > deadline {
            let health = fleet.envoy.pool_health().await;
            let stats = fleet.envoy.stats("kvroute").await;
            let ej = fleet.envoy.stats("outlier").await;
            panic!(
                "the victim {} got no traffic after it came back: health {health:?}\n{stats:?}\n{ej:?}\n{}",
                victim.addr(),
                fleet.envoy.log_tail()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (ok, failures) = load.stop().await;
    let retried = retries().await;
    let overflow = pool_stat(&fleet, "upstream_rq_retry_overflow").await;
    println!(
        "{ok} streamed requests ok, {} failed; {retried} retries ({overflow} refused by the retry \
         budget); the stopped replica refused {refused}",
        failures.len()
    );
    assert_none_failed(&fleet, ok, &failures);
}
