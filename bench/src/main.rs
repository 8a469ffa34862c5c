//! kvroute-bench: drives one workload through several routers, each against a fresh simulated
//! fleet, and writes results.json / results.md / ttft.svg. `demo` is the short `make run` tour.

mod ceiling;
mod compare;
mod demo;
mod driver;
mod instructions;
mod misses;
mod oracle;
mod overhead;
mod paths;
mod peers;
mod real_fleet;
mod repeats;
mod report;
mod routers;
mod sim_process;
mod stats;
mod workload;

use clap::{Parser, Subcommand};
use std::path::PathBuf;

#[derive(Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Compare routers on one workload and fleet; writes DIR/results.{json,md} and DIR/ttft.svg.
    Compare {
        /// Fleet spec (JSON), passed to kvroute-sim as --fleet and echoed in the results.
        #[arg(long)]
        fleet: PathBuf,
        /// Workload spec (JSON); see bench/README.md.
        #[arg(long)]
        workload: PathBuf,
        /// Comma-separated: round_robin, least_request, ring_hash, kvroute, kvroute:<policy>,
        /// smg, vllm-router:<policy>, oracle; NAME@N runs N instances of NAME behind one
        /// round-robin Envoy.
        #[arg(long, default_value = "round_robin,kvroute,oracle")]
        routers: String,
        /// Output directory.
        #[arg(long)]
        out: PathBuf,
        /// Runs the comparison N times, each with the next workload seed (DIR/run-<r>), and
        /// writes how often the first router was at least as good as each other one
        /// (DIR/repeats.md, repeats.json).
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
        repeat: u64,
        /// Another build of the filter, run as router `kvroute-b` (name it in --routers) beside
        /// `kvroute`: two builds on the same requests, in the same minutes.
        #[arg(long, value_name = "WASM")]
        compare_wasm: Option<PathBuf>,
        /// Worker threads of each Envoy the routers start (each worker has its own kvroute VM).
        /// A standalone Envoy runs one per core.
        #[arg(long, default_value_t = routers::ENVOY_WORKERS,
              value_parser = clap::value_parser!(u32).range(1..=16))]
        envoy_workers: u32,
    },
    /// kvroute vs round robin on a small embedded fleet and workload (about a minute).
    Demo,
    /// CPU per request and latency kvroute adds, next to plain Envoy, the floor filter, smg and
    /// vllm-router, all measured in one interleaved run.
    Overhead {
        /// Seconds per measured phase.
        #[arg(long, default_value_t = 10)]
        seconds: u64,
        /// kvroute plugin config laid over the shipped one (JSON object), e.g. '{"policy":"round_robin"}'.
        #[arg(long, default_value = "{}")]
        plugin_config: String,
        /// The configs to measure, comma-separated (plain, the baseline, always runs), e.g.
        /// `floor,kvroute` to compare builds quickly. Default: all.
        #[arg(long, value_delimiter = ',')]
        configs: Vec<String>,
        /// Also write the rows (config, prompt_bytes, cpu_us_per_request, added_p50_us,
        /// added_p99_us, ...) as JSON to FILE.
        #[arg(long, value_name = "FILE")]
        json: Option<PathBuf>,
        /// Also measure this other build of the filter, as config `kvroute-b`, side by side with
        /// `kvroute` (a change's cost: before and after).
        #[arg(long, value_name = "WASM")]
        compare_wasm: Option<PathBuf>,
    },
    /// Instructions per request of plain Envoy, the floor filter and kvroute, each Envoy run
    /// under valgrind's callgrind: counts that do not move with the machine's load (minutes).
    Instructions {
        /// Requests counted per config and prompt size.
        #[arg(long, default_value_t = 200)]
        requests: usize,
        /// kvroute plugin config laid over the shipped one (JSON object).
        #[arg(long, default_value = "{}")]
        plugin_config: String,
        /// The configs to count, comma-separated (plain, the baseline, always runs). Default: all.
        #[arg(long, value_delimiter = ',')]
        configs: Vec<String>,
        /// Also count this other build of the filter, as config `kvroute-b`.
        #[arg(long, value_name = "WASM")]
        compare_wasm: Option<PathBuf>,
        /// Keep callgrind's dumps in DIR (one per config and kind, for `callgrind_annotate`)
        /// instead of deleting them.
        #[arg(long, value_name = "DIR")]
        keep_dumps: Option<PathBuf>,
    },
}

fn main() {
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => fail(format!("tokio runtime: {e}")),
    };
    let outcome = rt.block_on(async {
        let work = async {
            match cli.command {
                Cmd::Compare {
                    fleet,
                    workload,
                    routers,
                    out,
                    repeat,
                    compare_wasm,
                    envoy_workers,
                } => {
                    let b = compare_wasm.as_deref();
                    let n = repeat as usize;
                    run_compare(fleet, workload, routers, out, n, b, envoy_workers).await
                }
                Cmd::Demo => demo::demo().await,
                Cmd::Overhead {
                    seconds,
                    plugin_config,
                    configs,
                    json,
                    compare_wasm,
                } => {
                    let config = parse_plugin_config(&plugin_config)?;
                    let (json, b) = (json.as_deref(), compare_wasm.as_deref());
                    overhead::overhead(seconds, config, &configs, json, b).await
                }
                Cmd::Instructions {
                    requests,
                    plugin_config,
                    configs,
                    compare_wasm,
                    keep_dumps,
                } => {
                    let config = parse_plugin_config(&plugin_config)?;
                    let (b, keep) = (compare_wasm.as_deref(), keep_dumps.as_deref());
                    instructions::instructions(requests, config, &configs, b, keep).await
                }
            }
        };
        // Stopped by a signal, the run's future is dropped, and with it the Envoys, sims and peer
        // routers it started (each kills its process on drop); a bare exit would leave them running.
        tokio::select! {
            outcome = work => outcome,
            signal = stop_signal() => Err(format!("stopped by {signal}")),
        }
    });
    // Tasks the run spawned hold processes too: end them before exiting.
    rt.shutdown_timeout(std::time::Duration::from_secs(5));
    if let Err(e) = outcome {
        fail(e);
    }
}

/// `--plugin-config`: a JSON object laid over the shipped plugin config.
fn parse_plugin_config(text: &str) -> Result<serde_json::Value, String> {
    serde_json::from_str(text).map_err(|e| format!("--plugin-config: {e}"))
}

/// The first SIGINT or SIGTERM, by name; never, where signals cannot be watched.
async fn stop_signal() -> &'static str {
    use tokio::signal::unix::{signal, SignalKind};
    match (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) {
        (Ok(mut int), Ok(mut term)) => tokio::select! {
            _ = int.recv() => "SIGINT",
            _ = term.recv() => "SIGTERM",
        },
        _ => std::future::pending().await,
    }
}

async fn run_compare(
    fleet: PathBuf,
    workload: PathBuf,
    routers: String,
    out: PathBuf,
    repeat: usize,
    compare_wasm: Option<&std::path::Path>,
    workers: u32,
) -> Result<(), String> {
    let fleet_text =
        std::fs::read_to_string(&fleet).map_err(|e| format!("{}: {e}", fleet.display()))?;
    let fleet_spec: serde_json::Value =
        serde_json::from_str(&fleet_text).map_err(|e| format!("{}: {e}", fleet.display()))?;
    let workload = workload::Workload::from_file(&workload)?;
    let routers = routers::Router::parse_list(&routers, compare_wasm)?;
    if repeat > 1 {
        let summary =
            repeats::repeat(&fleet_spec, &workload, &routers, repeat, workers, &out).await?;
        println!("{summary}");
        eprintln!("wrote {}/repeats.md, repeats.json", out.display());
        return Ok(());
    }
    let results = compare::compare(&fleet_spec, &workload, &routers, workers).await?;
    results.write_all(&out)?;
    println!("{}", results.markdown());
    eprintln!("wrote {}/results.json, results.md, ttft.svg", out.display());
    Ok(())
}

fn fail(msg: String) -> ! {
    eprintln!("kvroute-bench: {msg}");
    std::process::exit(1)
}
