//! The simulated fleet in virtual time: one engine core per replica (the simulator's own model),
//! and the simulator's front end that turns a request body into prompt and output tokens.

use kvroute_sim::bpe::Vocab;
use kvroute_sim::engine::core::{EngineCore, Happened, RequestId};
use kvroute_sim::kv_events::Published;
use kvroute_sim::request::{self, Endpoint, Frontend};
use kvroute_sim::spec::FleetSpec;
use kvroute_sim::tokenizer::seed_of;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::Value;
use std::sync::Arc;
use std::time::Duration;

/// What a replica needs to run one request, as its HTTP front end would give it.
pub struct Prepared {
    pub prompt: Vec<u32>,
    pub salt: Option<String>,
    pub output: Vec<u32>,
    pub include_usage: bool,
}

pub struct Fleet {
    pub spec: Arc<FleetSpec>,
    pub cores: Vec<EngineCore>,
    /// Each replica's address as the gateways name it (never connected to).
    pub addrs: Vec<String>,
    vocab: Vocab,
}

/// The addresses the lab names `n` replicas by: distinct ports drawn from `seed`, as the
/// wall-clock bench's simulator takes free ports. kvroute places groups by hashing addresses, so
/// where each group lands varies from seed to seed as it does from run to run there.
fn addresses(n: usize, seed: u64) -> Vec<String> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0xad_d2e5);
    let mut ports: Vec<u16> = Vec::with_capacity(n);
    while ports.len() < n {
        let port = rng.random_range(32768..61000);
        if !ports.contains(&port) {
            ports.push(port);
        }
    }
    ports.iter().map(|p| format!("127.0.0.1:{p}")).collect()
}

impl Fleet {
    /// A fresh fleet of `spec`, its addresses drawn from `seed`.
    pub fn new(spec: Arc<FleetSpec>, vocab: Vocab, seed: u64) -> Fleet {
        let cores = (0..spec.replicas)
            .map(|i| EngineCore::new(i, Arc::new(spec.replica(i))))
            .collect();
        Fleet {
            addrs: addresses(spec.replicas, seed),
            cores,
            spec,
            vocab,
        }
    }

    /// The replica named `addr`.
    pub fn index_of(&self, addr: &str) -> Option<usize> {
        self.addrs.iter().position(|a| a == addr)
    }

    /// The request as a replica's front end reads it: its tokens, or the 400 it answers.
    pub fn prepare(&self, path: &str, body: &Value, raw: &[u8]) -> Result<Prepared, String> {
        let endpoint = Endpoint::from_path(path).ok_or("not a generation path")?;
        let frontend = Frontend {
            vocab: &self.vocab,
            template: None,
        };
        let gen = request::parse_with(&frontend, endpoint, body, Some(raw))?;
        let output_len = gen.max_tokens.unwrap_or(self.spec.default_max_tokens);
        if gen.prompt_tokens.len() + output_len > self.spec.max_model_len {
            return Err("longer than max_model_len".into());
        }
        let (_, output) = self.vocab.output(seed_of(&gen.prompt_tokens), output_len);
        Ok(Prepared {
            prompt: gen.prompt_tokens,
            salt: gen.cache_salt,
            output,
            include_usage: gen.include_usage,
        })
    }

    /// Queues request `id` at replica `r`.
    pub fn submit(
        &mut self,
        now: Duration,
        r: usize,
        id: RequestId,
        p: Prepared,
    ) -> Result<(), String> {
        let core = &mut self.cores[r];
        core.note_request();
        core.submit(now, id, p.prompt, p.salt, p.output)
            .map_err(|e| format!("{e:?}"))
    }

    /// When replica `r` next has something to do by itself.
    pub fn next_event(&self, r: usize) -> Option<Duration> {
        self.cores[r].next_event()
    }

    /// Runs replica `r` up to `now`: what happened, and the KV-event batches it published.
    pub fn advance(&mut self, r: usize, now: Duration, out: &mut Vec<Happened>) -> Vec<Published> {
        let core = &mut self.cores[r];
        core.advance(now, out);
        core.take_published()
    }

    /// Drains what replica `r` published outside `advance` (on a submit).
    pub fn published(&mut self, r: usize) -> Vec<Published> {
        self.cores[r].take_published()
    }
}
