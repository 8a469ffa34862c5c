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
use bytes::Bytes;
use rmpv::Value;
use std::collections::VecDeque;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc;
use zeromq::{
    PubSocket, RouterRecvHalf, RouterSendHalf, RouterSocket, Socket, SocketRecv, SocketSend,
    ZmqMessage,
};

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

/// Binds a PUB socket on `addr` (and a replay ROUTER on `replay`, if given) and publishes every
/// batch sent to the returned channel.
pub async fn start_publisher(
    addr: SocketAddr,
    replay: Option<SocketAddr>,
    options: Options,
) -> io::Result<Publisher> {
    let (socket, local) = bound::<PubSocket>(addr).await?;
    let (router, replay) = match replay {
        Some(at) => {
            let (router, local) = bound::<RouterSocket>(at).await?;
            (Some(router.split()), Some(local))
        }
        None => (None, None),
    };
    let muted = Arc::new(AtomicBool::new(false));
    let (tx, rx) = mpsc::unbounded_channel::<Published>();
    tokio::spawn(publish(rx, socket, router, options, muted.clone()));
    Ok(Publisher {
        addr: local,
        replay,
        events: tx,
        muted,
    })
}

/// A ZeroMQ socket listening on `addr`, and the address it got.
async fn bound<S: Socket>(addr: SocketAddr) -> io::Result<(S, SocketAddr)> {
    let listener = std::net::TcpListener::bind(addr)?;
    let local = listener.local_addr()?;
    let mut socket = S::new();
    socket
        .bind_listener(listener)
        .await
        .map_err(io::Error::other)?;
    Ok((socket, local))
}

/// Publishes each batch from `batches` on `socket` and answers the replay `router`'s requests in
/// between, until the replica drops its sender (which closes both sockets).
///
/// The replica's step never waits here (the channel is unbounded), and this task never waits on
/// a subscriber: zeromq's PUB hands each message to a queue per subscriber and drops it when
/// that queue holds 100,000, as libzmq's PUB does at its high-water mark (vLLM's is 100,000).
async fn publish(
    mut batches: mpsc::UnboundedReceiver<Published>,
    socket: PubSocket,
    mut router: Option<(RouterSendHalf, RouterRecvHalf)>,
    options: Options,
    muted: Arc<AtomicBool>,
) {
    let mut stream = Stream {
        topic: Bytes::from(options.topic.clone().into_bytes()),
        kept: VecDeque::new(),
        keep: router.as_ref().map_or(0, |_| options.buffer_steps),
        socket,
        options,
        seq: 0,
    };
    loop {
        tokio::select! {
            batch = batches.recv() => match batch {
                Some(batch) => stream.send(batch).await,
                None => return,
            },
            request = next_request(&mut router) => match (request, &router) {
                (Ok(request), Some((sender, _))) if !muted.load(Ordering::Relaxed) => {
                    let replies = answer_replay(&stream.kept, &stream.topic, &request.into_vec());
                    tokio::spawn(send_replies(sender.clone(), replies));
                }
                (Ok(_), _) => {}
                (Err(_), _) => router = None,
            },
        }
    }
}

/// One replica's stream of messages: its PUB socket, the next message's number, and the last
/// messages, kept for the replay socket.
struct Stream {
    socket: PubSocket,
    options: Options,
    topic: Bytes,
    seq: u64,
    kept: VecDeque<(u64, Bytes)>,
    /// How many messages `kept` holds at most: `buffer_steps`, or none without a replay socket.
    keep: usize,
}

impl Stream {
    /// Numbers `batch`, keeps it and sends it, unless it is one the stream drops.
    async fn send(&mut self, batch: Published) {
        let o = &self.options;
        let payload = encode_batch(unix_ts(), &batch.events, o.block_size, o.format);
        let (seq, payload) = (self.seq, Bytes::from(payload));
        self.seq += 1;
        if self.keep > 0 {
            if self.kept.len() == self.keep {
                self.kept.pop_front();
            }
            self.kept.push_back((seq, payload.clone()));
        }
        if batch.dropped {
            return;
        }
        if let Ok(message) = ZmqMessage::try_from(frames(&o.topic, seq, payload)) {
            // A PUB send fails only on an empty message.
            let _ = self.socket.send(message).await;
        }
    }
}

/// Sends one request's replies. zeromq's ROUTER waits for room in the peer's queue, so they go
/// from a task of their own: a peer that reads slowly holds up its own answer, not the stream
/// or other peers'.
async fn send_replies(mut sender: RouterSendHalf, replies: Vec<ZmqMessage>) {
    for reply in replies {
        if sender.send(reply).await.is_err() {
            return;
        }
    }
}

/// The next request on the replay socket, its sender's identity first; never, without one.
async fn next_request(
    router: &mut Option<(RouterSendHalf, RouterRecvHalf)>,
) -> zeromq::ZmqResult<ZmqMessage> {
    match router {
        Some((_, requests)) => requests.recv().await,
        None => std::future::pending().await,
    }
}

/// The replies to one replay request `[identity, "", start_seq]`, as the ROUTER received it:
/// the kept messages from `start_seq` on, then the end marker, each addressed to `identity`;
/// nothing for a request of another shape (vLLM logs and drops it).
fn answer_replay(
    kept: &VecDeque<(u64, Bytes)>,
    topic: &Bytes,
    request: &[Bytes],
) -> Vec<ZmqMessage> {
    let (identity, start) = match request {
        [identity, _, start] if start.len() <= 8 => (
            identity,
            start.iter().fold(0u64, |n, &b| n << 8 | u64::from(b)),
        ),
        _ => return Vec::new(),
    };
    let reply = |frames: [Bytes; 4]| {
        let mut message = ZmqMessage::from(identity.clone());
        for frame in frames {
            message.push_back(frame);
        }
        message
    };
    let mut replies: Vec<ZmqMessage> = kept
        .iter()
        .filter(|(seq, _)| *seq >= start)
        .map(|(seq, payload)| {
            let seq = Bytes::copy_from_slice(&seq.to_be_bytes());
            reply([Bytes::new(), topic.clone(), seq, payload.clone()])
        })
        .collect();
    replies.push(reply([
        Bytes::new(),
        Bytes::new(),
        Bytes::copy_from_slice(&END_SEQ),
        Bytes::new(),
    ]));
    replies
}

/// The number of the end marker, `-1` as 8 bytes (vLLM's `END_SEQ`).
pub const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

#[cfg(test)]
mod tests {
    use super::*;

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
}
