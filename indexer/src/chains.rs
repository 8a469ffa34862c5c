//! One engine stream's cached blocks, turned into kvroute's prefix keys.
//!
//! Each stored block keeps its place in the chain of the prompt it belongs to: its own bytes
//! (its tokens decoded), the key of the last whole chunk that ends in or before it, how many
//! bytes follow that chunk, and the keys of the chunks that end inside it. A child block picks
//! up its parent's state (the trailing bytes are read back from the ancestors' own bytes),
//! appends its bytes and completes further chunks. A key is held while every block up to the
//! one holding its chunk's last byte is held: removing a block drops it and its descendants.
//! vLLM does not deduplicate blocks, so the same hash may be stored (and removed) more than
//! once; a block lives until its last copy goes.
//!
//! Events are applied a batch (one message) at a time, and a removed block's descendants are
//! dropped when the batch ends unless the block came back in it: SGLang (up to 0.5.6) split a
//! radix node by removing its pages and storing them again as two nodes, in one batch, while the
//! node's children stayed cached. A hash names its whole prefix, so the block that comes back is
//! the one that went, and its descendants' keys still hold.
//!
//! SGLang publishes one event per page (`block_size` = its `--page-size`, 1 by default), each
//! chained to the previous page; the bytes after the last whole chunk are carried over from one
//! event to the next when it continues the block just stored, instead of being read back from
//! the ancestors. Pages named by SGLang's old content hashes ([`crate::content_hash`]) cannot be
//! placed in a chain and are counted, not indexed.

use crate::content_hash::python_tuple_hash;
use crate::dialect::Dialect;
use crate::holders::Holders;
use crate::token_bytes::TokenBytes;
use crate::wire::{Event, ExtraKey, Removed, Stored};
use hashbrown::HashMap;
use kvroute::prefix;

/// What the stream's keys depend on besides the blocks.
#[derive(Debug, Clone)]
pub struct Shape {
    /// The model name the engine serves (seeds the chain, as the filter's request model does).
    pub model: String,
    /// Bytes per chunk: the filter's `chunk_size`.
    pub chunk_size: usize,
}

/// Counters of one stream, for `/metrics`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counts {
    pub events: u64,
    pub blocks_stored: u64,
    pub blocks_removed: u64,
    pub clears: u64,
    /// Blocks whose parent was never seen (the stream was joined late, or after a gap).
    pub orphan_blocks: u64,
    /// Blocks with multimodal or prompt-embedding extra keys, and their descendants.
    pub multimodal_blocks: u64,
    /// Blocks on another medium than the GPU (offloaded copies), not counted as cached.
    pub other_medium_blocks: u64,
    /// Blocks of a KV-cache group other than the full-attention one (hybrid models).
    pub other_group_blocks: u64,
    /// Events that did not fit together (token count against block count, unknown token ids).
    pub malformed: u64,
    /// SGLang blocks named by a content hash (SGLang up to 0.5.5), not indexed.
    pub content_hash_blocks: u64,
}

#[derive(Debug)]
struct Block {
    parent: Option<u64>,
    /// Copies stored and not yet removed.
    copies: u32,
    /// False for a block that is not indexed (multimodal, or below one): no bytes, no keys.
    indexed: bool,
    /// The key of the last whole chunk ending here or earlier (the seed before the first).
    last_key: u64,
    /// Bytes after that chunk, up to the end of this block.
    pending: u32,
    bytes: Box<[u8]>,
    keys: Box<[u64]>,
    children: Vec<u64>,
}

/// One publisher's blocks (one engine, or one data-parallel rank of it).
#[derive(Debug)]
pub struct Stream {
    endpoint: u32,
    shape: Shape,
    dialect: Dialect,
    blocks: HashMap<u64, Block>,
    /// The KV-cache group whose blocks are indexed: the first full-attention one seen.
    group: Option<u64>,
    pub counts: Counts,
    /// After a store: the bytes following the last whole chunk of block `tail`.
    scratch: Vec<u8>,
    tail: Option<u64>,
    /// Children of the blocks removed in this batch, until the batch ends or the block is back.
    detached: HashMap<u64, Vec<u64>>,
}

/// Whether a `kv_cache_spec_kind` is attention over the whole prefix (absent: the engine has
/// one group, which is).
fn full_attention(kind: Option<&str>) -> bool {
    kind.is_none_or(|k| k.contains("full") || k.contains("mla"))
}

fn on_gpu(medium: Option<&str>) -> bool {
    medium.is_none_or(|m| m.eq_ignore_ascii_case("gpu"))
}

/// What a block's extra keys mean for the index.
enum Extra<'a> {
    None,
    /// The cache salt (first block of a prompt only).
    Salt(&'a str),
    /// Multimodal or embedding inputs: the bytes are not the prompt's text.
    Opaque,
}

/// Reads one block's `extra_keys`: vLLM puts there the LoRA name, multimodal identifiers (a
/// string in older versions, an `(identifier, offset)` pair now), the cache salt on a prompt's
/// first block, and prompt-embedding hashes, in that order.
fn classify<'a>(keys: &'a [ExtraKey], lora: Option<&str>, first: bool) -> Extra<'a> {
    let mut texts = Vec::new();
    for key in keys {
        match key {
            ExtraKey::Other => return Extra::Opaque,
            ExtraKey::Text(s) if Some(s.as_str()) == lora => {}
            ExtraKey::Text(s) => texts.push(s.as_str()),
        }
    }
    match (texts.as_slice(), first) {
        ([], _) => Extra::None,
        ([salt], true) => Extra::Salt(salt),
        _ => Extra::Opaque,
    }
}

impl Stream {
    /// A vLLM engine's stream.
    pub fn new(endpoint: u32, shape: Shape) -> Stream {
        Stream::with_dialect(endpoint, shape, Dialect::Vllm)
    }

    pub fn with_dialect(endpoint: u32, shape: Shape, dialect: Dialect) -> Stream {
        Stream {
            endpoint,
            shape,
            dialect,
            blocks: HashMap::new(),
            group: None,
            counts: Counts::default(),
            scratch: Vec::new(),
            tail: None,
            detached: HashMap::new(),
        }
    }

    pub fn dialect(&self) -> Dialect {
        self.dialect
    }

    pub fn endpoint(&self) -> u32 {
        self.endpoint
    }

    /// Cached blocks known (indexed or not).
    pub fn blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Applies one event, as a batch of its own.
    pub fn apply(&mut self, event: &Event, tokens: &TokenBytes, holders: &mut Holders) {
        self.apply_batch(std::slice::from_ref(event), tokens, holders);
    }

    /// Applies one message's events in order; then drops what lies below the blocks removed
    /// and not stored again.
    pub fn apply_batch(&mut self, events: &[Event], tokens: &TokenBytes, holders: &mut Holders) {
        for event in events {
            self.counts.events += 1;
            match event {
                Event::Stored(stored) => self.store(stored, tokens, holders),
                Event::Removed(removed) => self.remove(removed, holders),
                Event::AllCleared => {
                    self.counts.clears += 1;
                    self.clear(holders);
                }
            }
        }
        self.drop_detached(holders);
    }

    /// Forgets every block and releases every key (the engine cleared its cache, restarted, or
    /// the stream lost events).
    pub fn clear(&mut self, holders: &mut Holders) {
        // In key order: the feed must not depend on how the table hashes.
        let mut keys: Vec<u64> = self
            .blocks
            .values()
            .flat_map(|b| b.keys.iter().copied())
            .collect();
        keys.sort_unstable();
        for key in keys {
            holders.release(self.endpoint, key);
        }
        self.blocks.clear();
        self.detached.clear();
        self.group = None;
        self.tail = None;
    }

    fn store(&mut self, ev: &Stored, tokens: &TokenBytes, holders: &mut Holders) {
        let n = ev.block_hashes.len() as u64;
        if !on_gpu(ev.medium.as_deref()) {
            self.counts.other_medium_blocks += n;
            return;
        }
        let group = ev.group_idx.unwrap_or(0);
        if !full_attention(ev.kv_cache_spec_kind.as_deref())
            || *self.group.get_or_insert(group) != group
        {
            self.counts.other_group_blocks += n;
            return;
        }
        if ev.token_ids.len() != ev.block_hashes.len() * ev.block_size {
            self.counts.malformed += 1;
            return;
        }
        let first_page = ev.token_ids.get(..ev.block_size);
        if self.dialect == Dialect::Sglang
            && ev.block_hashes.first().copied() == first_page.map(python_tuple_hash)
        {
            self.counts.content_hash_blocks += n;
            return;
        }
        let chunk = self.shape.chunk_size;
        let mut pending = std::mem::take(&mut self.scratch);
        // What the scratch holds is the tail's, and only while the tail is not passed over.
        let continues = ev.parent.is_some() && ev.parent == self.tail.take();
        if !continues {
            pending.clear();
        }
        // The chain state before the first block: the seed, or the parent's.
        let (mut last_key, mut indexed) = match ev.parent {
            None => (0, true),
            Some(p) => match self.blocks.get(&p) {
                None => {
                    self.counts.orphan_blocks += n;
                    self.scratch = pending;
                    return;
                }
                Some(b) if !b.indexed => (0, false),
                Some(b) => {
                    if !continues {
                        self.trailing_bytes(p, &mut pending);
                    }
                    (b.last_key, true)
                }
            },
        };
        let mut parent = ev.parent;
        for (i, (&hash, ids)) in ev
            .block_hashes
            .iter()
            .zip(ev.token_ids.chunks_exact(ev.block_size))
            .enumerate()
        {
            self.counts.blocks_stored += 1;
            let first = i == 0 && ev.parent.is_none();
            let extra = ev.extra_keys.get(i).map_or(&[][..], Vec::as_slice);
            match classify(extra, ev.lora_name.as_deref(), first) {
                Extra::Opaque => indexed = false,
                Extra::Salt(salt) if indexed => {
                    last_key = prefix::seed(self.model(ev), Some(salt));
                }
                _ if first => last_key = prefix::seed(self.model(ev), ev.salt.as_deref()),
                _ => {}
            }
            if !indexed {
                self.counts.multimodal_blocks += 1;
            }
            let start = pending.len();
            if indexed && tokens.decode(ids, &mut pending).is_err() {
                self.counts.malformed += 1;
                pending.truncate(start);
                indexed = false;
            }
            if let Some(b) = self.blocks.get_mut(&hash) {
                // Another copy of a known block: same hash, same content; carry on from it.
                b.copies += 1;
                (last_key, indexed) = (b.last_key, b.indexed);
                pending.clear();
                self.trailing_bytes(hash, &mut pending);
                parent = Some(hash);
                continue;
            }
            let mut keys = Vec::new();
            let own = pending[start..].to_vec().into_boxed_slice();
            if indexed {
                let mut at = 0;
                while pending.len() - at >= chunk {
                    last_key = prefix::chain(last_key, &pending[at..at + chunk]);
                    keys.push(last_key);
                    holders.add(self.endpoint, last_key);
                    at += chunk;
                }
                pending.drain(..at);
            }
            if let Some(p) = parent.and_then(|p| self.blocks.get_mut(&p)) {
                p.children.push(hash);
            }
            // A block removed earlier in this batch is back: its descendants are its again.
            let children = match self.detached.remove(&hash) {
                Some(mut children) => {
                    let blocks = &self.blocks;
                    children.retain(|c| blocks.get(c).is_some_and(|b| b.parent == Some(hash)));
                    children
                }
                None => Vec::new(),
            };
            self.blocks.insert(
                hash,
                Block {
                    parent,
                    copies: 1,
                    indexed,
                    last_key,
                    pending: pending.len() as u32,
                    bytes: if indexed { own } else { Box::default() },
                    keys: keys.into_boxed_slice(),
                    children,
                },
            );
            parent = Some(hash);
        }
        if indexed {
            self.tail = parent;
        }
        self.scratch = pending;
    }

    fn model<'a>(&'a self, ev: &'a Stored) -> &'a str {
        // A LoRA adapter is served, and requested, under its own name.
        ev.lora_name.as_deref().unwrap_or(&self.shape.model)
    }

    /// The bytes after block `hash`'s last whole chunk, read back from it and its ancestors.
    fn trailing_bytes(&self, hash: u64, out: &mut Vec<u8>) {
        let Some(want) = self.blocks.get(&hash).map(|b| b.pending as usize) else {
            return;
        };
        let mut parts: Vec<&[u8]> = Vec::new();
        let mut have = 0;
        let mut at = Some(hash);
        while have < want {
            let Some(b) = at.and_then(|h| self.blocks.get(&h)) else {
                break;
            };
            parts.push(&b.bytes);
            have += b.bytes.len();
            at = b.parent;
        }
        let mut skip = have.saturating_sub(want);
        for part in parts.iter().rev() {
            let from = skip.min(part.len());
            out.extend_from_slice(&part[from..]);
            skip -= from;
        }
    }

    fn remove(&mut self, ev: &Removed, holders: &mut Holders) {
        if !on_gpu(ev.medium.as_deref()) {
            self.counts.other_medium_blocks += ev.block_hashes.len() as u64;
            return;
        }
        if ev.group_idx.is_some() && ev.group_idx != self.group {
            self.counts.other_group_blocks += ev.block_hashes.len() as u64;
            return;
        }
        self.tail = None;
        for &hash in &ev.block_hashes {
            let Some(b) = self.blocks.get_mut(&hash) else {
                continue;
            };
            self.counts.blocks_removed += 1;
            b.copies -= 1;
            if b.copies == 0 {
                self.detach(hash, holders);
            }
        }
    }

    /// Removes block `hash` alone, releasing its keys; its children wait for the batch's end.
    fn detach(&mut self, hash: u64, holders: &mut Holders) {
        let Some(b) = self.blocks.remove(&hash) else {
            return;
        };
        if let Some(p) = b.parent.and_then(|p| self.blocks.get_mut(&p)) {
            p.children.retain(|c| *c != hash);
        }
        for &key in b.keys.iter() {
            holders.release(self.endpoint, key);
        }
        if !b.children.is_empty() {
            self.detached.entry(hash).or_default().extend(b.children);
        }
    }

    /// The batch is over: drops the descendants of every block removed and not stored again.
    fn drop_detached(&mut self, holders: &mut Holders) {
        if self.detached.is_empty() {
            return;
        }
        // In hash order: the feed must not depend on how the table hashes.
        let mut gone: Vec<(u64, Vec<u64>)> = self.detached.drain().collect();
        gone.sort_unstable_by_key(|(hash, _)| *hash);
        for (hash, children) in gone {
            for child in children {
                if self
                    .blocks
                    .get(&child)
                    .is_some_and(|b| b.parent == Some(hash))
                {
                    self.drop_subtree(child, holders);
                }
            }
        }
    }

    /// Removes `hash` and every block below it, releasing their keys.
    fn drop_subtree(&mut self, hash: u64, holders: &mut Holders) {
        let parent = self.blocks.get(&hash).and_then(|b| b.parent);
        if let Some(p) = parent.and_then(|p| self.blocks.get_mut(&p)) {
            p.children.retain(|c| *c != hash);
        }
        let mut stack = vec![hash];
        while let Some(h) = stack.pop() {
            if let Some(b) = self.blocks.remove(&h) {
                for &key in b.keys.iter() {
                    holders.release(self.endpoint, key);
                }
                stack.extend(b.children);
            }
        }
    }

    /// Heap bytes of the block table, estimated.
    pub fn memory(&self) -> usize {
        let per_entry = std::mem::size_of::<(u64, Block)>() + 1;
        let own: usize = self
            .blocks
            .values()
            .map(|b| b.bytes.len() + b.keys.len() * 8 + b.children.capacity() * 8)
            .sum();
        self.blocks.capacity() * per_entry + own
    }
}
