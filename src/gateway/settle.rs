//! The response side of a request: which host actually served it (after Envoy's retries), whether
//! it succeeded and whom to blame if not, and what its engine says it took from its prefix cache.
//! In-flight counts move to the serving host; affinity recorded for the host kvroute chose is
//! withdrawn when that host did not serve the request successfully, and recorded for the host
//! that did; the engine's `usage` becomes stats, in total and per endpoint, and, when it cached
//! clearly less than the map predicted, raises that endpoint's eviction horizon (the policy's
//! prefix index settles these: [`Policy::answered`](crate::policy::Policy::answered)).

use super::exchange::Exchange;
use super::host::{HostApi, StreamApi};
use super::stat_names::Counter;
use super::Gateway;
use crate::policy::Answer;
use crate::rendezvous::endpoint_id;
use crate::suspects::{self, UPSTREAM_FAILURE_FLAGS};
use crate::usage::{Tail, Usage};

impl Exchange {
    /// Whether the response has anything to settle: kvroute routed the request, or its engine
    /// may report usage.
    fn pending(&self) -> bool {
        self.chosen.is_some() || self.tail.is_some()
    }
}

/// Whether a response succeeded: no upstream failure in Envoy's `flags`, and either usage (only a
/// successful response carries it) or a 2xx `status`.
fn succeeded(flags: u64, status: Option<u16>, usage: Option<Usage>) -> bool {
    flags & UPSTREAM_FAILURE_FLAGS == 0
        && (usage.is_some() || status.is_some_and(|s| (200..300).contains(&s)))
}

impl<H: HostApi> Gateway<H> {
    /// The response headers: who served, and, when it is not the endpoint kvroute chose, the
    /// chosen one is blamed and the in-flight count moves to the one that served. Returns the
    /// debug header's value when it is configured.
    pub fn on_response_headers<'e>(
        &mut self,
        ex: &'e mut Exchange,
        end_of_stream: bool,
        stream: &dyn StreamApi,
    ) -> Option<&'e str> {
        ex.complete = end_of_stream;
        // Who answered, read once for the blame and the settling.
        if ex.counted.is_some() || ex.pending() {
            ex.served = stream.upstream_address();
        }
        if ex.counted.is_some() {
            // Retries are over by now (Envoy retries only before it forwards response headers):
            // an answer from another host means the chosen one failed. Whether the chosen host
            // answered 5xx waits for the stream's end, where a successful response (one that
            // reports usage) costs no status read.
            self.blame(ex, None, 0);
        }
        self.count_where_served(ex);
        if end_of_stream {
            self.first_byte(ex);
        }
        if self.router.config.debug_header {
            ex.outcome.as_deref()
        } else {
            None
        }
    }

    /// A response body chunk of `size` bytes: keeps its end when the engine may report usage
    /// there.
    pub fn on_response_body(
        &mut self,
        ex: &mut Exchange,
        size: usize,
        end_of_stream: bool,
        stream: &dyn StreamApi,
    ) {
        ex.complete |= end_of_stream;
        if size > 0 || end_of_stream {
            self.first_byte(ex);
        }
        let Some(tail) = ex.tail.as_mut() else {
            return;
        };
        if size == 0 {
            return;
        }
        if let Some(end) = stream.response_body_end(size, Tail::wanted(size)) {
            tail.push(&end);
        }
    }

    /// The stream is over, however it ended (the first call does the work): blame, usage and
    /// affinity settled, one request fewer in flight.
    pub fn on_end(&mut self, ex: &mut Exchange, stream: &dyn StreamApi) {
        if std::mem::replace(&mut ex.ended, true) {
            return;
        }
        let involved = ex.counted.is_some() || ex.pending();
        let usage = ex.tail.take().and_then(|t| t.usage());
        // A response that reports usage succeeded. Only a routed request's outcome matters
        // without one: it settles the affinity, and a 5xx blames the chosen endpoint.
        let status = match usage {
            None if ex.counted.is_some() => stream.response_status(),
            _ => None,
        };
        let server_error = status.is_some_and(suspects::server_error);
        // A reset or failed connection after the response started (a replica dying mid-stream)
        // shows only in Envoy's response flags; a response that reached its end had none. A 5xx
        // needs them too: was it Envoy's own 503 for a full cluster?
        let flags = if (!ex.complete && involved) || server_error {
            stream.response_flags()
        } else {
            0
        };
        if flags & UPSTREAM_FAILURE_FLAGS != 0 || server_error {
            self.blame(ex, status, flags);
        }
        let ok = succeeded(flags, status, usage);
        self.settle(ex, ok, usage);
        self.prefill_done(ex, ok, usage);
        if let Some((id, _)) = ex.counted.take() {
            self.inflight.add(id, -1);
        }
    }

    /// The response's first byte: the request's prefill leaves its endpoint's queue.
    fn first_byte(&mut self, ex: &mut Exchange) {
        let Some(p) = ex.prefill.as_mut().filter(|p| p.first_byte_ms.is_none()) else {
            return;
        };
        p.first_byte_ms = Some(self.host.now_ms());
        if let Some((id, _)) = &ex.counted {
            self.inflight
                .add_prefill(*id, -(p.expected.uncached as i64));
        }
    }

    /// The stream is over (`ok`: it succeeded): a prefill still queued leaves the queue; a
    /// streamed success's wait for its first byte teaches its endpoint's prefill rate, and is
    /// set against what was expected of it; the engine's `usage` teaches bytes per token.
    fn prefill_done(&mut self, ex: &mut Exchange, ok: bool, usage: Option<Usage>) {
        let (Some(p), Some((id, addr))) = (ex.prefill.take(), &ex.counted) else {
            return;
        };
        if let Some(u) = usage.filter(|_| ok) {
            self.prefill.tokenized(p.expected.prompt, u.prompt_tokens);
        }
        let Some(at) = p.first_byte_ms else {
            self.inflight
                .add_prefill(*id, -(p.expected.uncached as i64));
            return;
        };
        if ok && p.streams {
            let waited = at.saturating_sub(p.routed_ms);
            let work = p.expected.ahead + p.expected.uncached;
            self.prefill.first_byte(*id, work, waited);
            self.stats
                .ttft_estimate(&self.host, addr, p.expected.ttft_ms, waited);
        }
    }

    /// If the endpoint kvroute chose failed this request, marks it suspect so the next requests
    /// avoid it before Envoy's health check and the next poll notice. `status` is the response
    /// status when known; `flags` Envoy's `response.flags`.
    fn blame(&mut self, ex: &mut Exchange, status: Option<u16>, flags: u64) {
        let Some((_, chosen)) = &ex.counted else {
            return;
        };
        if ex.blamed {
            return;
        }
        if suspects::chosen_failed(chosen, ex.served.as_deref(), status, flags) {
            ex.blamed = true;
            let chosen = chosen.clone();
            let now = self.host.now_ms();
            self.mark_suspect(&chosen, now);
        }
    }

    /// If the host that served is not the one kvroute counted, the in-flight count moves there.
    fn count_where_served(&mut self, ex: &mut Exchange) {
        let (Some((id, addr)), Some(served)) = (&ex.counted, &ex.served) else {
            return;
        };
        if served == addr {
            return;
        }
        let served_id = endpoint_id(served);
        self.inflight.add(served_id, 1);
        self.inflight.add(*id, -1);
        if let Some(p) = ex.prefill.as_ref().filter(|p| p.first_byte_ms.is_none()) {
            let bytes = p.expected.uncached as i64;
            self.inflight.add_prefill(*id, -bytes);
            self.inflight.add_prefill(served_id, bytes);
        }
        self.stats.count(&self.host, Counter::ServedElsewhere);
        ex.counted = Some((served_id, served.clone()));
    }

    /// The response is over (`ok`: it succeeded): usage stats, and affinity settled on the host
    /// that served it.
    fn settle(&mut self, ex: &mut Exchange, ok: bool, usage: Option<Usage>) {
        let usage = usage.filter(|_| ok);
        if let Some(u) = usage {
            self.stats.usage(ex.served.as_deref(), u);
        }
        let Some(chosen) = ex.chosen.take() else {
            return;
        };
        let host = &self.host;
        let answer = Answer {
            chosen: &chosen.addr,
            served: ex.served.as_deref(),
            ok,
            usage,
            keys: &chosen.keys,
            now_ms: &|| host.now_ms(),
        };
        let settled = self.router.answered(host, chosen.ticket, &answer);
        let m = &mut self.stats;
        if settled.eviction_seen {
            m.count(host, Counter::EvictionsSeen);
        }
        if settled.withdrawn > 0 {
            m.add(host, Counter::AffinityWithdrawn, settled.withdrawn as i64);
        }
        if settled.recorded > 0 {
            m.slots_used(host, settled.recorded as i64);
        }
    }
}
