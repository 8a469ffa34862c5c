//! The response side of a stream: which host actually served it (after Envoy's retries), whether
//! it succeeded, and what its engine says it took from its prefix cache. In-flight counts move to
//! the serving host; affinity the request recorded for the host kvroute chose is withdrawn when
//! that host did not serve it successfully, and recorded for the host that did; the engine's
//! `usage` becomes Envoy stats (written on the tick), in total and per endpoint, and, when it
//! cached clearly less than the map predicted, raises that endpoint's eviction horizon
//! ([`eviction`]).

use std::cell::RefCell;

use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, MetricType};

use super::host::{now_ms, HostStore};
use super::root::Shared;
use crate::affinity::AffinityMap;
use crate::config::PolicyKind;
use crate::eviction::{self, Predicted};
use crate::rendezvous::endpoint_id;
use crate::router::Routed;
use crate::usage::{Tail, Usage};

/// Counters defined at configure time, so dashboards see them at zero.
pub const COUNTERS: [&str; 6] = [
    "kvroute.served_elsewhere",
    "kvroute.affinity.withdrawn",
    "kvroute.affinity.evictions_seen",
    "kvroute.usage.responses",
    "kvroute.usage.prompt_tokens",
    "kvroute.usage.cached_tokens",
];

/// What the chosen endpoint was meant to hold once this request is served.
struct Chosen {
    addr: String,
    keys: Vec<u64>,
    predicted: Predicted,
}

/// A stream's response, followed from its headers to its end.
#[derive(Default)]
pub struct Response {
    chosen: Option<Chosen>,
    served: Option<String>,
    /// The end of the body so far, when the request is one an engine reports usage for.
    tail: Option<Tail>,
}

impl Response {
    /// The request is an OpenAI generation request: its response may carry usage.
    pub fn want_usage(&mut self) {
        self.tail = Some(Tail::default());
    }

    pub fn routed(&mut self, routed: &mut Routed) {
        if !routed.usage {
            // A stream that did not ask for usage carries none: reading the end of each of its
            // chunks (a host call apiece) would find nothing.
            self.tail = None;
        }
        self.chosen = Some(Chosen {
            addr: routed.endpoints.first().cloned().unwrap_or_default(),
            keys: std::mem::take(&mut routed.keys),
            predicted: routed.predicted,
        });
    }

    /// Whether the response has anything to settle: kvroute routed the request, or its engine
    /// may report usage.
    pub fn pending(&self) -> bool {
        self.chosen.is_some() || self.tail.is_some()
    }

    /// Reads the host that gave the final answer (retries are over once response headers come).
    pub fn read_served(&mut self) {
        self.served = hostcalls::get_property(vec!["upstream", "address"])
            .ok()
            .flatten()
            .and_then(|b| String::from_utf8(b).ok());
    }

    /// The host that gave the final answer, once [`read_served`](Self::read_served) ran.
    pub fn served(&self) -> Option<&str> {
        self.served.as_deref()
    }

    /// Response headers: if the host that served (see [`read_served`](Self::read_served)) is not
    /// the one kvroute counted, the in-flight count moves there. Takes and returns the counted
    /// `(id, addr)`.
    pub fn headers(
        &mut self,
        shared: &RefCell<Shared>,
        counted: Option<(u32, String)>,
    ) -> Option<(u32, String)> {
        let (Some((id, addr)), Some(served)) = (counted.as_ref(), self.served.as_ref()) else {
            return counted;
        };
        if served == addr {
            return counted;
        }
        let served_id = endpoint_id(served);
        let mut s = shared.borrow_mut();
        s.inflight.add(served_id, 1);
        s.inflight.add(*id, -1);
        s.metrics.count("kvroute.served_elsewhere");
        Some((served_id, served.clone()))
    }

    /// A response body chunk of `size` bytes: keeps its end. (An error's body carries no usage;
    /// its status is not read to tell, see [`usage`](Self::usage).)
    pub fn body(&mut self, size: usize) {
        let Some(tail) = self.tail.as_mut() else {
            return;
        };
        if size == 0 {
            return;
        }
        let want = Tail::wanted(size);
        if let Ok(Some(end)) =
            hostcalls::get_buffer(BufferType::HttpResponseBody, size - want, want)
        {
            tail.push(&end);
        }
    }

    /// What the engine reported using, from the end of the body: only a successful response
    /// carries it, so a response that has it needs no status read.
    pub fn usage(&mut self) -> Option<Usage> {
        self.tail.take().and_then(|t| t.usage())
    }

    /// The stream is over (`ok`: it succeeded, `usage` from [`usage`](Self::usage)): usage
    /// stats, and affinity settled on the host that served it.
    pub fn end(&mut self, shared: &RefCell<Shared>, ok: bool, usage: Option<Usage>) {
        let usage = usage.filter(|_| ok);
        if let Some(u) = usage {
            shared.borrow_mut().metrics.usage(self.served.as_deref(), u);
        }
        let Some(chosen) = self.chosen.take() else {
            return;
        };
        let s = shared.borrow();
        let config = &s.router.config;
        if config.policy != PolicyKind::CacheAware || chosen.keys.is_empty() {
            return;
        }
        let served_there = self.served.as_deref() == Some(chosen.addr.as_str());
        if ok && served_there {
            // The engine says what it had cached: less than the map predicted is an eviction.
            let horizon = usage
                .and_then(|u| eviction::horizon(&chosen.predicted, u, config.eviction_grace_ms));
            let id = endpoint_id(&chosen.addr);
            let raised = horizon.is_some_and(|h| eviction::raise(&HostStore, id, h));
            if raised {
                // This request computed its prefix there again: the deepest key it followed
                // counts again, with a stamp past the horizon.
                let held = chosen.predicted.held.min(chosen.keys.len());
                AffinityMap::new(&HostStore, config.affinity_capacity).record(
                    &chosen.keys[held.saturating_sub(1)..held],
                    id,
                    now_ms(),
                );
            }
            drop(s);
            if raised {
                shared
                    .borrow_mut()
                    .metrics
                    .count("kvroute.affinity.evictions_seen");
            }
            return;
        }
        // The chosen host did not serve this prompt: it holds no more of it than before.
        let map = AffinityMap::new(&HostStore, config.affinity_capacity);
        let held = chosen.predicted.held.min(chosen.keys.len());
        let withdrawn = map.forget(&chosen.keys[held..], endpoint_id(&chosen.addr));
        let recorded = match (&self.served, ok) {
            (Some(served), true) => map.record(&chosen.keys, endpoint_id(served), now_ms()),
            _ => 0,
        };
        drop(s);
        let mut s = shared.borrow_mut();
        if withdrawn > 0 {
            s.metrics.add(
                MetricType::Counter,
                "kvroute.affinity.withdrawn",
                withdrawn as i64,
            );
        }
        if recorded > 0 {
            s.metrics.add(
                MetricType::Gauge,
                "kvroute.affinity.slots_used",
                recorded as i64,
            );
        }
    }
}

/// Envoy's `response.flags` (legacy bit set), 0 when unavailable.
pub fn response_flags() -> u64 {
    hostcalls::get_property(vec!["response", "flags"])
        .ok()
        .flatten()
        .and_then(|b| b.get(..8)?.try_into().ok())
        .map_or(0, u64::from_le_bytes)
}
