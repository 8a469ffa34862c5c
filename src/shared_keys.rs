//! Every key kvroute keeps in Envoy's shared data (which all worker VMs of one Envoy share), with
//! what it holds: the single keys, then the families of slots and shards, a prefix and a number.

/// The host snapshot (clusters, hosts, health, engine loads) the poll writes for every worker
/// (`gateway`).
pub const HOSTS: &str = "kvroute.hosts";
/// The lease of the current poll round: which worker polls (`freshness::RoundLease`).
pub const POLL_ROUND: &str = "kvroute.poll_round";
/// Each engine's last load and what was learnt of its capacity, across poll rounds
/// (`gateway::poll`).
pub const ENGINE_LOADS: &str = "kvroute.engine";
/// Endpoints that just failed a request, marked by any worker (`suspects`).
pub const SUSPECTS: &str = "kvroute.suspects";
/// kvroute's requests in flight per endpoint and the prefill they queue, every worker's
/// (`in_flight`).
pub const LOAD: &str = "kvroute.load";
/// Each endpoint's eviction horizon (`eviction`).
pub const EVICTIONS: &str = "kvroute.evictions";
/// The engine index's status: the indexer's feed it follows, how far it got (`holders::engine`).
pub const ENGINE_INDEX_STATUS: &str = "kvroute.engine_index.status";
/// The group weights the leading worker published (`placement::leader`).
pub const GROUPS_PUBLISHED: &str = "kvroute.groups.published";
/// The round-robin baseline's ticket (`policy::round_robin`).
pub const TICKET: &str = "kvroute.ticket";

/// Slot `slot` of the affinity map: records of who served which prefix (`holders::affinity`).
pub fn affinity_slot(slot: u64) -> String {
    format!("kvroute.affinity.{slot}")
}

/// Slot `slot` of the engine index: which engines report holding which prefix (`holders::engine`).
pub fn engine_index_slot(slot: u64) -> String {
    format!("kvroute.engine_index.{slot}")
}

/// Shard `shard` of the groups seen and their request counts (`placement::table`).
pub fn groups_shard(shard: usize) -> String {
    format!("kvroute.groups.{shard}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_two_keys_meet() {
        let single = [
            HOSTS,
            POLL_ROUND,
            ENGINE_LOADS,
            SUSPECTS,
            LOAD,
            EVICTIONS,
            ENGINE_INDEX_STATUS,
            GROUPS_PUBLISHED,
            TICKET,
        ];
        let families = [affinity_slot(7), engine_index_slot(7), groups_shard(7)];
        let prefixes: Vec<&str> = families.iter().map(|k| &k[..k.len() - 1]).collect();
        let distinct: std::collections::HashSet<&str> = single.into_iter().collect();
        assert_eq!(distinct.len(), single.len());
        for key in single {
            // A single key beside a family is never one of its numbered members.
            let member = |p: &&str| {
                key.strip_prefix(*p)
                    .is_some_and(|n| n.parse::<u64>().is_ok())
            };
            assert!(!prefixes.iter().any(member), "{key}");
        }
    }
}
