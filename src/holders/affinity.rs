//! The affinity map: which endpoints recently served which prompt prefixes, kept in shared data.
//!
//! Shared data never forgets a key, so the map is a fixed table: a prefix key lands in slot
//! `key % capacity`, and each slot is one shared-data value holding up to [`WAYS`] records
//! (full key, up to [`MAX_HOLDERS`] endpoint ids, last-use stamp). A new record evicts the
//! least-recently used one of its slot. At most `capacity` keys are ever written, whatever the
//! traffic. Writes are whole-value compare-and-swap, so a lost race loses an update, never a record.
//!
//! Each shared-data call takes a host-wide lock, so a request touches few keys: it records only
//! the keys past what it found (a conversation's new turn), and finds the longest held prefix by
//! galloping back from its last key (the newest keys of a conversation are the ones its next turn
//! finds), then bisecting: about 2·log2(new chunks) reads. Older keys of a conversation are never
//! refreshed and age out of their slots first, which a search from the end does not mind.
use super::{slots, Held, Holders};
use crate::shared_keys;
use crate::store::{self, SharedStore, Update};

/// Records per slot.
pub const WAYS: usize = 4;
/// Endpoints remembered per prefix: a hot prefix may grow onto this many replicas.
pub const MAX_HOLDERS: usize = 3;

const VERSION: u8 = 1;
const RECORD_LEN: usize = 8 + 8 + 1 + 4 * MAX_HOLDERS;

/// One prefix record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub key: u64,
    pub stamp_ms: u64,
    /// Endpoint ids, first holder first.
    pub holders: Vec<u32>,
}

/// The affinity table over a [`SharedStore`]; a held prefix's stamp is its deepest key's last use.
pub struct AffinityMap<'s, S: SharedStore + ?Sized> {
    store: &'s S,
    capacity: u32,
}

impl<'s, S: SharedStore + ?Sized> AffinityMap<'s, S> {
    pub fn new(store: &'s S, capacity: u32) -> Self {
        AffinityMap {
            store,
            capacity: capacity.max(1),
        }
    }

    /// The shared-data key of the slot holding `key`.
    pub fn slot_key(&self, key: u64) -> String {
        shared_keys::affinity_slot(key % u64::from(self.capacity))
    }

    /// The record for `key`, if its slot still holds it.
    pub fn get(&self, key: u64) -> Option<Record> {
        let (value, _) = self.store.get(&self.slot_key(key));
        find(value.as_deref()?, key)
    }

    /// Records that `endpoint` now holds the prefixes `keys`, stamped `now_ms`. Returns how many
    /// slots this created (slots ever written).
    pub fn record(&self, keys: &[u64], endpoint: u32, now_ms: u64) -> usize {
        self.record_keeping(keys, endpoint, now_ms, |_, _| true)
    }

    /// [`record`](Self::record), dropping from the records it rewrites the holders for which
    /// `keep(holder, stamp)` is false: the new stamp would otherwise make them count again.
    pub fn record_keeping(
        &self,
        keys: &[u64],
        endpoint: u32,
        now_ms: u64,
        keep: impl Fn(u32, u64) -> bool,
    ) -> usize {
        keys.iter()
            .filter(|&&key| self.upsert(key, endpoint, now_ms, &keep) == Update::Created)
            .count()
    }

    /// Records that `endpoint` no longer holds the prefixes `keys`: it never served them (the
    /// request failed, or another host answered), or its engine evicted them. Other holders stay;
    /// a record left with none is dropped. Deepest keys first, so presence stays monotone even if
    /// this stops half-way. Returns how many records changed.
    pub fn forget(&self, keys: &[u64], endpoint: u32) -> usize {
        keys.iter()
            .rev()
            .filter(|&&key| {
                let update = store::update(self.store, &self.slot_key(key), |current| {
                    let mut records = current.map(decode)?;
                    let r = records.iter_mut().find(|r| r.key == key)?;
                    let before = r.holders.len();
                    r.holders.retain(|&h| h != endpoint);
                    if r.holders.len() == before {
                        return None;
                    }
                    records.retain(|r| !r.holders.is_empty());
                    Some(encode(&records))
                });
                update == Update::Written
            })
            .count()
    }

    fn upsert(
        &self,
        key: u64,
        endpoint: u32,
        now_ms: u64,
        keep: impl Fn(u32, u64) -> bool,
    ) -> Update {
        store::update(self.store, &self.slot_key(key), |current| {
            let mut records = current.map(decode).unwrap_or_default();
            match records.iter_mut().find(|r| r.key == key) {
                Some(r) => {
                    let stamp = r.stamp_ms;
                    r.holders.retain(|&h| h == endpoint || keep(h, stamp));
                    r.stamp_ms = now_ms;
                    if !r.holders.contains(&endpoint) {
                        if r.holders.len() == MAX_HOLDERS {
                            // Keep the first holder (the prefix's home); replace the newest guest.
                            r.holders.pop();
                        }
                        r.holders.push(endpoint);
                    }
                }
                None => {
                    let fresh = Record {
                        key,
                        stamp_ms: now_ms,
                        holders: vec![endpoint],
                    };
                    if records.len() < WAYS {
                        records.push(fresh);
                    } else if let Some(lru) = records.iter_mut().min_by_key(|r| r.stamp_ms) {
                        *lru = fresh;
                    }
                }
            }
            Some(encode(&records))
        })
    }
}

impl<S: SharedStore + ?Sized> Holders for AffinityMap<'_, S> {
    /// Probes the last key, then 2, 4, 8, ... back from it, then bisects between the deepest hit
    /// and the shallowest miss above it.
    fn longest_match(&self, keys: &[u64], from: usize) -> Option<Held> {
        let (depth, record) = slots::longest(keys.len(), from, |i| self.get(keys[i]))?;
        Some(Held {
            depth,
            holders: record.holders,
            stamp_ms: Some(record.stamp_ms),
        })
    }
}

fn encode(records: &[Record]) -> Vec<u8> {
    let mut out = Vec::with_capacity(1 + records.len() * RECORD_LEN);
    out.push(VERSION);
    for r in records {
        out.extend_from_slice(&r.key.to_le_bytes());
        out.extend_from_slice(&r.stamp_ms.to_le_bytes());
        out.push(r.holders.len() as u8);
        for i in 0..MAX_HOLDERS {
            out.extend_from_slice(&r.holders.get(i).copied().unwrap_or(0).to_le_bytes());
        }
    }
    out
}

/// The record of `key` in a slot, decoding nothing else.
fn find(bytes: &[u8], key: u64) -> Option<Record> {
    let wanted = key.to_le_bytes();
    slots::records(bytes, VERSION, RECORD_LEN, WAYS)
        .chunks_exact(RECORD_LEN)
        .find(|r| r[..8] == wanted)
        .and_then(decode_record)
}

/// Decodes a slot; anything malformed (another version, a torn value) reads as an empty slot.
fn decode(bytes: &[u8]) -> Vec<Record> {
    slots::decode(bytes, VERSION, RECORD_LEN, WAYS, decode_record)
}

fn decode_record(r: &[u8]) -> Option<Record> {
    let u64_at = |i: usize| r.get(i..i + 8)?.try_into().ok().map(u64::from_le_bytes);
    let count = usize::from(*r.get(16)?).min(MAX_HOLDERS);
    let holders = slots::u32s(r, 17, count)?;
    Some(Record {
        key: u64_at(0)?,
        stamp_ms: u64_at(8)?,
        holders,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;

    #[test]
    fn the_longest_recorded_prefix_is_found() {
        let store = MemoryStore::new();
        let map = AffinityMap::new(&store, 1024);
        map.record(&[1, 2, 3, 4, 5], 7, 100);
        let m = map.longest_match(&[1, 2, 3, 9, 9, 9, 9], 0).unwrap();
        assert_eq!(m.depth, 3);
        assert_eq!((m.holders, m.stamp_ms), (vec![7], Some(100)));
        let full = map.longest_match(&[1, 2, 3, 4, 5], 0).unwrap();
        assert_eq!(full.depth, 5);
        assert!(map.longest_match(&[8, 12, 13], 0).is_none());
        assert!(map.longest_match(&[], 0).is_none());
        assert!(
            map.longest_match(&[1, 2, 3, 9], 3).is_none(),
            "only keys from `from` on are looked at"
        );
        assert_eq!(map.longest_match(&[1, 2, 3, 4, 9], 2).unwrap().depth, 4);
    }

    /// A store that counts reads.
    struct Counting(MemoryStore, std::cell::Cell<usize>);

    impl SharedStore for Counting {
        fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
            self.1.set(self.1.get() + 1);
            self.0.get(key)
        }
        fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), store::StoreError> {
            self.0.set(key, value, cas)
        }
    }

    #[test]
    fn a_new_turn_finds_the_last_one_in_a_few_reads_even_if_older_keys_aged_out() {
        let store = Counting(MemoryStore::new(), Default::default());
        let map = AffinityMap::new(&store, 1 << 16);
        let turn1: Vec<u64> = (1..=200).collect();
        // Only the second half is still held: the first turns' keys were evicted.
        map.record(&turn1[100..], 4, 1);
        let mut turn2 = turn1.clone();
        turn2.extend(1000..1003);
        store.1.set(0);
        let m = map.longest_match(&turn2, 10).unwrap();
        assert_eq!((m.depth, m.holders.clone()), (200, vec![4]));
        assert!(store.1.get() <= 5, "{} reads", store.1.get());
    }

    #[test]
    fn a_prefix_grows_onto_a_few_holders_keeping_its_first() {
        let store = MemoryStore::new();
        let map = AffinityMap::new(&store, 64);
        for (endpoint, t) in [(1, 1), (2, 2), (1, 3), (3, 4), (4, 5)] {
            map.record(&[42], endpoint, t);
        }
        let r = map.get(42).unwrap();
        assert_eq!(r.holders, vec![1, 2, 4]);
        assert_eq!(r.stamp_ms, 5);
    }

    #[test]
    fn a_rewrite_drops_the_holders_it_is_told_not_to_keep() {
        let store = MemoryStore::new();
        let map = AffinityMap::new(&store, 64);
        map.record(&[42], 1, 10);
        map.record(&[42], 2, 20);
        map.record_keeping(&[42], 3, 30, |h, stamp| h != 1 || stamp > 25);
        assert_eq!(map.get(42).unwrap().holders, vec![2, 3]);
        map.record_keeping(&[42], 2, 40, |_, _| false);
        assert_eq!(
            map.get(42).unwrap().holders,
            vec![2],
            "the endpoint recorded always stays"
        );
    }

    #[test]
    fn a_full_slot_evicts_its_least_recently_used_record() {
        let store = MemoryStore::new();
        let map = AffinityMap::new(&store, 1);
        for k in 0..WAYS as u64 {
            map.record(&[k], 1, 10 + k);
        }
        map.record(&[0], 1, 100); // key 0 is used again, key 1 is now the oldest
        map.record(&[99], 2, 101);
        assert!(map.get(1).is_none());
        assert!(map.get(0).is_some() && map.get(99).is_some());
    }

    #[test]
    fn the_number_of_keys_never_exceeds_capacity() {
        let store = MemoryStore::new();
        let map = AffinityMap::new(&store, 128);
        let mut created = 0;
        for k in 0..100_000u64 {
            created += map.record(&[k.wrapping_mul(0x9e37_79b9_7f4a_7c15)], (k % 5) as u32, k);
        }
        assert_eq!(store.len(), 128);
        assert_eq!(created, 128);
    }

    #[test]
    fn a_malformed_slot_reads_as_empty_and_is_rewritten() {
        let store = MemoryStore::new();
        let map = AffinityMap::new(&store, 8);
        store.set(&map.slot_key(3), b"\x01garbage", None).unwrap();
        assert!(map.get(3).is_none());
        map.record(&[3], 9, 1);
        assert_eq!(map.get(3).unwrap().holders, vec![9]);
    }

    #[test]
    fn forgetting_an_endpoint_keeps_other_holders_and_the_shallower_prefix() {
        let store = MemoryStore::new();
        let map = AffinityMap::new(&store, 1024);
        map.record(&[1, 2, 3, 4], 7, 1);
        map.record(&[1, 2], 8, 2);
        assert_eq!(map.forget(&[2, 3, 4], 7), 3);
        assert_eq!(map.get(1).unwrap().holders, vec![7, 8]);
        assert_eq!(map.get(2).unwrap().holders, vec![8]);
        assert!(map.get(3).is_none() && map.get(4).is_none());
        assert_eq!(map.longest_match(&[1, 2, 3, 4], 0).unwrap().depth, 2);
        assert_eq!(map.forget(&[3, 9], 7), 0, "nothing left to forget");
    }

    #[test]
    fn a_slot_of_another_format_version_is_ignored_not_misread() {
        let store = MemoryStore::new();
        let map = AffinityMap::new(&store, 8);
        map.record(&[3], 9, 1);
        let (mut value, _) = store.get(&map.slot_key(3));
        let value = value.as_mut().unwrap();
        value[0] = VERSION + 1;
        store.set(&map.slot_key(3), value, None).unwrap();
        assert!(map.get(3).is_none());
        assert!(decode(value).is_empty());
    }

    #[test]
    fn records_round_trip() {
        let records = vec![
            Record {
                key: u64::MAX,
                stamp_ms: 5,
                holders: vec![1, u32::MAX],
            },
            Record {
                key: 0,
                stamp_ms: u64::MAX,
                holders: vec![],
            },
        ];
        assert_eq!(decode(&encode(&records)), records);
    }
}
