//! kvroute-overhead: what kvroute costs per request, measured beside plain Envoy, the floor
//! filter and the peer routers: CPU and added latency in one interleaved run (`cpu`), and
//! instructions counted under valgrind (`instructions`).

mod instructions;
mod overhead;

use clap::{Parser, Subcommand};
use kvroute_bench::cli;
use std::path::PathBuf;

/// What kvroute costs per request, beside plain Envoy, the floor filter and the peer routers.
#[derive(Parser)]
#[command(version)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// CPU per request and latency kvroute adds, as a filter and as kvroute-epp, next to plain
    /// Envoy, the floor filter, smg and vllm-router, all measured in one interleaved run.
    Cpu {
        /// Seconds per measured phase.
        #[arg(long, default_value_t = 10)]
        seconds: u64,
        /// kvroute plugin config laid over the shipped one (JSON object), e.g.
        /// '{"policy":"round_robin"}'; kvroute-epp runs with the same.
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
    let command = Cli::parse().command;
    let outcome = cli::run_until_stopped(async {
        match command {
            Cmd::Cpu {
                seconds,
                plugin_config,
                configs,
                json,
                compare_wasm,
            } => {
                let config = cli::parse_plugin_config(&plugin_config)?;
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
                let config = cli::parse_plugin_config(&plugin_config)?;
                let (b, keep) = (compare_wasm.as_deref(), keep_dumps.as_deref());
                instructions::instructions(requests, config, &configs, b, keep).await
            }
        }
    });
    if let Err(e) = outcome {
        cli::fail("kvroute-overhead", e);
    }
}
