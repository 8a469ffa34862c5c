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
//!
//! The replay socket (vLLM's `replay_endpoint`) is a ROUTER answering a request
//! `["", start_seq as 8 bytes big-endian]` with every buffered message from `start_seq` on, each
//! as `["", topic, seq, payload]`, then the end marker `["", "", -1 as 8 bytes, ""]` (vLLM 0.32's
//! `_service_replay`); the buffer holds the last `buffer_steps` messages (vLLM's default 10,000).

use crate::prefix_cache::CacheEvent;
use crate::sglang_events;
use crate::zmtp::{self, PubSocket};
use bytes::Bytes;
use rmpv::Value;
use std::collections::VecDeque;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Map,
    Array,
    /// SGLang's events ([`crate::sglang_events`]): one per page, signed hashes.
    Sglang,
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

/// A msgspec tagged struct without `array_like`: its fields by name after `type`.
pub(crate) fn tagged_map(tag: &str, fields: Vec<(&str, Value)>) -> Value {
    let mut entries = vec![(Value::from("type"), Value::from(tag))];
    entries.extend(fields.into_iter().map(|(k, v)| (Value::from(k), v)));
    Value::Map(entries)
}

/// One event as msgpack value (for SGLang's, the array of the per-page events it becomes).
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
        (event, Format::Sglang) => {
            let mut events = Vec::new();
            sglang_events::encode(event, block_size, &mut events);
            Value::Array(events)
        }
    }
}

/// A whole `KVEventBatch` payload: `[ts, [events], data_parallel_rank]` (SGLang's third
/// element is its `attn_dp_rank`).
pub fn encode_batch(ts: f64, events: &[CacheEvent], block_size: usize, format: Format) -> Vec<u8> {
    let mut encoded = Vec::with_capacity(events.len());
    for e in events {
        match format {
            Format::Sglang => sglang_events::encode(e, block_size, &mut encoded),
            _ => encoded.push(encode_event(e, block_size, format)),
        }
    }
    let batch = Value::Array(vec![
        Value::F64(ts),
        Value::Array(encoded),
        Value::from(0u64),
    ]);
    let mut out = Vec::new();
    // Writing to a Vec cannot fail.
    let _ = rmpv::encode::write_value(&mut out, &batch);
    out
}

/// The three ZMQ frames of message number `seq`.
pub fn frames(topic: &str, seq: u64, payload: impl Into<Bytes>) -> Vec<Bytes> {
    vec![
        Bytes::copy_from_slice(topic.as_bytes()),
        Bytes::copy_from_slice(&seq.to_be_bytes()),
        payload.into(),
    ]
}

fn unix_ts() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// One batch of cache changes for the publisher.
#[derive(Debug, Clone)]
pub struct Published {
    pub events: Vec<CacheEvent>,
    /// Numbered and kept for replay but not sent on the PUB socket: every subscriber misses it,
    /// as one does past its high-water mark (a fault knob).
    pub dropped: bool,
}

/// How a replica publishes: the topic, the block size and format of its events, and how many
/// messages its replay socket keeps.
#[derive(Debug, Clone)]
pub struct Options {
    pub topic: String,
    pub block_size: usize,
    pub format: Format,
    /// vLLM's `buffer_steps`.
    pub buffer_steps: usize,
}

/// A running publisher: where its sockets listen, and where to send batches.
pub struct Publisher {
    pub addr: SocketAddr,
    /// The replay ROUTER's address, if it has one.
    pub replay: Option<SocketAddr>,
    pub events: mpsc::UnboundedSender<Published>,
    /// While set, the replay socket answers nothing, as an engine that is down.
    pub muted: Arc<AtomicBool>,
}

/// The last messages sent, by number, for the replay socket.
type Buffer = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

/// Binds a PUB socket on `addr` (and a replay ROUTER on `replay`, if given) and publishes every
/// batch sent to the returned channel.
pub async fn start_publisher(
    addr: SocketAddr,
    replay: Option<SocketAddr>,
    options: Options,
) -> io::Result<Publisher> {
    let (socket, local) = PubSocket::bind(addr).await?;
    let buffer: Buffer = Arc::new(Mutex::new(VecDeque::new()));
    let topic = Bytes::from(options.topic.clone().into_bytes());
    let muted = Arc::new(AtomicBool::new(false));
    let replay = match replay {
        Some(at) => {
            let (buffer, topic, muted) = (buffer.clone(), topic.clone(), muted.clone());
            let answer = move |request| {
                if muted.load(Ordering::Relaxed) {
                    return Vec::new();
                }
                answer_replay(&buffer, &topic, request)
            };
            Some(zmtp::bind_router(at, Arc::new(answer)).await?)
        }
        None => None,
    };
    let (tx, mut rx) = mpsc::unbounded_channel::<Published>();
    tokio::spawn(async move {
        let mut seq = 0u64;
        while let Some(batch) = rx.recv().await {
            let payload = Bytes::from(encode_batch(
                unix_ts(),
                &batch.events,
                options.block_size,
                options.format,
            ));
            if replay.is_some() && options.buffer_steps > 0 {
                let mut buffer = buffer.lock().unwrap_or_else(|e| e.into_inner());
                if buffer.len() == options.buffer_steps {
                    buffer.pop_front();
                }
                buffer.push_back((seq, payload.clone()));
            }
            if !batch.dropped {
                socket.send(frames(&options.topic, seq, payload));
            }
            seq += 1;
        }
    });
    Ok(Publisher {
        addr: local,
        replay,
        events: tx,
        muted,
    })
}

/// The replies to one replay request: the buffered messages from its start number on, then the
/// end marker; nothing for a request that is not `["", start_seq]` (vLLM logs and drops it).
fn answer_replay(buffer: &Buffer, topic: &Bytes, request: Vec<Vec<u8>>) -> Vec<Vec<Bytes>> {
    let start = match request.as_slice() {
        [_, start] if start.len() <= 8 => start.iter().fold(0u64, |n, &b| n << 8 | u64::from(b)),
        _ => return Vec::new(),
    };
    let buffer = buffer.lock().unwrap_or_else(|e| e.into_inner());
    let mut replies: Vec<Vec<Bytes>> = buffer
        .iter()
        .filter(|(seq, _)| *seq >= start)
        .map(|(seq, payload)| {
            let seq = Bytes::copy_from_slice(&seq.to_be_bytes());
            vec![Bytes::new(), topic.clone(), seq, payload.clone()]
        })
        .collect();
    replies.push(vec![
        Bytes::new(),
        Bytes::new(),
        Bytes::copy_from_slice(&END_SEQ),
        Bytes::new(),
    ]);
    replies
}

/// The number of the end marker, `-1` as 8 bytes (vLLM's `END_SEQ`).
pub const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

#[cfg(test)]
mod tests {
    use super::*;
    use crate::zmtp::{DealerSocket, SubSocket};
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

    #[tokio::test]
    async fn publisher_sends_topic_big_endian_seq_and_payload() {
        let localhost = "127.0.0.1:0".parse().unwrap();
        let publisher = start_publisher(localhost, None, options(10)).await.unwrap();
        assert!(publisher.replay.is_none());
        let mut sub = SubSocket::connect(publisher.addr, b"").await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        let tx = publisher.events;
        tx.send(batch(vec![stored()], false)).unwrap();
        tx.send(batch(vec![CacheEvent::AllCleared], false)).unwrap();
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

    /// The replay socket's answer to a request from `start`: (seq, payload) of each message,
    /// checked to be vLLM's `["", topic, seq, payload]` and to end with its end marker.
    async fn replay_from(addr: SocketAddr, start: u64) -> Vec<(u64, Vec<u8>)> {
        let mut dealer = DealerSocket::connect(addr).await.unwrap();
        dealer.send(&[b"", &start.to_be_bytes()]).await.unwrap();
        let mut messages = Vec::new();
        loop {
            let next = tokio::time::timeout(Duration::from_secs(2), dealer.recv()).await;
            let frames = next.unwrap().unwrap();
            assert_eq!(frames.len(), 4, "{frames:?}");
            assert!(frames[0].is_empty());
            if frames[2] == END_SEQ {
                assert!(frames[1].is_empty() && frames[3].is_empty());
                return messages;
            }
            assert_eq!(frames[1], b"kv-events");
            let seq = u64::from_be_bytes(frames[2].clone().try_into().unwrap());
            messages.push((seq, frames[3].clone()));
        }
    }

    #[tokio::test]
    async fn the_replay_socket_resends_the_last_buffer_steps_messages_from_the_start_asked() {
        let localhost: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let publisher = start_publisher(localhost, Some(localhost), options(3))
            .await
            .unwrap();
        let replay = publisher.replay.unwrap();
        assert!(replay_from(replay, 0).await.is_empty());
        let mut sub = SubSocket::connect(publisher.addr, b"").await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        for i in 0..5u64 {
            let removed = CacheEvent::Removed { hashes: vec![i] };
            publisher.events.send(batch(vec![removed], i == 3)).unwrap();
        }
        let mut heard = Vec::new();
        while heard.last() != Some(&4) {
            let frames = tokio::time::timeout(Duration::from_secs(2), sub.recv()).await;
            let frames = frames.unwrap().unwrap();
            heard.push(u64::from_be_bytes(frames[1].clone().try_into().unwrap()));
        }
        assert_eq!(heard, [0, 1, 2, 4], "message 3 is dropped from the stream");

        let replayed = replay_from(replay, 0).await;
        let seqs: Vec<u64> = replayed.iter().map(|(seq, _)| *seq).collect();
        assert_eq!(seqs, [2, 3, 4], "the last three, the dropped one too");
        let payload = rmpv::decode::read_value(&mut &replayed[1].1[..]).unwrap();
        let removed = &payload.as_array().unwrap()[1].as_array().unwrap()[0];
        assert_eq!(
            field(removed, "block_hashes").as_array().unwrap()[0].as_u64(),
            Some(3)
        );
        let seqs: Vec<u64> = replay_from(replay, 4).await.iter().map(|m| m.0).collect();
        assert_eq!(seqs, [4]);
        assert!(replay_from(replay, 5).await.is_empty());
    }
}
