//! The routing core's per-request cost when compiled to wasm32-wasip1, where Envoy runs it:
//! parse and prefix keys for 1 KB and 24 KB chat bodies. `make bench-core` runs it under wasmtime
//! (a plain WASI runtime: the core without the proxy-wasm adapter, `--no-default-features`).

use std::hint::black_box;
use std::time::Instant;

use kvroute::prefix::{PrefixKeys, Shape};
use kvroute::request::{self, Api};

const ROUNDS: u32 = 2000;

fn per_call(mut f: impl FnMut()) -> f64 {
    let start = Instant::now();
    for _ in 0..ROUNDS {
        f();
    }
    start.elapsed().as_secs_f64() / f64::from(ROUNDS) * 1e6
}

fn main() {
    for size in [1024usize, 24 * 1024] {
        let system = "You are a careful assistant. ".repeat(size / 29);
        let body = format!(
            r#"{{"model":"Qwen/Qwen3-32B","stream":true,"messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"question number 1"}}]}}"#
        );
        let Ok(prompt) = request::parse(Api::Chat, body.as_bytes()) else {
            eprintln!("the benchmark body did not parse");
            std::process::exit(1);
        };
        let parse = per_call(|| {
            black_box(request::parse(Api::Chat, black_box(body.as_bytes())).ok());
        });
        let keys = per_call(|| {
            let shape = Shape {
                chunk_size: 512,
                max_chunks: 256,
                group_bytes: 4096,
            };
            black_box(PrefixKeys::new(
                &prompt.model,
                black_box(&prompt.text),
                prompt.head,
                prompt.history,
                shape,
            ));
        });
        println!(
            "{:>2} KB chat body: parse {parse:6.2} µs, prefix keys {keys:6.2} µs",
            size / 1024
        );
    }
}
