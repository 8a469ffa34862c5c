//! Load rules shared by the policies: when an endpoint counts as overloaded, and rendezvous
//! orders with deterministic tie-breaks, so that gateways seeing the same loads choose alike.

use super::Candidate;
use crate::rendezvous;

/// Bounded load: an endpoint is overloaded when its engine queues requests, or when its load
/// exceeds `rel` times the fleet's mean load plus `abs` requests.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OverloadBound {
    pub abs: u64,
    pub rel: f64,
}

impl OverloadBound {
    pub fn overloaded(&self, c: &Candidate, mean: f64) -> bool {
        c.queueing || c.load as f64 > self.rel * mean + self.abs as f64
    }
}

/// The fleet's mean load.
pub fn mean_load(candidates: &[Candidate]) -> f64 {
    let total: u64 = candidates.iter().map(|c| c.load).sum();
    total as f64 / candidates.len().max(1) as f64
}

/// Candidate indices in `key`'s rendezvous order.
pub fn rendezvous_order(candidates: &[Candidate], key: u64) -> Vec<usize> {
    let ids: Vec<u32> = candidates.iter().map(|c| c.id).collect();
    rendezvous::order(key, &ids)
}

/// The least-loaded candidate, queueing ones last; among equals the first in `key`'s rendezvous
/// order.
pub fn least_loaded(candidates: &[Candidate], key: u64) -> usize {
    rendezvous_order(candidates, key)
        .into_iter()
        .enumerate()
        .min_by_key(|&(rank, i)| (candidates[i].queueing, candidates[i].load, rank))
        .map_or(0, |(_, i)| i)
}

/// The first candidate in `order` that is not overloaded, with its rank in the order.
pub fn first_not_overloaded(
    candidates: &[Candidate],
    order: &[usize],
    t: &OverloadBound,
) -> Option<(usize, usize)> {
    let mean = mean_load(candidates);
    order
        .iter()
        .enumerate()
        .find(|&(_, &i)| !t.overloaded(&candidates[i], mean))
        .map(|(rank, &i)| (rank, i))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{candidates, overload};

    #[test]
    fn overload_is_a_queue_or_load_above_the_bound_over_the_mean() {
        let t = OverloadBound { abs: 2, rel: 1.5 };
        let c = candidates(&[1, 1, 1, 9]);
        let mean = mean_load(&c);
        assert_eq!(mean, 3.0);
        assert!(!t.overloaded(&c[0], mean));
        assert!(t.overloaded(&c[3], mean), "9 > 1.5 * 3 + 2");
        let mut queueing = c[0].clone();
        queueing.queueing = true;
        assert!(t.overloaded(&queueing, mean), "a queue, however short");
    }

    #[test]
    fn least_loaded_breaks_ties_by_rendezvous_and_puts_queues_last() {
        let c = candidates(&[3, 1, 1, 5]);
        for key in 0..20 {
            assert!([1, 2].contains(&least_loaded(&c, key)));
        }
        let picks: std::collections::HashSet<usize> =
            (0..50).map(|k| least_loaded(&c, k)).collect();
        assert_eq!(picks.len(), 2, "both tied endpoints get keys");
        let mut c = candidates(&[0, 4]);
        c[0].queueing = true;
        assert_eq!(least_loaded(&c, 1), 1);
    }

    #[test]
    fn the_first_endpoint_not_overloaded_in_order_wins() {
        let c = candidates(&[20, 0, 0, 0]);
        assert_eq!(
            first_not_overloaded(&c, &[0, 2, 1, 3], &overload()),
            Some((1, 2))
        );
        assert_eq!(first_not_overloaded(&c, &[3, 0], &overload()), Some((0, 3)));
        let mut all = candidates(&[1, 1]);
        all.iter_mut().for_each(|c| c.queueing = true);
        assert_eq!(first_not_overloaded(&all, &[0, 1], &overload()), None);
    }
}
