//! Baseline: consistent hashing of the prompt's first chunk with bounded load: the first endpoint in
//! the prefix's rendezvous order that is not overloaded. No memory of where prefixes went.

use super::load::first_not_overloaded;
use super::{Candidate, Decision, Input, Pick};

pub fn pick(candidates: &[Candidate], input: &Input) -> Pick {
    let index = first_not_overloaded(candidates, input.keys.placement_key(), &input.thresholds);
    Pick {
        index,
        decision: Decision::PrefixHash,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{candidates, input};
    use crate::prefix::PrefixKeys;

    #[test]
    fn the_same_first_chunk_goes_to_the_same_endpoint_until_it_is_overloaded() {
        let keys = PrefixKeys::new("m", "shared system prompt, then a question", 8, 8);
        let home = pick(&candidates(&[0, 0, 0, 0]), &input(&keys, None)).index;
        let mut loads = [0u64; 4];
        loads[home] = 3;
        assert_eq!(pick(&candidates(&loads), &input(&keys, None)).index, home);
        loads[home] = 50;
        assert_ne!(pick(&candidates(&loads), &input(&keys, None)).index, home);
    }
}
