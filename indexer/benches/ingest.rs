//! The cost of ingest: BlockStored batches turned into keys, in blocks per second on one core,
//! and the index's memory per million cached tokens (printed).
//!
//! Token ids are drawn from the simulator's trained byte-level vocabulary, so blocks decode to
//! as many bytes as real text does. Each prompt is 512 tokens, stored as events of 128 tokens
//! (the parent of each is the previous event's last block), keyed in 512-byte chunks.

use criterion::{criterion_group, BatchSize, Criterion, Throughput};
use kvroute_indexer::chains::{Shape, Stream};
use kvroute_indexer::holders::Holders;
use kvroute_indexer::token_bytes::TokenBytes;
use kvroute_indexer::wire::{Event, Stored};
use std::time::Duration;

const CHUNK: usize = 512;
const PROMPT_TOKENS: usize = 512;
const EVENT_TOKENS: usize = 128;

fn vocab() -> TokenBytes {
    let tokenizer = kvroute_sim::bpe::train().expect("tokenizer trains");
    TokenBytes::from_tokenizer(&tokenizer).expect("byte-level")
}

/// The events that store `prompts` distinct prompts in blocks of `block` tokens.
fn events(prompts: usize, block: usize, vocab: usize) -> Vec<Event> {
    let mut rng = 0x2545_f491_4f6c_dd1d_u64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut out = Vec::new();
    let per_event = EVENT_TOKENS.max(block) / block;
    let mut hash = 0u64;
    for _ in 0..prompts {
        let mut parent = None;
        for _ in 0..PROMPT_TOKENS / (per_event * block) {
            let block_hashes: Vec<u64> = (0..per_event)
                .map(|_| {
                    hash += 1;
                    hash
                })
                .collect();
            let token_ids = (0..per_event * block)
                .map(|_| (next() % vocab as u64) as u32)
                .collect();
            let last = *block_hashes.last().unwrap();
            out.push(Event::Stored(Stored {
                block_hashes,
                parent,
                token_ids,
                block_size: block,
                medium: Some("GPU".into()),
                ..Stored::default()
            }));
            parent = Some(last);
        }
    }
    out
}

fn fresh() -> (Stream, Holders) {
    with_feed(1 << 20)
}

/// A stream and a holders table whose feed keeps `feed` changes.
fn with_feed(feed: usize) -> (Stream, Holders) {
    let mut holders = Holders::new(feed);
    let e = holders.endpoint("127.0.0.1:8000");
    let shape = Shape {
        model: "Qwen/Qwen3-32B".into(),
        chunk_size: CHUNK,
    };
    (Stream::new(e, shape), holders)
}

fn ingest(c: &mut Criterion) {
    let tokens = vocab();
    let mut group = c.benchmark_group("ingest");
    for block in [16, 128] {
        let evs = events(256, block, tokens.len());
        let blocks = 256 * PROMPT_TOKENS / block;
        group.throughput(Throughput::Elements(blocks as u64));
        group.bench_function(format!("block_stored_{block}_token_blocks"), |b| {
            b.iter_batched(
                fresh,
                |(mut stream, mut holders)| {
                    for e in &evs {
                        stream.apply(e, &tokens, &mut holders);
                    }
                    (stream, holders)
                },
                BatchSize::LargeInput,
            )
        });
    }
    group.finish();
}

/// Prints the index's memory per million cached tokens.
fn memory() {
    let tokens = vocab();
    for block in [16, 128] {
        let prompts = 1_000_000 / PROMPT_TOKENS;
        // The feed's ring is a fixed cost (16 bytes per change kept), left out here.
        let (mut stream, mut holders) = with_feed(1);
        for e in &events(prompts, block, tokens.len()) {
            stream.apply(e, &tokens, &mut holders);
        }
        let cached = prompts * PROMPT_TOKENS;
        let bytes = stream.memory() + holders.memory();
        println!(
            "memory: {:.1} MB per million cached tokens ({block}-token blocks, {} blocks, {} keys held)",
            bytes as f64 / cached as f64,
            stream.blocks(),
            holders.held(0),
        );
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).measurement_time(Duration::from_secs(5));
    targets = ingest
}

fn main() {
    memory();
    benches();
    Criterion::default().configure_from_args().final_summary();
}
