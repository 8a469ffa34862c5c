//! Replicas playing SGLang beside vLLM ones in one fleet: an SGLang replica publishes SGLang's
//! KV events (one per page of its page size, signed hashes, chained by parent), serves SGLang's
//! metric names (read by kvroute's metrics parser as load) and its `/v1/loads`, with
//! `num_waiting_uncached_tokens`; the vLLM replicas keep vLLM's.

use crate::common;

use common::{get, post, replay_from, tokens_of};
use kvroute_sim::fleet::Fleet;
use kvroute_sim::spec::{EngineKind, EngineKinds, FleetSpec};
use rmpv::Value;
use serde_json::json;
use std::net::SocketAddr;

const PAGE: usize = 4;

async fn mixed_fleet() -> Fleet {
    use EngineKind::{Sglang, Vllm};
    let spec = FleetSpec {
        replicas: 4,
        time_scale: 0.001,
        engine_kind: EngineKinds::Each(vec![Vllm, Vllm, Sglang, Sglang]),
        page_size: Some(PAGE),
        ..FleetSpec::default()
    };
    Fleet::start(spec, 0, 0).await.expect("fleet starts")
}

fn field<'a>(event: &'a Value, key: &str) -> Option<&'a Value> {
    event
        .as_map()?
        .iter()
        .find(|(k, _)| k.as_str() == Some(key))
        .map(|(_, v)| v)
}

/// Every event the replay socket at `addr` still has, in order.
async fn replayed_events(addr: SocketAddr) -> Vec<Value> {
    let mut events = Vec::new();
    for frames in replay_from(addr, 0).await {
        let batch = rmpv::decode::read_value(&mut &frames[3][..]).unwrap();
        events.extend(batch.as_array().unwrap()[1].as_array().unwrap().clone());
    }
    events
}

#[tokio::test]
async fn an_sglang_replica_publishes_one_event_per_page_with_signed_hashes() {
    let fleet = mixed_fleet().await;
    let announced = fleet.announcement();
    assert!(announced.contains(r#""engine_kind":"vllm""#), "{announced}");
    assert!(
        announced.contains(r#""engine_kind":"sglang""#),
        "{announced}"
    );
    let replica = &fleet.replicas[2];
    assert_eq!(replica.kind(), EngineKind::Sglang);
    let base = replica.url();
    let prompt = "alpha beta gamma delta epsilon ".repeat(12);
    let tokens = tokens_of(&base, &prompt).await;
    post(
        &format!("{base}/v1/completions"),
        &json!({"prompt": prompt, "max_tokens": 1}).to_string(),
    )
    .await;
    let events = replayed_events(replica.kv_events_replay_addr.unwrap()).await;
    let stored: Vec<&Value> = events
        .iter()
        .filter(|e| field(e, "type").and_then(Value::as_str) == Some("BlockStored"))
        .collect();
    assert_eq!(
        stored.len(),
        tokens.len() / PAGE,
        "one event per whole page"
    );
    let mut parent = Value::Nil;
    let mut ids = Vec::new();
    let mut signs = (false, false);
    for event in &stored {
        assert_eq!(
            field(event, "block_size").unwrap().as_u64(),
            Some(PAGE as u64)
        );
        assert_eq!(field(event, "parent_block_hash").unwrap(), &parent);
        assert_eq!(field(event, "medium").unwrap().as_str(), Some("GPU"));
        assert!(field(event, "group_idx").is_none() && field(event, "extra_keys").is_none());
        let hashes = field(event, "block_hashes").unwrap().as_array().unwrap();
        assert_eq!(hashes.len(), 1);
        let hash = hashes[0].as_i64().expect("a signed 64-bit hash");
        signs = (signs.0 || hash < 0, signs.1 || hash >= 0);
        parent = hashes[0].clone();
        ids.extend(
            field(event, "token_ids")
                .unwrap()
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap()),
        );
    }
    assert_eq!(ids, tokens[..ids.len()]);
    assert!(
        signs.0 && signs.1,
        "hashes of both signs over {} pages",
        stored.len()
    );
}

#[tokio::test]
async fn sglang_replicas_serve_sglangs_metrics_and_loads_and_vllm_replicas_vllms() {
    let fleet = mixed_fleet().await;
    let (vllm, sglang) = (fleet.replicas[0].url(), fleet.replicas[3].url());
    let url = format!("{sglang}/v1/completions");
    post(
        &url,
        &json!({"prompt": "one two three ".repeat(30), "max_tokens": 2}).to_string(),
    )
    .await;

    let page = get(&format!("{sglang}/metrics")).await.body;
    for name in [
        "sglang:num_running_reqs{",
        "sglang:num_queue_reqs{",
        "sglang:token_usage{",
        "sglang:max_total_num_tokens{",
        "sglang:cache_hit_rate{",
        "sglang:prompt_tokens_total{",
        "sglang:cached_tokens_total{",
        "sglang:num_requests_total{",
        "sglang:time_to_first_token_seconds_bucket{",
        "sglang:page_size{",
    ] {
        assert!(page.contains(name), "missing {name}\n{page}");
    }
    assert!(!page.contains("vllm:"));
    // kvroute's filter reads an SGLang page as load.
    let read = kvroute::engine_load::parse(page.as_bytes()).expect("kvroute reads the page");
    assert_eq!((read.running, read.waiting), (0, 0));
    assert_eq!(read.completed, Some(1.0));
    assert_eq!(read.kv.capacity_tokens, Some(131_072.0));
    assert!(read.kv.prompt_tokens.is_some_and(|p| p > 0.0));

    let loads = get(&format!("{sglang}/v1/loads")).await.json();
    let load = &loads["loads"][0];
    assert_eq!(load["dp_rank"], 0);
    assert_eq!(load["num_waiting_uncached_tokens"], 0, "idle: {loads}");
    assert_eq!(load["num_waiting_reqs"], 0);
    assert_eq!(load["max_total_num_tokens"], 131_072);
    let text = get(&format!("{sglang}/v1/loads?format=prometheus"))
        .await
        .body;
    assert!(
        text.contains("sglang_num_waiting_uncached_tokens{dp_rank=\"0\"} 0.0"),
        "{text}"
    );
    // kvroute's filter asks an SGLang engine for the prefill queued there.
    assert!(read.serves_loads);
    let core = get(&format!("{sglang}{}", kvroute::engine_load::LOADS_PATH)).await;
    assert_eq!(
        kvroute::engine_load::parse_loads(core.body.as_bytes()),
        Some(0)
    );

    let vllm_page = get(&format!("{vllm}/metrics")).await.body;
    assert!(vllm_page.contains("vllm:num_requests_running{") && !vllm_page.contains("sglang:"));
    assert!(!kvroute::engine_load::parse(vllm_page.as_bytes()).is_some_and(|m| m.serves_loads));
    assert_eq!(get(&format!("{vllm}/v1/loads")).await.status, 404);
}
