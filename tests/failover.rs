//! A backend that dies is routed around: retries cover the moment of death (a refused connection,
//! or a reset on a pooled connection to it), and once Envoy marks it unhealthy kvroute no longer
//! names it at all, not even as a fallback address.

use crate::common;

use common::{
    ask, debug_config, first_homes, served_by, take_routing_headers, wait_for_fresh_poll,
    wait_for_polls, Fleet,
};
use kvroute::gateway::stat_names::Gauge;
use kvroute::policy::cache_aware::HOLD_POLLS;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_backend_is_avoided_once_unhealthy_and_no_request_fails() {
    let fleet = Fleet::kvroute(4, debug_config(), |o| {
        o.health_check_interval = Some(Duration::from_millis(200))
    })
    .await;
    let homes = first_homes(&fleet, 4).await;
    let victim = homes[0];
    // Requests go one at a time, so the kill falls between requests: every failure would be
    // kvroute's (or the retry policy's), not a response cut by the kill itself.
    for i in 1..5 {
        for g in 0..4 {
            served_by(&fleet, &fleet.chat(&ask(g, i)).await);
        }
    }
    // Returns once the victim's listener and every connection to it are closed: Envoy still holds
    // pooled connections it has not yet seen close, and the next request may go out on one.
    fleet.backends[victim].kill().await;
    for i in 5..10 {
        for g in 0..4 {
            let reply = fleet.chat(&ask(g, i)).await;
            assert_ne!(served_by(&fleet, &reply), victim);
        }
    }
    let dead = fleet.backends[victim].addr();
    let marked = fleet
        .envoy
        .wait_for_pool(|h| h.get(&dead) == Some(&false), Duration::from_secs(30));
    marked.await.unwrap_or_else(|e| panic!("{e}"));
    // Homes settle once the gateway has warmed up (10 polls) and places the four groups by its
    // balanced assignment: until then a group goes to its first live rendezvous choice. A group
    // the assignment gives another home moves there once that has held for `HOLD_POLLS` polls,
    // counted from when the gateway warmed up: wait that out too, or on a slow machine the move
    // could fall inside the loop below.
    let placed = fleet.envoy.wait_for_stat(
        Gauge::GroupsPlaced.name(),
        |v| v >= 4,
        Duration::from_secs(30),
    );
    placed.await.unwrap_or_else(|e| panic!("{e}"));
    // (A poll more for the margin.)
    wait_for_polls(&fleet.envoy, HOLD_POLLS + 1).await;
    // kvroute reads the new health flags on its next poll of Envoy's /clusters.
    wait_for_fresh_poll(&fleet).await;
    // What kvroute names from here on: the routing header each served request carried. (Envoy's
    // connect-failure count would also see kvroute's own engine-metrics polls still in flight.)
    take_routing_headers(&fleet);
    // One conversation of the dead backend's group: a group's conversations may split between
    // homes where 4 groups on 3 live backends cannot even out whole.
    let (mut moved, mut seen) = (Vec::new(), Vec::new());
    let start = std::time::Instant::now();
    for i in 10..30 {
        for g in 0..4 {
            let question = if g == 0 { 10 } else { i };
            let reply = fleet.chat(&ask(g, question)).await;
            assert_ne!(served_by(&fleet, &reply), victim);
            if g == 0 {
                moved.push(served_by(&fleet, &reply));
                let decision = reply.decision.unwrap_or_default();
                let ms = start.elapsed().as_millis();
                seen.push(format!("{ms} ms: {} ({decision})", moved[moved.len() - 1]));
            }
        }
    }
    let named = take_routing_headers(&fleet);
    assert_eq!(named.len(), 80, "every request reached a live backend once");
    let dead_named: Vec<&String> = named
        .iter()
        .filter(|h| h.split(',').any(|a| a.trim() == dead.to_string()))
        .collect();
    assert!(
        dead_named.is_empty(),
        "kvroute still named the dead backend {dead}: {dead_named:?}"
    );
    moved.dedup();
    assert_eq!(
        moved.len(),
        1,
        "the dead backend's conversation did not settle on one new home: {moved:?}; each request \
         of it (time in the loop, backend, decision): {seen:?}"
    );
}
