//! kvroute-bench: drives one workload through several routers, each against a fresh simulated
//! fleet (`compare`, writing results.json / results.md / ttft.svg / samples.jsonl) or in virtual
//! time (`lab`), writes the READMEs' tables, and reads a run's samples again (`analyze`). `demo`
//! is the short `make run` tour.

use clap::{Parser, Subcommand};
use kvroute_bench::{
    analyze, cli, compare, demo, keys, lab, repeats, report, routers, targets, workload,
};
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
        /// kvroute-precise (with its own kvroute-indexer), kvroute-epp (an Envoy asking its own
        /// kvroute-epp), smg, vllm-router:<policy>, oracle; NAME@N runs N instances of NAME behind
        /// one round-robin Envoy.
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
        /// Worker threads of each Envoy the routers start (each worker has its own kvroute VM;
        /// each kvroute-epp runs as many gateways). A standalone Envoy runs one per core.
        #[arg(long, default_value_t = routers::ENVOY_WORKERS,
              value_parser = clap::value_parser!(u32).range(1..=16))]
        envoy_workers: u32,
    },
    /// kvroute vs round robin on a small embedded fleet and workload (about a minute).
    Demo {
        /// kvroute in precise mode (its own kvroute-indexer on the engines' KV events) vs
        /// kvroute, instead of kvroute vs round robin.
        #[arg(long, conflicts_with = "epp")]
        precise: bool,
        /// kvroute as kvroute-epp (plain Envoy asking it over ext_proc) vs round robin, instead
        /// of the filter.
        #[arg(long)]
        epp: bool,
    },
    /// README's results table from DIR/<workload>/results.json: a column per workload, a row per
    /// router, each cell the prefix hit rate and TTFT p90; printed, and written to DIR/summary.md.
    Summary {
        /// Where `make bench-results` wrote the sets.
        #[arg(long, default_value = "bench/results")]
        results: PathBuf,
        /// The workloads (subdirectories of DIR), in column order, comma-separated.
        #[arg(long, value_delimiter = ',', required = true)]
        workloads: Vec<String>,
        /// Also put the table into FILE, between its `<!-- results` and `<!-- /results -->` lines.
        #[arg(long, value_name = "FILE")]
        readme: Option<PathBuf>,
    },
    /// Precise mode's lines (`make bench-precise`) against their targets, from
    /// DIR/<line>/repeats.json: per line each figure's mean, what it is held against, the target
    /// and met or missed, and the build; a line without its file shows as not measured. Printed,
    /// and written to DIR/summary.md.
    PreciseSummary {
        /// Where `make bench-precise` wrote the lines.
        #[arg(long, default_value = "bench/results/precise")]
        results: PathBuf,
        /// Also put the table into FILE, between its `<!-- precise` and `<!-- /precise -->`
        /// lines (repeatable).
        #[arg(long, value_name = "FILE")]
        readme: Vec<PathBuf>,
    },
    /// Routers against the simulator's engine model in virtual time (no sockets, no clock),
    /// every router on the same K workload seeds: each figure's mean and 95% interval, and with
    /// --baseline each router's paired difference from it and a verdict. Prints the table; writes
    /// DIR/results.{json,md} with --out.
    Lab {
        /// Fleet spec (JSON), as `compare` takes it.
        #[arg(long)]
        fleet: PathBuf,
        /// Workload spec (JSON); its seed is the first of the K.
        #[arg(long)]
        workload: PathBuf,
        /// Comma-separated: round_robin, least_request, kvroute, kvroute:<policy>,
        /// kvroute-precise, smg, oracle; NAME@N for N instances behind round robin.
        #[arg(long, default_value = "round_robin,kvroute,smg,oracle")]
        routers: String,
        /// Workload seeds per router (the workload's seed, +1, ...).
        #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=1000))]
        seeds: u64,
        /// The router every other one is paired against, seed by seed.
        #[arg(long)]
        baseline: Option<String>,
        /// Output directory for results.json and results.md.
        #[arg(long)]
        out: Option<PathBuf>,
        #[command(flatten)]
        knobs: lab::Knobs,
    },
    /// Precise mode's lines (bench/targets/precise.toml) decided in the lab: each line's routers
    /// over --seeds paired seeds into DIR/<line>/results.{json,md}, then the table of each
    /// check's paired interval against its target (met, missed or undecided), printed, written
    /// to DIR/summary.md and into each --readme's `lab-precise` block.
    LabPrecise {
        #[arg(long, default_value = "bench/results/lab/precise")]
        results: PathBuf,
        /// The lines to run, comma-separated (default: all).
        #[arg(long, value_delimiter = ',')]
        lines: Vec<String>,
        #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(2..=1000))]
        seeds: u64,
        /// Only the table, from the lines DIR holds.
        #[arg(long)]
        summary_only: bool,
        #[arg(long, value_name = "FILE")]
        readme: Vec<PathBuf>,
        #[command(flatten)]
        knobs: lab::Knobs,
    },
    /// The lab held against the wall-clock bench: for each results.json under DIR (each
    /// workload's set, each precise line's first run), the lab on the same fleet, workload and
    /// seed through the same routers (round_robin, kvroute, kvroute@3, kvroute-precise, smg where
    /// present), each figure side by side; printed and written to DIR/lab/calibration/summary.md.
    LabCalibrate {
        #[arg(long, default_value = "bench/results")]
        results: PathBuf,
        /// Lab seeds per file, from the file's own.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=100))]
        seeds: u64,
        #[command(flatten)]
        knobs: lab::Knobs,
    },
    /// Two lab results of one workload, fleet and seeds (two builds, or two configs): each
    /// router's figures paired seed by seed, after − before with its 95% interval and verdict.
    LabDiff {
        /// results.json (or its directory) of the build before the change.
        before: PathBuf,
        /// results.json (or its directory) of the build with it.
        after: PathBuf,
    },
    /// Analyses of a run `compare` wrote, from its samples.jsonl (and results.json), printed.
    Analyze {
        #[command(subcommand)]
        analysis: Analysis,
    },
    /// One chat request rendered by a chat template, and kvroute's prefix keys over it:
    /// prints {"rendered": "...", "keys": ["<hex>", ...]}.
    Keys {
        /// The chat template: a raw Jinja file, or a tokenizer_config.json holding one.
        #[arg(long, value_name = "FILE")]
        chat_template: PathBuf,
        /// The request body (JSON) of a /v1/chat/completions request.
        #[arg(long, value_name = "FILE")]
        request: PathBuf,
        /// Bytes per chunk (the filter's `chunk_size`).
        #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u64).range(16..=(1 << 20)))]
        chunk_size: u64,
        /// The model that seeds the keys (default: the request's).
        #[arg(long)]
        model: Option<String>,
        /// A tokenizer_config.json whose special tokens (bos_token, ...) a raw template gets.
        #[arg(long, value_name = "FILE")]
        tokenizer_config: Option<PathBuf>,
    },
}

/// What `analyze` looks at.
#[derive(Subcommand)]
enum Analysis {
    /// What the workload allows on the run's fleet: the ceiling, the capacity bound, the fleet's
    /// blocks as one LRU cache (as results.md says them; needs the run's results.json).
    Ceiling {
        #[command(flatten)]
        run: Run,
    },
    /// Where each router's uncached prompt tokens were: a group's first request, a group or a
    /// conversation on another replica than its last one, or on the same.
    Misses {
        #[command(flatten)]
        run: Run,
    },
    /// Where each router's cold prefills came from (a group's first request on the replica, or
    /// evicted there), and its requests after 25 s to a replica crowded with groups.
    Crowding {
        #[command(flatten)]
        run: Run,
    },
    /// The first router's requests replayed through kvroute's own placement (GroupHomes over a
    /// shared store per gateway): moves, balance, crowding, and the workers' agreement.
    Placement {
        #[command(flatten)]
        run: Run,
        #[command(flatten)]
        setup: analyze::placement::Setup,
    },
}

/// The run an analysis reads.
#[derive(clap::Args)]
struct Run {
    /// The run's directory (`compare --out`, or a `--repeat`'s `run-<r>`), or its samples.jsonl.
    run: PathBuf,
}

fn main() {
    let cli = Cli::parse();
    if let Err(e) = run(cli.command) {
        cli::fail("kvroute-bench", e);
    }
}

fn run(command: Cmd) -> Result<(), String> {
    if let Cmd::Keys {
        chat_template,
        request,
        chunk_size,
        model,
        tokenizer_config,
    } = &command
    {
        return keys::keys(&keys::KeysArgs {
            chat_template,
            request,
            chunk_size: *chunk_size as usize,
            model: model.as_deref(),
            tokenizer_config: tokenizer_config.as_deref(),
        });
    }
    if let Some(outcome) = run_lab(&command) {
        return outcome;
    }
    if let Cmd::Analyze { analysis } = &command {
        print!("{}", run_analysis(analysis)?);
        return Ok(());
    }
    cli::run_until_stopped(async {
        match command {
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
            Cmd::Demo { precise, epp } => demo::demo(precise, epp).await,
            Cmd::Summary {
                results,
                workloads,
                readme,
            } => {
                let table = report::summary(&results, &workloads)?;
                write_summary(&results, &table, "results", readme.as_slice())
            }
            Cmd::PreciseSummary { results, readme } => {
                let table = targets::repeats::summary(&results)?;
                write_summary(&results, &table, "precise", &readme)
            }
            Cmd::Keys { .. }
            | Cmd::Analyze { .. }
            | Cmd::Lab { .. }
            | Cmd::LabPrecise { .. }
            | Cmd::LabCalibrate { .. }
            | Cmd::LabDiff { .. } => Ok(()),
        }
    })
}

/// The lab's commands, which run on threads of their own rather than on the tokio runtime;
/// `None` for the others.
fn run_lab(cmd: &Cmd) -> Option<Result<(), String>> {
    Some(match cmd {
        Cmd::Lab {
            fleet,
            workload,
            routers,
            seeds,
            baseline,
            out,
            knobs,
        } => lab::lab(&lab::LabArgs {
            fleet: fleet.clone(),
            workload: workload.clone(),
            routers: routers.clone(),
            seeds: *seeds,
            baseline: baseline.clone(),
            out: out.clone(),
            knobs: *knobs,
        }),
        Cmd::LabPrecise {
            results,
            lines,
            seeds,
            summary_only,
            readme,
            knobs,
        } => (|| {
            if !summary_only {
                lab::run_lines(results, lines, *seeds, knobs)?;
            }
            let table = lab::lines_summary(results)?;
            write_summary(results, &table, "lab-precise", readme)
        })(),
        Cmd::LabCalibrate {
            results,
            seeds,
            knobs,
        } => (|| {
            let table = lab::calibrate(&lab::calibration_sources(results)?, *seeds, knobs)?;
            write_summary(
                &results.join("lab/calibration"),
                &table,
                "lab-calibration",
                &[],
            )
        })(),
        Cmd::LabDiff { before, after } => lab::diff(before, after).map(|t| print!("{t}")),
        _ => return None,
    })
}

/// The text of `analysis`.
fn run_analysis(analysis: &Analysis) -> Result<String, String> {
    Ok(match analysis {
        Analysis::Ceiling { run } => analyze::ceiling(&run.run)? + "\n",
        Analysis::Misses { run } => {
            let table = analyze::misses::table(&analyze::samples(&run.run)?);
            match table.is_empty() {
                true => "no request of the run reported usage\n".into(),
                false => table.trim_start().to_string(),
            }
        }
        Analysis::Crowding { run } => analyze::crowding::table(&analyze::samples(&run.run)?),
        Analysis::Placement { run, setup } => {
            analyze::placement::report(&analyze::samples(&run.run)?, setup)
        }
    })
}

/// Writes `table` to `dir/summary.md` and into each of `readmes`' `name` block; prints it.
fn write_summary(
    dir: &std::path::Path,
    table: &str,
    block: &str,
    readmes: &[PathBuf],
) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let path = dir.join("summary.md");
    std::fs::write(&path, table).map_err(|e| format!("{}: {e}", path.display()))?;
    for readme in readmes {
        let io = |e: std::io::Error| format!("{}: {e}", readme.display());
        let text = std::fs::read_to_string(readme).map_err(io)?;
        let text = report::replace_block(&text, block, table)
            .ok_or_else(|| format!("{}: no {block} block", readme.display()))?;
        std::fs::write(readme, text).map_err(io)?;
    }
    print!("{table}");
    Ok(())
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
        let fleet_name = fleet
            .file_stem()
            .map_or(String::new(), |s| s.to_string_lossy().into_owned());
        let summary = repeats::repeat(
            &fleet_name,
            &fleet_spec,
            &workload,
            &routers,
            repeat,
            workers,
            &out,
        )
        .await?;
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
