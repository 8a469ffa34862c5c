//! Baseline: each request to the next endpoint in turn, shared across workers by a ticket counter.

use super::{Candidate, Decision, Input, Pick, Policy};
use crate::shared_keys;
use crate::store::{self, SharedStore};

/// Format of the ticket value: a version byte, then the ticket (u64 little-endian).
const VERSION: u8 = 1;

pub struct RoundRobin;

impl Policy for RoundRobin {
    fn pick(&mut self, candidates: &[Candidate], input: &Input) -> Option<Pick> {
        let ticket = next_ticket(input.store);
        let index = (ticket % candidates.len() as u64) as usize;
        Some(Pick::new(index, Decision::RoundRobin))
    }
}

fn next_ticket(store: &dyn SharedStore) -> u64 {
    let mut ticket = 0;
    store::update(store, shared_keys::TICKET, |current| {
        ticket = current
            .and_then(|v| store::unversioned(VERSION, v))
            .and_then(|v| v.try_into().ok())
            .map(u64::from_le_bytes)
            .unwrap_or(0)
            .wrapping_add(1);
        Some(store::versioned(VERSION, &ticket.to_le_bytes()))
    });
    ticket
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{candidates, input, keys};
    use crate::store::MemoryStore;

    #[test]
    fn tickets_cycle_through_every_endpoint() {
        let (c, k, store) = (candidates(&[9, 0, 0]), keys("x"), MemoryStore::new());
        let picks: Vec<usize> = (0..6)
            .map(|_| RoundRobin.pick(&c, &input(&k, &store)).unwrap().index)
            .collect();
        assert_eq!(picks[0..3], picks[3..6]);
        let distinct: std::collections::HashSet<_> = picks.iter().collect();
        assert_eq!(distinct.len(), 3);
    }
}
