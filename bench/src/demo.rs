//! `demo` (what `make run` does): kvroute vs round robin on a small embedded fleet and workload,
//! printing where requests went, how many followed cache affinity, and the hit rates; with
//! `--precise` (`make run PRECISE=1`), kvroute in precise mode vs kvroute; with `--epp`
//! (`make run EPP=1`), kvroute-epp behind plain Envoy vs round robin.

use crate::compare::{replica_shares, run_one, RouterRun};
use crate::report::RouterResult;
use crate::routers::{Router, ENVOY_WORKERS};
use crate::workload::Workload;
use serde_json::Value;

/// The demo's fleet and workload, compiled in so `make run` needs no files.
pub const DEMO_FLEET: &str = include_str!("../fleets/demo.json");
pub const DEMO_WORKLOAD: &str = include_str!("../workloads/demo.json");

pub async fn demo(precise: bool, epp: bool) -> Result<(), String> {
    let fleet: Value = serde_json::from_str(DEMO_FLEET).map_err(|e| format!("demo fleet: {e}"))?;
    // Precise mode: both fleets tokenize with the simulator's BPE, which the indexer decodes.
    let (fleet, _, _tokenizer) = match precise {
        true => crate::precise::with_tokenizer(&fleet)?,
        false => (fleet, Value::Null, None),
    };
    let (base, candidate) = match (precise, epp) {
        (true, _) => (Router::Kvroute(None), Router::KvroutePrecise),
        (false, true) => (Router::RoundRobin, Router::KvrouteEpp(None)),
        (false, false) => (Router::RoundRobin, Router::Kvroute(None)),
    };
    let (base_name, name) = (base.name(), candidate.name());
    let workload = Workload::from_json(DEMO_WORKLOAD)?;
    println!(
        "kvroute demo: {} groups x {} users sharing {}-token system prompts, {} s of traffic per router\n",
        workload.groups,
        workload.users_per_group,
        workload.system_prompt_tokens,
        workload.stage_duration_s * workload.arrival.stages() as f64
    );
    let rr = run_one(&fleet, None, &workload, &base, ENVOY_WORKERS).await?;
    let kv = run_one(&fleet, None, &workload, &candidate, ENVOY_WORKERS).await?;
    println!();
    for (name, run) in [(&base_name, &rr), (&name, &kv)] {
        let shares = replica_shares(&run.per_replica, "  ");
        println!("{name:>15}: requests per replica  {shares}");
    }
    let total: u64 = kv.decisions.iter().map(|(_, n)| n).sum();
    if total > 0 {
        // Sent to their group's home, after their conversation's history, or (precise mode) to
        // the engine that said it holds their prefix.
        let affinity = kv
            .decisions
            .iter()
            .filter(|(d, _)| d == "home" || d == "affinity" || d == "engine")
            .map(|(_, n)| n)
            .sum::<u64>();
        let all: Vec<String> = kv
            .decisions
            .iter()
            .map(|(d, n)| format!("{d}={n}"))
            .collect();
        println!(
            "\n{name} decisions: {}  ->  {:.0}% of requests went where their prefix was cached (home, affinity or engine)",
            all.join("  "),
            100.0 * affinity as f64 / total as f64
        );
    } else {
        println!("\nkvroute decisions: no kvroute.routed.* counters found in Envoy's stats");
    }
    let (hr_rr, hr_kv) = (hit_rate(&rr), hit_rate(&kv));
    println!(
        "\nprefix-cache hit rate: {name} {:.1}%  vs  {base_name} {:.1}%",
        hr_kv * 100.0,
        hr_rr * 100.0
    );
    if let (RouterResult::Measured(a), RouterResult::Measured(b)) = (&rr.result, &kv.result) {
        if let (Some(x), Some(y)) = (a.ttft_ms.p90, b.ttft_ms.p90) {
            println!("TTFT p90:              {name} {y:.0} ms  vs  {base_name} {x:.0} ms");
        }
    }
    println!(
        "\nNext: `make bench` compares every router (peers included) on the llm-d-shaped workload."
    );
    Ok(())
}

fn hit_rate(run: &RouterRun) -> f64 {
    match &run.result {
        RouterResult::Measured(m) => m.prefix_hit_rate,
        RouterResult::Skipped { .. } => 0.0,
    }
}
