//! One replica's scheduling model with time passed in: it never reads a clock, spawns or sleeps.
//!
//! Time is a [`Duration`] since an epoch the caller chooses, already in the driver's time (scaled
//! by `time_scale` and `slow_factor`, as [`time_model::real`] computes it); a time earlier than
//! one already passed in counts as that one. The model:
//! - Requests queue FIFO for one of `max_num_seqs` slots and for KV space; the head of the queue
//!   waits until both are free, and nothing behind it is admitted first.
//! - Prefills run one at a time per replica, in admission order (the serial prefill lane). The
//!   first output token exists when a request's prefill ends.
//! - Decode runs in engine steps of `decode_step_ms(running)` each (`running` counts every
//!   admitted request, prefilling or decoding, when the step begins). A step gives one more token
//!   to every request that had its first token before the step began; a request whose prefill
//!   ends joins at the next step boundary. Steps run only while some request is decoding.
//!   Prefills do not slow decode steps (vLLM's chunked prefill would mix them).
//! - Blocks are grown as output fills them; a finished or aborted request's blocks are released
//!   (its full blocks cached). No preemption: when the pool is pinned full, decoding requests
//!   stop growing their block count.
//! - The model never emits EOS early: a request generates exactly its output tokens.
//!
//! Ties at one time are processed in this fixed order, so runs are deterministic: first every
//! prefill ending then (admission order), then the decode step ending then (its requests in
//! admission order, each finishing request released and the queue admitted at once), then a new
//! step begins if some request is decoding. A submission or abort at a time first runs
//! everything due at or before it.

use crate::kv_events::Published;
use crate::metrics::Histogram;
use crate::prefix_cache::{Lease, PrefixCache};
use crate::spec::{EngineKind, FleetSpec};
use crate::time_model;
use serde::Serialize;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

/// What the engine tells about a request while it runs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Emit {
    /// Prefill is done and the first output token exists.
    First { cached_tokens: usize },
    /// Output tokens `[0, upto)` exist.
    Tokens { upto: usize },
    /// The last output token is out and the request's blocks are released.
    Done { cached_tokens: usize },
}

#[derive(Debug, Clone, PartialEq)]
pub enum GenError {
    /// The caller stopped listening (client went away).
    Aborted,
    /// The prompt cannot fit in the whole KV pool.
    TooLong(String),
}

/// Fault knobs set through the control API.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Faults {
    pub slow_factor: f64,
    pub fail_rate: f64,
    pub stopped: bool,
    /// The next this many KV-event messages are left off the PUB socket (still numbered and
    /// kept for replay): every subscriber misses them.
    pub drop_kv_events: u64,
}

impl Default for Faults {
    fn default() -> Self {
        Faults {
            slow_factor: 1.0,
            fail_rate: 0.0,
            stopped: false,
            drop_kv_events: 0,
        }
    }
}

/// A point-in-time view of a replica, for `/metrics` and `/fleet/state`.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub running: usize,
    pub waiting: usize,
    pub kv_usage: f64,
    pub num_gpu_blocks: usize,
    pub cached_blocks: usize,
    pub requests: u64,
    pub prefix_queries_tokens: u64,
    pub prefix_hits_tokens: u64,
    pub prompt_tokens_total: u64,
    pub generation_tokens_total: u64,
    pub success_total: u64,
    pub ttft_seconds: Histogram,
    pub faults: Faults,
}

/// Prefill work waiting on a replica, in tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Backlog {
    /// The queued (not admitted) requests' prompt tokens.
    pub queued_prompt_tokens: u64,
    /// The prompt tokens still to compute: SGLang's `num_waiting_uncached_tokens`.
    pub uncached_tokens: u64,
}

/// A request's name in the core, chosen by the caller; unique among live requests.
pub type RequestId = u64;

/// What happened to one request at one time.
#[derive(Debug, Clone, PartialEq)]
pub struct Happened {
    pub at: Duration,
    pub id: RequestId,
    pub what: Emit,
}

/// A request in the queue, not admitted yet.
struct Queued {
    id: RequestId,
    arrival: Duration,
    prompt: Vec<u32>,
    salt: Option<String>,
    output: Vec<u32>,
}

/// An admitted request: prefilling until `prefill_end`, then decoding.
struct Running {
    id: RequestId,
    arrival: Duration,
    output: Vec<u32>,
    lease: Lease,
    /// Prompt plus output so far; its full blocks are cached on release.
    sequence: Vec<u32>,
    /// Its prompt tokens not found in cache: the prefill's work.
    uncached: usize,
    prefill_start: Duration,
    prefill_end: Duration,
    /// Output tokens out (0 while prefilling).
    out: usize,
    /// Whether it gets a token when the current decode step ends.
    in_step: bool,
}

/// One replica's scheduler, prefix cache, counters and fault knobs.
pub struct EngineCore {
    spec: Arc<FleetSpec>,
    cache: PrefixCache,
    queue: VecDeque<Queued>,
    /// In admission order.
    running: Vec<Running>,
    /// When the current decode step ends, if one runs.
    step_end: Option<Duration>,
    /// When the serial prefill lane is next free.
    prefill_busy_until: Duration,
    /// The latest time seen.
    now: Duration,
    /// What happened during submissions and aborts, until the next `advance` hands it out.
    happened: Vec<Happened>,
    published: Vec<Published>,
    requests: u64,
    prefix_queries_tokens: u64,
    prefix_hits_tokens: u64,
    prompt_tokens_total: u64,
    generation_tokens_total: u64,
    success_total: u64,
    ttft_seconds: Histogram,
    faults: Faults,
    rng: u64,
}

impl EngineCore {
    /// An idle replica with an empty cache; `id` seeds its failure draws.
    pub fn new(id: usize, spec: Arc<FleetSpec>) -> EngineCore {
        let ttft = match spec.kind(id) {
            EngineKind::Vllm => Histogram::ttft(),
            EngineKind::Sglang => Histogram::sglang_ttft(),
        };
        EngineCore {
            cache: PrefixCache::new(spec.block_size, spec.kv_capacity_tokens),
            spec,
            queue: VecDeque::new(),
            running: Vec::new(),
            step_end: None,
            prefill_busy_until: Duration::ZERO,
            now: Duration::ZERO,
            happened: Vec::new(),
            published: Vec::new(),
            requests: 0,
            prefix_queries_tokens: 0,
            prefix_hits_tokens: 0,
            prompt_tokens_total: 0,
            generation_tokens_total: 0,
            success_total: 0,
            ttft_seconds: ttft,
            faults: Faults::default(),
            rng: 0x9E37_79B9_7F4A_7C15 ^ (id as u64 + 1),
        }
    }

    /// Queues a request arriving at `now` (FIFO). Err(GenError::TooLong) when it can never fit
    /// in the KV pool, or has no output tokens. `salt` is its `cache_salt`, the first prompt
    /// block's extra key in the prefix cache; `output` the token ids it will generate.
    pub fn submit(
        &mut self,
        now: Duration,
        id: RequestId,
        prompt: Vec<u32>,
        salt: Option<String>,
        output: Vec<u32>,
    ) -> Result<(), GenError> {
        if output.is_empty() {
            return Err(GenError::TooLong(
                "at least one output token is required".into(),
            ));
        }
        let bs = self.spec.block_size;
        let capacity = self.cache.capacity_blocks();
        if prompt.len().div_ceil(bs) > capacity {
            return Err(GenError::TooLong(format!(
                "prompt of {} tokens does not fit in the KV cache ({} tokens)",
                prompt.len(),
                capacity * bs
            )));
        }
        self.run_until(now);
        self.queue.push_back(Queued {
            id,
            arrival: self.now,
            prompt,
            salt,
            output,
        });
        self.admit();
        Ok(())
    }

    /// The request goes away (client gone): its slot and blocks are freed, its full blocks
    /// cached. Unknown or finished requests are ignored.
    pub fn abort(&mut self, now: Duration, id: RequestId) {
        self.run_until(now);
        if let Some(i) = self.queue.iter().position(|q| q.id == id) {
            self.queue.remove(i);
            // The head may have been what held the queue up.
            self.admit();
        } else if let Some(i) = self.running.iter().position(|r| r.id == id) {
            let r = self.running.remove(i);
            self.release(r);
        }
    }

    /// When the next thing happens by itself (a prefill ends, a decode step ends), if anything
    /// is pending.
    pub fn next_event(&self) -> Option<Duration> {
        let prefill = self
            .running
            .iter()
            .filter(|r| r.out == 0)
            .map(|r| r.prefill_end)
            .min();
        match (prefill, self.step_end) {
            (Some(p), Some(s)) => Some(p.min(s)),
            (p, s) => p.or(s),
        }
    }

    /// Runs everything due at or before `now`, in time order, appending what happened to `out`.
    pub fn advance(&mut self, now: Duration, out: &mut Vec<Happened>) {
        self.run_until(now);
        out.append(&mut self.happened);
    }

    /// The KV-event batches published since the last call, oldest first. Each is `dropped`
    /// while the `drop_kv_events` knob counts down.
    pub fn take_published(&mut self) -> Vec<Published> {
        std::mem::take(&mut self.published)
    }

    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            running: self.running.len(),
            waiting: self.queue.len(),
            kv_usage: self.cache.usage(),
            num_gpu_blocks: self.cache.capacity_blocks(),
            cached_blocks: self.cache.cached_blocks(),
            requests: self.requests,
            prefix_queries_tokens: self.prefix_queries_tokens,
            prefix_hits_tokens: self.prefix_hits_tokens,
            prompt_tokens_total: self.prompt_tokens_total,
            generation_tokens_total: self.generation_tokens_total,
            success_total: self.success_total,
            ttft_seconds: self.ttft_seconds.clone(),
            faults: self.faults,
        }
    }

    /// Prompt tokens a new request (under the cache salt `salt`) would find cached right now.
    pub fn cached_tokens(&self, prompt: &[u32], salt: Option<&str>) -> usize {
        self.cache.cached_tokens(prompt, salt)
    }

    /// The prefill work waiting: the queued requests' prompt tokens, and the tokens SGLang's
    /// `num_waiting_uncached_tokens` counts: each queued request's prompt less what the cache
    /// holds of it now, plus what is left of the admitted prefills not done yet (the serial
    /// prefill lane's backlog; SGLang's chunked request's remainder).
    pub fn backlog(&self) -> Backlog {
        let prompts: usize = self.queue.iter().map(|q| q.prompt.len()).sum();
        let queued: usize = self
            .queue
            .iter()
            .map(|q| q.prompt.len() - self.cache.cached_tokens(&q.prompt, q.salt.as_deref()))
            .sum();
        let booked: f64 = self
            .running
            .iter()
            .filter(|r| r.out == 0 && r.prefill_end > self.now)
            .map(|r| {
                let total = r.prefill_end.saturating_sub(r.prefill_start).as_secs_f64();
                let left = r.prefill_end.saturating_sub(self.now.max(r.prefill_start));
                match total > 0.0 {
                    true => r.uncached as f64 * left.as_secs_f64() / total,
                    false => 0.0,
                }
            })
            .sum();
        Backlog {
            queued_prompt_tokens: prompts as u64,
            uncached_tokens: queued as u64 + booked.round() as u64,
        }
    }

    pub fn faults(&self) -> Faults {
        self.faults
    }

    /// Takes effect for prefills booked and decode steps begun from now on.
    pub fn set_faults(&mut self, faults: Faults) {
        self.faults = faults;
    }

    /// Counts a generation request that reached this replica (served or failed).
    pub fn note_request(&mut self) {
        self.requests += 1;
    }

    /// Draws whether this request should fail, per the `fail_rate` knob.
    pub fn roll_failure(&mut self) -> bool {
        if self.faults.fail_rate <= 0.0 {
            return false;
        }
        // xorshift64: deterministic per replica, no dependency on a rand crate.
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        ((self.rng >> 11) as f64 / (1u64 << 53) as f64) < self.faults.fail_rate
    }

    /// Drops all unpinned cached blocks (like vLLM's `/reset_prefix_cache`).
    pub fn reset_prefix_cache(&mut self) {
        self.cache.clear();
        self.publish();
    }

    /// Processes every event due at or before `now` into `self.happened`, in the tie order of
    /// the module doc, and moves the time on to `now` (never back).
    fn run_until(&mut self, now: Duration) {
        while let Some(t) = self.next_event().filter(|t| *t <= now) {
            self.now = self.now.max(t);
            while let Some(i) = self
                .running
                .iter()
                .position(|r| r.out == 0 && r.prefill_end <= t)
            {
                self.end_prefill(i);
            }
            if self.step_end.is_some_and(|s| s <= t) {
                self.end_step();
            }
            self.begin_step();
        }
        self.now = self.now.max(now);
    }

    /// Admits queued requests, head first, while a slot and KV space are free; books each
    /// one's prefill on the serial lane.
    fn admit(&mut self) {
        while self.running.len() < self.spec.max_num_seqs {
            let Some(head) = self.queue.front() else {
                return;
            };
            let Some(lease) = self.cache.admit(&head.prompt, head.salt.as_deref()) else {
                return;
            };
            let Some(q) = self.queue.pop_front() else {
                return;
            };
            let (len, hit) = (q.prompt.len(), lease.hit_tokens);
            self.prefix_queries_tokens += len as u64;
            self.prefix_hits_tokens += hit as u64;
            self.prompt_tokens_total += len as u64;
            let ms = time_model::prefill_ms(&self.spec, len - hit, hit);
            let duration = time_model::real(&self.spec, ms, self.faults.slow_factor);
            let prefill_start = self.prefill_busy_until.max(self.now);
            self.prefill_busy_until = prefill_start + duration;
            self.running.push(Running {
                id: q.id,
                arrival: q.arrival,
                output: q.output,
                lease,
                sequence: q.prompt,
                uncached: len - hit,
                prefill_start,
                prefill_end: self.prefill_busy_until,
                out: 0,
                in_step: false,
            });
            self.publish();
        }
    }

    /// The prefill of `running[i]` is over: its first token is out.
    fn end_prefill(&mut self, i: usize) {
        let at = self.running[i].prefill_end;
        let r = &self.running[i];
        let ttft = (at.saturating_sub(r.arrival)).as_secs_f64() / self.spec.time_scale;
        self.ttft_seconds.observe(ttft);
        let (id, cached_tokens) = (r.id, r.lease.hit_tokens);
        self.happened.push(Happened {
            at,
            id,
            what: Emit::First { cached_tokens },
        });
        self.push_output(i);
        if self.running[i].out == self.running[i].output.len() {
            self.finish(i, at);
        }
    }

    /// The decode step is over: each of its requests has one more token.
    fn end_step(&mut self) {
        let Some(at) = self.step_end.take() else {
            return;
        };
        let mut i = 0;
        while i < self.running.len() {
            if !std::mem::take(&mut self.running[i].in_step) {
                i += 1;
                continue;
            }
            self.push_output(i);
            let r = &self.running[i];
            self.happened.push(Happened {
                at,
                id: r.id,
                what: Emit::Tokens { upto: r.out },
            });
            if r.out == r.output.len() {
                self.finish(i, at);
            } else {
                i += 1;
            }
        }
    }

    /// Begins a decode step now if none runs and some request is decoding.
    fn begin_step(&mut self) {
        if self.step_end.is_some() {
            return;
        }
        let mut any = false;
        for r in self.running.iter_mut().filter(|r| r.out > 0) {
            r.in_step = true;
            any = true;
        }
        if any {
            let ms = time_model::decode_step_ms(&self.spec, self.running.len());
            self.step_end =
                Some(self.now + time_model::real(&self.spec, ms, self.faults.slow_factor));
        }
    }

    /// `running[i]` has its last token: it is done, its blocks released.
    fn finish(&mut self, i: usize, at: Duration) {
        let r = self.running.remove(i);
        self.generation_tokens_total += r.output.len() as u64;
        self.success_total += 1;
        let (id, cached_tokens) = (r.id, r.lease.hit_tokens);
        self.release(r);
        self.happened.push(Happened {
            at,
            id,
            what: Emit::Done { cached_tokens },
        });
    }

    /// Returns a request's blocks (caching its full blocks) and admits whoever now fits.
    fn release(&mut self, r: Running) {
        self.cache.release(r.lease, &r.sequence);
        self.publish();
        self.admit();
    }

    /// Puts `running[i]`'s next output token out and grows its block count as blocks fill.
    fn push_output(&mut self, i: usize) {
        let bs = self.spec.block_size;
        let r = &mut self.running[i];
        r.sequence.push(r.output[r.out]);
        r.out += 1;
        let needed = r.sequence.len().div_ceil(bs);
        while r.lease.blocks_held() < needed {
            if !self.cache.grow(&mut r.lease) {
                break;
            }
        }
        self.publish();
    }

    /// Collects the cache's events since the last call as one batch, if there are any.
    fn publish(&mut self) {
        let events = self.cache.take_events();
        if events.is_empty() {
            return;
        }
        let dropped = self.faults.drop_kv_events > 0;
        self.faults.drop_kv_events = self.faults.drop_kv_events.saturating_sub(1);
        self.published.push(Published { events, dropped });
    }
}

#[cfg(test)]
mod tests;
