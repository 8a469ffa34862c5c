//! A replica that answers 5xx costs no request: Envoy retries a 500, 502 or 504 from the first
//! attempt once, on the next address kvroute listed. A request that makes every replica fail (a
//! poison prompt) so reaches two of them, never more, whatever retry headers its client sent; a
//! client's own error (4xx) goes back as it is, unretried, and blames no replica; a server error
//! the retry does not replay marks the replica that answered it suspect.

use crate::common;

use common::{
    ask, chat_body, debug_config, kv_stat, served_by, system_prompt, take_routing_headers,
};
use common::{pool_stat, reached_since, received, Fleet, Reply};
use kvroute::gateway::stat_names::Counter;
use std::collections::BTreeSet;
use std::time::Duration;

/// A marker in a prompt that the poisoned backends fail on.
const POISON: &str = "kvroute-test-poison-7f3a";

/// A poisoned question to `group`, with extra request `headers`.
async fn poisoned(fleet: &Fleet, group: usize, headers: &[(&str, &str)]) -> (Reply, bool) {
    let body = chat_body(&system_prompt(group), &format!("{POISON} {group}"), false);
    let mut req = fleet
        .client
        .post(format!("{}/v1/chat/completions", fleet.envoy.url()))
        .header("content-type", "application/json")
        .body(body.to_string());
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = req
        .send()
        .await
        .unwrap_or_else(|e| panic!("request failed: {e}"));
    let stamped = resp.headers().contains_key("x-kvroute-attempt");
    let status = resp.status().as_u16();
    let backend = resp
        .headers()
        .get("x-backend")
        .and_then(|v| v.to_str().ok()?.parse().ok());
    let body = resp.bytes().await.expect("response body").to_vec();
    let reply = Reply {
        status,
        backend,
        decision: None,
        body,
    };
    (reply, stamped)
}

/// Four backends behind kvroute, each answering `status` to a prompt with the marker.
async fn poisoned_fleet(status: u16) -> Fleet {
    let fleet = Fleet::kvroute(4, debug_config(), |_| {}).await;
    for b in &fleet.backends {
        b.set_poison(Some((POISON, status)));
    }
    fleet
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_every_replica_fails_reaches_two_of_them() {
    let fleet = poisoned_fleet(500).await;
    take_routing_headers(&fleet);
    // The second and third requests' clients ask for more retries on any 5xx: Envoy takes no
    // retry policy from a client it does not trust, so one client cannot spread its poison.
    let asks: [&[(&str, &str)]; 3] = [
        &[],
        &[("x-envoy-retry-on", "5xx"), ("x-envoy-max-retries", "5")],
        &[
            ("x-envoy-retry-on", "retriable-status-codes"),
            ("x-envoy-retriable-status-codes", "500"),
            ("x-envoy-max-retries", "5"),
        ],
    ];
    for (g, headers) in asks.iter().enumerate() {
        let before = received(&fleet);
        let (reply, stamped) = poisoned(&fleet, g, headers).await;
        assert_eq!(
            reply.status,
            500,
            "{:?}",
            String::from_utf8_lossy(&reply.body)
        );
        assert_eq!(reply.body, b"poisoned");
        assert!(!stamped, "the retry policy's stamp reached the client");
        let mut reached = reached_since(&fleet, &before);
        reached.sort();
        let named = take_routing_headers(&fleet);
        assert_eq!(
            reached.len(),
            2,
            "request {g} reached backends {reached:?} (named {named:?}), not two"
        );
        assert_ne!(reached[0], reached[1], "retried on the same backend");
        // Both attempts went where kvroute listed: its choice, then its fallback.
        let listed: BTreeSet<&str> = named[0].split(',').map(str::trim).collect();
        let addrs: Vec<String> = reached
            .iter()
            .map(|&i| fleet.backends[i].addr().to_string())
            .collect();
        for addr in &addrs {
            assert!(listed.contains(addr.as_str()), "{addr} not in {named:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_error_goes_back_unretried_and_blames_no_replica() {
    let fleet = poisoned_fleet(400).await;
    served_by(&fleet, &fleet.chat(&ask(0, 0)).await);
    take_routing_headers(&fleet);
    for round in 0..3 {
        let before = received(&fleet);
        let (reply, stamped) = poisoned(&fleet, 0, &[]).await;
        assert_eq!(reply.status, 400);
        assert_eq!(
            reply.body, b"poisoned",
            "the client's error reaches it unchanged"
        );
        assert!(!stamped, "the retry policy's stamp reached the client");
        let reached = reached_since(&fleet, &before);
        assert_eq!(reached.len(), 1, "round {round}: reached {reached:?}");
        // It went to kvroute's choice, the first address it listed.
        let named = take_routing_headers(&fleet);
        let first = named[0].split(',').next().unwrap_or_default().trim();
        assert_eq!(first, fleet.backends[reached[0]].addr().to_string());
        // And the next request of the group settles the first's end (on_log) on that worker.
        served_by(&fleet, &fleet.chat(&ask(0, round + 1)).await);
    }
    // The last 400's end was settled when the request after it was routed, before its answer
    // came back, and a mark is counted as it is made: there is nothing more to wait for.
    assert_eq!(
        kv_stat(&fleet, Counter::SuspectMarked.name()).await,
        0,
        "a 400 marked a replica"
    );
    assert_eq!(pool_stat(&fleet, "upstream_rq_retry").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_error_the_retry_does_not_replay_still_marks_the_replica() {
    // 507 (insufficient storage) is a server error outside the retried 500, 502 and 504: it
    // reaches the client from the replica kvroute chose, which kvroute then marks suspect.
    let fleet = poisoned_fleet(507).await;
    take_routing_headers(&fleet);
    let before = received(&fleet);
    let (reply, _) = poisoned(&fleet, 0, &[]).await;
    assert_eq!(reply.status, 507);
    let reached = reached_since(&fleet, &before);
    assert_eq!(reached.len(), 1, "reached {reached:?}");
    let named = take_routing_headers(&fleet);
    let first = named[0].split(',').next().unwrap_or_default().trim();
    assert_eq!(first, fleet.backends[reached[0]].addr().to_string());
    let marked = fleet.envoy.wait_for_stat(
        Counter::SuspectMarked.name(),
        |v| v >= 1,
        Duration::from_secs(10),
    );
    marked
        .await
        .unwrap_or_else(|e| panic!("the replica that answered 507 was not marked: {e}"));
}
