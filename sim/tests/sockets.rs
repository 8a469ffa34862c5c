//! The KV-event sockets as ZeroMQ peers see them: the PUB sends `[topic, seq, payload]` numbered
//! from 0 and skips what the stream drops; the replay ROUTER answers each DEALER with the last
//! `buffer_steps` messages from the number it asks, on its own connection.

use crate::common;

use common::{field, next_message, replay_from, subscribed};
use kvroute_sim::kv_events::{start_publisher, Format, Options, Published};
use kvroute_sim::prefix_cache::CacheEvent;
use rmpv::Value;
use std::net::SocketAddr;

fn options(buffer_steps: usize) -> Options {
    Options {
        topic: "kv-events".into(),
        block_size: 16,
        format: Format::Map,
        buffer_steps,
    }
}

fn batch(events: Vec<CacheEvent>, dropped: bool) -> Published {
    Published { events, dropped }
}

fn localhost() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

fn seq_of(frame: &[u8]) -> u64 {
    u64::from_be_bytes(frame.try_into().expect("8 bytes"))
}

/// The events of a `KVEventBatch` payload.
fn events(payload: &[u8]) -> Vec<Value> {
    let batch = rmpv::decode::read_value(&mut &payload[..]).unwrap();
    let parts = batch.as_array().expect("[ts, events, rank]");
    assert_eq!(parts.len(), 3);
    parts[1].as_array().unwrap().clone()
}

#[tokio::test]
async fn a_publisher_sends_topic_big_endian_seq_and_payload() {
    let publisher = start_publisher(localhost(), None, options(10))
        .await
        .unwrap();
    assert!(publisher.replay.is_none());
    let mut sub = subscribed(publisher.addr, "").await;
    let stored = CacheEvent::Stored {
        hashes: vec![u64::MAX - 1, 7],
        parent: Some(3),
        token_ids: (0..32).collect(),
        salt: None,
    };
    let tx = publisher.events;
    tx.send(batch(vec![stored], false)).unwrap();
    tx.send(batch(vec![CacheEvent::AllCleared], false)).unwrap();
    for (expected_seq, tag) in [(0u64, "BlockStored"), (1, "AllBlocksCleared")] {
        let frames = next_message(&mut sub).await;
        assert_eq!(frames.len(), 3);
        assert_eq!(frames[0], b"kv-events");
        assert_eq!(frames[1], expected_seq.to_be_bytes());
        assert_eq!(field(&events(&frames[2])[0], "type").as_str(), Some(tag));
    }
}

#[tokio::test]
async fn the_replay_socket_resends_the_last_buffer_steps_messages_from_the_start_asked() {
    let publisher = start_publisher(localhost(), Some(localhost()), options(3))
        .await
        .unwrap();
    let replay = publisher.replay.unwrap();
    assert!(replay_from(replay, 0).await.is_empty());
    let mut sub = subscribed(publisher.addr, "").await;
    for i in 0..5u64 {
        let removed = CacheEvent::Removed { hashes: vec![i] };
        publisher.events.send(batch(vec![removed], i == 3)).unwrap();
    }
    let mut heard = Vec::new();
    while heard.last() != Some(&4) {
        heard.push(seq_of(&next_message(&mut sub).await[1]));
    }
    assert_eq!(heard, [0, 1, 2, 4], "message 3 is dropped from the stream");

    // Two DEALERs at once: each gets the answer to its own request.
    let (from_0, from_4) = tokio::join!(replay_from(replay, 0), replay_from(replay, 4));
    let seqs: Vec<u64> = from_0.iter().map(|m| seq_of(&m[2])).collect();
    assert_eq!(seqs, [2, 3, 4], "the last three, the dropped one too");
    assert!(from_0
        .iter()
        .all(|m| m[0].is_empty() && m[1] == b"kv-events"));
    let removed = &events(&from_0[1][3])[0];
    assert_eq!(
        field(removed, "block_hashes").as_array().unwrap()[0].as_u64(),
        Some(3)
    );
    let seqs: Vec<u64> = from_4.iter().map(|m| seq_of(&m[2])).collect();
    assert_eq!(seqs, [4]);
    assert!(replay_from(replay, 5).await.is_empty());
}
