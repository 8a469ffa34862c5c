//! A worker's copy of the groups table, and the requests it counted since it last wrote them.

use hashbrown::HashMap;

use super::table::{read, record, Seen};
use crate::store::SharedStore;

/// How often a worker writes the requests it counted to the table.
pub const FLUSH_MS: u64 = 1_000;

/// A worker's copy of the groups table, and the requests it counted since it last wrote them.
/// A group new to the worker goes into the table at once ([`Tally::count`]); the requests of known
/// ones are written once per [`FLUSH_MS`] ([`Tally::sync`]).
#[derive(Debug, Default)]
pub struct Tally {
    seen: HashMap<u64, Seen>,
    versions: Vec<Option<u32>>,
    /// Requests of known groups counted since they were last written to the table.
    pending: HashMap<u64, u32>,
    flushed_ms: u64,
    /// When the table was last read: right after writing this worker's counts, else once per
    /// [`FLUSH_MS`], the most often any worker writes to it (each read is a host call per shard,
    /// the most of an idle tick's work).
    read_ms: Option<u64>,
}

impl Tally {
    /// Counts one request of `group` at `now_ms`.
    pub fn count(&mut self, store: &dyn SharedStore, group: u64, now_ms: u64) {
        if self.seen.contains_key(&group) {
            *self.pending.entry(group).or_default() += 1;
        } else {
            for seen in record(store, &[(group, 1)], now_ms) {
                self.seen.insert(seen.key, seen);
            }
        }
    }

    /// Writes the counted requests to the table if a [`FLUSH_MS`] has passed since the last
    /// write, and reads the table back right after, or when a [`FLUSH_MS`] has passed since the
    /// last read: this worker's own counts count at once, the other workers' at the pace they
    /// write them.
    pub fn sync(&mut self, store: &dyn SharedStore, now_ms: u64) {
        let mut flushed = false;
        if now_ms.saturating_sub(self.flushed_ms) >= FLUSH_MS && !self.pending.is_empty() {
            let pending: Vec<(u64, u32)> = self.pending.drain().collect();
            record(store, &pending, now_ms);
            self.flushed_ms = now_ms;
            flushed = true;
        }
        let due = self
            .read_ms
            .is_none_or(|at| now_ms.saturating_sub(at) >= FLUSH_MS);
        if flushed || due {
            self.read_ms = Some(now_ms);
            let (records, versions) = read(store);
            if versions != self.versions {
                self.seen = records.into_iter().map(|r| (r.key, r)).collect();
                self.versions = versions;
            }
        }
    }

    /// The groups as this worker knows them.
    pub fn seen(&self) -> Vec<Seen> {
        self.seen.values().copied().collect()
    }
}
