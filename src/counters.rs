//! Per-endpoint counters shared by all workers, one shared-data value per counter table (one read
//! per request for all endpoints). Entries at zero are dropped, so a table stays as small as the
//! set of endpoints with a count.
//!
//! - [`INFLIGHT`]: kvroute's own in-flight requests per endpoint: current between stats polls,
//!   where Envoy's `rq_active` is up to one poll interval old.
//! - [`PLACED`]: new prefixes placed per endpoint, halved whenever one reaches [`PLACED_CAP`], so
//!   recent placements break load ties and consecutive new prefixes spread over idle endpoints.

use crate::store::{self, SharedStore, Update};

/// A table of per-endpoint counts under one shared-data key.
#[derive(Debug, Clone, Copy)]
pub struct Counters {
    key: &'static str,
    /// When a count would exceed this, every count is halved first (`u32::MAX`: never).
    cap: u32,
}

pub const INFLIGHT: Counters = Counters {
    key: "kvroute.inflight",
    cap: u32::MAX,
};
pub const PLACED_CAP: u32 = 64;
pub const PLACED: Counters = Counters {
    key: "kvroute.placed",
    cap: PLACED_CAP,
};

impl Counters {
    /// Current counts as (endpoint id, count).
    pub fn counts<S: SharedStore + ?Sized>(&self, store: &S) -> Vec<(u32, u32)> {
        store
            .get(self.key)
            .0
            .map(|v| decode(&v))
            .unwrap_or_default()
    }

    /// Adds `delta` to the count of endpoint `id` (never below zero) and returns the new count, or
    /// `None` if the update lost too many races.
    pub fn add<S: SharedStore + ?Sized>(&self, store: &S, id: u32, delta: i64) -> Option<u32> {
        let mut result = 0;
        let cap = self.cap;
        let outcome = store::update(store, self.key, |current| {
            let mut table = current.map(decode).unwrap_or_default();
            if delta > 0
                && table
                    .iter()
                    .any(|(_, n)| i64::from(*n) + delta > i64::from(cap))
            {
                table.iter_mut().for_each(|(_, n)| *n /= 2);
                table.retain(|(_, n)| *n > 0);
            }
            let pos = table.iter().position(|(e, _)| *e == id);
            let old = pos.map(|p| table[p].1).unwrap_or(0);
            // Saturating: a decrement whose increment was lost to a startup race heals instead of
            // leaving a negative (and forever wrong) count.
            result = (i64::from(old) + delta).clamp(0, i64::from(u32::MAX)) as u32;
            match (pos, result) {
                (Some(p), 0) => {
                    table.swap_remove(p);
                }
                (Some(p), n) => table[p].1 = n,
                (None, 0) => return None,
                (None, n) => table.push((id, n)),
            }
            Some(encode(&table))
        });
        match outcome {
            Update::Created | Update::Written | Update::Declined => Some(result),
            Update::Failed => None,
        }
    }
}

fn encode(table: &[(u32, u32)]) -> Vec<u8> {
    table
        .iter()
        .flat_map(|(id, n)| id.to_le_bytes().into_iter().chain(n.to_le_bytes()))
        .collect()
}

fn decode(bytes: &[u8]) -> Vec<(u32, u32)> {
    bytes
        .chunks_exact(8)
        .map(|c| {
            let (id, n) = c.split_at(4);
            let word = |b: &[u8]| u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            (word(id), word(n))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;

    #[test]
    fn counts_go_up_and_back_to_zero() {
        let store = MemoryStore::new();
        assert_eq!(INFLIGHT.add(&store, 1, 1), Some(1));
        assert_eq!(INFLIGHT.add(&store, 1, 1), Some(2));
        assert_eq!(INFLIGHT.add(&store, 2, 1), Some(1));
        assert_eq!(INFLIGHT.counts(&store), vec![(1, 2), (2, 1)]);
        INFLIGHT.add(&store, 1, -1);
        INFLIGHT.add(&store, 1, -1);
        INFLIGHT.add(&store, 2, -1);
        assert!(INFLIGHT.counts(&store).is_empty());
    }

    #[test]
    fn a_count_never_goes_below_zero() {
        let store = MemoryStore::new();
        assert_eq!(INFLIGHT.add(&store, 1, -1), Some(0));
        assert_eq!(INFLIGHT.add(&store, 1, 1), Some(1));
    }

    #[test]
    fn capped_counts_halve_together_keeping_their_order() {
        let store = MemoryStore::new();
        PLACED.add(&store, 1, 1);
        for _ in 0..PLACED_CAP {
            PLACED.add(&store, 2, 1);
        }
        assert_eq!(PLACED.counts(&store), vec![(1, 1), (2, PLACED_CAP)]);
        assert_eq!(PLACED.add(&store, 2, 1), Some(PLACED_CAP / 2 + 1));
        assert_eq!(
            PLACED.counts(&store),
            vec![(2, PLACED_CAP / 2 + 1)],
            "1 halved to 0 and dropped"
        );
        assert!(INFLIGHT.counts(&store).is_empty(), "tables are separate");
    }

    #[test]
    fn large_ids_and_counts_survive_encoding() {
        let table = vec![(u32::MAX, u32::MAX - 1), (0, 1)];
        assert_eq!(decode(&encode(&table)), table);
    }
}
