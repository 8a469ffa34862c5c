//! Precise mode's fixtures: a simulated fleet tokenizing with the repository's byte-level BPE and
//! publishing vLLM's (or SGLang's) KV events with a replay socket, the configuration of an
//! indexer following it with its default `--stale-after`, and waits on what an index reports.

use kvroute_indexer::config::{Config as IndexerConfig, EngineSpec};
use kvroute_indexer::dialect::Dialect;
use kvroute_sim::fleet::Fleet;
use kvroute_sim::spec::{EngineKind, FleetSpec};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The model the fleet serves and the indexer keys for.
pub const MODEL: &str = "m";

/// The simulator's rendering of plain chats (ChatML), as a Jinja chat template.
pub const CHATML: &str = "{% for message in messages %}<|im_start|>{{ message.role }}\n\
{{ message.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}\
<|im_start|>assistant\n{% endif %}";

/// A chat whose long system prompt (several 512-byte chunks, with multi-byte characters) is
/// `tag`'s own.
pub fn body(tag: &str) -> Value {
    let system: String = (0..80)
        .map(|i| format!("Rule {i} of {tag}: the café opens at {i} o'clock. "))
        .collect();
    json!({"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": format!("When does {tag} open?")}]})
}

/// A simulated fleet tokenizing with the repository's BPE, and that tokenizer's file (removed
/// when the fleet is dropped).
pub struct BpeFleet {
    pub sim: Fleet,
    pub tokenizer: PathBuf,
}

impl BpeFleet {
    /// `replicas` replicas serving [`MODEL`]; `name` tells the tokenizer file apart.
    pub async fn start(replicas: usize, name: &str) -> BpeFleet {
        BpeFleet::start_with(replicas, name, |_| {}).await
    }

    /// [`BpeFleet::start`] with `change` made to the spec (e.g. which engine each replica plays).
    pub async fn start_with(
        replicas: usize,
        name: &str,
        change: impl FnOnce(&mut FleetSpec),
    ) -> BpeFleet {
        let tokenizer = std::env::temp_dir().join(format!(
            "kvroute-{name}-{}-tokenizer.json",
            std::process::id()
        ));
        kvroute_sim::bpe::write(&tokenizer).expect("tokenizer written");
        let mut spec = FleetSpec {
            replicas,
            model: MODEL.into(),
            time_scale: 0.05,
            tokenizer: Some(tokenizer.to_string_lossy().into_owned()),
            ..FleetSpec::default()
        };
        change(&mut spec);
        let sim = Fleet::start(spec, 0, 0).await.expect("sim fleet starts");
        BpeFleet { sim, tokenizer }
    }

    /// An indexer's configuration following every replica's KV events and replay socket (an
    /// idle replica is probed there and stays fresh) in its engine's dialect, listening on a free
    /// port of 127.0.0.1.
    pub fn indexer_config(&self) -> IndexerConfig {
        let engines = self.sim.replicas.iter().map(|r| EngineSpec {
            endpoint: r.addr.to_string(),
            events: r.kv_events_endpoint(),
            replay: r.kv_events_replay_endpoint(),
            kind: Some(match r.kind() {
                EngineKind::Vllm => Dialect::Vllm,
                EngineKind::Sglang => Dialect::Sglang,
            }),
            ..EngineSpec::default()
        });
        following(self.tokenizer.clone(), MODEL, engines.collect(), 1 << 16)
    }

    /// The backends' addresses, in replica order.
    pub fn backends(&self) -> Vec<std::net::SocketAddr> {
        self.sim.replicas.iter().map(|r| r.addr).collect()
    }

    /// A publisher drops what it sends before a subscription reaches it: sends to every replica
    /// until each of `indexers` (their base URLs) has heard every stream, then empties every
    /// replica's cache.
    pub async fn until_heard(&self, indexers: &[String]) {
        let mut probe = 0;
        eventually("every indexer heard every stream", || {
            probe += 1;
            async move {
                for r in &self.sim.replicas {
                    let body = json!({"model": MODEL, "max_tokens": 1,
                                      "prompt": format!("probe {probe} {}", "word ".repeat(300))});
                    post(&format!("{}/v1/completions", r.url()), &body).await;
                }
                for url in indexers {
                    let heard = health(url).await["streams"]
                        .as_array()
                        .is_some_and(|s| s.iter().all(|s| !s["next_seq"].is_null()));
                    if !heard {
                        return false;
                    }
                }
                true
            }
        })
        .await;
        for r in &self.sim.replicas {
            r.replica.reset_prefix_cache();
        }
    }
}

impl Drop for BpeFleet {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.tokenizer);
    }
}

/// Polls `check` every 100 ms for up to 60 s; panics with `what` when it never holds.
pub async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while !check().await {
        assert!(start.elapsed() < Duration::from_secs(60), "never: {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// POSTs `body` to `url`, which must answer 200.
pub async fn post(url: &str, body: &Value) {
    let resp = client().post(url).json(body).send().await.expect("request");
    assert_eq!(resp.status(), 200, "{url}");
    resp.bytes().await.expect("body");
}

/// The indexer's health page: its streams, each with its endpoint, next sequence and keys.
pub async fn health(indexer: &str) -> Value {
    client()
        .get(format!("{indexer}/health"))
        .send()
        .await
        .expect("health")
        .json()
        .await
        .expect("health json")
}

/// Keys the indexer says `endpoint` holds, from its health page.
pub async fn keys_held(indexer: &str, endpoint: &str) -> u64 {
    health(indexer).await["streams"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|s| s["endpoint"] == endpoint)
        .filter_map(|s| s["keys"].as_u64())
        .sum()
}

/// An indexer's configuration following `engines`, keying for `model` in the filter's default
/// chunk size, listening on a free port of 127.0.0.1, everything else the indexer's defaults
/// (its `--stale-after` and `--gap-hold` too).
pub fn following(
    tokenizer: PathBuf,
    model: &str,
    engines: Vec<EngineSpec>,
    feed_capacity: usize,
) -> IndexerConfig {
    use clap::Parser;
    let args = ["kvroute-indexer", "--listen=127.0.0.1:0", "--model", model];
    let mut config = IndexerConfig::try_parse_from(args.into_iter().chain(["--tokenizer=t"]))
        .expect("the indexer's command line");
    config.events.tokenizer = tokenizer;
    config.chunk_size = kvroute::config::Config::default().chunk_size;
    config.events.engines = engines;
    config.events.feed_capacity = feed_capacity;
    config
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .expect("client builds")
}
