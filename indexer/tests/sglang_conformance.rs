//! The indexer against SGLang's own code: events built with SGLang's msgspec classes
//! (`sglang.srt.disaggregation.kv_events` from PyPI's `sglang`, through tools/sglang-events.py)
//! decode into the keys of the pages they store, through a store, a removal, a radix split
//! (removal then stores, one batch) and a clear; and SGLang's `ZmqEventPublisher`, two
//! data-parallel ranks on port + rank, feeds a running indexer over real sockets on 127.0.0.1,
//! its replay socket answering the indexer's probes and requests. The simulator's SGLang
//! replicas publish what SGLang's typed `KVEventBatch` decodes.
//!
//! `make test` installs the package (`make sglang-deps`) and points $KVROUTE_SGLANG_PYTHON at
//! it. Without it the tests say why and pass, except in CI ($CI set), where they fail.

use crate::common;

use common::{config, tokenizer_file, whole_chunk_keys, Deadline, FeedClient};
use kvroute_indexer::chains::{self, Stream};
use kvroute_indexer::config::EngineSpec;
use kvroute_indexer::dialect::Dialect;
use kvroute_indexer::holders::Holders;
use kvroute_indexer::subscriber::fetch_replay;
use kvroute_indexer::token_bytes::TokenBytes;
use kvroute_indexer::wire::{self, Event};
use kvroute_sim::bpe::Vocab;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::io::Write;
use std::path::PathBuf;
use std::process::Stdio;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

const CHUNK: usize = 64;
const MODEL: &str = "m";

/// tools/sglang-events.py running on the venv's Python: SGLang's classes and publisher.
struct Reference {
    _child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
}

/// Says why the reference cannot run: a failure in CI, a message and a pass elsewhere.
fn unavailable(why: &str) -> Option<Reference> {
    if std::env::var_os("CI").is_some() {
        panic!("SGLang conformance cannot run in CI: {why}");
    }
    // Past the harness's capture, so the skip shows in a passing run too.
    let _ = writeln!(std::io::stderr(), "SKIPPED: SGLang conformance: {why}");
    None
}

impl Reference {
    async fn start() -> Option<Reference> {
        let Some(python) = std::env::var_os("KVROUTE_SGLANG_PYTHON") else {
            return unavailable(
                "KVROUTE_SGLANG_PYTHON is unset: run through `make test` (or `make sglang-deps` \
                 and export it as the Makefile does)",
            );
        };
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tools/sglang-events.py");
        let mut child = match Command::new(&python)
            .arg(&script)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
        {
            Ok(child) => child,
            Err(e) => return unavailable(&format!("{}: {e}", PathBuf::from(python).display())),
        };
        let stdin = child.stdin.take().expect("stdin");
        let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
        let first = lines.next_line().await.ok().flatten().unwrap_or_default();
        let hello: Value = serde_json::from_str(&first).unwrap_or(Value::Null);
        if let Some(version) = hello["sglang"].as_str() {
            eprintln!("SGLang {version}'s classes");
            return Some(Reference {
                _child: child,
                stdin,
                lines,
            });
        }
        let why = hello["unavailable"].as_str().unwrap_or(&first);
        unavailable(&format!("the sglang package does not load: {why}"))
    }

    async fn ask(&mut self, command: Value) -> Value {
        let line = format!("{command}\n");
        self.stdin
            .write_all(line.as_bytes())
            .await
            .expect("written");
        let answer = self
            .lines
            .next_line()
            .await
            .expect("read")
            .expect("an answer");
        serde_json::from_str(&answer).expect("json")
    }

    /// A `KVEventBatch` of `events`, as SGLang's msgspec encoder writes it.
    async fn encode(&mut self, events: Vec<Value>) -> Vec<u8> {
        let answer = self.ask(json!({ "encode": events })).await;
        let hex = answer["payload"].as_str().expect("a payload");
        (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex"))
            .collect()
    }
}

/// A prompt's pages: `page` token ids each, named as SGLang names them (a hash chain over the
/// pages, signed 64-bit).
struct Pages {
    ids: Vec<u32>,
    page: usize,
    hashes: Vec<i64>,
}

impl Pages {
    fn new(ids: Vec<u32>, page: usize) -> Pages {
        let mut chain = 0u64;
        let hashes = ids
            .chunks_exact(page)
            .map(|p| {
                let bytes: Vec<u8> = p.iter().flat_map(|t| t.to_le_bytes()).collect();
                chain = xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, chain);
                chain as i64
            })
            .collect();
        Pages { ids, page, hashes }
    }

    /// One `BlockStored` per page of `from..to`, as SGLang's radix cache records a node.
    fn stored(&self, from: usize, to: usize) -> Vec<Value> {
        (from..to)
            .map(|i| {
                json!({"type": "BlockStored", "block_hashes": [self.hashes[i]],
                       "parent_block_hash": i.checked_sub(1).map(|p| self.hashes[p]),
                       "token_ids": &self.ids[i * self.page..(i + 1) * self.page],
                       "block_size": self.page, "medium": "GPU"})
            })
            .collect()
    }

    /// The `BlockRemoved` of pages `from..to` (SGLang sends one per radix node).
    fn removed(&self, from: usize, to: usize) -> Value {
        json!({"type": "BlockRemoved", "block_hashes": &self.hashes[from..to], "medium": "GPU"})
    }

    fn len(&self) -> usize {
        self.hashes.len()
    }
}

/// kvroute's keys for the whole chunks of the first `pages` pages' bytes.
fn keys(tokens: &TokenBytes, p: &Pages, pages: usize) -> BTreeSet<u64> {
    let mut bytes = Vec::new();
    tokens
        .decode(&p.ids[..pages * p.page], &mut bytes)
        .expect("known ids");
    whole_chunk_keys(None, MODEL, &bytes, CHUNK)
}

fn union(sets: &[&BTreeSet<u64>]) -> BTreeSet<u64> {
    sets.iter().flat_map(|s| s.iter().copied()).collect()
}

fn tokenize(text: &str) -> Vec<u32> {
    Vocab::load(&tokenizer_file()).unwrap().tokenize(text)
}

/// A text of several chunks, with multi-byte characters, `tag`'s own after `shared` bytes of
/// a common beginning.
fn text(tag: &str) -> String {
    let common = "Die Küche öffnet um acht; 漢字とかな. ".repeat(6);
    let own: String = (0..12)
        .map(|i| format!("{tag} sentence {i} — ✓. "))
        .collect();
    format!("{common}{own}")
}

#[tokio::test]
async fn sglangs_classes_encode_what_the_indexer_decodes() {
    let Some(mut sglang) = Reference::start().await else {
        return;
    };
    let tokens = TokenBytes::load(&tokenizer_file()).unwrap();
    let a = Pages::new(tokenize(&text("first")), 4);
    let b = Pages::new(tokenize(&text("second")), 4);
    // b shares a's first pages: the common beginning's.
    let shared = (0..a.len().min(b.len()))
        .take_while(|&i| a.hashes[i] == b.hashes[i])
        .count();
    assert!(shared > 4 && shared < a.len() - 4, "{shared} pages shared");
    let mut holders = Holders::new(1 << 16);
    let e = holders.endpoint("127.0.0.1:30000");
    let shape = chains::Shape {
        model: MODEL.into(),
        chunk_size: CHUNK,
    };
    let mut stream = Stream::with_dialect(e, shape, Dialect::Sglang);
    let mut apply = async |events: Vec<Value>, holders: &mut Holders| {
        let payload = sglang.encode(events).await;
        let batch = wire::decode_payload_as(&payload, Dialect::Sglang).expect("decodes");
        stream.apply_batch(&batch.events, &tokens, holders);
        batch
    };
    let held = |h: &Holders| h.keys(e).into_iter().collect::<BTreeSet<u64>>();

    // Store: a as one node, one event per page.
    let batch = apply(a.stored(0, a.len()), &mut holders).await;
    assert_eq!(batch.events.len(), a.len());
    let Event::Stored(first) = &batch.events[1] else {
        panic!("{:?}", batch.events[1])
    };
    assert_eq!(first.parent, Some(a.hashes[0] as u64));
    assert_eq!(first.medium.as_deref(), Some("GPU"));
    let all_a = keys(&tokens, &a, a.len());
    assert_eq!(held(&holders), all_a);
    // Split: b's insertion splits node a at the shared pages (remove, then both halves).
    let mut split = vec![a.removed(0, a.len())];
    split.extend(a.stored(0, shared));
    split.extend(a.stored(shared, a.len()));
    split.extend(b.stored(shared, b.len()));
    apply(split, &mut holders).await;
    let all_b = keys(&tokens, &b, b.len());
    assert_eq!(held(&holders), union(&[&all_a, &all_b]));
    // Remove: evicting leaf a's tail node leaves the shared pages and b.
    apply(vec![a.removed(shared, a.len())], &mut holders).await;
    assert_eq!(held(&holders), all_b);
    // Clear.
    apply(vec![json!({"type": "AllBlocksCleared"})], &mut holders).await;
    assert!(held(&holders).is_empty());
    // A store without a medium (SGLang's default of None) is the GPU's.
    let mut bare = a.stored(0, a.len());
    for event in &mut bare {
        event.as_object_mut().unwrap().remove("medium");
    }
    apply(bare, &mut holders).await;
    assert_eq!(held(&holders), all_a);
}

#[tokio::test]
async fn sglangs_publisher_feeds_an_indexer_from_two_ranks_and_its_replay_sockets() {
    let Some(mut sglang) = Reference::start().await else {
        return;
    };
    let tokens = TokenBytes::load(&tokenizer_file()).unwrap();
    let ranks = sglang.ask(json!({"publishers": 2, "topic": "kv"})).await;
    let rank = |r: usize, field: &str| ranks["ranks"][r][field].as_str().unwrap().to_owned();
    let (a, b, c) = (
        Pages::new(tokenize(&text("rank zero")), 4),
        Pages::new(tokenize(&text("rank one")), 4),
        Pages::new(tokenize(&text("rank zero, later")), 4),
    );
    let shared = (0..a.len().min(c.len()))
        .take_while(|&i| a.hashes[i] == c.hashes[i])
        .count();
    // Node a is pages 0..cut, with a node below it; c will split it where they part.
    let cut = shared + 3;
    assert!(cut < a.len());
    // Published before the indexer subscribes: it gets them from the replay sockets.
    let publish = |r: usize, events: Vec<Value>| json!({"publish": events, "rank": r});
    let mut first = a.stored(0, cut);
    first.extend(a.stored(cut, a.len()));
    sglang.ask(publish(0, first)).await;
    sglang.ask(publish(1, b.stored(0, b.len()))).await;

    // One engine, two data-parallel ranks: its events and replay ports, plus the rank.
    let endpoint = "127.0.0.1:30000";
    let mut indexer_config = config(&[], CHUNK, 0.5);
    indexer_config.events.topic = "kv".into();
    indexer_config.events.engines = vec![EngineSpec {
        endpoint: endpoint.into(),
        events: rank(0, "endpoint"),
        replay: Some(rank(0, "replay_endpoint")),
        kind: Some(Dialect::Sglang),
        dp_size: 2,
        ..EngineSpec::default()
    }];
    assert_eq!(
        indexer_config.events.engines[0].ranks().unwrap()[1],
        (rank(1, "endpoint"), Some(rank(1, "replay_endpoint"))),
        "SGLang's rank 1 is on the ports the indexer derives"
    );
    let indexer = kvroute_indexer::start(indexer_config)
        .await
        .expect("starts");
    let base = format!("http://{}", indexer.addr);
    let (all_a, all_b, all_c) = (
        keys(&tokens, &a, a.len()),
        keys(&tokens, &b, b.len()),
        keys(&tokens, &c, c.len()),
    );
    let mut client = FeedClient::default();
    let mut held_becomes = async |want: BTreeSet<u64>, what: &str| {
        let deadline = Deadline::start();
        loop {
            client.poll(&base).await;
            if client.held(endpoint) == want {
                return;
            }
            deadline.tick(|| format!("never: {what}")).await;
        }
    };
    held_becomes(union(&[&all_a, &all_b]), "both ranks' first pages").await;

    // A radix split on rank 0, live: the node below (pages cut..) stays held.
    let mut split = vec![a.removed(0, cut)];
    split.extend(a.stored(0, shared));
    split.extend(a.stored(shared, cut));
    split.extend(c.stored(shared, c.len()));
    sglang.ask(publish(0, split)).await;
    held_becomes(union(&[&all_a, &all_b, &all_c]), "the split's pages").await;
    // Rank 0's cache cleared: rank 1's pages are still the endpoint's.
    sglang
        .ask(publish(0, vec![json!({"type": "AllBlocksCleared"})]))
        .await;
    held_becomes(all_b.clone(), "rank 1's pages alone").await;
    sglang.ask(publish(1, vec![b.removed(0, b.len())])).await;
    held_becomes(BTreeSet::new(), "nothing").await;

    // Both streams are SGLang's, and their replay sockets answered probes.
    let health = common::get_json(&format!("{base}/health")).await;
    let streams = health["streams"].as_array().unwrap();
    assert_eq!(streams.len(), 2);
    assert!(streams.iter().all(|s| s["kind"] == "sglang"));
    // Rank 0's replay socket gives back everything it published, in order.
    let replayed = fetch_replay(&rank(0, "replay_endpoint"), 0, u64::MAX, Dialect::Sglang)
        .await
        .expect("the replay socket answers");
    let seqs: Vec<u64> = replayed.iter().map(|b| b.seq).collect();
    assert_eq!(seqs, [0, 1, 2]);
    assert_eq!(replayed[1].events.len(), 1 + cut + c.len() - shared);
    assert_eq!(replayed[2].events, [Event::AllCleared]);
}

#[tokio::test]
async fn the_simulators_sglang_events_are_sglangs_kv_event_batches() {
    use kvroute_sim::kv_events::{encode_batch, Format};
    use kvroute_sim::prefix_cache::CacheEvent;
    let Some(mut sglang) = Reference::start().await else {
        return;
    };
    let events = [
        CacheEvent::Stored {
            hashes: vec![u64::MAX - 1, 7],
            parent: Some(1 << 63),
            token_ids: (0..8).collect(),
            salt: Some("tenant".into()),
        },
        CacheEvent::Removed {
            hashes: vec![u64::MAX - 1, 7],
        },
        CacheEvent::AllCleared,
    ];
    let payload = encode_batch(1.0, &events, 4, Format::Sglang);
    let hex: String = payload.iter().map(|b| format!("{b:02x}")).collect();
    let answer = sglang.ask(json!({ "decode": hex })).await;
    assert_eq!(answer["error"], Value::Null, "{answer}");
    assert_eq!(
        answer["events"],
        json!([
            {"type": "BlockStored", "block_hashes": [-2], "parent_block_hash": i64::MIN,
             "token_ids": [0, 1, 2, 3], "block_size": 4, "lora_id": null, "medium": "GPU",
             "cache_salt": "tenant"},
            {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": -2,
             "token_ids": [4, 5, 6, 7], "block_size": 4, "lora_id": null, "medium": "GPU",
             "cache_salt": "tenant"},
            {"type": "BlockRemoved", "block_hashes": [-2, 7], "medium": "GPU"},
            {"type": "AllBlocksCleared"},
        ])
    );
    assert_eq!(answer["attn_dp_rank"], 0);
    // And SGLang refuses what is not its batch: the check can fail.
    let vllm = encode_batch(1.0, &events, 4, Format::Array);
    let hex: String = vllm.iter().map(|b| format!("{b:02x}")).collect();
    let refused = sglang.ask(json!({ "decode": hex })).await;
    assert!(refused["error"].is_string(), "{refused}");
}
