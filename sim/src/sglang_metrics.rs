//! An SGLang replica's load, under SGLang's names: `/metrics` (Prometheus text, the
//! scheduler's `sglang:` gauges and counters) and `/v1/loads` (the per-rank load snapshot, JSON
//! or `?format=prometheus`).
//!
//! `num_waiting_uncached_tokens` is only in `/v1/loads` (SGLang's `LoadSnapshot`, also sent on
//! its load ZMQ socket), not in `/metrics`: the prompt tokens waiting for prefill compute, each
//! queued request's prompt less its cached prefix, plus the chunked-prefill request's remainder.

use crate::engine::{Backlog, Snapshot};
use crate::metrics::{escape, render_ttft};
use crate::spec::FleetSpec;
use serde_json::{json, Value};
use std::fmt::Write;
use std::time::{SystemTime, UNIX_EPOCH};

/// The full `/metrics` page of one SGLang replica (its scheduler on tensor-parallel rank 0).
pub fn render(spec: &FleetSpec, snap: &Snapshot) -> String {
    let labels = format!(
        "model_name=\"{}\",engine_type=\"unified\",tp_rank=\"0\",pp_rank=\"0\",moe_ep_rank=\"0\"",
        escape(&spec.model)
    );
    let capacity = snap.num_gpu_blocks * spec.block_size;
    let mut out = String::with_capacity(4096);
    let mut metric = |name: &str, kind: &str, help: &str, extra: &str, value: f64| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        let _ = writeln!(out, "{name}{{{labels}{extra}}} {value:?}");
    };
    let gauges = [
        (
            "sglang:num_running_reqs",
            "The number of running requests.",
            snap.running as f64,
        ),
        (
            "sglang:num_queue_reqs",
            "The number of requests in the waiting queue.",
            snap.waiting as f64,
        ),
        ("sglang:token_usage", "The token usage.", snap.kv_usage),
        (
            "sglang:num_used_tokens",
            "The number of used tokens.",
            (snap.kv_usage * capacity as f64).round(),
        ),
        (
            "sglang:max_total_num_tokens",
            "Maximum total number of tokens in the KV cache pool.",
            capacity as f64,
        ),
        ("sglang:page_size", "The page size.", spec.block_size as f64),
        (
            "sglang:cache_hit_rate",
            "The prefix cache hit rate.",
            hit_rate(snap),
        ),
    ];
    for (name, help, value) in gauges {
        metric(name, "gauge", help, "", value);
    }
    let counters = [
        (
            "sglang:prompt_tokens_total",
            "Number of prefill tokens processed.",
            "",
            snap.prompt_tokens_total,
        ),
        (
            "sglang:generation_tokens_total",
            "Number of generation tokens processed.",
            "",
            snap.generation_tokens_total,
        ),
        (
            "sglang:cached_tokens_total",
            "Number of cached prompt tokens by source (device/host/storage).",
            ",cache_source=\"device\"",
            snap.prefix_hits_tokens,
        ),
        (
            "sglang:num_requests_total",
            "Number of requests processed.",
            ",is_streaming=\"false\"",
            snap.success_total,
        ),
    ];
    for (name, help, extra, value) in counters {
        metric(name, "counter", help, extra, value as f64);
    }
    render_ttft(&mut out, "sglang", &snap.ttft_seconds, &labels);
    out
}

fn hit_rate(snap: &Snapshot) -> f64 {
    match snap.prefix_queries_tokens {
        0 => 0.0,
        q => snap.prefix_hits_tokens as f64 / q as f64,
    }
}

/// Rank 0's `LoadSnapshot` core fields, as `/v1/loads` lists them (SGLang's `num_total_tokens`
/// adds the waiting requests' prompt tokens to the used ones).
fn load(spec: &FleetSpec, snap: &Snapshot, backlog: Backlog) -> Value {
    let capacity = (snap.num_gpu_blocks * spec.block_size) as u64;
    let used = (snap.kv_usage * capacity as f64).round() as u64;
    let timestamp = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    json!({
        "timestamp": timestamp,
        "dp_rank": 0,
        "num_running_reqs": snap.running,
        "num_waiting_reqs": snap.waiting,
        "num_waiting_uncached_tokens": backlog.uncached_tokens,
        "num_used_tokens": used,
        "num_total_tokens": used + backlog.queued_prompt_tokens,
        "max_total_num_tokens": capacity,
        "max_running_requests": spec.max_num_seqs,
        "token_usage": snap.kv_usage,
        "cache_hit_rate": hit_rate(snap),
        "total_prefill_uncached_tokens":
            snap.prefix_queries_tokens.saturating_sub(snap.prefix_hits_tokens),
    })
}

/// `GET /v1/loads`: `{"version", "accelerator", "num_accelerators", "loads": [..]}` (SGLang's
/// answer also has an ISO 8601 `timestamp`; each load has its Unix one).
pub fn loads_json(spec: &FleetSpec, snap: &Snapshot, backlog: Backlog) -> Value {
    json!({
        "version": crate::api::VERSION,
        "accelerator": null,
        "num_accelerators": 1,
        "loads": [load(spec, snap, backlog)],
    })
}

/// `GET /v1/loads?format=prometheus`: every numeric field as `sglang_<field>{dp_rank="0"}`.
pub fn loads_prometheus(spec: &FleetSpec, snap: &Snapshot, backlog: Backlog) -> String {
    let mut out = String::new();
    if let Value::Object(fields) = load(spec, snap, backlog) {
        for (key, value) in fields.iter().filter(|(k, _)| *k != "dp_rank") {
            if let Some(v) = value.as_f64() {
                let _ = writeln!(
                    out,
                    "# TYPE sglang_{key} gauge\nsglang_{key}{{dp_rank=\"0\"}} {v:?}"
                );
            }
        }
    }
    out
}
