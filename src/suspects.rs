//! Endpoints that just failed a request kvroute routed to them, kept out of routing for a short
//! time so the next requests avoid them before Envoy's health check and kvroute's poll catch up.
//!
//! The list is small, bounded and expiring. One worker marks an endpoint in its own copy at once
//! and in one shared-data value ([`mark_shared`]); the other workers merge that value into theirs
//! on their tick. The encoded value starts with a format version byte, so a value written by
//! another build is ignored instead of misread.

use crate::hosts::Host;
use crate::store::{self, SharedStore};

/// How long a failed endpoint stays out of routing: as long as the shipped config's outlier
/// ejection (`base_ejection_time`), and well past Envoy's health check (2 failures at 1 s) and
/// kvroute's next poll. A replica still down when it expires fails one more request, which the
/// retry policy replays elsewhere, and is marked again.
pub const SUSPECT_MS: u64 = 10_000;

/// At most this many suspects: a whole fleet failing at once must not grow the shared value
/// without bound. When full, the mark expiring soonest gives way.
pub const MAX_SUSPECTS: usize = 64;

/// Format version of [`Suspects::encode`].
pub const VERSION: u8 = 1;

/// Envoy's legacy `response.flags` bits that mean the upstream failed the stream: a remote reset
/// (UR), a connection that could not be made (UF), a connection closed under the stream (UC).
pub const UPSTREAM_FAILURE_FLAGS: u64 = 0x10 | 0x20 | 0x40;

/// Envoy's `response.flags` bit for a circuit breaker that overflowed (UO): Envoy itself answered
/// 503 because the cluster was full, which says nothing about the endpoint.
pub const UPSTREAM_OVERFLOW_FLAG: u64 = 0x80;

/// Suspect endpoints with the time (ms since the epoch) their mark expires.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Suspects {
    entries: Vec<(String, u64)>,
}

impl Suspects {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Marks `addr` until `now_ms + SUSPECT_MS`. Returns false for an address too long to encode.
    pub fn mark(&mut self, addr: &str, now_ms: u64) -> bool {
        self.mark_until(addr, now_ms.saturating_add(SUSPECT_MS))
    }

    fn mark_until(&mut self, addr: &str, until_ms: u64) -> bool {
        self.extend(addr, until_ms).is_some()
    }

    /// Marks `addr` until `until_ms` unless it already is for as long. `None` for an address too
    /// long to encode; else whether the list changed.
    fn extend(&mut self, addr: &str, until_ms: u64) -> Option<bool> {
        if addr.is_empty() || addr.len() > u8::MAX as usize {
            return None;
        }
        if let Some(entry) = self.entries.iter_mut().find(|(a, _)| a == addr) {
            let later = until_ms > entry.1;
            entry.1 = entry.1.max(until_ms);
            return Some(later);
        }
        if self.entries.len() >= MAX_SUSPECTS {
            let soonest = (0..self.entries.len()).min_by_key(|&i| self.entries[i].1);
            match soonest {
                Some(i) if self.entries[i].1 < until_ms => {
                    self.entries.swap_remove(i);
                }
                _ => return Some(false),
            }
        }
        self.entries.push((addr.to_string(), until_ms));
        Some(true)
    }

    /// Whether `addr` is marked and its mark has not expired at `now_ms`.
    pub fn is_suspect(&self, addr: &str, now_ms: u64) -> bool {
        self.entries
            .iter()
            .any(|(a, until)| a == addr && *until > now_ms)
    }

    /// Drops the marks that expired at `now_ms`.
    pub fn prune(&mut self, now_ms: u64) {
        self.entries.retain(|(_, until)| *until > now_ms);
    }

    /// Takes in the marks of `other` still in force at `now_ms`, keeping the later expiry where
    /// both mark an address. Returns how many marks were news (new, or longer than this list's).
    pub fn merge(&mut self, other: &Suspects, now_ms: u64) -> usize {
        other
            .entries
            .iter()
            .filter(|(_, until)| *until > now_ms)
            .filter(|(addr, until)| self.extend(addr, *until) == Some(true))
            .count()
    }

    /// `hosts` with every suspect reported unhealthy, or `None` when none of them is suspect (the
    /// common case, which then copies nothing).
    pub fn apply(&self, hosts: &[Host], now_ms: u64) -> Option<Vec<Host>> {
        if self.is_empty()
            || !hosts
                .iter()
                .any(|h| h.healthy && self.is_suspect(&h.addr, now_ms))
        {
            return None;
        }
        let mut out = hosts.to_vec();
        for h in &mut out {
            if self.is_suspect(&h.addr, now_ms) {
                h.healthy = false;
            }
        }
        Some(out)
    }

    /// Version byte, then per mark: expiry (u64 little-endian), address length (u8), address.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(1 + self.entries.len() * 32);
        out.push(VERSION);
        for (addr, until) in &self.entries {
            out.extend_from_slice(&until.to_le_bytes());
            out.push(addr.len() as u8);
            out.extend_from_slice(addr.as_bytes());
        }
        out
    }

    /// The list [`Suspects::encode`] wrote, or `None` for another version or a damaged value.
    pub fn decode(bytes: &[u8]) -> Option<Suspects> {
        let (&version, mut rest) = bytes.split_first()?;
        if version != VERSION {
            return None;
        }
        let mut suspects = Suspects::new();
        while !rest.is_empty() {
            let until = u64::from_le_bytes(rest.get(..8)?.try_into().ok()?);
            let len = usize::from(*rest.get(8)?);
            let addr = std::str::from_utf8(rest.get(9..9 + len)?).ok()?;
            suspects.mark_until(addr, until);
            rest = &rest[9 + len..];
        }
        Some(suspects)
    }
}

/// Whether a routed request's outcome shows that `chosen`, the endpoint kvroute named first,
/// failed it. `upstream` is the host that gave the final answer (Envoy's `upstream.address`),
/// `status` its response status, `flags` Envoy's `response.flags` (needed with a 5xx status, to
/// tell the endpoint's 503 from Envoy's own). Any 5xx is the server's failure (a vLLM whose engine
/// died answers 500 to everything); a 4xx is the client's own error and blames nobody.
pub fn chosen_failed(
    chosen: &str,
    upstream: Option<&str>,
    status: Option<u16>,
    flags: u64,
) -> bool {
    match upstream {
        // override_host sends the first attempt to the first listed address, and retries consume
        // the following ones: an answer from any other host means that first attempt failed.
        Some(host) if host != chosen => true,
        // The chosen host itself answered 5xx (its engine failed, or it is going away) or its
        // stream failed.
        Some(_) => {
            let failed = status.is_some_and(server_error) && flags & UPSTREAM_OVERFLOW_FLAG == 0;
            failed || flags & UPSTREAM_FAILURE_FLAGS != 0
        }
        // No host was ever selected: nothing says the chosen one is at fault.
        None => false,
    }
}

/// Whether `status` is a server error (5xx).
pub fn server_error(status: u16) -> bool {
    (500..600).contains(&status)
}

/// Marks `addr` in the shared value under `key`: read, prune, mark, compare-and-swap. Returns
/// whether the value was written.
pub fn mark_shared<S: SharedStore + ?Sized>(store: &S, key: &str, addr: &str, now_ms: u64) -> bool {
    let written = store::update(store, key, |current| {
        // A value of another format version is replaced, not merged.
        let mut suspects = current.and_then(Suspects::decode).unwrap_or_default();
        suspects.prune(now_ms);
        suspects.mark(addr, now_ms).then(|| suspects.encode())
    });
    matches!(written, store::Update::Created | store::Update::Written)
}

/// The shared value under `key` and its version, decoded (`None` when absent or unreadable).
pub fn read_shared<S: SharedStore + ?Sized>(
    store: &S,
    key: &str,
) -> (Option<Suspects>, Option<u32>) {
    let (value, cas) = store.get(key);
    (value.as_deref().and_then(Suspects::decode), cas)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;

    const A: &str = "10.0.0.1:8000";
    const B: &str = "10.0.0.2:8000";

    #[test]
    fn a_mark_holds_until_it_expires() {
        let mut s = Suspects::new();
        assert!(s.mark(A, 1_000));
        assert!(s.is_suspect(A, 1_000));
        assert!(s.is_suspect(A, 1_000 + SUSPECT_MS - 1));
        assert!(!s.is_suspect(A, 1_000 + SUSPECT_MS));
        assert!(!s.is_suspect(B, 1_000));
        s.prune(1_000 + SUSPECT_MS);
        assert!(s.is_empty());
    }

    #[test]
    fn marking_again_extends_and_never_shortens() {
        let mut s = Suspects::new();
        s.mark(A, 1_000);
        s.mark(A, 3_000);
        assert_eq!(s.len(), 1);
        assert!(s.is_suspect(A, 3_000 + SUSPECT_MS - 1));
        s.mark_until(A, 10);
        assert!(s.is_suspect(A, 3_000 + SUSPECT_MS - 1));
    }

    #[test]
    fn the_list_is_bounded_and_the_soonest_expiry_gives_way() {
        let mut s = Suspects::new();
        for i in 0..MAX_SUSPECTS as u64 + 10 {
            s.mark(&format!("10.0.{}.{}:80", i / 256, i % 256), i);
        }
        assert_eq!(s.len(), MAX_SUSPECTS);
        assert!(!s.is_suspect("10.0.0.0:80", 0));
        let last = MAX_SUSPECTS as u64 + 9;
        assert!(s.is_suspect(&format!("10.0.0.{last}:80"), last));
        // A mark expiring before all the others does not push one of them out.
        s.mark_until("10.9.9.9:80", 1);
        assert!(!s.is_suspect("10.9.9.9:80", 0));
    }

    #[test]
    fn encode_decode_round_trips() {
        let mut s = Suspects::new();
        s.mark(A, 1_000);
        s.mark("[2001:db8::1]:8000", 2_000);
        let bytes = s.encode();
        assert_eq!(bytes[0], VERSION);
        assert_eq!(Suspects::decode(&bytes), Some(s));
        assert_eq!(Suspects::decode(&[VERSION]), Some(Suspects::new()));
    }

    #[test]
    fn other_versions_and_damaged_values_are_rejected() {
        let mut s = Suspects::new();
        s.mark(A, 1_000);
        let mut bytes = s.encode();
        assert_eq!(Suspects::decode(&[]), None);
        let truncated = &bytes[..bytes.len() - 1];
        assert_eq!(Suspects::decode(truncated), None);
        bytes[0] = VERSION + 1;
        assert_eq!(Suspects::decode(&bytes), None);
    }

    #[test]
    fn unencodable_addresses_are_refused() {
        let mut s = Suspects::new();
        assert!(!s.mark("", 0));
        assert!(!s.mark(&"1".repeat(256), 0));
        assert!(s.is_empty());
    }

    #[test]
    fn merge_keeps_the_later_expiry() {
        let mut mine = Suspects::new();
        mine.mark(A, 1_000);
        let mut theirs = Suspects::new();
        theirs.mark(A, 4_000);
        theirs.mark(B, 500);
        assert_eq!(mine.merge(&theirs, 600), 2);
        assert!(mine.is_suspect(A, 4_000 + SUSPECT_MS - 1));
        assert!(mine.is_suspect(B, 600));
        // Nothing new the second time; an expired mark is not taken in.
        assert_eq!(mine.merge(&theirs, 600), 0);
        let mut fresh = Suspects::new();
        assert_eq!(fresh.merge(&theirs, 500 + SUSPECT_MS), 1);
        assert!(!fresh.is_suspect(B, 0));
    }

    #[test]
    fn apply_reports_suspects_unhealthy_and_copies_nothing_otherwise() {
        let hosts = vec![Host::fixed(A), Host::fixed(B)];
        let mut s = Suspects::new();
        assert_eq!(s.apply(&hosts, 0), None);
        s.mark(A, 0);
        let applied = s.apply(&hosts, 1).unwrap();
        assert!(!applied[0].healthy);
        assert!(applied[1].healthy);
        assert_eq!(s.apply(&hosts, SUSPECT_MS), None, "expired");
    }

    #[test]
    fn a_failed_first_attempt_or_a_failing_answer_blames_the_chosen_endpoint() {
        // Answered by the chosen endpoint: fine unless it said 5xx or its stream failed.
        assert!(!chosen_failed(A, Some(A), Some(200), 0));
        for status in [500, 502, 503, 504, 599] {
            assert!(chosen_failed(A, Some(A), Some(status), 0), "{status}");
        }
        // A 4xx is the client's error (a prompt too long, a bad field), not the endpoint's.
        for status in [400, 404, 413, 429, 499] {
            assert!(!chosen_failed(A, Some(A), Some(status), 0), "{status}");
        }
        // Envoy's own 503 for a full cluster (circuit breaker overflow) is not the endpoint's.
        assert!(!chosen_failed(
            A,
            Some(A),
            Some(503),
            UPSTREAM_OVERFLOW_FLAG
        ));
        assert!(chosen_failed(A, Some(A), Some(200), 0x40));
        assert!(chosen_failed(A, Some(A), None, 0x20));
        // A client going away (downstream termination, local reset) is not the endpoint's fault.
        assert!(!chosen_failed(A, Some(A), Some(200), 0x4000 | 0x8));
        // Answered by another host: the first attempt was retried away from the chosen one.
        assert!(chosen_failed(A, Some(B), Some(200), 0));
        assert!(!chosen_failed(A, None, Some(503), 0x2));
    }

    #[test]
    fn shared_marks_accumulate_across_writers_and_drop_expired_ones() {
        let store = MemoryStore::new();
        let key = crate::shared_keys::SUSPECTS;
        assert!(mark_shared(&store, key, A, 1_000));
        assert!(mark_shared(&store, key, B, 2_000));
        let (s, cas) = read_shared(&store, key);
        let s = s.unwrap();
        assert!(cas.is_some());
        assert!(s.is_suspect(A, 2_000) && s.is_suspect(B, 2_000));
        // A later mark prunes what expired meanwhile.
        assert!(mark_shared(&store, key, B, 1_000 + SUSPECT_MS));
        let s = read_shared(&store, key).0.unwrap();
        assert_eq!(s.len(), 1);
        // A value of another version is replaced.
        store.set(key, &[VERSION + 1, 1, 2], None).unwrap();
        assert_eq!(read_shared(&store, key).0, None);
        assert!(mark_shared(&store, key, A, 0));
        assert!(read_shared(&store, key).0.unwrap().is_suspect(A, 0));
    }
}
