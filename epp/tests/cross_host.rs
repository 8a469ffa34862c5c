//! The filter and the picker decide alike: one request sequence driven through the filter's
//! gateway (as its proxy-wasm adapter drives it, on the core's in-memory host) and through the
//! picker (each request as Envoy's ext_proc messages, translated by the picker's stream onto its
//! worker's gateway, native host and shared store) gives the same pick, fallbacks included, for
//! every policy.

use crate::common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use common::driven::Picker;
use kvroute::config::{Config, PolicyKind};
use kvroute::gateway::testing::{MemoryHost, MemoryStream};
use kvroute::gateway::{Body, Exchange, Gateway};
use strum::VariantNames;

const POOL: [&str; 4] = [
    "127.0.0.1:8001",
    "127.0.0.1:8002",
    "127.0.0.1:8003",
    "127.0.0.1:8004",
];
const START_MS: u64 = 1_000_000;

/// Request `i` of the sequence: a body (twelve system prompts, shared unevenly, as groups of
/// users share a preamble), its session and its request id.
fn request(i: usize) -> (String, String, String) {
    let group = (i * i + 3 * i) % 12 % (1 + i % 5 + i % 7);
    let system = format!("You are assistant number {group}. ").repeat(30);
    let body = serde_json::json!({
        "model": "m",
        "messages": [
            { "role": "system", "content": system },
            { "role": "user", "content": format!("question {i}") }
        ]
    });
    (
        body.to_string(),
        format!("session-{}", i % 7),
        format!("request-{i}"),
    )
}

fn request_headers(body: &str, session: &str, id: &str) -> Vec<(String, Vec<u8>)> {
    [
        (":method", "POST"),
        (":path", "/v1/chat/completions"),
        ("content-length", &body.len().to_string()),
        ("x-session-id", session),
        ("x-request-id", id),
    ]
    .iter()
    .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
    .collect()
}

/// The filter's side: its gateway as the proxy-wasm adapter drives it.
struct Filter {
    gateway: Gateway<MemoryHost>,
    tick_ms: u64,
    open: Vec<(Exchange, MemoryStream, Option<String>)>,
}

impl Filter {
    fn new(config: Config) -> Filter {
        Filter {
            gateway: Gateway::new(config, MemoryHost::at(START_MS)),
            tick_ms: 0,
            open: Vec::new(),
        }
    }

    fn tick(&mut self, now: u64) {
        self.gateway.host().now.set(now);
        self.gateway.tick(self.tick_ms);
        self.tick_ms = self.gateway.tick_period().max(1);
    }

    fn send(&mut self, i: usize) -> Option<String> {
        let (body, session, id) = request(i);
        let headers = request_headers(&body, &session, &id);
        let mut ex = Exchange::default();
        let gw = &mut self.gateway;
        assert!(gw.on_request_headers(&mut ex, &headers, false).buffer);
        assert_eq!(gw.on_request_body(&mut ex, body.len(), true), Body::Route);
        let stream = MemoryStream {
            headers: headers
                .iter()
                .map(|(n, v)| (n.clone(), String::from_utf8_lossy(v).into_owned()))
                .collect(),
            ..MemoryStream::default()
        };
        let pick = gw.route(&mut ex, body.as_bytes(), &stream);
        self.open.push((ex, stream, pick.clone()));
        pick
    }

    /// The oldest open request is answered 200 by the endpoint it was sent to, and ends.
    fn answer_oldest(&mut self) {
        let (mut ex, mut stream, pick) = self.open.remove(0);
        stream.upstream = pick
            .as_deref()
            .and_then(|p| p.split(',').next())
            .map(str::to_string);
        stream.status = Some(200);
        self.gateway.on_response_headers(&mut ex, false, &stream);
        self.gateway.on_end(&mut ex, &stream);
    }
}

#[test]
fn the_filter_and_the_picker_pick_alike_for_every_policy() {
    for name in PolicyKind::VARIANTS {
        let endpoints: Vec<String> = POOL.iter().map(|a| format!("\"{a}\"")).collect();
        let json = format!(
            r#"{{"policy":"{name}","endpoints":[{}],"fallback_endpoints":2,"stats_interval_ms":100}}"#,
            endpoints.join(",")
        );
        let config = Config::parse(json.as_bytes()).unwrap();
        let clock = Arc::new(AtomicU64::new(START_MS));
        let mut filter = Filter::new(config.clone());
        let mut picker = Picker::new(config, clock.clone());
        let mut picks = Vec::new();
        for i in 0..240 {
            if i % 10 == 0 {
                let now = START_MS + i as u64 * 25;
                clock.store(now, Ordering::Relaxed);
                filter.tick(now);
                picker.worker.tick();
            }
            let (body, session, id) = request(i);
            let theirs = picker.send(request_headers(&body, &session, &id), body);
            let ours = filter.send(i);
            assert_eq!(ours, theirs, "policy {name}, request {i}: the picks differ");
            picks.push(ours.expect("routed"));
            // Three requests in flight at a time, answered oldest first.
            if i >= 3 {
                filter.answer_oldest();
                picker.answer_oldest();
            }
        }
        let firsts: std::collections::BTreeSet<_> =
            picks.iter().filter_map(|p| p.split(',').next()).collect();
        assert!(
            firsts.len() > 1,
            "policy {name} sent everything to {firsts:?}"
        );
    }
}
