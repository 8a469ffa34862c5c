//! kvroute's stats as the bench reads them: the families it reads by prefix (all of them, the
//! decisions, the fallbacks, the indexer polls) and each name as Prometheus text names it,
//! derived from kvroute's own names ([`kvroute::gateway::stat_names`]) so that each name is
//! written in one place.

use kvroute::gateway::stat_names::{self, Counter};

/// The prefix of `name`'s family: `name` up to and including its last dot.
fn family(name: &str) -> &str {
    name.rfind('.').map_or(name, |at| &name[..=at])
}

/// `name` as Prometheus text names it, and the bench's stat maps key it: dots as underscores
/// (`kvroute_routed_home`).
pub fn prometheus(name: &str) -> String {
    name.replace('.', "_")
}

/// Every kvroute stat's prefix (`kvroute.`).
pub fn all() -> &'static str {
    family(Counter::ServedElsewhere.name())
}

/// The per-decision counters' prefix (`kvroute.routed.`).
pub fn routed() -> &'static str {
    stat_names::ROUTED_PREFIX
}

/// The per-reason fallback counters' prefix (`kvroute.fallback.`).
pub fn fallback() -> &'static str {
    stat_names::FALLBACK_PREFIX
}

/// The counters of kvroute's polls of its indexer (`kvroute.index.`).
pub fn index() -> &'static str {
    family(Counter::IndexPollOk.name())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute::policy::Decision;
    use kvroute::router::Fallback;

    #[test]
    fn each_family_is_the_prefix_of_its_members() {
        assert!(Counter::UsageResponses.name().starts_with(all()));
        assert!(stat_names::routed(Decision::Engine).starts_with(routed()));
        assert!(stat_names::fallback(Fallback::NoModel).starts_with(fallback()));
        assert!(Counter::IndexResyncs.name().starts_with(index()));
        for family in [all(), routed(), fallback(), index()] {
            assert!(
                family.ends_with('.') && family.starts_with(all()),
                "{family}"
            );
        }
        assert_ne!(routed(), all());
        assert_eq!(
            prometheus(&stat_names::routed(Decision::Home)),
            "kvroute_routed_home"
        );
    }
}
