//! Decoding vLLM's KV-event messages: the simulator's map and array formats, and constructed
//! batches with the fields current vLLM adds (extra keys, LoRA, groups, byte hashes, a map
//! batch).

use crate::common;

use common::msgpack_map as map;
use kvroute_indexer::wire::{self, Event, ExtraKey, Removed, Stored};
use kvroute_sim::kv_events::{encode_batch, frames, Format};
use kvroute_sim::prefix_cache::CacheEvent;
use rmpv::Value;

fn sim_events() -> Vec<CacheEvent> {
    vec![
        CacheEvent::Stored {
            hashes: vec![u64::MAX - 1, 7],
            parent: Some(3),
            token_ids: (0..32).collect(),
            salt: None,
        },
        CacheEvent::Stored {
            hashes: vec![1, 2],
            parent: None,
            token_ids: (100..132).collect(),
            salt: Some("tenant-1".into()),
        },
        CacheEvent::Removed {
            hashes: vec![9, 10],
        },
        CacheEvent::AllCleared,
    ]
}

#[test]
fn both_of_the_simulators_formats_decode_to_the_same_events() {
    for format in [Format::Map, Format::Array] {
        let payload = encode_batch(1.5, &sim_events(), 16, format);
        let message = frames("kv-events", 41, payload);
        let batch = wire::decode_message(&message).unwrap();
        assert_eq!(batch.seq, 41);
        assert_eq!(batch.dp_rank, Some(0));
        assert_eq!(batch.events.len(), 4, "{format:?}");
        let Event::Stored(s) = &batch.events[0] else {
            panic!("{:?}", batch.events[0])
        };
        assert_eq!(s.block_hashes, vec![u64::MAX - 1, 7]);
        assert_eq!(s.parent, Some(3));
        assert_eq!(s.token_ids, (0..32).collect::<Vec<u32>>());
        assert_eq!(s.block_size, 16);
        assert_eq!(s.medium.as_deref(), Some("GPU"));
        assert!(s.lora_name.is_none());
        let Event::Stored(root) = &batch.events[1] else {
            panic!()
        };
        assert_eq!(root.parent, None);
        // The salt is the first block's extra key; the older array format has no extra keys.
        let salted = match format {
            Format::Map => vec![vec![ExtraKey::Text("tenant-1".into())], vec![]],
            Format::Array | Format::Sglang => vec![],
        };
        assert_eq!(root.extra_keys, salted, "{format:?}");
        assert!(s.extra_keys.iter().all(Vec::is_empty));
        assert_eq!(
            batch.events[2],
            Event::Removed(Removed {
                block_hashes: vec![9, 10],
                medium: Some("GPU".into()),
                group_idx: if format == Format::Map { Some(0) } else { None },
            })
        );
        assert_eq!(batch.events[3], Event::AllCleared);
    }
}

fn pack(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap();
    out
}

#[test]
fn current_vllm_fields_decode() {
    // A map batch (msgspec without array_like), defaults omitted, a bytes hash, extra keys
    // with a LoRA name, an (identifier, offset) multimodal pair and a salt.
    let stored = map(vec![
        ("type", Value::from("BlockStored")),
        (
            "block_hashes",
            Value::Array(vec![Value::Binary(vec![1, 2, 3]), Value::from(-5i64)]),
        ),
        ("parent_block_hash", Value::Nil),
        (
            "token_ids",
            Value::Array((0..8u32).map(Value::from).collect()),
        ),
        ("block_size", Value::from(4)),
        ("lora_id", Value::from(3)),
        ("medium", Value::from("GPU")),
        ("lora_name", Value::from("adapter")),
        (
            "extra_keys",
            Value::Array(vec![
                Value::Array(vec![Value::from("adapter"), Value::from("salt")]),
                Value::Array(vec![
                    Value::from("adapter"),
                    Value::Array(vec![Value::from("img"), Value::from(0)]),
                ]),
            ]),
        ),
        ("group_idx", Value::from(1)),
        ("kv_cache_spec_kind", Value::from("full_attention")),
    ]);
    let removed = Value::Array(vec![
        Value::from("BlockRemoved"),
        Value::Array(vec![Value::from(5)]),
        Value::from("CPU"),
        Value::from(2),
    ]);
    let batch = map(vec![
        ("ts", Value::F64(2.0)),
        ("events", Value::Array(vec![stored, removed])),
        ("data_parallel_rank", Value::from(3)),
    ]);
    let seq = 7u64.to_be_bytes();
    let decoded = wire::decode_message(&[&b"t"[..], &seq, &pack(&batch)]).unwrap();
    assert_eq!(decoded.dp_rank, Some(3));
    let Event::Stored(s) = &decoded.events[0] else {
        panic!()
    };
    assert_eq!(
        *s,
        Stored {
            block_hashes: vec![xxhash_rust::xxh3::xxh3_64(&[1, 2, 3]), (-5i64) as u64],
            parent: None,
            token_ids: (0..8).collect(),
            block_size: 4,
            medium: Some("GPU".into()),
            lora_name: Some("adapter".into()),
            extra_keys: vec![
                vec![
                    ExtraKey::Text("adapter".into()),
                    ExtraKey::Text("salt".into())
                ],
                vec![ExtraKey::Text("adapter".into()), ExtraKey::Other],
            ],
            group_idx: Some(1),
            kv_cache_spec_kind: Some("full_attention".into()),
            salt: None,
        }
    );
    assert_eq!(
        decoded.events[1],
        Event::Removed(Removed {
            block_hashes: vec![5],
            medium: Some("CPU".into()),
            group_idx: Some(2),
        })
    );
}

#[test]
fn malformed_messages_are_errors() {
    let ok = pack(&Value::Array(vec![
        Value::F64(0.0),
        Value::Array(vec![]),
        Value::Nil,
    ]));
    assert!(wire::decode_message(&[&b""[..], &[0u8; 8], &ok]).is_ok());
    assert!(wire::decode_message(&[&b""[..], &[0u8; 4], &ok]).is_err());
    assert!(wire::decode_message(&[&b""[..]]).is_err());
    assert!(wire::decode_message(&[&b""[..], &[0u8; 8], &b"\xc1"[..]]).is_err());
    let unknown = pack(&Value::Array(vec![
        Value::F64(0.0),
        Value::Array(vec![Value::Array(vec![Value::from("Bogus")])]),
    ]));
    assert!(wire::decode_message(&[&b""[..], &[0u8; 8], &unknown]).is_err());
    let no_tokens = pack(&Value::Array(vec![
        Value::F64(0.0),
        Value::Array(vec![Value::Array(vec![
            Value::from("BlockStored"),
            Value::Array(vec![Value::from(1)]),
        ])]),
    ]));
    assert!(wire::decode_message(&[&b""[..], &[0u8; 8], &no_tokens]).is_err());
}
