//! Workload spec (JSON) and the deterministic stream of OpenAI requests it describes.
//!
//! A workload is a population of users in groups. Users of one group share a long system prompt
//! (a tenant's instructions, or a popular document for RAG); each request adds the user's question.
//! With `turns > 1` a user's next request resends the whole conversation so far plus a new question.
//! Everything random comes from one seeded RNG, so the same seed yields the same requests.
//!
//! `kind` shapes the messages beyond plain chat:
//! - `agentic`: a group is an app (its system prompt and a tool list of `tools_tokens` words); a
//!   user is a session slot running one task after another, each task `steps_min..=steps_max`
//!   steps, and each step resends the task with every tool call and tool result so far;
//! - `multimodal`: a conversation opens with the group's image and the user's own image
//!   (`image_kb` of base64 each) before the question;
//! - `tenants`: every group (a document) is read by `tenants` tenants, each under its own
//!   `cache_salt`, so no two tenants share a cached block of the same document.

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

/// The shape of the messages (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Chat,
    Agentic,
    Multimodal,
    Tenants,
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
    pub kind: Kind,
    /// Agentic: words of each app's tool list (the JSON around them adds about a third).
    pub tools_tokens: usize,
    /// Agentic: tools in each app's list.
    pub tools_per_app: usize,
    /// Agentic: tool calls per task, at least and at most.
    pub steps_min: usize,
    pub steps_max: usize,
    /// Agentic: words of each tool result.
    pub tool_result_tokens: usize,
    /// Multimodal: KB of base64 per image.
    pub image_kb: usize,
    /// Tenants: tenants (cache salts) reading every document.
    pub tenants: usize,
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
            kind: Kind::Chat,
            tools_tokens: 1500,
            tools_per_app: 8,
            steps_min: 6,
            steps_max: 12,
            tool_result_tokens: 200,
            image_kb: 48,
            tenants: 4,
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
        if self.steps_min == 0 || self.steps_min > self.steps_max {
            return Err("steps_min must be at least 1 and at most steps_max".into());
        }
        if self.tenants == 0 || self.tools_per_app == 0 || self.image_kb == 0 {
            return Err("tenants, tools_per_app and image_kb must be at least 1".into());
        }
        if self.kind != Kind::Chat && self.api != Api::Chat {
            return Err(format!("kind {:?} needs api \"chat\"", self.kind));
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
    messages: Vec<Value>,
    episode: u64,
    /// Agentic: the task's seed, its steps taken and its length.
    seed: u64,
    steps: usize,
    target: usize,
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
        let tenants = if w.kind == Kind::Tenants {
            w.tenants
        } else {
            1
        };
        let users = w.groups * tenants * w.users_per_group;
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

    fn build(&self, system: String, messages: &[Value]) -> Value {
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
                msgs.extend(messages.iter().cloned());
                body["messages"] = Value::Array(msgs);
            }
            Api::Completions => {
                let mut prompt = system;
                for m in messages {
                    prompt.push('\n');
                    prompt.push_str(m["content"].as_str().unwrap_or(""));
                }
                body["prompt"] = Value::String(prompt);
            }
        }
        body
    }

    /// The next step of one of an app's sessions.
    fn agentic(&mut self) -> Request {
        let app = self.pick_group();
        let slot = self.rng.random_range(0..self.w.users_per_group);
        let (steps_min, steps_max) = (self.w.steps_min, self.w.steps_max);
        let fresh_seed: u64 = self.rng.random();
        let fresh_target = self.rng.random_range(steps_min..=steps_max);
        let conv = &mut self.conversations[app * self.w.users_per_group + slot];
        if conv.target == 0 || conv.steps > conv.target {
            // Task done (or none yet): the slot starts the next one.
            if conv.target != 0 {
                conv.episode += 1;
            }
            (conv.seed, conv.target, conv.steps) = (fresh_seed, fresh_target, 0);
        }
        let (seed, steps, episode) = (conv.seed, conv.steps, conv.episode);
        conv.steps += 1;
        let mut messages = vec![json!({"role": "user",
            "content": Self::words(seed, self.w.question_tokens)})];
        for step in 0..steps {
            let id = format!("call_{:x}_{step}", seed & 0xffff_ffff);
            let s = seed ^ (step as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            let tool = (s % self.w.tools_per_app as u64) as usize;
            let args = json!({"query": Self::words(s ^ 3, 8)}).to_string();
            messages.push(json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": id, "type": "function",
                 "function": {"name": format!("app{app}_tool{tool}"), "arguments": args}}]}));
            messages.push(json!({"role": "tool", "tool_call_id": id,
                "content": Self::words(s ^ 4, self.w.tool_result_tokens)}));
        }
        let mut body = self.build(self.system_prompt(app), &messages);
        body["tools"] = self.tools(app);
        Request {
            user: format!("a{app}-{slot}-{episode}"),
            body,
        }
    }

    /// An app's tool list: `tools_per_app` functions whose descriptions share `tools_tokens` words.
    fn tools(&self, app: usize) -> Value {
        let n = self.w.tools_per_app;
        let tools = (0..n)
            .map(|t| {
                let seed = self.w.seed ^ 0x7001_0000_0000 ^ ((app * 1000 + t) as u64);
                json!({"type": "function", "function": {
                    "name": format!("app{app}_tool{t}"),
                    "description": Self::words(seed, self.w.tools_tokens / n),
                    "parameters": {"type": "object",
                        "properties": {"query": {"type": "string", "description": "what to look up"}},
                        "required": ["query"]}}})
            })
            .collect();
        Value::Array(tools)
    }

    /// `image_kb` KB of base64 from `seed`, as a data URL.
    fn image(&self, seed: u64) -> Value {
        const B64: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let data: String = (0..self.w.image_kb * 1024)
            .map(|_| B64[rng.random_range(0..B64.len())] as char)
            .collect();
        json!({"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{data}")}})
    }
}

impl Iterator for RequestStream {
    type Item = Request;

    fn next(&mut self) -> Option<Request> {
        if self.w.kind == Kind::Agentic {
            return Some(self.agentic());
        }
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
                body: self.build(system, &[json!({"role": "user", "content": question})]),
                user,
            });
        }
        let group = self.pick_group();
        let member = self.rng.random_range(0..self.w.users_per_group);
        let tenant = match self.w.kind {
            Kind::Tenants => self.rng.random_range(0..self.w.tenants),
            _ => 0,
        };
        let tenants = if self.w.kind == Kind::Tenants {
            self.w.tenants
        } else {
            1
        };
        let user_index = (group * tenants + tenant) * self.w.users_per_group + member;
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
            let answer = Self::words(qseed ^ 2, self.w.output_tokens);
            conv.messages
                .push(json!({"role": "assistant", "content": answer}));
        }
        let question = Self::words(qseed, self.w.question_tokens);
        let opening = conv.messages.is_empty();
        let episode = conv.episode;
        let content = match self.w.kind {
            Kind::Multimodal if opening => {
                let own = self.w.seed ^ (user_index as u64) << 20 ^ episode;
                json!([
                    {"type": "text", "text": format!("Item {group}:")},
                    self.image(self.w.seed ^ 0x1a9e_0000 ^ group as u64),
                    {"type": "text", "text": "Mine:"},
                    self.image(own.wrapping_mul(0x9E37_79B9_7F4A_7C15)),
                    {"type": "text", "text": question},
                ])
            }
            _ => Value::String(question),
        };
        let conv = &mut self.conversations[user_index];
        conv.messages
            .push(json!({"role": "user", "content": content}));
        let messages = conv.messages.clone();
        let mut body = self.build(self.system_prompt(group), &messages);
        let user = match self.w.kind {
            Kind::Tenants => {
                body["cache_salt"] = json!(format!("tenant-{tenant}"));
                format!("u{group}-t{tenant}-{member}-{episode}")
            }
            _ => format!("u{group}-{member}-{episode}"),
        };
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

    #[test]
    fn agentic_sessions_grow_step_by_step_then_start_a_new_task() {
        let w = Workload {
            kind: Kind::Agentic,
            groups: 1,
            users_per_group: 1,
            steps_min: 2,
            steps_max: 2,
            ..Workload::default()
        };
        let reqs = take(&w, 4);
        let msgs = |i: usize| reqs[i].body["messages"].as_array().unwrap().clone();
        assert_eq!(msgs(0).len(), 2, "system and task");
        assert_eq!(msgs(1).len(), 4);
        assert_eq!(msgs(2).len(), 6);
        assert_eq!(
            msgs(2)[..4],
            msgs(1)[..],
            "each step resends the steps so far"
        );
        assert_eq!(
            msgs(2)[2]["tool_calls"][0]["function"]["name"]
                .as_str()
                .map(|n| n.starts_with("app0_tool")),
            Some(true)
        );
        assert_eq!(msgs(2)[3]["role"], "tool");
        assert_eq!(
            msgs(3).len(),
            2,
            "after its steps the session starts a new task"
        );
        assert_ne!(msgs(3)[1], msgs(0)[1]);
        assert_ne!(reqs[3].user, reqs[0].user);
        let tools = reqs[0].body["tools"].to_string();
        assert!(
            tools.len() > 6000,
            "a tool list of several KB: {}",
            tools.len()
        );
        assert!(reqs
            .iter()
            .all(|r| r.body["tools"] == reqs[0].body["tools"]));
    }

    #[test]
    fn multimodal_conversations_open_with_the_groups_and_the_users_image() {
        let w = Workload {
            kind: Kind::Multimodal,
            groups: 1,
            users_per_group: 2,
            turns: 2,
            image_kb: 1,
            ..Workload::default()
        };
        let reqs = take(&w, 6);
        let images = |r: &Request| -> Vec<String> {
            r.body["messages"][1]["content"]
                .as_array()
                .unwrap()
                .iter()
                .filter_map(|p| p["image_url"]["url"].as_str().map(str::to_string))
                .collect()
        };
        let (a, b) = (images(&reqs[0]), images(&reqs[1]));
        assert_eq!(a.len(), 2);
        assert!(a[0].len() > 1024);
        assert_eq!(a[0], b[0], "the group's image is shared");
        let same_user = reqs.iter().filter(|r| r.user == reqs[0].user).count();
        assert!(same_user >= 1);
        let other_user = reqs
            .iter()
            .find(|r| r.user != reqs[0].user && images(r).len() == 2);
        assert_ne!(
            images(other_user.unwrap())[1],
            a[1],
            "each user has an image of their own"
        );
    }

    #[test]
    fn tenants_read_the_same_documents_under_their_own_salt() {
        let w = Workload {
            kind: Kind::Tenants,
            groups: 1,
            tenants: 3,
            ..Workload::default()
        };
        let reqs = take(&w, 30);
        let salts: std::collections::HashSet<_> =
            reqs.iter().map(|r| r.body["cache_salt"].clone()).collect();
        assert_eq!(salts.len(), 3);
        assert!(reqs
            .iter()
            .all(|r| r.body["messages"][0] == reqs[0].body["messages"][0]));
        assert!(reqs.iter().all(|r| r.user.contains(&format!(
            "-{}-",
            r.body["cache_salt"]
                .as_str()
                .unwrap()
                .replace("tenant-", "t")
        ))));
    }

    #[test]
    fn shaped_kinds_need_the_chat_api_and_sane_steps() {
        assert!(Workload::from_json(r#"{"kind":"agentic","api":"completions"}"#).is_err());
        assert!(Workload::from_json(r#"{"kind":"agentic","steps_min":5,"steps_max":4}"#).is_err());
        assert!(Workload::from_json(r#"{"kind":"tenants","tenants":0}"#).is_err());
    }
}
