//! The prefix index: which endpoints hold which prefixes of a request, learnt from the requests
//! this gateway routed and settled by what their engines report. Behind a trait, so an index the
//! engines report themselves can stand in for the affinity map.

use hashbrown::HashMap;

use crate::eviction::{self, Predicted};
use crate::holders::affinity::AffinityMap;
use crate::holders::{Held, Holders};
use crate::policy::{Answer, Input, Settled};
use crate::prefix::PrefixKeys;
use crate::store::SharedStore;

/// A prefix record younger than this is not rewritten when a request follows it: it keeps hot
/// prefixes' writes to a handful per second instead of one per chunk per request.
pub const REFRESH_MS: u64 = 1000;

/// What the index found for one request: its longest held prefix, and the eviction horizons
/// that judged its holders, which also judge the holders of what the request then records.
#[derive(Debug, Default)]
pub struct Found {
    pub matched: Option<Held>,
    horizons: HashMap<u32, u64>,
}

/// Where a request's prefixes are held.
pub trait PrefixIndex {
    /// The longest prefix of the request past its head that some endpoint holds, with the holders
    /// that still count.
    fn lookup(&self, input: &Input) -> Found;
    /// The request goes to `endpoint`, with what the lookup `found`: what it will hold. Returns
    /// the shared-data keys written for the first time.
    fn routed(&self, input: &Input, found: &Found, endpoint: u32) -> usize;
    /// The request was answered: settles what [`routed`](Self::routed) recorded.
    /// `predicted` is what the index said the chosen endpoint held of the request's keys.
    fn answered(&self, store: &dyn SharedStore, predicted: &Predicted, answer: &Answer) -> Settled;
}

/// The affinity map ([`AffinityMap`]) with the engines' eviction horizons ([`eviction`]).
pub struct AffinityIndex {
    /// Shared-data slots of the affinity map.
    capacity: u32,
    /// How old a record must be before an engine's report may show it evicted.
    eviction_grace_ms: u64,
}

impl AffinityIndex {
    pub fn new(capacity: u32, eviction_grace_ms: u64) -> AffinityIndex {
        AffinityIndex {
            capacity,
            eviction_grace_ms,
        }
    }
}

impl PrefixIndex for AffinityIndex {
    fn lookup(&self, input: &Input) -> Found {
        let (store, keys) = (input.store, input.keys);
        // Only a match past the head counts (the head's place is its group's home): a request
        // without earlier turns looks nothing up, and one with them only at its history.
        let map = AffinityMap::new(store, self.capacity);
        let Some(mut matched) = map.longest_match(&keys.keys, keys.head_chunks) else {
            return Found::default();
        };
        // Holders whose engines were since found to evict what they last used by then. Read
        // now, not on the tick: what any worker learnt counts from its next request on.
        let horizons = eviction::read(store);
        let stamp = matched.stamp_ms.unwrap_or(0);
        (matched.holders).retain(|&h| eviction::still_held(&horizons, h, stamp));
        Found {
            matched: Some(matched),
            horizons,
        }
    }

    fn routed(&self, input: &Input, found: &Found, endpoint: u32) -> usize {
        let (keys, now_ms) = (input.keys, input.now_ms);
        let from = first_to_record(keys, found.matched.as_ref(), endpoint, now_ms);
        AffinityMap::new(input.store, self.capacity).record_keeping(
            &keys.keys[from..],
            endpoint,
            now_ms,
            |holder, stamp| eviction::still_held(&found.horizons, holder, stamp),
        )
    }

    fn answered(&self, store: &dyn SharedStore, predicted: &Predicted, answer: &Answer) -> Settled {
        let now_ms = answer.now_ms;
        let mut settled = Settled::default();
        let keys = answer.keys;
        if keys.is_empty() {
            return settled;
        }
        let map = AffinityMap::new(store, self.capacity);
        let chosen = crate::rendezvous::endpoint_id(answer.chosen);
        let held = predicted.held.min(keys.len());
        if answer.ok && answer.served == Some(answer.chosen) {
            // The engine says what it had cached: less than the map predicted is an eviction.
            let grace = self.eviction_grace_ms;
            let horizon = (answer.usage).and_then(|u| eviction::horizon(predicted, u, grace));
            settled.eviction_seen = horizon.is_some_and(|h| eviction::raise(store, chosen, h));
            if settled.eviction_seen {
                // This request computed its prefix there again: the deepest key it followed
                // counts again, with a stamp past the horizon.
                map.record(&keys[held.saturating_sub(1)..held], chosen, now_ms());
            }
            return settled;
        }
        // The chosen host did not serve this prompt: it holds no more of it than before.
        settled.withdrawn = map.forget(&keys[held..], chosen);
        if let (Some(served), true) = (answer.served, answer.ok) {
            let id = crate::rendezvous::endpoint_id(served);
            settled.recorded = map.record(keys, id, now_ms());
        }
        settled
    }
}

/// The first key a request routed to `endpoint` records: the keys past its match (new to the
/// map), and the deepest matched one too when it is stale or lacks `endpoint`, which is what the
/// next turn finds first. Without a match, every key past the head (the head's place is its
/// group's home, which needs no record).
fn first_to_record(keys: &PrefixKeys, matched: Option<&Held>, endpoint: u32, now_ms: u64) -> usize {
    match matched {
        Some(m)
            if m.holders.contains(&endpoint)
                && now_ms.saturating_sub(m.stamp_ms.unwrap_or(0)) < REFRESH_MS =>
        {
            m.depth
        }
        Some(m) => m.depth.saturating_sub(1),
        None => keys.tail_from,
    }
}
