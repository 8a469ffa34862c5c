//! Load comparisons shared by the policies: when an endpoint counts as overloaded, and the
//! least-loaded pick with a deterministic tie-break.

use super::Candidate;
use crate::rendezvous;

/// SGLang's balance thresholds: an endpoint is overloaded when its load exceeds the least-loaded
/// endpoint's by more than `abs` requests AND by more than `rel` times.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Thresholds {
    pub abs: u64,
    pub rel: f64,
}

impl Thresholds {
    pub fn overloaded(&self, load: u64, min: u64) -> bool {
        load.saturating_sub(min) > self.abs && load as f64 > self.rel * min as f64
    }

    /// Whether the fleet as a whole is imbalanced: its busiest endpoint is overloaded.
    pub fn imbalanced(&self, candidates: &[Candidate]) -> bool {
        let max = candidates.iter().map(|c| c.load).max().unwrap_or(0);
        self.overloaded(max, min_load(candidates))
    }
}

pub fn min_load(candidates: &[Candidate]) -> u64 {
    candidates.iter().map(|c| c.load).min().unwrap_or(0)
}

/// Candidate indices in `key`'s rendezvous order.
pub fn rendezvous_order(candidates: &[Candidate], key: u64) -> Vec<usize> {
    let ids: Vec<u32> = candidates.iter().map(|c| c.id).collect();
    rendezvous::order(key, &ids)
}

/// The least-loaded candidate; among equals, the one with the fewest recent new prefixes, then the
/// first in `key`'s rendezvous order, so that independent proxies seeing the same state make the
/// same choice.
pub fn least_loaded(candidates: &[Candidate], key: u64) -> usize {
    rendezvous_order(candidates, key)
        .into_iter()
        .enumerate()
        .min_by_key(|&(rank, i)| (candidates[i].load, candidates[i].placed, rank))
        .map_or(0, |(_, i)| i)
}

/// Where a new prefix goes on a balanced fleet: among the endpoints that are not overloaded, the
/// one with the fewest recently placed prefixes (SGLang's "smallest tree": room in its cache),
/// then the least loaded, then the first in `key`'s rendezvous order, so that independent
/// proxies seeing the same state make the same choice.
pub fn fewest_placed(candidates: &[Candidate], key: u64, t: &Thresholds) -> usize {
    let min = min_load(candidates);
    rendezvous_order(candidates, key)
        .into_iter()
        .enumerate()
        .filter(|&(_, i)| !t.overloaded(candidates[i].load, min))
        .min_by_key(|&(rank, i)| (candidates[i].placed, candidates[i].load, rank))
        .map_or_else(|| least_loaded(candidates, key), |(_, i)| i)
}

/// The first candidate in `key`'s rendezvous order that is not overloaded (bounded-load hashing).
pub fn first_not_overloaded(candidates: &[Candidate], key: u64, t: &Thresholds) -> usize {
    let min = min_load(candidates);
    rendezvous_order(candidates, key)
        .into_iter()
        .find(|&i| !t.overloaded(candidates[i].load, min))
        .unwrap_or_else(|| least_loaded(candidates, key))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::candidates;

    #[test]
    fn overload_needs_both_the_absolute_and_the_relative_gap() {
        let t = Thresholds { abs: 64, rel: 1.5 };
        assert!(!t.overloaded(100, 40), "gap 60 is within abs");
        assert!(!t.overloaded(300, 210), "ratio 1.43 is within rel");
        assert!(t.overloaded(300, 100));
        assert!(t.overloaded(65, 0));
    }

    #[test]
    fn least_loaded_breaks_ties_by_rendezvous_and_otherwise_takes_the_minimum() {
        let c = candidates(&[3, 1, 1, 5]);
        for key in 0..20 {
            assert!([1, 2].contains(&least_loaded(&c, key)));
        }
        let picks: std::collections::HashSet<usize> =
            (0..50).map(|k| least_loaded(&c, k)).collect();
        assert_eq!(picks.len(), 2, "both tied endpoints get keys");
    }
}
