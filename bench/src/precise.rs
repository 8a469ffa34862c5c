//! Precise mode in the bench: each precise gateway's own kvroute-indexer process subscribed to
//! every replica, the tokenizer file the fleet tokenizes with and the indexers decode with, the
//! chat template that renders prompts as the simulator does, and how fresh the index stayed.

use crate::sim_process::{spawn_logging, SimFleet, TempFile};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::process::{Child, Command};

/// The simulator's chat rendering (`kvroute_sim::chat_template`, Qwen's ChatML) as a Jinja chat
/// template, so the filter's keys are over the bytes the engines' blocks hold:
/// - plain chats as ChatML;
/// - the tool list in the system message, each tool as compact JSON with sorted keys (how the
///   simulator writes it), and each tool call as its function's name and arguments, those
///   re-serialized as the JSON string the client sent (compact, as the workloads send them);
/// - content parts as the simulator joins them (by a newline, in order), each image as the
///   simulator's 256 placeholder tokens named by the xxh3 of its URL, which the filter's image
///   marker carries. This template loops over the content, so the filter hands it the parts in
///   order (vLLM's "openai" content format).
///
/// A request's `cache_salt` is not in the text: the simulator, as vLLM, publishes it as the first
/// block's extra key, and the index seeds that prompt's keys with it as the filter does.
pub const SIM_CHAT_TEMPLATE: &str = concat!(
    "{% set sys = messages|length > 0 and messages[0].role in ['system', 'developer'] %}",
    "{% macro text_of(content) %}{% if content is string %}{{ content }}{% elif content %}",
    "{% for p in content if p.type == 'text' %}{% if not loop.first %}{{ '\n' }}{% endif %}",
    "{% if p.text[:16] == '<|kvroute_image:' %}<|vision_start|>",
    "{% for i in range(256) %}<|image_{{ p.text[16:32] }}|>{% endfor %}<|vision_end|>",
    "{% else %}{{ p.text }}{% endif %}{% endfor %}{% endif %}{% endmacro %}",
    "{% if tools %}<|im_start|>system\n{% if sys %}{{ text_of(messages[0].content) }}\n\n{% endif %}",
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n<tools>",
    "{% for tool in tools %}{{ '\n' }}{{ tool|tojson(separators=(',', ':'), sort_keys=true) }}{% endfor %}",
    "{{ '\n' }}</tools><|im_end|>\n{% endif %}",
    "{% for message in messages %}",
    "{% if loop.first and sys and tools %}",
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n",
    "{{ text_of(message.content) }}\n</tool_response><|im_end|>\n",
    "{% else %}<|im_start|>{{ 'system' if message.role == 'developer' else message.role }}\n",
    "{{ text_of(message.content) }}",
    "{% for call in message.tool_calls or [] %}{{ '\n' }}<tool_call>\n",
    "{\"arguments\":{{ call.function.arguments|tojson(separators=(',', ':'))|tojson }},",
    "\"name\":{{ call.function.name|tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n",
    "{% endif %}{% endfor %}",
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
);

/// How long an indexer may take to print its address, and every replica's stream to be heard.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// kvroute's plugin config in precise mode: the shipped one polling the `kvroute_indexer`
/// cluster, rendering as the simulator does, with the decision header on.
pub fn plugin_config() -> Value {
    json!({
        "debug_header": true,
        "index_cluster": kvroute_harness::bootstrap::INDEXER_CLUSTER,
        "chat_template": SIM_CHAT_TEMPLATE,
    })
}

/// The indexer binary: `$KVROUTE_INDEXER`, else `target/release/kvroute-indexer` under the
/// workspace root.
pub fn indexer_binary() -> PathBuf {
    std::env::var_os("KVROUTE_INDEXER")
        .map(PathBuf::from)
        .unwrap_or_else(|| crate::paths::workspace_root().join("target/release/kvroute-indexer"))
}

/// The fleet spec a run with a precise router starts its fleets with: `spec` with the
/// simulator's byte-level BPE tokenizer (written to a temporary file, kept alive by the returned
/// guard) unless it names a tokenizer already, so the indexers decode the engines' blocks as they
/// would a real engine's. The second value is the spec to report, without this machine's path.
pub fn with_tokenizer(spec: &Value) -> Result<(Value, Value, Option<TempFile>), String> {
    if spec.get("tokenizer").is_some_and(|t| !t.is_null()) {
        return Ok((spec.clone(), spec.clone(), None));
    }
    let file = TempFile::write("tokenizer.json", "")?;
    kvroute_sim::bpe::write(&file.0)?;
    let mut run = spec.clone();
    run["tokenizer"] = json!(file.0.to_string_lossy());
    let mut shown = spec.clone();
    shown["tokenizer"] = json!(SIM_TOKENIZER);
    Ok((run, shown, Some(file)))
}

/// How a reported fleet spec names the simulator's BPE tokenizer ([`with_tokenizer`]).
const SIM_TOKENIZER: &str = "kvroute-sim tokenizer (byte-level BPE)";

/// Whether the reported fleet spec `shown` tokenized with the simulator's BPE ([`with_tokenizer`]).
pub fn is_sim_tokenizer(shown: &Value) -> bool {
    shown["tokenizer"] == SIM_TOKENIZER
}

/// A kvroute-indexer process subscribed to every replica of a fleet; killed when dropped.
pub struct Indexer {
    pub addr: SocketAddr,
    http: reqwest::Client,
    _child: Child,
}

impl Indexer {
    /// Starts an indexer over `fleet` (every replica's KV events and replay socket, so an idle
    /// replica is probed and stays fresh past `--stale-after`, left at its default), decoding
    /// with the tokenizer `fleet_spec` names, and waits
    /// until it has heard every replica's stream (a ZMQ subscriber misses what was published
    /// before it joined: requests sent straight to each replica make them publish). The probes
    /// leave blocks in the caches; empty them once every indexer of the run is ready
    /// ([`reset_caches`]).
    pub async fn start(fleet: &SimFleet, fleet_spec: &Value) -> Result<Indexer, String> {
        let tokenizer = fleet_spec["tokenizer"]
            .as_str()
            .ok_or("precise mode needs a fleet that tokenizes with a tokenizer file")?;
        let bin = indexer_binary();
        if !bin.exists() {
            return Err(format!(
                "kvroute-indexer not found at {} (run make build)",
                bin.display()
            ));
        }
        let mut cmd = Command::new(&bin);
        cmd.args(["--listen", "127.0.0.1:0", "--model", &fleet.model])
            .arg("--tokenizer")
            .arg(Path::new(tokenizer));
        for r in &fleet.replicas {
            let events = r
                .kv_events
                .as_deref()
                .ok_or_else(|| format!("replica {} publishes no KV events", r.url))?;
            let endpoint = r.url.trim_start_matches("http://").trim_end_matches('/');
            let replay = r.kv_events_replay.as_ref().map(|r| format!(",replay={r}"));
            let replay = replay.unwrap_or_default();
            // Each replica's dialect, so a mixed fleet is read right.
            let kind = r.engine_kind.as_ref().map(|k| format!(",kind={k}"));
            let kind = kind.unwrap_or_default();
            cmd.arg("--engine")
                .arg(format!("{endpoint}={events}{replay}{kind}"));
        }
        let (child, mut lines) = spawn_logging(&mut cmd, &bin)?;
        let addr = tokio::time::timeout(START_TIMEOUT, async {
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(url) = line.split("listening on http://").nth(1) {
                    return url.trim().parse::<SocketAddr>().map_err(|e| e.to_string());
                }
                if !line.contains(": INFO: ") {
                    eprintln!("   {line}");
                }
            }
            Err("kvroute-indexer exited before it listened".to_string())
        })
        .await
        .map_err(|_| "kvroute-indexer did not listen within 60 s".to_string())??;
        // Keep draining (and showing) its log so it never blocks on a full pipe.
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                if !line.contains(": INFO: ") {
                    eprintln!("   {line}");
                }
            }
        });
        let indexer = Indexer {
            addr,
            http: reqwest::Client::new(),
            _child: child,
        };
        indexer.wait_heard(fleet).await?;
        Ok(indexer)
    }

    /// Probes every replica until the indexer's health page shows each stream with a sequence
    /// number.
    async fn wait_heard(&self, fleet: &SimFleet) -> Result<(), String> {
        let deadline = tokio::time::Instant::now() + START_TIMEOUT;
        for probe in 0.. {
            for r in &fleet.replicas {
                let body = json!({"model": fleet.model, "max_tokens": 1,
                    "prompt": format!("probe {probe} {}", "word ".repeat(64))});
                let url = format!("{}/v1/completions", r.url.trim_end_matches('/'));
                let sent = self.http.post(&url).json(&body).send().await;
                sent.map_err(|e| format!("{url}: {e}"))?;
            }
            let streams = self.health().await?["streams"].clone();
            let heard = streams
                .as_array()
                .is_some_and(|s| !s.is_empty() && s.iter().all(|s| !s["next_seq"].is_null()));
            if heard {
                return Ok(());
            }
            if tokio::time::Instant::now() > deadline {
                return Err(format!("the indexer never heard every replica: {streams}"));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Ok(())
    }

    async fn get(&self, path: &str) -> Result<reqwest::Response, String> {
        let url = format!("http://{}{path}", self.addr);
        self.http
            .get(&url)
            .send()
            .await
            .map_err(|e| format!("{url}: {e}"))
    }

    /// The indexer's health page.
    pub async fn health(&self) -> Result<Value, String> {
        self.get("/health")
            .await?
            .json()
            .await
            .map_err(|e| format!("indexer health: {e}"))
    }

    /// Keys the indexer holds over all its streams.
    pub async fn keys(&self) -> Result<u64, String> {
        let health = self.health().await?;
        let streams = health["streams"].as_array().cloned().unwrap_or_default();
        Ok(streams.iter().filter_map(|s| s["keys"].as_u64()).sum())
    }

    /// Endpoints the indexer calls stale now (`kvroute_indexer_stale_endpoints` in /metrics).
    pub async fn stale_endpoints(&self) -> Result<u64, String> {
        let text = self
            .get("/metrics")
            .await?
            .text()
            .await
            .map_err(|e| format!("indexer metrics: {e}"))?;
        text.lines()
            .find_map(|l| l.strip_prefix("kvroute_indexer_stale_endpoints "))
            .and_then(|v| v.trim().parse().ok())
            .ok_or_else(|| "indexer metrics: no kvroute_indexer_stale_endpoints".into())
    }
}

/// Empties every replica's prefix cache (vLLM's `/reset_prefix_cache`), then waits until every
/// indexer has dropped what the probes cached: every router starts from empty caches.
pub async fn reset_caches(fleet: &SimFleet, indexers: &[&Indexer]) -> Result<(), String> {
    let http = reqwest::Client::new();
    for r in &fleet.replicas {
        let url = format!("{}/reset_prefix_cache", r.url.trim_end_matches('/'));
        let resp = http
            .post(&url)
            .send()
            .await
            .map_err(|e| format!("{url}: {e}"))?;
        if !resp.status().is_success() {
            return Err(format!("{url}: HTTP {}", resp.status()));
        }
    }
    let deadline = tokio::time::Instant::now() + START_TIMEOUT;
    for indexer in indexers {
        while indexer.keys().await? > 0 {
            if tokio::time::Instant::now() > deadline {
                return Err("an indexer kept keys after the caches were reset".into());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    Ok(())
}

/// How fresh the index was during a precise router's run.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct IndexFreshness {
    /// Share of kvroute's polls of its indexer that were answered and applied
    /// (`kvroute.index.poll_ok` over it and `poll_failed`, summed over its Envoys' workers).
    pub polls_answered: f64,
    /// Share of the samples taken through the run (each indexer's /metrics, every 500 ms) in which
    /// no indexer called any engine stale.
    pub fresh: f64,
    /// Samples taken.
    pub samples: u64,
}

impl IndexFreshness {
    /// From kvroute's poll counters grown over the run and the samples' count of fresh ones.
    pub fn new(polls_ok: u64, polls_failed: u64, fresh_samples: u64, samples: u64) -> Self {
        let share = |a: u64, b: u64| match b {
            0 => 0.0,
            b => (a as f64 / b as f64 * 1e4).round() / 1e4,
        };
        IndexFreshness {
            polls_answered: share(polls_ok, polls_ok + polls_failed),
            fresh: share(fresh_samples, samples),
            samples,
        }
    }
}

/// How often [`sample_freshness`] looks.
pub const SAMPLE_EVERY: Duration = Duration::from_millis(500);

/// One look at `indexers`: whether none calls any engine stale (an indexer that does not answer
/// is not fresh).
pub async fn all_fresh(indexers: &[&Indexer]) -> bool {
    for indexer in indexers {
        if indexer.stale_endpoints().await.map_or(true, |n| n > 0) {
            return false;
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::workload::Workload;
    use kvroute::template::Templates;

    /// The filter's rendering of `body` with [`SIM_CHAT_TEMPLATE`], and the simulator's.
    fn both(templates: &Templates, body: &Value) -> (String, String) {
        let filter = templates
            .render(body.to_string().as_bytes())
            .unwrap_or_else(|e| panic!("not rendered: {e:?}"));
        let messages = body["messages"].as_array().expect("messages");
        let tools = body["tools"].as_array().map(Vec::as_slice);
        let sim = kvroute_sim::chat_template::render(messages, tools, true).expect("sim renders");
        (String::from_utf8(filter.text).expect("utf-8"), sim)
    }

    #[test]
    fn the_template_renders_every_chat_workload_as_the_simulator_does() {
        let mut templates = Templates::default();
        templates
            .set_default(&json!({ "chat_template": SIM_CHAT_TEMPLATE }))
            .expect("the template compiles");
        let workloads = [
            include_str!("../workloads/llm-d.json"),
            include_str!("../workloads/zipf-pressure.json"),
            include_str!("../workloads/agentic.json"),
            include_str!("../workloads/multimodal.json"),
            include_str!("../workloads/tenants.json"),
            include_str!("../workloads/multi-turn.json"),
        ];
        for text in workloads {
            let w = Workload::from_json(text).expect("workload");
            for r in w.stream("m").take(40) {
                let (filter, sim) = both(&templates, &r.body);
                if filter != sim {
                    let at = filter
                        .bytes()
                        .zip(sim.bytes())
                        .take_while(|(a, b)| a == b)
                        .count();
                    let show = |s: &str| {
                        s.get(at.saturating_sub(40)..(at + 60).min(s.len()))
                            .unwrap_or("")
                            .to_string()
                    };
                    panic!(
                        "{}: {} renders differently from byte {at}:\n filter: {:?}\n    sim: {:?}",
                        w.name,
                        r.user,
                        show(&filter),
                        show(&sim)
                    );
                }
            }
        }
    }

    #[test]
    fn freshness_rounds_shares_and_has_no_nan() {
        let f = IndexFreshness::new(2, 1, 3, 4);
        assert_eq!((f.polls_answered, f.fresh, f.samples), (0.6667, 0.75, 4));
        let none = IndexFreshness::new(0, 0, 0, 0);
        assert_eq!((none.polls_answered, none.fresh), (0.0, 0.0));
    }
}
