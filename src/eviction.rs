//! The closed loop: an engine that reports fewer cached tokens than the affinity map predicted
//! has evicted what the map says it holds, and, since engines evict the least recently used
//! blocks first, everything the map last saw it use before then too.
//!
//! Each endpoint gets an eviction horizon: the map's last-use stamp of a prefix its engine was
//! found to have lost. A record last used at or before its holder's horizon no longer counts for
//! that holder. The horizons live in one shared-data value (one entry per endpoint, the oldest
//! dropped past [`MAX_ENDPOINTS`]), so every worker sees what any of them learnt.
//!
//! A prefix another request is still prefilling is not cached yet (engines report a block as
//! cached only once it is computed), so a record younger than the grace period when the request
//! was routed proves nothing: a burst of requests for a new prefix never erases its own record.

use hashbrown::HashMap;

use crate::shared_keys;
use crate::store::{self, versioned, SharedStore, Update};
use crate::usage::Usage;

/// Endpoints with a horizon, at most: beyond it the oldest horizon is forgotten (its endpoint's
/// records then count again, as they did before anything was learnt).
pub const MAX_ENDPOINTS: usize = 1024;

const VERSION: u8 = 1;
const ENTRY_LEN: usize = 4 + 8;

/// What the map told the router about the chosen endpoint, kept until the engine's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Predicted {
    /// Leading chunk keys the map said the endpoint held (0: none).
    pub held: usize,
    /// The map's last-use stamp of the deepest of them.
    pub stamp_ms: u64,
    /// Bytes of the rendered prompt the keys were cut from, and bytes per chunk.
    pub prompt_bytes: usize,
    pub chunk_size: usize,
    /// When the request was routed.
    pub routed_ms: u64,
}

impl Predicted {
    /// The prompt tokens the prediction stands for, scaled from bytes by the engine's own count.
    fn tokens(&self, prompt_tokens: u64) -> u64 {
        let bytes = self
            .held
            .saturating_mul(self.chunk_size)
            .min(self.prompt_bytes);
        match self.prompt_bytes {
            0 => 0,
            total => (prompt_tokens as u128 * bytes as u128 / total as u128) as u64,
        }
    }
}

/// Tokens, at least, the engine may cache less than predicted without it meaning an eviction:
/// engines cache whole blocks, never the prompt's last token, and chunk bytes map to tokens only
/// roughly.
pub const SLACK_TOKENS: u64 = 64;

/// The horizon the engine's report sets for the endpoint that served the request, if it shows
/// an eviction: the prediction's stamp, when that is at least `grace_ms` older than the request
/// and the engine cached clearly less (a quarter, and [`SLACK_TOKENS`]) than predicted.
pub fn horizon(predicted: &Predicted, usage: Usage, grace_ms: u64) -> Option<u64> {
    if predicted.held == 0 || predicted.routed_ms.saturating_sub(predicted.stamp_ms) < grace_ms {
        return None;
    }
    let expected = predicted.tokens(usage.prompt_tokens);
    let slack = (expected / 4).max(SLACK_TOKENS);
    (usage.cached_tokens.saturating_add(slack) < expected).then_some(predicted.stamp_ms)
}

/// Every endpoint's horizon.
pub fn read(store: &dyn SharedStore) -> HashMap<u32, u64> {
    let (value, _) = store.get(shared_keys::EVICTIONS);
    value.as_deref().map(decode).unwrap_or_default()
}

/// Raises `endpoint`'s horizon to `stamp_ms` (horizons never go back). Returns whether it moved.
pub fn raise(store: &dyn SharedStore, endpoint: u32, stamp_ms: u64) -> bool {
    let update = store::update(store, shared_keys::EVICTIONS, |current| {
        let mut horizons = current.map(decode).unwrap_or_default();
        let h = horizons.entry(endpoint).or_default();
        if *h >= stamp_ms {
            return None;
        }
        *h = stamp_ms;
        if horizons.len() > MAX_ENDPOINTS {
            let oldest = horizons
                .iter()
                .min_by_key(|&(id, h)| (*h, *id))
                .map(|(id, _)| *id);
            horizons.retain(|id, _| Some(*id) != oldest);
        }
        Some(encode(&horizons))
    });
    matches!(update, Update::Created | Update::Written)
}

/// Whether a record last used at `stamp_ms` still counts for `endpoint`.
pub fn still_held(horizons: &HashMap<u32, u64>, endpoint: u32, stamp_ms: u64) -> bool {
    horizons.get(&endpoint).is_none_or(|&h| stamp_ms > h)
}

fn encode(horizons: &HashMap<u32, u64>) -> Vec<u8> {
    let mut entries: Vec<(u32, u64)> = horizons.iter().map(|(&id, &h)| (id, h)).collect();
    entries.sort_unstable();
    let body: Vec<u8> = entries
        .iter()
        .flat_map(|(id, h)| id.to_le_bytes().into_iter().chain(h.to_le_bytes()))
        .collect();
    versioned(VERSION, &body)
}

/// Anything malformed (another version, a torn value) reads as no horizons.
fn decode(value: &[u8]) -> HashMap<u32, u64> {
    let Some(body) = store::unversioned(VERSION, value) else {
        return HashMap::new();
    };
    if body.len() % ENTRY_LEN != 0 {
        return HashMap::new();
    }
    body.chunks_exact(ENTRY_LEN)
        .filter_map(|e| {
            let id = u32::from_le_bytes(e.get(..4)?.try_into().ok()?);
            let h = u64::from_le_bytes(e.get(4..)?.try_into().ok()?);
            Some((id, h))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;

    /// 10 chunks of 100 bytes held out of a 2000-byte prompt, stamped 10 s before the request.
    fn predicted() -> Predicted {
        Predicted {
            held: 10,
            stamp_ms: 1_000,
            prompt_bytes: 2_000,
            chunk_size: 100,
            routed_ms: 11_000,
        }
    }

    fn usage(prompt_tokens: u64, cached_tokens: u64) -> Usage {
        Usage {
            prompt_tokens,
            cached_tokens,
        }
    }

    #[test]
    fn an_engine_that_cached_what_was_predicted_evicted_nothing() {
        // Half the prompt predicted: 500 of 1000 tokens; block rounding loses a few.
        assert_eq!(horizon(&predicted(), usage(1000, 496), 5_000), None);
        assert_eq!(horizon(&predicted(), usage(1000, 1000), 5_000), None);
        assert_eq!(
            horizon(&predicted(), usage(1000, 400), 5_000),
            None,
            "within a quarter of the prediction"
        );
    }

    #[test]
    fn an_engine_that_cached_much_less_evicted_and_the_horizon_is_the_records_stamp() {
        assert_eq!(horizon(&predicted(), usage(1000, 0), 5_000), Some(1_000));
        assert_eq!(horizon(&predicted(), usage(1000, 240), 5_000), Some(1_000));
    }

    #[test]
    fn a_record_younger_than_the_grace_may_still_be_prefilling() {
        assert_eq!(horizon(&predicted(), usage(1000, 0), 10_001), None);
        let fresh = Predicted {
            routed_ms: 1_200,
            ..predicted()
        };
        assert_eq!(horizon(&fresh, usage(1000, 0), 5_000), None);
    }

    #[test]
    fn nothing_predicted_or_a_short_prompt_proves_nothing() {
        let none = Predicted {
            held: 0,
            ..predicted()
        };
        assert_eq!(horizon(&none, usage(1000, 0), 0), None);
        // 40 tokens predicted: under the slack.
        assert_eq!(horizon(&predicted(), usage(80, 0), 0), None);
        let empty = Predicted {
            prompt_bytes: 0,
            ..predicted()
        };
        assert_eq!(horizon(&empty, usage(1000, 0), 0), None);
    }

    #[test]
    fn horizons_only_rise_and_hide_records_used_before_them() {
        let store = MemoryStore::new();
        assert!(raise(&store, 7, 100));
        assert!(!raise(&store, 7, 50), "a horizon never goes back");
        assert!(raise(&store, 8, 10));
        let h = read(&store);
        assert_eq!((h.get(&7), h.get(&8)), (Some(&100), Some(&10)));
        assert!(!still_held(&h, 7, 100));
        assert!(still_held(&h, 7, 101));
        assert!(
            still_held(&h, 9, 0),
            "an endpoint without a horizon keeps its records"
        );
    }

    #[test]
    fn the_table_stays_bounded_dropping_the_oldest_horizon() {
        let store = MemoryStore::new();
        for id in 0..=MAX_ENDPOINTS as u32 {
            raise(&store, id, 1_000 + u64::from(id));
        }
        let h = read(&store);
        assert_eq!(h.len(), MAX_ENDPOINTS);
        assert!(!h.contains_key(&0));
        assert_eq!(
            h.get(&(MAX_ENDPOINTS as u32)),
            Some(&(1_000 + MAX_ENDPOINTS as u64))
        );
    }

    #[test]
    fn a_value_of_another_version_or_torn_reads_as_no_horizons() {
        let store = MemoryStore::new();
        raise(&store, 7, 100);
        let (value, _) = store.get(shared_keys::EVICTIONS);
        let mut value = value.unwrap();
        value[0] = VERSION + 1;
        assert!(decode(&value).is_empty());
        value[0] = VERSION;
        value.pop();
        assert!(decode(&value).is_empty());
    }
}
