//! kvroute's policy: every gateway sends a request's group to the same home, and a hot group
//! overflows along the same path, without talking to the others.
//!
//! A request's group is its head (tools and system prompt, or first message) hashed
//! ([`PrefixKeys::group`](crate::prefix::PrefixKeys)); its endpoints are ranked by rendezvous on
//! that key, and its home is the first of them, or, once this gateway has been up a little while,
//! its place in the balanced assignment of the groups it has seen ([`group_home`]), which
//! gateways that saw the same groups compute alike (where that splits the group, the home its
//! conversation's hash falls to). Overload is judged from the engines' own reports, the same at
//! every gateway. The policy is stages ([`pipeline`](crate::policy::pipeline), [`stages`]):
//!
//! - overloaded endpoints (the engine queues, or the load exceeds `rel` × the mean + `abs`) are
//!   filtered out;
//! - a prefix of the request that reaches past its head (a conversation's history) and that the
//!   prefix index ([`prefix_index`]) says an endpoint holds, if it covers at least
//!   `cache_threshold` of the request: its first holder in the group's order that used it within
//!   its engine's retention ([`retention`](crate::retention)) (`affinity`);
//! - else the group's home (`home`), or, overloaded, the next endpoint in its order (`spread`),
//!   so a hot group grows onto a few replicas, always the same ones, and comes back home when it
//!   drains;
//! - every endpoint overloaded: the least loaded (`balance`);
//! - in precise mode, last, a reviser ([`stages::EngineHolder`]): where the engines report
//!   holding the request's longest prefix and the pick's engine is not a holder, instead of that
//!   pick the least-loaded holder, if the prefix covers at least `cache_threshold` of the
//!   request, the engine index is fresh, and its load is within the pick's band: `rel` × the
//!   pick's load + `abs` for a conversation's history, the pick's load + `abs` for a group's head
//!   ([`engine_prefix`]; `engine`).
//!
//! The prefix index records which endpoint served which prefix, settled by the engines' reports
//! once each response is in ([`PrefixIndex::answered`]), from what the request's [`Ticket`]
//! kept ([`Pending`]).

mod engine_prefix;
mod group_home;
mod prefix_index;
mod stages;
#[cfg(test)]
mod tests;

pub use engine_prefix::EngineHolders;
pub use group_home::GroupHomes;
pub use prefix_index::{AffinityIndex, Found, PrefixIndex, REFRESH_MS};

use super::load::{least_loaded, mean_load, rendezvous_order, OverloadBound};
use super::pipeline::{self, Filter, Reviser, Scorer, Scoring};
use super::{Answer, Candidate, Decision, Input, Pick, Policy, Settled, Ticket};
use crate::eviction::Predicted;
use crate::holders::Held;
use crate::store::SharedStore;

/// Poll intervals (`stats_interval_ms`) a gateway waits, seeing groups, before it places them
/// by the balanced assignment rather than by their first rendezvous choice.
pub const WARMUP_POLLS: u64 = 10;

/// Poll intervals the balanced assignment must keep giving a group a new home before the group
/// moves there ([`homes`](crate::placement::homes)).
pub const HOLD_POLLS: u64 = 4;

pub struct CacheAware {
    index: Box<dyn PrefixIndex>,
    /// What the engines hold, in precise mode.
    engine: Option<EngineHolders>,
    homes: GroupHomes,
    filters: Vec<Box<dyn Filter>>,
    scorers: Vec<Box<dyn Scorer>>,
    revisers: Vec<Box<dyn Reviser>>,
    overload: OverloadBound,
}

/// What cache_aware keeps of a request in its [`Ticket`]: what its lookup found, for
/// [`Policy::routed`], and what it predicted the chosen endpoint held, for [`Policy::answered`].
#[derive(Debug)]
pub struct Pending {
    found: Found,
    predicted: Predicted,
}

impl CacheAware {
    /// The policy over an affinity map of `capacity` slots (whose records an engine's report
    /// may show evicted however young: [`with_index`](Self::with_index) sets another index).
    pub fn new(
        capacity: u32,
        cache_threshold: f64,
        overload: OverloadBound,
        warmup_ms: u64,
        hold_ms: u64,
    ) -> Self {
        CacheAware {
            index: Box::new(AffinityIndex::new(capacity, 0)),
            engine: None,
            homes: GroupHomes::new(warmup_ms, hold_ms),
            filters: vec![Box::new(stages::NotOverloaded(overload))],
            scorers: vec![
                Box::new(stages::HistoryHolder { cache_threshold }),
                Box::new(stages::GroupHome),
            ],
            revisers: Vec::new(),
            overload,
        }
    }

    /// Precise mode: sends a request where the engines hold its longest prefix, if that endpoint
    /// is within the band of the one the stages pick ([`stages::EngineHolder`]).
    pub fn with_engine_index(mut self, engine: EngineHolders) -> Self {
        self.engine = Some(engine);
        self.revisers
            .push(Box::new(stages::EngineHolder(self.overload)));
        self
    }

    /// Uses `index` as the prefix index.
    pub fn with_index(mut self, index: Box<dyn PrefixIndex>) -> Self {
        self.index = index;
        self
    }
}

/// Leading chunks of the request `c` is known to hold: the affinity map's longest match if it
/// served it (`served`), the engines' longest held prefix if its engine reports it, the deeper.
fn held_chunks(c: &Candidate, served: Option<&Held>, engine: Option<&Held>) -> usize {
    let reported = engine.filter(|e| e.holders.contains(&c.id));
    served
        .map_or(0, |m| m.depth)
        .max(reported.map_or(0, |e| e.depth))
}

impl Policy for CacheAware {
    fn pick(&mut self, candidates: &[Candidate], input: &Input) -> Option<Pick> {
        let found = self.index.lookup(input);
        let held = self.engine.as_mut().and_then(|e| e.lookup(input));
        let group = input.keys.group;
        let mut order = rendezvous_order(candidates, group);
        let home = self
            .homes
            .home(candidates, input.keys, &order, input.now_ms);
        if let Some(at) = order.iter().position(|&i| i == home) {
            order[..=at].rotate_right(1);
        }
        let matched = found.matched.as_ref();
        let scoring = Scoring {
            candidates,
            input,
            order: &order,
            matched,
            engine: held.as_ref(),
            mean_load: mean_load(candidates),
        };
        let placed = pipeline::pick(&scoring, &self.filters, &self.scorers)
            .unwrap_or_else(|| (least_loaded(candidates, group), Decision::Balance));
        let (index, decision) = pipeline::revise(&scoring, placed, &self.revisers);
        let chosen = &candidates[index];
        let served = matched.filter(|m| m.holders.contains(&chosen.id));
        let chunks = held_chunks(chosen, served, held.as_ref());
        let predicted = Predicted {
            held: served.map_or(0, |m| m.depth),
            stamp_ms: served.and_then(|m| m.stamp_ms).unwrap_or(0),
            prompt_bytes: input.prompt_bytes,
            chunk_size: input.chunk_size,
            routed_ms: input.now_ms,
        };
        let chunks_total = input.keys.keys.len().max(1);
        let match_fraction = matched.map(|m| m.depth as f64 / chunks_total as f64);
        Some(Pick {
            index,
            decision,
            held_bytes: (chunks * input.chunk_size).min(input.prompt_bytes),
            match_fraction,
            ticket: Ticket(Some(Pending { found, predicted })),
        })
    }

    fn routed(&mut self, candidates: &[Candidate], input: &Input, pick: &Pick) -> usize {
        self.homes
            .count(input.store, input.keys.group, input.now_ms);
        let Some(pending) = &pick.ticket.0 else {
            return 0;
        };
        let chosen = candidates[pick.index].id;
        self.index.routed(input, &pending.found, chosen)
    }

    fn tick(&mut self, store: &dyn SharedStore, now_ms: u64, completed: &[(&str, f64)]) -> usize {
        self.homes.tick(store, now_ms, completed)
    }

    fn answered(&self, store: &dyn SharedStore, ticket: Ticket, answer: &Answer) -> Settled {
        match ticket.0 {
            Some(pending) => self.index.answered(store, &pending.predicted, answer),
            None => Settled::default(),
        }
    }
}
