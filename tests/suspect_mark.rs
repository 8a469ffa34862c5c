//! A replica that fails a request kvroute routed to it is avoided from the next request on, before
//! any poll of Envoy's `/clusters` could report it unhealthy: kvroute polls only every 2 s here
//! (10× the other tests), and Envoy health-checks every 30 s, so Envoy itself still reports the
//! replica healthy at the end: no poll can have told kvroute. Only the suspect mark explains it.

use crate::common;

use common::{
    ask, client_per_request, first_homes, first_named, kv_stat, served_by, take_routing_headers,
    Fleet,
};
use kvroute::gateway::stat_names::Counter;
use serde_json::json;
use std::time::Duration;

/// Envoy worker threads, each with its own kvroute VM (the harness default). Envoy runs one more
/// VM on its main thread, which ticks (and so takes in marks) but routes nothing.
const WORKERS: usize = 2;

#[derive(Clone, Copy)]
enum Failure {
    /// Listener closed and every connection dropped.
    Kill,
    /// Listener closed; requests on connections still open are answered 503.
    Stop,
    /// Listener closed; a request on a connection still open has the connection closed under it.
    StopResetting,
}

async fn failed_replica_is_not_named_again_before_the_next_poll(failure: Failure) {
    let config = json!({ "debug_header": true, "stats_interval_ms": 2_000 });
    let fleet = Fleet::kvroute(4, config, |o| {
        o.health_check_interval = Some(Duration::from_secs(30))
    })
    .await;

    // One keep-alive connection, so one Envoy worker, until the failure: that worker then holds
    // an idle pooled connection to the replica, and the first request after the failure goes out
    // on it (and meets a 503, or a reset after the request was written).
    let homes = first_homes(&fleet, 4).await;
    let victim = homes[0];
    for i in 1..4 {
        let reply = fleet.chat(&ask(0, i)).await;
        assert_eq!(served_by(&fleet, &reply), victim, "the prefix has a home");
    }
    let dead = fleet.backends[victim].addr();
    match failure {
        Failure::Kill => fleet.backends[victim].kill().await,
        Failure::Stop => fleet.backends[victim].stop().await,
        Failure::StopResetting => fleet.backends[victim].stop_resetting().await,
    }
    take_routing_headers(&fleet);

    // Nothing knows yet: kvroute follows the prefix to the replica, and Envoy retries elsewhere.
    let reply = fleet.chat(&ask(0, 4)).await;
    let served = served_by(&fleet, &reply);
    let named = take_routing_headers(&fleet);
    assert_eq!(first_named(&named, dead), 1, "{named:?}");
    // The retry went to the next address kvroute listed (override_host uses one per attempt).
    let listed: Vec<&str> = named[0].split(',').collect();
    assert_eq!(
        Some(fleet.backends[served].addr().to_string().as_str()),
        listed.get(1).copied(),
        "{named:?}"
    );
    assert_eq!(kv_stat(&fleet, Counter::SuspectMarked.name()).await, 1);
    // The worker that saw the failure avoids the replica at once; every other VM (the other
    // worker's and the main thread's) takes in its mark on its next tick.
    let learned = fleet.envoy.wait_for_stat(
        Counter::SuspectLearned.name(),
        |v| v >= WORKERS as u64,
        Duration::from_secs(30),
    );
    learned.await.unwrap_or_else(|e| panic!("{e}"));

    // A new connection per request: the requests reach both workers' VMs.
    let client = client_per_request();
    let asked = 12;
    for i in 5..5 + asked {
        let reply = fleet.chat_via(&client, &ask(0, i)).await;
        assert_ne!(served_by(&fleet, &reply), victim);
    }
    let named = take_routing_headers(&fleet);
    assert_eq!(named.len(), asked, "each request was served once");
    let named_dead = first_named(&named, dead);
    let health = fleet
        .envoy
        .pool_health()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        health.get(&dead),
        Some(&true),
        "Envoy already reports {dead} unhealthy: the test cannot tell the mark from a health update"
    );
    assert_eq!(
        named_dead, 0,
        "kvroute named the failed replica {dead} first in {named_dead} of {asked} requests after \
         every worker knew it failed: {named:?}"
    );
    assert_eq!(kv_stat(&fleet, Counter::SuspectMarked.name()).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_replica_is_not_named_again_before_the_next_poll() {
    failed_replica_is_not_named_again_before_the_next_poll(Failure::Kill).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_replica_is_not_named_again_before_the_next_poll() {
    failed_replica_is_not_named_again_before_the_next_poll(Failure::Stop).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_resetting_requests_is_not_named_again_before_the_next_poll() {
    failed_replica_is_not_named_again_before_the_next_poll(Failure::StopResetting).await;
}
