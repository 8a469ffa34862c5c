//! Whether the host hands kvroute the bodies it pauses for, judged from evidence, and the
//! header-only routing used for the rest of the VM's life when it does not.
//!
//! kvroute pauses a routable request in the headers phase until its body is in. Envoy only keeps
//! calling a filter's body callback during that pause when the Wasm filter config sets
//! `allow_on_headers_stop_iteration: true`; without it (Istio's `WasmPlugin` cannot set it) Envoy
//! turns the pause into "stop everything and buffer", holds the body outside the filter, and the
//! request waits forever. Nothing tells a plugin which of the two it got, so kvroute watches its
//! first paused streams: the first body delivered during a pause proves the flag; a body Envoy has
//! read but never delivered proves its absence. A client that simply has not sent its body yet
//! proves neither, so waiting for a slow client never counts as evidence.

use hashbrown::HashMap;
use xxhash_rust::xxh3::xxh3_64;

use crate::hosts::Host;
use crate::rendezvous;

/// Tick period while paused streams are watched: how long a withheld body waits at most.
pub const WATCH_TICK_MS: u64 = 100;

/// How long a partly received body must stand still, never delivered, to count as withheld. Only
/// for bodies whose end Envoy cannot have reached: no `content-length`, or a body larger than
/// Envoy's buffer, at which point Envoy stops reading from the client.
pub const STALL_MS: u64 = 1000;

/// What is known about the host's handling of bodies during a pause.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyAccess {
    /// No paused stream has shown it yet.
    Unknown,
    /// A body reached kvroute during a pause: the flag is set. Nothing is watched any more.
    Delivered,
    /// Envoy read a body it never delivered: the flag is missing. kvroute no longer pauses.
    Missing,
}

/// Is this evidence that the host withholds bodies from paused filters? `received` is how many body
/// bytes Envoy has read for a stream whose filter was given none of them; `still_ms` how long that
/// count has not moved.
pub fn withheld(content_length: Option<u64>, received: u64, still_ms: u64) -> bool {
    if received == 0 {
        // Nothing arrived yet: a slow client, never evidence.
        return false;
    }
    match content_length {
        // The whole body is in Envoy and none of it reached the filter.
        Some(len) if received >= len => true,
        // Part of it sits in Envoy, not moving, not delivered.
        _ => still_ms >= STALL_MS,
    }
}

/// Body bytes Envoy has read for a stream, from its `request.total_size` property (body bytes
/// received plus the header map's size, as a little-endian i64) and the header map's size (the sum
/// of its names' and values' lengths, which is how Envoy counts it).
pub fn body_received(total_size: &[u8], header_bytes: u64) -> Option<u64> {
    let total = i64::from_le_bytes(total_size.try_into().ok()?);
    Some(u64::try_from(total).ok()?.saturating_sub(header_bytes))
}

/// The size Envoy gives a header map: names' and values' lengths, nothing for separators.
pub fn header_bytes(headers: &[(String, impl AsRef<[u8]>)]) -> u64 {
    headers
        .iter()
        .map(|(k, v)| (k.len() + v.as_ref().len()) as u64)
        .sum()
}

/// Routing from headers alone: the session's rendezvous order over the healthy hosts (the chosen
/// one, then `fallbacks` more for retries), the same order the `session` policy uses. Empty when no
/// host is healthy, which leaves the request to Envoy's load balancer.
pub fn session_endpoints(hosts: &[Host], session: &str, fallbacks: usize) -> Vec<String> {
    let mut healthy: Vec<&Host> = hosts.iter().filter(|h| h.healthy).collect();
    healthy.sort_by(|a, b| a.addr.cmp(&b.addr));
    healthy.dedup_by(|a, b| a.addr == b.addr);
    let ids: Vec<u32> = healthy.iter().map(|h| h.id()).collect();
    rendezvous::order(xxh3_64(session.as_bytes()), &ids)
        .into_iter()
        .take(1 + fallbacks)
        .map(|i| healthy[i].addr.clone())
        .collect()
}

/// A paused stream that has been given no body yet, as last observed.
#[derive(Debug, Clone)]
struct Watched {
    content_length: Option<u64>,
    received: u64,
    /// When `received` last changed (first observed), if observed.
    since_ms: Option<u64>,
}

/// One VM's knowledge of body access and the paused streams it watches until it knows.
#[derive(Debug)]
pub struct BodyWatch {
    state: BodyAccess,
    paused: HashMap<u32, Watched>,
}

impl Default for BodyWatch {
    fn default() -> Self {
        BodyWatch {
            state: BodyAccess::Unknown,
            paused: HashMap::new(),
        }
    }
}

impl BodyWatch {
    pub fn state(&self) -> BodyAccess {
        self.state
    }

    /// Whether streams are waiting on a verdict (the root then ticks every [`WATCH_TICK_MS`]).
    pub fn watching(&self) -> bool {
        self.state == BodyAccess::Unknown && !self.paused.is_empty()
    }

    /// A stream paused for its body. Returns whether the caller must watch it (the verdict is
    /// still open) and whether it is the first one watched (the root must start ticking fast).
    pub fn paused(&mut self, id: u32, content_length: Option<u64>) -> (bool, bool) {
        if self.state != BodyAccess::Unknown {
            return (false, false);
        }
        let first = self.paused.is_empty();
        let watched = Watched {
            content_length,
            received: 0,
            since_ms: None,
        };
        self.paused.insert(id, watched);
        (true, first)
    }

    /// A watched stream got (part of) its body while paused: the host delivers bodies.
    pub fn delivered(&mut self) {
        if self.state == BodyAccess::Unknown {
            self.state = BodyAccess::Delivered;
            self.paused.clear();
        }
    }

    /// A watched stream ended.
    pub fn forget(&mut self, id: u32) {
        self.paused.remove(&id);
    }

    /// The streams to observe on this tick.
    pub fn watched(&self) -> Vec<u32> {
        if self.state == BodyAccess::Unknown {
            self.paused.keys().copied().collect()
        } else {
            Vec::new()
        }
    }

    /// Records that watched stream `id` has `received` body bytes in Envoy at `now_ms`; returns
    /// whether that is evidence of a withheld body.
    pub fn observe(&mut self, id: u32, received: u64, now_ms: u64) -> bool {
        let Some(w) = self.paused.get_mut(&id) else {
            return false;
        };
        if w.since_ms.is_none() || received != w.received {
            w.received = received;
            w.since_ms = Some(now_ms);
        }
        let still = now_ms.saturating_sub(w.since_ms.unwrap_or(now_ms));
        withheld(w.content_length, w.received, still)
    }

    /// Concludes that the host withholds bodies. Returns the streams still paused, which the caller
    /// must route from their headers and resume; `None` once a verdict was reached before.
    pub fn conclude_missing(&mut self) -> Option<Vec<u32>> {
        if self.state != BodyAccess::Unknown {
            return None;
        }
        self.state = BodyAccess::Missing;
        Some(self.paused.drain().map(|(id, _)| id).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_that_has_sent_nothing_is_never_evidence() {
        assert!(!withheld(Some(500), 0, 60_000));
        assert!(!withheld(None, 0, 60_000));
    }

    #[test]
    fn a_whole_body_in_envoy_that_never_arrived_is_evidence_at_once() {
        assert!(withheld(Some(500), 500, 0));
        assert!(!withheld(Some(500), 499, STALL_MS - 1));
    }

    #[test]
    fn a_partial_body_counts_only_once_it_stands_still() {
        assert!(!withheld(None, 10, STALL_MS - 1));
        assert!(withheld(None, 10, STALL_MS));
        // Larger than Envoy's buffer: Envoy stops reading short of content-length.
        assert!(withheld(Some(10_000_000), 1 << 20, STALL_MS));
    }

    #[test]
    fn body_bytes_are_total_size_less_the_headers() {
        let headers = vec![
            (":method".to_string(), "POST".to_string()),
            ("content-length".to_string(), "12".to_string()),
        ];
        assert_eq!(header_bytes(&headers), 11 + 16);
        assert_eq!(body_received(&(27i64 + 12).to_le_bytes(), 27), Some(12));
        assert_eq!(body_received(&27i64.to_le_bytes(), 27), Some(0));
        assert_eq!(body_received(&[1, 2, 3], 0), None);
        assert_eq!(body_received(&(-1i64).to_le_bytes(), 0), None);
    }

    #[test]
    fn a_delivered_body_ends_the_watch_for_good() {
        let mut w = BodyWatch::default();
        assert_eq!(w.paused(1, Some(10)), (true, true));
        assert_eq!(w.paused(2, None), (true, false));
        assert!(w.watching());
        w.delivered();
        assert_eq!(w.state(), BodyAccess::Delivered);
        assert!(!w.watching());
        assert!(w.watched().is_empty());
        assert_eq!(w.paused(3, Some(10)), (false, false));
        assert_eq!(w.conclude_missing(), None, "a verdict is final");
        assert_eq!(w.state(), BodyAccess::Delivered);
    }

    #[test]
    fn evidence_needs_bytes_that_stay_undelivered() {
        let mut w = BodyWatch::default();
        w.paused(1, None);
        assert!(!w.observe(1, 0, 0));
        assert!(!w.observe(1, 5, 100));
        // Still growing: the clock restarts.
        assert!(!w.observe(1, 8, 100 + STALL_MS));
        assert!(w.observe(1, 8, 100 + 2 * STALL_MS));
        assert!(!w.observe(9, 8, 100 + 2 * STALL_MS), "unknown stream");
    }

    #[test]
    fn concluding_hands_back_every_paused_stream_once() {
        let mut w = BodyWatch::default();
        w.paused(1, Some(3));
        w.paused(2, Some(3));
        w.forget(2);
        assert!(w.observe(1, 3, 0));
        assert_eq!(w.conclude_missing(), Some(vec![1]));
        assert_eq!(w.state(), BodyAccess::Missing);
        assert_eq!(w.conclude_missing(), None);
        assert_eq!(w.paused(4, Some(3)), (false, false), "no pausing any more");
        w.delivered();
        assert_eq!(w.state(), BodyAccess::Missing, "a verdict is final");
    }

    #[test]
    fn session_routing_is_stable_and_skips_unhealthy_hosts() {
        let mut hosts: Vec<Host> = (0..4)
            .map(|i| Host::fixed(&format!("127.0.0.1:{}", 8001 + i)))
            .collect();
        let first = session_endpoints(&hosts, "user-7", 1);
        assert_eq!(first.len(), 2);
        assert_ne!(first[0], first[1]);
        hosts.reverse();
        assert_eq!(session_endpoints(&hosts, "user-7", 1), first);
        for h in hosts.iter_mut() {
            h.healthy = h.addr != first[0];
        }
        let moved = session_endpoints(&hosts, "user-7", 0);
        assert_eq!(moved, vec![first[1].clone()]);
        for h in hosts.iter_mut() {
            h.healthy = false;
        }
        assert!(session_endpoints(&hosts, "user-7", 1).is_empty());
    }

    #[test]
    fn sessions_spread_over_hosts() {
        let hosts: Vec<Host> = (0..4)
            .map(|i| Host::fixed(&format!("127.0.0.1:{}", 8001 + i)))
            .collect();
        let used: std::collections::HashSet<String> = (0..64)
            .map(|i| session_endpoints(&hosts, &format!("s{i}"), 0).remove(0))
            .collect();
        assert_eq!(used.len(), 4);
    }
}
