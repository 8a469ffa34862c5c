//! What the workload allows: its prefix hit rate with an unbounded cache and perfect routing (the
//! ceiling), with the fleet's KV capacity and the best eviction there is (the capacity bound), and
//! with the fleet's capacity as one least-recently-used cache (what routing gets from engines that
//! evict the least recently used block, were no prefix ever held twice). Counted the way the
//! simulator counts hits (whole blocks of its tokenizer's tokens, the last prompt token always
//! recomputed), over the same requests the routers were sent.

use crate::workload::{Api, Workload};
use kvroute_sim::bpe::Vocab;
use kvroute_sim::prefix_cache::{block_hashes, usable_hit_blocks, BlockHash, PrefixCache};
use kvroute_sim::request::{cache_salt, prompt_tokens_in, Endpoint};
use kvroute_sim::spec::FleetSpec;
use serde_json::{json, Value};
use std::collections::{BTreeSet, HashMap, HashSet};

/// The three hit rates of one workload on one fleet.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bounds {
    /// Every prefix computed once fleet-wide: no router can beat it.
    pub ceiling: f64,
    /// The fleet's KV blocks as one cache that always evicts the block needed furthest in the
    /// future (Belady's MIN): no router can beat it on this fleet either, since whatever replicas
    /// a router uses, they never hold more distinct blocks than that, and a block enters them only
    /// with a request that contains it.
    pub capacity: f64,
    /// The fleet's KV blocks as one LRU cache, the engines' own eviction: not a bound (a router
    /// that keeps rarely used prefixes away from hot ones can do better), a reference.
    pub fleet_lru: f64,
}

impl Bounds {
    /// The rates to the five decimals results.json keeps.
    pub fn rounded(self) -> Bounds {
        let round = |x: f64| (x * 1e5).round() / 1e5;
        Bounds {
            ceiling: round(self.ceiling),
            capacity: round(self.capacity),
            fleet_lru: round(self.fleet_lru),
        }
    }
}

/// A prompt as the simulator's cache keys it: its token ids and its `cache_salt`.
type Prompt = (Vec<u32>, Option<String>);

/// The prompts of the first `sent` requests of `workload`, tokenized as the simulator does, the
/// readiness probe each run sends first in front (it is in the caches too, though not counted).
fn prompts(workload: &Workload, spec: &FleetSpec, sent: usize) -> Result<Vec<Prompt>, String> {
    let endpoint = match workload.api {
        Api::Chat => Endpoint::Chat,
        Api::Completions => Endpoint::Completion,
    };
    // The fleet's tokenizer file when it names one, else the simulator's hash tokenizer.
    let vocab = match &spec.tokenizer {
        Some(path) => Vocab::load(std::path::Path::new(path))?,
        None => Vocab::Hash,
    };
    let tokens = |body: &Value| {
        let (tokens, _) = prompt_tokens_in(&vocab, endpoint, body)?;
        Ok((tokens, cache_salt(body)?))
    };
    let ping = match workload.api {
        Api::Chat => {
            json!({"model": spec.model, "messages": [{"role": "user", "content": "ping"}]})
        }
        Api::Completions => json!({"model": spec.model, "prompt": "ping"}),
    };
    std::iter::once(ping)
        .chain(workload.stream(&spec.model).take(sent).map(|r| r.body))
        .map(|body| tokens(&body))
        .collect()
}

/// The hit rates of the first `sent` requests of `workload` on the fleet `fleet_spec`.
pub fn bounds(workload: &Workload, fleet_spec: &Value, sent: usize) -> Result<Bounds, String> {
    let spec: FleetSpec =
        serde_json::from_value(fleet_spec.clone()).map_err(|e| format!("fleet spec: {e}"))?;
    let bs = spec.block_size.max(1);
    let prompts = prompts(workload, &spec, sent)?;
    let hashes: Vec<Vec<BlockHash>> = prompts
        .iter()
        .map(|(t, salt)| block_hashes(t, bs, salt.as_deref()))
        .collect();
    let lens: Vec<usize> = prompts.iter().map(|(t, _)| t.len()).collect();
    let fleet_blocks = spec.replicas.max(1) * (spec.kv_capacity_tokens / bs).max(1);
    Ok(Bounds {
        ceiling: ceiling(&hashes, &lens, bs),
        capacity: capacity_bound(&hashes, &lens, bs, fleet_blocks),
        fleet_lru: fleet_lru(&prompts, &lens, bs, fleet_blocks * bs),
    })
}

/// The bounds as results.md says them, in percent.
pub fn describe(ceiling: f64, capacity: f64, fleet_lru: f64) -> String {
    format!(
        "What the workload allows: {:.1}% with an unbounded cache (the ceiling), {:.1}% with the fleet's KV blocks and the best eviction (the capacity bound), {:.1}% with the fleet's KV blocks as one LRU cache.",
        ceiling * 100.0,
        capacity * 100.0,
        fleet_lru * 100.0
    )
}

/// Hit tokens over prompt tokens, the first prompt (the probe) not counted.
fn rate(hit_blocks: impl IntoIterator<Item = usize>, lens: &[usize], bs: usize) -> f64 {
    let hits: usize = hit_blocks.into_iter().skip(1).map(|b| b * bs).sum();
    let queries: usize = lens.iter().skip(1).sum();
    hits as f64 / queries.max(1) as f64
}

/// One infinite cache.
fn ceiling(hashes: &[Vec<BlockHash>], lens: &[usize], bs: usize) -> f64 {
    let mut cached: HashSet<BlockHash> = HashSet::new();
    let hits = hashes.iter().zip(lens).map(|(h, &len)| {
        let matched = h.iter().take_while(|b| cached.contains(b)).count();
        cached.extend(h);
        usable_hit_blocks(matched, len, bs)
    });
    rate(hits, lens, bs)
}

/// One cache of `blocks` blocks under Belady's MIN, every block of every prompt an access. It
/// counts every cached block of a prompt, not only a cached prefix, which is at least what any
/// router's replicas can have cached of it.
fn capacity_bound(hashes: &[Vec<BlockHash>], lens: &[usize], bs: usize, blocks: usize) -> f64 {
    let accesses: Vec<BlockHash> = hashes.iter().flatten().copied().collect();
    // For each access, the position of the next access to the same block.
    let mut next = vec![usize::MAX; accesses.len()];
    let mut seen: HashMap<BlockHash, usize> = HashMap::new();
    for (i, b) in accesses.iter().enumerate().rev() {
        if let Some(j) = seen.insert(*b, i) {
            next[i] = j;
        }
    }
    // The cache, ordered by next use (furthest last), and each cached block's next use.
    let mut by_next: BTreeSet<(usize, BlockHash)> = BTreeSet::new();
    let mut next_of: HashMap<BlockHash, usize> = HashMap::new();
    let mut at = 0;
    let mut hits = Vec::with_capacity(hashes.len());
    for (h, &len) in hashes.iter().zip(lens) {
        let mut hit = 0;
        for b in h {
            match next_of.get(b) {
                Some(&n) => {
                    hit += 1;
                    by_next.remove(&(n, *b));
                }
                None => {
                    if next_of.len() >= blocks {
                        if let Some((n, victim)) = by_next.pop_last() {
                            next_of.remove(&victim);
                            debug_assert!(n >= at);
                        }
                    }
                }
            }
            next_of.insert(*b, next[at]);
            by_next.insert((next[at], *b));
            at += 1;
        }
        hits.push(hit.min(len.saturating_sub(1) / bs));
    }
    rate(hits, lens, bs)
}

/// One simulator cache of `tokens` tokens, each prompt admitted and released in turn.
fn fleet_lru(prompts: &[Prompt], lens: &[usize], bs: usize, tokens: usize) -> f64 {
    let mut cache = PrefixCache::new(bs, tokens);
    let hits = prompts.iter().map(|(t, salt)| {
        let salt = salt.as_deref();
        let hit = cache.cached_tokens(t, salt) / bs;
        // A prompt larger than the whole fleet's cache is not cached at all.
        if let Some(lease) = cache.admit(t, salt) {
            cache.release(lease, t);
        }
        hit
    });
    rate(hits, lens, bs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn zipf() -> Workload {
        Workload::from_file(
            &crate::paths::workspace_root().join("bench/workloads/zipf-pressure.json"),
        )
        .unwrap()
    }

    #[test]
    fn repeated_prefixes_hit_and_the_ceiling_is_a_rate() {
        let fleet = json!({"replicas": 4, "kv_capacity_tokens": 9216});
        let few = bounds(&zipf(), &fleet, 1).unwrap();
        assert_eq!(few.ceiling, 0.0, "the first request hits nothing");
        let many = bounds(&zipf(), &fleet, 400).unwrap().ceiling;
        assert!(many > 0.5 && many < 1.0, "{many}");
    }

    #[test]
    fn a_small_fleet_is_bounded_below_the_ceiling_and_lru_below_the_bound() {
        let small = json!({"replicas": 4, "kv_capacity_tokens": 9216});
        let b = bounds(&zipf(), &small, 400).unwrap();
        assert!(b.capacity < b.ceiling - 0.02, "{b:?}");
        assert!(b.fleet_lru < b.capacity - 0.02, "{b:?}");
        assert!(b.fleet_lru > 0.3, "{b:?}");
    }

    #[test]
    fn a_fleet_that_holds_everything_reaches_the_ceiling() {
        let big = json!({"replicas": 4, "kv_capacity_tokens": 10_000_000});
        let b = bounds(&zipf(), &big, 400).unwrap();
        assert!((b.capacity - b.ceiling).abs() < 1e-9, "{b:?}");
        assert!((b.fleet_lru - b.ceiling).abs() < 1e-9, "{b:?}");
    }

    #[test]
    fn min_keeps_the_block_needed_soonest() {
        // Blocks a, b, c in a cache of two: a b c a b ... MIN keeps a and evicts b at c's miss
        // (b is needed after a), so the second a hits and the second b misses.
        let (a, b, c) = (vec![1u64], vec![2u64], vec![3u64]);
        let hashes = vec![vec![], a.clone(), b.clone(), c, a, b];
        let lens = vec![1, 17, 17, 17, 17, 17];
        let r = capacity_bound(&hashes, &lens, 16, 2);
        assert!((r - 16.0 / 85.0).abs() < 1e-9, "{r}");
    }
}
