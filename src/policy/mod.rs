//! Policies: given the candidate endpoints (healthy, with their load) and what is known about the
//! request, pick one. One file per policy; `cache_aware` is kvroute's, the rest are baselines.

mod cache_aware;
mod least_request;
mod load;
mod prefix_hash;
mod round_robin;
mod session;

pub use load::Thresholds;

use crate::affinity::Match;
use crate::config::PolicyKind;
use crate::prefix::PrefixKeys;

/// An endpoint a request may go to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    pub addr: String,
    pub id: u32,
    /// Requests in flight: the larger of kvroute's own count and Envoy's `rq_active`.
    pub load: u64,
    /// New prefixes recently placed here: breaks load ties so new prefixes spread.
    pub placed: u64,
}

/// Why an endpoint was picked. Each is a counter and a debug-header value, so names are stable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Followed the prefix to an endpoint holding it.
    Affinity,
    /// The prefix's holders were overloaded: grew it onto the next endpoint in its rendezvous order.
    Spread,
    /// No usable match, balanced fleet: least-loaded endpoint, ties broken by rendezvous.
    NewPrefix,
    /// No usable match, imbalanced fleet: least-loaded endpoint.
    Balance,
    RoundRobin,
    LeastRequest,
    Session,
    PrefixHash,
}

impl Decision {
    pub const ALL: [Decision; 8] = [
        Decision::Affinity,
        Decision::Spread,
        Decision::NewPrefix,
        Decision::Balance,
        Decision::RoundRobin,
        Decision::LeastRequest,
        Decision::Session,
        Decision::PrefixHash,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Decision::Affinity => "affinity",
            Decision::Spread => "spread",
            Decision::NewPrefix => "new_prefix",
            Decision::Balance => "balance",
            Decision::RoundRobin => "round_robin",
            Decision::LeastRequest => "least_request",
            Decision::Session => "session",
            Decision::PrefixHash => "prefix_hash",
        }
    }
}

/// What a policy may know about the request.
pub struct Input<'a> {
    pub keys: &'a PrefixKeys,
    /// The longest prefix found in the affinity map (cache_aware only).
    pub matched: Option<&'a Match>,
    pub cache_threshold: f64,
    pub thresholds: Thresholds,
    /// Hash of the session header's value, if the request has one.
    pub session: Option<u64>,
    /// A number that differs per request: the round-robin ticket, and a tie-breaker.
    pub ticket: u64,
}

/// The chosen candidate (an index into the candidates) and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pick {
    pub index: usize,
    pub decision: Decision,
}

/// Picks a candidate with policy `kind`; `None` when there is none to pick or the policy lacks
/// what it needs (a session policy without a session).
pub fn pick(kind: PolicyKind, candidates: &[Candidate], input: &Input) -> Option<Pick> {
    if candidates.is_empty() {
        return None;
    }
    match kind {
        PolicyKind::CacheAware => Some(cache_aware::pick(candidates, input)),
        PolicyKind::RoundRobin => Some(round_robin::pick(candidates, input)),
        PolicyKind::LeastRequest => Some(least_request::pick(candidates, input)),
        PolicyKind::Session => session::pick(candidates, input),
        PolicyKind::PrefixHash => Some(prefix_hash::pick(candidates, input)),
    }
}

#[cfg(test)]
pub(crate) mod testing {
    use super::*;
    use crate::rendezvous::endpoint_id;

    pub fn candidates(loads: &[u64]) -> Vec<Candidate> {
        loads
            .iter()
            .enumerate()
            .map(|(i, &load)| {
                let addr = format!("127.0.0.1:{}", 8001 + i);
                Candidate {
                    id: endpoint_id(&addr),
                    addr,
                    load,
                    placed: 0,
                }
            })
            .collect()
    }

    pub fn input<'a>(keys: &'a PrefixKeys, matched: Option<&'a Match>) -> Input<'a> {
        Input {
            keys,
            matched,
            cache_threshold: 0.3,
            thresholds: Thresholds { abs: 4, rel: 1.5 },
            session: None,
            ticket: 0,
        }
    }
}
