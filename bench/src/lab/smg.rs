//! An in-process model of SGLang Model Gateway's `cache_aware` policy over HTTP workers.
//!
//! What it models is smg 1.13.0, the version PyPI serves as `smg` (read from its source
//! distribution: `model_gateway/src/policies/cache_aware.rs`, `policies/least_load.rs`,
//! `crates/kv_index/src/string_tree.rs`, `crates/protocols/src/{chat,completion}.rs` and the
//! launcher's defaults in `src/smg/router_args.py`), run as the wall-clock bench runs it:
//! `python -m smg launch --policy cache_aware --backend vllm` with default settings.
//!
//! - **Defaults**: `cache_threshold` 0.3, `balance_abs_threshold` 64, `balance_rel_threshold`
//!   1.5, eviction every 60 s (the launcher's `eviction_interval_secs`, where the bare Rust
//!   binary says 120; the first pass one interval after start), `max_tree_size` 2^26
//!   characters. The KV-usage triggers
//!   (`balance_token_usage_threshold`, `overload_token_usage_threshold`) default to 1.0, off.
//! - **Routing text**: for `/v1/chat/completions` the text of the messages in order, each
//!   message's text parts joined by a space and the messages joined by a space, an assistant's
//!   `reasoning_content` after its content; for `/v1/completions` the `prompt`, an array of
//!   prompts joined by a space. Never the raw JSON. A request with a `cache_salt` keys under
//!   its namespace: the text follows a marker of the salt, so requests of different salts
//!   never match each other (smg's `cache_namespace.rs`; the marker's few characters count in
//!   the match rate here, where smg leaves them out). See [`routing_text`].
//! - **Tree**: one radix tree per model shared by all workers; each node lists the workers
//!   ("tenants") it was inserted for, with a last-access stamp. The unit is the character
//!   (Unicode scalar), not the token. A lookup walks the text down the tree; the matched length
//!   counts the characters shared with a node it ends inside, and the matched node's tenants
//!   (at most 8) are the holders.
//! - **Match rate**: matched characters / text characters (0 for an empty text). Strictly
//!   above `cache_threshold` the holders are the candidates; otherwise the request is a miss.
//! - **Load**: the gateway's own in-flight count per worker, incremented when a request is
//!   dispatched to it and decremented when its response (the whole stream) ends.
//! - **Engine reports**: every 10 s smg reads each worker's `/metrics` (running and waiting
//!   requests, KV usage; see [`Smg::report`]). Overload protection, on by default, leaves out
//!   of routing a worker that reported 8 or more waiting requests or 0.8 KV usage; when every
//!   worker is out the request goes to the fewest in flight, without the policy or its tree.
//! - **Spill gate** (smg 1.10 on; before, the two thresholds switched the whole fleet to the
//!   shortest queue): with `mean` the in-flight mean over the eligible workers, a worker is hot
//!   when its load exceeds both `balance_rel_threshold × mean` and `mean + margin`, where
//!   `margin` is `min(balance_abs_threshold, max(ceil(2·sqrt(mean)), 4))`. A hit goes to the
//!   holder with the least expected wait among those not hot; when every holder is hot it
//!   spills to the least expected wait among the workers not hot (any eligible worker when all
//!   are). A miss goes to the least expected wait among the eligible workers.
//! - **Expected wait** (the `least_load` scorer, at its defaults): for a reporting worker
//!   `1024 · max(in flight, running + waiting + requests sent since the report) / 2000` seconds
//!   plus `0.15 · k / (1 − k)` for KV usage `k`; a worker without a report, beside reporting
//!   ones, scores as the best of those plus `1024 · in flight / 2000`; with no report among the
//!   candidates the score is the in-flight count. smg breaks scores within 1e-6 uniformly at
//!   random (a reservoir draw over the candidates in worker order); this model draws from a
//!   seeded generator, so a run is reproducible.
//! - **Insertion**: the text is inserted for the chosen worker, hit, spill or miss alike: the
//!   worker joins every node on the matched path (stamp 0 where it was absent) and gets a
//!   fresh stamp on the node where the text ends, splitting an edge where the text leaves it.
//!   A worker's size is the characters of the nodes it is on.
//! - **Eviction**: when the total of all workers' sizes exceeds `max_tree_size`, (worker,
//!   node) pairs where the node is that worker's leaf are removed oldest stamp first, a parent
//!   becoming a leaf in turn, until the total is within the budget; a node left with no worker
//!   and no child is dropped.
//!
//! Left out: the 1-in-8 sampled re-stamp of a matched node during lookup, the order in which
//! smg lists a node's holders (here by worker index), the partitions of `extra_key` and LoRA,
//! and health, circuit breaking and the liveness veto (every worker is healthy).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::Value;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// Match rate a hit must exceed.
const CACHE_THRESHOLD: f32 = 0.3;
/// Most requests above the fleet mean a worker may hold before it is hot.
const BALANCE_ABS_THRESHOLD: f64 = 64.0;
/// Multiple of the fleet mean a worker must exceed to be hot.
const BALANCE_REL_THRESHOLD: f32 = 1.5;
/// Floor of the hot margin above the mean when the configured one is at least this.
const MIN_ABSOLUTE_MARGIN: f64 = 4.0;
/// Interval between eviction passes.
const EVICTION_INTERVAL_MS: u64 = 60_000;
/// Budget of the tree, in characters summed over workers.
const MAX_TREE_SIZE: usize = 1 << 26;
/// Most holders a lookup returns.
const MATCHED_TENANTS_CAP: usize = 8;
/// Interval between smg's polls of each worker's `/metrics`.
pub const POLL_INTERVAL_MS: u64 = 10_000;
/// Waiting requests at or above which a worker is left out of routing.
const OVERLOAD_WAITING: u32 = 8;
/// KV usage at or above which a worker is left out of routing.
const OVERLOAD_KV_USAGE: f64 = 0.8;
/// Tokens the expected-wait score counts per request (smg's mean prefill guess over HTTP).
const MEAN_PREFILL_TOKENS: f64 = 1024.0;
/// Tokens per second the score drains them at (vLLM's gauges report no throughput).
const DEFAULT_THROUGHPUT: f64 = 2000.0;
/// Seconds of the KV-usage penalty `w · k / (1 − k)`.
const KV_PRESSURE_WEIGHT: f64 = 0.15;
/// Scores this close are equal.
const TIE_EPSILON: f64 = 1e-6;

/// A worker's load as smg reads it from that worker's `/metrics` at a poll.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Report {
    /// `vllm:num_requests_running`.
    pub running: u32,
    /// `vllm:num_requests_waiting`.
    pub waiting: u32,
    /// `vllm:kv_cache_usage_perc`, a fraction.
    pub kv_usage: f64,
}

/// One instance of the gateway in front of `workers` endpoints, numbered from 0.
pub struct Smg {
    tree: Tree,
    in_flight: Vec<usize>,
    /// Each worker's last report, if any.
    reports: Vec<Option<Report>>,
    /// Requests sent to each worker since its last report.
    since_poll: Vec<usize>,
    rng: ChaCha8Rng,
    max_tree_size: usize,
    next_eviction_ms: u64,
}

impl Smg {
    /// smg's defaults over `workers` (at least one) endpoints; `seed` drives the tie draws.
    pub fn new(workers: usize, seed: u64) -> Smg {
        Smg::with_budget(workers, seed, MAX_TREE_SIZE)
    }

    fn with_budget(workers: usize, seed: u64, max_tree_size: usize) -> Smg {
        assert!(workers > 0, "smg needs at least one worker");
        Smg {
            tree: Tree::new(workers),
            in_flight: vec![0; workers],
            reports: vec![None; workers],
            since_poll: vec![0; workers],
            rng: ChaCha8Rng::seed_from_u64(seed),
            max_tree_size,
            next_eviction_ms: EVICTION_INTERVAL_MS,
        }
    }

    /// Picks the worker for a request whose routing text is `text`, at virtual time `now_ms`
    /// (which runs the eviction passes due by then), and counts it in flight there.
    pub fn pick(&mut self, text: &str, now_ms: u64) -> usize {
        if now_ms >= self.next_eviction_ms {
            self.tree.evict(self.max_tree_size);
            self.next_eviction_ms = (now_ms / EVICTION_INTERVAL_MS + 1) * EVICTION_INTERVAL_MS;
        }
        let everyone: Vec<usize> = (0..self.in_flight.len()).collect();
        let eligible: Vec<usize> = everyone
            .iter()
            .copied()
            .filter(|&w| !self.reports[w].as_ref().is_some_and(overloaded))
            .collect();
        if eligible.is_empty() {
            // Every worker overloaded: the router steers to the fewest in flight, past the policy.
            let in_flight: Vec<f64> = self.in_flight.iter().map(|&n| n as f64).collect();
            let chosen = self.draw_least(&everyone, &in_flight);
            self.in_flight[chosen] += 1;
            return chosen;
        }
        let load: usize = eligible.iter().map(|&w| self.in_flight[w]).sum();
        let mean = load as f64 / eligible.len() as f64;
        let found = self.tree.find(text);
        let rate = if found.input == 0 {
            0.0
        } else {
            found.matched as f32 / found.input as f32
        };
        let chosen = if rate > CACHE_THRESHOLD {
            let holders: Vec<usize> = (self.tree.holders(found.node()).into_iter())
                .filter(|w| eligible.contains(w))
                .collect();
            let safe = self.cool(&holders, mean);
            if safe.is_empty() && !holders.is_empty() {
                let cool = self.cool(&eligible, mean);
                self.least_loaded(if cool.is_empty() { &eligible } else { &cool })
            } else if safe.is_empty() {
                self.least_loaded(&eligible)
            } else {
                self.least_loaded(&safe)
            }
        } else {
            self.least_loaded(&eligible)
        };
        self.tree.insert(text, &found, chosen);
        self.in_flight[chosen] += 1;
        chosen
    }

    /// smg polled `worker`'s `/metrics` and read `report`: it scores the worker's expected
    /// wait from it, drops the credit for requests sent since the previous poll, and leaves the
    /// worker out of routing while it is overloaded (8 waiting requests or 0.8 KV usage) and
    /// another is not. Call it every [`POLL_INTERVAL_MS`] per worker; without reports smg (and
    /// this model) compares in-flight counts.
    pub fn report(&mut self, worker: usize, report: Report) {
        if let Some(slot) = self.reports.get_mut(worker) {
            *slot = Some(report);
            self.since_poll[worker] = 0;
        }
    }

    /// The request sent to `worker` finished: its in-flight count goes down.
    pub fn done(&mut self, worker: usize) {
        if let Some(n) = self.in_flight.get_mut(worker) {
            *n = n.saturating_sub(1);
        }
    }

    /// Those of `workers` under the spill gate at fleet mean `mean`: a worker is over it
    /// when its load exceeds both the relative and the absolute margin above the mean.
    fn cool(&self, workers: &[usize], mean: f64) -> Vec<usize> {
        let swing = (2.0 * mean.sqrt()).ceil();
        let margin = BALANCE_ABS_THRESHOLD.min(swing.max(MIN_ABSOLUTE_MARGIN));
        let hot =
            |load: f64| load > mean * f64::from(BALANCE_REL_THRESHOLD) && load > mean + margin;
        workers
            .iter()
            .copied()
            .filter(|&w| !hot(self.in_flight[w] as f64))
            .collect()
    }

    /// The candidate with the least expected wait, equal ones drawn uniformly; it is credited
    /// with the request until its next report. A reporting worker waits
    /// `p · max(in flight, running + waiting + sent since the report) / throughput` plus the KV
    /// penalty; one without a report, beside reporting ones, the best of those plus its in-flight
    /// work; with no report among the candidates the wait is the in-flight count.
    fn least_loaded(&mut self, candidates: &[usize]) -> usize {
        let wait = |w: usize, report: &Report| {
            let reported = (report.running + report.waiting) as usize + self.since_poll[w];
            let work = self.in_flight[w].max(reported) as f64 * MEAN_PREFILL_TOKENS;
            let k = report.kv_usage.clamp(0.0, 0.999);
            work / DEFAULT_THROUGHPUT + KV_PRESSURE_WEIGHT * k / (1.0 - k)
        };
        let known: Vec<Option<f64>> = candidates
            .iter()
            .map(|&w| self.reports[w].as_ref().map(|r| wait(w, r)))
            .collect();
        let best_known = known
            .iter()
            .flatten()
            .copied()
            .fold(f64::INFINITY, f64::min);
        let scores: Vec<f64> = candidates
            .iter()
            .zip(&known)
            .map(|(&w, score)| match score {
                Some(score) => *score,
                None if best_known.is_finite() => {
                    best_known + self.in_flight[w] as f64 * MEAN_PREFILL_TOKENS / DEFAULT_THROUGHPUT
                }
                None => self.in_flight[w] as f64,
            })
            .collect();
        let chosen = self.draw_least(candidates, &scores);
        self.since_poll[chosen] += 1;
        chosen
    }

    /// The candidate with the lowest of `scores` (one per candidate), equal ones drawn
    /// uniformly as smg's reservoir draw does.
    fn draw_least(&mut self, candidates: &[usize], scores: &[f64]) -> usize {
        let (mut best, mut best_score) = (0, scores[0]);
        let mut tied = 1u32;
        for (i, &score) in scores.iter().enumerate().skip(1) {
            if score < best_score - TIE_EPSILON {
                (best, best_score, tied) = (i, score, 1);
            } else if (score - best_score).abs() <= TIE_EPSILON {
                tied += 1;
                best_score = best_score.min(score);
                if self.rng.random_range(0..tied) == 0 {
                    best = i;
                }
            }
        }
        candidates[best]
    }
}

/// Whether smg's overload protection leaves a worker with this report out of routing.
fn overloaded(report: &Report) -> bool {
    report.waiting >= OVERLOAD_WAITING || report.kv_usage >= OVERLOAD_KV_USAGE
}

/// The text smg routes a request by, from its OpenAI JSON body: a chat request's messages
/// (text parts of a content array joined by a space, an assistant's `reasoning_content` after
/// its content, messages joined by a space, empty texts skipped), or a completion's `prompt`
/// (an array joined by a space); empty for anything else.
pub fn routing_text(body: &Value) -> String {
    let text = unsalted_text(body);
    match body.get("cache_salt").and_then(Value::as_str) {
        Some(salt) => format!("\u{0}{salt}\u{0}{text}"),
        None => text,
    }
}

/// The request's text, before its namespace.
fn unsalted_text(body: &Value) -> String {
    if let Some(messages) = body.get("messages").and_then(Value::as_array) {
        let mut out = String::new();
        let mut any = false;
        for message in messages {
            let reasoning = match message.get("role").and_then(Value::as_str) {
                Some("assistant") => message.get("reasoning_content"),
                _ => None,
            };
            for piece in [message.get("content"), reasoning].into_iter().flatten() {
                let parts = content_texts(piece);
                if parts.is_empty() {
                    continue;
                }
                if any {
                    out.push(' ');
                }
                out.push_str(&parts.join(" "));
                any = true;
            }
        }
        return out;
    }
    match body.get("prompt") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(items)) => {
            let prompts: Vec<&str> = items.iter().filter_map(Value::as_str).collect();
            prompts.join(" ")
        }
        _ => String::new(),
    }
}

/// The non-empty texts of a message content: the string itself, or the `text` parts of an array.
fn content_texts(content: &Value) -> Vec<&str> {
    match content {
        Value::String(s) if !s.is_empty() => vec![s.as_str()],
        Value::Array(parts) => parts
            .iter()
            .filter(|p| p.get("type").and_then(Value::as_str) == Some("text"))
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .filter(|t| !t.is_empty())
            .collect(),
        _ => Vec::new(),
    }
}

/// The root's index in the arena.
const ROOT: usize = 0;

/// One node of the radix tree: the edge text leading to it and the workers holding it.
struct Node {
    label: String,
    chars: usize,
    parent: usize,
    children: HashMap<char, usize>,
    /// Per worker, its last-access stamp when it holds this node.
    stamps: Vec<Option<u64>>,
    live: bool,
}

/// Where a lookup ended.
struct Found {
    /// Nodes whose whole edge the text matched, from the top.
    path: Vec<usize>,
    /// The child the match ended inside, if it ended inside an edge.
    partial: Option<usize>,
    /// Characters matched, including those shared with `partial`.
    matched: usize,
    /// Characters in the text.
    input: usize,
    /// Byte offset of the text after the fully matched nodes.
    rest: usize,
}

impl Found {
    /// The node the match resolves on: the partial child, else the deepest full match.
    fn node(&self) -> usize {
        self.partial.or(self.path.last().copied()).unwrap_or(ROOT)
    }
}

/// smg's approximate tree: one radix tree over characters shared by all workers.
struct Tree {
    nodes: Vec<Node>,
    free: Vec<usize>,
    /// Characters each worker holds.
    held: Vec<usize>,
    epoch: u64,
}

impl Tree {
    fn new(workers: usize) -> Tree {
        let root = Node {
            label: String::new(),
            chars: 0,
            parent: ROOT,
            children: HashMap::new(),
            stamps: vec![None; workers],
            live: true,
        };
        Tree {
            nodes: vec![root],
            free: Vec::new(),
            held: vec![0; workers],
            epoch: 0,
        }
    }

    fn total(&self) -> usize {
        self.held.iter().sum()
    }

    fn tick(&mut self) -> u64 {
        self.epoch += 1;
        self.epoch
    }

    fn find(&self, text: &str) -> Found {
        let (mut at, mut pos, mut matched) = (ROOT, 0, 0);
        let mut path = Vec::new();
        let mut partial = None;
        while let Some(c) = text[pos..].chars().next() {
            let Some(&child) = self.nodes[at].children.get(&c) else {
                break;
            };
            let node = &self.nodes[child];
            let (chars, bytes) = shared_prefix(&text[pos..], &node.label);
            matched += chars;
            if bytes < node.label.len() {
                partial = Some(child);
                break;
            }
            pos += bytes;
            path.push(child);
            at = child;
        }
        let full: usize = path.iter().map(|&n| self.nodes[n].chars).sum();
        let input = full + text[pos..].chars().count();
        Found {
            path,
            partial,
            matched,
            input,
            rest: pos,
        }
    }

    /// The workers holding `node`, at most [`MATCHED_TENANTS_CAP`], lowest index first.
    fn holders(&self, node: usize) -> Vec<usize> {
        if node == ROOT {
            return Vec::new();
        }
        let stamps = &self.nodes[node].stamps;
        (0..stamps.len())
            .filter(|&w| stamps[w].is_some())
            .take(MATCHED_TENANTS_CAP)
            .collect()
    }

    /// Puts `worker` on `node` with stamp 0 unless it is there, counting the node's characters.
    fn attach(&mut self, node: usize, worker: usize) {
        let n = &mut self.nodes[node];
        if n.stamps[worker].is_none() {
            n.stamps[worker] = Some(0);
            self.held[worker] += n.chars;
        }
    }

    fn alloc(&mut self, label: String, parent: usize) -> usize {
        let workers = self.held.len();
        let node = Node {
            chars: label.chars().count(),
            label,
            parent,
            children: HashMap::new(),
            stamps: vec![None; workers],
            live: true,
        };
        match self.free.pop() {
            Some(id) => {
                self.nodes[id] = node;
                id
            }
            None => {
                self.nodes.push(node);
                self.nodes.len() - 1
            }
        }
    }

    /// Inserts `text` for `worker`, reusing the lookup `found` made of it.
    fn insert(&mut self, text: &str, found: &Found, worker: usize) {
        for &node in &found.path {
            self.attach(node, worker);
        }
        let mut at = found.path.last().copied().unwrap_or(ROOT);
        let mut rest = &text[found.rest..];
        while let Some(c) = rest.chars().next() {
            let Some(&child) = self.nodes[at].children.get(&c) else {
                let stamp = self.tick();
                let leaf = self.alloc(rest.to_string(), at);
                self.nodes[leaf].stamps[worker] = Some(stamp);
                self.held[worker] += self.nodes[leaf].chars;
                self.nodes[at].children.insert(c, leaf);
                return;
            };
            let (chars, bytes) = shared_prefix(rest, &self.nodes[child].label);
            let next = if bytes < self.nodes[child].label.len() {
                self.split(at, child, chars, bytes)
            } else {
                child
            };
            self.attach(next, worker);
            at = next;
            rest = &rest[bytes..];
        }
        let stamp = self.tick();
        self.nodes[at].stamps[worker] = Some(stamp);
    }

    /// Cuts `child`'s edge after `bytes` (`chars` characters): a new node takes the head and
    /// `child`'s holders, `child` keeps the tail below it. Returns the new node.
    fn split(&mut self, parent: usize, child: usize, chars: usize, bytes: usize) -> usize {
        let tail = self.nodes[child].label.split_off(bytes);
        let head = std::mem::replace(&mut self.nodes[child].label, tail);
        let first = head.chars().next();
        let tail_first = self.nodes[child].label.chars().next();
        self.nodes[child].chars -= chars;
        let stamps = self.nodes[child].stamps.clone();
        let mid = self.alloc(head, parent);
        self.nodes[mid].stamps = stamps;
        self.nodes[child].parent = mid;
        if let (Some(first), Some(tail_first)) = (first, tail_first) {
            self.nodes[mid].children.insert(tail_first, child);
            self.nodes[parent].children.insert(first, mid);
        }
        mid
    }

    /// Whether `worker` holds `node` and no child of it.
    fn is_leaf_of(&self, node: usize, worker: usize) -> bool {
        let n = &self.nodes[node];
        n.live
            && n.stamps[worker].is_some()
            && !n
                .children
                .values()
                .any(|&c| self.nodes[c].stamps[worker].is_some())
    }

    /// Removes workers' leaves, oldest stamp first, until the total is within `max`.
    fn evict(&mut self, max: usize) {
        if self.total() <= max {
            return;
        }
        let workers = self.held.len();
        let mut heap = BinaryHeap::new();
        for node in 1..self.nodes.len() {
            for w in 0..workers {
                if self.is_leaf_of(node, w) {
                    if let Some(stamp) = self.nodes[node].stamps[w] {
                        heap.push(Reverse((stamp, node, w)));
                    }
                }
            }
        }
        while self.total() > max {
            let Some(Reverse((_, node, w))) = heap.pop() else {
                break;
            };
            if node == ROOT || !self.is_leaf_of(node, w) {
                continue;
            }
            self.held[w] -= self.nodes[node].chars;
            self.nodes[node].stamps[w] = None;
            let n = &self.nodes[node];
            let parent = n.parent;
            if n.children.is_empty() && n.stamps.iter().all(Option::is_none) {
                if let Some(first) = n.label.chars().next() {
                    self.nodes[parent].children.remove(&first);
                }
                let n = &mut self.nodes[node];
                n.live = false;
                n.label = String::new();
                self.free.push(node);
            }
            if parent != ROOT && self.is_leaf_of(parent, w) {
                if let Some(stamp) = self.nodes[parent].stamps[w] {
                    heap.push(Reverse((stamp, parent, w)));
                }
            }
        }
    }
}

/// Characters and bytes `a` and `b` share at their start.
fn shared_prefix(a: &str, b: &str) -> (usize, usize) {
    let mut bytes = a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count();
    while !a.is_char_boundary(bytes) {
        bytes -= 1;
    }
    let chars = if a.is_ascii() {
        bytes
    } else {
        a[..bytes].chars().count()
    };
    (chars, bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A text of `len` characters that shares nothing with another `tag`'s.
    fn text(tag: char, len: usize) -> String {
        tag.to_string().repeat(len)
    }

    #[test]
    fn the_same_prefix_goes_to_the_same_worker() {
        let mut smg = Smg::new(4, 7);
        let system = format!("You are a helpful assistant. {}", text('s', 2000));
        let first = smg.pick(&format!("{system} Question one?"), 0);
        smg.done(first);
        for (i, q) in ["Question two?", "And a third, rather longer, question?"]
            .iter()
            .enumerate()
        {
            let w = smg.pick(&format!("{system} {q}"), 1000 * (i as u64 + 1));
            assert_eq!(w, first);
            smg.done(w);
        }
    }

    #[test]
    fn a_miss_goes_to_the_least_loaded_worker_not_the_smallest_tree() {
        let mut smg = Smg::new(3, 1);
        let big = text('a', 5000);
        smg.tree.insert(&big, &smg.tree.find(&big), 1);
        smg.tree.insert("bbbb", &smg.tree.find("bbbb"), 0);
        // Worker 1 holds the biggest tree and the fewest requests, worker 2 the smallest tree.
        smg.in_flight = vec![1, 0, 2];
        // 10 of 100 characters match worker 1's text: a miss, which goes by load.
        let miss = format!("{}{}", text('a', 10), text('z', 90));
        assert_eq!(smg.pick(&miss, 10), 1);
        // Just over the threshold it is a hit on the holder although another is less loaded.
        smg.in_flight = vec![0, 3, 0];
        let hit = format!("{}{}", text('a', 31), text('y', 69));
        assert_eq!(smg.pick(&hit, 20), 1);
        // At the threshold it is a miss again.
        let edge = format!("{}{}", text('a', 30), text('x', 70));
        assert_eq!(smg.pick(&edge, 30), 0);
    }

    #[test]
    fn a_hot_holder_spills_to_the_least_loaded_worker() {
        let mut smg = Smg::new(2, 3);
        let prompt = text('p', 500);
        let home = smg.pick(&prompt, 0);
        // The holder takes every copy until it holds 11 of the fleet's 11 (mean 5.5, margin 5).
        for _ in 1..11 {
            assert_eq!(smg.pick(&prompt, 0), home);
        }
        let other = smg.pick(&prompt, 0);
        assert_ne!(other, home);
        // The spill target now holds the prefix too, and is the cool holder.
        assert_eq!(smg.tree.holders(smg.tree.find(&prompt).node()).len(), 2);
        assert_eq!(smg.pick(&prompt, 0), other);
        // Once the load evens out the request goes back by load among both holders.
        for _ in 0..11 {
            smg.done(home);
        }
        assert_eq!(smg.pick(&prompt, 0), home);
    }

    fn idle() -> Report {
        Report {
            running: 0,
            waiting: 0,
            kv_usage: 0.0,
        }
    }

    #[test]
    fn reports_price_the_wait_and_credit_sends_until_the_next_poll() {
        let mut smg = Smg::new(3, 4);
        for w in 0..3 {
            smg.report(w, idle());
        }
        // Worker 0 runs requests from elsewhere; worker 1 is fuller of KV.
        smg.report(
            0,
            Report {
                running: 2,
                ..idle()
            },
        );
        smg.report(
            1,
            Report {
                kv_usage: 0.5,
                ..idle()
            },
        );
        assert_eq!(smg.pick(&text('a', 100), 0), 2);
        smg.done(2);
        // Worker 2's send is credited though it finished: 0.512 s against worker 1's 0.15 s.
        assert_eq!(smg.pick(&text('b', 100), 0), 1);
        smg.done(1);
        // A poll clears the credit.
        smg.report(
            1,
            Report {
                kv_usage: 0.5,
                ..idle()
            },
        );
        smg.report(2, idle());
        assert_eq!(smg.pick(&text('c', 100), 0), 2);
    }

    #[test]
    fn overloaded_workers_are_left_out_until_all_are() {
        let mut smg = Smg::new(2, 8);
        let prompt = text('p', 300);
        let home = smg.pick(&prompt, 0);
        smg.done(home);
        let other = 1 - home;
        smg.report(
            home,
            Report {
                waiting: 8,
                ..idle()
            },
        );
        smg.report(other, idle());
        assert_eq!(smg.pick(&prompt, 0), other);
        smg.report(
            other,
            Report {
                kv_usage: 0.8,
                ..idle()
            },
        );
        // Both out: the fewest in flight, and the tree does not learn the request.
        assert_eq!(smg.pick(&text('q', 300), 0), home);
        assert_eq!(smg.tree.find(&text('q', 300)).matched, 0);
        smg.report(home, idle());
        assert_eq!(smg.pick(&prompt, 0), home);
    }

    #[test]
    fn eviction_bounds_the_tree_and_keeps_the_recent() {
        let budget = 1_000;
        let mut smg = Smg::with_budget(3, 5, budget);
        let tags: Vec<char> = ('A'..='Z').collect();
        for (i, &tag) in tags.iter().enumerate() {
            let w = smg.pick(&text(tag, 100), i as u64 * 10_000);
            smg.done(w);
        }
        assert!(smg.tree.total() > budget);
        // An empty text is a miss that inserts nothing: only the eviction pass shows.
        smg.pick("", 10 * EVICTION_INTERVAL_MS);
        assert!(smg.tree.total() <= budget, "{}", smg.tree.total());
        let gone = smg.tree.find(&text('A', 100));
        assert_eq!(gone.matched, 0);
        let kept = smg.tree.find(&text('Z', 100));
        assert_eq!(kept.matched, 100);
        let live = smg.tree.nodes.iter().filter(|n| n.live).count();
        assert!(live <= 1 + budget / 100 + 1, "{live} nodes live");
    }

    #[test]
    fn matching_counts_characters_and_splits_edges() {
        let mut tree = Tree::new(2);
        tree.insert("héllo wörld", &tree.find("héllo wörld"), 0);
        let f = tree.find("héllo there");
        assert_eq!((f.matched, f.input), (6, 11));
        assert_eq!(tree.holders(f.node()), vec![0]);
        tree.insert("héllo there", &f, 1);
        assert_eq!(tree.held, vec![11, 11]);
        let f = tree.find("héllo");
        assert_eq!((f.matched, f.input), (5, 5));
        assert_eq!(tree.holders(f.node()), vec![0, 1]);
        let f = tree.find("héllo wörld!");
        assert_eq!((f.matched, f.input), (11, 12));
        assert_eq!(tree.holders(f.node()), vec![0]);
        assert_eq!(tree.find("").input, 0);
    }

    /// Checks the tree's structure and each worker's character count against its nodes.
    fn check(tree: &Tree) {
        let mut held = vec![0; tree.held.len()];
        for (id, node) in tree.nodes.iter().enumerate().filter(|(_, n)| n.live) {
            for (w, stamp) in node.stamps.iter().enumerate() {
                if stamp.is_some() {
                    held[w] += node.chars;
                }
            }
            assert_eq!(node.chars, node.label.chars().count());
            for (&c, &child) in &node.children {
                let kid = &tree.nodes[child];
                assert!(kid.live && kid.parent == id && kid.label.starts_with(c));
            }
            if id != ROOT {
                assert!(!node.label.is_empty());
                assert!(!node.children.is_empty() || node.stamps.iter().any(Option::is_some));
            }
        }
        assert_eq!(held, tree.held);
    }

    #[test]
    fn growing_conversations_keep_the_tree_consistent_under_eviction() {
        let mut smg = Smg::with_budget(4, 9, 20_000);
        let mut turns = vec![String::from("Système: réponds brièvement."); 12];
        for i in 0..600u64 {
            let c = (i * 7 % 12) as usize;
            turns[c].push_str(&format!(" tour {i} de la conversation {c}"));
            let w = smg.pick(&turns[c], i * 1_000);
            if i % 2 == 0 {
                smg.done(w);
            }
            check(&smg.tree);
        }
        assert!(smg.tree.total() <= 20_000 + 12 * 3_000);
    }

    #[test]
    fn picks_are_reproducible_for_a_seed() {
        let run = |seed| {
            let mut smg = Smg::new(8, seed);
            (0..200u64)
                .map(|i| {
                    let w = smg.pick(&format!("{} user {i}", text('x', (i % 7) as usize * 40)), i);
                    if i % 3 == 0 {
                        smg.done(w);
                    }
                    w
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(run(11), run(11));
    }

    #[test]
    fn long_texts_stay_fast() {
        let mut smg = Smg::new(8, 2);
        let system = text('s', 8_000);
        let start = std::time::Instant::now();
        for i in 0..400u64 {
            let body = format!(
                "{system} conversation {} turn {} {}",
                i % 40,
                i / 40,
                text('t', 12_000)
            );
            let w = smg.pick(&body, i * 100);
            smg.done(w);
        }
        assert!(start.elapsed().as_secs() < 20, "{:?}", start.elapsed());
    }

    #[test]
    fn chat_text_is_the_messages_in_order() {
        let body = json!({
            "model": "Qwen/Qwen3-32B",
            "stream": true,
            "max_tokens": 128,
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": [
                    {"type": "text", "text": "Look at this:"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                    {"type": "text", "text": "what is it?"}
                ]},
                {"role": "assistant", "content": null, "reasoning_content": "It is a cat.",
                 "tool_calls": [{"id": "c1", "type": "function",
                                 "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": ""},
                {"role": "user", "content": "Thanks."}
            ]
        });
        assert_eq!(
            routing_text(&body),
            "You are terse. Look at this: what is it? It is a cat. Thanks."
        );
    }

    #[test]
    fn completion_text_is_the_prompt() {
        assert_eq!(routing_text(&json!({"prompt": "Once upon"})), "Once upon");
        assert_eq!(routing_text(&json!({"prompt": ["a", "b"]})), "a b");
        assert_eq!(routing_text(&json!({"input": "x"})), "");
        let salted = |salt: &str| routing_text(&json!({"prompt": "doc", "cache_salt": salt}));
        assert_ne!(salted("a")[..2], salted("b")[..2], "salts diverge at once");
        assert!(salted("a").ends_with("doc"));
    }
}
