//! The name of every stat kvroute defines (Envoy shows them as `wasmcustom.kvroute.*`), each
//! written once: the stats of fixed name as enums, the per-decision, per-reason, per-outcome and
//! per-endpoint families as functions of their member. What each one means, for operators:
//! docs/operations.md.

use strum::{IntoStaticStr, VariantArray};

use crate::policy::Decision;
use crate::router::Fallback;
use crate::template::Outcome;

/// kvroute's counters of fixed name, all defined (at zero) when a gateway starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, IntoStaticStr, VariantArray)]
pub enum Counter {
    /// Envoy admin `/clusters` polls answered, and failed (no answer, an error, a bad body).
    #[strum(serialize = "kvroute.stats_poll.ok")]
    StatsPollOk,
    #[strum(serialize = "kvroute.stats_poll.failed")]
    StatsPollFailed,
    /// Engine `/metrics` polls answered, and failed.
    #[strum(serialize = "kvroute.engine_poll.ok")]
    EnginePollOk,
    #[strum(serialize = "kvroute.engine_poll.failed")]
    EnginePollFailed,
    /// SGLang load-snapshot polls answered, and failed.
    #[strum(serialize = "kvroute.engine_poll.loads_ok")]
    LoadsPollOk,
    #[strum(serialize = "kvroute.engine_poll.loads_failed")]
    LoadsPollFailed,
    /// Endpoints this worker marked suspect, and marks it learnt from other workers.
    #[strum(serialize = "kvroute.suspect_marked")]
    SuspectMarked,
    #[strum(serialize = "kvroute.suspect_learned")]
    SuspectLearned,
    /// Requests in flight removed where kvroute's count stayed above Envoy's `rq_active`.
    #[strum(serialize = "kvroute.inflight_corrected")]
    InflightCorrected,
    /// Engines whose load was stale when a poll round was published.
    #[strum(serialize = "kvroute.engine_poll.stale")]
    EnginePollStale,
    /// kvroute-indexer polls applied, and failed; full resyncs among the applied.
    #[strum(serialize = "kvroute.index.poll_ok")]
    IndexPollOk,
    #[strum(serialize = "kvroute.index.poll_failed")]
    IndexPollFailed,
    #[strum(serialize = "kvroute.index.resyncs")]
    IndexResyncs,
    /// Engine-index keys the indexer's answers stored and dropped, and keys pushed out of a full
    /// slot.
    #[strum(serialize = "kvroute.index.held")]
    IndexHeld,
    #[strum(serialize = "kvroute.index.dropped")]
    IndexDropped,
    #[strum(serialize = "kvroute.index.overflowed")]
    IndexOverflowed,
    /// Responses served by another host than the one kvroute chose.
    #[strum(serialize = "kvroute.served_elsewhere")]
    ServedElsewhere,
    /// Affinity records withdrawn from a host that did not serve, and evictions the closed loop
    /// learnt.
    #[strum(serialize = "kvroute.affinity.withdrawn")]
    AffinityWithdrawn,
    #[strum(serialize = "kvroute.affinity.evictions_seen")]
    EvictionsSeen,
    /// What engines reported in responses' `usage`: the responses, their prompt tokens and
    /// cached tokens (also per endpoint: [`Counter::of_endpoint`]).
    #[strum(serialize = "kvroute.usage.responses")]
    UsageResponses,
    #[strum(serialize = "kvroute.usage.prompt_tokens")]
    UsagePromptTokens,
    #[strum(serialize = "kvroute.usage.cached_tokens")]
    UsageCachedTokens,
}

impl Counter {
    pub fn name(self) -> &'static str {
        self.into()
    }

    /// The same counter of one endpoint (`seg`: its address as a stat segment,
    /// [`stat_segment`](crate::usage::stat_segment)).
    pub fn of_endpoint(self, seg: &str) -> String {
        format!("{}.{seg}", self.name())
    }
}

/// kvroute's gauges of fixed name, defined when first written (but for `SlotsUsed`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, IntoStaticStr, VariantArray)]
pub enum Gauge {
    /// Healthy endpoints in the last host snapshot.
    #[strum(serialize = "kvroute.endpoints_known")]
    EndpointsKnown,
    /// Groups placed by the balanced assignment.
    #[strum(serialize = "kvroute.groups_placed")]
    GroupsPlaced,
    /// Engines whose event stream the indexer cannot vouch for now.
    #[strum(serialize = "kvroute.index.stale_engines")]
    IndexStaleEngines,
    /// Affinity slots written so far, defined at start.
    #[strum(serialize = "kvroute.affinity.slots_used")]
    SlotsUsed,
}

impl Gauge {
    pub fn name(self) -> &'static str {
        self.into()
    }
}

/// The histogram of the share of a request's prefix found, in percent.
pub const MATCH_PERCENT: &str = "kvroute.match_percent";

/// What the name of every per-decision counter ([`routed`]) starts with: their sum is the
/// requests kvroute routed.
pub const ROUTED_PREFIX: &str = "kvroute.routed.";

/// What the name of every per-reason counter ([`fallback`]) starts with: their sum is the
/// requests kvroute left to Envoy.
pub const FALLBACK_PREFIX: &str = "kvroute.fallback.";

/// What the name of every per-endpoint in-flight gauge ([`inflight`]) starts with.
pub const INFLIGHT_PREFIX: &str = "kvroute.inflight.";

/// Requests routed with `decision`.
pub fn routed(decision: Decision) -> String {
    format!("{ROUTED_PREFIX}{}", decision.name())
}

/// Requests left to Envoy for `reason`.
pub fn fallback(reason: Fallback) -> String {
    format!("{FALLBACK_PREFIX}{}", reason.name())
}

/// Chat requests whose prompt had `outcome` under the templates.
pub fn template(outcome: Outcome) -> String {
    format!("kvroute.template.{}", outcome.name())
}

/// The gauge of kvroute's requests in flight at one endpoint (`seg`, as for
/// [`Counter::of_endpoint`]).
pub fn inflight(seg: &str) -> String {
    format!("{INFLIGHT_PREFIX}{seg}")
}

/// The histogram of one endpoint's measured time to first token, in percent of the expected.
pub fn ttft_estimate(seg: &str) -> String {
    format!("kvroute.ttft_estimate_percent.{seg}")
}

#[cfg(test)]
mod tests {
    use strum::VariantArray;

    use super::*;

    /// Every member's name, in order, joined by spaces.
    fn joined<T: Copy + Into<&'static str>>(all: &[T]) -> String {
        let names: Vec<&str> = all.iter().map(|&m| m.into()).collect();
        names.join(" ")
    }

    /// Derived from the variants' names, these are stat names and debug-header values (`home`,
    /// `fallback:no_cluster`) that dashboards and users rely on: renaming a variant must not
    /// move them.
    #[test]
    fn decision_reason_and_outcome_names_stay_the_ones_in_use() {
        assert_eq!(
            joined(Decision::VARIANTS),
            "engine affinity home spread balance round_robin least_request session prefix_hash"
        );
        assert_eq!(
            joined(Fallback::VARIANTS),
            "method path empty_body body_too_large bad_json no_model no_prompt no_cluster \
             no_healthy_endpoint no_session no_body_access stale_hosts stale_engine_loads"
        );
        assert_eq!(joined(Outcome::VARIANTS), "rendered no_template failed");
    }
}
