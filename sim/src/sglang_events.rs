//! KV events as SGLang publishes them (`sglang.srt.disaggregation.kv_events`, 0.5.23): the
//! same framing and batch as vLLM's, with SGLang's events.
//!
//! - One `BlockStored` per page, as SGLang's radix cache records a node: `{"type":
//!   "BlockStored", "block_hashes": [h], "parent_block_hash": previous page | nil, "token_ids":
//!   the page's ids, "block_size": page size, "lora_id": nil, "medium": "GPU"}`, with
//!   `"cache_salt"` on every page of a salted prompt's chain. `parent_block_hash` and `lora_id`
//!   have no default in SGLang's struct, so they are written even when nil.
//! - One `BlockRemoved` for the pages that go together: `{"type": "BlockRemoved",
//!   "block_hashes": [..], "medium": "GPU"}`; `{"type": "AllBlocksCleared"}`.
//! - Hashes are signed 64-bit integers (SGLang's are the first 8 bytes of a SHA-256 chain): the
//!   simulator's unsigned hashes are written as the `i64` of the same bits.

use crate::kv_events::tagged_map as tagged;
use crate::prefix_cache::CacheEvent;
use rmpv::Value;

fn hash(h: u64) -> Value {
    Value::from(h as i64)
}

/// The SGLang events of one cache change, pages of `page_size` tokens.
pub fn encode(event: &CacheEvent, page_size: usize, out: &mut Vec<Value>) {
    match event {
        CacheEvent::Stored {
            hashes,
            parent,
            token_ids,
            salt,
        } => {
            let mut parent = *parent;
            for (&h, page) in hashes.iter().zip(token_ids.chunks_exact(page_size)) {
                let mut fields = vec![
                    ("block_hashes", Value::Array(vec![hash(h)])),
                    ("parent_block_hash", parent.map_or(Value::Nil, hash)),
                    (
                        "token_ids",
                        Value::Array(page.iter().map(|&t| Value::from(t)).collect()),
                    ),
                    ("block_size", Value::from(page_size as u64)),
                    ("lora_id", Value::Nil),
                    ("medium", Value::from("GPU")),
                ];
                if let Some(salt) = salt {
                    fields.push(("cache_salt", Value::from(salt.as_str())));
                }
                out.push(tagged("BlockStored", fields));
                parent = Some(h);
            }
        }
        CacheEvent::Removed { hashes } => out.push(tagged(
            "BlockRemoved",
            vec![
                (
                    "block_hashes",
                    Value::Array(hashes.iter().map(|&h| hash(h)).collect()),
                ),
                ("medium", Value::from("GPU")),
            ],
        )),
        CacheEvent::AllCleared => out.push(tagged("AllBlocksCleared", vec![])),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field<'a>(map: &'a Value, key: &str) -> Option<&'a Value> {
        map.as_map()?
            .iter()
            .find(|(k, _)| k.as_str() == Some(key))
            .map(|(_, v)| v)
    }

    #[test]
    fn a_stored_chain_is_one_event_per_page_chained_with_signed_hashes() {
        let mut out = Vec::new();
        let stored = CacheEvent::Stored {
            hashes: vec![u64::MAX - 1, 7, 9],
            parent: Some(3),
            token_ids: (0..12).collect(),
            salt: Some("tenant".into()),
        };
        encode(&stored, 4, &mut out);
        assert_eq!(out.len(), 3);
        let parents: Vec<Option<i64>> = out
            .iter()
            .map(|e| field(e, "parent_block_hash").unwrap().as_i64())
            .collect();
        assert_eq!(parents, [Some(3), Some(-2), Some(7)]);
        assert_eq!(
            field(&out[0], "block_hashes").unwrap().as_array().unwrap()[0].as_i64(),
            Some(-2)
        );
        assert_eq!(
            field(&out[2], "token_ids")
                .unwrap()
                .as_array()
                .unwrap()
                .len(),
            4
        );
        assert!(out
            .iter()
            .all(|e| field(e, "cache_salt").and_then(Value::as_str) == Some("tenant")));
        assert!(field(&out[0], "lora_id").unwrap().is_nil());
        let mut removed = Vec::new();
        encode(&CacheEvent::Removed { hashes: vec![1, 2] }, 4, &mut removed);
        assert_eq!(removed.len(), 1);
        assert_eq!(
            field(&removed[0], "medium").and_then(Value::as_str),
            Some("GPU")
        );
    }
}
