//! SGLang's KV events, decoded and keyed: messages built as SGLang's msgspec classes encode them
//! (tagged maps in an `[ts, events, attn_dp_rank]` batch; older builds' arrays), with signed
//! 64-bit hashes, one event per page, radix-node splits sent as a removal and stores in one
//! batch, no `medium` or a host tier's, `cache_salt`, EAGLE's token pairs and the content hashes
//! of SGLang up to 0.5.5. `sglang_conformance.rs` checks the same against SGLang's own classes.

use crate::common;

use common::{msgpack_map as map, whole_chunk_keys};
use kvroute_indexer::chains::{self, Stream};
use kvroute_indexer::content_hash::python_tuple_hash;
use kvroute_indexer::dialect::Dialect;
use kvroute_indexer::holders::Holders;
use kvroute_indexer::token_bytes::TokenBytes;
use kvroute_indexer::wire::{self, Batch, Event};
use rmpv::Value;
use std::collections::BTreeSet;

const CHUNK: usize = 8;
const MODEL: &str = "m";
/// Multi-byte characters cut across pages and chunks.
const TEXT: &str = "Grüße aus Köln! 漢字とかな and some more text to fill the pages 🙂.";

/// Token `i` is byte `i`: a page's bytes are its token ids.
fn bytes_vocab() -> TokenBytes {
    let pieces: Vec<[u8; 1]> = (0..=255u8).map(|b| [b]).collect();
    TokenBytes::from_pieces(&pieces)
}

/// One SGLang engine's stream (endpoint 0), or a vLLM one's.
fn stream(dialect: Dialect) -> (Stream, Holders) {
    let mut holders = Holders::new(1 << 16);
    let e = holders.endpoint("127.0.0.1:30000");
    let shape = chains::Shape {
        model: MODEL.into(),
        chunk_size: CHUNK,
    };
    (Stream::with_dialect(e, shape, dialect), holders)
}

fn ids(text: &[u8]) -> Vec<u32> {
    text.iter().map(|&b| u32::from(b)).collect()
}

/// SGLang's page hashes of `text`: a chain over the pages (as its SHA-256 chain is), signed.
fn page_hashes(text: &[u8], page: usize) -> Vec<i64> {
    (1..=text.len() / page)
        .map(|i| xxhash_rust::xxh3::xxh3_64(&text[..i * page]) as i64)
        .collect()
}

fn int_list(xs: impl IntoIterator<Item = i64>) -> Value {
    Value::Array(xs.into_iter().map(Value::from).collect())
}

/// `BlockStored` of pages `from..to` of `text`, one event per page as SGLang's radix cache
/// records a node, each page's parent the page before (the first's: `parent`).
fn stored_pages(
    text: &[u8],
    page: usize,
    from: usize,
    to: usize,
    salt: Option<&str>,
) -> Vec<Value> {
    let h = page_hashes(text, page);
    (from..to)
        .map(|i| {
            let parent = i.checked_sub(1).map_or(Value::Nil, |p| Value::from(h[p]));
            let mut fields = vec![
                ("type", Value::from("BlockStored")),
                ("block_hashes", int_list([h[i]])),
                ("parent_block_hash", parent),
                (
                    "token_ids",
                    int_list(
                        ids(&text[i * page..(i + 1) * page])
                            .into_iter()
                            .map(i64::from),
                    ),
                ),
                ("block_size", Value::from(page)),
                ("lora_id", Value::Nil),
                ("medium", Value::from("GPU")),
            ];
            if let Some(salt) = salt {
                fields.push(("cache_salt", Value::from(salt)));
            }
            map(fields)
        })
        .collect()
}

/// `BlockRemoved` of pages `from..to`: SGLang sends one per radix node.
fn removed_pages(text: &[u8], page: usize, from: usize, to: usize) -> Value {
    let h = page_hashes(text, page);
    map(vec![
        ("type", Value::from("BlockRemoved")),
        ("block_hashes", int_list(h[from..to].iter().copied())),
        ("medium", Value::from("GPU")),
    ])
}

/// One message's payload: SGLang's `KVEventBatch` is an array `[ts, events, attn_dp_rank]`.
fn payload(events: Vec<Value>, rank: i64) -> Vec<u8> {
    let batch = Value::Array(vec![
        Value::F64(1.0),
        Value::Array(events),
        Value::from(rank),
    ]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &batch).unwrap();
    out
}

fn decode(events: Vec<Value>, dialect: Dialect) -> Batch {
    wire::decode_payload_as(&payload(events, 0), dialect).expect("decodes")
}

/// Decodes one message's events and applies them as the index does.
fn apply(s: &mut Stream, h: &mut Holders, events: Vec<Value>) {
    let batch = decode(events, s.dialect());
    s.apply_batch(&batch.events, &bytes_vocab(), h);
}

/// The keys of the whole chunks of `text[..len]`, as the filter computes them.
fn expected(text: &[u8], len: usize, salt: Option<&str>) -> BTreeSet<u64> {
    whole_chunk_keys(salt, MODEL, &text[..len], CHUNK)
}

fn held(h: &Holders) -> BTreeSet<u64> {
    h.keys(0).into_iter().collect()
}

#[test]
fn signed_hashes_and_the_batch_rank_decode() {
    let text = TEXT.as_bytes();
    let events = stored_pages(text, 4, 0, 3, None);
    let batch = wire::decode_payload_as(&payload(events, 3), Dialect::Sglang).unwrap();
    assert_eq!(batch.dp_rank, Some(3));
    let h = page_hashes(text, 4);
    assert!(h.iter().any(|h| *h < 0), "some hashes are negative");
    for (i, event) in batch.events.iter().enumerate() {
        let Event::Stored(s) = event else {
            panic!("{event:?}")
        };
        assert_eq!(s.block_hashes, vec![h[i] as u64]);
        assert_eq!(s.parent, i.checked_sub(1).map(|p| h[p] as u64));
        assert_eq!(s.block_size, 4);
        assert_eq!(s.medium.as_deref(), Some("GPU"));
    }
    // Byte hashes (vLLM's) decode in SGLang's dialect too.
    let bytes = map(vec![
        ("type", Value::from("BlockRemoved")),
        (
            "block_hashes",
            Value::Array(vec![Value::Binary(vec![1, 2])]),
        ),
    ]);
    let Event::Removed(r) = &decode(vec![bytes], Dialect::Sglang).events[0] else {
        panic!()
    };
    assert_eq!(r.block_hashes, vec![xxhash_rust::xxh3::xxh3_64(&[1, 2])]);
    assert_eq!(r.medium, None, "a missing medium decodes as none");
}

#[test]
fn one_event_per_page_gives_the_keys_of_the_whole_chain() {
    let text = TEXT.as_bytes();
    for page in [1, 2, 4, 16] {
        let n = text.len() / page;
        let (mut s, mut h) = stream(Dialect::Sglang);
        apply(&mut s, &mut h, stored_pages(text, page, 0, n, None));
        assert_eq!(held(&h), expected(text, n * page, None), "page {page}");
        assert_eq!(s.blocks(), n);
        // The same pages over several messages, a node at a time.
        let (mut s, mut h) = stream(Dialect::Sglang);
        for (from, to) in [(0, n / 3), (n / 3, n / 2), (n / 2, n)] {
            apply(&mut s, &mut h, stored_pages(text, page, from, to, None));
        }
        assert_eq!(held(&h), expected(text, n * page, None), "page {page}");
    }
}

#[test]
fn pages_stored_in_either_dialect_give_the_same_keys() {
    let text = TEXT.as_bytes();
    let n = text.len() / 4;
    let mut keys = Vec::new();
    for dialect in [Dialect::Vllm, Dialect::Sglang] {
        let (mut s, mut h) = stream(dialect);
        apply(&mut s, &mut h, stored_pages(text, 4, 0, n, None));
        keys.push(held(&h));
    }
    assert_eq!(keys[0], keys[1]);
    assert_eq!(keys[0], expected(text, n * 4, None));
}

#[test]
fn a_radix_split_sent_as_remove_then_store_keeps_the_nodes_below() {
    let text = TEXT.as_bytes();
    let page = 2;
    let n = text.len() / page;
    let (mut s, mut h) = stream(Dialect::Sglang);
    // Node A: pages 0..12; node B below it: pages 12..n (a longer prompt came later).
    apply(&mut s, &mut h, stored_pages(text, page, 0, 12, None));
    apply(&mut s, &mut h, stored_pages(text, page, 12, n, None));
    assert_eq!(held(&h), expected(text, n * page, None));
    // A prompt sharing pages 0..5 of A and then going its own way splits A at page 5: SGLang
    // removes A's pages, stores A's two halves, then the new node, all in one batch.
    let mut other = text[..5 * page].to_vec();
    other.extend_from_slice("— und dann ganz anders weiter, bis zum Schluss.".as_bytes());
    let m = other.len() / page;
    let before = h.version();
    let mut split = vec![removed_pages(text, page, 0, 12)];
    split.extend(stored_pages(text, page, 0, 5, None));
    split.extend(stored_pages(text, page, 5, 12, None));
    split.extend(stored_pages(&other, page, 5, m, None));
    apply(&mut s, &mut h, split);
    let both: BTreeSet<u64> = expected(text, n * page, None)
        .union(&expected(&other, m * page, None))
        .copied()
        .collect();
    assert_eq!(held(&h), both, "B's keys are still held");
    assert_eq!(s.blocks(), n + m - 5);
    // B's own keys never went: a client applying the feed saw no release of them.
    let only_b: BTreeSet<u64> = expected(text, n * page, None)
        .difference(&expected(text, 12 * page, None))
        .copied()
        .collect();
    assert!(!only_b.is_empty());
    let changes = h.since(Some(before), 1 << 16).changes;
    assert!(changes.iter().all(|c| c.held || !only_b.contains(&c.key)));
    // Evicting leaf B (one removal, no store) releases B's keys and only them.
    apply(&mut s, &mut h, vec![removed_pages(text, page, 12, n)]);
    let left: BTreeSet<u64> = expected(text, 12 * page, None)
        .union(&expected(&other, m * page, None))
        .copied()
        .collect();
    assert_eq!(held(&h), left);
}

#[test]
fn a_removed_block_that_does_not_come_back_takes_its_descendants_when_the_batch_ends() {
    let text = TEXT.as_bytes();
    let n = text.len() / 4;
    let (mut s, mut h) = stream(Dialect::Sglang);
    apply(&mut s, &mut h, stored_pages(text, 4, 0, n, None));
    // Pages 3..5 go; 5.. are below them and cannot be reached in the engine any more.
    apply(&mut s, &mut h, vec![removed_pages(text, 4, 3, 5)]);
    assert_eq!(held(&h), expected(text, 3 * 4, None));
    assert_eq!(s.blocks(), 3);
}

#[test]
fn a_missing_medium_is_the_gpu_and_host_tiers_are_ignored() {
    let text = TEXT.as_bytes();
    let n = text.len() / 4;
    let (mut s, mut h) = stream(Dialect::Sglang);
    let strip = |mut v: Value, medium: Option<&str>| {
        if let Value::Map(entries) = &mut v {
            entries.retain(|(k, _)| k.as_str() != Some("medium"));
            if let Some(m) = medium {
                entries.push((Value::from("medium"), Value::from(m)));
            }
        }
        v
    };
    // HiCache's host copy of the pages (SGLang's StorageMedium.CPU is "CPU_PINNED").
    let host: Vec<Value> = stored_pages(text, 4, 0, n, None)
        .into_iter()
        .map(|v| strip(v, Some("CPU_PINNED")))
        .collect();
    apply(&mut s, &mut h, host);
    assert!(held(&h).is_empty());
    assert_eq!(s.counts.other_medium_blocks as usize, n);
    // An older SGLang sends no medium at all.
    let bare: Vec<Value> = stored_pages(text, 4, 0, n, None)
        .into_iter()
        .map(|v| strip(v, None))
        .collect();
    apply(&mut s, &mut h, bare);
    assert_eq!(held(&h), expected(text, n * 4, None));
    // The host tier evicting its copy leaves the GPU's alone.
    let evicted = strip(removed_pages(text, 4, 0, n), Some("CPU_PINNED"));
    apply(&mut s, &mut h, vec![evicted]);
    assert_eq!(held(&h), expected(text, n * 4, None));
}

#[test]
fn the_cache_salt_field_seeds_the_chain() {
    let text = TEXT.as_bytes();
    let n = text.len() / 4;
    let (mut s, mut h) = stream(Dialect::Sglang);
    apply(
        &mut s,
        &mut h,
        stored_pages(text, 4, 0, n, Some("tenant-a")),
    );
    assert_eq!(held(&h), expected(text, n * 4, Some("tenant-a")));
    assert!(held(&h).is_disjoint(&expected(text, n * 4, None)));
}

#[test]
fn eagle_bigram_pages_key_their_first_tokens() {
    let text = TEXT.as_bytes();
    let n = text.len() / 4;
    let (mut s, mut h) = stream(Dialect::Sglang);
    // In bigram mode a page's token_ids are pairs (token i, token i + 1).
    let pairs: Vec<Value> = stored_pages(text, 4, 0, n, None)
        .into_iter()
        .enumerate()
        .map(|(p, mut v)| {
            let Value::Map(entries) = &mut v else {
                unreachable!()
            };
            for (k, value) in entries.iter_mut() {
                if k.as_str() == Some("token_ids") {
                    *value = Value::Array(
                        (p * 4..p * 4 + 4)
                            .map(|i| {
                                let next = text.get(i + 1).copied().unwrap_or(0);
                                int_list([i64::from(text[i]), i64::from(next)])
                            })
                            .collect(),
                    );
                }
            }
            v
        })
        .collect();
    apply(&mut s, &mut h, pairs);
    assert_eq!(held(&h), expected(text, n * 4, None));
}

#[test]
fn older_sglangs_array_events_decode_with_their_own_field_order() {
    let text = TEXT.as_bytes();
    let h = page_hashes(text, 4);
    let page = |i: usize| int_list(ids(&text[i * 4..i * 4 + 4]).into_iter().map(i64::from));
    // SGLang 0.5.9 to 0.5.19: `array_like` events, `medium` after `lora_id`.
    let plain = Value::Array(vec![
        Value::from("BlockStored"),
        int_list([h[0]]),
        Value::Nil,
        page(0),
        Value::from(4),
        Value::Nil,
        Value::from("GPU"),
    ]);
    // SGLang 0.5.19: a salted store appends `metadata`, where vLLM has `lora_name`.
    let mut salted = plain.clone();
    if let Value::Array(fields) = &mut salted {
        fields.push(map(vec![("cache_salt", Value::from("tenant-a"))]));
    }
    // SGLang before 0.5.9: no medium; removals one page at a time.
    let removed = Value::Array(vec![Value::from("BlockRemoved"), int_list([h[0]])]);
    let batch = decode(vec![plain, salted.clone(), removed], Dialect::Sglang);
    let [Event::Stored(p), Event::Stored(s), Event::Removed(r)] = batch.events.as_slice() else {
        panic!("{:?}", batch.events)
    };
    assert_eq!((p.block_hashes[0], p.block_size), (h[0] as u64, 4));
    assert_eq!(p.medium.as_deref(), Some("GPU"));
    assert_eq!(p.salt, None);
    assert_eq!(s.salt.as_deref(), Some("tenant-a"));
    assert_eq!(s.lora_name, None);
    assert_eq!((r.block_hashes[0], &r.medium), (h[0] as u64, &None));
    // Read as vLLM's, the metadata map is no LoRA name either.
    let Event::Stored(v) = &decode(vec![salted], Dialect::Vllm).events[0] else {
        panic!()
    };
    assert_eq!((v.lora_name.as_ref(), v.salt.as_ref()), (None, None));
}

#[test]
fn content_hashed_pages_of_old_sglang_are_counted_not_indexed() {
    let text = TEXT.as_bytes();
    let n = text.len() / 4;
    // SGLang up to 0.5.5: a page's hash is Python's hash(tuple(tokens)), chained by parent.
    let content: Vec<i64> = (0..n)
        .map(|i| python_tuple_hash(&ids(&text[i * 4..i * 4 + 4])) as i64)
        .collect();
    let events: Vec<Value> = (0..n)
        .map(|i| {
            Value::Array(vec![
                Value::from("BlockStored"),
                int_list([content[i]]),
                i.checked_sub(1)
                    .map_or(Value::Nil, |p| Value::from(content[p])),
                int_list(ids(&text[i * 4..i * 4 + 4]).into_iter().map(i64::from)),
                Value::from(4),
                Value::Nil,
            ])
        })
        .collect();
    let (mut s, mut h) = stream(Dialect::Sglang);
    apply(&mut s, &mut h, events.clone());
    assert!(held(&h).is_empty());
    assert_eq!(s.counts.content_hash_blocks as usize, n);
    assert_eq!(s.blocks(), 0);
    // A vLLM stream has no such hashes to look for.
    let (mut v, mut hv) = stream(Dialect::Vllm);
    apply(&mut v, &mut hv, events);
    assert_eq!(v.counts.content_hash_blocks, 0);
}

#[test]
fn a_clear_and_a_store_after_it_in_one_batch() {
    let text = TEXT.as_bytes();
    let n = text.len() / 4;
    let (mut s, mut h) = stream(Dialect::Sglang);
    apply(&mut s, &mut h, stored_pages(text, 4, 0, n, None));
    let mut events = vec![map(vec![("type", Value::from("AllBlocksCleared"))])];
    events.extend(stored_pages(text, 4, 0, 4, None));
    apply(&mut s, &mut h, events);
    assert_eq!(held(&h), expected(text, 16, None));
    assert_eq!(s.counts.clears, 1);
}
