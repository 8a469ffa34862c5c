//! One simulated vLLM replica in tokio time: the [`EngineCore`] model, driven by a task.
//!
//! The core holds the whole model (see [`core`] for it and its simplifications); this driver
//! gives it the time. The replica keeps the core behind a mutex with an epoch, and the core's
//! times are durations since that epoch. One driver task per replica, spawned by the first
//! request and aborted when the replica drops, sleeps until the core's next event or until a
//! submission or abort wakes it, advances the core to the present, hands each request what
//! happened to it through the request's channel, and forwards published KV events to the
//! publisher. Whoever else touches the core (a submission, an abort, a snapshot) advances it to
//! the present first as well, so every view is current however late the driver wakes. A
//! request's tokens carry the time the model gives them, even when the driver hands them out
//! late; there are no timers but the driver's.

pub mod core;

pub use self::core::{Backlog, Emit, EngineCore, Faults, GenError, Happened, RequestId, Snapshot};

use crate::bpe::Vocab;
use crate::kv_events::Published;
use crate::request::Frontend;
use crate::spec::FleetSpec;
use kvroute::template::Templates;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::{mpsc, watch, Notify};
use tokio::task::JoinHandle;
use tokio::time::Instant;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Outcome {
    pub cached_tokens: usize,
}

/// The core and who listens to its requests.
struct Driven {
    core: EngineCore,
    /// Each live request's channel.
    listeners: HashMap<RequestId, mpsc::UnboundedSender<Happened>>,
    next_id: RequestId,
}

/// What a replica shares with its driver task.
struct Shared {
    driven: Mutex<Driven>,
    /// Wakes the driver: the core's next event may have moved earlier.
    wake: Notify,
    epoch: Instant,
    events: Option<mpsc::UnboundedSender<Published>>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Driven> {
        // A panic while holding the lock leaves a consistent core behind; keep serving.
        self.driven.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The present, in the core's time.
    fn now(&self) -> Duration {
        Instant::now().saturating_duration_since(self.epoch)
    }

    /// The core, advanced to the present.
    fn current(&self) -> MutexGuard<'_, Driven> {
        let mut driven = self.lock();
        self.settle(&mut driven, self.now());
        driven
    }

    /// Advances the core to `now`, hands what happened to each request's listener and
    /// forwards the KV events published meanwhile.
    fn settle(&self, driven: &mut Driven, now: Duration) {
        let mut happened = Vec::new();
        driven.core.advance(now, &mut happened);
        for h in happened {
            let (id, done) = (h.id, matches!(h.what, Emit::Done { .. }));
            if let Some(tx) = driven.listeners.get(&id) {
                // A listener gone is a request being aborted; its guard tells the core.
                let _ = tx.send(h);
            }
            if done {
                driven.listeners.remove(&id);
            }
        }
        for batch in driven.core.take_published() {
            if let Some(tx) = &self.events {
                // The publisher only goes away at shutdown; losing events then is fine.
                let _ = tx.send(batch);
            }
        }
    }
}

/// Advances the core whenever its next event is due; runs until aborted.
async fn drive(shared: Arc<Shared>) {
    loop {
        let next = shared.current().core.next_event();
        match next {
            Some(t) => {
                tokio::select! {
                    () = tokio::time::sleep_until(shared.epoch + t) => {}
                    () = shared.wake.notified() => {}
                }
            }
            None => shared.wake.notified().await,
        }
    }
}

/// One replica: how it reads requests, and its engine core driven in tokio time.
pub struct Replica {
    pub id: usize,
    pub spec: Arc<FleetSpec>,
    /// How its prompts and outputs are tokenized.
    pub vocab: Vocab,
    /// The chat template its chat prompts are rendered with (none: the built-in renderer).
    pub template: Option<Arc<Templates>>,
    shared: Arc<Shared>,
    driver: Mutex<Option<JoinHandle<()>>>,
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
        let driven = Driven {
            core: EngineCore::new(id, spec.clone()),
            listeners: HashMap::new(),
            next_id: 0,
        };
        Replica {
            id,
            spec,
            vocab,
            template: None,
            shared: Arc::new(Shared {
                driven: Mutex::new(driven),
                wake: Notify::new(),
                epoch: Instant::now(),
                events,
            }),
            driver: Mutex::new(None),
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

    /// The instant the core's times count from.
    pub fn epoch(&self) -> Instant {
        self.shared.epoch
    }

    /// Runs one request: waits for a slot and KV space, "prefills", then "decodes" the
    /// `output` token ids (decided up front by the caller), reporting progress through `emit`
    /// (never [`Emit::Done`]: the end is the returned outcome). `emit` returning false, or the
    /// future dropped, aborts the request (its blocks are released, as vLLM does on
    /// disconnect). `salt` is the request's `cache_salt`, the first prompt block's extra key in
    /// the prefix cache.
    pub async fn generate(
        &self,
        prompt: &[u32],
        salt: Option<&str>,
        output: &[u32],
        mut emit: impl FnMut(Emit) -> bool,
    ) -> Result<Outcome, GenError> {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let id = {
            let mut driven = self.shared.lock();
            let now = self.shared.now();
            let id = driven.next_id;
            let (prompt, salt) = (prompt.to_vec(), salt.map(str::to_string));
            driven.core.submit(now, id, prompt, salt, output.to_vec())?;
            driven.next_id += 1;
            driven.listeners.insert(id, tx);
            self.shared.settle(&mut driven, now);
            id
        };
        let mut live = Live {
            shared: &self.shared,
            id,
            done: false,
        };
        self.ensure_driver();
        self.shared.wake.notify_one();
        while let Some(h) = rx.recv().await {
            match h.what {
                Emit::Done { cached_tokens } => {
                    live.done = true;
                    return Ok(Outcome { cached_tokens });
                }
                what => {
                    if !emit(what) {
                        return Err(GenError::Aborted);
                    }
                }
            }
        }
        Err(GenError::Aborted)
    }

    /// Spawns the driver task unless it runs (a runtime that went away took it along).
    fn ensure_driver(&self) {
        let mut driver = self.driver.lock().unwrap_or_else(|e| e.into_inner());
        if driver.as_ref().is_none_or(JoinHandle::is_finished) {
            *driver = Some(tokio::spawn(drive(self.shared.clone())));
        }
    }

    /// Counts a generation request that reached this replica (served or failed).
    pub fn note_request(&self) {
        self.shared.lock().core.note_request();
    }

    /// Draws whether this request should fail, per the `fail_rate` knob.
    pub fn roll_failure(&self) -> bool {
        self.shared.lock().core.roll_failure()
    }

    /// Prompt tokens a new request (under the cache salt `salt`) would find cached on this
    /// replica right now.
    pub fn cached_tokens(&self, prompt: &[u32], salt: Option<&str>) -> usize {
        self.shared.current().core.cached_tokens(prompt, salt)
    }

    pub fn faults(&self) -> Faults {
        self.shared.lock().core.faults()
    }

    pub fn set_faults(&self, faults: Faults) {
        self.shared.lock().core.set_faults(faults);
        self.stopped.send_replace(faults.stopped);
    }

    /// Follows the `stopped` knob, for the listener task.
    pub fn watch_stopped(&self) -> watch::Receiver<bool> {
        self.stopped.subscribe()
    }

    /// Drops all unpinned cached blocks (like vLLM's `/reset_prefix_cache`).
    pub fn reset_prefix_cache(&self) {
        let mut driven = self.shared.current();
        driven.core.reset_prefix_cache();
        self.shared.settle(&mut driven, self.shared.now());
    }

    pub fn snapshot(&self) -> Snapshot {
        self.shared.current().core.snapshot()
    }

    /// Its prefill work waiting (SGLang's `num_waiting_uncached_tokens`).
    pub fn backlog(&self) -> Backlog {
        self.shared.current().core.backlog()
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        let driver = self.driver.get_mut().unwrap_or_else(|e| e.into_inner());
        if let Some(task) = driver.take() {
            task.abort();
        }
    }
}

/// A request in the core; aborts it there unless it is done, however `generate` ends.
struct Live<'a> {
    shared: &'a Shared,
    id: RequestId,
    done: bool,
}

impl Drop for Live<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let mut driven = self.shared.lock();
        let now = self.shared.now();
        driven.core.abort(now, self.id);
        driven.listeners.remove(&self.id);
        self.shared.settle(&mut driven, now);
        drop(driven);
        // Freed room may admit a request whose prefill ends before the driver's next wake.
        self.shared.wake.notify_one();
    }
}

#[cfg(test)]
mod tests;
