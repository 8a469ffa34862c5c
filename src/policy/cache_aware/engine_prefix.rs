//! Precise mode's signal: which endpoints' engines hold the longest prefix of a request, from the
//! engine index ([`holders::engine`](crate::holders::engine)), and where that sends a request.

use crate::holders::engine::{EngineIndex, Status};
use crate::holders::{Held, Holders};
use crate::policy::pipeline::Scoring;
use crate::policy::Input;
use crate::policy::OverloadBound;

/// How long a worker goes by the engine index's status it read (a request reads it again after
/// that): the records it reads must be of the generation the status names, and a full resync
/// starts a new one. Read on requests rather than on the tick, which a busy worker runs late.
pub const STATUS_MS: u64 = 100;

/// Reads the engine index for requests.
pub struct EngineHolders {
    /// The index's shared-data slots.
    capacity: u32,
    /// How long after the indexer's last answer the index still counts.
    max_age_ms: u64,
    cache_threshold: f64,
    /// The index's status as this worker last read it, and when.
    status: (Option<Status>, Option<u64>),
}

impl EngineHolders {
    pub fn new(capacity: u32, max_age_ms: u64, cache_threshold: f64) -> Self {
        EngineHolders {
            capacity,
            max_age_ms,
            cache_threshold,
            status: (None, None),
        }
    }

    /// The endpoints whose engines hold the longest prefix of the request any engine holds, if
    /// that prefix covers at least `cache_threshold` of the request and the index is fresh. A
    /// prefix no engine holds, or a shallow one (a short preamble many groups share), gives none:
    /// the request is placed as without the index.
    pub fn lookup(&mut self, input: &Input) -> Option<Held> {
        let now = input.now_ms;
        let cached = &mut self.status;
        if cached
            .1
            .is_none_or(|at| now.saturating_sub(at) >= STATUS_MS)
        {
            *cached = (Status::read(input.store), Some(now));
        }
        let status = cached
            .0
            .as_ref()
            .filter(|s| s.fresh(now, self.max_age_ms))?;
        let keys = &input.keys.keys;
        let index = EngineIndex::new(input.store, self.capacity);
        let held = index.as_of(status).longest_match(keys, 0)?;
        ((held.depth as f64) >= self.cache_threshold * keys.len() as f64).then_some(held)
    }
}

/// The endpoint precise mode sends the request to instead of `placed`, the one the stages picked
/// without the engine index, when the engines hold the request's longest prefix (`held`):
/// `placed` itself if it is a holder; else the least loaded holder (ties to the earliest in the
/// group's order)
/// if its load (running and waiting) is within `placed`'s band. A hit saves the request's
/// prefill, which is worth some wait, not any wait, and how much depends on what it saves:
/// - a conversation's history is the request's alone, and nowhere else can it be had without
///   computing it again: its holder keeps it within `rel` × `placed`'s load + `abs`;
/// - a group's head is one prefill away on its home, where placement puts the group (or, where
///   the group is split, this conversation): its holder keeps it only within `abs` of `placed`'s
///   load, so a group first served where the balanced assignment would not put it moves home
///   once its traffic weighs on that holder, and a split group's conversations reach their homes.
pub fn instead_of(placed: usize, held: &Held, s: &Scoring, band: &OverloadBound) -> Option<usize> {
    let candidates = s.candidates;
    let holds = |i: usize| held.holders.contains(&candidates[i].id);
    if holds(placed) {
        return Some(placed);
    }
    let load = |i: usize| candidates[i].load as f64;
    let holder = (s.order)
        .iter()
        .copied()
        .filter(|&i| holds(i))
        .min_by_key(|&i| candidates[i].load)?;
    let history = held.depth > s.input.keys.head_chunks;
    let rel = if history { band.rel } else { 1.0 };
    (load(holder) <= rel * load(placed) + band.abs as f64).then_some(holder)
}
