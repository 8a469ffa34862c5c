//! One balanced assignment per gateway: of an Envoy's worker VMs, the one that leads computes the
//! weights of the groups ([`weighted`](super::weighted)) and publishes them in shared data; the
//! others adopt them, so every worker sends a group to the same home. (Each worker computing them
//! at its own moments, from its own history, would weigh a skewed fleet's groups differently.)
//!
//! A worker leads when nothing is published yet, when it wrote what is, or when the author has not
//! rewritten it for [`LEAD_TTL_MS`] (its VM was reloaded or stopped). The leader rewrites it when
//! the weights change and at least every [`FLUSH_MS`]. A worker that takes over continues
//! from the weights it adopted, so the homes do not move.

use super::FLUSH_MS;
use crate::shared_keys;
use crate::store::{self, SharedStore};

/// A publication its author has not rewritten for this long is orphaned: any worker takes over.
pub const LEAD_TTL_MS: u64 = 3 * FLUSH_MS;

const VERSION: u8 = 1;
const HEADER_LEN: usize = 8 * 4;
const GROUP_LEN: usize = 12;

/// What the leading worker publishes.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Published {
    /// The author's token (random per VM).
    pub author: u64,
    pub written_ms: u64,
    /// From when the gateway places groups by the assignment (its first leader's warm-up end).
    pub warm_ms: u64,
    /// When the weights last changed: the assignment holds from then.
    pub weights_ms: u64,
    /// The groups that take a place and their weights, sorted by key.
    pub weights: Vec<(u64, u32)>,
}

impl Published {
    /// Whether the worker with `token` leads at `now_ms`, given what is published.
    pub fn led_by(this: Option<&Published>, token: u64, now_ms: u64) -> bool {
        this.is_none_or(|p| p.author == token || now_ms.saturating_sub(p.written_ms) >= LEAD_TTL_MS)
    }

    /// Whether the leader must rewrite `this` to publish `next` at `now_ms`.
    pub fn stale(this: Option<&Published>, next: &Published) -> bool {
        this.is_none_or(|p| {
            p.author != next.author
                || p.weights_ms != next.weights_ms
                || p.warm_ms != next.warm_ms
                || p.weights != next.weights
                || next.written_ms.saturating_sub(p.written_ms) >= FLUSH_MS
        })
    }

    fn encode(&self) -> Vec<u8> {
        let mut body = Vec::with_capacity(HEADER_LEN + self.weights.len() * GROUP_LEN);
        for n in [self.author, self.written_ms, self.warm_ms, self.weights_ms] {
            body.extend_from_slice(&n.to_le_bytes());
        }
        for (group, weight) in &self.weights {
            body.extend_from_slice(&group.to_le_bytes());
            body.extend_from_slice(&weight.to_le_bytes());
        }
        store::versioned(VERSION, &body)
    }

    /// `None` for a value of another version or shape.
    fn decode(value: &[u8]) -> Option<Published> {
        let body = store::unversioned(VERSION, value)?;
        if body.len() < HEADER_LEN || !(body.len() - HEADER_LEN).is_multiple_of(GROUP_LEN) {
            return None;
        }
        let u64_at = |at: usize| body[at..at + 8].try_into().ok().map(u64::from_le_bytes);
        let weights = body[HEADER_LEN..]
            .chunks_exact(GROUP_LEN)
            .map(|c| {
                let group = u64::from_le_bytes(c[..8].try_into().ok()?);
                let weight = u32::from_le_bytes(c[8..].try_into().ok()?);
                Some((group, weight))
            })
            .collect::<Option<Vec<_>>>()?;
        Some(Published {
            author: u64_at(0)?,
            written_ms: u64_at(8)?,
            warm_ms: u64_at(16)?,
            weights_ms: u64_at(24)?,
            weights,
        })
    }
}

/// What is published, with its version for a compare-and-swap write.
pub fn read(store: &dyn SharedStore) -> (Option<Published>, Option<u32>) {
    let (value, cas) = store.get(shared_keys::GROUPS_PUBLISHED);
    (value.as_deref().and_then(Published::decode), cas)
}

/// Publishes `next` if the value is still at `cas`; false when another worker wrote first.
pub fn write(store: &dyn SharedStore, next: &Published, cas: Option<u32>) -> bool {
    store
        .set(shared_keys::GROUPS_PUBLISHED, &next.encode(), cas)
        .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;

    fn published(author: u64, written_ms: u64) -> Published {
        Published {
            author,
            written_ms,
            warm_ms: 5,
            weights_ms: 3,
            weights: vec![(1, 4), (u64::MAX, 256)],
        }
    }

    #[test]
    fn a_publication_reads_back_and_a_malformed_one_reads_as_none() {
        let store = MemoryStore::new();
        assert_eq!(read(&store).0, None);
        let p = published(7, 100);
        assert!(write(&store, &p, None));
        assert_eq!(read(&store).0, Some(p.clone()));
        for bad in [vec![], vec![VERSION], vec![VERSION + 1; 45], {
            let mut v = p.encode();
            v.pop();
            v
        }] {
            store
                .set(shared_keys::GROUPS_PUBLISHED, &bad, None)
                .unwrap();
            assert_eq!(read(&store).0, None, "{bad:?}");
        }
    }

    #[test]
    fn the_author_leads_until_it_stops_rewriting() {
        let p = published(7, 100);
        assert!(Published::led_by(None, 9, 0), "nothing published: anyone");
        assert!(Published::led_by(Some(&p), 7, 100 + LEAD_TTL_MS + 5));
        assert!(!Published::led_by(Some(&p), 9, 100 + LEAD_TTL_MS - 1));
        assert!(
            Published::led_by(Some(&p), 9, 100 + LEAD_TTL_MS),
            "orphaned"
        );
    }

    #[test]
    fn the_leader_rewrites_on_a_change_or_once_a_flush_interval() {
        let p = published(7, 100);
        let same_soon = published(7, 100 + FLUSH_MS - 1);
        assert!(!Published::stale(Some(&p), &same_soon));
        assert!(Published::stale(Some(&p), &published(7, 100 + FLUSH_MS)));
        let changed = Published {
            weights: vec![(1, 8)],
            ..same_soon.clone()
        };
        assert!(Published::stale(Some(&p), &changed));
        assert!(Published::stale(Some(&p), &published(9, 101)), "new author");
        assert!(Published::stale(None, &p));
    }

    #[test]
    fn a_lost_race_does_not_write() {
        let store = MemoryStore::new();
        assert!(write(&store, &published(7, 100), None));
        let (_, cas) = read(&store);
        assert!(write(&store, &published(9, 101), cas));
        assert!(!write(&store, &published(7, 102), cas), "stale cas");
        assert_eq!(read(&store).0.map(|p| p.author), Some(9));
    }
}
