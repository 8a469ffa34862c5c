//! End-to-end: a request on a replica shows up as a BlockStored event on its ZMQ socket.

mod common;

use common::{fast_fleet, post};
use kvroute_sim::zmtp::SubSocket;
use rmpv::Value;
use serde_json::json;
use std::time::Duration;

fn field<'a>(event: &'a Value, key: &str) -> &'a Value {
    event
        .as_map()
        .and_then(|m| m.iter().find(|(k, _)| k.as_str() == Some(key)))
        .map(|(_, v)| v)
        .unwrap_or_else(|| panic!("no {key} in {event}"))
}

#[tokio::test]
async fn request_publishes_block_stored_with_the_prompt_tokens() {
    let fleet = fast_fleet(1).await;
    let endpoint = fleet.replicas[0].kv_events_endpoint();
    let addr = endpoint.strip_prefix("tcp://").unwrap().parse().unwrap();
    let mut sub = SubSocket::connect(addr, b"kv-events").await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;

    let base = fleet.replicas[0].url();
    let prompt = "alpha beta gamma delta ".repeat(10);
    let tokens = post(
        &format!("{base}/tokenize"),
        &json!({"prompt": prompt}).to_string(),
    )
    .await
    .json();
    let tokens: Vec<u64> = tokens["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    post(
        &format!("{base}/v1/completions"),
        &json!({"prompt": prompt, "max_tokens": 1}).to_string(),
    )
    .await;

    let frames = tokio::time::timeout(Duration::from_secs(2), sub.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(frames[0], b"kv-events");
    assert_eq!(frames[1], 0u64.to_be_bytes());
    let batch = rmpv::decode::read_value(&mut &frames[2][..]).unwrap();
    let event = &batch.as_array().unwrap()[1].as_array().unwrap()[0];
    assert_eq!(field(event, "type").as_str(), Some("BlockStored"));
    assert!(field(event, "parent_block_hash").is_nil());
    let full = tokens.len() / 16 * 16;
    let ids: Vec<u64> = field(event, "token_ids")
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    assert_eq!(ids, tokens[..full]);
    assert_eq!(
        field(event, "block_hashes").as_array().unwrap().len(),
        full / 16
    );
}
