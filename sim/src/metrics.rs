//! `/metrics` in Prometheus text format, with vLLM's metric names and labels (an SGLang
//! replica's: [`crate::sglang_metrics`]).
//!
//! Times are reported in *simulated* seconds (real time divided by `time_scale`), so a
//! scraper sees the same numbers a real fleet would produce.

use crate::engine::Snapshot;
use crate::spec::FleetSpec;
use std::fmt::Write;

/// vLLM's bucket bounds for `vllm:time_to_first_token_seconds`.
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];

/// SGLang's default bucket bounds for `sglang:time_to_first_token_seconds`.
const SGLANG_TTFT_BUCKETS: &[f64] = &[
    0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0, 200.0,
    400.0,
];

#[derive(Debug, Clone)]
pub struct Histogram {
    bounds: &'static [f64],
    /// Non-cumulative counts per bucket; the last slot is +Inf.
    counts: Vec<u64>,
    sum: f64,
}

impl Histogram {
    pub fn ttft() -> Self {
        Histogram::with_bounds(TTFT_BUCKETS)
    }

    pub fn sglang_ttft() -> Self {
        Histogram::with_bounds(SGLANG_TTFT_BUCKETS)
    }

    fn with_bounds(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
        }
    }

    pub fn observe(&mut self, value: f64) {
        let slot = self
            .bounds
            .iter()
            .position(|b| value <= *b)
            .unwrap_or(self.bounds.len());
        self.counts[slot] += 1;
        self.sum += value;
    }

    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    pub(crate) fn render(&self, out: &mut String, name: &str, labels: &str) {
        let mut cumulative = 0;
        for (bound, count) in self.bounds.iter().zip(&self.counts) {
            cumulative += count;
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels},le=\"{bound:?}\"}} {cumulative}.0"
            );
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{{labels},le=\"+Inf\"}} {}.0",
            self.count()
        );
        let _ = writeln!(out, "{name}_count{{{labels}}} {}.0", self.count());
        let _ = writeln!(out, "{name}_sum{{{labels}}} {:?}", self.sum);
    }
}

/// The full `/metrics` page of one replica.
pub fn render(spec: &FleetSpec, snap: &Snapshot) -> String {
    let labels = format!("engine=\"0\",model_name=\"{}\"", escape(&spec.model));
    let mut out = String::with_capacity(4096);
    let mut metric = |name: &str, kind: &str, help: &str, value: f64| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        let _ = writeln!(out, "{name}{{{labels}}} {value:?}");
    };
    metric(
        "vllm:num_requests_running",
        "gauge",
        "Number of requests in model execution batches.",
        snap.running as f64,
    );
    metric(
        "vllm:num_requests_waiting",
        "gauge",
        "Number of requests waiting to be processed.",
        snap.waiting as f64,
    );
    metric(
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage. 1 means 100 percent usage.",
        snap.kv_usage,
    );
    // Name used by vLLM's V0 engine; some scrapers still read it.
    metric(
        "vllm:gpu_cache_usage_perc",
        "gauge",
        "GPU KV-cache usage. 1 means 100 percent usage.",
        snap.kv_usage,
    );
    metric(
        "vllm:prefix_cache_queries_total",
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
        snap.prefix_queries_tokens as f64,
    );
    metric(
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
        snap.prefix_hits_tokens as f64,
    );
    metric(
        "vllm:prompt_tokens_total",
        "counter",
        "Number of prefill tokens processed.",
        snap.prompt_tokens_total as f64,
    );
    metric(
        "vllm:generation_tokens_total",
        "counter",
        "Number of generation tokens processed.",
        snap.generation_tokens_total as f64,
    );
    // By `finished_reason`, as vLLM counts them; the simulated model never stops early.
    let _ = writeln!(out, "# HELP vllm:request_success_total Count of successfully processed requests.\n# TYPE vllm:request_success_total counter");
    for (reason, n) in [("stop", 0), ("length", snap.success_total)] {
        let _ = writeln!(
            out,
            "vllm:request_success_total{{{labels},finished_reason=\"{reason}\"}} {:?}",
            n as f64
        );
    }
    let _ = writeln!(out, "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge");
    let _ = writeln!(
        out,
        "vllm:cache_config_info{{block_size=\"{}\",enable_prefix_caching=\"True\",engine=\"0\",num_gpu_blocks=\"{}\",prefix_caching_hash_algo=\"xxh3_64\"}} 1.0",
        spec.block_size, snap.num_gpu_blocks
    );
    render_ttft(&mut out, "vllm", &snap.ttft_seconds, &labels);
    out
}

/// The `<engine>:time_to_first_token_seconds` histogram family, with its help and type.
pub(crate) fn render_ttft(out: &mut String, engine: &str, ttft: &Histogram, labels: &str) {
    let name = format!("{engine}:time_to_first_token_seconds");
    let _ = writeln!(
        out,
        "# HELP {name} Histogram of time to first token in seconds.\n# TYPE {name} histogram"
    );
    ttft.render(out, &name, labels);
}

pub(crate) fn escape(label: &str) -> String {
    label
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::Replica;
    use std::sync::Arc;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let mut h = Histogram::ttft();
        h.observe(0.003);
        h.observe(0.7);
        h.observe(5000.0);
        let mut out = String::new();
        h.render(&mut out, "t", "a=\"b\"");
        assert!(out.contains("t_bucket{a=\"b\",le=\"0.005\"} 1.0"));
        assert!(out.contains("t_bucket{a=\"b\",le=\"0.75\"} 2.0"));
        assert!(out.contains("t_bucket{a=\"b\",le=\"2560.0\"} 2.0"));
        assert!(out.contains("t_bucket{a=\"b\",le=\"+Inf\"} 3.0"));
        assert!(out.contains("t_count{a=\"b\"} 3.0"));
    }

    #[test]
    fn page_has_vllm_names_and_model_label() {
        let spec = Arc::new(FleetSpec::default());
        let replica = Replica::new(0, spec.clone(), None);
        let page = render(&spec, &replica.snapshot());
        for needle in [
            "vllm:num_requests_running{engine=\"0\",model_name=\"Qwen/Qwen3-32B\"} 0.0",
            "vllm:num_requests_waiting{",
            "vllm:kv_cache_usage_perc{",
            "vllm:prefix_cache_queries_total{",
            "vllm:prefix_cache_hits_total{",
            "block_size=\"16\"",
            "num_gpu_blocks=\"8192\"",
            "vllm:time_to_first_token_seconds_bucket{",
        ] {
            assert!(page.contains(needle), "missing {needle}\n{page}");
        }
    }
}
