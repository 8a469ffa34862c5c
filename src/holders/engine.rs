//! The engine index: which endpoints' engines say they hold which prefix keys, in shared data.
//!
//! kvroute-indexer follows the engines' KV-cache events and turns each replica's stored blocks
//! back into kvroute's own chained chunk keys (over the same rendered prompt bytes). One worker
//! polls its change feed ([`Feed`]) and applies it here; requests read it. Unlike the affinity
//! map, which remembers where this gateway sent prefixes, this is what the engines hold, the same
//! at every gateway that follows the same engines.
//!
//! Shared data never deletes a key, so the index is a fixed table like the affinity map: a key
//! lands in slot `key % capacity`, and each slot holds up to [`WAYS`] records (key, generation,
//! the feed version that last changed it, up to [`MAX_HOLDERS`] endpoint ids). A full resync (the
//! indexer restarted, or this gateway fell behind its feed) starts a new generation: records of
//! an older one read as absent and give way first, so nothing needs deleting. A slot that
//! overflows drops the record changed longest ago; the index then misses a prefix an engine
//! holds, and the request is placed as it would be without the index.

use hashbrown::HashMap;
use serde::{Deserialize, Serialize};

use super::{slots, Held, Holders};
use crate::rendezvous::endpoint_id;
use crate::shared_keys;
use crate::store::{self, SharedStore, Update};

/// Records per slot.
pub const WAYS: usize = 4;
/// Endpoints kept per key; a prefix held by more is held nearly everywhere, and the first ones
/// kept are the ones that held it longest.
pub const MAX_HOLDERS: usize = 8;

const VERSION: u8 = 1;
const RECORD_LEN: usize = 8 + 4 + 4 + 1 + 4 * MAX_HOLDERS;

/// What the index stands for: which feed it follows, how far it got, which records count.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Status {
    /// The indexer's epoch (chosen anew at each start) and the last feed version applied.
    pub epoch: u64,
    pub version: u64,
    /// The generation a record must carry to count.
    pub generation: u32,
    /// When the indexer last answered (ms since the Unix epoch); 0 if never.
    pub answered_ms: u64,
    /// Endpoints whose engine's event stream the indexer cannot vouch for (a gap it could not
    /// repair, a silent engine): what the index says of them does not count.
    pub stale: Vec<u32>,
}

impl Status {
    /// The index as the last poll left it, `None` if no poll has succeeded.
    pub fn read<S: SharedStore + ?Sized>(store: &S) -> Option<Status> {
        let (value, _) = store.get(shared_keys::ENGINE_INDEX_STATUS);
        let body = store::unversioned(VERSION, value.as_deref()?)?;
        serde_json::from_slice(body).ok()
    }

    fn write<S: SharedStore + ?Sized>(&self, store: &S) {
        if let Ok(json) = serde_json::to_vec(self) {
            let key = shared_keys::ENGINE_INDEX_STATUS;
            let _ = store.set(key, &store::versioned(VERSION, &json), None);
        }
    }

    /// Whether the indexer answered within `max_age_ms` of `now_ms`.
    pub fn fresh(&self, now_ms: u64, max_age_ms: u64) -> bool {
        self.answered_ms > 0 && now_ms.saturating_sub(self.answered_ms) <= max_age_ms
    }

    /// The feed version to ask for next: changes after it, within this epoch.
    pub fn since(&self) -> (u64, u64) {
        (self.epoch, self.version)
    }
}

/// One answer of the indexer's change feed (`GET /v1/changes?epoch=E&since=V`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Feed {
    pub epoch: u64,
    /// The version this answer brings the index to.
    pub version: u64,
    /// The changes are the whole index: what the index held before no longer counts.
    pub full: bool,
    /// The engines' endpoints (`ip:port`, as Envoy routes to them); changes name them by position.
    pub endpoints: Vec<String>,
    /// Endpoints whose stream the indexer cannot vouch for now.
    #[serde(default)]
    pub stale: Vec<String>,
    /// `(endpoint position, 1 held / 0 dropped, key)`, in the order they happened.
    pub changes: Vec<(usize, u8, u64)>,
}

/// Why a feed answer was not applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FeedError {
    /// Changes of an epoch other than the one the index follows, not a full answer: ask for the
    /// whole index.
    OtherEpoch,
    /// A change names an endpoint position the answer does not list.
    UnknownEndpoint,
}

/// What applying a feed answer did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Applied {
    pub held: usize,
    pub dropped: usize,
    /// Records pushed out of a full slot.
    pub overflowed: usize,
    pub full: bool,
}

/// One key's record.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Record {
    key: u64,
    generation: u32,
    changed: u32,
    holders: Vec<u32>,
}

/// The engine index over a [`SharedStore`].
pub struct EngineIndex<'s, S: SharedStore + ?Sized> {
    store: &'s S,
    capacity: u32,
}

impl<'s, S: SharedStore + ?Sized> EngineIndex<'s, S> {
    pub fn new(store: &'s S, capacity: u32) -> Self {
        EngineIndex {
            store,
            capacity: capacity.max(1),
        }
    }

    fn slot(&self, key: u64) -> u64 {
        key % u64::from(self.capacity)
    }

    fn slot_key(slot: u64) -> String {
        shared_keys::engine_index_slot(slot)
    }

    /// The endpoints that hold `key`, by `status` (its generation, its stale endpoints); `None`
    /// when none does.
    pub fn holders(&self, key: u64, status: &Status) -> Option<Vec<u32>> {
        let (value, _) = self.store.get(&Self::slot_key(self.slot(key)));
        let record = decode(value.as_deref()?)
            .into_iter()
            .find(|r| r.key == key && r.generation == status.generation)?;
        let holders: Vec<u32> = record
            .holders
            .into_iter()
            .filter(|h| !status.stale.contains(h))
            .collect();
        (!holders.is_empty()).then_some(holders)
    }

    /// The index as `status` has it (its generation, its stale endpoints), to look prefixes up in.
    pub fn as_of<'a>(&'a self, status: &'a Status) -> AsOf<'a, 's, S> {
        AsOf {
            index: self,
            status,
        }
    }

    /// Applies one answer of the feed, at `now_ms`, and records the new status. Changes are
    /// grouped by slot, so a slot costs one read-modify-write however many of its keys changed.
    pub fn apply(&self, feed: &Feed, now_ms: u64) -> Result<Applied, FeedError> {
        let mut status = Status::read(self.store).unwrap_or_default();
        if !feed.full && feed.epoch != status.epoch {
            return Err(FeedError::OtherEpoch);
        }
        let ids: Vec<u32> = feed.endpoints.iter().map(|a| endpoint_id(a)).collect();
        let mut by_slot: HashMap<u64, Vec<(u64, bool, u32)>> = HashMap::new();
        for &(at, held, key) in &feed.changes {
            let id = *ids.get(at).ok_or(FeedError::UnknownEndpoint)?;
            by_slot
                .entry(self.slot(key))
                .or_default()
                .push((key, held != 0, id));
        }
        if feed.full {
            status.generation = status.generation.wrapping_add(1);
        }
        let (generation, changed) = (status.generation, feed.version as u32);
        let mut applied = Applied {
            full: feed.full,
            ..Applied::default()
        };
        for (slot, changes) in &by_slot {
            let mut counts = Applied::default();
            let update = store::update(self.store, &Self::slot_key(*slot), |current| {
                counts = Applied::default();
                let mut records = current.map(decode).unwrap_or_default();
                records.retain(|r| r.generation == generation);
                for &(key, held, id) in changes {
                    if held {
                        counts.overflowed += hold(&mut records, key, id, generation, changed);
                        counts.held += 1;
                    } else {
                        drop_holder(&mut records, key, id);
                        counts.dropped += 1;
                    }
                }
                Some(encode(&records))
            });
            if matches!(update, Update::Created | Update::Written) {
                applied.held += counts.held;
                applied.dropped += counts.dropped;
                applied.overflowed += counts.overflowed;
            }
        }
        status.epoch = feed.epoch;
        status.version = feed.version;
        status.answered_ms = now_ms;
        status.stale = feed.stale.iter().map(|a| endpoint_id(a)).collect();
        status.write(self.store);
        Ok(applied)
    }
}

/// The engine index as one status has it.
pub struct AsOf<'a, 's, S: SharedStore + ?Sized> {
    index: &'a EngineIndex<'s, S>,
    status: &'a Status,
}

impl<S: SharedStore + ?Sized> Holders for AsOf<'_, '_, S> {
    /// Engines hold a prefix's blocks from the first, so presence is monotone along the chain:
    /// probes the last key, then 2, 4, 8, ... back from it, then bisects.
    fn longest_match(&self, keys: &[u64], from: usize) -> Option<Held> {
        let found = |i: usize| self.index.holders(keys[i], self.status);
        let (depth, holders) = slots::longest(keys.len(), from, found)?;
        Some(Held {
            depth,
            holders,
            stamp_ms: None,
        })
    }
}

/// Marks `id` a holder of `key`, adding its record (pushing out the one changed longest ago
/// when the slot is full). Returns how many records it pushed out.
fn hold(records: &mut Vec<Record>, key: u64, id: u32, generation: u32, changed: u32) -> usize {
    if let Some(r) = records.iter_mut().find(|r| r.key == key) {
        r.changed = changed;
        if !r.holders.contains(&id) && r.holders.len() < MAX_HOLDERS {
            r.holders.push(id);
        }
        return 0;
    }
    let fresh = Record {
        key,
        generation,
        changed,
        holders: vec![id],
    };
    if records.len() < WAYS {
        records.push(fresh);
        return 0;
    }
    match records.iter_mut().min_by_key(|r| r.changed) {
        Some(oldest) => *oldest = fresh,
        None => records.push(fresh),
    }
    1
}

/// `id` no longer holds `key`; a record left with no holder goes.
fn drop_holder(records: &mut Vec<Record>, key: u64, id: u32) {
    if let Some(r) = records.iter_mut().find(|r| r.key == key) {
        r.holders.retain(|&h| h != id);
    }
    records.retain(|r| !r.holders.is_empty());
}

fn encode(records: &[Record]) -> Vec<u8> {
    let mut out = Vec::with_capacity(1 + records.len() * RECORD_LEN);
    out.push(VERSION);
    for r in records {
        out.extend_from_slice(&r.key.to_le_bytes());
        out.extend_from_slice(&r.generation.to_le_bytes());
        out.extend_from_slice(&r.changed.to_le_bytes());
        out.push(r.holders.len().min(MAX_HOLDERS) as u8);
        for i in 0..MAX_HOLDERS {
            out.extend_from_slice(&r.holders.get(i).copied().unwrap_or(0).to_le_bytes());
        }
    }
    out
}

/// Decodes a slot; anything malformed (another version, a torn value) reads as an empty slot.
fn decode(bytes: &[u8]) -> Vec<Record> {
    slots::decode(bytes, VERSION, RECORD_LEN, WAYS, decode_record)
}

fn decode_record(r: &[u8]) -> Option<Record> {
    let u32_at = |i: usize| r.get(i..i + 4)?.try_into().ok().map(u32::from_le_bytes);
    let count = usize::from(*r.get(16)?).min(MAX_HOLDERS);
    Some(Record {
        key: u64::from_le_bytes(r.get(..8)?.try_into().ok()?),
        generation: u32_at(8)?,
        changed: u32_at(12)?,
        holders: slots::u32s(r, 17, count)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;

    const A: &str = "127.0.0.1:8001";
    const B: &str = "127.0.0.1:8002";

    fn feed(epoch: u64, version: u64, full: bool, changes: &[(usize, u8, u64)]) -> Feed {
        Feed {
            epoch,
            version,
            full,
            endpoints: vec![A.to_string(), B.to_string()],
            stale: Vec::new(),
            changes: changes.to_vec(),
        }
    }

    fn status(store: &MemoryStore) -> Status {
        Status::read(store).expect("a status once a feed was applied")
    }

    #[test]
    fn the_deepest_key_an_engine_holds_is_found_with_its_holders() {
        let store = MemoryStore::new();
        let index = EngineIndex::new(&store, 1024);
        let changes: Vec<_> = (1..=5)
            .map(|k| (0, 1, k))
            .chain((1..=2).map(|k| (1, 1, k)))
            .collect();
        index.apply(&feed(7, 1, true, &changes), 100).unwrap();
        let s = status(&store);
        let (a, b) = (endpoint_id(A), endpoint_id(B));
        assert_eq!(
            index
                .as_of(&s)
                .longest_match(&[1, 2, 3, 9, 9], 0)
                .map(|h| (h.depth, h.holders)),
            Some((3, vec![a]))
        );
        assert_eq!(
            index
                .as_of(&s)
                .longest_match(&[1, 2, 8], 0)
                .map(|h| (h.depth, h.holders)),
            Some((2, vec![a, b]))
        );
        assert_eq!(
            index
                .as_of(&s)
                .longest_match(&[6, 7], 0)
                .map(|h| (h.depth, h.holders)),
            None
        );
        assert_eq!(
            index
                .as_of(&s)
                .longest_match(&[], 0)
                .map(|h| (h.depth, h.holders)),
            None
        );
    }

    #[test]
    fn dropped_blocks_take_their_keys_away() {
        let store = MemoryStore::new();
        let index = EngineIndex::new(&store, 1024);
        index
            .apply(&feed(7, 1, true, &[(0, 1, 1), (0, 1, 2), (1, 1, 1)]), 100)
            .unwrap();
        index.apply(&feed(7, 2, false, &[(0, 0, 2)]), 200).unwrap();
        let s = status(&store);
        assert_eq!(s.version, 2);
        assert_eq!(s.answered_ms, 200);
        assert_eq!(index.holders(2, &s), None);
        assert_eq!(
            index.holders(1, &s),
            Some(vec![endpoint_id(A), endpoint_id(B)])
        );
    }

    #[test]
    fn a_full_answer_replaces_what_the_index_held() {
        let store = MemoryStore::new();
        let index = EngineIndex::new(&store, 1024);
        index
            .apply(&feed(7, 1, true, &[(0, 1, 1), (0, 1, 2)]), 100)
            .unwrap();
        // The indexer restarted: its new epoch's full answer holds key 2 only, on B.
        index.apply(&feed(8, 1, true, &[(1, 1, 2)]), 200).unwrap();
        let s = status(&store);
        assert_eq!(index.holders(1, &s), None);
        assert_eq!(index.holders(2, &s), Some(vec![endpoint_id(B)]));
    }

    #[test]
    fn changes_of_another_epoch_are_refused_until_a_full_answer() {
        let store = MemoryStore::new();
        let index = EngineIndex::new(&store, 1024);
        index.apply(&feed(7, 1, true, &[(0, 1, 1)]), 100).unwrap();
        assert_eq!(
            index.apply(&feed(8, 5, false, &[(0, 1, 2)]), 200),
            Err(FeedError::OtherEpoch)
        );
        assert_eq!(
            index.apply(&feed(7, 2, false, &[(3, 1, 2)]), 200),
            Err(FeedError::UnknownEndpoint)
        );
        assert_eq!(status(&store).version, 1, "nothing applied");
    }

    #[test]
    fn a_stale_engine_holds_nothing() {
        let store = MemoryStore::new();
        let index = EngineIndex::new(&store, 1024);
        let mut answer = feed(7, 1, true, &[(0, 1, 1), (1, 1, 1), (1, 1, 2)]);
        answer.stale = vec![B.to_string()];
        index.apply(&answer, 100).unwrap();
        let s = status(&store);
        assert_eq!(
            index
                .as_of(&s)
                .longest_match(&[1, 2], 0)
                .map(|h| (h.depth, h.holders)),
            Some((1, vec![endpoint_id(A)]))
        );
        assert!(s.fresh(1100, 1000));
        assert!(!s.fresh(1101, 1000));
    }

    #[test]
    fn the_table_stays_bounded_and_a_full_slot_drops_its_oldest_change() {
        let store = MemoryStore::new();
        let index = EngineIndex::new(&store, 4);
        let changes: Vec<_> = (0..100).map(|k| (0, 1, k)).collect();
        let applied = index.apply(&feed(7, 1, true, &changes), 100).unwrap();
        assert_eq!(applied.held, 100);
        assert_eq!(applied.overflowed, 100 - 4 * WAYS);
        assert_eq!(store.len(), 4 + 1, "four slots and the status");
        let later: Vec<_> = (1000..1004).map(|k| (0, 1, k * 4)).collect();
        index.apply(&feed(7, 2, false, &later), 200).unwrap();
        let s = status(&store);
        assert!(index.holders(4000, &s).is_some());
        let kept = (0..100).filter(|&k| index.holders(k, &s).is_some()).count();
        assert_eq!(
            kept,
            4 * WAYS - 4,
            "the new keys pushed out slot 0's oldest"
        );
    }

    #[test]
    fn malformed_slots_read_as_empty() {
        assert!(decode(&[]).is_empty());
        assert!(decode(&[VERSION, 1, 2, 3]).is_empty());
        assert!(decode(&[VERSION + 1]).is_empty());
        let r = Record {
            key: 5,
            generation: 1,
            changed: 2,
            holders: vec![9, 10],
        };
        assert_eq!(decode(&encode(std::slice::from_ref(&r))), vec![r]);
    }
}
