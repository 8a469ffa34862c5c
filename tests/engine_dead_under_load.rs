//! A replica that answers 500 to every request while eight clients stream chat completions through
//! kvroute costs no request: Envoy retries each 500 once on kvroute's fallback address, and kvroute
//! marks the replica suspect, so its groups go to their next choice while it keeps failing. Once it
//! answers again its groups come back. Whether its health check fails too (a replica that is down)
//! or still says 200 (a vLLM whose engine died under a live API server) makes no difference.

use crate::common;

use common::load::{assert_none_failed, fleet_under_load, wait_until};
use common::{kv_stat, pool_stat, Fleet};
use kvroute::gateway::stat_names::Counter;
use kvroute::suspects::SUSPECT_MS;
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

const CLIENTS: usize = 8;
const GROUPS: usize = 12;
const VICTIM: usize = 1;

#[derive(Clone, Copy)]
enum Failure {
    /// Every request 500, `/health` 503: Envoy's health check notices too.
    Down,
    /// Every request 500, `/health` 200: only the answers tell.
    EngineDead,
}

impl Failure {
    fn set(self, fleet: &Fleet, on: bool) {
        let victim = &fleet.backends[VICTIM];
        match self {
            Failure::Down => victim.set_failing(on),
            Failure::EngineDead => victim.set_engine_dead(on),
        }
    }
}

async fn a_replica_answering_500_under_streamed_load_fails_no_request(failure: Failure) {
    // The shipped health check's pace (1 s), and a quick kvroute poll.
    let (fleet, load) = fleet_under_load(Duration::from_secs(1), CLIENTS, GROUPS, VICTIM).await;
    let victim = &fleet.backends[VICTIM];
    // The groups the victim was home to (or one of the homes of).
    let its_groups: BTreeSet<usize> = load
        .served_since(0)
        .into_iter()
        .filter(|&(_, b)| b == VICTIM)
        .map(|(g, _)| g)
        .collect();
    assert!(!its_groups.is_empty(), "the victim served no shared group");

    failure.set(&fleet, true);
    let received_at_failure = victim.received();
    let ok_at_failure = load.ok();
    let deadline = Instant::now() + Duration::from_secs(60);
    while victim.received() == received_at_failure
        || kv_stat(&fleet, Counter::SuspectMarked.name()).await == 0
    {
        assert!(
            Instant::now() < deadline,
            "no request reached the failing replica, or kvroute never marked it"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Keep it failing past one mark's expiry, and for a few hundred requests: named again once the
    // mark expires, it fails again and is marked again.
    let failing_since = Instant::now();
    wait_until(
        "the failure outlasted a suspect mark and 200 requests",
        Duration::from_secs(120),
        || {
            failing_since.elapsed() > Duration::from_millis(SUSPECT_MS + 2_000)
                && load.ok() >= ok_at_failure + 200
        },
    )
    .await;
    let failed_there = victim.received() - received_at_failure;
    let ok_while_failing = load.ok() - ok_at_failure;
    let marks = kv_stat(&fleet, Counter::SuspectMarked.name()).await;

    failure.set(&fleet, false);
    let mark = load.served_len();
    wait_until(
        "one of the victim's groups came back to it",
        Duration::from_secs(120),
        || {
            load.served_since(mark)
                .iter()
                .any(|(g, b)| *b == VICTIM && its_groups.contains(g))
        },
    )
    .await;
    let (ok, failures) = load.stop().await;
    let retries = pool_stat(&fleet, "upstream_rq_retry").await;
    println!(
        "{ok} streamed requests ok, {} failed; {failed_there} reached the failing replica, {retries} \
         retries, {marks} suspect marks",
        failures.len()
    );
    assert_none_failed(&fleet, ok, &failures);
    // Its share was a quarter of the requests; marked, it gets a few as each mark expires.
    assert!(
        failed_there * 8 <= ok_while_failing,
        "{failed_there} requests reached the failing replica while {ok_while_failing} were served: \
         it was not avoided"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_is_down_fails_no_request_and_its_groups_come_back() {
    a_replica_answering_500_under_streamed_load_fails_no_request(Failure::Down).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_engine_behind_a_healthy_api_server_fails_no_request_and_its_groups_come_back() {
    a_replica_answering_500_under_streamed_load_fails_no_request(Failure::EngineDead).await;
}
