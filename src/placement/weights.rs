//! The groups' weights: which groups take a place, and each one's recent requests against the
//! mean group's, in quarters of the mean.

use hashbrown::HashSet;

use super::table::{Seen, HALF_LIFE_MS};
use super::tally::FLUSH_MS;

/// The mean group's weight: weights are in quarters of it.
pub const MEAN_WEIGHT: u64 = 4;
/// The heaviest weight a group can have, in quarters of the mean group.
pub const MAX_WEIGHT: u32 = 256;
/// Counts whose variance is at most this many times their mean spread as equally popular groups'
/// do (a Poisson count's variance is its mean): chance may explain any one of them ([`weight`]).
/// Beyond it the groups are unequal (a Zipf-skewed fleet's counts spread many times more), and
/// a group far below the mean is a rare one, though chance could explain it alone.
pub const EQUAL_SPREAD: f64 = 2.0;
/// Below this mean count per group a gateway takes every spread for chance: counts so small (a
/// gateway that sees a share of a fleet's traffic may stay under it for long) tell the rare
/// groups of a skewed fleet apart too unreliably for gateways that each see a share to weigh
/// them alike.
pub const EQUAL_BELOW_MEAN: f64 = 6.0;
/// Requests per group this gateway sees, on average, after a group's only request before it
/// takes that group for a one-off ([`one_offs`]).
pub const ONE_OFF_REPEATS: f64 = 3.0;

/// The groups that take a place at `now_ms` (seen at least `min_requests` times), sorted by key,
/// each with its weight: its recent requests over the mean group's, in quarters of the mean (see
/// [`weight`]).
///
/// A prompt sent once (a one-off) is no group, but a gateway with a share of the traffic counts a
/// group from its first request, so it cannot tell a one-off from an average group it has seen
/// once so far; it drops such a group once it is more likely a one-off ([`one_offs`]).
/// `seeing_ms` is how long this gateway has been counting.
pub fn weighted(seen: &[Seen], now_ms: u64, min_requests: f32, seeing_ms: u64) -> Vec<(u64, u32)> {
    let mut counted: Vec<&Seen> = seen
        .iter()
        .filter(|s| s.takes_place(now_ms, min_requests))
        .collect();
    let dropped = one_offs(&counted, now_ms, seeing_ms);
    counted.retain(|s| !dropped.contains(&s.key));
    let counted: Vec<(u64, f64)> = counted
        .iter()
        .map(|s| (s.key, s.requests_at(now_ms)))
        .collect();
    let n = counted.len().max(1) as f64;
    let mean = counted.iter().map(|(_, r)| r).sum::<f64>() / n;
    let variance = counted.iter().map(|(_, r)| (r - mean).powi(2)).sum::<f64>() / n;
    let alike = mean < EQUAL_BELOW_MEAN || variance <= EQUAL_SPREAD * mean;
    let mut out: Vec<(u64, u32)> = counted
        .into_iter()
        .map(|(g, r)| (g, weight(r, mean, alike)))
        .collect();
    out.sort_unstable();
    out
}

/// The groups among `counted` seen only once that are taken for one-offs: each one this gateway
/// has since seen [`ONE_OFF_REPEATS`] requests per group without seeing it again (an average group
/// goes that long unseen one time in 20), and all of them where there are more of them than
/// groups as popular as the mean would leave seen once by chance (a fleet with many one-offs).
/// Counted as average groups, a single prompt one gateway alone saw would take a place there
/// that the other gateways do not give it, and change the room every endpoint has at that one.
fn one_offs(counted: &[&Seen], now_ms: u64, seeing_ms: u64) -> HashSet<u64> {
    let once = |s: &&&Seen| s.requests <= 1.0;
    let n = counted.len().max(1) as f64;
    let volume: f64 = counted.iter().map(|s| s.requests_at(now_ms)).sum();
    // Requests per ms lately: the decayed volume over the time it covers (a second at least).
    let window = (seeing_ms.max(FLUSH_MS) as f64).min(HALF_LIFE_MS as f64 / std::f64::consts::LN_2);
    let per_group = volume / window / n;
    let stale: HashSet<u64> = counted
        .iter()
        .filter(once)
        .filter(|s| per_group * now_ms.saturating_sub(s.last_ms) as f64 >= ONE_OFF_REPEATS)
        .map(|s| s.key)
        .collect();
    let more: Vec<f64> = counted
        .iter()
        .filter(|s| !once(s))
        .map(|s| s.requests_at(now_ms))
        .collect();
    let singles = counted.iter().filter(once).count() - stale.len();
    if more.is_empty() || singles == 0 {
        return stale;
    }
    let mean = more.iter().sum::<f64>() / more.len() as f64;
    let chance = (counted.len() - stale.len()) as f64 * (-mean).exp() * (1.0 + mean);
    if singles as f64 > chance + 2.0 * chance.sqrt() + 1.0 {
        counted.iter().filter(once).map(|s| s.key).collect()
    } else {
        stale
    }
}

/// The weights `next`, except that a group which weighed at least the mean in `previous` and
/// still does keeps its previous weight while it moved by one mean at most. A hot group's count
/// wanders around the boundary between two whole means as requests come and decay, and each step
/// across it changes the room its endpoint leaves to the others, moving the group that was
/// last in line there and back again; a step of two means is a change in popularity, not noise. Both sides sorted by key.
pub fn steady(previous: &[(u64, u32)], mut next: Vec<(u64, u32)>) -> Vec<(u64, u32)> {
    let mean = MEAN_WEIGHT as u32;
    for (group, w) in next.iter_mut() {
        if let Ok(i) = previous.binary_search_by_key(group, |&(g, _)| g) {
            let before = previous[i].1;
            if before >= mean && *w >= mean && before.abs_diff(*w) <= mean {
                *w = before;
            }
        }
    }
    next
}

/// A group's recent requests `r`, against the mean group's, as a weight in quarters of the mean
/// group. A group weighs 4 (the mean) while it is within 0.5–2× the mean, or, while the counts
/// spread `alike` (as equally popular groups' do, or are too few to tell: [`EQUAL_SPREAD`],
/// [`EQUAL_BELOW_MEAN`]), within what chance alone moves a count by (3 standard deviations of a
/// Poisson count with the mean's expectation) and seen more than once lately (a count above 1: one
/// request never decays to more, and two seen a while ago may have decayed below [`MIN_REQUESTS`](super::MIN_REQUESTS))
/// or at a mean so small that a mean group is often seen only once ([`once_is_chance`]): the
/// ordinary ups and downs of equally popular groups, which each gateway counts a little
/// differently, move nothing, and a gateway that has seen few requests, whose counts are all noise,
/// weighs every group alike. (A prompt seen once among groups of several requests each is no such
/// chance: a one-off one gateway saw stays a rare group there, instead of changing the room of
/// every endpoint at that gateway alone.) Beyond both a group weighs what it is worth (a group with
/// 9× the mean's traffic takes the room of nine, a rare one a quarter), so the endpoint that homes
/// a hot group takes few others, the rare groups of a skewed fleet are not taken for average ones
/// (which would make the room larger than the traffic, and leave a busy group room beside the
/// hottest), and the traffic stays balanced. A hot group weighs
/// whole means: its count grows and decays a little between any two ticks, and each quarter it
/// gained or lost would change the room it leaves to the others on its endpoint, and so move one of
/// them, losing its prefix.
pub(super) fn weight(r: f64, mean: f64, alike: bool) -> u32 {
    let mean = mean.max(f64::MIN_POSITIVE);
    let popularity = r / mean;
    let mean_weight = MEAN_WEIGHT as f64;
    let chance =
        alike && (r > 1.0 || once_is_chance(mean)) && (r - mean).abs() <= 3.0 * mean.sqrt();
    let w = if (0.5..2.0).contains(&popularity) || chance {
        mean_weight
    } else if popularity > 1.0 {
        mean_weight * popularity.round()
    } else {
        (mean_weight * popularity).round()
    };
    w.clamp(1.0, f64::from(MAX_WEIGHT)) as u32
}

/// Whether a group as popular as the mean would be seen at most once lately at least one time in
/// 20 (a Poisson count with the mean's expectation; true below a mean of about 4.7). A gateway
/// that sees a third of the traffic counts groups of a request every few seconds a few requests
/// each for its first 20 s: there, a group it has seen once is as likely an average group as a
/// rare one, and the other gateways, which saw two of it, weigh it the mean.
pub(super) fn once_is_chance(mean: f64) -> bool {
    (-mean).exp() * (1.0 + mean) >= 0.05
}
