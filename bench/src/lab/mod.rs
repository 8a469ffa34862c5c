//! `lab`: routers against the simulator's engine model in virtual time, one thread per run, over
//! paired workload seeds, with means, 95% intervals and paired verdicts against a baseline.
//!
//! A run drives the real routing code (kvroute's `Gateway`, the indexer's own code in precise
//! mode) and the simulator's own engine core on one virtual clock, with no sockets and no clock
//! reads, so the same command gives the same bytes. bench/README.md says what it leaves out.

mod calibrate;
mod diff;
mod fleet;
mod gateways;
mod host;
pub mod index;
mod lines;
mod queue;
mod report;
mod run;
pub mod smg;
pub mod stats;

pub use calibrate::{calibrate, sources as calibration_sources};
pub use diff::diff;
pub use lines::{run as run_lines, summary as lines_summary};

use crate::routers::Router;
use crate::workload::Workload;
use kvroute_sim::bpe::Vocab;
use kvroute_sim::spec::FleetSpec;
use report::Figures;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What `kvroute-bench lab` was asked.
pub struct LabArgs {
    pub fleet: PathBuf,
    pub workload: PathBuf,
    pub routers: String,
    pub seeds: u64,
    pub baseline: Option<String>,
    pub out: Option<PathBuf>,
    pub knobs: Knobs,
}

/// How the lab runs and what it models around the engines, for every router alike.
#[derive(Debug, Clone, Copy, serde::Serialize, clap::Args)]
pub struct Knobs {
    /// Runs at once, each on its own thread (0: one per core).
    #[serde(skip)]
    #[arg(long, default_value_t = 0)]
    pub jobs: usize,
    /// Worker threads of each gateway's Envoy, each with its own kvroute.
    #[arg(long = "envoy-workers", default_value_t = crate::routers::ENVOY_WORKERS as usize)]
    pub workers: usize,
    /// Milliseconds from a gateway's poll call to its answer.
    #[arg(long, default_value_t = 1.0)]
    pub poll_latency_ms: f64,
    /// Milliseconds from an engine's KV-event batch to the indexer taking it in.
    #[arg(long, default_value_t = 2.0)]
    pub kv_event_lag_ms: f64,
    /// Share of KV-event batches the stream loses (0 to 1).
    #[arg(long, default_value_t = 0.0)]
    pub kv_event_loss: f64,
}

/// What every run of one lab invocation shares.
pub struct Options {
    pub spec: Arc<FleetSpec>,
    pub vocab: Vocab,
    /// Worker threads of each gateway's Envoy (each a `Gateway` of its own).
    pub workers: usize,
    /// From a gateway's poll call to its answer.
    pub poll_latency: Duration,
    /// From an engine's KV-event batch to the indexer taking it in.
    pub kv_event_lag: Duration,
    /// The share of KV-event batches the stream loses.
    pub kv_event_loss: f64,
    /// The plugin configuration `envoy/kvroute.yaml` ships (JSON text).
    shipped: String,
}

impl Options {
    /// The plugin configuration `router` runs kvroute with, as the wall-clock bench's Envoys do.
    pub fn plugin_config(&self, router: &Router) -> Result<String, String> {
        let overrides = match router {
            Router::KvroutePrecise => crate::precise::plugin_config(),
            Router::Kvroute(Some(policy)) => json!({ "policy": policy, "debug_header": true }),
            _ => json!({ "debug_header": true }),
        };
        kvroute_harness::bootstrap::merge_plugin_config(&self.shipped, &overrides)
            .map_err(|e| e.to_string())
    }
}

/// Runs the lab and prints its table; writes results.json and results.md to `--out`.
pub fn lab(args: &LabArgs) -> Result<(), String> {
    let fleet_text = read(&args.fleet)?;
    let fleet: Value =
        serde_json::from_str(&fleet_text).map_err(|e| format!("{}: {e}", args.fleet.display()))?;
    let workload = Workload::from_file(&args.workload)?;
    let routers = Router::parse_list(&args.routers, None)?;
    let baseline = match &args.baseline {
        Some(b) => Some(
            routers
                .iter()
                .position(|r| &r.name() == b)
                .ok_or_else(|| format!("--baseline {b}: not among --routers"))?,
        ),
        None => None,
    };
    let (seeds, figures) = measure(&fleet, &workload, &routers, args.seeds, &args.knobs)?;
    let table = report::Table {
        workload: &workload,
        fleet,
        seeds: &seeds,
        routers: &routers,
        figures: &figures,
        baseline,
        knobs: args.knobs,
    };
    print!("{}", table.markdown());
    if let Some(out) = &args.out {
        table.write(out)?;
    }
    Ok(())
}

/// Every router on `k` seeds of `workload` on the fleet `fleet`: the seeds, and each router's
/// runs in seed order.
pub fn measure(
    fleet: &Value,
    workload: &Workload,
    routers: &[Router],
    k: u64,
    knobs: &Knobs,
) -> Result<(Vec<u64>, Vec<Figures>), String> {
    let opts = Options::new(fleet, routers, knobs)?;
    let seeds = seeds_from(workload, k);
    let figures = run_all(&opts, workload, routers, &seeds, knobs.jobs)?;
    Ok((seeds, figures))
}

/// `k` seeds: the workload's own, then the next ones (as `compare --repeat` takes them).
fn seeds_from(workload: &Workload, k: u64) -> Vec<u64> {
    (0..k).map(|i| workload.seed.wrapping_add(i)).collect()
}

impl Options {
    /// The options for runs of `routers` on the fleet `fleet` (its spec as JSON): a fleet that
    /// tokenizes with the simulator's BPE when a router is precise, as `compare` runs one.
    pub fn new(fleet: &Value, routers: &[Router], knobs: &Knobs) -> Result<Options, String> {
        let spec = FleetSpec::from_json(&fleet.to_string()).map_err(|e| format!("fleet: {e}"))?;
        let vocab = match routers.iter().any(Router::is_precise) {
            true => Vocab::from_tokenizer(kvroute_sim::bpe::train()?)?,
            false => Vocab::Hash,
        };
        let shipped_yaml = read(&kvroute_harness::paths::shipped_bootstrap())?;
        let shipped = kvroute_harness::bootstrap::shipped_plugin_config(&shipped_yaml)
            .map_err(|e| e.to_string())?;
        let ms = |v: f64| Duration::from_secs_f64(v.max(0.0) / 1000.0);
        Ok(Options {
            spec: Arc::new(spec),
            vocab,
            workers: knobs.workers.max(1),
            poll_latency: ms(knobs.poll_latency_ms),
            kv_event_lag: ms(knobs.kv_event_lag_ms),
            kv_event_loss: knobs.kv_event_loss.clamp(0.0, 1.0),
            shipped,
        })
    }
}

fn read(path: &Path) -> Result<String, String> {
    std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))
}

/// Every router on every seed, `jobs` runs at a time; each router's figures in seed order.
fn run_all(
    opts: &Options,
    workload: &Workload,
    routers: &[Router],
    seeds: &[u64],
    jobs: usize,
) -> Result<Vec<Figures>, String> {
    let total = routers.len() * seeds.len();
    let threads = match jobs {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    }
    .clamp(1, total.max(1));
    let next = AtomicUsize::new(0);
    let done: Mutex<Vec<Option<Result<crate::report::Measured, String>>>> =
        Mutex::new(vec![None; total]);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let job = next.fetch_add(1, Ordering::Relaxed);
                if job >= total {
                    return;
                }
                let (r, k) = (job / seeds.len(), job % seeds.len());
                let mut w = workload.clone();
                w.seed = seeds[k];
                let started = Instant::now();
                let result = one(opts, &w, &routers[r]);
                if let Ok(m) = &result {
                    eprintln!(
                        "[lab] {} seed {}: hit {:.1}%, TTFT p90 {:.0} ms, {} requests ({:.1} s)",
                        m.router,
                        w.seed,
                        m.prefix_hit_rate * 100.0,
                        m.ttft_ms.p90.unwrap_or(0.0),
                        m.requests,
                        started.elapsed().as_secs_f64()
                    );
                }
                if let Ok(mut done) = done.lock() {
                    done[job] = Some(result);
                }
            });
        }
    });
    let done = done.into_inner().map_err(|_| "a lab run panicked")?;
    let mut out: Vec<Figures> = routers.iter().map(|_| Figures::default()).collect();
    for (job, result) in done.into_iter().enumerate() {
        let r = job / seeds.len();
        match result {
            Some(Ok(m)) => out[r].runs.push(m),
            Some(Err(e)) => out[r].skipped = Some(e),
            None => out[r].skipped = Some("not run".into()),
        }
    }
    Ok(out)
}

/// One seed through one router.
pub fn one(
    opts: &Options,
    workload: &Workload,
    router: &Router,
) -> Result<crate::report::Measured, String> {
    let run = run::Run::new(opts, workload, router)?;
    let (outcome, per_replica, hits, queries) = run.finish();
    Ok(crate::report::measured(
        &router.name(),
        &outcome,
        hits,
        queries,
        &per_replica,
    ))
}
