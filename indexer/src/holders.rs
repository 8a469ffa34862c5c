//! Which endpoint holds which key, counted, and the versioned feed of its changes.
//!
//! An endpoint holds a key while at least one of its cached block chains (of any of its
//! streams: data-parallel ranks publish separately) covers the key's chunk; the count is how
//! many do. A change is recorded when a count goes 0 → 1 (held) or 1 → 0 (released), so the
//! feed only carries what a client must apply. `version` counts the changes since this
//! process started; the ring keeps the most recent `capacity` of them.

use hashbrown::HashMap;
use std::collections::VecDeque;

/// One entry of the change feed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Change {
    pub endpoint: u32,
    pub held: bool,
    pub key: u64,
}

/// What a client gets for `since`: the changes after it, or everything held now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delta {
    /// The version the client has after applying `changes`.
    pub version: u64,
    /// `changes` is a snapshot: drop everything, then apply.
    pub full: bool,
    pub changes: Vec<Change>,
}

#[derive(Debug)]
pub struct Holders {
    endpoints: Vec<String>,
    held: Vec<HashMap<u64, u32>>,
    ring: VecDeque<Change>,
    capacity: usize,
    version: u64,
}

impl Holders {
    /// An empty table whose feed remembers the last `capacity` changes.
    pub fn new(capacity: usize) -> Holders {
        Holders {
            endpoints: Vec::new(),
            held: Vec::new(),
            ring: VecDeque::with_capacity(capacity.min(1 << 16)),
            capacity: capacity.max(1),
            version: 0,
        }
    }

    /// The index of endpoint `name`, added if new (indexes never change within a process).
    pub fn endpoint(&mut self, name: &str) -> u32 {
        if let Some(i) = self.endpoints.iter().position(|e| e == name) {
            return i as u32;
        }
        self.endpoints.push(name.to_owned());
        self.held.push(HashMap::new());
        (self.endpoints.len() - 1) as u32
    }

    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    pub fn version(&self) -> u64 {
        self.version
    }

    /// Keys endpoint `e` holds.
    pub fn held(&self, e: u32) -> usize {
        self.held.get(e as usize).map_or(0, HashMap::len)
    }

    pub fn holds(&self, e: u32, key: u64) -> bool {
        self.held
            .get(e as usize)
            .is_some_and(|h| h.contains_key(&key))
    }

    /// Every key endpoint `e` holds (in no order).
    pub fn keys(&self, e: u32) -> Vec<u64> {
        self.held
            .get(e as usize)
            .map_or_else(Vec::new, |h| h.keys().copied().collect())
    }

    /// One more chain of `e` covers `key`.
    #[inline]
    pub fn add(&mut self, e: u32, key: u64) {
        let count = self.held[e as usize].entry(key).or_insert(0);
        *count += 1;
        if *count == 1 {
            self.push(Change {
                endpoint: e,
                held: true,
                key,
            });
        }
    }

    /// One chain of `e` that covered `key` is gone.
    #[inline]
    pub fn release(&mut self, e: u32, key: u64) {
        let held = &mut self.held[e as usize];
        if let Some(count) = held.get_mut(&key) {
            *count -= 1;
            if *count == 0 {
                held.remove(&key);
                self.push(Change {
                    endpoint: e,
                    held: false,
                    key,
                });
            }
        }
    }

    fn push(&mut self, change: Change) {
        if self.ring.len() == self.capacity {
            self.ring.pop_front();
        }
        self.ring.push_back(change);
        self.version += 1;
    }

    /// The changes after version `since`, at most `limit` of them (the client asks again from
    /// the version it got); a snapshot when the ring no longer reaches back to `since`, or
    /// `since` is ahead (another process's version).
    pub fn since(&self, since: Option<u64>, limit: usize) -> Delta {
        let oldest = self.version - self.ring.len() as u64;
        match since {
            Some(v) if v >= oldest && v <= self.version => {
                let skip = (v - oldest) as usize;
                let changes: Vec<Change> =
                    self.ring.iter().skip(skip).take(limit).copied().collect();
                Delta {
                    version: v + changes.len() as u64,
                    full: false,
                    changes,
                }
            }
            _ => self.snapshot(),
        }
    }

    /// Everything held now, as `held` changes by endpoint and key (an order that does not
    /// depend on how the tables hash), at the current version.
    pub fn snapshot(&self) -> Delta {
        let mut changes: Vec<Change> = self
            .held
            .iter()
            .enumerate()
            .flat_map(|(e, held)| {
                held.keys().map(move |&key| Change {
                    endpoint: e as u32,
                    held: true,
                    key,
                })
            })
            .collect();
        changes.sort_unstable_by_key(|c| (c.endpoint, c.key));
        Delta {
            version: self.version,
            full: true,
            changes,
        }
    }

    /// Heap bytes of the tables and the ring, estimated.
    pub fn memory(&self) -> usize {
        // hashbrown: key, value and one control byte per bucket.
        let tables: usize = self.held.iter().map(|h| h.capacity() * 13).sum();
        tables + self.ring.capacity() * std::mem::size_of::<Change>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_make_changes_only_at_zero_and_the_feed_replays_them() {
        let mut h = Holders::new(100);
        let a = h.endpoint("10.0.0.1:8000");
        assert_eq!(h.endpoint("10.0.0.1:8000"), a);
        h.add(a, 7);
        h.add(a, 7);
        h.release(a, 7);
        assert!(h.holds(a, 7));
        assert_eq!(h.version(), 1);
        h.release(a, 7);
        h.release(a, 7);
        assert!(!h.holds(a, 7));
        let d = h.since(Some(0), 100);
        assert!(!d.full);
        assert_eq!(d.version, 2);
        assert_eq!(
            d.changes.iter().map(|c| c.held).collect::<Vec<_>>(),
            [true, false]
        );
        assert_eq!(h.since(Some(1), 1).changes.len(), 1);
        assert!(h.since(Some(2), 100).changes.is_empty());
    }

    #[test]
    fn a_client_behind_the_ring_or_ahead_of_it_gets_a_snapshot() {
        let mut h = Holders::new(2);
        let a = h.endpoint("a");
        for k in 0..5 {
            h.add(a, k);
        }
        let d = h.since(Some(1), 100);
        assert!(d.full);
        assert_eq!(d.changes.len(), 5);
        assert_eq!(d.version, 5);
        assert!(!h.since(Some(3), 100).full);
        assert!(h.since(Some(6), 100).full);
        assert!(h.since(None, 100).full);
    }

    #[test]
    fn a_limited_answer_resumes_where_it_stopped() {
        let mut h = Holders::new(100);
        let a = h.endpoint("a");
        for k in 0..10 {
            h.add(a, k);
        }
        let first = h.since(Some(0), 4);
        assert_eq!((first.version, first.changes.len()), (4, 4));
        let rest = h.since(Some(first.version), 100);
        assert_eq!(rest.changes[0].key, 4);
        assert_eq!(rest.version, 10);
    }
}
