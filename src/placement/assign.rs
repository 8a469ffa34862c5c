//! The balanced assignment: each group's home among the endpoints, the same at every gateway that
//! has seen the same groups.

use std::collections::VecDeque;

use hashbrown::HashMap;

use super::weights::MEAN_WEIGHT;
use crate::rendezvous;

/// Each group's home among `endpoints` (ids): groups (key, weight) fill endpoints up to
/// ceil(total weight of the groups of at least the mean's weight, plus the rarer ones' in whole
/// means, / endpoints) rounded up to whole mean groups, each as high in its rendezvous order as
/// that allows; an endpoint always keeps the group that ranks it highest, however heavy.
/// Independent of the order of `groups`.
pub fn assign(groups: &[(u64, u32)], endpoints: &[u32]) -> HashMap<u64, u32> {
    let mut homes = HashMap::new();
    if endpoints.is_empty() {
        return homes;
    }
    let mut groups = groups.to_vec();
    groups.sort_unstable();
    // The room is what the groups of at least the mean's weight need, plus the whole means the
    // rare ones add up to, in whole means: a rare group (a one-off prompt one gateway saw, a
    // group on its way in or out) ranks below every other and takes what room is left, so
    // whether a gateway counts it moves no other group, while the long tail of a skewed fleet
    // (a Zipf tail weighing a quarter to a half of the mean each) is room the others leave it,
    // which moves less as its groups step in and out of the band around the mean.
    // Whole means, so that a hot group's count moving by a few percent rarely changes it.
    // (Where no group weighs the mean, every group counts.)
    let weights = || groups.iter().map(|&(_, w)| u64::from(w));
    let rare = weights().filter(|&w| w < MEAN_WEIGHT).sum::<u64>();
    let total = match weights().filter(|&w| w >= MEAN_WEIGHT).sum::<u64>() {
        0 => weights().sum(),
        counted => counted + rare / MEAN_WEIGHT * MEAN_WEIGHT,
    };
    let capacity = total.div_ceil(endpoints.len() as u64).div_ceil(MEAN_WEIGHT) * MEAN_WEIGHT;
    let orders: Vec<Vec<usize>> = groups
        .iter()
        .map(|&(g, _)| rendezvous::order(g, endpoints))
        .collect();
    // How an endpoint ranks a group: heavier first (light ones are easier to place elsewhere),
    // then by the group's rendezvous weight for it, then by key.
    let rank = |g: usize, e: usize| {
        let (key, w) = groups[g];
        (w, rendezvous::weight(key, endpoints[e]), key)
    };
    let mut next = vec![0usize; groups.len()];
    let mut held: Vec<Vec<usize>> = vec![Vec::new(); endpoints.len()];
    let mut load = vec![0u64; endpoints.len()];
    let mut free: VecDeque<usize> = (0..groups.len()).collect();
    while let Some(g) = free.pop_front() {
        // Refused everywhere (the room it needed went to heavier or better-ranked groups): the
        // least-loaded endpoint, earliest in its order among equals, takes it.
        let e = match orders[g].get(next[g]) {
            Some(&e) => e,
            None => {
                let e = orders[g]
                    .iter()
                    .copied()
                    .enumerate()
                    .min_by_key(|&(rank, e)| (load[e], rank))
                    .map_or(0, |(_, e)| e);
                held[e].push(g);
                load[e] += u64::from(groups[g].1);
                continue;
            }
        };
        next[g] += 1;
        held[e].push(g);
        load[e] += u64::from(groups[g].1);
        held[e].sort_unstable_by_key(|&h| std::cmp::Reverse(rank(h, e)));
        // Refuse the lowest-ranked groups while over capacity, keeping the best one.
        while load[e] > capacity && held[e].len() > 1 {
            if let Some(worst) = held[e].pop() {
                load[e] -= u64::from(groups[worst].1);
                free.push_back(worst);
            }
        }
    }
    // Capacity bounds the busiest endpoint, not the idlest: 6 groups on 4 endpoints may settle
    // as 2, 2, 2, 0. The least-loaded endpoint takes the lowest-ranked group of the most-loaded
    // one while that evens them out (each move lowers the sum of squared loads, so it ends).
    loop {
        let lo = (0..endpoints.len())
            .min_by_key(|&e| (load[e], e))
            .unwrap_or(0);
        let hi = (0..endpoints.len())
            .filter(|&e| held[e].len() > 1)
            .max_by_key(|&e| (load[e], std::cmp::Reverse(e)));
        let Some(hi) = hi else { break };
        let Some(&g) = held[hi].last() else { break };
        let w = u64::from(groups[g].1);
        if load[lo] + w >= load[hi] {
            break;
        }
        held[hi].pop();
        load[hi] -= w;
        held[lo].push(g);
        load[lo] += w;
    }
    for (e, gs) in held.iter().enumerate() {
        for &g in gs {
            homes.insert(groups[g].0, endpoints[e]);
        }
    }
    homes
}
