//! Which engine publishes a stream: vLLM or SGLang, whose KV events share a wire format but
//! differ in what their fields mean.
//!
//! Both publish msgspec's msgpack of the same `KVEventBatch` in the same ZMQ framing, and the
//! decoder reads the union of their fields whatever the dialect. What the dialect decides:
//! - the field order of events in the older array form: vLLM's `BlockStored` continues
//!   `medium, lora_name, extra_keys, group_idx, ...` after `lora_id`, SGLang's `medium, metadata`
//!   (a `{"cache_salt": ..}` map, SGLang 0.5.19);
//! - whether a block hash may be a content hash: SGLang up to 0.5.5 published Python's
//!   `hash(tuple(page_tokens))`, the same for a page wherever it stands in a prompt, so such
//!   blocks cannot be placed in a chain (see [`crate::chains`]); vLLM's hashes always chain.

/// A stream's engine, `vllm` unless configured otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Dialect {
    #[default]
    Vllm,
    Sglang,
}

impl Dialect {
    pub fn name(self) -> &'static str {
        match self {
            Dialect::Vllm => "vllm",
            Dialect::Sglang => "sglang",
        }
    }
}

impl std::fmt::Display for Dialect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Dialect {
    type Err = String;

    fn from_str(s: &str) -> Result<Dialect, String> {
        match s {
            "vllm" => Ok(Dialect::Vllm),
            "sglang" => Ok(Dialect::Sglang),
            other => Err(format!("{other:?}: the engine kind is vllm or sglang")),
        }
    }
}
