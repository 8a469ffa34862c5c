//! Policies: given the candidate endpoints (healthy, with their load) and the request, pick one.
//! One file per policy behind one trait, built once from the config; `cache_aware` is kvroute's,
//! made of stages ([`pipeline`]), the rest are baselines to compare it with.

pub mod cache_aware;
mod least_request;
mod load;
pub mod pipeline;
mod prefix_hash;
mod round_robin;
mod session;

pub use load::OverloadBound;

use strum::{EnumCount, IntoStaticStr, VariantArray};

use crate::config::{Config, PolicyKind};
use crate::prefix::PrefixKeys;
use crate::store::SharedStore;
use crate::usage::Usage;

/// An endpoint a request may go to.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate<'h> {
    pub addr: &'h str,
    pub id: u32,
    /// Requests at the endpoint: the engine's own report corrected by kvroute's requests since,
    /// or, without engine metrics, the larger of kvroute's count and Envoy's `rq_active`.
    pub load: u64,
    /// The engine queues new requests: it is full, whatever the others' load.
    pub queueing: bool,
    /// How long its engine keeps a prefix nobody uses ([`retention`](crate::retention)); `None`
    /// where its metrics do not say, or it keeps everything.
    pub retention_ms: Option<u64>,
    /// Prompt bytes queued there to prefill before a new request's: kvroute's own requests not
    /// yet at their first byte, or what the engine's waiting requests are taken to cost, the
    /// larger ([`prefill`](crate::prefill)).
    pub queued_prefill: u64,
    /// Prompt bytes its engine prefills per millisecond, as learnt.
    pub prefill_rate: f64,
}

impl Candidate<'_> {
    /// Whether a prefix it last used at `stamp_ms` is likely still in its cache at `now_ms`.
    pub fn keeps(&self, stamp_ms: u64, now_ms: u64) -> bool {
        self.retention_ms
            .is_none_or(|r| now_ms.saturating_sub(stamp_ms) <= r)
    }

    /// Milliseconds to the first token of a request that finds `held` of its `prompt` bytes
    /// cached here.
    pub fn expected_ttft_ms(&self, prompt: usize, held: usize) -> f64 {
        let uncached = prompt.saturating_sub(held) as u64;
        crate::prefill::expected_ttft_ms(self.queued_prefill, uncached, self.prefill_rate)
    }
}

/// Why an endpoint was picked: the stage of `cache_aware` that decided, or the baseline that
/// picked. Each is a counter (`kvroute.routed.<name>`) and a debug-header value, so names are
/// stable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, IntoStaticStr, VariantArray, EnumCount)]
#[strum(serialize_all = "snake_case")]
pub enum Decision {
    /// Followed the prefix to an endpoint whose engine reports holding it (the engine index).
    Engine,
    /// Followed the prefix to an endpoint this gateway saw serve it.
    Affinity,
    /// The group's home: first in its rendezvous order, not overloaded.
    Home,
    /// The group's home was overloaded: the next endpoint in its rendezvous order that is not.
    Spread,
    /// Every endpoint overloaded: the least-loaded one.
    Balance,
    RoundRobin,
    LeastRequest,
    Session,
    PrefixHash,
}

impl Decision {
    pub fn name(self) -> &'static str {
        self.into()
    }
}

/// What a policy may know about the request.
pub struct Input<'a> {
    pub keys: &'a PrefixKeys,
    /// Hash of the session header's value, if the request has one.
    pub session: Option<u64>,
    /// A number that differs per request: least_request's tie-break.
    pub nonce: u64,
    /// Shared data: the affinity map, the round-robin ticket.
    pub store: &'a dyn SharedStore,
    pub now_ms: u64,
    /// Bytes of the rendered prompt, and bytes per key's chunk.
    pub prompt_bytes: usize,
    pub chunk_size: usize,
}

/// The chosen candidate (an index into the candidates) and why.
#[derive(Debug)]
pub struct Pick {
    pub index: usize,
    pub decision: Decision,
    /// Bytes of the prompt the chosen endpoint is taken to hold (0: none known).
    pub held_bytes: usize,
    /// Share of the request's chunks the policy found some endpoint holding, where it looked
    /// (cache_aware, for a request with history).
    pub match_fraction: Option<f64>,
    /// What the policy keeps of the request until it is answered.
    pub ticket: Ticket,
}

impl Pick {
    pub fn new(index: usize, decision: Decision) -> Pick {
        Pick {
            index,
            decision,
            held_bytes: 0,
            match_fraction: None,
            ticket: Ticket::default(),
        }
    }
}

/// What a policy keeps of one routed request from its pick to its answer: the caller holds it and
/// hands it back unopened, to [`Policy::routed`] and then to [`Policy::answered`].
#[derive(Debug, Default)]
pub struct Ticket(Option<cache_aware::Pending>);

/// How a routed request was answered.
pub struct Answer<'a> {
    /// The endpoint kvroute chose.
    pub chosen: &'a str,
    /// The host that gave the final answer, when known.
    pub served: Option<&'a str>,
    /// The response succeeded.
    pub ok: bool,
    /// What the engine reported using (successful responses only).
    pub usage: Option<Usage>,
    /// The request's prefix keys.
    pub keys: &'a [u64],
    /// The time, read only when something is recorded (a host call).
    pub now_ms: &'a dyn Fn() -> u64,
}

/// What settling an answer changed in what the policy keeps.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Settled {
    /// Records taken back from a chosen endpoint that did not serve the request.
    pub withdrawn: usize,
    /// Records written for the first time (for the host that served instead).
    pub recorded: usize,
    /// The engine cached clearly less than predicted: its eviction horizon rose.
    pub eviction_seen: bool,
}

/// What a policy reads of a request beyond its body: each is a host call the other policies
/// skip.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Needs {
    /// The session header's value ([`Input::session`]).
    pub session: bool,
    /// Something unique to the request (Envoy's `x-request-id`), for [`Input::nonce`].
    pub request_id: bool,
}

/// A way of picking endpoints.
pub trait Policy {
    /// What the policy reads of the request beyond its body.
    fn needs(&self) -> Needs {
        Needs::default()
    }

    /// Picks one of `candidates` (never empty); `None` when the policy lacks what it needs (a
    /// session policy without a session).
    fn pick(&mut self, candidates: &[Candidate], input: &Input) -> Option<Pick>;

    /// The request now goes to `candidates[pick.index]`: remember what that teaches. Returns the
    /// shared-data keys written for the first time (cache_aware: affinity slots).
    fn routed(&mut self, _candidates: &[Candidate], _input: &Input, _pick: &Pick) -> usize {
        0
    }

    /// Called periodically (each worker's tick): refresh what the policy keeps from shared data;
    /// `completed` holds each engine's finished-requests counter (address, count) as last polled.
    /// Returns how many groups it places by balance (cache_aware), for a gauge.
    fn tick(
        &mut self,
        _store: &dyn SharedStore,
        _now_ms: u64,
        _completed: &[(&str, f64)],
    ) -> usize {
        0
    }

    /// The request routed with `ticket` was answered: settle what [`routed`](Self::routed)
    /// taught.
    fn answered(&self, _store: &dyn SharedStore, _ticket: Ticket, _answer: &Answer) -> Settled {
        Settled::default()
    }
}

/// The policy the config names.
pub fn build(config: &Config) -> Box<dyn Policy> {
    let overload = OverloadBound {
        abs: config.balance_abs_threshold,
        rel: config.balance_rel_threshold,
    };
    match config.policy {
        PolicyKind::CacheAware => {
            let index =
                cache_aware::AffinityIndex::new(config.affinity_capacity, config.eviction_grace_ms);
            let policy = cache_aware::CacheAware::new(
                config.affinity_capacity,
                config.cache_threshold,
                overload,
                config.stats_interval_ms * cache_aware::WARMUP_POLLS,
                config.stats_interval_ms * cache_aware::HOLD_POLLS,
            );
            let policy = policy.with_index(Box::new(index));
            Box::new(match config.index_cluster {
                Some(_) => policy.with_engine_index(cache_aware::EngineHolders::new(
                    config.engine_index_capacity,
                    crate::freshness::max_age_ms(config.stats_interval_ms),
                    config.cache_threshold,
                )),
                None => policy,
            })
        }
        PolicyKind::RoundRobin => Box::new(round_robin::RoundRobin),
        PolicyKind::LeastRequest => Box::new(least_request::LeastRequest),
        PolicyKind::Session => Box::new(session::Session),
        PolicyKind::PrefixHash => Box::new(prefix_hash::PrefixHash { overload }),
    }
}

#[cfg(test)]
pub(crate) mod testing {
    use super::*;
    use crate::rendezvous::endpoint_id;
    use crate::store::MemoryStore;

    pub const ADDRS: [&str; 8] = [
        "127.0.0.1:8001",
        "127.0.0.1:8002",
        "127.0.0.1:8003",
        "127.0.0.1:8004",
        "127.0.0.1:8005",
        "127.0.0.1:8006",
        "127.0.0.1:8007",
        "127.0.0.1:8008",
    ];

    pub fn candidates(loads: &[u64]) -> Vec<Candidate<'static>> {
        loads
            .iter()
            .zip(ADDRS)
            .map(|(&load, addr)| Candidate {
                id: endpoint_id(addr),
                addr,
                load,
                queueing: false,
                retention_ms: None,
                queued_prefill: 0,
                prefill_rate: 1.0,
            })
            .collect()
    }

    /// Keys of `text` in 10-byte chunks, its first 40 bytes its head.
    pub fn keys(text: &str) -> PrefixKeys {
        let shape = crate::prefix::Shape {
            chunk_size: 10,
            max_chunks: 64,
            group_bytes: 40,
        };
        PrefixKeys::new("m", text, 40, true, shape)
    }

    pub fn input<'a>(keys: &'a PrefixKeys, store: &'a MemoryStore) -> Input<'a> {
        Input {
            keys,
            session: None,
            nonce: 0,
            store,
            now_ms: 1,
            prompt_bytes: keys.keys.len() * 10,
            chunk_size: 10,
        }
    }

    pub fn overload() -> OverloadBound {
        OverloadBound { abs: 2, rel: 1.5 }
    }
}
