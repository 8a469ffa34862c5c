//! Engine blocks → kvroute keys, on constructed events: the keys of a stored chain are
//! `kvroute::prefix`'s over its bytes, whole chunks only, however the chain arrives; removals,
//! clears, salts, LoRA, multimodal blocks, media and groups.

use crate::common;

use common::whole_chunk_keys;
use kvroute_indexer::chains::{self, Stream};
use kvroute_indexer::holders::Holders;
use kvroute_indexer::token_bytes::TokenBytes;
use kvroute_indexer::wire::{Event, ExtraKey, Removed, Stored};
use std::collections::BTreeSet;

const BLOCK: usize = 4;
const CHUNK: usize = 8;
const MODEL: &str = "m";

/// Token `i` is byte `i`: a block's bytes are its token ids.
fn bytes_vocab() -> TokenBytes {
    let pieces: Vec<[u8; 1]> = (0..=255u8).map(|b| [b]).collect();
    TokenBytes::from_pieces(&pieces)
}

fn setup() -> (Stream, Holders, TokenBytes) {
    let mut holders = Holders::new(1 << 16);
    let e = holders.endpoint("127.0.0.1:8000");
    let shape = chains::Shape {
        model: MODEL.into(),
        chunk_size: CHUNK,
    };
    (Stream::new(e, shape), holders, bytes_vocab())
}

/// Block hashes for `text`'s blocks: the text so far, hashed (like a chain).
fn hashes(text: &[u8], salt: u64) -> Vec<u64> {
    (1..=text.len() / BLOCK)
        .map(|i| xxhash_rust::xxh3::xxh3_64_with_seed(&text[..i * BLOCK], salt))
        .collect()
}

/// A BlockStored of blocks `from..to` of `text`.
fn stored(text: &[u8], from: usize, to: usize, salt: u64) -> Stored {
    let h = hashes(text, salt);
    Stored {
        block_hashes: h[from..to].to_vec(),
        parent: from.checked_sub(1).map(|p| h[p]),
        token_ids: text[from * BLOCK..to * BLOCK]
            .iter()
            .map(|&b| u32::from(b))
            .collect(),
        block_size: BLOCK,
        ..Stored::default()
    }
}

fn expected(text: &[u8], blocks: usize, salt: Option<&str>, model: &str) -> BTreeSet<u64> {
    whole_chunk_keys(salt, model, &text[..blocks * BLOCK], CHUNK)
}

fn held(h: &Holders) -> BTreeSet<u64> {
    h.keys(0).into_iter().collect()
}

/// Multi-byte characters cut across blocks and chunks.
const TEXT: &str = "Grüße aus Köln! 漢字とかな and some more text to fill the blocks 🙂.";

#[test]
fn one_event_gives_the_keys_of_its_whole_chunks() {
    let (mut s, mut h, t) = setup();
    let text = TEXT.as_bytes();
    let n = text.len() / BLOCK;
    s.apply(&Event::Stored(stored(text, 0, n, 0)), &t, &mut h);
    assert_eq!(held(&h), expected(text, n, None, MODEL));
    assert!(!held(&h).is_empty());
    assert_eq!(s.blocks(), n);
}

#[test]
fn a_chain_in_pieces_gives_the_same_keys() {
    let text = TEXT.as_bytes();
    let n = text.len() / BLOCK;
    for cuts in [
        vec![1, 2, 3],
        vec![5],
        vec![n - 1],
        (1..n).collect::<Vec<_>>(),
    ] {
        let (mut s, mut h, t) = setup();
        let mut from = 0;
        for to in cuts.iter().copied().chain([n]) {
            s.apply(&Event::Stored(stored(text, from, to, 0)), &t, &mut h);
            from = to;
        }
        assert_eq!(held(&h), expected(text, n, None, MODEL), "cuts {cuts:?}");
    }
}

#[test]
fn removing_a_block_takes_its_keys_and_its_descendants_keys() {
    let (mut s, mut h, t) = setup();
    let text = TEXT.as_bytes();
    let n = text.len() / BLOCK;
    s.apply(&Event::Stored(stored(text, 0, n, 0)), &t, &mut h);
    let hs = hashes(text, 0);
    // Block 6 holds bytes 24..28: it completes chunk 2 (bytes 16..24) no later than block 5.
    let remove = |hash| {
        Event::Removed(Removed {
            block_hashes: vec![hash],
            ..Removed::default()
        })
    };
    s.apply(&remove(hs[n - 1]), &t, &mut h);
    assert_eq!(held(&h), expected(text, n - 1, None, MODEL));
    s.apply(&remove(hs[6]), &t, &mut h);
    assert_eq!(held(&h), expected(text, 6, None, MODEL));
    assert_eq!(s.blocks(), 6);
    s.apply(&remove(12345), &t, &mut h);
    assert_eq!(s.blocks(), 6, "an unknown block changes nothing");
    s.apply(&remove(hs[0]), &t, &mut h);
    assert!(held(&h).is_empty());
    assert_eq!(s.blocks(), 0);
}

#[test]
fn chains_with_the_same_bytes_share_keys_by_count_and_copies_live_until_the_last_goes() {
    let (mut s, mut h, t) = setup();
    let text = TEXT.as_bytes();
    let n = text.len() / BLOCK;
    // Two tokenizations of the same text: different block hashes, same bytes.
    s.apply(&Event::Stored(stored(text, 0, n, 1)), &t, &mut h);
    s.apply(&Event::Stored(stored(text, 0, n, 2)), &t, &mut h);
    // And a second copy of the first chain (vLLM does not deduplicate).
    s.apply(&Event::Stored(stored(text, 0, n, 1)), &t, &mut h);
    let all = expected(text, n, None, MODEL);
    let remove = |salt| {
        Event::Removed(Removed {
            block_hashes: vec![hashes(text, salt)[0]],
            ..Removed::default()
        })
    };
    s.apply(&remove(1), &t, &mut h);
    s.apply(&remove(2), &t, &mut h);
    assert_eq!(held(&h), all, "one copy of chain 1 is left");
    s.apply(&remove(1), &t, &mut h);
    assert!(held(&h).is_empty());
}

#[test]
fn all_blocks_cleared_releases_everything_through_the_feed() {
    let (mut s, mut h, t) = setup();
    let text = TEXT.as_bytes();
    s.apply(&Event::Stored(stored(text, 0, 10, 0)), &t, &mut h);
    let before = h.version();
    s.apply(&Event::AllCleared, &t, &mut h);
    assert!(held(&h).is_empty());
    assert_eq!(s.blocks(), 0);
    let d = h.since(Some(before), 1000);
    assert_eq!(d.changes.len(), expected(text, 10, None, MODEL).len());
    assert!(d.changes.iter().all(|c| !c.held));
    // A client that applied everything from 0 holds nothing either.
    let mut client = BTreeSet::new();
    for c in h.since(Some(0), 1000).changes {
        if c.held {
            client.insert(c.key);
        } else {
            client.remove(&c.key);
        }
    }
    assert!(client.is_empty());
}

#[test]
fn the_cache_salt_on_the_first_block_seeds_the_chain() {
    let (mut s, mut h, t) = setup();
    let text = TEXT.as_bytes();
    let n = text.len() / BLOCK;
    let mut ev = stored(text, 0, 3, 0);
    ev.extra_keys = vec![vec![ExtraKey::Text("tenant-a".into())], vec![], vec![]];
    s.apply(&Event::Stored(ev), &t, &mut h);
    s.apply(&Event::Stored(stored(text, 3, n, 0)), &t, &mut h);
    assert_eq!(held(&h), expected(text, n, Some("tenant-a"), MODEL));
    assert!(held(&h).is_disjoint(&expected(text, n, None, MODEL)));
}

#[test]
fn a_lora_adapter_seeds_the_chain_with_its_name() {
    let (mut s, mut h, t) = setup();
    let text = TEXT.as_bytes();
    let n = text.len() / BLOCK;
    let mut ev = stored(text, 0, n, 0);
    ev.lora_name = Some("adapter".into());
    ev.extra_keys = (0..n)
        .map(|i| {
            let mut k = vec![ExtraKey::Text("adapter".into())];
            if i == 0 {
                k.push(ExtraKey::Text("salt".into()));
            }
            k
        })
        .collect();
    s.apply(&Event::Stored(ev), &t, &mut h);
    assert_eq!(held(&h), expected(text, n, Some("salt"), "adapter"));
}

#[test]
fn multimodal_blocks_and_their_descendants_are_not_indexed() {
    let (mut s, mut h, t) = setup();
    let text = TEXT.as_bytes();
    let n = text.len() / BLOCK;
    let mut ev = stored(text, 0, 8, 0);
    ev.extra_keys = vec![vec![]; 8];
    ev.extra_keys[5] = vec![ExtraKey::Other];
    s.apply(&Event::Stored(ev), &t, &mut h);
    s.apply(&Event::Stored(stored(text, 8, n, 0)), &t, &mut h);
    assert_eq!(held(&h), expected(text, 5, None, MODEL));
    assert_eq!(s.counts.multimodal_blocks as usize, n - 5);
    // An old vLLM's multimodal hash is a bare string past the first block.
    let (mut s, mut h, t) = setup();
    let mut ev = stored(text, 0, n, 0);
    ev.extra_keys = vec![vec![]; n];
    ev.extra_keys[2] = vec![ExtraKey::Text("mm-hash".into())];
    s.apply(&Event::Stored(ev), &t, &mut h);
    assert_eq!(held(&h), expected(text, 2, None, MODEL));
}

#[test]
fn other_media_and_other_groups_are_ignored() {
    let (mut s, mut h, t) = setup();
    let text = TEXT.as_bytes();
    let n = text.len() / BLOCK;
    let mut cpu = stored(text, 0, n, 0);
    cpu.medium = Some("CPU".into());
    s.apply(&Event::Stored(cpu), &t, &mut h);
    let mut sliding = stored(text, 0, n, 0);
    sliding.group_idx = Some(1);
    sliding.kv_cache_spec_kind = Some("sliding_window".into());
    s.apply(&Event::Stored(sliding), &t, &mut h);
    assert!(held(&h).is_empty());
    let mut full = stored(text, 0, n, 0);
    full.group_idx = Some(0);
    full.kv_cache_spec_kind = Some("full_attention".into());
    full.medium = Some("GPU".into());
    s.apply(&Event::Stored(full), &t, &mut h);
    assert_eq!(held(&h), expected(text, n, None, MODEL));
    // A second full-attention group repeats the same blocks: only the first counts.
    let mut second = stored(text, 0, n, 0);
    second.group_idx = Some(2);
    s.apply(&Event::Stored(second), &t, &mut h);
    // Removals from another group or medium leave the indexed group alone.
    let hs = hashes(text, 0);
    for (medium, group) in [(Some("CPU"), Some(0)), (None, Some(1))] {
        s.apply(
            &Event::Removed(Removed {
                block_hashes: vec![hs[0]],
                medium: medium.map(Into::into),
                group_idx: group,
            }),
            &t,
            &mut h,
        );
    }
    assert_eq!(held(&h), expected(text, n, None, MODEL));
    assert_eq!(s.counts.other_medium_blocks as usize, n + 1);
    assert_eq!(s.counts.other_group_blocks as usize, 2 * n + 1);
}

#[test]
fn blocks_without_a_known_parent_are_not_indexed() {
    let (mut s, mut h, t) = setup();
    let text = TEXT.as_bytes();
    s.apply(&Event::Stored(stored(text, 3, 8, 0)), &t, &mut h);
    assert!(held(&h).is_empty());
    assert_eq!(s.counts.orphan_blocks, 5);
    let mut bad = stored(text, 0, 3, 0);
    bad.token_ids.pop();
    s.apply(&Event::Stored(bad), &t, &mut h);
    assert_eq!(s.counts.malformed, 1);
    let mut unknown = stored(text, 0, 3, 0);
    unknown.token_ids[0] = 999;
    s.apply(&Event::Stored(unknown), &t, &mut h);
    assert!(held(&h).is_empty());
    assert_eq!(s.counts.malformed, 2);
}
