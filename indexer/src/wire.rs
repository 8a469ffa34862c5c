//! The engines' KV-event wire format, decoded: ZMQ frames `[topic, seq, payload]` into a
//! sequence number and a batch of events. vLLM and SGLang publish the same format; where they
//! differ is said here and in [`crate::dialect`].
//!
//! `seq` is an 8-byte big-endian counter from 0 per publisher. The payload is msgspec's msgpack
//! of `KVEventBatch(ts, events, rank)`: an array `[ts, [event, ...], rank]` where the batch is
//! `array_like` (vLLM's `data_parallel_rank`, SGLang's `attn_dp_rank`), a map `{"ts", "events",
//! "data_parallel_rank"}` where it is not. Events are msgspec tagged unions, in one of two shapes:
//! - map (current vLLM; SGLang 0.5.23): `{"type": "BlockStored", "block_hashes": [..],
//!   "parent_block_hash": h|nil, "token_ids": [..], "block_size": n, "lora_id": ..,
//!   "medium": "GPU"|.., "lora_name": .., "extra_keys": [entry|nil per block], "group_idx": g,
//!   "kv_cache_spec_kind": ..}` from vLLM, `{.., "medium", "cache_salt", "session_id",
//!   "lora_name"}` from SGLang, with fields at their default left out (`omit_defaults`);
//! - array (older vLLM; SGLang up to 0.5.19 at least, `array_like`): `["BlockStored", hashes,
//!   parent, token_ids, block_size, lora_id, medium, ..]`, trailing defaults left out; after
//!   `medium` vLLM has `lora_name, extra_keys, group_idx, kv_cache_spec_kind, ..`, SGLang 0.5.19
//!   `metadata` (`{"cache_salt": ..}`), so the dialect names those positions.
//!
//! `BlockRemoved` carries `block_hashes`, `medium` and (vLLM) `group_idx`; `AllBlocksCleared`
//! nothing. A block hash is an integer (SGLang's are signed 64-bit) or bytes (vLLM's
//! `ExternalBlockHash`); bytes are folded to 64 bits, a negative integer kept as its two's
//! complement. A token id is an integer, or in SGLang's EAGLE bigram mode a pair whose first
//! element is the token at that position.

use crate::dialect::Dialect;
use rmpv::Value;
use xxhash_rust::xxh3::xxh3_64;

/// One message's sequence number and events.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    pub seq: u64,
    pub events: Vec<Event>,
    /// The data-parallel rank the publisher stamped, if any.
    pub dp_rank: Option<i64>,
    /// A hash of the payload: tells this message from another run's message of the same number.
    pub digest: u64,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Stored(Stored),
    Removed(Removed),
    AllCleared,
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct Stored {
    pub block_hashes: Vec<u64>,
    pub parent: Option<u64>,
    pub token_ids: Vec<u32>,
    pub block_size: usize,
    /// `None` is the GPU (older vLLM sent no medium).
    pub medium: Option<String>,
    pub lora_name: Option<String>,
    /// One entry per block: its extra hash keys, empty when it has none.
    pub extra_keys: Vec<Vec<ExtraKey>>,
    pub group_idx: Option<u64>,
    pub kv_cache_spec_kind: Option<String>,
    /// SGLang's `cache_salt` (on every block of a salted prompt; vLLM puts it in `extra_keys`).
    pub salt: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct Removed {
    pub block_hashes: Vec<u64>,
    pub medium: Option<String>,
    pub group_idx: Option<u64>,
}

/// One element of a block's `extra_keys` tuple, as far as the index needs to tell them apart.
#[derive(Debug, Clone, PartialEq)]
pub enum ExtraKey {
    /// A string: the LoRA name, the cache salt (first block only), or an older vLLM's
    /// multimodal hash.
    Text(String),
    /// Anything else: a multimodal `(identifier, offset)` pair, prompt-embedding hash bytes, a
    /// LoRA id of older versions.
    Other,
}

/// Why a message could not be decoded.
#[derive(Debug, Clone, PartialEq)]
pub struct WireError(pub String);

impl std::fmt::Display for WireError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

fn err<T>(what: impl Into<String>) -> Result<T, WireError> {
    Err(WireError(what.into()))
}

/// Decodes one ZMQ message of a vLLM engine: `[topic, seq, payload]` (a topic-less
/// `[seq, payload]` is accepted).
pub fn decode_message<B: AsRef<[u8]>>(frames: &[B]) -> Result<Batch, WireError> {
    decode_message_as(frames, Dialect::Vllm)
}

/// [`decode_message`] for an engine of `dialect`.
pub fn decode_message_as<B: AsRef<[u8]>>(
    frames: &[B],
    dialect: Dialect,
) -> Result<Batch, WireError> {
    let (seq, payload) = match frames {
        [_, seq, payload] | [seq, payload] => (seq.as_ref(), payload.as_ref()),
        _ => return err(format!("{} frames, expected 3", frames.len())),
    };
    let seq: [u8; 8] = match seq.try_into() {
        Ok(s) => s,
        Err(_) => return err(format!("sequence frame of {} bytes", seq.len())),
    };
    let mut batch = decode_payload_as(payload, dialect)?;
    batch.seq = u64::from_be_bytes(seq);
    Ok(batch)
}

/// Decodes a vLLM `KVEventBatch` payload (sequence number 0).
pub fn decode_payload(payload: &[u8]) -> Result<Batch, WireError> {
    decode_payload_as(payload, Dialect::Vllm)
}

/// [`decode_payload`] for an engine of `dialect`.
pub fn decode_payload_as(payload: &[u8], dialect: Dialect) -> Result<Batch, WireError> {
    let value = rmpv::decode::read_value(&mut &payload[..])
        .map_err(|e| WireError(format!("msgpack: {e}")))?;
    let (events, rank) = match &value {
        Value::Array(parts) if parts.len() >= 2 => (&parts[1], parts.get(2)),
        Value::Map(_) => match field(&value, "events") {
            Some(events) => (events, field(&value, "data_parallel_rank")),
            None => return err("batch map without events"),
        },
        _ => return err("batch is neither [ts, events, rank] nor a map"),
    };
    let Value::Array(events) = events else {
        return err("events is not an array");
    };
    let events = events
        .iter()
        .map(|e| decode_event(e, dialect))
        .collect::<Result<_, _>>()?;
    Ok(Batch {
        seq: 0,
        events,
        dp_rank: rank.and_then(Value::as_i64),
        digest: xxh3_64(payload),
    })
}

fn field<'a>(map: &'a Value, key: &str) -> Option<&'a Value> {
    map.as_map()?
        .iter()
        .find(|(k, _)| k.as_str() == Some(key))
        .map(|(_, v)| v)
        .filter(|v| !v.is_nil())
}

/// An event's fields by name: a map's own, an array's by position (the names of the positions
/// both engines share, then the dialect's own).
enum Fields<'a> {
    Map(&'a Value),
    Array(
        &'a [Value],
        &'static [&'static str],
        &'static [&'static str],
    ),
}

impl<'a> Fields<'a> {
    fn get(&self, name: &str) -> Option<&'a Value> {
        match self {
            Fields::Map(map) => field(map, name),
            Fields::Array(items, shared, own) => {
                let i = match shared.iter().position(|n| *n == name) {
                    Some(i) => i,
                    None => shared.len() + own.iter().position(|n| *n == name)?,
                };
                items.get(i).filter(|v| !v.is_nil())
            }
        }
    }
}

/// Reads an event in either shape.
fn decode_event(event: &Value, dialect: Dialect) -> Result<Event, WireError> {
    /// `BlockStored`'s positions up to `medium`, the same in both engines.
    const STORED: &[&str] = &[
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
    ];
    const VLLM_STORED: &[&str] = &[
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
    ];
    const SGLANG_STORED: &[&str] = &["metadata"];
    const REMOVED: &[&str] = &["block_hashes", "medium", "group_idx"];
    let (tag, fields) = match event {
        Value::Map(_) => match field(event, "type").and_then(Value::as_str) {
            Some(tag) => (tag, Fields::Map(event)),
            None => return err("event map without a type"),
        },
        Value::Array(items) => match items.first().and_then(Value::as_str) {
            Some(tag) => {
                let (shared, own): (&[&str], &[&str]) = match (tag, dialect) {
                    ("BlockStored", Dialect::Vllm) => (STORED, VLLM_STORED),
                    ("BlockStored", Dialect::Sglang) => (STORED, SGLANG_STORED),
                    ("BlockRemoved", _) => (REMOVED, &[]),
                    _ => (&[], &[]),
                };
                (tag, Fields::Array(&items[1..], shared, own))
            }
            None => return err("event array without a tag"),
        },
        _ => return err("event is neither a map nor an array"),
    };
    let get = |k: &str| fields.get(k);
    match tag {
        "BlockStored" => {
            let block_hashes = hashes(get("block_hashes"))?;
            let token_ids = match get("token_ids") {
                Some(Value::Array(ids)) => {
                    ids.iter()
                        .map(token_id)
                        .collect::<Option<Vec<u32>>>()
                        .ok_or_else(|| WireError("token id is not a u32".into()))?
                }
                _ => return err("BlockStored without token_ids"),
            };
            let salt = text(get("cache_salt"))
                .or_else(|| get("metadata").and_then(|m| text(field(m, "cache_salt"))));
            let block_size = match get("block_size").and_then(Value::as_u64) {
                Some(n) if n > 0 => n as usize,
                _ => return err("BlockStored without a block_size"),
            };
            let extra_keys = match get("extra_keys") {
                Some(Value::Array(per_block)) => per_block.iter().map(extra_keys).collect(),
                _ => Vec::new(),
            };
            Ok(Event::Stored(Stored {
                block_hashes,
                parent: get("parent_block_hash").map(hash).transpose()?,
                token_ids,
                block_size,
                medium: text(get("medium")),
                lora_name: text(get("lora_name")),
                extra_keys,
                group_idx: get("group_idx").and_then(Value::as_u64),
                kv_cache_spec_kind: text(get("kv_cache_spec_kind")),
                salt,
            }))
        }
        "BlockRemoved" => Ok(Event::Removed(Removed {
            block_hashes: hashes(get("block_hashes"))?,
            medium: text(get("medium")),
            group_idx: get("group_idx").and_then(Value::as_u64),
        })),
        "AllBlocksCleared" => Ok(Event::AllCleared),
        other => err(format!("unknown event type {other:?}")),
    }
}

/// A token id, or the first of an EAGLE bigram pair `[token, next token]` (SGLang).
fn token_id(t: &Value) -> Option<u32> {
    let id = match t {
        Value::Array(pair) => pair.first()?,
        id => id,
    };
    id.as_u64().and_then(|id| u32::try_from(id).ok())
}

fn text(v: Option<&Value>) -> Option<String> {
    v.and_then(Value::as_str).map(str::to_owned)
}

/// A block hash as a u64: an integer as it is (a negative one by its two's complement), bytes
/// hashed down to 64 bits.
pub fn hash(v: &Value) -> Result<u64, WireError> {
    match v {
        Value::Integer(i) => match (i.as_u64(), i.as_i64()) {
            (Some(u), _) => Ok(u),
            (None, Some(s)) => Ok(s as u64),
            _ => err("block hash out of range"),
        },
        Value::Binary(b) => Ok(xxh3_64(b)),
        _ => err("block hash is neither an integer nor bytes"),
    }
}

fn hashes(v: Option<&Value>) -> Result<Vec<u64>, WireError> {
    match v {
        Some(Value::Array(items)) => items.iter().map(hash).collect(),
        _ => err("event without block_hashes"),
    }
}

fn extra_keys(entry: &Value) -> Vec<ExtraKey> {
    match entry {
        Value::Array(items) => items
            .iter()
            .map(|k| match k.as_str() {
                Some(s) => ExtraKey::Text(s.to_owned()),
                None => ExtraKey::Other,
            })
            .collect(),
        Value::Nil => Vec::new(),
        _ => vec![ExtraKey::Other],
    }
}
