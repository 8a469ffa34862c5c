#![cfg(not(target_arch = "wasm32"))]
//! Precise mode end to end, every part real: a simulated fleet tokenizing with a byte-level BPE
//! and publishing vLLM's KV events, kvroute-indexer subscribed to it, and Envoy with kvroute
//! rendering prompts with the engines' chat template and polling the indexer. A prompt a replica
//! cached draws the request there (decision `engine`), whichever replica its group would go
//! to; once that replica's cache is reset, the request is placed by its group again.

mod common;

use kvroute_indexer::config::{Config as IndexerConfig, EngineSpec};
use kvroute_sim::fleet::Fleet;
use kvroute_sim::spec::FleetSpec;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const MODEL: &str = "m";
/// The simulator's rendering of plain chats (ChatML), as a Jinja chat template.
const CHATML: &str = "{% for message in messages %}<|im_start|>{{ message.role }}\n\
{{ message.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}\
<|im_start|>assistant\n{% endif %}";

fn body(tag: &str) -> Value {
    let system: String = (0..80)
        .map(|i| format!("Rule {i} of {tag}: the café opens at {i} o'clock. "))
        .collect();
    json!({"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": format!("When does {tag} open?")}]})
}

/// Polls `check` every 100 ms for up to 60 s; panics with `what` when it never holds.
async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while !check().await {
        assert!(start.elapsed() < Duration::from_secs(60), "never: {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn post(url: &str, body: &Value) {
    let resp = common::client()
        .post(url)
        .json(body)
        .send()
        .await
        .expect("request");
    assert_eq!(resp.status(), 200, "{url}");
    resp.bytes().await.expect("body");
}

/// The indexer's health page: its streams, each with its endpoint, next sequence and keys.
async fn health(indexer: &str) -> Value {
    common::client()
        .get(format!("{indexer}/health"))
        .send()
        .await
        .expect("health")
        .json()
        .await
        .expect("health json")
}

/// Keys the indexer says `endpoint` holds, from its health page.
async fn keys_held(indexer: &str, endpoint: &str) -> u64 {
    health(indexer).await["streams"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|s| s["endpoint"] == endpoint)
        .filter_map(|s| s["keys"].as_u64())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_replica_whose_engine_cached_the_prompt_draws_it_until_it_evicts_it() {
    let tokenizer = std::env::temp_dir().join(format!(
        "kvroute-precise-e2e-{}-tokenizer.json",
        std::process::id()
    ));
    kvroute_sim::bpe::write(&tokenizer).expect("tokenizer written");
    let spec = FleetSpec {
        replicas: 3,
        model: MODEL.into(),
        time_scale: 0.05,
        tokenizer: Some(tokenizer.to_string_lossy().into_owned()),
        ..FleetSpec::default()
    };
    let sim = Fleet::start(spec, 0, 0).await.expect("sim fleet starts");
    let indexer = kvroute_indexer::start(IndexerConfig {
        listen: "127.0.0.1:0".parse().expect("address"),
        tokenizer: tokenizer.clone(),
        model: MODEL.into(),
        chunk_size: 512,
        engines: sim
            .replicas
            .iter()
            .map(|r| EngineSpec {
                endpoint: r.addr.to_string(),
                events: r.kv_events_endpoint(),
                replay: None,
                model: None,
            })
            .collect(),
        topic: String::new(),
        envoy_admin: None,
        cluster: None,
        kv_events_port: None,
        replay_port: None,
        stale_after: 3600.0,
        gap_hold: 3600.0,
        feed_capacity: 1 << 16,
    })
    .await
    .expect("indexer starts");
    let index_url = format!("http://{}", indexer.addr);

    // A publisher drops what it sends before a subscription reaches it: send until every
    // replica's stream has been heard, then start from empty caches.
    let mut probe = 0;
    eventually("every stream heard", || {
        probe += 1;
        let (sim, index_url) = (&sim, &index_url);
        async move {
            for r in &sim.replicas {
                let body = json!({"model": MODEL, "max_tokens": 1,
                                  "prompt": format!("probe {probe} {}", "word ".repeat(300))});
                post(&format!("{}/v1/completions", r.url()), &body).await;
            }
            health(index_url).await["streams"]
                .as_array()
                .is_some_and(|s| s.iter().all(|s| !s["next_seq"].is_null()))
        }
    })
    .await;
    for r in &sim.replicas {
        r.replica.reset_prefix_cache();
    }

    let backends = sim.replicas.iter().map(|r| r.addr).collect();
    let config = json!({"debug_header": true, "stats_interval_ms": 200,
                        "index_cluster": "kvroute_indexer", "chat_template": CHATML});
    let envoy = common::kvroute_with_indexer(backends, indexer.addr, config).await;

    // Each of three prompts cached by a replica chosen here, not by kvroute: each goes there.
    for (n, r) in sim.replicas.iter().enumerate() {
        let tag = format!("shop {n}");
        let cached = r.addr.to_string();
        post(&format!("{}/v1/chat/completions", r.url()), &body(&tag)).await;
        let indexed = || async { keys_held(&index_url, &cached).await >= 2 };
        eventually("the indexer holds the prompt", indexed).await;
        common::index_applied(&envoy, 3).await;
        assert_eq!(
            common::decided(&envoy, &body(&tag)).await,
            ("engine".to_string(), cached.clone()),
            "prompt {n}"
        );
    }

    // The first replica's engine drops everything: its prompt is placed by its group again.
    let first = sim.replicas[0].addr.to_string();
    sim.replicas[0].replica.reset_prefix_cache();
    let emptied = || async { keys_held(&index_url, &first).await == 0 };
    eventually("the indexer drops the reset replica's keys", emptied).await;
    common::index_applied(&envoy, 3).await;
    let (decision, _) = common::decided(&envoy, &body("shop 0")).await;
    assert_ne!(
        decision, "engine",
        "the evicted prompt still drew the request"
    );
    let _ = std::fs::remove_file(&tokenizer);
}
