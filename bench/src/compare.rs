//! `compare`: runs one workload through each router, each against a fresh (cold) sim fleet.

use crate::analyze;
use crate::driver::{self, Sample};
use crate::precise::{self, IndexFreshness};
use crate::real_fleet::RealFleet;
use crate::report::{measure, Measured, Results, RouterResult};
use crate::routers::{Router, Running};
use crate::sim_process::SimFleet;
use crate::stamp::Stamp;
use crate::workload::{Api, Workload};
use kvroute::gateway::stat_names::Counter;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The counters of kvroute's corrections printed after each run: the engine reported less cached
/// than predicted, affinity withdrawn from a host that did not serve, and another host served.
const CORRECTIONS: [Counter; 3] = [
    Counter::EvictionsSeen,
    Counter::AffinityWithdrawn,
    Counter::ServedElsewhere,
];

/// kvroute's counters of its polls of the indexer: answered and applied, and not.
const INDEX_POLLS: [Counter; 2] = [Counter::IndexPollOk, Counter::IndexPollFailed];

/// How long a started router may take to serve its first request before it is skipped.
const FIRST_REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// One router's run, with what the demo wants beyond the results line.
pub struct RouterRun {
    pub result: RouterResult,
    /// Requests each replica served during the run (by replica id order).
    pub per_replica: Vec<u64>,
    /// kvroute's `routed.<decision>` counters (empty for other routers).
    pub decisions: Vec<(String, u64)>,
    /// kvroute's corrections of its map from what Envoy and the engines said (empty for other
    /// routers).
    pub corrections: Vec<(String, u64)>,
    /// Every request as the client saw it.
    pub samples: Vec<Sample>,
}

/// Runs every router in turn, its Envoys (if any) with `workers` worker threads, and collects the
/// results (skipped routers included).
pub async fn compare(
    fleet_spec: &Value,
    workload: &Workload,
    routers: &[Router],
    workers: u32,
) -> Result<Results, String> {
    let stamp = Stamp::now();
    let mut results = Vec::new();
    let mut samples = Vec::new();
    let mut sent = 0;
    // Real engines start once (a minute or more) and serve every router, caches emptied between.
    let real = match crate::real_fleet::is_real(fleet_spec) {
        true => Some(Arc::new(RealFleet::start(fleet_spec).await?)),
        false => None,
    };
    // Precise mode decodes the engines' blocks with a tokenizer file: with a precise router in
    // the run, every router's fleet tokenizes with the simulator's BPE, so all see one fleet.
    let (fleet_spec, shown_spec, _tokenizer) =
        match real.is_none() && routers.iter().any(Router::is_precise) {
            true => precise::with_tokenizer(fleet_spec)?,
            false => (fleet_spec.clone(), fleet_spec.clone(), None),
        };
    let fleet_spec = &fleet_spec;
    for (i, router) in routers.iter().enumerate() {
        eprintln!("== [{}/{}] {}", i + 1, routers.len(), router.name());
        let run = run_one(fleet_spec, real.as_ref(), workload, router, workers).await?;
        if !run.decisions.is_empty() {
            let d: Vec<String> = run
                .decisions
                .iter()
                .filter(|(_, n)| *n > 0)
                .map(|(k, n)| format!("{k}={n}"))
                .collect();
            eprintln!("   kvroute decisions: {}", d.join(" "));
        }
        if !run.corrections.is_empty() {
            let c: Vec<String> = run
                .corrections
                .iter()
                .map(|(k, n)| format!("{k}={n}"))
                .collect();
            eprintln!("   kvroute map corrections: {}", c.join(" "));
        }
        if !run.per_replica.is_empty() {
            eprintln!(
                "   requests per replica: {}",
                replica_shares(&run.per_replica, " ")
            );
            let moves = group_replica_changes(&run.samples);
            let why: Vec<String> = moves
                .cold_by_decision
                .iter()
                .map(|(d, n)| format!("{d} {n}"))
                .collect();
            let why = match why.is_empty() {
                true => String::new(),
                false => format!("; kvroute's decisions: {}", why.join(", ")),
            };
            eprintln!(
                "   group replica changes: {} ({} onto a replica without the group's prefix{why})",
                moves.changes, moves.cold
            );
            if let Some((across, within)) = moves.gateway_rates() {
                eprintln!(
                    "   instances agreeing: {:.1}% of a group's consecutive requests through different instances changed replica, {:.1}% through the same one",
                    across * 100.0,
                    within * 100.0
                );
            }
            eprintln!(
                "   group requests without their prefix cached: {} on a replica new to the group, {} on one that had served it",
                moves.misses_new_there, moves.misses_served_before
            );
            let phases: Vec<String> = hit_rate_by_phase(&run.samples)
                .iter()
                .map(|(name, hit)| match hit {
                    Some(h) => format!("{name} {:.1}%", h * 100.0),
                    None => format!("{name} -"),
                })
                .collect();
            eprintln!("   hit rate by send time: {}", phases.join(", "));
        }
        if let RouterResult::Measured(m) = &run.result {
            sent = sent.max(m.requests as usize);
        }
        samples.push((router.name(), run.samples));
        results.push(run.result);
    }
    // The bounds count tokens as the sim does; real engines' tokenizer counts others.
    let bounds = (sent > 0 && real.is_none())
        .then(|| analyze::ceiling::bounds(workload, fleet_spec, sent))
        .transpose()?;
    if let Some(b) = bounds {
        eprintln!(
            "   ceiling hit rate (unbounded cache, perfect routing): {:.4}",
            b.ceiling
        );
        eprintln!(
            "   capacity bound (the fleet's KV blocks, the best eviction): {:.4}; the fleet's blocks as one LRU cache: {:.4}",
            b.capacity, b.fleet_lru
        );
        for r in &results {
            if let RouterResult::Measured(m) = r {
                if m.prefix_hit_rate > b.capacity + 1e-4 {
                    eprintln!(
                        "   WARNING: {} hit rate {} is above the capacity bound",
                        m.router, m.prefix_hit_rate
                    );
                }
            }
        }
    }
    let rounded = bounds.map(analyze::ceiling::Bounds::rounded);
    Ok(Results {
        stamp: Some(stamp),
        workload: serde_json::to_value(workload).map_err(|e| e.to_string())?,
        fleet: shown_spec,
        envoy_workers: workers,
        ceiling_hit_rate: rounded.map(|b| b.ceiling),
        capacity_bound_hit_rate: rounded.map(|b| b.capacity),
        fleet_lru_hit_rate: rounded.map(|b| b.fleet_lru),
        results,
        samples,
    })
}

/// Starts a fresh fleet (or, given `real` engines, empties their caches) and `router` (its Envoys
/// with `workers` worker threads), drives the workload, and measures. A router that cannot be
/// started is reported as skipped; a fleet that cannot be started is an error.
pub async fn run_one(
    fleet_spec: &Value,
    real: Option<&Arc<RealFleet>>,
    workload: &Workload,
    router: &Router,
    workers: u32,
) -> Result<RouterRun, String> {
    let name = router.name();
    let fleet = match real {
        Some(real) => SimFleet::on_real(real.clone()).await?,
        None => SimFleet::start(fleet_spec).await?,
    };
    let skipped = |reason: String| {
        eprintln!("   {name}: skipped: {reason}");
        Ok(RouterRun {
            result: RouterResult::Skipped {
                router: name.clone(),
                skipped: reason,
            },
            per_replica: Vec::new(),
            decisions: Vec::new(),
            corrections: Vec::new(),
            samples: Vec::new(),
        })
    };
    let running = match router.start(&fleet, fleet_spec, workers).await {
        Ok(r) => r,
        Err(reason) => return skipped(reason),
    };
    let indexers = running.indexers();
    if !indexers.is_empty() {
        // Every indexer has heard every replica (the probes that made them publish cached
        // blocks): empty the caches, as every other router's run starts.
        if let Err(reason) = precise::reset_caches(&fleet, &indexers).await {
            return skipped(reason);
        }
        running.wait_index_polls(2).await;
    }
    if let Err(reason) = first_request(&running, workload, &fleet.model).await {
        return skipped(reason);
    }
    let before = fleet.state().await?;
    let usage_before = running.kvroute_usage().await;
    let polls_before = running.kvroute_counters(&INDEX_POLLS).await;
    let done = std::sync::atomic::AtomicBool::new(false);
    let drive = async {
        let outcome = driver::run(&running.url, workload, &fleet.model, &name).await;
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        outcome
    };
    // How fresh the index is, looked at through the run (nothing to look at for other routers).
    let sample = async {
        let (mut fresh, mut samples) = (0u64, 0u64);
        while !indexers.is_empty() && !done.load(std::sync::atomic::Ordering::Relaxed) {
            fresh += u64::from(precise::all_fresh(&indexers).await);
            samples += 1;
            tokio::time::sleep(precise::SAMPLE_EVERY).await;
        }
        (fresh, samples)
    };
    let (outcome, (fresh, samples)) = tokio::join!(drive, sample);
    running.settle_counters(outcome.samples.len() as u64).await;
    let after = fleet.state().await?;
    let usage_after = running.kvroute_usage().await;
    let decisions = running.kvroute_decisions().await;
    let corrections = running.kvroute_counters(&CORRECTIONS).await;
    let mut measured: Measured = measure(&name, &outcome, &before, &after);
    if !indexers.is_empty() {
        let polls_after = running.kvroute_counters(&INDEX_POLLS).await;
        let grown = |i: usize| {
            let at = |v: &[(String, u64)]| v.get(i).map_or(0, |(_, n)| *n);
            at(&polls_after).saturating_sub(at(&polls_before))
        };
        measured.index = Some(IndexFreshness::new(grown(0), grown(1), fresh, samples));
    }
    if let (Some((c0, p0)), Some((c1, p1))) = (usage_before, usage_after) {
        let prompt = p1.saturating_sub(p0);
        if prompt > 0 {
            let rate = c1.saturating_sub(c0) as f64 / prompt as f64;
            measured.engine_reported_hit_rate = Some((rate * 1e4).round() / 1e4);
        }
    }
    Ok(RouterRun {
        result: RouterResult::Measured(measured),
        per_replica: after.growth_since(&before, |r| r.requests),
        decisions,
        corrections,
        samples: outcome.samples,
    })
}

/// Sends one tiny request until the router answers 200, so a peer that is up but has not yet
/// registered its workers is not charged for it (and one that never works is skipped).
async fn first_request(running: &Running, w: &Workload, model: &str) -> Result<(), String> {
    let body = match w.api {
        Api::Chat => {
            json!({"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "ping"}]})
        }
        Api::Completions => json!({"model": model, "max_tokens": 1, "prompt": "ping"}),
    };
    let url = format!("{}{}", running.url, w.path());
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .map_err(|e| e.to_string())?;
    let deadline = Instant::now() + FIRST_REQUEST_TIMEOUT;
    let mut last = String::new();
    while Instant::now() < deadline {
        match http.post(&url).json(&body).send().await {
            Ok(r) if r.status().is_success() => return Ok(()),
            Ok(r) => {
                let status = r.status();
                last = format!(
                    "HTTP {status}: {}",
                    r.text()
                        .await
                        .unwrap_or_default()
                        .chars()
                        .take(200)
                        .collect::<String>()
                );
            }
            Err(e) => last = e.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Err(format!(
        "no successful request within {FIRST_REQUEST_TIMEOUT:?} (last: {last})"
    ))
}

/// `r0=12 r1=9 ...`: requests each replica served, joined by `sep`.
pub fn replica_shares(per_replica: &[u64], sep: &str) -> String {
    let shares: Vec<String> = per_replica
        .iter()
        .enumerate()
        .map(|(i, n)| format!("r{i}={n}"))
        .collect();
    shares.join(sep)
}

/// How often a row's groups changed replica ([`group_replica_changes`]).
#[derive(Debug, Default, PartialEq)]
pub struct ReplicaChanges {
    pub changes: u64,
    /// Those that found less than half their prompt cached there.
    pub cold: u64,
    /// The cold ones by kvroute's decision (`x-kvroute-decision`: `home`, `affinity`, ...), for
    /// rows whose router says.
    pub cold_by_decision: std::collections::BTreeMap<String, u64>,
    /// Requests of a group that found less than half their prompt cached, on a replica that had
    /// never served the group before (a first request, a move or a split)...
    pub misses_new_there: u64,
    /// ... and on one that had: it evicted the group's prefix since (or was still prefilling it).
    /// Under cache pressure these are what capacity-aware placement can win back.
    pub misses_served_before: u64,
    /// For `NAME@N`: consecutive requests of a group through different instances, and how many
    /// of those went to different replicas; then the same through one instance. Where the
    /// instances agree on every group's home the two rates match (splits and spills move both).
    pub across: (u64, u64),
    pub within: (u64, u64),
}

impl ReplicaChanges {
    /// The share of a group's consecutive requests through different instances, then through
    /// the same one, that changed replica; `None` without instance names.
    pub fn gateway_rates(&self) -> Option<(f64, f64)> {
        let rate = |(pairs, changed): (u64, u64)| changed as f64 / pairs.max(1) as f64;
        (self.across.0 + self.within.0 > 0).then(|| (rate(self.across), rate(self.within)))
    }
}

/// How often a group's request went to another replica than the group's previous request (in
/// the order they were sent), and how many of those found less than half their prompt cached
/// there, by why kvroute sent it there. The group is the workload's user tag without its member
/// and episode ([`analyze::group_of`]); requests outside any group (`u-unique-...`) and failed
/// ones are left out. A
/// router that keeps each group on one replica scores 0; one that splits a group scores its
/// alternations. Every cold request of a group is also counted by whether its replica had served
/// the group before.
pub fn group_replica_changes(samples: &[Sample]) -> ReplicaChanges {
    let mut sorted = analyze::in_send_order(samples);
    sorted.retain(|s| !s.user.starts_with("u-"));
    let mut last: std::collections::HashMap<&str, (usize, Option<&str>)> =
        std::collections::HashMap::new();
    let mut served: std::collections::HashSet<(&str, usize)> = std::collections::HashSet::new();
    let mut out = ReplicaChanges::default();
    for s in sorted {
        let Some(replica) = s.replica else {
            continue;
        };
        let group = analyze::group_of(&s.user);
        let cold = s.cached_tokens.unwrap_or(0) * 2 < s.prompt_tokens.unwrap_or(0);
        if cold {
            match served.contains(&(group, replica)) {
                true => out.misses_served_before += 1,
                false => out.misses_new_there += 1,
            }
        }
        served.insert((group, replica));
        let gateway = s.gateway.as_deref();
        let before = last.insert(group, (replica, gateway));
        if let (Some((was, Some(then))), Some(now)) = (before, gateway) {
            let pairs = match then == now {
                true => &mut out.within,
                false => &mut out.across,
            };
            pairs.0 += 1;
            pairs.1 += u64::from(was != replica);
        }
        if before.is_some_and(|(was, _)| was != replica) {
            out.changes += 1;
            if cold {
                out.cold += 1;
                if let Some(d) = &s.decision {
                    *out.cold_by_decision.entry(d.clone()).or_default() += 1;
                }
            }
        }
    }
    out
}

/// The phases of a run [`hit_rate_by_phase`] reports: routers that learn the fleet (kvroute's
/// warm-up, three gateways each counting the groups on its own) differ most in the first.
const PHASES: [(&str, f64, f64); 3] = [
    ("0-10 s", 0.0, 10_000.0),
    ("10-25 s", 10_000.0, 25_000.0),
    ("after 25 s", 25_000.0, f64::INFINITY),
];

/// The engines' hit rate (cached over prompt tokens, from each response's usage) of the requests
/// sent in each of [`PHASES`], `None` for a phase without such requests.
pub fn hit_rate_by_phase(samples: &[Sample]) -> Vec<(&'static str, Option<f64>)> {
    PHASES
        .iter()
        .map(|&(name, from, to)| {
            let (cached, prompt) = samples
                .iter()
                .filter(|s| s.error.is_none() && (from..to).contains(&s.sent_ms))
                .filter_map(|s| Some((s.cached_tokens?, s.prompt_tokens?)))
                .fold((0, 0), |(c, p), (sc, sp)| (c + sc, p + sp));
            (name, (prompt > 0).then(|| cached as f64 / prompt as f64))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::served as sample;

    #[test]
    fn hit_rate_by_phase_weighs_tokens_of_the_requests_sent_in_each_phase() {
        let samples = [
            sample("u0-0-0", 0.0, 0, 0),
            sample("u0-1-0", 9_999.0, 0, 50),
            sample("u0-2-0", 10_000.0, 0, 90),
            sample("u0-3-0", 30_000.0, 0, 100),
            Sample {
                error: Some("x".into()),
                ..sample("u0-4-0", 31_000.0, 1, 0)
            },
        ];
        let phases = hit_rate_by_phase(&samples);
        assert_eq!(phases[0], ("0-10 s", Some(0.25)));
        assert_eq!(phases[1], ("10-25 s", Some(0.9)));
        assert_eq!(phases[2], ("after 25 s", Some(1.0)));
        assert_eq!(hit_rate_by_phase(&samples[..2])[2], ("after 25 s", None));
    }

    #[test]
    fn group_replica_changes_counts_each_move_of_a_group_in_send_order() {
        let samples = [
            sample("u1-0-0", 30.0, 2, 90), // back to 2 after 1: a move, warm
            sample("u0-0-0", 0.0, 0, 0),
            sample("u1-0-0", 10.0, 2, 0),
            sample("u0-1-0", 15.0, 0, 90), // same replica: no move
            sample("u1-1-0", 20.0, 1, 10), // a move, cold
            sample("u-unique-3", 25.0, 3, 0),
            sample("u-unique-4", 26.0, 2, 0),
        ];
        let moves = group_replica_changes(&samples);
        assert_eq!((moves.changes, moves.cold), (2, 1));
        assert!(moves.cold_by_decision.is_empty(), "no router said why");
        let failed = Sample {
            error: Some("x".into()),
            ..sample("u0-2-0", 40.0, 3, 0)
        };
        assert_eq!((moves.misses_new_there, moves.misses_served_before), (3, 0));
        let one = group_replica_changes(&[samples[1].clone(), failed]);
        assert_eq!((one.changes, one.cold), (0, 0), "one request moves nothing");
        assert_eq!((one.misses_new_there, one.misses_served_before), (1, 0));
    }

    #[test]
    fn instances_that_disagree_change_replica_between_each_other() {
        let through = |user, sent_ms, replica, gateway: &str| Sample {
            gateway: Some(gateway.into()),
            ..sample(user, sent_ms, replica, 90)
        };
        let samples = [
            through("u0-0-0", 0.0, 0, "a"),
            through("u0-1-0", 1.0, 1, "b"), // across, changed
            through("u0-2-0", 2.0, 1, "b"), // within, same
            through("u0-3-0", 3.0, 0, "a"), // across, changed
            through("u1-0-0", 4.0, 2, "a"),
            through("u1-1-0", 5.0, 2, "b"), // across, same
        ];
        let moves = group_replica_changes(&samples);
        assert_eq!((moves.across, moves.within), ((3, 2), (1, 0)));
        let (across, within) = moves.gateway_rates().unwrap();
        assert!((across - 2.0 / 3.0).abs() < 1e-9 && within == 0.0);
        let plain =
            group_replica_changes(&[sample("u0-0-0", 0.0, 0, 0), sample("u0-1-0", 1.0, 1, 0)]);
        assert_eq!(plain.gateway_rates(), None, "one router names no instance");
    }

    #[test]
    fn cold_replica_changes_are_counted_by_kvroutes_decision() {
        let said = |user, sent_ms, replica, cached, decision: &str| Sample {
            decision: Some(decision.into()),
            ..sample(user, sent_ms, replica, cached)
        };
        let samples = [
            said("u0-0-0", 0.0, 0, 0, "home"),
            said("u0-1-0", 10.0, 1, 0, "home"), // cold, home moved
            said("u0-0-1", 20.0, 0, 0, "affinity"), // cold, history lost there
            said("u0-2-0", 30.0, 1, 90, "home"), // warm
            said("u0-3-0", 40.0, 2, 10, "spread"), // cold
            said("u0-3-1", 50.0, 3, 0, "home"), // cold
        ];
        let moves = group_replica_changes(&samples);
        assert_eq!((moves.changes, moves.cold), (5, 4));
        // Cold on replica 0 (new), 1 (new), 0 again (served before), 2 (new), 3 (new).
        assert_eq!((moves.misses_new_there, moves.misses_served_before), (4, 1));
        let by: Vec<(&str, u64)> = moves
            .cold_by_decision
            .iter()
            .map(|(d, n)| (d.as_str(), *n))
            .collect();
        assert_eq!(by, vec![("affinity", 1), ("home", 2), ("spread", 1)]);
    }
}
