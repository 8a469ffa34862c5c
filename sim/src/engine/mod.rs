//! One simulated vLLM replica: FIFO admission (max_num_seqs and KV space), serialised
//! prefill, batched decode, the prefix cache, counters, and fault knobs.
//!
//! Time is modelled with tokio sleeps, never busy work. Simplifications, all deliberate:
//! - Prefills run one at a time per replica, in admission order; decode steps of running
//!   requests proceed in parallel with them (vLLM's chunked prefill mixes both in one step;
//!   here a prefill does not slow running decodes).
//! - A decode step's length depends on the current number of running requests; tokens are
//!   released in small bursts (at most every `MIN_TICK` of real time) so that a fast
//!   `time_scale` does not turn into thousands of timer wake-ups.
//! - No preemption: when the KV pool is pinned full, new requests wait at the head of the
//!   queue and decoding requests simply stop growing their block count.
//! - The model never emits EOS early: a request generates exactly `max_tokens` tokens.

use crate::bpe::Vocab;
use crate::kv_events::Published;
use crate::metrics::Histogram;
use crate::prefix_cache::{Lease, PrefixCache};
use crate::request::Frontend;
use crate::spec::FleetSpec;
use crate::time_model;
use kvroute::template::Templates;
use serde::Serialize;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::{mpsc, watch, Notify, Semaphore};
use tokio::time::Instant;

/// Never wake a decoding request more often than this (real time).
const MIN_TICK: Duration = Duration::from_millis(5);

/// What the engine tells the caller while a request runs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Emit {
    /// Prefill is done and the first output token exists.
    First { cached_tokens: usize },
    /// Output tokens `[0, upto)` exist.
    Tokens { upto: usize },
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Outcome {
    pub cached_tokens: usize,
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

struct State {
    cache: PrefixCache,
    running: usize,
    waiting: usize,
    requests: u64,
    prefix_queries_tokens: u64,
    prefix_hits_tokens: u64,
    prompt_tokens_total: u64,
    generation_tokens_total: u64,
    success_total: u64,
    /// When the replica's (serial) prefill lane is next free.
    prefill_busy_until: Instant,
    ttft_seconds: Histogram,
    faults: Faults,
    rng: u64,
}

pub struct Replica {
    pub id: usize,
    pub spec: Arc<FleetSpec>,
    /// How its prompts and outputs are tokenized.
    pub vocab: Vocab,
    /// The chat template its chat prompts are rendered with (none: the built-in renderer).
    pub template: Option<Arc<Templates>>,
    state: Mutex<State>,
    slots: Semaphore,
    kv_freed: Notify,
    events: Option<mpsc::UnboundedSender<Published>>,
    stopped: watch::Sender<bool>,
}

impl Replica {
    /// `events` receives every batch of cache changes (for the KV-event publisher).
    pub fn new(
        id: usize,
        spec: Arc<FleetSpec>,
        events: Option<mpsc::UnboundedSender<Published>>,
    ) -> Self {
        Self::with_vocab(id, spec, events, Vocab::Hash)
    }

    /// [`Replica::new`] tokenizing with `vocab`.
    pub fn with_vocab(
        id: usize,
        spec: Arc<FleetSpec>,
        events: Option<mpsc::UnboundedSender<Published>>,
        vocab: Vocab,
    ) -> Self {
        let cache = PrefixCache::new(spec.block_size, spec.kv_capacity_tokens);
        Replica {
            id,
            slots: Semaphore::new(spec.max_num_seqs),
            state: Mutex::new(State {
                cache,
                running: 0,
                waiting: 0,
                requests: 0,
                prefix_queries_tokens: 0,
                prefix_hits_tokens: 0,
                prompt_tokens_total: 0,
                generation_tokens_total: 0,
                success_total: 0,
                prefill_busy_until: Instant::now(),
                ttft_seconds: Histogram::ttft(),
                faults: Faults::default(),
                rng: 0x9E37_79B9_7F4A_7C15 ^ (id as u64 + 1),
            }),
            spec,
            vocab,
            template: None,
            kv_freed: Notify::new(),
            events,
            stopped: watch::channel(false).0,
        }
    }

    /// How it turns a request into prompt tokens: its tokenizer and chat template.
    pub fn frontend(&self) -> Frontend<'_> {
        Frontend {
            vocab: &self.vocab,
            template: self.template.as_deref(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves plain counters behind; keep serving.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs one request: waits for a slot and KV space, "prefills", then "decodes" the
    /// `output` token ids (decided up front by the caller), reporting progress through `emit`. `emit` returning false
    /// aborts the request (its blocks are released, as vLLM does on disconnect). `salt` is the
    /// request's `cache_salt`, the first prompt block's extra key in the prefix cache.
    pub async fn generate(
        &self,
        prompt: &[u32],
        salt: Option<&str>,
        output: &[u32],
        mut emit: impl FnMut(Emit) -> bool,
    ) -> Result<Outcome, GenError> {
        let output_len = output.len();
        if output_len == 0 {
            return Err(GenError::TooLong(
                "at least one output token is required".into(),
            ));
        }
        let arrival = Instant::now();
        let bs = self.spec.block_size;
        let capacity = self.lock().cache.capacity_blocks();
        if prompt.len().div_ceil(bs) > capacity {
            return Err(GenError::TooLong(format!(
                "prompt of {} tokens does not fit in the KV cache ({} tokens)",
                prompt.len(),
                capacity * bs
            )));
        }

        let mut waiting = WaitingGuard::new(self);
        let _slot = self.slots.acquire().await.map_err(|_| GenError::Aborted)?;
        let (lease, prefill_end) = loop {
            let notified = self.kv_freed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(admitted) = self.try_admit(prompt, salt, &mut waiting) {
                break admitted;
            }
            notified.await;
        };
        let hit = lease.hit_tokens;
        let mut run = RunningGuard {
            replica: self,
            lease: Some(lease),
            sequence: prompt.to_vec(),
        };

        tokio::time::sleep_until(prefill_end).await;
        let ttft = arrival.elapsed().as_secs_f64() / self.spec.time_scale;
        self.lock().ttft_seconds.observe(ttft);
        run.push_output(&output[..1]);
        if !emit(Emit::First { cached_tokens: hit }) {
            return Err(GenError::Aborted);
        }

        let mut emitted = 1;
        let mut last = Instant::now();
        let mut credit = 0.0;
        while emitted < output_len {
            let step = self.decode_step();
            tokio::time::sleep(step.max(MIN_TICK)).await;
            let now = Instant::now();
            credit += (now - last).as_secs_f64() / step.as_secs_f64().max(1e-9);
            last = now;
            let due = (credit.floor() as usize).min(output_len - emitted);
            credit -= due as f64;
            if due > 0 {
                emitted += due;
                run.push_output(&output[emitted - due..emitted]);
                if !emit(Emit::Tokens { upto: emitted }) {
                    return Err(GenError::Aborted);
                }
            }
        }
        let mut st = self.lock();
        st.generation_tokens_total += output_len as u64;
        st.success_total += 1;
        Ok(Outcome { cached_tokens: hit })
    }

    /// Admits the request if the KV pool has room; books its prefill on the serial lane.
    fn try_admit(
        &self,
        prompt: &[u32],
        salt: Option<&str>,
        waiting: &mut WaitingGuard,
    ) -> Option<(Lease, Instant)> {
        let mut st = self.lock();
        let lease = st.cache.admit(prompt, salt)?;
        waiting.disarm(&mut st);
        st.running += 1;
        st.prefix_queries_tokens += prompt.len() as u64;
        st.prefix_hits_tokens += lease.hit_tokens as u64;
        st.prompt_tokens_total += prompt.len() as u64;
        let ms = time_model::prefill_ms(
            &self.spec,
            prompt.len() - lease.hit_tokens,
            lease.hit_tokens,
        );
        let duration = time_model::real(&self.spec, ms, st.faults.slow_factor);
        let start = st.prefill_busy_until.max(Instant::now());
        st.prefill_busy_until = start + duration;
        let end = st.prefill_busy_until;
        self.publish(&mut st);
        Some((lease, end))
    }

    fn decode_step(&self) -> Duration {
        let st = self.lock();
        let ms = time_model::decode_step_ms(&self.spec, st.running);
        time_model::real(&self.spec, ms, st.faults.slow_factor)
    }

    fn publish(&self, st: &mut State) {
        let events = st.cache.take_events();
        if let (Some(tx), false) = (&self.events, events.is_empty()) {
            let dropped = st.faults.drop_kv_events > 0;
            st.faults.drop_kv_events = st.faults.drop_kv_events.saturating_sub(1);
            // The publisher only goes away at shutdown; losing events then is fine.
            let _ = tx.send(Published { events, dropped });
        }
    }

    /// Counts a generation request that reached this replica (served or failed).
    pub fn note_request(&self) {
        self.lock().requests += 1;
    }

    /// Draws whether this request should fail, per the `fail_rate` knob.
    pub fn roll_failure(&self) -> bool {
        let mut st = self.lock();
        if st.faults.fail_rate <= 0.0 {
            return false;
        }
        // xorshift64: deterministic per replica, no dependency on a rand crate.
        st.rng ^= st.rng << 13;
        st.rng ^= st.rng >> 7;
        st.rng ^= st.rng << 17;
        ((st.rng >> 11) as f64 / (1u64 << 53) as f64) < st.faults.fail_rate
    }

    /// Prompt tokens a new request (under the cache salt `salt`) would find cached on this
    /// replica right now.
    pub fn cached_tokens(&self, prompt: &[u32], salt: Option<&str>) -> usize {
        self.lock().cache.cached_tokens(prompt, salt)
    }

    pub fn faults(&self) -> Faults {
        self.lock().faults
    }

    pub fn set_faults(&self, faults: Faults) {
        self.lock().faults = faults;
        self.stopped.send_replace(faults.stopped);
    }

    /// Follows the `stopped` knob, for the listener task.
    pub fn watch_stopped(&self) -> watch::Receiver<bool> {
        self.stopped.subscribe()
    }

    /// Drops all unpinned cached blocks (like vLLM's `/reset_prefix_cache`).
    pub fn reset_prefix_cache(&self) {
        let mut st = self.lock();
        st.cache.clear();
        self.publish(&mut st);
    }

    pub fn snapshot(&self) -> Snapshot {
        let st = self.lock();
        Snapshot {
            running: st.running,
            waiting: st.waiting,
            kv_usage: st.cache.usage(),
            num_gpu_blocks: st.cache.capacity_blocks(),
            cached_blocks: st.cache.cached_blocks(),
            requests: st.requests,
            prefix_queries_tokens: st.prefix_queries_tokens,
            prefix_hits_tokens: st.prefix_hits_tokens,
            prompt_tokens_total: st.prompt_tokens_total,
            generation_tokens_total: st.generation_tokens_total,
            success_total: st.success_total,
            ttft_seconds: st.ttft_seconds.clone(),
            faults: st.faults,
        }
    }
}

/// Keeps `waiting` right even if the request is dropped while queued.
struct WaitingGuard<'a> {
    replica: &'a Replica,
    armed: bool,
}

impl<'a> WaitingGuard<'a> {
    fn new(replica: &'a Replica) -> Self {
        replica.lock().waiting += 1;
        WaitingGuard {
            replica,
            armed: true,
        }
    }

    fn disarm(&mut self, st: &mut State) {
        if self.armed {
            st.waiting -= 1;
            self.armed = false;
        }
    }
}

impl Drop for WaitingGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.replica.lock().waiting -= 1;
        }
    }
}

/// Holds a running request's blocks; returns them however the request ends.
struct RunningGuard<'a> {
    replica: &'a Replica,
    lease: Option<Lease>,
    /// Prompt plus output so far; its full blocks are cached on release.
    sequence: Vec<u32>,
}

impl RunningGuard<'_> {
    /// Appends output tokens and grows the block count as blocks fill.
    fn push_output(&mut self, tokens: &[u32]) {
        self.sequence.extend_from_slice(tokens);
        let Some(lease) = self.lease.as_mut() else {
            return;
        };
        let needed = self.sequence.len().div_ceil(self.replica.spec.block_size);
        let mut st = self.replica.lock();
        while lease.blocks_held() < needed {
            if !st.cache.grow(lease) {
                break;
            }
        }
        self.replica.publish(&mut st);
    }
}

impl Drop for RunningGuard<'_> {
    fn drop(&mut self) {
        let mut st = self.replica.lock();
        if let Some(lease) = self.lease.take() {
            st.cache.release(lease, &self.sequence);
        }
        st.running -= 1;
        self.replica.publish(&mut st);
        drop(st);
        self.replica.kv_freed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fast_spec() -> Arc<FleetSpec> {
        Arc::new(FleetSpec {
            time_scale: 0.001,
            ..FleetSpec::default()
        })
    }

    #[tokio::test]
    async fn second_identical_prompt_hits_cache_and_prefills_faster() {
        let spec = Arc::new(FleetSpec {
            time_scale: 0.01,
            ..FleetSpec::default()
        });
        let replica = Replica::new(0, spec, None);
        let prompt: Vec<u32> = (0..6000).collect();
        let t0 = Instant::now();
        let cold = replica
            .generate(&prompt, None, &[5], |_| true)
            .await
            .unwrap();
        let cold_time = t0.elapsed();
        let t1 = Instant::now();
        let warm = replica
            .generate(&prompt, None, &[5], |_| true)
            .await
            .unwrap();
        let warm_time = t1.elapsed();
        assert_eq!(cold.cached_tokens, 0);
        assert_eq!(warm.cached_tokens, 5984);
        // 42.5 ms vs 6 ms real at time_scale 0.01.
        assert!(cold_time >= Duration::from_millis(40), "{cold_time:?}");
        assert!(warm_time < Duration::from_millis(25), "{warm_time:?}");
        let snap = replica.snapshot();
        assert_eq!(snap.prefix_queries_tokens, 12000);
        assert_eq!(snap.prefix_hits_tokens, 5984);
        assert_eq!(snap.ttft_seconds.count(), 2);
    }

    #[tokio::test]
    async fn emits_every_output_token_in_order_and_releases_blocks() {
        let replica = Replica::new(0, fast_spec(), None);
        let mut seen = Vec::new();
        replica
            .generate(&[1, 2, 3], None, &[9; 40], |e| {
                seen.push(e);
                true
            })
            .await
            .unwrap();
        assert_eq!(seen[0], Emit::First { cached_tokens: 0 });
        assert_eq!(seen.last(), Some(&Emit::Tokens { upto: 40 }));
        let snap = replica.snapshot();
        assert_eq!((snap.running, snap.waiting, snap.kv_usage), (0, 0, 0.0));
        assert_eq!(snap.generation_tokens_total, 40);
    }

    // Paused time: the clock moves only when every task waits, so a loaded machine cannot let
    // one request finish before the next arrives.
    #[tokio::test(start_paused = true)]
    async fn requests_beyond_max_num_seqs_wait_in_fifo_order() {
        // Each request takes ~15 ms here: 9.5 ms prefill plus one 5 ms decode tick.
        let spec = Arc::new(FleetSpec {
            max_num_seqs: 1,
            time_scale: 0.1,
            ..FleetSpec::default()
        });
        let replica = Arc::new(Replica::new(0, spec, None));
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for i in 0..3u32 {
            let (r, o) = (replica.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                r.generate(&[i; 64], None, &[1, 2], |_| true).await.unwrap();
                o.lock().unwrap().push(i);
            }));
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        tokio::time::sleep(Duration::from_millis(3)).await;
        let snap = replica.snapshot();
        assert_eq!((snap.running, snap.waiting), (1, 2));
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), vec![0, 1, 2]);
    }

    #[tokio::test]
    async fn aborting_releases_the_slot_and_pins() {
        let replica = Replica::new(0, fast_spec(), None);
        let err = replica
            .generate(&[7; 100], None, &[1; 10], |_| false)
            .await
            .unwrap_err();
        assert_eq!(err, GenError::Aborted);
        let snap = replica.snapshot();
        assert_eq!((snap.running, snap.kv_usage), (0, 0.0));
        assert!(snap.cached_blocks >= 6);
    }

    #[tokio::test]
    async fn prompts_larger_than_the_pool_are_rejected_not_queued_forever() {
        let spec = Arc::new(FleetSpec {
            kv_capacity_tokens: 64,
            ..FleetSpec::default()
        });
        let replica = Replica::new(0, spec, None);
        let err = replica
            .generate(&[1; 100], None, &[1], |_| true)
            .await
            .unwrap_err();
        assert!(matches!(err, GenError::TooLong(_)));
    }

    #[tokio::test]
    async fn slow_factor_stretches_prefill() {
        let spec = Arc::new(FleetSpec {
            time_scale: 0.01,
            ..FleetSpec::default()
        });
        let replica = Replica::new(0, spec, None);
        replica.set_faults(Faults {
            slow_factor: 4.0,
            ..Faults::default()
        });
        let t = Instant::now();
        replica
            .generate(&[3; 1000], None, &[1], |_| true)
            .await
            .unwrap();
        // 750 ms simulated * 4 * 0.01 = 30 ms.
        assert!(
            t.elapsed() >= Duration::from_millis(29),
            "{:?}",
            t.elapsed()
        );
    }

    #[test]
    fn fail_rate_is_respected_roughly() {
        let replica = Replica::new(0, fast_spec(), None);
        assert!(!(0..100).any(|_| replica.roll_failure()));
        replica.set_faults(Faults {
            fail_rate: 0.5,
            ..Faults::default()
        });
        let fails = (0..1000).filter(|_| replica.roll_failure()).count();
        assert!((350..650).contains(&fails), "{fails}");
        replica.set_faults(Faults {
            fail_rate: 1.0,
            ..Faults::default()
        });
        assert!((0..100).all(|_| replica.roll_failure()));
    }
}
