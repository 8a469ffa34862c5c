//! Baseline: each request to the next endpoint in turn, shared across workers by a ticket counter.

use super::{Candidate, Decision, Input, Pick};

pub fn pick(candidates: &[Candidate], input: &Input) -> Pick {
    let index = (input.ticket % candidates.len() as u64) as usize;
    Pick {
        index,
        decision: Decision::RoundRobin,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{candidates, input};
    use crate::prefix::PrefixKeys;

    #[test]
    fn tickets_cycle_through_every_endpoint() {
        let c = candidates(&[9, 0, 0]);
        let keys = PrefixKeys::new("m", "x", 8, 8);
        let picks: Vec<usize> = (0..6)
            .map(|t| {
                pick(
                    &c,
                    &super::Input {
                        ticket: t,
                        ..input(&keys, None)
                    },
                )
                .index
            })
            .collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
    }
}
