//! The fleet spec: what `--fleet FLEET.json` may contain, every field optional with a default.

use serde::{Deserialize, Serialize};

/// One simulated fleet. Defaults model Qwen3-32B on one H100-class GPU, calibrated to the
/// llm-d precise-scheduling benchmark (see `time_model` and sim/README.md).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FleetSpec {
    /// Number of replicas.
    pub replicas: usize,
    /// Served model name (`/v1/models`, the `model` field, the `model_name` metric label).
    pub model: String,
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV pool size per replica, in tokens.
    pub kv_capacity_tokens: usize,
    /// Requests running at once per replica; the rest wait in a FIFO queue.
    pub max_num_seqs: usize,
    /// Longest prompt + output accepted, like vLLM's `--max-model-len`.
    pub max_model_len: usize,
    /// Output length when a request gives no `max_tokens` (the simulated model never stops
    /// early, so this stands in for "until EOS").
    pub default_max_tokens: usize,
    /// Fixed cost of a prefill, in simulated milliseconds.
    pub prefill_base_ms: f64,
    /// Prefill cost per uncached prompt token.
    pub prefill_ms_per_token: f64,
    /// Prefill cost per cached prompt token (attention still reads them).
    pub cached_token_ms: f64,
    /// Decode step time with one running request: the time per output token.
    pub decode_ms_per_token: f64,
    /// Extra decode step time per additional running request.
    pub decode_batch_slope: f64,
    /// Real seconds per simulated second: 0.01 runs everything 100x faster.
    pub time_scale: f64,
    /// ZMQ topic of KV events (vLLM's `kv_events_config.topic`).
    pub kv_events_topic: String,
    /// Inner event encoding: "map" (vLLM since array_like was dropped) or "array" (older vLLM).
    pub kv_events_format: String,
    /// Whether each replica has a replay socket (vLLM's `kv_events_config.replay_endpoint`): a
    /// ROUTER that resends its last messages from a number asked for.
    pub kv_events_replay: bool,
    /// Messages the replay socket keeps (vLLM's `kv_events_config.buffer_steps`).
    pub kv_events_buffer_steps: usize,
    /// A `tokenizer.json` (byte-level BPE) to tokenize with; none: the hash tokenizer.
    pub tokenizer: Option<String>,
    /// A chat template to render chat prompts with, by kvroute's template module (the code the
    /// filter keys prompts with): a Jinja file, or a `tokenizer_config.json` holding
    /// `chat_template`; none: the built-in ChatML renderer ([`crate::chat_template`]).
    pub chat_template: Option<String>,
    /// Which engine the replicas play: `"vllm"` or `"sglang"` for all, or a list with one kind
    /// per replica (a mixed fleet).
    pub engine_kind: EngineKinds,
    /// SGLang replicas' page size (`--page-size`): their cache's granularity and the tokens of
    /// each KV event; none: `block_size`.
    pub page_size: Option<usize>,
}

/// The engine a replica plays: its KV events' dialect and its metric names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    #[default]
    Vllm,
    Sglang,
}

impl EngineKind {
    pub fn name(self) -> &'static str {
        match self {
            EngineKind::Vllm => "vllm",
            EngineKind::Sglang => "sglang",
        }
    }

    fn parse(name: &str) -> Result<EngineKind, String> {
        match name {
            "vllm" => Ok(EngineKind::Vllm),
            "sglang" => Ok(EngineKind::Sglang),
            other => Err(format!(
                "engine_kind: {other:?} is neither \"vllm\" nor \"sglang\""
            )),
        }
    }
}

/// `engine_kind`: one kind for every replica, or one per replica.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum EngineKinds {
    All(EngineKind),
    Each(Vec<EngineKind>),
}

impl Default for EngineKinds {
    fn default() -> Self {
        EngineKinds::All(EngineKind::Vllm)
    }
}

impl<'de> Deserialize<'de> for EngineKinds {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(
            untagged,
            expecting = "engine_kind: \"vllm\", \"sglang\" or a list of them"
        )]
        enum Raw {
            One(String),
            Each(Vec<String>),
        }
        let kinds = match Raw::deserialize(d)? {
            Raw::One(name) => EngineKind::parse(&name).map(EngineKinds::All),
            Raw::Each(names) => names
                .iter()
                .map(|n| EngineKind::parse(n))
                .collect::<Result<_, _>>()
                .map(EngineKinds::Each),
        };
        kinds.map_err(serde::de::Error::custom)
    }
}

impl Default for FleetSpec {
    fn default() -> Self {
        FleetSpec {
            replicas: 4,
            model: "Qwen/Qwen3-32B".into(),
            block_size: 16,
            // About what is left of an 80 GB GPU after Qwen3-32B's weights in bf16.
            kv_capacity_tokens: 131_072,
            max_num_seqs: 64,
            max_model_len: 32_768,
            default_max_tokens: 64,
            prefill_base_ms: 50.0,
            prefill_ms_per_token: 0.7,
            cached_token_ms: 0.09,
            decode_ms_per_token: 30.0,
            decode_batch_slope: 0.3,
            time_scale: 1.0,
            kv_events_topic: "kv-events".into(),
            kv_events_format: "map".into(),
            kv_events_replay: true,
            kv_events_buffer_steps: 10_000,
            tokenizer: None,
            chat_template: None,
            engine_kind: EngineKinds::default(),
            page_size: None,
        }
    }
}

impl FleetSpec {
    pub fn from_json(text: &str) -> Result<Self, String> {
        let spec: FleetSpec = serde_json::from_str(text).map_err(|e| e.to_string())?;
        spec.validate()?;
        Ok(spec)
    }

    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("replicas", self.replicas),
            ("block_size", self.block_size),
            ("max_num_seqs", self.max_num_seqs),
            ("max_model_len", self.max_model_len),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(format!("{name} must be at least 1"));
            }
        }
        if self.kv_capacity_tokens < self.block_size {
            return Err("kv_capacity_tokens must hold at least one block".into());
        }
        if !(self.time_scale > 0.0 && self.time_scale.is_finite()) {
            return Err("time_scale must be a positive number".into());
        }
        let costs = [
            self.prefill_base_ms,
            self.prefill_ms_per_token,
            self.cached_token_ms,
            self.decode_ms_per_token,
            self.decode_batch_slope,
        ];
        if costs.iter().any(|c| !(c.is_finite() && *c >= 0.0)) {
            return Err("cost parameters must be non-negative numbers".into());
        }
        if self.kv_events_format != "map" && self.kv_events_format != "array" {
            return Err("kv_events_format must be \"map\" or \"array\"".into());
        }
        if let EngineKinds::Each(kinds) = &self.engine_kind {
            if kinds.len() != self.replicas {
                return Err(format!(
                    "engine_kind lists {} kinds for {} replicas",
                    kinds.len(),
                    self.replicas
                ));
            }
        }
        match self.page_size {
            Some(0) => return Err("page_size must be at least 1".into()),
            Some(p) if self.kv_capacity_tokens < p => {
                return Err("kv_capacity_tokens must hold at least one page".into())
            }
            _ => {}
        }
        Ok(())
    }

    /// The engine replica `id` plays.
    pub fn kind(&self, id: usize) -> EngineKind {
        match &self.engine_kind {
            EngineKinds::All(kind) => *kind,
            EngineKinds::Each(kinds) => kinds.get(id).copied().unwrap_or_default(),
        }
    }

    /// Replica `id`'s own spec: its kind alone, and an SGLang replica's page size as its
    /// block size.
    pub fn replica(&self, id: usize) -> FleetSpec {
        let kind = self.kind(id);
        let mut spec = self.clone();
        spec.engine_kind = EngineKinds::All(kind);
        if kind == EngineKind::Sglang {
            spec.block_size = self.page_size.unwrap_or(self.block_size);
        }
        spec
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_file_gives_defaults_and_fields_override() {
        assert_eq!(FleetSpec::from_json("{}").unwrap(), FleetSpec::default());
        let s = FleetSpec::from_json(r#"{"replicas":2,"time_scale":0.01}"#).unwrap();
        assert_eq!((s.replicas, s.time_scale, s.block_size), (2, 0.01, 16));
        let s = FleetSpec::from_json(r#"{"tokenizer":"t.json"}"#).unwrap();
        assert_eq!(s.tokenizer.as_deref(), Some("t.json"));
        let s = FleetSpec::from_json(r#"{"chat_template":"qwen3.jinja"}"#).unwrap();
        assert_eq!(s.chat_template.as_deref(), Some("qwen3.jinja"));
    }

    #[test]
    fn unknown_fields_and_bad_values_are_rejected() {
        assert!(FleetSpec::from_json(r#"{"replica":2}"#).is_err());
        assert!(FleetSpec::from_json(r#"{"time_scale":0}"#).is_err());
        assert!(FleetSpec::from_json(r#"{"kv_events_format":"json"}"#).is_err());
    }

    #[test]
    fn engine_kinds_are_one_for_all_or_one_per_replica() {
        let s = FleetSpec::from_json(r#"{"engine_kind":"sglang","page_size":4}"#).unwrap();
        assert_eq!(s.kind(3), EngineKind::Sglang);
        assert_eq!(s.replica(3).block_size, 4);
        let mixed = r#"{"replicas":4,"engine_kind":["vllm","vllm","sglang","sglang"]}"#;
        let s = FleetSpec::from_json(mixed).unwrap();
        let kinds: Vec<EngineKind> = (0..4).map(|i| s.kind(i)).collect();
        use EngineKind::{Sglang, Vllm};
        assert_eq!(kinds, [Vllm, Vllm, Sglang, Sglang]);
        assert_eq!(s.replica(2).engine_kind, EngineKinds::All(Sglang));
        assert_eq!(
            s.replica(2).block_size,
            16,
            "the page size defaults to block_size"
        );
        assert_eq!(FleetSpec::default().kind(0), Vllm);
        for (bad, says) in [
            (r#"{"engine_kind":"trtllm"}"#, "trtllm"),
            (r#"{"engine_kind":["vllm"]}"#, "1 kinds for 4 replicas"),
            (r#"{"engine_kind":3}"#, "engine_kind"),
            (r#"{"page_size":0}"#, "page_size"),
        ] {
            let e = FleetSpec::from_json(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
        // A spec written back reads the same.
        let json = serde_json::to_string(&s).unwrap();
        assert_eq!(FleetSpec::from_json(&json).unwrap(), s);
    }
}
