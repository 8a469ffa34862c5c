//! CPU cost of the routing core per request, natively (the filter runs the same code in V8, plus
//! host calls): parse, prefix keys and a full cache-aware route, for 1 KB and 24 KB prompts.
//! `cargo bench -p kvroute --bench route`; Envoy-level overhead is `make bench-overhead`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kvroute::config::Config;
use kvroute::endpoints::Host;
use kvroute::prefix::{PrefixKeys, Shape};
use kvroute::request::{self, Api};
use kvroute::router::{self, RequestInfo, Router};
use kvroute::store::MemoryStore;

fn body(prompt_bytes: usize, question: usize) -> String {
    let system = "You are a careful assistant. ".repeat(prompt_bytes / 29);
    format!(
        r#"{{"model":"Qwen/Qwen3-32B","stream":true,"messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"question number {question}"}}]}}"#
    )
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
        let router = Router::new(Config::default());
        let store = MemoryStore::new();
        let mut n = 0u64;
        c.bench_with_input(
            BenchmarkId::new("route_shared_prefix", size),
            &size,
            |bench, &size| {
                bench.iter(|| {
                    n += 1;
                    let b = body(size, (n % 16) as usize);
                    let req = RequestInfo {
                        api: Api::Chat,
                        body: b.as_bytes(),
                        session: None,
                        request_id: None,
                    };
                    let r = router.route(&store, &hosts, &req, n);
                    if let Ok(r) = r {
                        router::finish(&store, r.endpoint_id);
                    }
                })
            },
        );
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
