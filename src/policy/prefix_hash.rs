//! Baseline: consistent hashing of the prompt's first chunk with bounded load: the first endpoint in
//! the prefix's rendezvous order that is not overloaded. No memory of where prefixes went.

use super::load::{first_not_overloaded, least_loaded, rendezvous_order, OverloadBound};
use super::{Candidate, Decision, Input, Pick, Policy};

pub struct PrefixHash {
    pub overload: OverloadBound,
}

impl Policy for PrefixHash {
    fn pick(&mut self, candidates: &[Candidate], input: &Input) -> Option<Pick> {
        let key = input.keys.keys.first().copied().unwrap_or(input.keys.group);
        let order = rendezvous_order(candidates, key);
        let index = first_not_overloaded(candidates, &order, &self.overload)
            .map_or_else(|| least_loaded(candidates, key), |(_, i)| i);
        Some(Pick::new(index, Decision::PrefixHash))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{candidates, input, keys, overload};
    use crate::store::MemoryStore;

    #[test]
    fn the_same_first_chunk_goes_to_the_same_endpoint_until_it_is_overloaded() {
        let (k, store) = (
            keys("shared system prompt, then a question"),
            MemoryStore::new(),
        );
        let mut p = PrefixHash {
            overload: overload(),
        };
        let mut pick = |loads: &[u64]| {
            p.pick(&candidates(loads), &input(&k, &store))
                .unwrap()
                .index
        };
        let home = pick(&[0, 0, 0, 0]);
        let mut loads = [0u64; 4];
        loads[home] = 2;
        assert_eq!(pick(&loads), home);
        loads[home] = 50;
        assert_ne!(pick(&loads), home);
    }
}
