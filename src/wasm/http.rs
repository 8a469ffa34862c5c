//! The HTTP stream context: strips client routing headers, buffers routable bodies, asks the core
//! for a decision, writes the routing header, marks the chosen endpoint suspect when it failed the
//! request, and settles the in-flight count when the stream ends. Where Envoy withholds bodies from
//! paused filters, it routes from headers instead.

use std::cell::RefCell;
use std::rc::Rc;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, BufferType, MapType};

use super::host::{self, now_ms, HostStore, Metrics};
use super::response::{response_flags, Response};
use super::root::Shared;
use crate::body_access::{self, BodyAccess};
use crate::config::PolicyKind;
use crate::request::Api;
use crate::router::{self, Fallback, RequestInfo, Routed};
use crate::suspects::{self, UPSTREAM_FAILURE_FLAGS};

pub struct Stream {
    shared: Rc<RefCell<Shared>>,
    id: u32,
    /// Paused while the root watches whether Envoy delivers bodies (see `body_access`).
    watched: bool,
    api: Option<Api>,
    body_size: usize,
    /// What was decided, for the debug header: a decision name or `fallback:<reason>`.
    outcome: Option<String>,
    /// The endpoint counted in flight, until the stream ends.
    routed: Option<(u32, String)>,
    /// The chosen endpoint was already found at fault (at most one mark per request).
    blamed: bool,
    /// Who served the response and what its engine reported (see `response`).
    response: Response,
    /// The response reached its end of stream: no upstream failure cut it short, so Envoy's
    /// response flags need not be read.
    complete: bool,
    /// The end-of-stream work ran (Envoy calls both `on_done` and `on_log`).
    ended: bool,
}

impl Stream {
    pub fn new(shared: Rc<RefCell<Shared>>, id: u32) -> Self {
        Stream {
            shared,
            id,
            watched: false,
            api: None,
            body_size: 0,
            outcome: None,
            routed: None,
            blamed: false,
            response: Response::default(),
            complete: false,
            ended: false,
        }
    }

    fn fallback(&mut self, reason: Fallback) -> Action {
        self.shared.borrow_mut().metrics.fallback(reason);
        self.outcome = Some(format!("fallback:{}", reason.name()));
        Action::Continue
    }

    /// Holds the headers until the body is in: the routing header depends on it. Until it is known
    /// whether Envoy delivers bodies during a pause, the root watches the stream.
    fn pause(&mut self, api: Api, content_length: Option<usize>) -> Action {
        self.api = Some(api);
        let mut shared = self.shared.borrow_mut();
        let (watched, first) = shared
            .body
            .paused(self.id, content_length.map(|n| n as u64));
        self.watched = watched;
        if first {
            shared.watch_started();
        }
        Action::Pause
    }

    /// A callback on a watched stream: either the root found Envoy withholding bodies and already
    /// routed this stream from its headers and resumed it, or, if `body` is here during the pause,
    /// Envoy delivers bodies. Returns whether the stream is done with routing.
    fn settle_watch(&mut self, body: bool) -> bool {
        if !self.watched {
            return false;
        }
        self.watched = false;
        let mut shared = self.shared.borrow_mut();
        if shared.body.state() == BodyAccess::Missing {
            self.api = None;
            self.outcome = Some(format!("fallback:{}", Fallback::NoBodyAccess.name()));
            return true;
        }
        if body {
            shared.body.delivered();
        } else {
            // A local reply (a timeout, say) ended the pause: no evidence either way.
            shared.body.forget(self.id);
        }
        false
    }

    /// The body is complete (or all we will buffer): route it.
    fn route(&mut self) -> Action {
        let Some(api) = self.api.take() else {
            return Action::Continue;
        };
        let body = hostcalls::get_buffer(BufferType::HttpRequestBody, 0, self.body_size)
            .ok()
            .flatten()
            .unwrap_or_default();
        let cluster = candidate_cluster(&self.shared);
        let shared = self.shared.borrow();
        let now = now_ms();
        if shared.snapshot_stale() {
            drop(shared);
            return self.fallback(Fallback::StaleHosts);
        }
        let Some(hosts) = shared.hosts(cluster.as_deref(), now) else {
            drop(shared);
            return self.fallback(Fallback::NoCluster);
        };
        // Only the policies that use these headers pay for reading them.
        let session = match shared.router.config.policy {
            PolicyKind::Session => request_header(&shared.router.config.session_header),
            _ => None,
        };
        let request_id = match shared.router.config.policy {
            PolicyKind::LeastRequest => request_header("x-request-id"),
            _ => None,
        };
        let req = RequestInfo {
            api,
            body: &body,
            session: session.as_deref(),
            request_id: request_id.as_deref(),
        };
        let inflight = shared.inflight.view();
        let result = shared
            .router
            .route_with(&HostStore, &inflight, &hosts, &req, now);
        drop(shared);
        match result {
            Ok(routed) => {
                self.shared.borrow_mut().inflight.add(routed.endpoint_id, 1);
                self.apply(routed)
            }
            Err(reason) => self.fallback(reason),
        }
    }

    fn apply(&mut self, mut routed: Routed) -> Action {
        self.response.routed(&mut routed);
        let mut shared = self.shared.borrow_mut();
        let value = routed.endpoints.join(",");
        let _ = hostcalls::set_map_value(
            MapType::HttpRequestHeaders,
            &shared.router.config.header,
            Some(&value),
        );
        let m: &mut Metrics = &mut shared.metrics;
        m.routed(routed.decision);
        if let Some(fraction) = routed.match_fraction {
            m.match_percent((fraction * 100.0).round() as u64);
        }
        if routed.slots_created > 0 {
            m.slots_used(routed.slots_created as i64);
        }
        let primary = routed.endpoints.first().cloned().unwrap_or_default();
        self.outcome = Some(routed.decision.name().to_string());
        self.routed = Some((routed.endpoint_id, primary));
        Action::Continue
    }

    /// If the endpoint kvroute chose failed this request, marks it suspect so the next requests
    /// avoid it before Envoy's health check and the next poll notice. `status` is the response
    /// status when known; `flags` Envoy's `response.flags`.
    fn blame(&mut self, status: Option<u16>, flags: u64) {
        let Some((_, chosen)) = &self.routed else {
            return;
        };
        if self.blamed {
            return;
        }
        if suspects::chosen_failed(chosen, self.response.served(), status, flags) {
            self.blamed = true;
            let chosen = chosen.clone();
            self.shared.borrow_mut().mark_suspect(&chosen, now_ms());
        }
    }

    /// The stream is over, however it ended (Envoy calls both `on_done` and `on_log`; the first
    /// does the work): blame, usage and affinity settled, one request fewer in flight.
    fn end(&mut self) {
        if std::mem::replace(&mut self.ended, true) {
            return;
        }
        if self.watched {
            self.watched = false;
            self.shared.borrow_mut().body.forget(self.id);
        }
        let involved = self.routed.is_some() || self.response.pending();
        let usage = self.response.usage();
        // A response that reports usage succeeded. Only a routed request's outcome matters
        // without one: it settles the affinity, and a 5xx blames the chosen endpoint. (In
        // `on_log`, which Envoy calls first, the response headers are still readable.)
        let status = match usage {
            None if self.routed.is_some() => host::status(MapType::HttpResponseHeaders),
            _ => None,
        };
        let server_error = status.is_some_and(suspects::server_error);
        // A reset or failed connection after the response started (a replica dying mid-stream)
        // shows only in Envoy's response flags; a response that reached its end had none. A 5xx
        // needs them too: was it Envoy's own 503 for a full cluster?
        let flags = if (!self.complete && involved) || server_error {
            response_flags()
        } else {
            0
        };
        if flags & UPSTREAM_FAILURE_FLAGS != 0 || server_error {
            self.blame(status, flags);
        }
        let ok = flags & UPSTREAM_FAILURE_FLAGS == 0
            && (usage.is_some() || status.is_some_and(|s| (200..300).contains(&s)));
        self.response.end(&self.shared, ok, usage);
        self.settle();
    }

    /// The stream is over, however it ended: one request fewer in flight.
    fn settle(&mut self) {
        if let Some((id, _)) = self.routed.take() {
            self.shared.borrow_mut().inflight.add(id, -1);
        }
    }
}

/// Routes the effective stream from its headers alone, for when Envoy withholds bodies: the
/// session header's rendezvous order if the request has one, else Envoy's load balancer. Counted as
/// the `no_body_access` fallback either way.
pub(super) fn route_from_headers(shared: &RefCell<Shared>) {
    let session_header = shared.borrow().router.config.session_header.clone();
    let session = request_header(&session_header);
    if let Some(session) = session {
        let cluster = candidate_cluster(shared);
        let s = shared.borrow();
        if let Some(hosts) = s.hosts(cluster.as_deref(), now_ms()) {
            let endpoints = body_access::session_endpoints(
                &hosts,
                &session,
                s.router.config.fallback_endpoints,
            );
            if !endpoints.is_empty() {
                let value = endpoints.join(",");
                let _ = hostcalls::set_map_value(
                    MapType::HttpRequestHeaders,
                    &s.router.config.header,
                    Some(&value),
                );
            }
        }
    }
    shared.borrow_mut().metrics.fallback(Fallback::NoBodyAccess);
}

/// A request header's value. Values are bytes (HTTP allows 0x80-0xFF in them, and Envoy forwards
/// them), so they are read as bytes: the SDK's `get_map_value` panics on one that is not UTF-8,
/// which would trap the VM on a client's say-so. Invalid sequences read as U+FFFD.
fn request_header(name: &str) -> Option<String> {
    hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, name)
        .ok()
        .flatten()
        .map(|v| String::from_utf8_lossy(&v).into_owned())
}

/// The request's headers, values as bytes (see [`request_header`]); names are tokens, which
/// Envoy's codecs check, so they are text. `None` when the map cannot be read.
pub(super) fn request_headers() -> Option<Vec<(String, Vec<u8>)>> {
    hostcalls::get_map_bytes(MapType::HttpRequestHeaders).ok()
}

/// Traps the VM when `path` is the configured `unsafe_trap_path_for_tests` (tests of Envoy's
/// failure policy; unset in production, where nothing reaches the panic).
fn trap_for_tests(shared: &RefCell<Shared>, path: &str) {
    let s = shared.borrow();
    if s.router.config.unsafe_trap_path_for_tests.as_deref() == Some(path) {
        panic!("kvroute: trapping on purpose (unsafe_trap_path_for_tests)");
    }
}

/// Which cluster's hosts are the effective stream's candidates: the one its route chose, with a
/// host snapshot read first if this worker has none yet. A static endpoint list does not depend
/// on the route, so it costs no host call then.
fn candidate_cluster(shared: &RefCell<Shared>) -> Option<String> {
    shared.borrow_mut().ensure_snapshot();
    if shared.borrow().router.config.endpoints.is_empty() {
        route_cluster()
    } else {
        None
    }
}

/// The upstream cluster of the request's route: `xds.cluster_name` on current Envoy (one host
/// call), the older `cluster_name` only where that is missing.
fn route_cluster() -> Option<String> {
    [vec!["xds", "cluster_name"], vec!["cluster_name"]]
        .into_iter()
        .find_map(|path| hostcalls::get_property(path).ok().flatten())
        .and_then(|b| String::from_utf8(b).ok())
}

impl Context for Stream {
    fn on_done(&mut self) -> bool {
        self.end();
        true
    }
}

impl HttpContext for Stream {
    fn on_http_request_headers(&mut self, _headers: usize, end_of_stream: bool) -> Action {
        let (header, max_body) = {
            let shared = self.shared.borrow();
            (
                shared.router.config.header.clone(),
                shared.router.config.max_body_bytes,
            )
        };
        // One host call for every header this needs (each call crosses into the VM twice).
        let headers = request_headers().unwrap_or_default();
        let head = router::Head::read(&headers, &header);
        // Whatever happens next, a client never chooses the upstream. (Also removed without
        // looking when the header map could not be read.)
        if head.routing_header || headers.is_empty() {
            let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, &header, None);
        }
        trap_for_tests(&self.shared, head.path);
        let api = match router::routable(head.method, head.path) {
            Err(reason) => return self.fallback(reason),
            Ok(_) if end_of_stream => return self.fallback(Fallback::EmptyBody),
            Ok(api) => api,
        };
        self.response.want_usage();
        if head.content_length.is_some_and(|n| n > max_body) {
            // Known to be too large: never start buffering it. Once a filter has buffered, Envoy
            // answers 413 instead of applying back-pressure when the body outgrows its buffer.
            return self.fallback(Fallback::BodyTooLarge);
        }
        if self.shared.borrow().body.state() == BodyAccess::Missing {
            // Pausing would hang the request: Envoy would never hand over the body.
            route_from_headers(&self.shared);
            self.outcome = Some(format!("fallback:{}", Fallback::NoBodyAccess.name()));
            return Action::Continue;
        }
        self.pause(api, head.content_length)
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.settle_watch(true) || self.api.is_none() {
            return Action::Continue;
        }
        self.body_size = body_size;
        let max = self.shared.borrow().router.config.max_body_bytes;
        if body_size > max {
            // Stop buffering before Envoy's own buffer limit answers 413: stream it on unrouted.
            self.api = None;
            return self.fallback(Fallback::BodyTooLarge);
        }
        if end_of_stream {
            self.route()
        } else {
            Action::Pause
        }
    }

    fn on_http_request_trailers(&mut self, _trailers: usize) -> Action {
        if self.settle_watch(true) {
            return Action::Continue;
        }
        self.route()
    }

    fn on_http_response_headers(&mut self, _headers: usize, end_of_stream: bool) -> Action {
        self.settle_watch(false);
        self.complete = end_of_stream;
        // Who answered, read once for the blame and the response's settling.
        if self.routed.is_some() || self.response.pending() {
            self.response.read_served();
        }
        if self.routed.is_some() {
            // Retries are over by now (Envoy retries only before it forwards response headers):
            // an answer from another host means the chosen one failed. Whether the chosen host
            // answered 5xx waits for the stream's end, where a successful response (one that
            // reports usage) costs no status read.
            self.blame(None, 0);
        }
        self.routed = self.response.headers(&self.shared, self.routed.take());
        if self.shared.borrow().router.config.debug_header {
            if let Some(outcome) = &self.outcome {
                let _ = hostcalls::set_map_value(
                    MapType::HttpResponseHeaders,
                    "x-kvroute-decision",
                    Some(outcome),
                );
            }
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.complete |= end_of_stream;
        self.response.body(body_size);
        Action::Continue
    }

    fn on_log(&mut self) {
        self.end();
    }
}
