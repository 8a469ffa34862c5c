//! Precise mode's signal: which endpoints' engines hold the longest prefix of a request, from the
//! engine index ([`engine_index`](crate::engine_index)), and the scorer that prefers them.

use std::cell::RefCell;

use crate::engine_index::{EngineIndex, Status};
use crate::policy::pipeline::{Scorer, Scoring};
use crate::policy::OverloadBound;
use crate::policy::{Candidate, Decision, Input};

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

    /// The endpoints whose engines hold the longest prefix of the request any engine holds, if
    /// that prefix covers at least `cache_threshold` of the request and the index is fresh. A
    /// prefix no engine holds, or a shallow one (a short preamble many groups share), gives none:
    /// the request is placed as without the index.
    pub fn lookup(&self, input: &Input) -> Option<Vec<u32>> {
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
        let (depth, holders) =
            EngineIndex::new(input.store, self.capacity).longest_match(keys, status)?;
        ((depth as f64) >= self.cache_threshold * keys.len() as f64).then_some(holders)
    }
}

/// 1 for an endpoint whose engine holds the request's longest engine-held prefix
/// ([`EngineHolders::lookup`]) and that may take the group's request; 0 for the others. Its weight
/// outranks a history holder and a home together: what the engines hold comes before what this
/// gateway remembers. But placement owns where a group lives: a holder other than the group's home
/// counts only while its load is within the home's band: at most `rel` times the home's load plus
/// `abs` (the overload bound's terms, over the home's load rather than the fleet's mean), or the
/// home queues. So a group first placed where the balanced assignment would not put it moves home
/// once its traffic weighs on that holder, rather than staying wherever it landed first, and does
/// not move for the swings of a fleet's load from one request to the next.
pub struct EngineHolder {
    pub band: OverloadBound,
}

impl EngineHolder {
    /// Whether candidate `i` is the group's home or within its load band.
    fn may_take(&self, s: &Scoring, i: usize) -> bool {
        let Some(home) = s.order.first().map(|&h| &s.candidates[h]) else {
            return true;
        };
        let c = &s.candidates[i];
        c.id == home.id || home.queueing || within(&self.band, c, home)
    }
}

/// Whether `c`'s load is within `other`'s band (`rel` × its load + `abs`), queueing only where
/// `other` queues too.
fn within(band: &OverloadBound, c: &Candidate, other: &Candidate) -> bool {
    (other.queueing || !c.queueing)
        && c.load as f64 <= band.rel * other.load as f64 + band.abs as f64
}

/// With every endpoint overloaded, the least loaded of the endpoints whose engines hold the
/// request's prefix, if it is within the band of `least`, the least loaded of all: a hit there
/// saves the prefill the request would queue for anywhere else.
pub fn holder_over_balance(s: &Scoring, least: usize, band: &OverloadBound) -> Option<usize> {
    let holders = s.engine_holders?;
    s.order
        .iter()
        .copied()
        .filter(|&i| holders.contains(&s.candidates[i].id))
        .min_by_key(|&i| (s.candidates[i].queueing, s.candidates[i].load))
        .filter(|&i| within(band, &s.candidates[i], &s.candidates[least]))
}

impl Scorer for EngineHolder {
    fn weight(&self) -> f64 {
        4.0
    }

    fn score(&self, s: &Scoring, i: usize) -> f64 {
        let held = s
            .engine_holders
            .is_some_and(|h| h.contains(&s.candidates[i].id));
        if held && self.may_take(s, i) {
            1.0
        } else {
            0.0
        }
    }

    fn decision(&self, _s: &Scoring, _i: usize) -> Decision {
        Decision::Engine
    }
}
