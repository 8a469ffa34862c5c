//! Precise mode's signal: how much of a request each endpoint's engine holds, from the engine
//! index ([`engine_index`](crate::engine_index)), and where that sends the request.

use std::cell::RefCell;

use crate::affinity::Match;
use crate::engine_index::{EngineIndex, Status};
use crate::policy::OverloadBound;
use crate::policy::{Candidate, Input};

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
    status: RefCell<(Option<Status>, Option<u64>)>,
}

impl EngineHolders {
    pub fn new(capacity: u32, max_age_ms: u64, cache_threshold: f64) -> Self {
        EngineHolders {
            capacity,
            max_age_ms,
            cache_threshold,
            status: RefCell::new((None, None)),
        }
    }

    /// How many of the request's leading chunk keys each candidate holds, while the index is
    /// fresh: what its engine reports, or, where this gateway sent a deeper prefix there so lately
    /// (within the index's `max_age_ms`) that the engine may not have reported it yet (`sent`,
    /// from the prefix index), that prefix.
    pub fn depths(
        &self,
        input: &Input,
        candidates: &[Candidate],
        sent: Option<&Match>,
    ) -> Option<Depths> {
        let now = input.now_ms;
        let mut cached = self.status.borrow_mut();
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
        let ids: Vec<u32> = candidates.iter().map(|c| c.id).collect();
        let mut held =
            EngineIndex::new(input.store, self.capacity).depths(keys, status, &ids, LEVELS);
        let lately = sent.filter(|m| now.saturating_sub(m.record.stamp_ms) <= self.max_age_ms);
        if let Some(m) = lately {
            for (d, id) in held.iter_mut().zip(&ids) {
                if m.record.holders.contains(id) {
                    *d = (*d).max(m.depth);
                }
            }
        }
        let least = (self.cache_threshold * keys.len() as f64).ceil().max(1.0) as usize;
        Some(Depths { held, least })
    }
}

/// Depths of the longest match [`EngineIndex::depths`] looks for: a request's prefixes are
/// held at few depths (its conversation's history, its group's head, a preamble many share).
const LEVELS: usize = 3;

/// What each candidate holds of a request.
pub struct Depths {
    /// Leading chunk keys held, by candidate.
    pub held: Vec<usize>,
    /// The fewest that count as a hit (`cache_threshold` of the request's keys): less, a short
    /// preamble many groups share, is left to placement.
    pub least: usize,
}

/// Where precise mode sends the request instead of `placed`, the endpoint the stages picked
/// without the engine index: a hit saves the prefill of what the endpoint holds, and is worth
/// at most `band.abs` requests of queue over the least loaded endpoint. Among the endpoints
/// within that load, those holding the most of the request; of them the least loaded (ties to
/// `placed`, then to the earliest in the group's `order`), so the conversations of a group whose
/// head several engines hold spread over them by load. `None` (the stages' pick stands) where
/// none within that load holds at least `depths.least` keys: a new group is placed.
pub fn instead_of(
    placed: usize,
    depths: &Depths,
    candidates: &[Candidate],
    order: &[usize],
    band: &OverloadBound,
) -> Option<usize> {
    let least_load = candidates.iter().map(|c| c.load).min()?;
    let within = |i: &usize| candidates[*i].load <= least_load + band.abs;
    let best = order
        .iter()
        .filter(|i| within(i))
        .map(|&i| depths.held[i])
        .max()?;
    if best < depths.least {
        return None;
    }
    let best_of = |i: &usize| within(i) && depths.held[*i] == best;
    std::iter::once(placed)
        .chain(order.iter().copied())
        .filter(best_of)
        .min_by_key(|&i| candidates[i].load)
}
