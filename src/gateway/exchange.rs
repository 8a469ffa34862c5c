//! One request's way through the gateway, up to the routing header: which requests are routed,
//! buffering their body, the decision, and the routing from headers alone where Envoy withholds
//! bodies. The response side is in `settle`.

use std::borrow::Cow;

use super::host::{HostApi, StreamApi};
use super::Gateway;
use crate::body_access;
use crate::policy::Ticket;
use crate::prefill::Expected;
use crate::request::Api;
use crate::router::{self, Fallback, RequestInfo, Routed};
use crate::usage::Tail;

/// One request and its response, as the gateway follows them: the adapter keeps one per stream
/// and hands it to each of the gateway's per-request entry points.
#[derive(Default)]
pub struct Exchange {
    /// A routable request whose body is being buffered.
    api: Option<Api>,
    body_size: usize,
    /// What was decided, for the debug header: a decision name or `fallback:<reason>`.
    pub(super) outcome: Option<String>,
    /// Why the request was left to Envoy's load balancer, when it was.
    fallback: Option<Fallback>,
    /// The only endpoints the request may go to, when the proxy names a subset of the hosts.
    subset: Option<Vec<String>>,
    /// The endpoint counted in flight for this request (id, address), until the stream ends.
    pub(super) counted: Option<(u32, String)>,
    /// The chosen endpoint was already found at fault (at most one mark per request).
    pub(super) blamed: bool,
    /// What the chosen endpoint was meant to hold once this request is served.
    pub(super) chosen: Option<Chosen>,
    /// The host that gave the final answer, once the response headers came.
    pub(super) served: Option<String>,
    /// The end of the response body so far, when the request is one an engine reports usage for.
    pub(super) tail: Option<Tail>,
    /// The response reached its end of stream: no upstream failure cut it short, so Envoy's
    /// response flags need not be read.
    pub(super) complete: bool,
    /// The end-of-stream work ran (Envoy may report the end twice).
    pub(super) ended: bool,
    /// The request's prefill, counted queued at its endpoint (the one `counted` names) until its
    /// first response byte.
    pub(super) prefill: Option<Prefilling>,
}

/// A routed request's prefill: what was expected of it, and when its first byte came.
pub(super) struct Prefilling {
    pub expected: Expected,
    pub routed_ms: u64,
    /// Its first byte comes with its first token (a stream): the wait teaches the prefill rate.
    pub streams: bool,
    /// When its first response byte came: its prefill left the endpoint's queue then.
    pub first_byte_ms: Option<u64>,
}

/// The endpoint a routed request was sent to, its prefix keys and the policy's ticket: what to
/// settle once the response says who served it.
pub(super) struct Chosen {
    pub addr: String,
    pub keys: Vec<u64>,
    pub ticket: Ticket,
}

impl Exchange {
    /// The body size to read and hand to [`Gateway::route`], while a routable request waits for
    /// its routing.
    pub fn body_to_route(&self) -> Option<usize> {
        self.api.map(|_| self.body_size)
    }

    /// The request was routed from its headers, as [`Gateway::route_from_headers`] does: nothing
    /// more to route.
    pub fn routed_from_headers(&mut self) {
        self.api = None;
        self.outcome = Some(format!("fallback:{}", Fallback::NoBodyAccess.name()));
    }

    /// Lets [`Gateway::route`] pick only among `addrs` (`ip:port`, as the hosts are named): a
    /// proxy that chose a subset of the endpoints (an endpoint picker's subset hint). With none
    /// of them eligible, the request falls back as [`Fallback::NoHealthyEndpoint`].
    pub fn restrict_to(&mut self, addrs: Vec<String>) {
        self.subset = Some(addrs);
    }

    /// Why the request was left to Envoy's load balancer, once it was.
    pub fn fallback(&self) -> Option<Fallback> {
        self.fallback
    }
}

/// What to do with a request once its headers are in.
#[derive(Debug, PartialEq, Eq)]
pub struct RequestHeaders {
    /// The client sent the routing header (or the headers could not be read): remove it, since a
    /// client never chooses the upstream.
    pub strip_routing_header: bool,
    /// Hold the request until its body is in (the routing header depends on it); `false`: let it
    /// go on, left to Envoy's load balancer.
    pub buffer: bool,
    /// Its declared `content-length`.
    pub content_length: Option<usize>,
}

/// What to do with a request body chunk.
#[derive(Debug, PartialEq, Eq)]
pub enum Body {
    /// Not routed: let it go on.
    Continue,
    /// Keep buffering.
    Wait,
    /// The body is complete: read it and [`Gateway::route`] it.
    Route,
}

impl<H: HostApi> Gateway<H> {
    /// A request's headers (names, and values as bytes): whether kvroute routes it, and so holds
    /// it for its body.
    pub fn on_request_headers<V: AsRef<[u8]>>(
        &mut self,
        ex: &mut Exchange,
        headers: &[(String, V)],
        end_of_stream: bool,
    ) -> RequestHeaders {
        let config = &self.router.config;
        let fields = router::HeaderFields::read(headers, &config.header);
        let mut verdict = RequestHeaders {
            strip_routing_header: fields.routing_header || headers.is_empty(),
            buffer: false,
            content_length: fields.content_length,
        };
        // Tests of Envoy's failure policy (unset in production, where nothing reaches the panic).
        if config.unsafe_trap_path_for_tests.as_deref() == Some(fields.path) {
            panic!("kvroute: trapping on purpose (unsafe_trap_path_for_tests)");
        }
        let api = match router::routable(fields.method, fields.path) {
            Err(reason) => return self.unrouted(ex, reason, verdict),
            Ok(_) if end_of_stream => return self.unrouted(ex, Fallback::EmptyBody, verdict),
            Ok(api) => api,
        };
        ex.tail = Some(Tail::default());
        if fields
            .content_length
            .is_some_and(|n| n > config.max_body_bytes)
        {
            // Known to be too large: never start buffering it. Once a filter has buffered, Envoy
            // answers 413 instead of applying back-pressure when the body outgrows its buffer.
            return self.unrouted(ex, Fallback::BodyTooLarge, verdict);
        }
        ex.api = Some(api);
        verdict.buffer = true;
        verdict
    }

    /// A request body chunk: the body so far is `body_size` bytes.
    pub fn on_request_body(&mut self, ex: &mut Exchange, body_size: usize, end: bool) -> Body {
        if ex.api.is_none() {
            return Body::Continue;
        }
        ex.body_size = body_size;
        if body_size > self.router.config.max_body_bytes {
            // Stop buffering before Envoy's own buffer limit answers 413: stream it on unrouted.
            ex.api = None;
            self.fallback(ex, Fallback::BodyTooLarge);
            return Body::Continue;
        }
        if end {
            Body::Route
        } else {
            Body::Wait
        }
    }

    /// Routes a request whose body is complete: the routing header's value (the chosen endpoint,
    /// then its fallbacks), or `None` when it is left to Envoy's load balancer.
    pub fn route(
        &mut self,
        ex: &mut Exchange,
        body: &[u8],
        stream: &dyn StreamApi,
    ) -> Option<String> {
        let api = ex.api.take()?;
        let cluster = self.candidate_cluster(stream);
        let now = self.host.now_ms();
        if self.snapshot_stale() {
            self.fallback(ex, Fallback::StaleHosts);
            return None;
        }
        let config = &self.router.config;
        let hosts = super::candidate_hosts(
            config,
            &self.snapshot,
            &self.suspects,
            cluster.as_deref(),
            now,
        );
        let Some(mut hosts) = hosts else {
            self.fallback(ex, Fallback::NoCluster);
            return None;
        };
        if let Some(subset) = &ex.subset {
            let within = hosts.iter().filter(|h| subset.contains(&h.addr)).cloned();
            hosts = Cow::Owned(within.collect());
        }
        // Only the policies that use these headers pay for reading them.
        let needs = self.router.needs();
        let session = match needs.session {
            true => stream.request_header(&self.router.config.session_header),
            false => None,
        };
        let request_id = match needs.request_id {
            true => stream.request_header("x-request-id"),
            false => None,
        };
        let req = RequestInfo {
            api,
            body,
            session: session.as_deref(),
            request_id: request_id.as_deref(),
        };
        let inflight = self.inflight.view();
        let routing =
            self.router
                .route_with(&self.host, &inflight, &self.prefill, &hosts, &req, now);
        drop(hosts);
        if let Some(outcome) = routing.template {
            self.stats.template(outcome);
        }
        match routing.result {
            Ok(routed) => {
                let (id, expected) = (routed.endpoint_id, routed.prefill);
                self.inflight.add(id, 1);
                self.inflight.add_prefill(id, expected.uncached as i64);
                self.prefill.routed(expected.uncached);
                ex.prefill = Some(Prefilling {
                    expected,
                    routed_ms: now,
                    streams: routed.streams,
                    first_byte_ms: None,
                });
                Some(self.routed(ex, routed))
            }
            Err(reason) => {
                self.fallback(ex, reason);
                None
            }
        }
    }

    /// Routes a request from its headers alone, for when Envoy withholds bodies: the session
    /// header's rendezvous order if the request has one (the routing header's value), else
    /// Envoy's load balancer. Counted as the `no_body_access` fallback either way.
    pub fn route_from_headers(&mut self, stream: &dyn StreamApi) -> Option<String> {
        let session = stream.request_header(&self.router.config.session_header);
        let mut value = None;
        if let Some(session) = session {
            let cluster = self.candidate_cluster(stream);
            let now = self.host.now_ms();
            if let Some(hosts) = self.hosts(cluster.as_deref(), now) {
                let fallbacks = self.router.config.fallback_endpoints;
                let endpoints = body_access::session_endpoints(&hosts, &session, fallbacks);
                if !endpoints.is_empty() {
                    value = Some(endpoints.join(","));
                }
            }
        }
        self.stats.fallback(&self.host, Fallback::NoBodyAccess);
        value
    }

    /// The request goes to `routed`'s endpoints: counted, and remembered for its response.
    fn routed(&mut self, ex: &mut Exchange, routed: Routed) -> String {
        if !routed.usage {
            // A stream that did not ask for usage carries none: reading the end of each of its
            // chunks (a host call apiece) would find nothing.
            ex.tail = None;
        }
        let primary = routed.endpoints.first().cloned().unwrap_or_default();
        ex.chosen = Some(Chosen {
            addr: primary.clone(),
            keys: routed.keys,
            ticket: routed.ticket,
        });
        let m = &mut self.stats;
        m.routed(routed.decision);
        if let Some(fraction) = routed.match_fraction {
            m.match_percent(&self.host, (fraction * 100.0).round() as u64);
        }
        if routed.slots_created > 0 {
            m.slots_used(&self.host, routed.slots_created as i64);
        }
        ex.outcome = Some(routed.decision.name().to_string());
        ex.counted = Some((routed.endpoint_id, primary));
        routed.endpoints.join(",")
    }

    fn unrouted(
        &mut self,
        ex: &mut Exchange,
        reason: Fallback,
        verdict: RequestHeaders,
    ) -> RequestHeaders {
        self.fallback(ex, reason);
        verdict
    }

    /// The request is left to Envoy's load balancer, for `reason`.
    fn fallback(&mut self, ex: &mut Exchange, reason: Fallback) {
        self.stats.fallback(&self.host, reason);
        ex.fallback = Some(reason);
        ex.outcome = Some(format!("fallback:{}", reason.name()));
    }
}
