//! Workload spec (JSON) and the deterministic stream of OpenAI requests it describes.
//!
//! A workload is a population of users in groups. Users of one group share a long system prompt
//! (a tenant's instructions, or a popular document for RAG); each request adds the user's question.
//! With `turns > 1` a user's next request resends the whole conversation so far plus a new question.
//! Everything random comes from one seeded RNG, so the same seed yields the same requests.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// Which OpenAI endpoint the requests use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Api {
    Chat,
    Completions,
}

/// How requests arrive: open-loop Poisson stages or closed-loop concurrency stages.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Arrival {
    /// One stage per entry, each `stage_duration_s` long, at that many requests per second.
    Poisson { qps: Vec<f64> },
    /// One stage per entry, each keeping that many requests in flight.
    Concurrency { levels: Vec<usize> },
}

impl Arrival {
    pub fn stages(&self) -> usize {
        match self {
            Arrival::Poisson { qps } => qps.len(),
            Arrival::Concurrency { levels } => levels.len(),
        }
    }
}

/// The workload file. Every field is optional; `Default` below is the single place for defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Workload {
    pub name: String,
    pub seed: u64,
    pub api: Api,
    pub groups: usize,
    pub users_per_group: usize,
    pub system_prompt_tokens: usize,
    pub question_tokens: usize,
    pub output_tokens: usize,
    pub turns: usize,
    pub group_zipf: f64,
    pub unique_fraction: f64,
    pub arrival: Arrival,
    pub stage_duration_s: f64,
    pub session_header: bool,
}

impl Default for Workload {
    fn default() -> Self {
        Workload {
            name: "shared-prefix".into(),
            seed: 42,
            api: Api::Chat,
            groups: 8,
            users_per_group: 4,
            system_prompt_tokens: 1000,
            question_tokens: 100,
            output_tokens: 32,
            turns: 1,
            group_zipf: 0.0,
            unique_fraction: 0.0,
            arrival: Arrival::Poisson { qps: vec![4.0] },
            stage_duration_s: 20.0,
            session_header: true,
        }
    }
}

/// Header carrying the user's id when `session_header` is on (what ring_hash and `session` key on).
pub const SESSION_HEADER: &str = "x-session-id";

impl Workload {
    pub fn from_file(path: &std::path::Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        Self::from_json(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    pub fn from_json(text: &str) -> Result<Self, String> {
        let w: Workload = serde_json::from_str(text).map_err(|e| e.to_string())?;
        w.validate()?;
        Ok(w)
    }

    pub fn validate(&self) -> Result<(), String> {
        if self.groups == 0 || self.users_per_group == 0 || self.turns == 0 {
            return Err("groups, users_per_group and turns must be at least 1".into());
        }
        if !(0.0..=1.0).contains(&self.unique_fraction) || self.group_zipf < 0.0 {
            return Err("unique_fraction must be in [0,1] and group_zipf >= 0".into());
        }
        if self.arrival.stages() == 0 || self.stage_duration_s <= 0.0 {
            return Err("arrival needs at least one stage and stage_duration_s > 0".into());
        }
        Ok(())
    }

    pub fn path(&self) -> &'static str {
        match self.api {
            Api::Chat => "/v1/chat/completions",
            Api::Completions => "/v1/completions",
        }
    }

    /// The requests, naming `model` (the fleet's served model) in each body.
    pub fn stream(&self, model: &str) -> RequestStream {
        RequestStream::new(self.clone(), model.to_string())
    }
}

/// One request to send: its JSON body, and the user it belongs to (for the session header).
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub user: String,
    pub body: Value,
}

/// An endless, deterministic sequence of requests for a workload.
pub struct RequestStream {
    w: Workload,
    model: String,
    rng: ChaCha8Rng,
    /// Cumulative Zipf weights over groups, for picking a group by popularity.
    group_cdf: Vec<f64>,
    /// Per user: the conversation so far (alternating user/assistant turns) and turns taken.
    conversations: Vec<Conversation>,
    unique_count: u64,
}

#[derive(Clone, Default)]
struct Conversation {
    messages: Vec<String>,
    episode: u64,
}

impl RequestStream {
    fn new(w: Workload, model: String) -> Self {
        let weights: Vec<f64> = (1..=w.groups)
            .map(|rank| 1.0 / (rank as f64).powf(w.group_zipf))
            .collect();
        let total: f64 = weights.iter().sum();
        let mut acc = 0.0;
        let group_cdf = weights
            .iter()
            .map(|x| {
                acc += x / total;
                acc
            })
            .collect();
        let users = w.groups * w.users_per_group;
        RequestStream {
            rng: ChaCha8Rng::seed_from_u64(w.seed),
            group_cdf,
            conversations: vec![Conversation::default(); users],
            unique_count: 0,
            w,
            model,
        }
    }

    fn pick_group(&mut self) -> usize {
        let x: f64 = self.rng.random();
        self.group_cdf
            .iter()
            .position(|&c| x < c)
            .unwrap_or(self.w.groups - 1)
    }

    /// The text a system prompt, question or answer is made of: `tokens` words from a seeded RNG.
    fn words(seed: u64, tokens: usize) -> String {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut s = String::with_capacity(tokens * 6);
        for i in 0..tokens {
            if i > 0 {
                s.push(' ');
            }
            s.push_str(WORDS[rng.random_range(0..WORDS.len())]);
        }
        s
    }

    fn system_prompt(&self, group: usize) -> String {
        let seed = self.w.seed ^ 0x5157_0000_0000 ^ (group as u64).wrapping_mul(0x9E37_79B9);
        format!(
            "[doc {group}] {}",
            Self::words(seed, self.w.system_prompt_tokens)
        )
    }

    fn build(&self, system: String, messages: &[String]) -> Value {
        let common = json!({
            "model": self.model,
            "max_tokens": self.w.output_tokens,
            "ignore_eos": true,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        let mut body = common;
        match self.w.api {
            Api::Chat => {
                let mut msgs = vec![json!({"role": "system", "content": system})];
                for (i, m) in messages.iter().enumerate() {
                    let role = if i % 2 == 0 { "user" } else { "assistant" };
                    msgs.push(json!({"role": role, "content": m}));
                }
                body["messages"] = Value::Array(msgs);
            }
            Api::Completions => {
                let mut prompt = system;
                for m in messages {
                    prompt.push('\n');
                    prompt.push_str(m);
                }
                body["prompt"] = Value::String(prompt);
            }
        }
        body
    }
}

impl Iterator for RequestStream {
    type Item = Request;

    fn next(&mut self) -> Option<Request> {
        let unique = self.rng.random::<f64>() < self.w.unique_fraction;
        if unique {
            // A prompt nobody else shares: its own "system prompt" and question.
            self.unique_count += 1;
            let seed: u64 = self.rng.random();
            let system = format!(
                "[unique {}] {}",
                self.unique_count,
                Self::words(seed, self.w.system_prompt_tokens)
            );
            let question = Self::words(seed ^ 1, self.w.question_tokens);
            let user = format!("u-unique-{}", self.unique_count);
            return Some(Request {
                body: self.build(system, &[question]),
                user,
            });
        }
        let group = self.pick_group();
        let member = self.rng.random_range(0..self.w.users_per_group);
        let user_index = group * self.w.users_per_group + member;
        let qseed: u64 = self.rng.random();
        let turns = self.w.turns;
        let conv = &mut self.conversations[user_index];
        if conv.messages.len().div_ceil(2) >= turns {
            // Conversation finished: the user starts a new one on the same system prompt.
            conv.messages.clear();
            conv.episode += 1;
        }
        if !conv.messages.is_empty() {
            // The previous answer, as the client would resend it. It is synthetic (the replica's
            // actual output is not fed back) so that requests do not depend on the router.
            conv.messages
                .push(Self::words(qseed ^ 2, self.w.output_tokens));
        }
        conv.messages
            .push(Self::words(qseed, self.w.question_tokens));
        let messages = conv.messages.clone();
        let user = format!("u{group}-{member}-{}", conv.episode);
        let body = self.build(self.system_prompt(group), &messages);
        Some(Request { user, body })
    }
}

/// Short common words, so a word is about one token for any tokenizer.
const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "for", "on", "with", "as", "by", "at", "from", "that",
    "this", "be", "are", "was", "it", "or", "an", "not", "can", "all", "new", "more", "one",
    "will", "has", "but", "use", "time", "data", "model", "cache", "token", "route", "node",
    "user", "query", "system", "answer", "value", "state", "load", "fleet", "prefix", "block",
    "page", "file", "code", "test", "run", "set", "get", "list", "key", "map", "tree", "hash",
    "path", "host", "port", "line", "word", "text", "note", "part", "step", "plan", "rule", "case",
    "view", "form", "unit", "rate",
];

#[cfg(test)]
mod tests {
    use super::*;

    fn take(w: &Workload, n: usize) -> Vec<Request> {
        w.stream("m").take(n).collect()
    }

    #[test]
    fn same_seed_yields_same_requests() {
        let w = Workload {
            turns: 3,
            unique_fraction: 0.2,
            group_zipf: 1.1,
            ..Workload::default()
        };
        assert_eq!(take(&w, 200), take(&w, 200));
    }

    #[test]
    fn different_seed_yields_different_requests() {
        let a = Workload::default();
        let b = Workload {
            seed: 7,
            ..Workload::default()
        };
        assert_ne!(take(&a, 20), take(&b, 20));
    }

    #[test]
    fn empty_spec_takes_every_default() {
        assert_eq!(Workload::from_json("{}").unwrap(), Workload::default());
    }

    #[test]
    fn unknown_field_is_rejected() {
        assert!(Workload::from_json(r#"{"qps": 3}"#).is_err());
    }

    #[test]
    fn users_of_a_group_share_the_system_prompt() {
        let w = Workload {
            groups: 1,
            users_per_group: 5,
            ..Workload::default()
        };
        let reqs = take(&w, 10);
        let sys = |r: &Request| r.body["messages"][0]["content"].clone();
        assert!(reqs.iter().all(|r| sys(r) == sys(&reqs[0])));
        assert_ne!(reqs[0].body["messages"][1], reqs[1].body["messages"][1]);
    }

    #[test]
    fn each_turn_resends_the_conversation_so_far() {
        let w = Workload {
            groups: 1,
            users_per_group: 1,
            turns: 3,
            ..Workload::default()
        };
        let reqs = take(&w, 4);
        let msgs = |i: usize| reqs[i].body["messages"].as_array().unwrap().clone();
        assert_eq!(msgs(0).len(), 2);
        assert_eq!(msgs(1).len(), 4);
        assert_eq!(msgs(2).len(), 6);
        assert_eq!(msgs(1)[..2], msgs(0)[..]);
        assert_eq!(msgs(2)[..4], msgs(1)[..]);
        // After `turns` turns the user starts over.
        assert_eq!(msgs(3).len(), 2);
        assert_ne!(reqs[3].user, reqs[0].user);
    }

    #[test]
    fn all_unique_prompts_share_nothing() {
        let w = Workload {
            unique_fraction: 1.0,
            ..Workload::default()
        };
        let reqs = take(&w, 5);
        let sys = |r: &Request| r.body["messages"][0]["content"].clone();
        assert_ne!(sys(&reqs[0]), sys(&reqs[1]));
    }

    #[test]
    fn completions_api_sends_one_prompt() {
        let w = Workload {
            api: Api::Completions,
            ..Workload::default()
        };
        let r = take(&w, 1).remove(0);
        assert!(r.body["prompt"].as_str().unwrap().starts_with("[doc "));
        assert!(r.body.get("messages").is_none());
    }
}
