//! vLLM-style automatic prefix cache: chained block hashes, pinned blocks, LRU eviction.
//!
//! A prompt is cut into full blocks of `block_size` tokens; block i is identified by
//! `hash(hash(block i-1), tokens of block i, extra keys of block i)`, so a hash names a whole
//! prefix. The only extra key simulated is vLLM's `cache_salt` (per-tenant cache isolation), which
//! vLLM's `generate_block_hash_extra_keys` gives the first block alone: it enters that block's
//! hash, and the chain carries it into every later one, so prompts under different salts (or one
//! salted, one not) share no block while prompts under the same salt share as usual. Token ids
//! stay as rendered; the salt travels in the first block's `extra_keys` of its KV event. The pool has
//! `capacity_blocks` blocks. Blocks used by running requests are pinned (reference count > 0);
//! blocks nobody uses stay cached until space is needed and are then evicted least recently
//! used first. Like vLLM's free queue, when a request finishes its *last* blocks become the
//! first eviction candidates, so the shared head of a prefix survives longest.
//!
//! Every change that a KV-event subscriber must see is queued as a [`CacheEvent`].

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap};
use xxhash_rust::xxh3::xxh3_64;

pub type BlockHash = u64;

/// Parent "hash" of the first block, a fixed seed (vLLM uses a random or configured seed).
const ROOT_SEED: u64 = 0x6b76_726f_7574_6531;

/// Chained hashes of every *full* block of `tokens`, a prompt (and what it generated) under
/// vLLM's `cache_salt` `salt`, if any: the first block's extra key.
pub fn block_hashes(tokens: &[u32], block_size: usize, salt: Option<&str>) -> Vec<BlockHash> {
    let mut parent = ROOT_SEED;
    let mut buf = Vec::with_capacity(8 + 4 * block_size);
    tokens
        .chunks_exact(block_size.max(1))
        .enumerate()
        .map(|(i, block)| {
            buf.clear();
            buf.extend_from_slice(&parent.to_le_bytes());
            for t in block {
                buf.extend_from_slice(&t.to_le_bytes());
            }
            // A block's tokens have a fixed length, so the salt's bytes cannot pass for tokens.
            if let (0, Some(salt)) = (i, salt) {
                buf.extend_from_slice(salt.as_bytes());
            }
            parent = xxh3_64(&buf);
            parent
        })
        .collect()
}

/// How many of `matched` leading cached blocks a prompt of `prompt_len` tokens can use.
/// vLLM always recomputes at least the last prompt token (it needs its logits), so a fully
/// cached prompt whose length is a multiple of the block size reuses one block less.
pub fn usable_hit_blocks(matched: usize, prompt_len: usize, block_size: usize) -> usize {
    matched.min(prompt_len.saturating_sub(1) / block_size.max(1))
}

/// A change to the cache contents, in the vocabulary of vLLM's KV events.
#[derive(Debug, Clone, PartialEq)]
pub enum CacheEvent {
    /// A contiguous chain of newly cached blocks; `parent` is the block before the first.
    Stored {
        hashes: Vec<BlockHash>,
        parent: Option<BlockHash>,
        token_ids: Vec<u32>,
        /// The prompt's `cache_salt` when the chain starts at its first block (`parent` is
        /// `None`): that block's extra key. Later blocks have none.
        salt: Option<String>,
    },
    Removed {
        hashes: Vec<BlockHash>,
    },
    AllCleared,
}

#[derive(Debug)]
struct Block {
    pins: u32,
    /// Position in `lru` while unpinned.
    lru_tick: u64,
}

/// The blocks a running request holds; give it back with [`PrefixCache::release`].
#[derive(Debug, Default)]
pub struct Lease {
    /// The prompt's full blocks, all pinned.
    pinned: Vec<BlockHash>,
    /// Unhashed blocks: the prompt's partial tail and blocks grown during decode.
    private_blocks: usize,
    /// Prompt tokens served from cache.
    pub hit_tokens: usize,
    /// The prompt's `cache_salt`: the sequence's blocks are hashed under it at release too.
    salt: Option<String>,
}

impl Lease {
    /// Blocks this request occupies in the pool.
    pub fn blocks_held(&self) -> usize {
        self.pinned.len() + self.private_blocks
    }
}

#[derive(Debug)]
pub struct PrefixCache {
    block_size: usize,
    capacity_blocks: usize,
    blocks: HashMap<BlockHash, Block>,
    /// Unpinned cached blocks, oldest first.
    lru: BTreeMap<u64, BlockHash>,
    tick: u64,
    pinned_blocks: usize,
    private_blocks: usize,
    events: Vec<CacheEvent>,
}

impl PrefixCache {
    pub fn new(block_size: usize, capacity_tokens: usize) -> Self {
        let block_size = block_size.max(1);
        PrefixCache {
            block_size,
            capacity_blocks: (capacity_tokens / block_size).max(1),
            blocks: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
            pinned_blocks: 0,
            private_blocks: 0,
            events: Vec::new(),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn capacity_blocks(&self) -> usize {
        self.capacity_blocks
    }

    /// Cached blocks, pinned or not.
    pub fn cached_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Fraction of the pool held by running requests, as vLLM's `kv_cache_usage_perc`
    /// (evictable cached blocks count as free).
    pub fn usage(&self) -> f64 {
        (self.pinned_blocks + self.private_blocks) as f64 / self.capacity_blocks as f64
    }

    /// Number of leading blocks of `hashes` that are cached right now.
    pub fn matched_blocks(&self, hashes: &[BlockHash]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.blocks.contains_key(h))
            .count()
    }

    /// Prompt tokens a new request with these tokens (under the cache salt `salt`) would get
    /// from cache right now.
    pub fn cached_tokens(&self, tokens: &[u32], salt: Option<&str>) -> usize {
        let hashes = block_hashes(tokens, self.block_size, salt);
        usable_hit_blocks(self.matched_blocks(&hashes), tokens.len(), self.block_size)
            * self.block_size
    }

    /// Allocates the blocks a prompt needs: pins its cached prefix, evicts as needed and
    /// caches its remaining full blocks (vLLM caches them when they are scheduled, before
    /// the forward pass finishes). Returns `None`, changing nothing, if running requests
    /// pin too much of the pool for the prompt to fit; the caller waits and retries. `salt` is
    /// the request's `cache_salt`.
    pub fn admit(&mut self, tokens: &[u32], salt: Option<&str>) -> Option<Lease> {
        let hashes = block_hashes(tokens, self.block_size, salt);
        let matched = self.matched_blocks(&hashes);
        let partial = usize::from(!tokens.len().is_multiple_of(self.block_size));
        let new_hashed = hashes[matched..]
            .iter()
            .filter(|h| !self.blocks.contains_key(h))
            .count();
        let needed = new_hashed + partial;
        // Blocks this prompt is about to pin cannot be evicted to make room for it.
        let evictable_elsewhere = self.lru.len()
            - hashes
                .iter()
                .filter(|h| self.blocks.get(h).is_some_and(|b| b.pins == 0))
                .count();
        if self.free_blocks() + evictable_elsewhere < needed {
            return None;
        }
        for h in &hashes[..matched] {
            self.pin(*h);
        }
        self.make_room(needed);
        let mut run: Vec<usize> = Vec::new();
        for i in matched..hashes.len() {
            if let Entry::Vacant(slot) = self.blocks.entry(hashes[i]) {
                slot.insert(Block {
                    pins: 1,
                    lru_tick: 0,
                });
                self.pinned_blocks += 1;
                run.push(i);
            } else {
                self.flush_stored_run(&mut run, &hashes, tokens, salt);
                self.pin(hashes[i]);
            }
        }
        self.flush_stored_run(&mut run, &hashes, tokens, salt);
        self.private_blocks += partial;
        Some(Lease {
            pinned: hashes,
            private_blocks: partial,
            hit_tokens: usable_hit_blocks(matched, tokens.len(), self.block_size) * self.block_size,
            salt: salt.map(str::to_string),
        })
    }

    /// Takes one more unhashed block for a decoding request. Returns false if the pool is
    /// full of pinned blocks (vLLM would preempt; the simulator just stops counting).
    pub fn grow(&mut self, lease: &mut Lease) -> bool {
        if self.free_blocks() + self.lru.len() == 0 {
            return false;
        }
        self.make_room(1);
        self.private_blocks += 1;
        lease.private_blocks += 1;
        true
    }

    /// Returns a finished (or aborted) request's blocks. `sequence` is its prompt plus the
    /// tokens it generated: newly completed full blocks of it are cached too, as vLLM does
    /// for output blocks, so the next turn of a conversation can hit them.
    pub fn release(&mut self, lease: Lease, sequence: &[u32]) {
        let salt = lease.salt.as_deref();
        let hashes = block_hashes(sequence, self.block_size, salt);
        let start = lease.pinned.len().min(hashes.len());
        // Output blocks reuse the request's private blocks, so the pool size is unchanged.
        let mut converted = 0;
        let mut run = Vec::new();
        for i in start..hashes.len() {
            if converted == lease.private_blocks {
                break;
            }
            if self.blocks.contains_key(&hashes[i]) {
                self.flush_stored_run(&mut run, &hashes, sequence, salt);
                break;
            }
            self.blocks.insert(
                hashes[i],
                Block {
                    pins: 0,
                    lru_tick: 0,
                },
            );
            converted += 1;
            run.push(i);
        }
        self.flush_stored_run(&mut run, &hashes, sequence, salt);
        self.private_blocks -= lease.private_blocks.min(self.private_blocks);
        // Tail first: give the last block the oldest tick so it is evicted first.
        let released = lease.pinned.iter().chain(&hashes[start..start + converted]);
        let released: Vec<BlockHash> = released.copied().collect();
        for h in released.iter().rev() {
            self.unpin_or_enqueue(*h);
        }
    }

    /// Drops every unpinned block (vLLM's `reset_prefix_cache`).
    pub fn clear(&mut self) {
        let victims: Vec<BlockHash> = self.lru.values().copied().collect();
        for h in &victims {
            self.blocks.remove(h);
        }
        self.lru.clear();
        // vLLM publishes it on every reset, whether anything was cached or not.
        self.events.push(CacheEvent::AllCleared);
    }

    /// Events since the last call, oldest first.
    pub fn take_events(&mut self) -> Vec<CacheEvent> {
        std::mem::take(&mut self.events)
    }

    fn free_blocks(&self) -> usize {
        self.capacity_blocks
            .saturating_sub(self.blocks.len() + self.private_blocks)
    }

    fn make_room(&mut self, needed: usize) {
        let mut removed = Vec::new();
        while self.free_blocks() < needed {
            let Some((_, victim)) = self.lru.pop_first() else {
                break;
            };
            self.blocks.remove(&victim);
            removed.push(victim);
        }
        if !removed.is_empty() {
            self.events.push(CacheEvent::Removed { hashes: removed });
        }
    }

    fn pin(&mut self, h: BlockHash) {
        if let Some(block) = self.blocks.get_mut(&h) {
            if block.pins == 0 {
                self.lru.remove(&block.lru_tick);
                self.pinned_blocks += 1;
            }
            block.pins += 1;
        }
    }

    fn unpin_or_enqueue(&mut self, h: BlockHash) {
        let Some(block) = self.blocks.get_mut(&h) else {
            return;
        };
        if block.pins > 0 {
            block.pins -= 1;
            if block.pins > 0 {
                return;
            }
            self.pinned_blocks -= 1;
        } else {
            // Already unpinned (a freshly cached output block): refresh its position.
            self.lru.remove(&block.lru_tick);
        }
        self.tick += 1;
        block.lru_tick = self.tick;
        self.lru.insert(self.tick, h);
    }

    fn flush_stored_run(
        &mut self,
        run: &mut Vec<usize>,
        hashes: &[BlockHash],
        tokens: &[u32],
        salt: Option<&str>,
    ) {
        let (Some(&first), Some(&last)) = (run.first(), run.last()) else {
            return;
        };
        let bs = self.block_size;
        let parent = first.checked_sub(1).map(|p| hashes[p]);
        self.events.push(CacheEvent::Stored {
            hashes: run.iter().map(|&i| hashes[i]).collect(),
            parent,
            token_ids: tokens[first * bs..(last + 1) * bs].to_vec(),
            salt: salt.filter(|_| parent.is_none()).map(str::to_string),
        });
        run.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(seed: u32, n: usize) -> Vec<u32> {
        (0..n as u32).map(|i| seed * 100_000 + i).collect()
    }

    #[test]
    fn hashes_chain_so_equal_prefixes_share_hashes_and_only_full_blocks_count() {
        let a = toks(1, 40);
        let mut b = a[..32].to_vec();
        b.extend(toks(2, 8));
        let (ha, hb) = (block_hashes(&a, 16, None), block_hashes(&b, 16, None));
        assert_eq!(ha.len(), 2);
        assert_eq!(ha, hb);
        let mut c = a.clone();
        c[0] = 999;
        let hc = block_hashes(&c, 16, None);
        assert_ne!(ha[0], hc[0]);
        assert_ne!(
            ha[1], hc[1],
            "a change in block 0 must change every later hash"
        );
    }

    #[test]
    fn the_cache_salt_keys_the_first_block_and_so_the_whole_chain() {
        let doc = toks(1, 48);
        let (plain, a, a2, b) = (
            block_hashes(&doc, 16, None),
            block_hashes(&doc, 16, Some("a")),
            block_hashes(&doc, 16, Some("a")),
            block_hashes(&doc, 16, Some("b")),
        );
        assert_eq!(a, a2, "the same salt, the same blocks");
        for (x, y) in [(&a, &plain), (&a, &b), (&b, &plain)] {
            assert!(x.iter().all(|h| !y.contains(h)), "no block shared");
        }
        // The salt is the first block's key, not a token: a short prompt has none to key.
        assert!(block_hashes(&doc[..15], 16, Some("a")).is_empty());
    }

    #[test]
    fn salted_prompts_hit_only_under_their_own_salt() {
        let mut cache = PrefixCache::new(16, 1600);
        let prompt = toks(1, 40);
        let lease = cache.admit(&prompt, Some("a")).unwrap();
        assert_eq!(lease.hit_tokens, 0);
        // Its output completes a third block, cached under the salt too.
        let mut seq = prompt.clone();
        seq.extend(toks(2, 8));
        cache.release(lease, &seq);
        assert_eq!(cache.cached_tokens(&seq, Some("a")), 32);
        assert_eq!(cache.cached_tokens(&prompt, None), 0);
        assert_eq!(cache.cached_tokens(&prompt, Some("b")), 0);
        assert_eq!(cache.admit(&prompt, None).unwrap().hit_tokens, 0);
        assert_eq!(cache.admit(&prompt, Some("b")).unwrap().hit_tokens, 0);
        assert_eq!(cache.admit(&seq, Some("a")).unwrap().hit_tokens, 32);
        assert_eq!(cache.matched_blocks(&block_hashes(&seq, 16, Some("a"))), 3);
    }

    #[test]
    fn the_salt_travels_with_the_first_block_only() {
        let mut cache = PrefixCache::new(4, 64);
        let a: Vec<u32> = (0..8).collect();
        let l = cache.admit(&a, Some("t")).unwrap();
        let ha = block_hashes(&a, 4, Some("t"));
        assert_eq!(
            cache.take_events(),
            vec![CacheEvent::Stored {
                hashes: ha.clone(),
                parent: None,
                token_ids: a.clone(),
                salt: Some("t".into()),
            }]
        );
        // A longer prompt under the salt stores only its new block, whose parent is cached.
        cache.release(l, &a);
        let mut b = a.clone();
        b.extend(100..104);
        cache.admit(&b, Some("t")).unwrap();
        assert_eq!(
            cache.take_events(),
            vec![CacheEvent::Stored {
                hashes: vec![block_hashes(&b, 4, Some("t"))[2]],
                parent: Some(ha[1]),
                token_ids: (100..104).collect(),
                salt: None,
            }]
        );
    }

    #[test]
    fn second_request_with_same_prefix_hits_full_blocks_only() {
        let mut cache = PrefixCache::new(16, 1600);
        let prompt = toks(1, 40);
        let lease = cache.admit(&prompt, None).unwrap();
        assert_eq!(lease.hit_tokens, 0);
        cache.release(lease, &prompt);
        let lease2 = cache.admit(&prompt, None).unwrap();
        assert_eq!(lease2.hit_tokens, 32);
        assert_eq!(cache.cached_tokens(&prompt, None), 32);
    }

    #[test]
    fn fully_cached_block_aligned_prompt_recomputes_its_last_block() {
        let mut cache = PrefixCache::new(16, 1600);
        let prompt = toks(1, 32);
        let lease = cache.admit(&prompt, None).unwrap();
        cache.release(lease, &prompt);
        assert_eq!(cache.admit(&prompt, None).unwrap().hit_tokens, 16);
    }

    #[test]
    fn lru_evicts_least_recently_used_unpinned_blocks() {
        // Room for 4 blocks: two 2-block prompts fill it.
        let mut cache = PrefixCache::new(16, 64);
        let (a, b, c) = (toks(1, 32), toks(2, 32), toks(3, 32));
        for p in [&a, &b] {
            let l = cache.admit(p, None).unwrap();
            cache.release(l, p);
        }
        // Touch `a` so `b` becomes the oldest.
        let l = cache.admit(&a, None).unwrap();
        cache.release(l, &a);
        let l = cache.admit(&c, None).unwrap();
        cache.release(l, &c);
        assert_eq!(cache.matched_blocks(&block_hashes(&a, 16, None)), 2);
        assert_eq!(cache.matched_blocks(&block_hashes(&b, 16, None)), 0);
        assert_eq!(cache.matched_blocks(&block_hashes(&c, 16, None)), 2);
    }

    #[test]
    fn tail_blocks_are_evicted_before_the_shared_head() {
        let mut cache = PrefixCache::new(16, 64);
        let a = toks(1, 64);
        let l = cache.admit(&a, None).unwrap();
        cache.release(l, &a);
        let b = toks(2, 16);
        let l = cache.admit(&b, None).unwrap();
        cache.release(l, &b);
        // One block had to go, and it was a's last one.
        assert_eq!(cache.matched_blocks(&block_hashes(&a, 16, None)), 3);
    }

    #[test]
    fn pinned_blocks_are_never_evicted_and_admission_waits_when_pool_is_pinned() {
        let mut cache = PrefixCache::new(16, 64);
        let a = toks(1, 48);
        let held = cache.admit(&a, None).unwrap();
        assert!((cache.usage() - 0.75).abs() < 1e-9);
        // Needs 2 blocks, only 1 free and nothing evictable.
        assert!(cache.admit(&toks(2, 32), None).is_none());
        assert_eq!(cache.matched_blocks(&block_hashes(&a, 16, None)), 3);
        cache.release(held, &a);
        assert_eq!(cache.usage(), 0.0);
        assert!(cache.admit(&toks(2, 32), None).is_some());
        // `a`'s tail went first; its head is still cached.
        assert_eq!(cache.matched_blocks(&block_hashes(&a, 16, None)), 2);
    }

    #[test]
    fn a_prompt_does_not_evict_its_own_prefix_to_make_room() {
        let mut cache = PrefixCache::new(16, 48);
        let a = toks(1, 32);
        let l = cache.admit(&a, None).unwrap();
        cache.release(l, &a);
        let mut longer = a.clone();
        longer.extend(toks(2, 16));
        let lease = cache.admit(&longer, None).unwrap();
        assert_eq!(lease.hit_tokens, 32);
        assert!(cache.admit(&toks(3, 16), None).is_none());
    }

    #[test]
    fn events_describe_stores_with_parents_and_tail_first_removals() {
        let mut cache = PrefixCache::new(4, 12); // 3 blocks
        let a: Vec<u32> = (0..8).collect();
        let l = cache.admit(&a, None).unwrap();
        let ha = block_hashes(&a, 4, None);
        assert_eq!(
            cache.take_events(),
            vec![CacheEvent::Stored {
                hashes: ha.clone(),
                parent: None,
                token_ids: a.clone(),
                salt: None,
            }]
        );
        cache.release(l, &a);
        let mut b = a.clone();
        b.extend(100..104);
        let hb = block_hashes(&b, 4, None);
        let l = cache.admit(&b, None).unwrap();
        assert_eq!(
            cache.take_events(),
            vec![CacheEvent::Stored {
                hashes: vec![hb[2]],
                parent: Some(hb[1]),
                token_ids: (100..104).collect(),
                salt: None,
            }]
        );
        cache.release(l, &b);
        let c: Vec<u32> = (200..208).collect();
        let _l = cache.admit(&c, None).unwrap();
        let ev = cache.take_events();
        assert_eq!(
            ev[0],
            CacheEvent::Removed {
                hashes: vec![hb[2], hb[1]]
            }
        );
        assert!(matches!(&ev[1], CacheEvent::Stored { parent: None, .. }));
        assert_eq!(ev.len(), 2);
    }

    #[test]
    fn clear_drops_idle_blocks_but_keeps_pinned_ones() {
        let mut cache = PrefixCache::new(16, 1600);
        let (a, b) = (toks(1, 32), toks(2, 32));
        let l = cache.admit(&a, None).unwrap();
        cache.release(l, &a);
        let _held = cache.admit(&b, None).unwrap();
        cache.take_events();
        cache.clear();
        assert_eq!(cache.matched_blocks(&block_hashes(&a, 16, None)), 0);
        assert_eq!(cache.matched_blocks(&block_hashes(&b, 16, None)), 2);
        assert_eq!(cache.take_events(), vec![CacheEvent::AllCleared]);
        cache.clear();
        assert_eq!(
            cache.take_events(),
            vec![CacheEvent::AllCleared],
            "even empty"
        );
    }

    #[test]
    fn output_blocks_are_cached_at_release_for_the_next_turn() {
        let mut cache = PrefixCache::new(16, 1600);
        let prompt = toks(1, 20);
        let mut lease = cache.admit(&prompt, None).unwrap();
        assert!(cache.grow(&mut lease));
        let mut seq = prompt.clone();
        seq.extend(toks(2, 20)); // 40 tokens: 2 full blocks
        cache.release(lease, &seq);
        assert_eq!(cache.matched_blocks(&block_hashes(&seq, 16, None)), 2);
        assert_eq!(cache.usage(), 0.0);
    }
}
