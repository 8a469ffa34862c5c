//! The splits: groups that span several endpoints where whole groups cannot even them out, and
//! which of a split group's homes a conversation goes to.

use hashbrown::HashMap;

use super::assign::assign;
use super::weights::MEAN_WEIGHT;

/// Each group's homes with their shares of its weight, largest first: a group spans several
/// endpoints only where that evens the fleet out ([`shares`]).
pub type Shares = HashMap<u64, Vec<(u32, u64)>>;

/// Shares are finer than weights: sixteenths of the mean group.
pub const SHARE_UNITS: u64 = 4;

/// [`assign`], evened out by splitting groups. Whole groups can leave endpoints uneven however
/// they are placed: 6 equal groups on 4 endpoints sit 2, 2, 1, 1, and a group with 9× the mean's
/// traffic outweighs its endpoint's share, and one lone group is all the traffic. While the
/// busiest endpoint carries more than a quarter of an even share over the idlest (and more than
/// one mean group, unless that is over a third of an even share), half the gap moves from its
/// largest part to the idlest; that group's conversations then split between the two by a hash
/// of their opening message, which every gateway computes alike. Only as many groups span
/// endpoints as evening out takes: groups that already even out stay whole. The gap of one mean
/// group that whole groups leave stays unsplit from three groups per endpoint on: 15 equal
/// groups on 4 endpoints sit 4, 4, 4, 3 (27% of an even share), which is what a gateway that
/// has not yet seen one of 16 groups computes; splitting there would give that gateway other
/// homes for some groups, where the others, which saw all 16, split nothing.
pub fn shares(groups: &[(u64, u32)], endpoints: &[u32]) -> Shares {
    let homes = assign(groups, endpoints);
    let n = endpoints.len();
    let mut parts: Vec<Vec<(u64, u64)>> = vec![Vec::new(); n];
    let mut sorted = groups.to_vec();
    sorted.sort_unstable();
    for (g, w) in sorted {
        if let Some(e) = homes
            .get(&g)
            .and_then(|h| endpoints.iter().position(|e| e == h))
        {
            parts[e].push((g, u64::from(w) * SHARE_UNITS));
        }
    }
    let mut load: Vec<u64> = parts.iter().map(|p| p.iter().map(|x| x.1).sum()).collect();
    let even = load.iter().sum::<u64>() / n.max(1) as u64;
    let slack = (even / 4)
        .max((even / 3).min(MEAN_WEIGHT * SHARE_UNITS))
        .max(1);
    // Each move lowers the sum of squared loads; the bound only guards against a bug.
    for _ in 0..4 * n + groups.len() {
        let lo = (0..n).min_by_key(|&e| (load[e], e)).unwrap_or(0);
        let hi = (0..n)
            .max_by_key(|&e| (load[e], std::cmp::Reverse(e)))
            .unwrap_or(0);
        let gap = load[hi] - load[lo];
        if gap <= slack {
            break;
        }
        let Some(at) = (0..parts[hi].len())
            .max_by_key(|&i| (parts[hi][i].1, std::cmp::Reverse(parts[hi][i].0)))
        else {
            break;
        };
        let (g, share) = parts[hi][at];
        let moved = (gap / 2).min(share);
        if moved == share {
            parts[hi].remove(at);
        } else {
            parts[hi][at].1 -= moved;
        }
        match parts[lo].iter_mut().find(|p| p.0 == g) {
            Some(p) => p.1 += moved,
            None => parts[lo].push((g, moved)),
        }
        load[hi] -= moved;
        load[lo] += moved;
    }
    let mut out: Shares = HashMap::new();
    for (e, ps) in parts.iter().enumerate() {
        for &(g, share) in ps {
            out.entry(g).or_default().push((endpoints[e], share));
        }
    }
    // The home `assign` gave comes first among equal shares.
    for (g, parts) in out.iter_mut() {
        let home = homes.get(g).copied();
        parts.sort_unstable_by_key(|&(e, share)| (std::cmp::Reverse(share), Some(e) != home, e));
    }
    out
}

/// The home of a group's conversation among its `homes`: each takes the conversations whose
/// hash falls in its share.
pub fn home_of(homes: &[(u32, u64)], conversation: u64) -> Option<u32> {
    let total: u64 = homes.iter().map(|h| h.1).sum();
    let mut point = ((u128::from(conversation) * u128::from(total)) >> 64) as u64;
    for &(e, share) in homes {
        if point < share {
            return Some(e);
        }
        point -= share;
    }
    homes.first().map(|h| h.0)
}
