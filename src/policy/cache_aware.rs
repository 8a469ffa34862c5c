//! kvroute's policy: follow the prefix to an endpoint that holds it, unless that builds a hotspot.
//!
//! - Match ≥ `cache_threshold` of the request's chunks: the least-loaded holder of the prefix
//!   (`affinity`); if even that one is overloaded, the first endpoint in the prefix's rendezvous
//!   order that is not (`spread`), so a hot prefix grows onto a few replicas that then also keep
//!   affinity, instead of scattering over all of them.
//! - Otherwise, on a balanced fleet, the endpoint with the fewest recently placed prefixes among
//!   those not overloaded, then the least loaded, then rendezvous on the first chunk, so several
//!   independent proxies place the same new prefix on the same replica (`new_prefix`); on an
//!   imbalanced fleet the least-loaded endpoint (`balance`), as SGLang does.

use super::load::{fewest_placed, first_not_overloaded, least_loaded, min_load};
use super::{Candidate, Decision, Input, Pick};

pub fn pick(candidates: &[Candidate], input: &Input) -> Pick {
    let key = input.keys.placement_key();
    let min = min_load(candidates);
    if let Some(holder) = usable_holder(candidates, input) {
        if !input.thresholds.overloaded(candidates[holder].load, min) {
            return Pick {
                index: holder,
                decision: Decision::Affinity,
            };
        }
        let index = first_not_overloaded(candidates, key, &input.thresholds);
        return Pick {
            index,
            decision: Decision::Spread,
        };
    }
    if input.thresholds.imbalanced(candidates) {
        let index = least_loaded(candidates, key);
        return Pick {
            index,
            decision: Decision::Balance,
        };
    }
    let index = fewest_placed(candidates, key, &input.thresholds);
    Pick {
        index,
        decision: Decision::NewPrefix,
    }
}

/// The least-loaded candidate holding the matched prefix (first holder wins ties), if the match
/// covers enough of the request.
fn usable_holder(candidates: &[Candidate], input: &Input) -> Option<usize> {
    let m = input.matched?;
    let chunks = input.keys.keys.len();
    if chunks == 0 || (m.depth as f64) < input.cache_threshold * chunks as f64 {
        return None;
    }
    m.record
        .holders
        .iter()
        .filter_map(|id| candidates.iter().position(|c| c.id == *id))
        .min_by_key(|&i| candidates[i].load)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::affinity::{Match, Record};
    use crate::policy::testing::{candidates, input};
    use crate::prefix::PrefixKeys;

    fn matched(depth: usize, holders: Vec<u32>) -> Match {
        Match {
            depth,
            record: Record {
                key: 0,
                stamp_ms: 0,
                holders,
            },
        }
    }

    #[test]
    fn a_good_match_follows_affinity() {
        let c = candidates(&[0, 0, 0, 0]);
        let keys = PrefixKeys::new("m", &"p".repeat(100), 10, 64);
        let m = matched(5, vec![c[2].id]);
        assert_eq!(
            pick(&c, &input(&keys, Some(&m))),
            Pick {
                index: 2,
                decision: Decision::Affinity
            }
        );
    }

    #[test]
    fn a_match_below_the_threshold_is_a_new_prefix() {
        let c = candidates(&[0, 0, 0, 0]);
        let keys = PrefixKeys::new("m", &"p".repeat(100), 10, 64);
        let m = matched(2, vec![c[2].id]);
        let p = pick(&c, &input(&keys, Some(&m)));
        assert_eq!(p.decision, Decision::NewPrefix);
    }

    #[test]
    fn a_new_prefix_goes_to_the_least_loaded_endpoint() {
        let c = candidates(&[3, 2, 0, 1]);
        let keys = PrefixKeys::new("m", "fresh", 10, 64);
        assert_eq!(pick(&c, &input(&keys, None)).index, 2);
    }

    #[test]
    fn an_overloaded_holder_spreads_the_prefix_to_its_next_rendezvous_endpoint() {
        let keys = PrefixKeys::new("m", &"p".repeat(100), 10, 64);
        let base = candidates(&[0, 0, 0, 0]);
        let order = crate::policy::load::rendezvous_order(&base, keys.placement_key());
        let (home, next) = (order[0], order[1]);
        let mut loads = [1u64; 4];
        loads[home] = 20;
        let c = candidates(&loads);
        let m = matched(10, vec![c[home].id]);
        assert_eq!(
            pick(&c, &input(&keys, Some(&m))),
            Pick {
                index: next,
                decision: Decision::Spread
            }
        );
        // Once spread, the prefix's least-loaded holder serves it.
        let m2 = matched(10, vec![c[home].id, c[next].id]);
        assert_eq!(
            pick(&c, &input(&keys, Some(&m2))),
            Pick {
                index: next,
                decision: Decision::Affinity
            }
        );
    }

    #[test]
    fn holders_that_left_the_candidates_are_ignored() {
        let c = candidates(&[0, 0]);
        let keys = PrefixKeys::new("m", &"p".repeat(100), 10, 64);
        let m = matched(10, vec![12345]);
        assert_eq!(
            pick(&c, &input(&keys, Some(&m))).decision,
            Decision::NewPrefix
        );
    }

    #[test]
    fn a_new_prefix_prefers_the_endpoint_with_the_fewest_prefixes_unless_it_is_overloaded() {
        let keys = PrefixKeys::new("m", "fresh", 10, 64);
        let mut c = candidates(&[2, 0, 1, 0]);
        for (cand, placed) in c.iter_mut().zip([0, 3, 2, 1]) {
            cand.placed = placed;
        }
        assert_eq!(
            pick(&c, &input(&keys, None)).index,
            0,
            "fewest prefixes, though busier"
        );
        c[0].load = 9; // now overloaded (abs 4 over the minimum, and over 1.5x)
        let p = pick(&c, &input(&keys, None));
        assert_eq!(
            p,
            Pick {
                index: 3,
                decision: Decision::Balance
            },
            "idle, fewer prefixes than 1"
        );
    }

    #[test]
    fn an_imbalanced_fleet_balances_new_prefixes() {
        let c = candidates(&[50, 0, 2, 3]);
        let keys = PrefixKeys::new("m", "fresh", 10, 64);
        assert_eq!(
            pick(&c, &input(&keys, None)),
            Pick {
                index: 1,
                decision: Decision::Balance
            }
        );
    }
}
