//! Per-endpoint load counters shared by all workers, all in one shared-data value so a request
//! reads every endpoint's counts with one host call. Entries at zero are dropped, so the value
//! stays as small as the set of endpoints with something to count.
//!
//! - `inflight`: kvroute's own requests in flight per endpoint: current between stats polls,
//!   where Envoy's `rq_active` is up to one poll interval old.
//! - `placed`: new prefixes placed per endpoint, halved whenever one reaches [`PLACED_CAP`], so
//!   recent placements break load ties and consecutive new prefixes spread over idle endpoints.

use crate::store::{self, SharedStore, Update};

const KEY: &str = "kvroute.load";
const ENTRY_LEN: usize = 12;
pub const PLACED_CAP: u32 = 64;

/// One endpoint's counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    pub id: u32,
    pub inflight: u32,
    pub placed: u32,
}

/// Every endpoint's current counts.
pub fn read<S: SharedStore + ?Sized>(store: &S) -> Vec<Counts> {
    store.get(KEY).0.map(|v| decode(&v)).unwrap_or_default()
}

/// Adds `inflight` (never going below zero) and `placed` to endpoint `id`'s counts and returns
/// them, or `None` if the update lost too many races.
pub fn add<S: SharedStore + ?Sized>(
    store: &S,
    id: u32,
    inflight: i64,
    placed: u32,
) -> Option<Counts> {
    let mut result = Counts {
        id,
        inflight: 0,
        placed: 0,
    };
    let outcome = store::update(store, KEY, |current| {
        let mut table = current.map(decode).unwrap_or_default();
        if placed > 0
            && table
                .iter()
                .any(|c| c.placed.saturating_add(placed) > PLACED_CAP)
        {
            table.iter_mut().for_each(|c| c.placed /= 2);
        }
        let pos = match table.iter().position(|c| c.id == id) {
            Some(p) => p,
            None => {
                table.push(Counts {
                    id,
                    inflight: 0,
                    placed: 0,
                });
                table.len() - 1
            }
        };
        let c = &mut table[pos];
        // Saturating: a decrement whose increment was lost to a startup race heals instead of
        // leaving a negative (and forever wrong) count.
        c.inflight = (i64::from(c.inflight) + inflight).clamp(0, i64::from(u32::MAX)) as u32;
        c.placed = c.placed.saturating_add(placed);
        result = *c;
        table.retain(|c| c.inflight > 0 || c.placed > 0);
        Some(encode(&table))
    });
    match outcome {
        Update::Created | Update::Written | Update::Declined => Some(result),
        Update::Failed => None,
    }
}

fn encode(table: &[Counts]) -> Vec<u8> {
    let mut out = Vec::with_capacity(table.len() * ENTRY_LEN);
    for c in table {
        out.extend_from_slice(&c.id.to_le_bytes());
        out.extend_from_slice(&c.inflight.to_le_bytes());
        out.extend_from_slice(&c.placed.to_le_bytes());
    }
    out
}

fn decode(bytes: &[u8]) -> Vec<Counts> {
    let word = |b: &[u8], i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    bytes
        .chunks_exact(ENTRY_LEN)
        .map(|b| Counts {
            id: word(b, 0),
            inflight: word(b, 4),
            placed: word(b, 8),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;

    fn inflight(store: &MemoryStore) -> Vec<(u32, u32)> {
        read(store)
            .iter()
            .filter(|c| c.inflight > 0)
            .map(|c| (c.id, c.inflight))
            .collect()
    }

    #[test]
    fn in_flight_counts_go_up_and_back_to_zero() {
        let store = MemoryStore::new();
        assert_eq!(add(&store, 1, 1, 0).map(|c| c.inflight), Some(1));
        assert_eq!(add(&store, 1, 1, 0).map(|c| c.inflight), Some(2));
        add(&store, 2, 1, 0);
        assert_eq!(inflight(&store), vec![(1, 2), (2, 1)]);
        add(&store, 1, -1, 0);
        add(&store, 1, -1, 0);
        add(&store, 2, -1, 0);
        assert!(read(&store).is_empty(), "entries at zero are dropped");
    }

    #[test]
    fn an_in_flight_count_never_goes_below_zero() {
        let store = MemoryStore::new();
        assert_eq!(add(&store, 1, -1, 0).map(|c| c.inflight), Some(0));
        assert_eq!(add(&store, 1, 1, 0).map(|c| c.inflight), Some(1));
    }

    #[test]
    fn placements_halve_together_at_the_cap_and_outlive_in_flight_requests() {
        let store = MemoryStore::new();
        add(&store, 1, 1, 1);
        add(&store, 1, -1, 0);
        assert_eq!(
            read(&store),
            vec![Counts {
                id: 1,
                inflight: 0,
                placed: 1
            }]
        );
        for _ in 0..PLACED_CAP {
            add(&store, 2, 0, 1);
        }
        assert_eq!(
            add(&store, 2, 0, 1).map(|c| c.placed),
            Some(PLACED_CAP / 2 + 1)
        );
        assert_eq!(
            read(&store).len(),
            1,
            "endpoint 1's single placement halved to 0 and dropped"
        );
    }

    #[test]
    fn large_counts_survive_encoding() {
        let table = vec![Counts {
            id: u32::MAX,
            inflight: u32::MAX - 1,
            placed: 7,
        }];
        assert_eq!(decode(&encode(&table)), table);
    }
}
