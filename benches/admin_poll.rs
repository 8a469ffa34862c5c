//! Cost of one admin poll's parse on a large mesh: a 2,000-cluster × 10-host `/clusters?format=json`
//! document, keeping the one routed cluster (what kvroute does with `clusters` set) and keeping
//! every cluster (without it); and a whole round: the parse, the snapshot the poller publishes to
//! shared data, and one worker reading it back (every worker does, on its next tick).
//! `cargo bench -p kvroute --bench admin_poll`; natively, so the filter's V8 cost is a small
//! multiple of this.

use criterion::{criterion_group, criterion_main, Criterion};
use kvroute::hosts::{decode_snapshot, encode_snapshot, parse_admin_clusters, PolledClusters};
use kvroute_harness::mesh::clusters_json;

const POOL: &str = "outbound|8000||vllm.llm.svc.cluster.local";

fn bench(c: &mut Criterion) {
    let pool: Vec<_> = (1..=8)
        .map(|i| std::net::SocketAddr::from(([127, 0, 0, 1], 8000 + i)))
        .collect();
    let doc = clusters_json(POOL, &pool, 1999, 10);
    println!("document: {} bytes, 2,000 clusters", doc.len());
    let routed = [POOL.to_string()];
    let keep = PolledClusters::new(&routed, None);
    assert_eq!(
        parse_admin_clusters(doc.as_bytes(), keep).unwrap()[POOL].len(),
        8
    );
    let mut group = c.benchmark_group("admin_poll_2000x10");
    group.sample_size(20);
    for (name, keep) in [
        ("routed_cluster", keep),
        ("all_clusters", PolledClusters::ALL),
    ] {
        let snapshot = parse_admin_clusters(doc.as_bytes(), keep).unwrap();
        println!(
            "keep {name}: {} hosts, published snapshot {} bytes",
            snapshot.values().map(Vec::len).sum::<usize>(),
            encode_snapshot(&snapshot).len()
        );
        group.bench_function(format!("parse_keep_{name}"), |b| {
            b.iter(|| parse_admin_clusters(doc.as_bytes(), keep))
        });
        group.bench_function(format!("round_keep_{name}"), |b| {
            b.iter(|| {
                let snapshot = parse_admin_clusters(doc.as_bytes(), keep).unwrap();
                decode_snapshot(&encode_snapshot(&snapshot))
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
