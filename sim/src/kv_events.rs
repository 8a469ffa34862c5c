//! KV events as vLLM publishes them: msgpack batches on a ZMQ PUB socket, one per replica.
//!
//! Wire format (vllm/distributed/kv_events.py, `ZmqEventPublisher`): each message has three
//! frames `[topic, seq as 8-byte big-endian, payload]`, `seq` counting from 0. The payload is
//! msgspec's msgpack of `KVEventBatch(ts, events, data_parallel_rank)`, which keeps
//! `array_like=True`, so it is the array `[ts, [event, ...], 0]`. Events are tagged structs:
//! - `"map"` format (vLLM after PR #42892 dropped `array_like` from the event structs, and what
//!   vllm-router's `kv_index/wire.rs` decodes): `{"type": "BlockStored", "block_hashes": [..],
//!   "parent_block_hash": h|nil, "token_ids": [..], "block_size": 16, "lora_id": nil,
//!   "medium": "GPU", "lora_name": nil, "extra_keys": [nil, ..], "group_idx": 0,
//!   "kv_cache_spec_kind": "full_attention"}`, `{"type": "BlockRemoved", "block_hashes": [..],
//!   "medium": "GPU", "group_idx": 0}`, `{"type": "AllBlocksCleared"}`. `extra_keys` has one
//!   entry per block, as vLLM's `to_event_extra_keys` publishes them untagged: `nil` for a block
//!   without any, `[cache_salt]` for a salted prompt's first block (the only key simulated).
//! - `"array"` format (older vLLM, tag first): `["BlockStored", hashes, parent, token_ids,
//!   block_size, lora_id, medium, lora_name]`, `["BlockRemoved", hashes, medium]`,
//!   `["AllBlocksCleared"]`. It has no `extra_keys`, so a salt is not published in it.
//!
//! Block hashes are unsigned 64-bit integers (vLLM's `ExternalBlockHash` may be int or bytes).

use crate::prefix_cache::CacheEvent;
use crate::zmtp::PubSocket;
use bytes::Bytes;
use rmpv::Value;
use std::io;
use std::net::SocketAddr;
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Map,
    Array,
}

impl Format {
    pub fn from_name(name: &str) -> Format {
        if name == "array" {
            Format::Array
        } else {
            Format::Map
        }
    }
}

const MEDIUM: &str = "GPU";

fn ints<T: Copy + Into<u64>>(xs: &[T]) -> Value {
    Value::Array(xs.iter().map(|&x| Value::from(x.into())).collect())
}

fn opt_hash(h: Option<u64>) -> Value {
    h.map_or(Value::Nil, Value::from)
}

/// `extra_keys` of a stored chain of `blocks` blocks: the salt, if any, is the first block's.
fn extra_keys(blocks: usize, salt: Option<&str>) -> Value {
    let mut keys = vec![Value::Nil; blocks];
    if let (Some(first), Some(salt)) = (keys.first_mut(), salt) {
        *first = Value::Array(vec![Value::from(salt)]);
    }
    Value::Array(keys)
}

fn tagged_map(tag: &str, fields: Vec<(&str, Value)>) -> Value {
    let mut entries = vec![(Value::from("type"), Value::from(tag))];
    entries.extend(fields.into_iter().map(|(k, v)| (Value::from(k), v)));
    Value::Map(entries)
}

/// One event as msgpack value.
pub fn encode_event(event: &CacheEvent, block_size: usize, format: Format) -> Value {
    match (event, format) {
        (
            CacheEvent::Stored {
                hashes,
                parent,
                token_ids,
                salt,
            },
            Format::Map,
        ) => tagged_map(
            "BlockStored",
            vec![
                ("block_hashes", ints(hashes)),
                ("parent_block_hash", opt_hash(*parent)),
                ("token_ids", ints(token_ids)),
                ("block_size", Value::from(block_size as u64)),
                ("lora_id", Value::Nil),
                ("medium", Value::from(MEDIUM)),
                ("lora_name", Value::Nil),
                ("extra_keys", extra_keys(hashes.len(), salt.as_deref())),
                ("group_idx", Value::from(0u64)),
                ("kv_cache_spec_kind", Value::from("full_attention")),
            ],
        ),
        (
            CacheEvent::Stored {
                hashes,
                parent,
                token_ids,
                ..
            },
            Format::Array,
        ) => Value::Array(vec![
            Value::from("BlockStored"),
            ints(hashes),
            opt_hash(*parent),
            ints(token_ids),
            Value::from(block_size as u64),
            Value::Nil,
            Value::from(MEDIUM),
            Value::Nil,
        ]),
        (CacheEvent::Removed { hashes }, Format::Map) => tagged_map(
            "BlockRemoved",
            vec![
                ("block_hashes", ints(hashes)),
                ("medium", Value::from(MEDIUM)),
                ("group_idx", Value::from(0u64)),
            ],
        ),
        (CacheEvent::Removed { hashes }, Format::Array) => Value::Array(vec![
            Value::from("BlockRemoved"),
            ints(hashes),
            Value::from(MEDIUM),
        ]),
        (CacheEvent::AllCleared, Format::Map) => tagged_map("AllBlocksCleared", vec![]),
        (CacheEvent::AllCleared, Format::Array) => {
            Value::Array(vec![Value::from("AllBlocksCleared")])
        }
    }
}

/// A whole `KVEventBatch` payload: `[ts, [events], data_parallel_rank]`.
pub fn encode_batch(ts: f64, events: &[CacheEvent], block_size: usize, format: Format) -> Vec<u8> {
    let batch = Value::Array(vec![
        Value::F64(ts),
        Value::Array(
            events
                .iter()
                .map(|e| encode_event(e, block_size, format))
                .collect(),
        ),
        Value::from(0u64),
    ]);
    let mut out = Vec::new();
    // Writing to a Vec cannot fail.
    let _ = rmpv::encode::write_value(&mut out, &batch);
    out
}

/// The three ZMQ frames of message number `seq`.
pub fn frames(topic: &str, seq: u64, payload: Vec<u8>) -> Vec<Bytes> {
    vec![
        Bytes::copy_from_slice(topic.as_bytes()),
        Bytes::copy_from_slice(&seq.to_be_bytes()),
        Bytes::from(payload),
    ]
}

fn unix_ts() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Binds a PUB socket on `addr` and publishes every batch sent to the returned channel.
pub async fn start_publisher(
    addr: SocketAddr,
    topic: String,
    block_size: usize,
    format: Format,
) -> io::Result<(SocketAddr, mpsc::UnboundedSender<Vec<CacheEvent>>)> {
    let (socket, local) = PubSocket::bind(addr).await?;
    let (tx, mut rx) = mpsc::unbounded_channel::<Vec<CacheEvent>>();
    tokio::spawn(async move {
        let mut seq = 0u64;
        while let Some(events) = rx.recv().await {
            let payload = encode_batch(unix_ts(), &events, block_size, format);
            socket.send(frames(&topic, seq, payload));
            seq += 1;
        }
    });
    Ok((local, tx))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::zmtp::SubSocket;
    use std::time::Duration;

    fn stored() -> CacheEvent {
        CacheEvent::Stored {
            hashes: vec![u64::MAX - 1, 7],
            parent: Some(3),
            token_ids: (0..32).collect(),
            salt: None,
        }
    }

    fn field<'a>(map: &'a Value, key: &str) -> &'a Value {
        map.as_map()
            .and_then(|m| m.iter().find(|(k, _)| k.as_str() == Some(key)))
            .map(|(_, v)| v)
            .unwrap_or_else(|| panic!("no field {key} in {map}"))
    }

    #[test]
    fn map_batch_decodes_to_vllm_shape() {
        let payload = encode_batch(
            1.5,
            &[
                stored(),
                CacheEvent::Removed { hashes: vec![9] },
                CacheEvent::AllCleared,
            ],
            16,
            Format::Map,
        );
        let batch = rmpv::decode::read_value(&mut &payload[..]).unwrap();
        let parts = batch.as_array().unwrap();
        assert_eq!(parts.len(), 3);
        assert_eq!(parts[0].as_f64(), Some(1.5));
        assert_eq!(parts[2].as_u64(), Some(0));
        let events = parts[1].as_array().unwrap();
        assert_eq!(field(&events[0], "type").as_str(), Some("BlockStored"));
        assert_eq!(
            field(&events[0], "block_hashes").as_array().unwrap()[0].as_u64(),
            Some(u64::MAX - 1)
        );
        assert_eq!(field(&events[0], "parent_block_hash").as_u64(), Some(3));
        assert_eq!(field(&events[0], "token_ids").as_array().unwrap().len(), 32);
        assert_eq!(field(&events[0], "block_size").as_u64(), Some(16));
        assert!(field(&events[0], "lora_id").is_nil());
        assert_eq!(field(&events[0], "medium").as_str(), Some("GPU"));
        assert_eq!(field(&events[1], "type").as_str(), Some("BlockRemoved"));
        assert_eq!(
            field(&events[1], "block_hashes").as_array().unwrap()[0].as_u64(),
            Some(9)
        );
        assert_eq!(events[2].as_map().unwrap().len(), 1);
    }

    #[test]
    fn a_salted_first_block_carries_the_salt_in_its_extra_keys() {
        let salted = CacheEvent::Stored {
            hashes: vec![1, 2, 3],
            parent: None,
            token_ids: (0..48).collect(),
            salt: Some("tenant-1".into()),
        };
        let payload = encode_batch(1.0, &[salted, stored()], 16, Format::Map);
        let batch = rmpv::decode::read_value(&mut &payload[..]).unwrap();
        let events = batch.as_array().unwrap()[1].as_array().unwrap();
        let keys = field(&events[0], "extra_keys").as_array().unwrap();
        assert_eq!(
            keys,
            &vec![
                Value::Array(vec![Value::from("tenant-1")]),
                Value::Nil,
                Value::Nil
            ]
        );
        let unsalted = field(&events[1], "extra_keys").as_array().unwrap();
        assert_eq!(unsalted, &vec![Value::Nil, Value::Nil]);
    }

    #[test]
    fn array_batch_puts_the_tag_first() {
        let payload = encode_batch(
            2.0,
            &[stored(), CacheEvent::Removed { hashes: vec![9] }],
            16,
            Format::Array,
        );
        let batch = rmpv::decode::read_value(&mut &payload[..]).unwrap();
        let events = batch.as_array().unwrap()[1].as_array().unwrap();
        let s = events[0].as_array().unwrap();
        assert_eq!(s[0].as_str(), Some("BlockStored"));
        assert_eq!(s.len(), 8);
        assert_eq!(s[2].as_u64(), Some(3));
        assert_eq!(s[4].as_u64(), Some(16));
        assert_eq!(s[6].as_str(), Some("GPU"));
        let r = events[1].as_array().unwrap();
        assert_eq!((r[0].as_str(), r.len()), (Some("BlockRemoved"), 3));
    }

    #[tokio::test]
    async fn publisher_sends_topic_big_endian_seq_and_payload() {
        let (addr, tx) = start_publisher(
            "127.0.0.1:0".parse().unwrap(),
            "kv-events".into(),
            16,
            Format::Map,
        )
        .await
        .unwrap();
        let mut sub = SubSocket::connect(addr, b"").await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        tx.send(vec![stored()]).unwrap();
        tx.send(vec![CacheEvent::AllCleared]).unwrap();
        for expected_seq in 0..2u64 {
            let frames = tokio::time::timeout(Duration::from_secs(2), sub.recv())
                .await
                .unwrap()
                .unwrap();
            assert_eq!(frames.len(), 3);
            assert_eq!(frames[0], b"kv-events");
            assert_eq!(frames[1], expected_seq.to_be_bytes());
            let batch = rmpv::decode::read_value(&mut &frames[2][..]).unwrap();
            assert_eq!(batch.as_array().unwrap().len(), 3);
        }
    }
}
