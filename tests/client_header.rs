//! A client cannot pick the upstream by sending kvroute's routing header itself.

use crate::common;

use common::{chat_body, debug_config, served_by, system_prompt, Fleet};

const HEADER: &str = "x-gateway-destination-endpoint";

/// A kvroute fleet of 4, the home of `prompt`'s group (one request sent), and the address of
/// another backend for a client to forge; the backends' request logs emptied.
async fn fleet_with_home(prompt: &str) -> (Fleet, usize, String) {
    let fleet = Fleet::kvroute(4, debug_config(), |_| {}).await;
    let home = served_by(
        &fleet,
        &fleet.chat(&chat_body(prompt, "warm up", false)).await,
    );
    let forged = fleet.backends[(home + 1) % 4].addr().to_string();
    for b in &fleet.backends {
        b.take_requests();
    }
    (fleet, home, forged)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_sent_routing_header_never_decides_the_upstream() {
    let prompt = system_prompt(11);
    let (fleet, home, forged) = fleet_with_home(&prompt).await;
    let x = (home + 1) % 4;

    for i in 0..8 {
        let body = chat_body(&prompt, &format!("q{i}"), false).to_string();
        let reply = fleet
            .post(
                "/v1/chat/completions",
                body,
                &[("content-type", "application/json"), (HEADER, &forged)],
            )
            .await;
        assert_eq!(
            served_by(&fleet, &reply),
            home,
            "the forged header moved a routed request"
        );
    }
    let got = fleet.backends[home].take_requests();
    assert_eq!(got.len(), 8);
    for r in &got {
        let values = r.header_values(HEADER);
        assert_eq!(
            values.len(),
            1,
            "exactly kvroute's value must arrive: {values:?}"
        );
        assert!(
            values[0].starts_with(&fleet.backends[home].addr().to_string()),
            "{values:?}"
        );
        assert_ne!(values[0], forged);
    }

    // Unroutable requests: the header is stripped and round robin picks, not the client.
    for b in &fleet.backends {
        b.take_requests();
    }
    for _ in 0..8 {
        let reply = fleet.get("/v1/models", &[(HEADER, &forged)]).await;
        served_by(&fleet, &reply);
        let reply = fleet
            .post(
                "/v1/embeddings",
                "{}",
                &[(HEADER, &forged), (HEADER, &forged)],
            )
            .await;
        assert_eq!(reply.status, 404);
    }
    let all: Vec<_> = fleet.backends.iter().map(|b| b.take_requests()).collect();
    assert!(
        all[x].len() < 16,
        "every unroutable request went where the client said"
    );
    for r in all.iter().flatten() {
        assert!(
            r.header_values(HEADER).is_empty(),
            "client header reached a backend: {r:?}"
        );
    }
}

/// Header values are bytes: HTTP allows 0x80-0xFF in them and Envoy forwards such values. A request
/// carrying one (here in an unrelated header, and in a forged routing header) is routed like any
/// other, and the forged header is still replaced: reading the headers never assumes UTF-8.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_values_that_are_not_utf8_are_routed_and_still_replaced() {
    let prompt = system_prompt(12);
    let (fleet, home, forged) = fleet_with_home(&prompt).await;
    let mut forged = forged.into_bytes();
    forged.push(0xff);
    for i in 0..4 {
        let body = chat_body(&prompt, &format!("q{i}"), false).to_string();
        let reply = fleet
            .post_raw_headers(
                "/v1/chat/completions",
                body,
                &[
                    ("content-type", b"application/json"),
                    ("x-note", b"caf\xe9 \xff"),
                    (HEADER, &forged),
                ],
            )
            .await;
        assert_eq!(served_by(&fleet, &reply), home, "{reply:?}");
        let decision = reply.decision.as_deref().unwrap_or("none");
        assert!(
            !decision.starts_with("fallback") && decision != "none",
            "request {i} was not routed: decision {decision}\n{}",
            fleet.envoy.log_tail()
        );
    }
    let got = fleet.backends[home].take_requests();
    assert_eq!(got.len(), 4);
    for r in &got {
        let values = r.header_values(HEADER);
        assert_eq!(values.len(), 1, "exactly kvroute's value: {values:?}");
        assert!(
            values[0].starts_with(&fleet.backends[home].addr().to_string()),
            "{values:?}"
        );
    }
}

/// The `session` policy keys on a header the client sends: a value that is not UTF-8 still keys
/// it (each such value to one endpoint), where reading it as text trapped the VM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_header_that_is_not_utf8_still_keys_the_session() {
    let config =
        serde_json::json!({"debug_header": true, "stats_interval_ms": 200, "policy": "session"});
    let fleet = Fleet::kvroute(4, config, |_| {}).await;
    let mut served = Vec::new();
    for i in 0..4 {
        let body = chat_body(&system_prompt(13), &format!("q{i}"), false).to_string();
        let reply = fleet
            .post_raw_headers(
                "/v1/chat/completions",
                body,
                &[
                    ("content-type", b"application/json"),
                    ("x-session-id", b"user-\xe9\xff"),
                ],
            )
            .await;
        served.push(served_by(&fleet, &reply));
        assert_eq!(reply.decision.as_deref(), Some("session"), "{reply:?}");
    }
    assert!(served.iter().all(|&b| b == served[0]), "{served:?}");
}
