//! Per-endpoint load counters shared by all workers, all in one shared-data value so a request
//! reads every endpoint's counts with one host call. Entries at zero are dropped, so the value
//! stays as small as the set of endpoints with something to count.
//!
//! - `inflight`: kvroute's own requests in flight per endpoint: current between stats polls,
//!   where Envoy's `rq_active` is up to one poll interval old.
//! - `placed`: new prefixes placed per endpoint, halved whenever one reaches [`PLACED_CAP`]: a
//!   cheap stand-in for how many prefixes an endpoint caches, used to spread new prefixes.

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

/// Every endpoint's counts, and the version they were read at.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Table {
    pub counts: Vec<Counts>,
    pub version: Option<u32>,
}

impl Table {
    /// Endpoint `id`'s counts (zero when it has none).
    pub fn get(&self, id: u32) -> Counts {
        let zero = Counts {
            id,
            inflight: 0,
            placed: 0,
        };
        self.counts
            .iter()
            .find(|c| c.id == id)
            .copied()
            .unwrap_or(zero)
    }
}

/// Every endpoint's current counts.
pub fn read<S: SharedStore + ?Sized>(store: &S) -> Table {
    let (value, version) = store.get(KEY);
    Table {
        counts: value.map(|v| decode(&v)).unwrap_or_default(),
        version,
    }
}

/// Adds `inflight` (never going below zero) and `placed` to endpoint `id`'s counts and returns
/// them, or `None` if the update lost too many races.
pub fn add<S: SharedStore + ?Sized>(
    store: &S,
    id: u32,
    inflight: i64,
    placed: u32,
) -> Option<Counts> {
    let mut result = None;
    let outcome = store::update(store, KEY, |current| {
        let mut counts = current.map(decode).unwrap_or_default();
        result = Some(apply(&mut counts, id, inflight, placed));
        Some(encode(&counts))
    });
    match outcome {
        Update::Created | Update::Written | Update::Declined => result,
        Update::Failed => None,
    }
}

/// Like [`add`], but only if nobody changed the counts since `table` was read: a decision taken
/// on `table` and its count then happen as one step. `None` when they changed (decide again).
pub fn add_unchanged<S: SharedStore + ?Sized>(
    store: &S,
    table: &Table,
    id: u32,
    inflight: i64,
    placed: u32,
) -> Option<Counts> {
    let mut counts = table.counts.clone();
    let result = apply(&mut counts, id, inflight, placed);
    store.set(KEY, &encode(&counts), table.version).ok()?;
    Some(result)
}

fn apply(counts: &mut Vec<Counts>, id: u32, inflight: i64, placed: u32) -> Counts {
    if placed > 0
        && counts
            .iter()
            .any(|c| c.placed.saturating_add(placed) > PLACED_CAP)
    {
        counts.iter_mut().for_each(|c| c.placed /= 2);
    }
    let pos = match counts.iter().position(|c| c.id == id) {
        Some(p) => p,
        None => {
            counts.push(Counts {
                id,
                inflight: 0,
                placed: 0,
            });
            counts.len() - 1
        }
    };
    let c = &mut counts[pos];
    // Saturating: a decrement whose increment was lost to a startup race heals instead of
    // leaving a negative (and forever wrong) count.
    c.inflight = (i64::from(c.inflight) + inflight).clamp(0, i64::from(u32::MAX)) as u32;
    c.placed = c.placed.saturating_add(placed);
    let result = *c;
    counts.retain(|c| c.inflight > 0 || c.placed > 0);
    result
}

fn encode(counts: &[Counts]) -> Vec<u8> {
    let mut out = Vec::with_capacity(counts.len() * ENTRY_LEN);
    for c in counts {
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
        let table = read(store);
        table
            .counts
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
        assert!(
            read(&store).counts.is_empty(),
            "entries at zero are dropped"
        );
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
            read(&store).get(1),
            Counts {
                id: 1,
                inflight: 0,
                placed: 1
            }
        );
        for _ in 0..PLACED_CAP {
            add(&store, 2, 0, 1);
        }
        assert_eq!(
            add(&store, 2, 0, 1).map(|c| c.placed),
            Some(PLACED_CAP / 2 + 1)
        );
        assert_eq!(
            read(&store).counts.len(),
            1,
            "endpoint 1's placement halved to 0, dropped"
        );
    }

    #[test]
    fn a_count_taken_on_a_stale_table_is_refused() {
        let store = MemoryStore::new();
        add(&store, 1, 1, 0);
        let table = read(&store);
        add(&store, 2, 1, 0); // another worker counts in between
        assert_eq!(add_unchanged(&store, &table, 1, 1, 1), None);
        let fresh = read(&store);
        assert_eq!(
            add_unchanged(&store, &fresh, 1, 1, 1).map(|c| c.inflight),
            Some(2)
        );
        assert_eq!(read(&store).get(2).inflight, 1);
    }

    #[test]
    fn large_counts_survive_encoding() {
        let counts = vec![Counts {
            id: u32::MAX,
            inflight: u32::MAX - 1,
            placed: 7,
        }];
        assert_eq!(decode(&encode(&counts)), counts);
    }
}
