//! The workload's ceiling: its prefix hit rate with an unbounded cache and perfect routing, every
//! prefix computed once fleet-wide. Counted the way the simulator counts hits (whole blocks of
//! its tokenizer's tokens, the last prompt token always recomputed), over the same requests.

use crate::workload::{Api, Workload};
use kvroute_sim::prefix_cache::{block_hashes, usable_hit_blocks};
use kvroute_sim::request::{prompt_tokens, Endpoint};
use kvroute_sim::spec::FleetSpec;
use serde_json::{json, Value};
use std::collections::HashSet;

/// The hit rate of the first `sent` requests of `workload` on one infinite cache.
pub fn hit_rate(workload: &Workload, fleet_spec: &Value, sent: usize) -> Result<f64, String> {
    let spec: FleetSpec =
        serde_json::from_value(fleet_spec.clone()).map_err(|e| format!("fleet spec: {e}"))?;
    let bs = spec.block_size.max(1);
    let endpoint = match workload.api {
        Api::Chat => Endpoint::Chat,
        Api::Completions => Endpoint::Completion,
    };
    let tokens = |body: &Value| prompt_tokens(endpoint, body).map(|(t, _)| t);
    let mut cached: HashSet<u64> = HashSet::new();
    // The readiness probe each run sends first is in the caches too, though not counted.
    let ping = match workload.api {
        Api::Chat => {
            json!({"model": spec.model, "messages": [{"role": "user", "content": "ping"}]})
        }
        Api::Completions => json!({"model": spec.model, "prompt": "ping"}),
    };
    cached.extend(block_hashes(&tokens(&ping)?, bs));
    let (mut hits, mut queries) = (0usize, 0usize);
    for req in workload.stream(&spec.model).take(sent) {
        let t = tokens(&req.body)?;
        let hashes = block_hashes(&t, bs);
        let matched = hashes.iter().take_while(|h| cached.contains(h)).count();
        hits += usable_hit_blocks(matched, t.len(), bs) * bs;
        queries += t.len();
        cached.extend(hashes);
    }
    Ok(hits as f64 / queries.max(1) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeated_prefixes_hit_and_the_ceiling_is_a_rate() {
        let w = Workload::from_file(
            &crate::paths::workspace_root().join("bench/workloads/zipf-pressure.json"),
        )
        .unwrap();
        let fleet = json!({"replicas": 4, "kv_capacity_tokens": 9216});
        let few = hit_rate(&w, &fleet, 1).unwrap();
        assert_eq!(few, 0.0, "the first request hits nothing");
        let many = hit_rate(&w, &fleet, 400).unwrap();
        assert!(many > 0.5 && many < 1.0, "{many}");
    }
}
