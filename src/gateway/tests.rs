//! The gateway driven through its entry points with an in-memory host, as the adapter drives it.

use super::testing::{MemoryHost, MemoryStream};
use super::*;
use crate::in_flight;
use crate::policy::Decision;
use crate::rendezvous::endpoint_id;
use crate::router::Fallback;
use crate::template::Outcome;

const POOL: [&str; 4] = [
    "10.0.0.1:8000",
    "10.0.0.2:8000",
    "10.0.0.3:8000",
    "10.0.0.4:8000",
];

fn gateway(config: &str, host: MemoryHost) -> Gateway<MemoryHost> {
    match Gateway::configure(config.as_bytes(), host) {
        Ok(gateway) => gateway,
        Err(e) => panic!("{e}"),
    }
}

/// A gateway over the static pool.
fn static_pool(extra: &str) -> Gateway<MemoryHost> {
    let endpoints: Vec<String> = POOL.iter().map(|a| format!("\"{a}\"")).collect();
    let config = format!(r#"{{"endpoints":[{}]{extra}}}"#, endpoints.join(","));
    gateway(&config, MemoryHost::at(1_000_000))
}

fn chat(system: &str, user: &str) -> String {
    format!(
        r#"{{"model":"m","messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"{user}"}}]}}"#
    )
}

fn headers(body: &str) -> Vec<(String, Vec<u8>)> {
    [
        (":method", "POST"),
        (":path", "/v1/chat/completions"),
        ("content-length", &body.len().to_string()),
    ]
    .iter()
    .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
    .collect()
}

/// Takes a request through the request side, as the adapter does: the routing header's value.
fn send(
    gw: &mut Gateway<MemoryHost>,
    ex: &mut Exchange,
    body: &str,
    stream: &MemoryStream,
) -> Option<String> {
    let verdict = gw.on_request_headers(ex, &headers(body), false);
    assert!(verdict.buffer, "{verdict:?}");
    assert_eq!(gw.on_request_body(ex, body.len(), true), Body::Route);
    assert_eq!(ex.body_to_route(), Some(body.len()));
    gw.route(ex, body.as_bytes(), stream)
}

fn usage_body(prompt: u64, cached: u64) -> Vec<u8> {
    format!(
        r#"{{"id":"c","choices":[],"usage":{{"prompt_tokens":{prompt},"completion_tokens":1,"prompt_tokens_details":{{"cached_tokens":{cached}}}}}}}"#
    )
    .into_bytes()
}

/// The shared in-flight count of endpoint `addr`.
fn inflight(gw: &Gateway<MemoryHost>, addr: &str) -> u32 {
    in_flight::read(&*gw.host().store).inflight(endpoint_id(addr))
}

#[test]
fn a_request_routed_then_served_by_another_host_after_a_retry_settles_there_and_counts_return_to_zero(
) {
    let mut gw = static_pool("");
    gw.tick(100);
    let body = chat(&"You are a helpful assistant. ".repeat(40), "hello");
    let mut ex = Exchange::default();
    let stream = MemoryStream::default();
    let Some(value) = send(&mut gw, &mut ex, &body, &stream) else {
        panic!("not routed");
    };
    let listed: Vec<&str> = value.split(',').collect();
    assert_eq!(listed.len(), 2, "the chosen endpoint and one fallback");
    let (chosen, retried) = (listed[0].to_string(), listed[1].to_string());
    // The tick writes the worker's own count to shared data, and the decision to its stat.
    assert_eq!(
        inflight(&gw, &chosen),
        0,
        "counted in the worker until its tick"
    );
    gw.tick(100);
    assert_eq!(inflight(&gw, &chosen), 1);
    assert_eq!(gw.host().stat(&stat_names::routed(Decision::Home)), 1);
    assert_eq!(
        gw.host()
            .stat(&stat_names::inflight(&crate::usage::stat_segment(&chosen))),
        1
    );

    // Envoy retried on the fallback address: the answer came from there, with usage.
    let response = MemoryStream {
        upstream: Some(retried.clone()),
        body: usage_body(300, 0),
        ..MemoryStream::default()
    };
    assert_eq!(gw.on_response_headers(&mut ex, false, &response), None);
    assert_eq!(gw.host().stat(Counter::ServedElsewhere.name()), 1);
    assert_eq!(
        gw.host().stat(Counter::SuspectMarked.name()),
        1,
        "the chosen one failed"
    );
    gw.on_response_body(&mut ex, response.body.len(), true, &response);
    gw.on_end(&mut ex, &response);
    gw.on_end(&mut ex, &response); // Envoy reports the end twice: settled once
    assert_eq!(
        response.reads.get(),
        2,
        "the upstream and one body end: no status, no flags"
    );
    assert!(
        gw.host().stat(Counter::AffinityWithdrawn.name()) > 0,
        "taken back from the chosen host"
    );

    gw.tick(100);
    let seg = crate::usage::stat_segment(&retried);
    assert_eq!(gw.host().stat(Counter::UsageResponses.name()), 1);
    assert_eq!(gw.host().stat(Counter::UsagePromptTokens.name()), 300);
    assert_eq!(
        gw.host()
            .stat(&Counter::UsagePromptTokens.of_endpoint(&seg)),
        300
    );
    assert_eq!(inflight(&gw, &chosen), 0);
    assert_eq!(inflight(&gw, &retried), 0);
    assert!(
        in_flight::read(&*gw.host().store).counts.is_empty(),
        "counts back to zero"
    );
    let chosen_seg = crate::usage::stat_segment(&chosen);
    assert_eq!(gw.host().stat(&stat_names::inflight(&chosen_seg)), 0);

    // The next request of the group avoids the suspect it was homed on.
    let mut next = Exchange::default();
    let again = send(
        &mut gw,
        &mut next,
        &chat(&"You are a helpful assistant. ".repeat(40), "more"),
        &stream,
    );
    assert!(again.is_some_and(|v| !v.starts_with(&chosen)));
}

#[test]
fn a_new_gateway_shows_its_counters_and_each_decision_reason_and_outcome_at_zero() {
    use strum::VariantArray;
    let gw = static_pool("");
    let names: Vec<String> = (Counter::VARIANTS.iter().map(|c| c.name().to_string()))
        .chain(Decision::VARIANTS.iter().map(|&d| stat_names::routed(d)))
        .chain(Fallback::VARIANTS.iter().map(|&f| stat_names::fallback(f)))
        .chain(Outcome::VARIANTS.iter().map(|&o| stat_names::template(o)))
        .chain([stat_names::MATCH_PERCENT, Gauge::SlotsUsed.name()].map(String::from))
        .collect();
    for name in &names {
        assert!(gw.host().defined(name), "{name}");
        assert_eq!(gw.host().stat(name), 0, "{name}");
    }
    let distinct: std::collections::HashSet<&String> = names.iter().collect();
    assert_eq!(distinct.len(), names.len(), "no two stats share a name");
}

#[test]
fn template_outcomes_are_counted_by_the_gateway_on_its_tick() {
    let mut gw = static_pool(r#","models":{"m":"{{ messages[0].content }}"}"#);
    gw.tick(100);
    let rendered = chat("You are a helpful assistant.", "hello");
    let unknown_model = rendered.replacen(r#""model":"m""#, r#""model":"x""#, 1);
    for body in [&rendered, &rendered, &unknown_model] {
        let mut ex = Exchange::default();
        assert!(send(&mut gw, &mut ex, body, &MemoryStream::default()).is_some());
    }
    let count = |o| gw.host().stat(&stat_names::template(o));
    assert_eq!(count(Outcome::Rendered), 0, "written on the tick");
    gw.tick(100);
    let count = |o| gw.host().stat(&stat_names::template(o));
    assert_eq!(
        [Outcome::Rendered, Outcome::NoTemplate, Outcome::Failed].map(count),
        [2, 1, 0]
    );
}

#[test]
fn a_response_its_chosen_host_served_keeps_the_affinity_and_blames_nobody() {
    let mut gw = static_pool(r#","debug_header":true"#);
    let body = chat(&"System prompt. ".repeat(60), "question");
    let mut ex = Exchange::default();
    let stream = MemoryStream::default();
    let chosen =
        send(&mut gw, &mut ex, &body, &stream).map(|v| v.split(',').next().map(String::from));
    let chosen = chosen.flatten().unwrap_or_default();
    let response = MemoryStream {
        upstream: Some(chosen.clone()),
        body: usage_body(200, 100),
        ..MemoryStream::default()
    };
    assert_eq!(
        gw.on_response_headers(&mut ex, false, &response),
        Some("home")
    );
    gw.on_response_body(&mut ex, response.body.len(), true, &response);
    gw.on_end(&mut ex, &response);
    gw.tick(100);
    let h = gw.host();
    assert_eq!(h.stat(Counter::SuspectMarked.name()), 0);
    assert_eq!(h.stat(Counter::ServedElsewhere.name()), 0);
    assert_eq!(h.stat(Counter::AffinityWithdrawn.name()), 0);
    assert_eq!(h.stat(Counter::UsageCachedTokens.name()), 100);
    assert!(in_flight::read(&*h.store).counts.is_empty());
}

/// A gateway that routed one request, answered by the endpoint it chose with `status` and
/// Envoy's `flags`, the stream's end `complete` (reached) or not.
fn answered_by_chosen(status: u16, flags: u64, complete: bool) -> Gateway<MemoryHost> {
    let mut gw = static_pool("");
    let mut ex = Exchange::default();
    let stream = MemoryStream::default();
    let value = send(&mut gw, &mut ex, &chat("s", "q"), &stream).unwrap_or_default();
    let chosen = value.split(',').next().unwrap_or_default().to_string();
    let response = MemoryStream {
        upstream: Some(chosen),
        status: Some(status),
        flags,
        ..MemoryStream::default()
    };
    gw.on_response_headers(&mut ex, complete, &response);
    gw.on_end(&mut ex, &response);
    gw.tick(100);
    assert!(in_flight::read(&*gw.host().store).counts.is_empty());
    gw
}

#[test]
fn a_5xx_from_the_chosen_host_blames_it_unless_envoy_itself_overflowed() {
    for status in [500, 502, 503, 504] {
        let failed = answered_by_chosen(status, 0, true);
        assert_eq!(
            failed.host().stat(Counter::SuspectMarked.name()),
            1,
            "{status}"
        );
    }
    for status in [400, 404, 429] {
        let clients = answered_by_chosen(status, 0, true);
        assert_eq!(
            clients.host().stat(Counter::SuspectMarked.name()),
            0,
            "{status}"
        );
    }
    let overflow = crate::suspects::UPSTREAM_OVERFLOW_FLAG;
    let envoys_own = answered_by_chosen(503, overflow, true);
    assert_eq!(envoys_own.host().stat(Counter::SuspectMarked.name()), 0);
}

#[test]
fn a_stream_reset_after_the_response_started_blames_the_chosen_host() {
    let reset = 0x10; // UR: upstream reset
    let gw = answered_by_chosen(200, reset, false);
    assert_eq!(gw.host().stat(Counter::SuspectMarked.name()), 1);
}

#[test]
fn unroutable_requests_go_on_counted_and_a_clients_routing_header_is_stripped() {
    let mut gw = static_pool(r#","max_body_bytes":100"#);
    let mut ex = Exchange::default();
    let mut get = headers("x");
    get[0].1 = b"GET".to_vec();
    get.push((
        "x-gateway-destination-endpoint".into(),
        b"1.2.3.4:80".to_vec(),
    ));
    let verdict = gw.on_request_headers(&mut ex, &get, true);
    assert!(verdict.strip_routing_header && !verdict.buffer);
    assert_eq!(gw.host().stat(&stat_names::fallback(Fallback::Method)), 1);
    let mut big = Exchange::default();
    assert!(gw.on_request_headers(&mut big, &headers("x"), false).buffer);
    assert_eq!(gw.on_request_body(&mut big, 101, false), Body::Continue);
    assert_eq!(big.body_to_route(), None);
    assert_eq!(
        gw.host()
            .stat(&stat_names::fallback(Fallback::BodyTooLarge)),
        1
    );
}

/// An admin `/clusters` answer listing the pool with each host's `rq_active`.
fn admin_answer(rq_active: &[u64]) -> Vec<u8> {
    let hosts: Vec<String> = POOL
        .iter()
        .zip(rq_active)
        .map(|(addr, active)| {
            let (ip, port) = addr.split_once(':').unwrap_or_default();
            format!(
                r#"{{"address":{{"socket_address":{{"address":"{ip}","port_value":{port}}}}},"stats":[{{"name":"rq_active","value":"{active}","type":"GAUGE"}}],"health_status":{{"eds_health_status":"HEALTHY"}}}}"#
            )
        })
        .collect();
    format!(
        r#"{{"cluster_statuses":[{{"name":"pool","host_statuses":[{}]}}]}}"#,
        hosts.join(",")
    )
    .into_bytes()
}

/// A gateway that polls the admin cluster `admin` every second.
fn polling() -> Gateway<MemoryHost> {
    gateway(r#"{"admin_cluster":"admin"}"#, MemoryHost::at(1_000_000))
}

/// One poll round a second after the last: tick, then answer the admin call with `rq_active`.
fn poll_round(gw: &mut Gateway<MemoryHost>, rq_active: &[u64]) {
    let h = gw.host();
    h.now.set(h.now.get() + 1000);
    gw.tick(100);
    let calls = gw.host().take_calls();
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert_eq!(calls[0].1, "admin");
    gw.on_poll_answer(calls[0].0, Some(200), Some(admin_answer(rq_active)));
}

#[test]
fn the_first_poll_publishes_the_hosts_and_requests_wait_for_it() {
    let mut gw = polling();
    let stream = MemoryStream {
        cluster: Some("pool".into()),
        ..MemoryStream::default()
    };
    let mut early = Exchange::default();
    assert_eq!(send(&mut gw, &mut early, &chat("s", "q"), &stream), None);
    assert_eq!(
        gw.host().stat(&stat_names::fallback(Fallback::NoCluster)),
        1
    );
    assert_eq!(gw.tick_period(), 100, "fast until the first snapshot");
    poll_round(&mut gw, &[0, 0, 0, 0]);
    assert_eq!(gw.host().stat(Counter::StatsPollOk.name()), 1);
    assert_eq!(gw.host().stat(Gauge::EndpointsKnown.name()), 4);
    let mut ex = Exchange::default();
    assert!(send(&mut gw, &mut ex, &chat("s", "q"), &stream).is_some());
    assert_eq!(
        stream.reads.get(),
        2,
        "the route's cluster, once per request"
    );
    // Another worker of the gateway reads the snapshot on its first request.
    let mut other = Gateway::new(crate::config::Config::default(), gw.host().sibling());
    let mut ex = Exchange::default();
    let stream = MemoryStream {
        cluster: Some("pool".into()),
        ..MemoryStream::default()
    };
    let static_less = send(&mut other, &mut ex, &chat("s", "q"), &stream);
    assert!(static_less.is_some());
}

/// Counts `n` requests in flight at endpoint `id` in the shared table, as another worker's flush
/// would.
fn in_flight_elsewhere(gw: &Gateway<MemoryHost>, id: u32, n: i64) {
    let d = in_flight::Delta {
        id,
        inflight: n,
        prefill: 0,
    };
    in_flight::add_all(&*gw.host().store, &[d]);
}

#[test]
fn in_flight_counts_above_envoys_for_three_polls_running_are_lowered_to_it() {
    let mut gw = polling();
    poll_round(&mut gw, &[0, 0, 0, 0]);
    // Five requests whose end this gateway never saw (a VM that failed with streams in flight).
    let lost = endpoint_id(POOL[0]);
    in_flight_elsewhere(&gw, lost, 5);
    poll_round(&mut gw, &[2, 0, 0, 0]);
    poll_round(&mut gw, &[1, 0, 0, 0]);
    assert_eq!(
        gw.host().stat(Counter::InflightCorrected.name()),
        0,
        "two polls prove nothing"
    );
    assert_eq!(inflight(&gw, POOL[0]), 5);
    poll_round(&mut gw, &[2, 0, 0, 0]);
    // The least excess over the three answers (5 - 2, 5 - 1, 5 - 2) is removed.
    assert_eq!(gw.host().stat(Counter::InflightCorrected.name()), 3);
    assert_eq!(inflight(&gw, POOL[0]), 2);
    let seg = crate::usage::stat_segment(POOL[0]);
    assert_eq!(gw.host().stat(&stat_names::inflight(&seg)), 2);
}

#[test]
fn an_excess_that_does_not_last_three_polls_is_left_alone() {
    let mut gw = polling();
    poll_round(&mut gw, &[0, 0, 0, 0]);
    in_flight_elsewhere(&gw, endpoint_id(POOL[1]), 1);
    poll_round(&mut gw, &[0, 0, 0, 0]);
    poll_round(&mut gw, &[0, 1, 0, 0]); // Envoy caught up with it
    poll_round(&mut gw, &[0, 0, 0, 0]);
    poll_round(&mut gw, &[0, 0, 0, 0]);
    assert_eq!(gw.host().stat(Counter::InflightCorrected.name()), 0);
    assert_eq!(inflight(&gw, POOL[1]), 1);
}

#[test]
fn a_poll_that_fails_or_stays_unanswered_is_counted_failed() {
    let mut gw = polling();
    poll_round(&mut gw, &[0, 0, 0, 0]);
    let h = gw.host();
    h.now.set(h.now.get() + 1000);
    gw.tick(100);
    let calls = gw.host().take_calls();
    gw.on_poll_answer(calls[0].0, Some(503), None);
    assert_eq!(gw.host().stat(Counter::StatsPollFailed.name()), 1);
    let h = gw.host();
    h.now.set(h.now.get() + 1000);
    gw.tick(100); // this round's call is never answered
    let h = gw.host();
    h.now.set(h.now.get() + 1000);
    gw.tick(100);
    assert_eq!(gw.host().stat(Counter::StatsPollFailed.name()), 2);
}

#[test]
fn a_tick_takes_in_other_workers_suspect_marks_and_requests_in_flight() {
    let mut first = static_pool("");
    let mut second = Gateway::new(first_config(), first.host().sibling());
    let mut ex = Exchange::default();
    let stream = MemoryStream::default();
    let value = send(&mut first, &mut ex, &chat("s", "q"), &stream).unwrap_or_default();
    let listed: Vec<&str> = value.split(',').collect();
    let response = MemoryStream {
        upstream: Some(listed[1].to_string()),
        ..MemoryStream::default()
    };
    first.on_response_headers(&mut ex, false, &response);
    first.tick(100);
    assert_eq!(second.host().stat(Counter::SuspectLearned.name()), 0);
    second.tick(100);
    assert_eq!(second.host().stat(Counter::SuspectLearned.name()), 1);
    // The second worker sees the first's request in flight on the host that served it.
    let seg = crate::usage::stat_segment(listed[1]);
    assert_eq!(second.host().stat(&stat_names::inflight(&seg)), 1);
    first.on_end(&mut ex, &response);
    first.tick(100);
    second.tick(100);
    assert_eq!(second.host().stat(&stat_names::inflight(&seg)), 0);
}

fn first_config() -> crate::config::Config {
    crate::config::Config {
        endpoints: POOL.iter().map(|a| a.to_string()).collect(),
        ..crate::config::Config::default()
    }
}

/// A two-turn conversation's second turn, its first question `q1` long enough to span chunks.
fn conversation(turns: usize) -> String {
    let system = "You answer questions about the document. ".repeat(30);
    let q1 = "Here is the document to read first. ".repeat(60);
    let mut messages = vec![
        format!(r#"{{"role":"system","content":"{system}"}}"#),
        format!(r#"{{"role":"user","content":"{q1}"}}"#),
    ];
    if turns > 1 {
        messages.push(r#"{"role":"assistant","content":"an answer"}"#.into());
        messages.push(r#"{"role":"user","content":"and then?"}"#.into());
    }
    format!(r#"{{"model":"m","messages":[{}]}}"#, messages.join(","))
}

#[test]
fn an_engine_that_cached_far_less_than_predicted_raises_its_eviction_horizon() {
    let mut gw = static_pool(r#","eviction_grace_ms":0"#);
    assert!(gw.host().defined(Counter::EvictionsSeen.name()));
    let stream = MemoryStream::default();
    let mut first = Exchange::default();
    let value = send(&mut gw, &mut first, &conversation(1), &stream).unwrap_or_default();
    let chosen = value.split(',').next().unwrap_or_default().to_string();
    let served = |cached| MemoryStream {
        upstream: Some(chosen.clone()),
        body: usage_body(800, cached),
        ..MemoryStream::default()
    };
    let end = |gw: &mut Gateway<MemoryHost>, ex: &mut Exchange, response: &MemoryStream| {
        gw.on_response_headers(ex, false, response);
        gw.on_response_body(ex, response.body.len(), true, response);
        gw.on_end(ex, response);
    };
    end(&mut gw, &mut first, &served(0));
    assert_eq!(
        gw.host().stat(Counter::EvictionsSeen.name()),
        0,
        "nothing predicted"
    );
    gw.host().now.set(gw.host().now.get() + 10);
    let mut second = Exchange::default();
    let value = send(&mut gw, &mut second, &conversation(2), &stream).unwrap_or_default();
    assert!(value.starts_with(&chosen), "follows its history");
    end(&mut gw, &mut second, &served(0));
    assert_eq!(gw.host().stat(Counter::EvictionsSeen.name()), 1);
    assert_eq!(gw.host().stat(Counter::SuspectMarked.name()), 0);
}

#[test]
fn a_request_restricted_to_a_subset_goes_only_within_it() {
    let mut gw = static_pool("");
    let stream = MemoryStream::default();
    for i in 0..16 {
        let mut ex = Exchange::default();
        ex.restrict_to(vec![POOL[1].to_string(), POOL[3].to_string()]);
        let body = chat(&format!("system {i}"), "hello");
        let value = send(&mut gw, &mut ex, &body, &stream).expect("routed");
        let listed: Vec<&str> = value.split(',').collect();
        assert!(
            listed.iter().all(|a| *a == POOL[1] || *a == POOL[3]),
            "{value} strays from the subset"
        );
        assert_eq!(ex.fallback(), None);
    }
}

#[test]
fn a_subset_with_no_eligible_endpoint_falls_back_as_no_healthy_endpoint() {
    let mut gw = static_pool("");
    let stream = MemoryStream::default();
    for subset in [vec![], vec!["10.9.9.9:8000".to_string()]] {
        let mut ex = Exchange::default();
        ex.restrict_to(subset);
        assert_eq!(send(&mut gw, &mut ex, &chat("s", "u"), &stream), None);
        assert_eq!(ex.fallback(), Some(Fallback::NoHealthyEndpoint));
    }
    assert_eq!(
        gw.host()
            .stat(&stat_names::fallback(Fallback::NoHealthyEndpoint)),
        2
    );
}

/// The shared queued prefill of endpoint `addr`.
fn queued_prefill(gw: &Gateway<MemoryHost>, addr: &str) -> u32 {
    in_flight::read(&*gw.host().store).prefill(endpoint_id(addr))
}

#[test]
fn a_requests_uncached_prompt_is_queued_at_its_endpoint_until_its_first_byte_and_its_wait_is_measured(
) {
    let mut gw = static_pool("");
    gw.tick(100);
    let body = chat(&"You are a helpful assistant. ".repeat(40), "hello")
        .replace(r#""model":"m""#, r#""model":"m","stream":true"#);
    let mut ex = Exchange::default();
    let Some(value) = send(&mut gw, &mut ex, &body, &MemoryStream::default()) else {
        panic!("not routed");
    };
    let chosen = value.split(',').next().unwrap_or_default().to_string();
    gw.tick(100);
    let queued = queued_prefill(&gw, &chosen);
    assert!(
        queued > 1000,
        "nothing held yet: the whole prompt, {queued} bytes"
    );
    // The next request of the group to the same endpoint sees that work ahead of it.
    let response = MemoryStream {
        upstream: Some(chosen.clone()),
        body: b"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\n".to_vec(),
        ..MemoryStream::default()
    };
    gw.on_response_headers(&mut ex, false, &response);
    assert_eq!(
        queued_prefill(&gw, &chosen),
        queued,
        "headers are not the first token"
    );
    gw.host().now.set(gw.host().now.get() + 250);
    gw.on_response_body(&mut ex, response.body.len(), false, &response);
    gw.tick(100);
    assert_eq!(
        queued_prefill(&gw, &chosen),
        0,
        "prefilled at the first byte"
    );
    assert_eq!(inflight(&gw, &chosen), 1, "still decoding");
    let seg = crate::usage::stat_segment(&chosen);
    let estimate = stat_names::ttft_estimate(&seg);
    assert!(
        !gw.host().defined(&estimate),
        "recorded once the stream succeeds"
    );
    let end = MemoryStream {
        upstream: Some(chosen.clone()),
        status: Some(200),
        ..MemoryStream::default()
    };
    gw.on_response_body(&mut ex, 0, true, &end);
    gw.on_end(&mut ex, &end);
    // 250 ms against the work over the configured 40 bytes per millisecond.
    let expected = f64::from(queued) / 40.0;
    let percent = (250.0 * 100.0 / expected).round() as i64;
    assert_eq!(gw.host().stat(&estimate), percent);

    // A request whose stream ends before any byte takes its prefill out of the queue too.
    let mut ex = Exchange::default();
    send(&mut gw, &mut ex, &body, &MemoryStream::default());
    gw.tick(100);
    assert!(queued_prefill(&gw, &chosen) > 0);
    let reset = MemoryStream {
        upstream: Some(chosen.clone()),
        flags: 0x10,
        ..MemoryStream::default()
    };
    gw.on_end(&mut ex, &reset);
    gw.tick(100);
    assert_eq!(queued_prefill(&gw, &chosen), 0);
    assert_eq!(inflight(&gw, &chosen), 0);
}

/// An engine's `/metrics` page with nothing running, in vLLM's or SGLang's names.
fn engine_page(sglang: bool) -> Vec<u8> {
    match sglang {
        true => b"sglang:num_running_reqs 0\nsglang:num_queue_reqs 0\n".to_vec(),
        false => b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n".to_vec(),
    }
}

#[test]
fn an_sglang_engines_load_snapshot_gives_the_prefill_queued_there() {
    let config = r#"{"admin_cluster":"admin","engine_metrics_cluster":"pool"}"#;
    let mut gw = gateway(config, MemoryHost::at(1_000_000));
    poll_round(&mut gw, &[0, 0, 0, 0]);
    // The next round asks each engine for its metrics; the SGLang ones (the first two) are then
    // asked for their load snapshot, and the round is shared once every answer is in.
    let h = gw.host();
    h.now.set(h.now.get() + 1000);
    gw.tick(100);
    let calls = gw.host().take_calls();
    let (admin, engines) = calls.split_first().expect("a round");
    assert_eq!(engines.len(), 4, "{calls:?}");
    for (i, (token, cluster, path)) in engines.iter().enumerate() {
        assert_eq!((cluster.as_str(), path.as_str()), ("pool", "/metrics"));
        gw.on_poll_answer(*token, Some(200), Some(engine_page(i < 2)));
    }
    gw.on_poll_answer(admin.0, Some(200), Some(admin_answer(&[0, 0, 0, 0])));
    let loads = gw.host().take_calls();
    let paths: Vec<&str> = loads.iter().map(|c| c.2.as_str()).collect();
    assert_eq!(paths, [crate::engine_load::LOADS_PATH; 2]);
    let page = b"sglang_num_waiting_uncached_tokens{dp_rank=\"0\"} 5000\n";
    gw.on_poll_answer(loads[0].0, Some(200), Some(page.to_vec()));
    gw.on_poll_answer(loads[1].0, Some(404), None);
    assert_eq!(gw.host().stat(Counter::LoadsPollOk.name()), 1);
    assert_eq!(gw.host().stat(Counter::LoadsPollFailed.name()), 1);
    gw.tick(100);
    // 5000 tokens at 4 bytes each are queued at the first SGLang engine.
    let snapshot = gw.snapshot.get("pool").expect("the pool");
    let queued: Vec<Option<u64>> = snapshot
        .iter()
        .map(|h| h.engine.and_then(|e| e.queued_prefill(0, 4.0)))
        .collect();
    assert_eq!(queued, [Some(20_000), None, None, None]);
}
