//! What kvroute costs, counted in instructions instead of seconds: every Envoy config of
//! `overhead` (`plain`, `floor`, `floor+header`, `floor+reads`, `kvroute`, and `kvroute-b` with
//! `--compare-wasm`) runs under valgrind's callgrind, which counts the instructions its process
//! executes, the filter's compiled wasm included. Counting is on only while a config is measured:
//! a few requests to settle, then N requests of each kind (1 KB and 24 KB prompts, and 1 KB
//! streamed back as the test backends stream: 8 chunks and `[DONE]`), then the process idle for
//! a while, whose rate (timers, kvroute's ticks) is taken off the requests' count. kvroute polls
//! Envoy's admin and the engines once, at start, and not again during the run (its
//! `stats_interval_ms` is an hour unless `--plugin-config` says otherwise), and the pool has no
//! active health checks: a poll is idle work, not a request's, and one more or less in a window
//! would move the count by far more than a request costs.
//!
//! A count does not depend on what else the shared machine is doing: one run tells a change's cost
//! to within a few thousand instructions per request, where CPU time per request moves by tens of
//! µs between runs. Instructions are not time (a cache miss counts one, a long copy counts many):
//! compare configs and builds with it, don't convert it to µs.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kvroute_bench::kvroute_stats;
use kvroute_harness::{Envoy, EnvoyOptions};
use serde_json::Value;
use tokio::process::Command;

use crate::overhead::{bodies, envoy_configs, quiet_backends, send, wanted_configs, ENVOY_CONFIGS};

/// Concurrent clients while a config is counted: the Envoy under valgrind is the bottleneck.
const CLIENTS: usize = 4;
/// Requests counted but not kept, once counting is on (valgrind translates new code paths).
const SETTLE: usize = 20;
/// How long each config is counted idle.
const IDLE: Duration = Duration::from_secs(3);
/// kvroute's `stats_interval_ms` here: longer than any run, so it polls once, at start.
const POLL_ONCE_MS: u64 = 3_600_000;
/// Envoy under valgrind starts (and compiles the filter) far slower than alone.
const READY: Duration = Duration::from_secs(300);

/// The requests counted, by label: the prompt sizes of `overhead`, and the smaller one streamed.
const KINDS: [(&str, usize, bool); 3] = [
    ("1 KB", 1024, false),
    ("24 KB", 24 * 1024, false),
    ("1 KB streamed", 1024, true),
];

/// One config's count for one kind of request.
struct Count {
    config: &'static str,
    kind: &'static str,
    per_request: f64,
    idle_per_s: f64,
}

/// Counts `requests` requests of each kind through each of `configs` (empty: all; `plain`, the
/// baseline, always), `kvroute-b` being the build `compare_wasm` names. The dumps stay in
/// `keep_dumps` when given.
pub async fn instructions(
    requests: usize,
    plugin_config: Value,
    configs: &[String],
    compare_wasm: Option<&Path>,
    keep_dumps: Option<&Path>,
) -> Result<(), String> {
    let wanted = wanted_configs(&ENVOY_CONFIGS, configs, compare_wasm.is_some())?;
    let requests = requests.max(1);
    let mut plugin_config = plugin_config;
    if let Some(fields) = plugin_config.as_object_mut() {
        fields
            .entry("stats_interval_ms")
            .or_insert(Value::from(POLL_ONCE_MS));
    }
    let dir = keep_dumps.map(Path::to_path_buf).unwrap_or_else(|| {
        std::env::temp_dir().join(format!("kvroute-callgrind-{}", std::process::id()))
    });
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let outcome = count_all(requests, plugin_config, &wanted, compare_wasm, &dir).await;
    if keep_dumps.is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    let counts = outcome?;
    print_counts(&counts, requests);
    Ok(())
}

async fn count_all(
    requests: usize,
    plugin_config: Value,
    wanted: &dyn Fn(&str) -> bool,
    compare_wasm: Option<&Path>,
    dir: &Path,
) -> Result<Vec<Count>, String> {
    let (_backends, addrs) = quiet_backends().await?;
    let run_under: Vec<String> = [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        // `.venv/bin/envoy` is a script that execs the binary.
        "--trace-children=yes",
        // V8 writes the filter's machine code at run time.
        "--smc-check=all-non-file",
    ]
    .map(String::from)
    .into_iter()
    .chain([format!(
        "--callgrind-out-file={}/callgrind.%p",
        dir.display()
    )])
    .collect();
    let client = reqwest::Client::new();
    let kinds: Vec<(&'static str, Vec<String>)> = KINDS
        .iter()
        .map(|&(label, size, streamed)| (label, kind_bodies(size, streamed)))
        .collect();
    let mut counts = Vec::new();
    for (name, opts) in envoy_configs(&addrs, plugin_config, compare_wasm) {
        if !wanted(name) {
            continue;
        }
        eprintln!("instructions: {name} (Envoy under callgrind)");
        let envoy = Envoy::start(EnvoyOptions {
            run_under: run_under.clone(),
            ready_timeout: READY,
            // Hosts are healthy from the start, so kvroute's one poll sees them so.
            active_health_checks: false,
            ..opts
        })
        .await
        .map_err(|e| format!("{name}: {e}"))?;
        let pid = envoy.pid().ok_or(format!("{name}: Envoy exited"))?;
        let url = envoy.url();
        // Every VM compiled and every code path taken once, before counting.
        for (_, bodies) in &kinds {
            send_many(&client, &url, bodies, bodies.len()).await?;
        }
        callgrind(pid, &["-i", "on"]).await?;
        send_many(&client, &url, &kinds[0].1, SETTLE).await?;
        let mut taken = Vec::new();
        for (n, (kind, bodies)) in kinds.iter().enumerate() {
            callgrind(pid, &["-z"]).await?;
            let start = Instant::now();
            send_many(&client, &url, bodies, requests).await?;
            let wall = start.elapsed();
            let total = dump(pid, dir, &format!("{name}-{n}")).await?;
            taken.push((*kind, total, wall));
        }
        callgrind(pid, &["-z"]).await?;
        tokio::time::sleep(IDLE).await;
        let idle_per_s = dump(pid, dir, &format!("{name}-idle")).await? / IDLE.as_secs_f64();
        callgrind(pid, &["-i", "off"]).await?;
        if name == "kvroute" || name == "kvroute-b" {
            report_decisions(name, &envoy).await;
        }
        for (kind, total, wall) in taken {
            counts.push(Count {
                config: name,
                kind,
                per_request: (total - idle_per_s * wall.as_secs_f64()) / requests as f64,
                idle_per_s,
            });
        }
    }
    Ok(counts)
}

/// `overhead`'s bodies of `size`, asking for a streamed response when `streamed`.
fn kind_bodies(size: usize, streamed: bool) -> Vec<String> {
    let mut all = bodies(size);
    if streamed {
        for body in &mut all {
            if let Ok(mut v) = serde_json::from_str::<Value>(body) {
                v["stream"] = Value::Bool(true);
                *body = v.to_string();
            }
        }
    }
    all
}

/// Sends `n` of `bodies` (in turn) to `url` from [`CLIENTS`] clients.
async fn send_many(
    client: &reqwest::Client,
    url: &str,
    bodies: &[String],
    n: usize,
) -> Result<(), String> {
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let (client, url) = (client.clone(), url.to_string());
            let mine: Vec<String> = (c..n)
                .step_by(CLIENTS)
                .map(|i| bodies[i % bodies.len()].clone())
                .collect();
            tokio::spawn(async move {
                for body in &mine {
                    send(&client, &url, body).await?;
                }
                Ok::<_, String>(())
            })
        })
        .collect();
    for t in tasks {
        t.await.map_err(|e| e.to_string())??;
    }
    Ok(())
}

async fn callgrind(pid: u32, args: &[&str]) -> Result<(), String> {
    let out = Command::new("callgrind_control")
        .args(args)
        .arg(pid.to_string())
        .output()
        .await
        .map_err(|e| format!("callgrind_control: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "callgrind_control {args:?} {pid}: {}",
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// Has callgrind write what it counted since the last zeroing, labelled `label`, and returns it.
async fn dump(pid: u32, dir: &Path, label: &str) -> Result<f64, String> {
    callgrind(pid, &[&format!("--dump={label}")]).await?;
    let trigger = format!("desc: Trigger: dump {label}\n");
    for _ in 0..50 {
        if let Some(total) = find_total(dir, pid, &trigger) {
            return Ok(total);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(format!(
        "callgrind wrote no dump {label:?} in {}",
        dir.display()
    ))
}

/// The `totals:` of the dump file of `pid` in `dir` whose header has `trigger`.
fn find_total(dir: &Path, pid: u32, trigger: &str) -> Option<f64> {
    let prefix = format!("callgrind.{pid}.");
    let files: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| Some(e.ok()?.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&prefix))
        })
        .collect();
    files.iter().find_map(|path| {
        let text = std::fs::read_to_string(path).ok()?;
        // `totals:` comes last: a file still being written has no complete one yet.
        if !text.contains(trigger) || !text.ends_with('\n') {
            return None;
        }
        let line = text.lines().find(|l| l.starts_with("totals:"))?;
        line.trim_start_matches("totals:").trim().parse().ok()
    })
}

async fn report_decisions(name: &str, envoy: &Envoy) {
    if let Ok(routed) = envoy.stats(kvroute_stats::all()).await {
        let (decided, fell_back) = (kvroute_stats::routed(), kvroute_stats::fallback());
        let mut moved: Vec<_> = routed
            .into_iter()
            .filter(|(k, v)| *v > 0 && (k.contains(decided) || k.contains(fell_back)))
            .collect();
        moved.sort();
        eprintln!("instructions: {name} decisions {moved:?}");
    }
}

fn print_counts(counts: &[Count], requests: usize) {
    println!(
        "\ninstructions per request (valgrind callgrind, {requests} requests of each kind, \
         {CLIENTS} clients, idle rate taken off):\n"
    );
    println!("| config | requests | instructions/request | over plain | idle instructions/s |");
    println!("|---|---|---:|---:|---:|");
    let find = |config: &str, kind: &str| {
        counts
            .iter()
            .find(|c| c.config == config && c.kind == kind)
            .map(|c| c.per_request)
    };
    for (kind, _, _) in KINDS {
        for c in counts.iter().filter(|c| c.kind == kind) {
            let over =
                find("plain", kind).map_or("–".into(), |p| thousands(c.per_request - p, true));
            println!(
                "| {} | {kind} | {} | {over} | {} |",
                c.config,
                thousands(c.per_request, false),
                thousands(c.idle_per_s, false),
            );
        }
    }
    println!();
    for (kind, _, _) in KINDS {
        let get = |c| find(c, kind);
        if let (Some(kv), Some(header), Some(floor)) =
            (get("kvroute"), get("floor+header"), get("floor"))
        {
            let own = match get("floor+reads") {
                Some(reads) => format!(
                    "the host calls kvroute makes (floor+reads − floor+header) {}, kvroute's own \
                     code (kvroute − floor+reads) {}",
                    thousands(reads - header, true),
                    thousands(kv - reads, true),
                ),
                None => format!(
                    "kvroute's own (kvroute − floor+header) {}",
                    thousands(kv - header, true)
                ),
            };
            println!(
                "{kind}: kvroute − floor = {}; of which Envoy honouring the header (floor+header − \
                 floor) {}, {own}",
                thousands(kv - floor, true),
                thousands(header - floor, true),
            );
        }
        if let (Some(a), Some(b)) = (get("kvroute"), get("kvroute-b")) {
            println!("{kind}: kvroute-b − kvroute = {}", thousands(b - a, true));
        }
    }
}

/// `n` rounded to thousands, as `123.4k` (with a sign when `signed`).
fn thousands(n: f64, signed: bool) -> String {
    if signed {
        format!("{:+.1}k", n / 1e3)
    } else {
        format!("{:.1}k", n / 1e3)
    }
}
