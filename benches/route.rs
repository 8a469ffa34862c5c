//! CPU cost of the routing core per request, natively (the filter runs the same code in V8, plus
//! host calls): parse, prefix keys and a full cache-aware route as a gateway worker makes it (its
//! requests in flight counted locally), for 1 KB and 24 KB prompts, on the common path (a known
//! group) and the costly ones: a new group, a conversation seen for the first time (every key of
//! its history written), and one whose record has gone stale. Each route also reports its
//! shared-data calls (each a host call under a host-wide lock in Envoy).
//! `cargo bench -p kvroute --bench route`; Envoy-level overhead is `make bench-overhead`.

use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion};
use kvroute::config::Config;
use kvroute::hosts::Host;
use kvroute::in_flight::Local;
use kvroute::policy::cache_aware::REFRESH_MS;
use kvroute::prefill::PrefillModel;
use kvroute::prefix::{PrefixKeys, Shape};
use kvroute::request::{self, Api};
use kvroute::router::{RequestInfo, Router};
use kvroute::store::MemoryStore;

/// A gateway worker's routing: the router, with its requests in flight and prefill model.
struct Worker {
    router: Router,
    inflight: Local,
    prefill: PrefillModel,
}

impl Worker {
    fn new() -> Worker {
        let config = Config::default();
        Worker {
            prefill: PrefillModel::new(config.prefill_bytes_per_ms),
            router: Router::new(config),
            inflight: Local::default(),
        }
    }

    /// Routes `body` at `now` and ends the request, as the gateway does.
    fn route(&mut self, store: &MemoryStore, hosts: &[Host], body: &str, now: u64) {
        let req = RequestInfo {
            api: Api::Chat,
            body: body.as_bytes(),
            session: None,
            request_id: None,
        };
        let view = self.inflight.view();
        let routing = (self.router).route_with(store, &view, &self.prefill, hosts, &req, now);
        if let Ok(r) = routing.result {
            self.inflight.add(r.endpoint_id, 1);
            self.inflight.add(r.endpoint_id, -1);
        }
    }
}

fn body(prompt_bytes: usize, question: usize) -> String {
    let system = "You are a careful assistant. ".repeat(prompt_bytes / 29);
    format!(
        r#"{{"model":"Qwen/Qwen3-32B","stream":true,"messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"question number {question}"}}]}}"#
    )
}

/// A conversation's next turn: a short system prompt, then about `history_bytes` of earlier turns.
fn follow_up(history_bytes: usize, conversation: u64) -> String {
    let answer = format!("Answer of conversation {conversation}. ").repeat(history_bytes / 30);
    format!(
        r#"{{"model":"Qwen/Qwen3-32B","messages":[{{"role":"system","content":"Be brief."}},{{"role":"user","content":"q1"}},{{"role":"assistant","content":"{answer}"}},{{"role":"user","content":"q2"}}]}}"#
    )
}

/// Routes `body` and ends the request; the shared-data calls it made.
fn route_once(
    worker: &mut Worker,
    store: &MemoryStore,
    hosts: &[Host],
    body: &str,
    now: u64,
) -> u64 {
    let before = store.calls();
    worker.route(store, hosts, body, now);
    store.calls() - before
}

fn bench(c: &mut Criterion) {
    let hosts: Vec<Host> = (0..8)
        .map(|i| Host::fixed(&format!("10.0.0.{i}:8000")))
        .collect();
    for size in [1024usize, 24 * 1024] {
        let b = body(size, 0);
        c.bench_with_input(BenchmarkId::new("parse", size), &b, |bench, b| {
            bench.iter(|| request::parse(Api::Chat, b.as_bytes()))
        });
        let prompt = request::parse(Api::Chat, b.as_bytes()).unwrap();
        c.bench_with_input(
            BenchmarkId::new("prefix_keys", size),
            &prompt,
            |bench, p| {
                let shape = Shape {
                    chunk_size: 512,
                    max_chunks: 256,
                    group_bytes: 4096,
                };
                bench.iter(|| PrefixKeys::new(&p.model, &p.text, p.head, p.history, shape))
            },
        );
        let mut worker = Worker::new();
        let store = MemoryStore::new();
        let mut n = 0u64;
        c.bench_with_input(
            BenchmarkId::new("route_shared_prefix", size),
            &size,
            |bench, &size| {
                bench.iter(|| {
                    n += 1;
                    let b = body(size, (n % 16) as usize);
                    worker.route(&store, &hosts, &b, n);
                })
            },
        );
        // A group never seen: its first request records the group and its question.
        let mut group = 0u64;
        c.bench_with_input(BenchmarkId::new("route_new_group", size), &size, |bench, &size| {
            bench.iter_batched(
                || {
                    group += 1;
                    let system = format!("Assistant {group}. ").repeat(size / 16);
                    format!(
                        r#"{{"model":"m","messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"q"}}]}}"#
                    )
                },
                |b| route_once(&mut worker, &store, &hosts, &b, 1),
                BatchSize::SmallInput,
            )
        });
        // A conversation seen for the first time: every key of its history is new.
        let mut conversation = 0u64;
        c.bench_with_input(
            BenchmarkId::new("route_new_history", size),
            &size,
            |bench, &size| {
                bench.iter_batched(
                    || {
                        conversation += 1;
                        follow_up(size, conversation)
                    },
                    |b| route_once(&mut worker, &store, &hosts, &b, 1),
                    BatchSize::SmallInput,
                )
            },
        );
        // A conversation whose record is stale every time it is followed.
        let stale_body = follow_up(size, u64::MAX);
        let mut now = 0;
        c.bench_with_input(
            BenchmarkId::new("route_stale_history", size),
            &stale_body,
            |bench, b| {
                bench.iter(|| {
                    now += 2 * REFRESH_MS;
                    route_once(&mut worker, &store, &hosts, b, now)
                })
            },
        );
        let mut calls = |body: &str, now| route_once(&mut worker, &store, &hosts, body, now);
        let (first, stale) = (follow_up(size, 1 << 40), 10 * REFRESH_MS);
        println!(
            "shared-data calls per request at {size} B: known group {}, new group {}, new history {}, stale history {}",
            calls(&body(size, 1), 1),
            calls(&body(size, 1).replace("careful", "fresh"), 1),
            calls(&first, 1),
            calls(&first, stale),
        );
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
