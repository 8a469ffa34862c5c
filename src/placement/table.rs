//! The groups table: the groups a gateway has seen lately, in shared data, bounded whatever the
//! traffic: [`SHARDS`] values of up to [`PER_SHARD`] records (group key, last seen, requests seen,
//! halving every [`HALF_LIFE_MS`]), the least recently seen evicted.

use crate::shared_keys;
use crate::store::{self, SharedStore, Update};

pub const SHARDS: usize = 16;
pub const PER_SHARD: usize = 64;
/// A group not seen for this long no longer takes a place.
pub const TTL_MS: u64 = 60_000;
/// Request counts halve over this time: popularity is recent popularity.
pub const HALF_LIFE_MS: u64 = 30_000;

const VERSION: u8 = 2;
const RECORD_LEN: usize = 20;

/// One group as the table remembers it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Seen {
    pub key: u64,
    pub last_ms: u64,
    /// Requests seen, decayed to `last_ms`.
    pub requests: f32,
}

impl Seen {
    /// Whether the group takes a place in the assignment at `now_ms`, once this gateway has seen
    /// `min_requests` of it.
    pub fn takes_place(&self, now_ms: u64, min_requests: f32) -> bool {
        self.requests >= min_requests && now_ms.saturating_sub(self.last_ms) < TTL_MS
    }

    /// Requests seen, decayed to `now_ms`.
    pub fn requests_at(&self, now_ms: u64) -> f64 {
        f64::from(self.requests) * decay(now_ms.saturating_sub(self.last_ms))
    }
}

/// What a count keeps of itself after `age_ms`: it halves every [`HALF_LIFE_MS`].
pub(super) fn decay(age_ms: u64) -> f64 {
    0.5f64.powf(age_ms as f64 / HALF_LIFE_MS as f64)
}

fn shard_of(group: u64) -> usize {
    (group % SHARDS as u64) as usize
}

fn shard_key(shard: usize) -> String {
    shared_keys::groups_shard(shard)
}

/// Adds `count` requests of each group at `now_ms`, one write per shard touched. Returns the
/// records as written.
pub fn record(store: &dyn SharedStore, counts: &[(u64, u32)], now_ms: u64) -> Vec<Seen> {
    let mut written = Vec::new();
    for shard in 0..SHARDS {
        let mine: Vec<(u64, u32)> = counts
            .iter()
            .copied()
            .filter(|(g, _)| shard_of(*g) == shard)
            .collect();
        if mine.is_empty() {
            continue;
        }
        let mut result = Vec::new();
        let outcome = store::update(store, &shard_key(shard), |current| {
            let mut records = current.map(decode).unwrap_or_default();
            result.clear();
            for &(group, count) in &mine {
                result.push(add(&mut records, group, count, now_ms));
            }
            Some(encode(&records))
        });
        if matches!(outcome, Update::Created | Update::Written) {
            written.extend(result);
        }
    }
    written
}

/// Adds `count` requests of `group` to a shard's records, evicting the least recently seen.
fn add(records: &mut Vec<Seen>, group: u64, count: u32, now_ms: u64) -> Seen {
    if let Some(r) = records.iter_mut().find(|r| r.key == group) {
        r.requests = (r.requests_at(now_ms) + f64::from(count)) as f32;
        r.last_ms = r.last_ms.max(now_ms);
        return *r;
    }
    let fresh = Seen {
        key: group,
        last_ms: now_ms,
        requests: count as f32,
    };
    if records.len() < PER_SHARD {
        records.push(fresh);
    } else if let Some(lru) = records.iter_mut().min_by_key(|r| r.last_ms) {
        *lru = fresh;
    }
    fresh
}

/// Every shard's records and version (to tell whether anything changed since the last read).
pub fn read(store: &dyn SharedStore) -> (Vec<Seen>, Vec<Option<u32>>) {
    let mut all = Vec::new();
    let mut versions = Vec::with_capacity(SHARDS);
    for shard in 0..SHARDS {
        let (value, version) = store.get(&shard_key(shard));
        all.extend(value.as_deref().map(decode).unwrap_or_default());
        versions.push(version);
    }
    (all, versions)
}

pub(super) fn encode(records: &[Seen]) -> Vec<u8> {
    let mut out = Vec::with_capacity(1 + records.len() * RECORD_LEN);
    out.push(VERSION);
    for r in records {
        out.extend_from_slice(&r.key.to_le_bytes());
        out.extend_from_slice(&r.last_ms.to_le_bytes());
        out.extend_from_slice(&r.requests.to_bits().to_le_bytes());
    }
    out
}

/// Decodes a shard; another version or a torn value reads as empty.
pub(super) fn decode(bytes: &[u8]) -> Vec<Seen> {
    let Some((&VERSION, body)) = bytes.split_first() else {
        return Vec::new();
    };
    body.chunks_exact(RECORD_LEN)
        .take(PER_SHARD)
        .filter_map(|r| {
            Some(Seen {
                key: u64::from_le_bytes(r.get(0..8)?.try_into().ok()?),
                last_ms: u64::from_le_bytes(r.get(8..16)?.try_into().ok()?),
                requests: f32::from_bits(u32::from_le_bytes(r.get(16..20)?.try_into().ok()?)),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;
    #[test]
    fn the_table_counts_requests_and_stays_bounded() {
        let store = MemoryStore::new();
        assert_eq!(record(&store, &[(7, 1)], 10)[0].requests, 1.0);
        let seen = record(&store, &[(7, 3), (8, 1)], 20);
        assert_eq!(seen.len(), 2);
        assert!((seen.iter().find(|s| s.key == 7).unwrap().requests - 4.0).abs() < 1e-3);
        for g in 0..10_000u64 {
            record(
                &store,
                &[(g.wrapping_mul(0x9e37_79b9_7f4a_7c15), 1)],
                100 + g,
            );
        }
        let (all, versions) = read(&store);
        assert_eq!(all.len(), SHARDS * PER_SHARD);
        assert_eq!(versions.len(), SHARDS);
        assert_eq!(store.len(), SHARDS);
    }

    #[test]
    fn a_malformed_shard_reads_as_empty() {
        assert!(decode(b"\x09garbage").is_empty());
        assert!(decode(&[]).is_empty());
        let r = vec![Seen {
            key: u64::MAX,
            last_ms: 5,
            requests: 3.5,
        }];
        assert_eq!(decode(&encode(&r)), r);
    }
}
