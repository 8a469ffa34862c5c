//! The harness itself, without kvroute: Envoy starts from the shipped bootstrap with a plain LB
//! policy, and the test backends answer, record and die as documented.

use crate::common;

use common::{chat_body, Fleet};
use kvroute_harness::backend::{self, Backend};
use kvroute_harness::Lb;
use std::collections::HashSet;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_robin_envoy_spreads_requests_over_all_backends() {
    let fleet = Fleet::start(3, Lb::RoundRobin, |_| {}).await;
    let mut seen = HashSet::new();
    for i in 0..30 {
        let reply = fleet
            .chat(&chat_body(
                "same system prompt",
                &format!("question {i}"),
                false,
            ))
            .await;
        assert_eq!(reply.status, 200);
        assert_eq!(
            reply.body,
            backend::json_response(reply.backend.unwrap(), true).as_bytes()
        );
        seen.insert(reply.backend.unwrap());
    }
    assert_eq!(seen.len(), 3, "round robin must use every backend");
    let received: u64 = fleet.backends.iter().map(Backend::received).sum();
    assert_eq!(received, 30, "health checks must not be counted");
    let recorded = fleet
        .backends
        .iter()
        .flat_map(Backend::requests)
        .find(|r| r.body.ends_with(b"}"))
        .unwrap();
    assert_eq!(
        (recorded.method.as_str(), recorded.path.as_str()),
        ("POST", "/v1/chat/completions")
    );
    assert_eq!(recorded.header_values("content-type"), ["application/json"]);
    let sent: serde_json::Value = serde_json::from_slice(&recorded.body).unwrap();
    assert_eq!(sent["messages"][0]["content"], "same system prompt");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ring_hash_envoy_keeps_one_header_value_on_one_backend() {
    let fleet = Fleet::start(
        4,
        Lb::RingHash {
            header: "x-user".into(),
        },
        |_| {},
    )
    .await;
    for user in ["alice", "bob", "carol"] {
        let mut seen = HashSet::new();
        for i in 0..10 {
            let body = chat_body("sys", &format!("q{i}"), false).to_string();
            let reply = fleet
                .post("/v1/chat/completions", body, &[("x-user", user)])
                .await;
            assert_eq!(reply.status, 200);
            seen.insert(reply.backend.unwrap());
        }
        assert_eq!(seen.len(), 1, "{user} moved between backends: {seen:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_request_envoy_streams_sse_through() {
    let fleet = Fleet::start(2, Lb::LeastRequest, |_| {}).await;
    let reply = fleet.chat(&chat_body("sys", "stream please", true)).await;
    assert_eq!(reply.status, 200);
    let expected = backend::sse_events(reply.backend.unwrap(), true).concat();
    assert_eq!(String::from_utf8(reply.body).unwrap(), expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_backend_is_marked_unhealthy_and_avoided() {
    let fleet = Fleet::start(2, Lb::RoundRobin, |o| {
        o.health_check_interval = Some(Duration::from_millis(200))
    })
    .await;
    fleet.backends[1].kill().await;
    let dead = fleet.backends[1].addr();
    let wait = fleet
        .envoy
        .wait_for_pool(|h| h.get(&dead) == Some(&false), Duration::from_secs(20));
    wait.await.unwrap_or_else(|e| panic!("{e}"));
    for i in 0..10 {
        let reply = fleet.chat(&chat_body("sys", &format!("q{i}"), false)).await;
        assert_eq!((reply.status, reply.backend), (200, Some(0)));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_backend_answers_500_and_fails_health_checks() {
    let fleet = Fleet::start(2, Lb::RoundRobin, |o| {
        o.health_check_interval = Some(Duration::from_millis(200))
    })
    .await;
    fleet.backends[0].set_failing(true);
    let sick = fleet.backends[0].addr();
    // Asked directly (through Envoy a 500 is retried on the other backend), it answers 500.
    let direct = fleet
        .client
        .post(format!("http://{sick}/v1/chat/completions"))
        .json(&chat_body("sys", "direct", false))
        .send()
        .await
        .expect("the failing backend answers");
    assert_eq!(direct.status(), 500);
    assert_eq!(direct.text().await.expect("body"), "failing");
    let wait = fleet
        .envoy
        .wait_for_pool(|h| h.get(&sick) == Some(&false), Duration::from_secs(20));
    wait.await.unwrap_or_else(|e| panic!("{e}"));
    let reply = fleet.chat(&chat_body("sys", "q", false)).await;
    assert_eq!((reply.status, reply.backend), (200, Some(1)));
}

/// A port the harness found free can be taken by a parallel test before Envoy binds it. The first
/// bootstrap here listens on a port this test holds, as if another process had just taken it:
/// Envoy exits on the bind, and the harness starts it again on fresh ports.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_starts_again_when_its_port_was_taken() {
    use kvroute_harness::{bootstrap, paths, Envoy, EnvoyOptions, HarnessError};
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let taken_port = taken.local_addr().expect("addr").port();
    let shipped = std::fs::read_to_string(paths::shipped_bootstrap()).expect("bootstrap");
    let backends = Backend::start_many(1).await.expect("backend");
    let addrs = [backends[0].addr()];
    let mut listeners = Vec::new();
    let envoy = Envoy::start_with(
        |admin_port, listener_port, _| -> Result<String, HarnessError> {
            let listener_port = if listeners.is_empty() {
                taken_port
            } else {
                listener_port
            };
            listeners.push(listener_port);
            let patch = bootstrap::Patch::new(admin_port, listener_port, &addrs, &Lb::RoundRobin);
            bootstrap::render(&shipped, &patch)
        },
        EnvoyOptions::default(),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(listeners.len(), 2, "Envoy started on ports {listeners:?}");
    assert_ne!(envoy.url(), format!("http://127.0.0.1:{taken_port}"));
    let reply = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", envoy.url()))
        .json(&chat_body("a prompt", "a question", false))
        .send()
        .await
        .expect("request");
    assert_eq!(reply.status(), 200);
    drop(taken);
}
