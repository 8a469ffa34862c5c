//! Precise mode through a real Envoy over a simulated fleet: what the indexer's change feed says
//! the engines hold sends a request to the holder, ahead of its group's home; a dropped prefix
//! sends it home again; an indexer that stops answering leaves routing as it is without one. The
//! indexer here is an HTTP server on 127.0.0.1 serving the feed's documents.

use crate::common;

use kvroute::gateway::stat_names::Counter;
use kvroute::prefix::{PrefixKeys, Shape};
use kvroute::request::{self, Api};
use kvroute_harness::mesh::FakeAdmin;
use kvroute_sim::spec::FleetSpec;
use serde_json::{json, Value};
use std::time::Duration;

const MODEL: &str = "Qwen/Qwen3-32B";

fn body() -> Value {
    let system: String = (0..60)
        .map(|i| format!("Clause {i}: the tenant keeps the garden tidy. "))
        .collect();
    json!({"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": "Who mows the lawn?"}]})
}

/// The request's keys, as the filter computes them with the default shape.
fn keys(body: &Value) -> Vec<u64> {
    let bytes = body.to_string();
    let prompt = request::parse(Api::Chat, bytes.as_bytes()).expect("a chat request");
    let shape = Shape {
        chunk_size: 512,
        max_chunks: 256,
        group_bytes: 4096,
    };
    let keys = PrefixKeys::salted(None, &prompt.model, &prompt.text, prompt.head, false, shape);
    keys.keys
}

/// A feed answer: `holder` holds (`held`) or drops every key of `keys`.
fn feed(epoch: u64, version: u64, full: bool, holder: &str, held: bool, keys: &[u64]) -> String {
    let changes: Vec<Value> = keys.iter().map(|k| json!([0, u8::from(held), k])).collect();
    json!({"epoch": epoch, "version": version, "full": full, "endpoints": [holder],
           "stale": [], "changes": changes})
    .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_that_holds_the_prefix_draws_the_request_until_it_drops_it() {
    let spec = FleetSpec {
        replicas: 3,
        time_scale: 0.05,
        ..FleetSpec::default()
    };
    let sim = kvroute_sim::fleet::Fleet::start(spec, 0, 0)
        .await
        .expect("sim fleet starts");
    let indexer = FakeAdmin::start(feed(1, 0, true, "127.0.0.1:1", true, &[]))
        .await
        .expect("fake indexer starts");
    let backends = sim.replicas.iter().map(|r| r.addr).collect();
    let config = json!({"debug_header": true, "stats_interval_ms": 200,
                        "index_cluster": "kvroute_indexer"});
    let envoy = common::kvroute_with_indexer(backends, indexer.addr(), config).await;
    common::index_applied(&envoy, 1).await;
    assert!(
        indexer
            .last_path()
            .starts_with("/v1/changes?epoch=1&since=0"),
        "asked {}",
        indexer.last_path()
    );

    // No engine holds it: its group's home.
    let body = body();
    let (decision, home) = common::decided(&envoy, &body).await;
    assert_eq!(decision, "home");

    // Another replica's engine reports the whole prompt: the request goes there.
    let holder = sim
        .replicas
        .iter()
        .map(|r| r.addr.to_string())
        .find(|a| *a != home)
        .expect("three replicas");
    let keys = keys(&body);
    indexer.answer(200, feed(2, 1, true, &holder, true, &keys));
    common::index_applied(&envoy, 3).await;
    assert_eq!(
        common::decided(&envoy, &body).await,
        ("engine".into(), holder.clone())
    );
    assert!(
        envoy
            .stat(Counter::IndexResyncs.name())
            .await
            .ok()
            .flatten()
            .unwrap_or(0)
            >= 2,
        "two epochs, each in full"
    );

    // It evicts the prompt: placed by its group again (whose home the gateway may have moved by
    // now, once it counted the group).
    indexer.answer(200, feed(2, 2, false, &holder, false, &keys));
    common::index_applied(&envoy, 3).await;
    assert_eq!(common::decided(&envoy, &body).await.0, "home");

    // Holding it again, then the indexer fails: once its last answer is too old the index no
    // longer counts, and the request goes home as it would without one.
    indexer.answer(200, feed(2, 3, false, &holder, true, &keys));
    common::index_applied(&envoy, 3).await;
    assert_eq!(common::decided(&envoy, &body).await.0, "engine");
    let failed = envoy
        .stat(Counter::IndexPollFailed.name())
        .await
        .ok()
        .flatten()
        .unwrap_or(0);
    indexer.answer(503, String::new());
    envoy
        .wait_for_stat(
            Counter::IndexPollFailed.name(),
            |v| v >= failed + 5,
            Duration::from_secs(30),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(common::decided(&envoy, &body).await.0, "home");
}
