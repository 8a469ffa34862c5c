//! cache_aware's stages: the load guardrail as a filter, the prefix's holders and the group's
//! home as scorers, the engines' holders (precise mode) as a reviser. The holder scorer's weight
//! outranks any home score, so the pick is the cascade: a holder of the request's history if one
//! is kept, else the first kept endpoint in the group's order (its home first), else, with every
//! endpoint overloaded, the policy's fallback; then, in precise mode, an engine that holds more.

use super::engine_prefix;
use crate::policy::load::OverloadBound;
use crate::policy::pipeline::{Filter, Reviser, Scorer, Scoring};
use crate::policy::Decision;

/// Drops overloaded endpoints: an engine that queues, or a load above the bound over the mean.
pub struct NotOverloaded(pub OverloadBound);

impl Filter for NotOverloaded {
    fn keeps(&self, s: &Scoring, i: usize) -> bool {
        !self.0.overloaded(&s.candidates[i], s.mean_load)
    }
}

/// 1 for an endpoint that holds the request's history (a matched prefix past its head covering at
/// least `cache_threshold` of its chunks) and likely still keeps it (its engine has not written
/// its free cache over since); 0 for the others. A match within the head is the group's own
/// prefix: its place is the group's home, the same for every gateway.
pub struct HistoryHolder {
    pub cache_threshold: f64,
}

impl Scorer for HistoryHolder {
    fn weight(&self) -> f64 {
        2.0
    }

    fn score(&self, s: &Scoring, i: usize) -> f64 {
        let Some(m) = s.matched else {
            return 0.0;
        };
        let keys = s.input.keys;
        let chunks = keys.keys.len();
        if m.depth <= keys.head_chunks || (m.depth as f64) < self.cache_threshold * chunks as f64 {
            return 0.0;
        }
        let c = &s.candidates[i];
        let kept = m
            .stamp_ms
            .is_none_or(|stamp| c.keeps(stamp, s.input.now_ms));
        let holds = m.holders.contains(&c.id) && kept;
        if holds {
            1.0
        } else {
            0.0
        }
    }

    fn decision(&self, _s: &Scoring, _i: usize) -> Decision {
        Decision::Affinity
    }
}

/// How early the endpoint comes in the group's order, its home first: 1 for the home, down to
/// 1/n for the last of n.
pub struct GroupHome;

impl Scorer for GroupHome {
    fn weight(&self) -> f64 {
        1.0
    }

    fn score(&self, s: &Scoring, i: usize) -> f64 {
        let n = s.order.len();
        let rank = s.order.iter().position(|&o| o == i).unwrap_or(n);
        (n - rank) as f64 / n.max(1) as f64
    }

    fn decision(&self, s: &Scoring, i: usize) -> Decision {
        if s.order.first() == Some(&i) {
            Decision::Home
        } else {
            Decision::Spread
        }
    }
}

/// Precise mode: the request goes where the engines report holding its longest prefix, if that
/// endpoint is within the band of the pick ([`engine_prefix::instead_of`]).
pub struct EngineHolder(pub OverloadBound);

impl Reviser for EngineHolder {
    fn revise(&self, s: &Scoring, picked: usize) -> Option<(usize, Decision)> {
        let held = s.engine?;
        let holder = engine_prefix::instead_of(picked, held, s, &self.0)?;
        Some((holder, Decision::Engine))
    }
}
