//! What an engine says about itself: its Prometheus `/metrics` (vLLM's or SGLang's names) read as
//! its load (running, waiting, every gateway's traffic), its capacity, learnt from when it
//! queues, and how fast its KV cache turns over ([`retention`](crate::retention)).

use hashbrown::HashMap;
use serde::{Deserialize, Serialize};

use crate::retention::{Churn, KvMetrics};

/// Engine loads by host address, as the last metrics polls found them.
pub type EngineLoads = HashMap<String, EngineLoad>;

/// The numbers kvroute reads from one `/metrics` page.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Metrics {
    /// Requests running (in the batch, prefilling or decoding).
    pub running: u64,
    /// Requests queued for admission: the engine is full.
    pub waiting: u64,
    /// Requests it has finished since it started (a counter), when it says.
    pub completed: Option<f64>,
    /// Its KV cache: size, use and the tokens written into it, where it says.
    pub kv: KvMetrics,
    /// The page is SGLang's: the engine also serves [`LOADS_PATH`].
    pub serves_loads: bool,
    /// Prompt tokens queued and not yet prefilled, minus what its cache holds of them, where the
    /// engine says (SGLang's `num_waiting_uncached_tokens`, from [`LOADS_PATH`]).
    pub waiting_uncached_tokens: Option<u64>,
}

/// SGLang's load snapshot in Prometheus text, its core fields only: the one page that gives the
/// prefill work queued at the engine (`sglang_num_waiting_uncached_tokens{dp_rank="0"}`, a sample
/// per data-parallel rank). Its `/metrics` does not.
pub const LOADS_PATH: &str = "/v1/loads?include=core&format=prometheus";
const WAITING_UNCACHED: &str = "sglang_num_waiting_uncached_tokens";

/// vLLM's and SGLang's metric families for each number kvroute reads.
const RUNNING: [&str; 2] = ["vllm:num_requests_running", "sglang:num_running_reqs"];
const WAITING: [&str; 2] = ["vllm:num_requests_waiting", "sglang:num_queue_reqs"];
const COMPLETED: [&str; 2] = ["vllm:request_success_total", "sglang:num_requests_total"];
const KV_USAGE: [&str; 2] = ["vllm:kv_cache_usage_perc", "sglang:token_usage"];
/// vLLM gives its cache size as labels of `vllm:cache_config_info` instead.
const KV_TOKENS: [&str; 1] = ["sglang:max_total_num_tokens"];
const VLLM_CACHE_CONFIG: &str = "vllm:cache_config_info";
const PROMPT_TOKENS: [&str; 2] = [
    "vllm:prefix_cache_queries_total",
    "sglang:prompt_tokens_total",
];
const CACHED_TOKENS: [&str; 2] = ["vllm:prefix_cache_hits_total", "sglang:cached_tokens_total"];
const GENERATED_TOKENS: [&str; 2] = [
    "vllm:generation_tokens_total",
    "sglang:generation_tokens_total",
];

/// Reads an engine's Prometheus text, each number summed over label sets (one per model; the
/// cache's use is the highest). `None` when it exposes neither requests running nor waiting.
pub fn parse(text: &[u8]) -> Option<Metrics> {
    let text = String::from_utf8_lossy(text);
    let (mut running, mut waiting, mut completed) = (None, None, None);
    let mut kv = KvMetrics::default();
    let mut serves_loads = false;
    for (name, line) in samples(&text) {
        serves_loads |= name.starts_with("sglang:");
        // Read only for the lines kept: most of a page is histograms kvroute skips.
        let value = || sample_value(line);
        let slot = if RUNNING.contains(&name) {
            &mut running
        } else if WAITING.contains(&name) {
            &mut waiting
        } else if COMPLETED.contains(&name) {
            &mut completed
        } else if KV_TOKENS.contains(&name) {
            &mut kv.capacity_tokens
        } else if PROMPT_TOKENS.contains(&name) {
            &mut kv.prompt_tokens
        } else if CACHED_TOKENS.contains(&name) {
            &mut kv.cached_tokens
        } else if GENERATED_TOKENS.contains(&name) {
            &mut kv.generated_tokens
        } else if KV_USAGE.contains(&name) {
            if let Some(v) = value() {
                kv.usage = Some(kv.usage.map_or(v, |u: f64| u.max(v)));
            }
            continue;
        } else if name == VLLM_CACHE_CONFIG {
            let tokens = label(line, "num_gpu_blocks").zip(label(line, "block_size"));
            if let Some((blocks, size)) = tokens {
                *kv.capacity_tokens.get_or_insert(0.0) += blocks * size;
            }
            continue;
        } else {
            continue;
        };
        if let Some(v) = value() {
            *slot.get_or_insert(0.0) += v;
        }
    }
    if running.is_none() && waiting.is_none() {
        return None;
    }
    Some(Metrics {
        running: running.unwrap_or(0.0).round() as u64,
        waiting: waiting.unwrap_or(0.0).round() as u64,
        completed,
        kv,
        serves_loads,
        waiting_uncached_tokens: None,
    })
}

/// The prefill work queued at an SGLang engine, from its [`LOADS_PATH`] page: uncached prompt
/// tokens waiting, summed over its data-parallel ranks. `None` when the page does not say.
pub fn parse_loads(text: &[u8]) -> Option<u64> {
    let text = String::from_utf8_lossy(text);
    let ranks = samples(&text).filter(|(name, _)| *name == WAITING_UNCACHED);
    let values: Vec<f64> = ranks.filter_map(|(_, line)| sample_value(line)).collect();
    (!values.is_empty()).then(|| values.iter().sum::<f64>().round() as u64)
}

/// A Prometheus page's sample lines with their metric names.
fn samples(text: &str) -> impl Iterator<Item = (&str, &str)> {
    text.lines()
        .filter_map(|line| Some((&line[..line.find(['{', ' '])?], line)))
}

/// A sample line's value, when it is a finite count or gauge (not negative).
fn sample_value(line: &str) -> Option<f64> {
    line.rsplit(' ')
        .next()
        .and_then(|v| v.parse::<f64>().ok())
        .filter(|v| v.is_finite() && *v >= 0.0)
}

/// A numeric label's value in a Prometheus sample line (`name{a="1",b="2"} 1.0`).
fn label(line: &str, name: &str) -> Option<f64> {
    let labels = line.get(line.find('{')? + 1..line.rfind('}')?)?;
    labels.split(',').find_map(|pair| {
        let (k, v) = pair.split_once('=')?;
        (k.trim() == name).then(|| v.trim().trim_matches('"').parse().ok())?
    })
}

/// What kvroute itself had at an endpoint when its engine answered: what it sends from then on
/// comes on top of the engine's numbers.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Own {
    /// Requests in flight.
    pub inflight: u32,
    /// Prompt bytes of those requests still to prefill.
    pub prefill: u32,
}

/// An engine's load as kvroute keeps it between polls.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct EngineLoad {
    pub running: u64,
    pub waiting: u64,
    /// The most requests it runs at once, learnt from what it ran when it last queued (its
    /// max_num_seqs, or what its KV space allowed); `None` until it has been seen full.
    pub capacity: Option<u64>,
    /// kvroute's own in-flight count to it when the metrics were read: requests sent since
    /// then are on top of what it reported.
    pub own_at_poll: u32,
    /// Uncached prompt tokens queued at the engine, where it says ([`Metrics`]).
    #[serde(default)]
    pub waiting_uncached_tokens: Option<u64>,
    /// kvroute's own prefill bytes queued there when the engine said so: as `own_at_poll` is
    /// to requests.
    #[serde(default)]
    pub prefill_at_poll: u32,
    /// Polls since the engine last answered: its numbers are that old. Past
    /// [`STALE_POLLS`](crate::freshness::STALE_POLLS) they are not trusted (an engine too busy
    /// to answer would otherwise look as idle as it last was).
    #[serde(default)]
    pub missed: u32,
    /// Requests the engine has finished since it started, by every gateway ([`Metrics`]).
    #[serde(default)]
    pub completed: Option<f64>,
    /// How fast its KV cache turns over, where its metrics say ([`Churn`]).
    #[serde(default)]
    pub churn: Option<Churn>,
}

impl EngineLoad {
    /// The engine's new report, learning its capacity from the previous ones: once it has
    /// queued, the most it was ever seen running. (A queue with nothing running is a stall, not
    /// a limit.)
    pub fn observe(previous: Option<&EngineLoad>, m: &Metrics, own: Own, now_ms: u64) -> Self {
        let known = previous.and_then(|p| p.capacity);
        let capacity = match known {
            Some(c) => Some(c.max(m.running)),
            None => (m.waiting > 0 && m.running > 0).then_some(m.running),
        };
        EngineLoad {
            running: m.running,
            waiting: m.waiting,
            capacity,
            own_at_poll: own.inflight,
            waiting_uncached_tokens: m.waiting_uncached_tokens,
            prefill_at_poll: own.prefill,
            missed: 0,
            completed: m.completed,
            churn: Churn::observe(previous.and_then(|p| p.churn.as_ref()), &m.kv, now_ms),
        }
    }

    /// The same load, one more poll without an answer from the engine.
    pub fn missed_poll(&self) -> Self {
        EngineLoad {
            missed: self.missed.saturating_add(1),
            ..*self
        }
    }

    /// Too many polls without an answer to route on its numbers.
    pub fn stale(&self) -> bool {
        u64::from(self.missed) >= crate::freshness::STALE_POLLS
    }

    /// Requests at the engine now: what it reported, corrected by kvroute's own requests sent or
    /// finished since (other gateways' changes show at the next poll).
    pub fn estimate(&self, own_now: u32) -> u64 {
        let reported = (self.running + self.waiting) as i64;
        let since = i64::from(own_now) - i64::from(self.own_at_poll);
        (reported + since).max(i64::from(own_now)).max(0) as u64
    }

    /// Prompt bytes queued at the engine to prefill, where it reports its uncached tokens waiting
    /// (at `bytes_per_token`): what it reported, corrected by kvroute's own queued prefill since,
    /// as [`estimate`](Self::estimate) corrects the request count.
    pub fn queued_prefill(&self, own_now: u32, bytes_per_token: f64) -> Option<u64> {
        let reported = (self.waiting_uncached_tokens? as f64 * bytes_per_token) as i64;
        let since = i64::from(own_now) - i64::from(self.prefill_at_poll);
        Some((reported + since).max(i64::from(own_now)).max(0) as u64)
    }

    /// Whether the engine queues new requests: it said so, or it has more than it can run, or it
    /// has stopped answering (taken as too busy to).
    pub fn queueing(&self, estimate: u64) -> bool {
        self.waiting > 0 || self.stale() || self.capacity.is_some_and(|c| estimate > c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn own(inflight: u32) -> Own {
        Own {
            inflight,
            prefill: 0,
        }
    }

    fn metrics(running: u64, waiting: u64) -> Metrics {
        Metrics {
            running,
            waiting,
            ..Metrics::default()
        }
    }

    #[test]
    fn vllm_and_sglang_pages_give_running_waiting_and_token_counters() {
        let text = "# HELP vllm:num_requests_running Number of requests running.\n\
            # TYPE vllm:num_requests_running gauge\n\
            vllm:num_requests_running{engine=\"0\",model_name=\"a\"} 3.0\n\
            vllm:num_requests_running{engine=\"0\",model_name=\"b\"} 1.0\n\
            vllm:num_requests_waiting{engine=\"0\",model_name=\"a\"} 12.0\n\
            vllm:num_requests_waiting_by_reason{reason=\"x\"} 99.0\n\
            vllm:kv_cache_usage_perc{engine=\"0\"} 0.5\n";
        let m = parse(text.as_bytes()).unwrap();
        assert_eq!((m.running, m.waiting), (4, 12));
        let s = parse(b"sglang:num_queue_reqs 4\nsglang:num_running_reqs 2\n").unwrap();
        assert_eq!((s.running, s.waiting), (2, 4));
        assert_eq!(parse(b"up 1\n"), None);
        assert_eq!(parse(b"vllm:num_requests_waiting NaN\n"), None);
        assert_eq!(m.completed, None);
    }

    #[test]
    fn vllm_and_sglang_pages_give_their_kv_cache_and_the_tokens_written_to_it() {
        let text = "vllm:num_requests_running{engine=\"0\"} 2.0\n\
            vllm:kv_cache_usage_perc{engine=\"0\"} 0.25\n\
            vllm:gpu_cache_usage_perc{engine=\"0\"} 0.9\n\
            vllm:prefix_cache_queries_total{engine=\"0\"} 5000.0\n\
            vllm:prefix_cache_hits_total{engine=\"0\"} 3000.0\n\
            vllm:generation_tokens_total{engine=\"0\"} 100.0\n\
            vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"576\"} 1.0\n";
        let kv = parse(text.as_bytes()).unwrap().kv;
        assert_eq!(kv.capacity_tokens, Some(9216.0));
        assert_eq!(kv.usage, Some(0.25), "the V0 name is not read");
        assert_eq!(
            (kv.prompt_tokens, kv.cached_tokens, kv.generated_tokens),
            (Some(5000.0), Some(3000.0), Some(100.0))
        );
        let s = parse(
            b"sglang:num_running_reqs 1\nsglang:max_total_num_tokens 4096\nsglang:token_usage 0.5\n\
              sglang:prompt_tokens_total 70\nsglang:cached_tokens_total 20\n\
              sglang:generation_tokens_total 8\n",
        );
        let kv = s.unwrap().kv;
        assert_eq!((kv.capacity_tokens, kv.usage), (Some(4096.0), Some(0.5)));
        assert_eq!(
            (kv.prompt_tokens, kv.cached_tokens, kv.generated_tokens),
            (Some(70.0), Some(20.0), Some(8.0))
        );
        let bare = parse(b"vllm:num_requests_running 1\n").unwrap();
        assert_eq!(bare.kv, KvMetrics::default());
        for garbled in [
            "vllm:cache_config_info{} 1",
            "vllm:cache_config_info{block_size=\"x\",num_gpu_blocks=\"2\"} 1",
            "vllm:cache_config_info{num_gpu_blocks=\"2\" 1",
            "vllm:cache_config_info 1",
        ] {
            let page = format!("vllm:num_requests_running 1\n{garbled}\n");
            let kv = parse(page.as_bytes()).unwrap().kv;
            assert_eq!(kv.capacity_tokens, None, "{garbled}");
        }
    }

    #[test]
    fn finished_requests_are_summed_over_label_sets() {
        let text = "vllm:num_requests_running 1\n\
            vllm:request_success_total{finished_reason=\"stop\",model_name=\"a\"} 40.0\n\
            vllm:request_success_total{finished_reason=\"length\",model_name=\"a\"} 2.0\n";
        assert_eq!(parse(text.as_bytes()).unwrap().completed, Some(42.0));
        let s = parse(
            b"sglang:num_running_reqs 0\nsglang:num_requests_total{is_streaming=\"true\"} 7\n",
        );
        assert_eq!(s.unwrap().completed, Some(7.0));
    }

    #[test]
    fn an_engine_that_queues_teaches_its_capacity() {
        let idle = EngineLoad::observe(None, &metrics(3, 0), own(0), 0);
        assert_eq!(idle.capacity, None);
        assert!(!idle.queueing(idle.estimate(0)));
        let full = EngineLoad::observe(Some(&idle), &metrics(16, 5), own(2), 0);
        assert_eq!(full.capacity, Some(16));
        assert!(full.queueing(full.estimate(2)), "it reported a queue");
        let drained = EngineLoad::observe(Some(&full), &metrics(10, 0), own(0), 0);
        assert_eq!(drained.capacity, Some(16), "capacity is remembered");
        assert!(!drained.queueing(drained.estimate(0)));
        assert!(
            drained.queueing(drained.estimate(7)),
            "7 more sent since the poll make 17 > 16"
        );
        let stall = EngineLoad::observe(None, &metrics(0, 9), own(0), 0);
        assert_eq!(stall.capacity, None, "a stall");
    }

    #[test]
    fn an_engine_that_stops_answering_is_taken_as_queueing() {
        let mut load = EngineLoad::observe(None, &metrics(0, 0), own(0), 0);
        for _ in 0..crate::freshness::STALE_POLLS {
            assert!(!load.queueing(0));
            load = load.missed_poll();
        }
        assert!(load.stale() && load.queueing(0));
        let back = EngineLoad::observe(Some(&load), &metrics(1, 0), own(0), 0);
        assert!(!back.stale() && !back.queueing(1));
    }

    #[test]
    fn the_estimate_adds_what_kvroute_sent_since_the_poll() {
        let load = EngineLoad::observe(None, &metrics(4, 2), own(3), 0);
        assert_eq!(load.estimate(3), 6);
        assert_eq!(load.estimate(5), 8, "two more sent");
        assert_eq!(load.estimate(0), 3, "three of ours finished");
        let stale = EngineLoad::observe(None, &metrics(0, 0), own(9), 0);
        assert_eq!(stale.estimate(2), 2, "never below our own count");
    }

    #[test]
    fn sglangs_loads_page_gives_the_uncached_tokens_waiting_over_its_ranks() {
        // SGLang's `/v1/loads?format=prometheus`: a gauge per core field, a sample per DP rank.
        let page = "# TYPE sglang_num_waiting_reqs gauge\n\
            sglang_num_waiting_reqs{dp_rank=\"0\"} 3\n\
            sglang_num_waiting_reqs{dp_rank=\"1\"} 1\n\
            # TYPE sglang_num_waiting_uncached_tokens gauge\n\
            sglang_num_waiting_uncached_tokens{dp_rank=\"0\"} 1200\n\
            sglang_num_waiting_uncached_tokens{dp_rank=\"1\"} 34.0\n";
        assert_eq!(parse_loads(page.as_bytes()), Some(1234));
        assert_eq!(
            parse_loads(b"sglang_num_waiting_reqs{dp_rank=\"0\"} 3\n"),
            None
        );
        assert_eq!(
            parse_loads(b"sglang_num_waiting_uncached_tokens -1\n"),
            None
        );
        assert_eq!(parse_loads(b"<html>not found</html>"), None);
        let sglang = parse(b"sglang:num_running_reqs 1\n").unwrap();
        assert!(sglang.serves_loads, "an SGLang page");
        let vllm = parse(b"vllm:num_requests_running 1\n").unwrap();
        assert!(!vllm.serves_loads);
    }

    #[test]
    fn queued_prefill_is_the_engines_report_plus_kvroutes_own_since() {
        let m = Metrics {
            waiting_uncached_tokens: Some(1_000),
            ..metrics(2, 3)
        };
        let load = EngineLoad::observe(
            None,
            &m,
            Own {
                inflight: 1,
                prefill: 400,
            },
            0,
        );
        assert_eq!(load.queued_prefill(400, 4.0), Some(4_000));
        assert_eq!(
            load.queued_prefill(900, 4.0),
            Some(4_500),
            "500 bytes sent since"
        );
        assert_eq!(
            load.queued_prefill(0, 4.0),
            Some(3_600),
            "ours reached their first byte"
        );
        let m = Metrics {
            waiting_uncached_tokens: Some(0),
            ..metrics(0, 0)
        };
        let idle = EngineLoad::observe(
            None,
            &m,
            Own {
                inflight: 0,
                prefill: 800,
            },
            0,
        );
        assert_eq!(
            idle.queued_prefill(300, 4.0),
            Some(300),
            "never below our own"
        );
        let silent = EngineLoad::observe(None, &metrics(2, 3), own(1), 0);
        assert_eq!(silent.queued_prefill(300, 4.0), None, "vLLM does not say");
    }
}
