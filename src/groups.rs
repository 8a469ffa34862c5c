//! The groups a gateway has seen lately, and their homes: a balanced assignment of groups to
//! endpoints that every gateway which has seen the same groups computes alike.
//!
//! Rendezvous alone gives each group a home every gateway agrees on, but by chance: 24 groups
//! on 4 endpoints often put 9 on one and 3 on another. Here each endpoint takes at most
//! ceil(groups / endpoints) groups: groups propose to endpoints in their rendezvous order, and an
//! endpoint keeps the groups that rank it highest (deferred acceptance). The outcome depends only
//! on the set of groups and endpoints, not on the order requests arrived in, so gateways that have
//! seen the same groups agree, and a restarted gateway agrees again once it has seen them.
//!
//! The table is shared data: [`SHARDS`] values of up to [`PER_SHARD`] records (group key, last
//! seen, requests seen), least recently seen evicted, so its size is bounded whatever the traffic.

use hashbrown::HashMap;

use crate::rendezvous;
use crate::store::{self, SharedStore, Update};

pub const SHARDS: usize = 16;
pub const PER_SHARD: usize = 64;
/// A group counts once this many requests of it were seen: one-off prompts are no group.
pub const MIN_REQUESTS: u32 = 2;
/// A group not seen for this long no longer takes a place.
pub const TTL_MS: u64 = 60_000;
/// A record seen again sooner than this is not rewritten.
pub const REFRESH_MS: u64 = 1_000;

const VERSION: u8 = 1;
const RECORD_LEN: usize = 20;

/// One group as the table remembers it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seen {
    pub key: u64,
    pub last_ms: u64,
    pub requests: u32,
}

impl Seen {
    /// Whether the group takes a place in the assignment at `now_ms`.
    pub fn counts(&self, now_ms: u64) -> bool {
        self.requests >= MIN_REQUESTS && now_ms.saturating_sub(self.last_ms) < TTL_MS
    }

    /// Whether a request of this group at `now_ms` needs to be written down.
    pub fn stale(&self, now_ms: u64) -> bool {
        self.requests < MIN_REQUESTS || now_ms.saturating_sub(self.last_ms) >= REFRESH_MS
    }
}

fn shard_key(group: u64) -> String {
    format!("kvroute.groups.{}", group % SHARDS as u64)
}

/// Records a request of `group` at `now_ms`; returns the record as written.
pub fn touch(store: &dyn SharedStore, group: u64, now_ms: u64) -> Option<Seen> {
    let mut written = None;
    let outcome = store::update(store, &shard_key(group), |current| {
        let mut records = current.map(decode).unwrap_or_default();
        let seen = match records.iter_mut().find(|r| r.key == group) {
            Some(r) => {
                r.last_ms = r.last_ms.max(now_ms);
                r.requests = r.requests.saturating_add(1);
                *r
            }
            None => {
                let fresh = Seen {
                    key: group,
                    last_ms: now_ms,
                    requests: 1,
                };
                if records.len() < PER_SHARD {
                    records.push(fresh);
                } else if let Some(lru) = records.iter_mut().min_by_key(|r| r.last_ms) {
                    *lru = fresh;
                }
                fresh
            }
        };
        written = Some(seen);
        Some(encode(&records))
    });
    match outcome {
        Update::Created | Update::Written => written,
        Update::Declined | Update::Failed => None,
    }
}

/// Every shard's records and version (to tell whether anything changed since the last read).
pub fn read(store: &dyn SharedStore) -> (Vec<Seen>, Vec<Option<u32>>) {
    let mut all = Vec::new();
    let mut versions = Vec::with_capacity(SHARDS);
    for shard in 0..SHARDS {
        let (value, version) = store.get(&format!("kvroute.groups.{shard}"));
        all.extend(value.as_deref().map(decode).unwrap_or_default());
        versions.push(version);
    }
    (all, versions)
}

/// Each group's home among `endpoints` (ids): at most ceil(groups / endpoints) groups per
/// endpoint, each group as high in its rendezvous order as that allows. Independent of the order
/// of `groups`.
pub fn assign(groups: &[u64], endpoints: &[u32]) -> HashMap<u64, u32> {
    let mut homes = HashMap::new();
    if endpoints.is_empty() {
        return homes;
    }
    let capacity = groups.len().div_ceil(endpoints.len());
    let orders: Vec<Vec<usize>> = groups
        .iter()
        .map(|&g| rendezvous::order(g, endpoints))
        .collect();
    // How an endpoint ranks a group: by the group's rendezvous weight for it, then by key.
    let rank = |g: usize, e: usize| (rendezvous::weight(groups[g], endpoints[e]), groups[g]);
    let mut next = vec![0usize; groups.len()];
    let mut held: Vec<Vec<usize>> = vec![Vec::new(); endpoints.len()];
    let mut free: Vec<usize> = (0..groups.len()).collect();
    while let Some(g) = free.pop() {
        let Some(&e) = orders[g].get(next[g]) else {
            continue;
        };
        next[g] += 1;
        held[e].push(g);
        if held[e].len() > capacity {
            let worst = held[e]
                .iter()
                .enumerate()
                .min_by_key(|&(_, &h)| rank(h, e))
                .map_or(0, |(i, _)| i);
            free.push(held[e].swap_remove(worst));
        }
    }
    for (e, gs) in held.iter().enumerate() {
        for &g in gs {
            homes.insert(groups[g], endpoints[e]);
        }
    }
    homes
}

fn encode(records: &[Seen]) -> Vec<u8> {
    let mut out = Vec::with_capacity(1 + records.len() * RECORD_LEN);
    out.push(VERSION);
    for r in records {
        out.extend_from_slice(&r.key.to_le_bytes());
        out.extend_from_slice(&r.last_ms.to_le_bytes());
        out.extend_from_slice(&r.requests.to_le_bytes());
    }
    out
}

/// Decodes a shard; another version or a torn value reads as empty.
fn decode(bytes: &[u8]) -> Vec<Seen> {
    let Some((&VERSION, body)) = bytes.split_first() else {
        return Vec::new();
    };
    body.chunks_exact(RECORD_LEN)
        .take(PER_SHARD)
        .filter_map(|r| {
            Some(Seen {
                key: u64::from_le_bytes(r.get(0..8)?.try_into().ok()?),
                last_ms: u64::from_le_bytes(r.get(8..16)?.try_into().ok()?),
                requests: u32::from_le_bytes(r.get(16..20)?.try_into().ok()?),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rendezvous::endpoint_id;
    use crate::store::MemoryStore;

    fn endpoints(n: usize) -> Vec<u32> {
        (0..n)
            .map(|i| endpoint_id(&format!("127.0.0.1:{}", 8001 + i)))
            .collect()
    }

    fn groups(n: u64) -> Vec<u64> {
        (0..n)
            .map(|g| g.wrapping_mul(0x9e37_79b9_7f4a_7c15))
            .collect()
    }

    fn per_endpoint(homes: &HashMap<u64, u32>, endpoints: &[u32]) -> Vec<usize> {
        endpoints
            .iter()
            .map(|e| homes.values().filter(|h| *h == e).count())
            .collect()
    }

    #[test]
    fn every_endpoint_gets_its_share_of_groups() {
        let eps = endpoints(4);
        for n in [4u64, 12, 24, 25, 100] {
            let homes = assign(&groups(n), &eps);
            assert_eq!(homes.len(), n as usize);
            let counts = per_endpoint(&homes, &eps);
            let cap = (n as usize).div_ceil(4);
            assert!(counts.iter().all(|&c| c <= cap), "{n} groups: {counts:?}");
        }
    }

    #[test]
    fn the_assignment_does_not_depend_on_the_order_groups_were_seen() {
        let eps = endpoints(4);
        let gs = groups(30);
        let mut reversed = gs.clone();
        reversed.reverse();
        assert_eq!(assign(&gs, &eps), assign(&reversed, &eps));
    }

    #[test]
    fn most_groups_keep_their_first_rendezvous_choice() {
        let eps = endpoints(4);
        let gs = groups(24);
        let homes = assign(&gs, &eps);
        let first = gs
            .iter()
            .filter(|&&g| homes[&g] == eps[rendezvous::order(g, &eps)[0]])
            .count();
        assert!(first >= 12, "only {first} of 24 at their first choice");
    }

    #[test]
    fn a_group_that_joins_moves_few_others() {
        let eps = endpoints(4);
        let gs = groups(40);
        let before = assign(&gs[..39], &eps);
        let after = assign(&gs, &eps);
        let moved = gs[..39].iter().filter(|&g| before[g] != after[g]).count();
        assert!(moved <= 6, "{moved} groups moved");
    }

    #[test]
    fn the_table_counts_requests_and_stays_bounded() {
        let store = MemoryStore::new();
        assert_eq!(touch(&store, 7, 10).map(|s| s.requests), Some(1));
        let seen = touch(&store, 7, 20).unwrap();
        assert_eq!((seen.requests, seen.last_ms), (2, 20));
        assert!(seen.counts(20) && !seen.counts(20 + TTL_MS));
        assert!(!seen.stale(500) && seen.stale(20 + REFRESH_MS));
        for g in 0..10_000u64 {
            touch(&store, g.wrapping_mul(0x9e37_79b9_7f4a_7c15), 100 + g);
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
            requests: u32::MAX,
        }];
        assert_eq!(decode(&encode(&r)), r);
    }
}
