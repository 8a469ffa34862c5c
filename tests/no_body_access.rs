//! Loaded the way Istio's WasmPlugin loads it (no `allow_on_headers_stop_iteration`, no vm_id),
//! kvroute never hangs a request: it notices once that Envoy withholds bodies, logs it, and routes
//! from headers. With the flag, a client that sends its body late is still routed on its body.

use crate::common;

use common::{chat_body, debug_config, kv_stat, served_by, system_prompt, Fleet};
use kvroute::gateway::stat_names;
use kvroute::router::Fallback;
use std::collections::{HashMap, HashSet};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const FLAG: &str = "allow_on_headers_stop_iteration";
/// How long the slow client waits between its headers and its body: longer than anything kvroute
/// waits before it concludes (100 ms ticks, 1 s for a stalled partial body).
const CLIENT_PAUSE: Duration = Duration::from_millis(1500);

/// What a raw HTTP/1.1 exchange returned.
struct RawReply {
    status: u16,
    headers: HashMap<String, String>,
}

/// How a raw request frames its body.
#[derive(Clone, Copy, PartialEq)]
enum Framing {
    ContentLength,
    Chunked,
}

/// POSTs `body` to the chat API over a plain connection: the headers first, then after `pause` the
/// body, as a slow client would.
async fn raw_post(fleet: &Fleet, body: &str, pause: Duration, framing: Framing) -> RawReply {
    let addr = fleet.envoy.url().replace("http://", "");
    let mut conn = tokio::net::TcpStream::connect(&addr)
        .await
        .expect("connect");
    let (length, payload) = match framing {
        Framing::ContentLength => (format!("content-length: {}", body.len()), body.to_string()),
        Framing::Chunked => (
            "transfer-encoding: chunked".to_string(),
            format!("{:x}\r\n{body}\r\n0\r\n\r\n", body.len()),
        ),
    };
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: kvroute\r\ncontent-type: application/json\r\n\
         {length}\r\nconnection: close\r\n\r\n"
    );
    conn.write_all(head.as_bytes()).await.expect("send headers");
    // The scenario itself: a client that is slow to send its body, not a wait for a condition.
    tokio::time::sleep(pause).await;
    conn.write_all(payload.as_bytes()).await.expect("send body");
    let mut raw = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(60), conn.read_to_end(&mut raw)).await;
    read.unwrap_or_else(|_| panic!("no answer in 60 s\n{}", fleet.envoy.log_tail()))
        .expect("read reply");
    let text = String::from_utf8_lossy(&raw);
    let head = text.split("\r\n\r\n").next().unwrap_or_default();
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {text:?}"));
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    RawReply { status, headers }
}

/// kvroute's log lines about the missing flag, by Envoy thread id (the second `[...]` field).
fn flag_errors_by_thread(log: &str) -> Vec<String> {
    log.lines()
        .filter(|l| l.contains("wasm log") && l.contains(FLAG))
        .map(|l| {
            assert!(l.contains("[error]"), "not logged as an error: {l}");
            l.split('[').nth(2).unwrap_or_default().to_string()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_stop_iteration_flag_every_post_answers() {
    let fleet = Fleet::kvroute(4, debug_config(), |o| o.wasm_plugin_like = true).await;
    let system = system_prompt(1);
    let fallback = "fallback:no_body_access";

    // A slow client (its body arrives while Envoy already holds others') alongside quick ones.
    let slow_body = chat_body(&system, "slow", false).to_string();
    let slow = raw_post(&fleet, &slow_body, CLIENT_PAUSE, Framing::ContentLength);
    let quick = async {
        let mut backends = HashSet::new();
        for i in 0..6 {
            for stream in [false, true] {
                let reply = fleet
                    .chat(&chat_body(&system, &format!("q{i}"), stream))
                    .await;
                backends.insert(served_by(&fleet, &reply));
                assert_eq!(reply.decision.as_deref(), Some(fallback));
                let text = String::from_utf8_lossy(&reply.body);
                if stream {
                    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
                } else {
                    assert!(text.contains("chat.completion"), "{text}");
                }
            }
        }
        backends
    };
    let (slow, backends) = tokio::join!(slow, quick);
    assert_eq!(slow.status, 200, "{}", fleet.envoy.log_tail());
    assert_eq!(
        slow.headers.get("x-kvroute-decision").map(String::as_str),
        Some(fallback)
    );
    assert!(
        backends.len() > 1,
        "without a session, Envoy's round robin spreads them: {backends:?}"
    );

    // A chunked body (no content-length): Envoy can be seen holding it, not completing it.
    let body = chat_body(&system, "chunked", false).to_string();
    let reply = raw_post(&fleet, &body, Duration::ZERO, Framing::Chunked).await;
    assert_eq!(reply.status, 200, "{}", fleet.envoy.log_tail());
    assert_eq!(
        reply.headers.get("x-kvroute-decision").map(String::as_str),
        Some(fallback)
    );

    // Routed from headers: one session, one backend.
    let mut session_backends = HashSet::new();
    for i in 0..8 {
        let body = chat_body(&system_prompt(i), "hi", false).to_string();
        let reply = fleet
            .post(
                "/v1/chat/completions",
                body,
                &[
                    ("content-type", "application/json"),
                    ("x-session-id", "alice"),
                ],
            )
            .await;
        session_backends.insert(served_by(&fleet, &reply));
        assert_eq!(reply.decision.as_deref(), Some(fallback));
    }
    assert_eq!(session_backends.len(), 1, "{session_backends:?}");

    let posts = 1 + 12 + 1 + 8;
    assert_eq!(
        kv_stat(&fleet, &stat_names::fallback(Fallback::NoBodyAccess)).await,
        posts
    );
    let errors = flag_errors_by_thread(&fleet.envoy.log());
    let threads: HashSet<&String> = errors.iter().collect();
    assert!(!errors.is_empty(), "{}", fleet.envoy.log_tail());
    assert_eq!(
        threads.len(),
        errors.len(),
        "one error per worker VM at most: {errors:?}"
    );
    assert!(errors.len() <= 2, "two workers: {errors:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_client_with_the_flag_is_routed_on_its_body() {
    let fleet = Fleet::kvroute(4, debug_config(), |_| {}).await;
    // The first POSTs of both workers, so each VM is still watching when they pause.
    let body = |i: usize| chat_body(&system_prompt(i), "late body", false).to_string();
    let slow = |body| raw_post(&fleet, body, CLIENT_PAUSE, Framing::ContentLength);
    let bodies: Vec<String> = (0..4).map(body).collect();
    let (a, b, c, d) = tokio::join!(
        slow(&bodies[0]),
        slow(&bodies[1]),
        slow(&bodies[2]),
        slow(&bodies[3]),
    );
    for reply in [a, b, c, d] {
        assert_eq!(reply.status, 200, "{}", fleet.envoy.log_tail());
        let decision = reply.headers.get("x-kvroute-decision").cloned();
        assert!(
            matches!(
                decision.as_deref(),
                Some("home" | "balance" | "affinity" | "spread")
            ),
            "routed on the body, not a fallback: {decision:?}"
        );
    }
    let reply = fleet
        .chat(&chat_body(&system_prompt(0), "next", false))
        .await;
    served_by(&fleet, &reply);
    assert_eq!(reply.decision.as_deref(), Some("home"));
    assert_eq!(
        kv_stat(&fleet, &stat_names::fallback(Fallback::NoBodyAccess)).await,
        0
    );
    let log = fleet.envoy.log();
    assert!(!log.contains(FLAG), "nothing about the flag: {log}");
}
