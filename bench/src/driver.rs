//! Load generation: sends a workload's requests to one router URL, stage by stage, and times
//! each streamed response (TTFT at the first generated token, e2e at the end of the stream).

use crate::workload::{Arrival, Request, Workload, SESSION_HEADER};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::Value;
use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::task::JoinSet;
use tokio::time::{sleep_until, timeout};

/// A request still streaming after this long is counted as an error.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);
/// After the last stage, how long in-flight requests may take to finish.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(60);
/// Open-loop arrivals beyond this many in flight are not sent and count as errors, so an
/// overloaded router cannot make the client itself fall over.
const MAX_IN_FLIGHT: usize = 512;

/// What the client saw of one request.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct Sample {
    /// The workload's user tag (`u<group>-<member>-<episode>`).
    pub user: String,
    /// Milliseconds from the run's start to the request's send.
    pub sent_ms: f64,
    pub error: Option<String>,
    pub ttft_ms: Option<f64>,
    pub e2e_ms: f64,
    pub output_tokens: u64,
    /// The `x-sim-replica` response header: which replica served it.
    pub replica: Option<usize>,
    /// kvroute's `x-kvroute-decision` response header (`home`, `spread`, `affinity`, ...): why
    /// it went to that replica. Other routers send none.
    pub decision: Option<String>,
    /// For `NAME@N`, the instance that served it (the front's `x-bench-upstream` header).
    pub gateway: Option<String>,
    /// The final usage chunk's `prompt_tokens` and `prompt_tokens_details.cached_tokens`.
    pub prompt_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
}

/// Everything a run produced.
#[derive(Debug, Default)]
pub struct RunOutcome {
    pub samples: Vec<Sample>,
    /// From the first request sent to the last one finished.
    pub wall_s: f64,
}

/// Live counters for the progress line.
#[derive(Default)]
pub struct Progress {
    sent: AtomicU64,
    done: AtomicU64,
    errors: AtomicU64,
    stage: AtomicU64,
}

/// Runs every stage of `w` against `base_url` (e.g. `http://127.0.0.1:10000`).
/// `model` is the fleet's served model name, sent in every request body.
pub async fn run(base_url: &str, w: &Workload, model: &str, label: &str) -> RunOutcome {
    let progress = Arc::new(Progress::default());
    let ticker = tokio::spawn(report_progress(
        progress.clone(),
        label.to_string(),
        w.clone(),
    ));
    let client = Client {
        http: reqwest::Client::builder()
            .pool_max_idle_per_host(MAX_IN_FLIGHT)
            .build()
            .unwrap_or_default(),
        url: format!("{}{}", base_url.trim_end_matches('/'), w.path()),
        session_header: w.session_header,
        progress: progress.clone(),
        run_start: Instant::now(),
    };
    let mut requests = w.stream(model);
    let mut arrivals = ChaCha8Rng::seed_from_u64(w.seed ^ 0xA11_7E5);
    let mut set: JoinSet<Sample> = JoinSet::new();
    let mut samples = Vec::new();
    let stage_len = Duration::from_secs_f64(w.stage_duration_s);
    let start = Instant::now();

    for stage in 0..w.arrival.stages() {
        progress.stage.store(stage as u64, Ordering::Relaxed);
        let deadline = tokio::time::Instant::now() + stage_len;
        match &w.arrival {
            Arrival::Poisson { qps } => {
                let rate = qps[stage];
                let mut next = tokio::time::Instant::now();
                loop {
                    if rate > 0.0 {
                        let gap: f64 = -(1.0 - arrivals.random::<f64>()).ln() / rate;
                        next += Duration::from_secs_f64(gap);
                    } else {
                        next = deadline;
                    }
                    if next >= deadline {
                        collect_until(&mut set, &mut samples, deadline).await;
                        break;
                    }
                    collect_until(&mut set, &mut samples, next).await;
                    let Some(req) = requests.next() else { break };
                    if set.len() >= MAX_IN_FLIGHT {
                        progress.errors.fetch_add(1, Ordering::Relaxed);
                        samples.push(Sample {
                            error: Some("client in-flight cap".into()),
                            ..Sample::default()
                        });
                        continue;
                    }
                    set.spawn(client.clone().send(req));
                }
            }
            Arrival::Concurrency { levels } => {
                let level = levels[stage].max(1);
                while tokio::time::Instant::now() < deadline {
                    while set.len() < level {
                        let Some(req) = requests.next() else { break };
                        set.spawn(client.clone().send(req));
                    }
                    tokio::select! {
                        Some(done) = set.join_next() => samples.push(done.unwrap_or_else(panicked)),
                        _ = sleep_until(deadline) => {}
                    }
                }
            }
        }
    }
    // Let in-flight requests finish; what is left after the drain timeout counts as errors.
    let drained = timeout(DRAIN_TIMEOUT, async {
        while let Some(done) = set.join_next().await {
            samples.push(done.unwrap_or_else(panicked));
        }
    })
    .await;
    if drained.is_err() {
        for _ in 0..set.len() {
            samples.push(Sample {
                error: Some("unfinished after drain".into()),
                ..Sample::default()
            });
        }
        set.abort_all();
    }
    let wall_s = start.elapsed().as_secs_f64();
    ticker.abort();
    let clear = if std::io::stderr().is_terminal() {
        "\r\x1b[K"
    } else {
        ""
    };
    let errors = samples.iter().filter(|s| s.error.is_some()).count();
    let mostly = most_common_error(&samples)
        .map(|e| format!(" (mostly: {e})"))
        .unwrap_or_default();
    eprintln!(
        "{clear}[{label}] finished: {} requests, {errors} errors{mostly}, {wall_s:.1} s",
        samples.len()
    );
    RunOutcome { samples, wall_s }
}

fn most_common_error(samples: &[Sample]) -> Option<String> {
    let mut counts = std::collections::HashMap::<&str, usize>::new();
    for e in samples.iter().filter_map(|s| s.error.as_deref()) {
        *counts.entry(e).or_default() += 1;
    }
    counts
        .into_iter()
        .max_by_key(|(_, n)| *n)
        .map(|(e, _)| e.to_string())
}

/// Collects finished requests until `until`.
async fn collect_until(
    set: &mut JoinSet<Sample>,
    samples: &mut Vec<Sample>,
    until: tokio::time::Instant,
) {
    loop {
        if set.is_empty() {
            sleep_until(until).await;
            return;
        }
        tokio::select! {
            Some(done) = set.join_next() => samples.push(done.unwrap_or_else(panicked)),
            _ = sleep_until(until) => return,
        }
    }
}

fn panicked(e: tokio::task::JoinError) -> Sample {
    Sample {
        error: Some(format!("request task failed: {e}")),
        ..Sample::default()
    }
}

async fn report_progress(p: Arc<Progress>, label: String, w: Workload) {
    let tty = std::io::stderr().is_terminal();
    let every = if tty {
        Duration::from_secs(1)
    } else {
        Duration::from_secs(5)
    };
    let start = Instant::now();
    let total = w.stage_duration_s * w.arrival.stages() as f64;
    loop {
        tokio::time::sleep(every).await;
        let stage = p.stage.load(Ordering::Relaxed) as usize;
        let load = match &w.arrival {
            Arrival::Poisson { qps } => format!("{} qps", qps.get(stage).copied().unwrap_or(0.0)),
            Arrival::Concurrency { levels } => {
                format!("{} in flight", levels.get(stage).copied().unwrap_or(0))
            }
        };
        let (sent, done) = (
            p.sent.load(Ordering::Relaxed),
            p.done.load(Ordering::Relaxed),
        );
        let line = format!(
            "[{label}] {:.0}/{total:.0} s  stage {}/{} ({load})  sent {sent}  done {done}  errors {}",
            start.elapsed().as_secs_f64(),
            stage + 1,
            w.arrival.stages(),
            p.errors.load(Ordering::Relaxed),
        );
        if tty {
            eprint!("\r\x1b[K{line}");
        } else {
            eprintln!("{line}");
        }
    }
}

#[derive(Clone)]
struct Client {
    http: reqwest::Client,
    url: String,
    session_header: bool,
    progress: Arc<Progress>,
    run_start: Instant,
}

impl Client {
    async fn send(self, req: Request) -> Sample {
        self.progress.sent.fetch_add(1, Ordering::Relaxed);
        let start = Instant::now();
        let user = req.user.clone();
        let mut sample = match timeout(REQUEST_TIMEOUT, self.stream(req, start)).await {
            Ok(s) => s,
            Err(_) => Sample {
                error: Some("timed out".into()),
                ..Sample::default()
            },
        };
        sample.e2e_ms = start.elapsed().as_secs_f64() * 1e3;
        sample.sent_ms = start.duration_since(self.run_start).as_secs_f64() * 1e3;
        sample.user = user;
        let counter = if sample.error.is_some() {
            &self.progress.errors
        } else {
            &self.progress.done
        };
        counter.fetch_add(1, Ordering::Relaxed);
        sample
    }

    async fn stream(&self, req: Request, start: Instant) -> Sample {
        let mut sample = Sample::default();
        let mut builder = self.http.post(&self.url).json(&req.body);
        if self.session_header {
            builder = builder.header(SESSION_HEADER, &req.user);
        }
        let mut resp = match builder.send().await {
            Ok(r) => r,
            Err(e) => {
                return Sample {
                    error: Some(format!("send: {e}")),
                    ..sample
                }
            }
        };
        sample.replica = resp
            .headers()
            .get("x-sim-replica")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse().ok());
        let text = |name: &str| {
            resp.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        sample.decision = text("x-kvroute-decision");
        sample.gateway = text(kvroute_harness::bootstrap::UPSTREAM_HEADER);
        if !resp.status().is_success() {
            let status = resp.status();
            let text = resp.text().await.unwrap_or_default();
            sample.error = Some(format!(
                "HTTP {status}: {}",
                text.chars().take(200).collect::<String>()
            ));
            return sample;
        }
        let mut sse = SseParser::default();
        loop {
            match resp.chunk().await {
                Ok(Some(bytes)) => {
                    for event in sse.push(&bytes) {
                        if sample.ttft_ms.is_none() && event.has_token {
                            sample.ttft_ms = Some(start.elapsed().as_secs_f64() * 1e3);
                        }
                        if let Some((p, c)) = event.prompt {
                            sample.prompt_tokens = Some(p);
                            sample.cached_tokens = Some(c);
                        }
                        if let Some(n) = event.completion_tokens {
                            sample.output_tokens = n;
                        } else if event.has_token && !sse.saw_usage {
                            sample.output_tokens += 1;
                        }
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    sample.error = Some(format!("stream: {e}"));
                    return sample;
                }
            }
        }
        if sample.ttft_ms.is_none() {
            sample.error = Some("stream ended without a token".into());
        }
        sample
    }
}

/// What one SSE `data:` event of an OpenAI stream carried.
#[derive(Debug, PartialEq)]
struct Event {
    has_token: bool,
    completion_tokens: Option<u64>,
    /// `prompt_tokens` and `prompt_tokens_details.cached_tokens` of the usage chunk.
    prompt: Option<(u64, u64)>,
}

/// Splits a byte stream into SSE `data:` events and reads the parts the driver needs.
#[derive(Default)]
struct SseParser {
    buf: Vec<u8>,
    saw_usage: bool,
}

impl SseParser {
    fn push(&mut self, bytes: &[u8]) -> Vec<Event> {
        self.buf.extend_from_slice(bytes);
        let mut events = Vec::new();
        while let Some(nl) = self.buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.buf.drain(..=nl).collect();
            let line = String::from_utf8_lossy(&line);
            let Some(data) = line.trim().strip_prefix("data:") else {
                continue;
            };
            let data = data.trim();
            if data == "[DONE]" {
                continue;
            }
            let Ok(v) = serde_json::from_str::<Value>(data) else {
                continue;
            };
            let completion_tokens = v["usage"]["completion_tokens"].as_u64();
            let prompt = v["usage"]["prompt_tokens"].as_u64().map(|p| {
                let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
                (p, cached.unwrap_or(0))
            });
            if completion_tokens.is_some() {
                self.saw_usage = true;
            }
            let has_token = v["choices"].as_array().is_some_and(|cs| {
                cs.iter().any(|c| {
                    let text = c["delta"]["content"]
                        .as_str()
                        .or_else(|| c["text"].as_str());
                    text.is_some_and(|t| !t.is_empty())
                })
            });
            events.push(Event {
                has_token,
                completion_tokens,
                prompt,
            });
        }
        events
    }
}

/// For tests: a request of `user` sent at `sent_ms`, served by `replica` with `cached` of its 100
/// prompt tokens cached.
#[cfg(test)]
pub fn served(user: &str, sent_ms: f64, replica: usize, cached: u64) -> Sample {
    Sample {
        user: user.into(),
        sent_ms,
        replica: Some(replica),
        prompt_tokens: Some(100),
        cached_tokens: Some(cached),
        ..Sample::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_parser_finds_tokens_and_usage_across_chunk_boundaries() {
        let mut p = SseParser::default();
        let role =
            "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n";
        assert_eq!(
            p.push(role.as_bytes()),
            vec![Event {
                has_token: false,
                completion_tokens: None,
                prompt: None
            }]
        );
        let tok = "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n";
        let (a, b) = tok.split_at(10);
        assert!(p.push(a.as_bytes()).is_empty());
        assert_eq!(
            p.push(b.as_bytes()),
            vec![Event {
                has_token: true,
                completion_tokens: None,
                prompt: None
            }]
        );
        let usage = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":7}}\n\ndata: [DONE]\n\n";
        assert_eq!(
            p.push(usage.as_bytes()),
            vec![Event {
                has_token: false,
                completion_tokens: Some(7),
                prompt: Some((5, 0))
            }]
        );
    }

    #[test]
    fn sse_parser_reads_completions_text() {
        let mut p = SseParser::default();
        let ev = p.push(b"data: {\"choices\":[{\"text\":\" the\"}]}\n");
        assert!(ev[0].has_token);
    }
}
