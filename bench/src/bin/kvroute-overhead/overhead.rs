//! What kvroute costs: CPU per request and latency added, for 1 KB and 24 KB prompts, next to
//! plain Envoy, the floor (a filter that only pauses for the body and reads it), the floor that
//! also writes the routing header for Envoy's `override_host` (`floor+header`: what honouring the
//! header costs Envoy, whoever writes it), the floor that also makes the host calls kvroute makes
//! on its common path and ignores their answers (`floor+reads`: what asking Envoy costs, apart
//! from kvroute's own code), and the peer routers as a hop (smg, vllm-router).
//! With `--compare-wasm`, another build of the filter runs as `kvroute-b` beside `kvroute`, so a
//! change's cost is measured in one run rather than across runs on a noisy machine.
//! `kvroute+template` and `kvroute-precise` ([`precise`]) measure precise mode: both render the
//! prompt with a chat template, and the second also follows an indexer's change feed whose engine
//! holdings decide its requests. `kvroute-epp` ([`epp`]) is kvroute's core as an endpoint picker:
//! plain Envoy asking a kvroute-epp process over ext_proc, with the same plugin config; its CPU
//! is the Envoy's and the picker's together.
//!
//! Every config runs at once against the same in-process backends, and every client sends each
//! body to every config in turn (rotating which goes first), so machine noise (this box is shared)
//! hits all alike; the numbers that matter are differences and ratios, not absolute values.
//! `floor`, `floor+header`, `floor+reads`, `kvroute`, `kvroute-b` and `kvroute-epp` are measured
//! over plain Envoy; `plain`, `smg` and `vllm-router` over going straight to a backend (the peers are a hop
//! behind the gateway a user already has). Each process's CPU while idle is reported too: work
//! that is not per request (kvroute's polls, health checks) is part of the CPU per request at a
//! given rate.

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use kvroute_harness::backend::Backend;
use kvroute_harness::{Envoy, EnvoyOptions, Lb};
use serde::Serialize;
use serde_json::{json, Value};

use kvroute_bench::peers::{self, PeerProcess};
use kvroute_bench::stats::percentile;

mod epp;
mod precise;

/// Prompt sizes measured, in bytes of prompt text.
const SIZES: [usize; 2] = [1024, 24 * 1024];
/// Concurrent clients for the latency runs: a steady load well below saturation.
const LATENCY_CLIENTS: usize = 4;
/// Concurrent clients for the CPU runs: enough to keep one config busy, so idle work (timers,
/// health checks) is spread over many requests.
const THROUGHPUT_CLIENTS: usize = 32;
/// Prefix groups: requests mostly go to their group's home, the common path in production.
const GROUPS: usize = 16;
/// How long every process's idle CPU is measured, all at once, after a warm-up.
const IDLE: Duration = Duration::from_secs(3);
/// vllm-router's policy here: its cache-aware one, like smg's.
const VLLM_ROUTER_POLICY: &str = "cache_aware";

/// The Envoy configs, in table order (`instructions` counts these).
pub(crate) const ENVOY_CONFIGS: [&str; 6] = [
    "plain",
    "floor",
    "floor+header",
    "floor+reads",
    "kvroute",
    "kvroute-b",
];
/// The peer routers, measured as a hop, after the Envoy configs.
const PEERS: [&str; 2] = ["smg", "vllm-router"];
/// Addresses `floor+header` lists per request: the chosen one and one fallback, as kvroute's
/// default `fallback_endpoints` (1) has it.
const FLOOR_HEADER_ADDRESSES: usize = 2;

/// One row of the table (and of `--json`).
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub config: String,
    pub prompt_bytes: usize,
    /// CPU (user + system) of the proxy or router process per request, in µs.
    pub cpu_us_per_request: Option<f64>,
    /// p50 and p99 latency over the config's baseline (see the module doc), in µs.
    pub added_p50_us: Option<f64>,
    pub added_p99_us: Option<f64>,
    /// What the added latency is measured over: `plain` (Envoy) or `backend` (direct).
    pub over: &'static str,
    pub requests_per_s: Option<f64>,
    /// CPU of the process while no client sends anything (timers, polls, health checks), in ms
    /// per second.
    pub idle_cpu_ms_per_s: Option<f64>,
    /// Of `cpu_us_per_request`, what the picker process used (`kvroute-epp`; the rest is its
    /// Envoy's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub picker_cpu_us_per_request: Option<f64>,
    /// Why the config was not measured (a peer that is not installed or did not start).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skipped: Option<String>,
}

/// A config under test and where to send requests.
struct Target {
    name: &'static str,
    url: String,
    process: Process,
}

/// The processes of a config, whose CPU it is charged.
enum Process {
    Envoy(Envoy),
    Peer(PeerProcess),
    /// Envoy and the kvroute-epp it asks.
    Epp(Box<kvroute_bench::epp::Gateway>),
}

impl Target {
    fn envoy(name: &'static str, envoy: Envoy) -> Target {
        Target {
            name,
            url: envoy.url(),
            process: Process::Envoy(envoy),
        }
    }

    fn cpu_time(&self) -> Option<Duration> {
        match &self.process {
            Process::Envoy(e) => e.cpu_time(),
            Process::Peer(p) => p.cpu_time(),
            Process::Epp(g) => g.cpu_time(),
        }
    }

    /// The picker's part of [`Target::cpu_time`], for `kvroute-epp`.
    fn picker_cpu_time(&self) -> Option<Duration> {
        match &self.process {
            Process::Epp(g) => g.picker.cpu_time(),
            _ => None,
        }
    }

    /// The Envoy that serves the config, if one does.
    fn envoy_of(&self) -> Option<&Envoy> {
        match &self.process {
            Process::Envoy(e) => Some(e),
            Process::Epp(g) => Some(&g.envoy),
            Process::Peer(_) => None,
        }
    }

    fn over(&self) -> &'static str {
        match &self.process {
            Process::Envoy(_) | Process::Epp(_) if self.name != "plain" => "plain",
            _ => "backend",
        }
    }
}

pub async fn overhead(
    seconds: u64,
    plugin_config: serde_json::Value,
    configs: &[String],
    json_out: Option<&Path>,
    compare_wasm: Option<&Path>,
) -> Result<(), String> {
    let known: Vec<&str> = ENVOY_CONFIGS
        .into_iter()
        .chain(precise::CONFIGS)
        .chain([epp::CONFIG])
        .chain(PEERS)
        .collect();
    let wanted = wanted_configs(&known, configs, compare_wasm.is_some())?;
    let load_before = load_average();
    let (_backends, addrs) = quiet_backends().await?;
    let workers: Vec<String> = addrs.iter().map(|a| format!("http://{a}")).collect();
    let mut targets = Vec::new();
    let mut skipped: Vec<(&str, String)> = Vec::new();
    let precise = precise::start(&addrs, &plugin_config, &wanted).await?;
    let picker = match wanted(epp::CONFIG) {
        true => Some(epp::start(&addrs, &plugin_config).await),
        false => None,
    };
    for (name, opts) in envoy_configs(&addrs, plugin_config, compare_wasm) {
        if !wanted(name) {
            continue;
        }
        let envoy = Envoy::start(opts)
            .await
            .map_err(|e| format!("{name}: {e}"))?;
        targets.push(Target::envoy(name, envoy));
    }
    for (name, envoy) in precise.envoys {
        targets.push(Target::envoy(name, envoy));
    }
    let _feed = precise.feed;
    match picker {
        Some(Ok(gateway)) => targets.push(Target {
            name: epp::CONFIG,
            url: gateway.envoy.url(),
            process: Process::Epp(Box::new(gateway)),
        }),
        Some(Err(e)) => {
            eprintln!("overhead: {} skipped: {e}", epp::CONFIG);
            skipped.push((epp::CONFIG, e));
        }
        None => {}
    }
    for name in PEERS.into_iter().filter(|n| wanted(n)) {
        let peer = match name {
            "smg" => peers::start_smg_on(&workers).await,
            _ => peers::start_vllm_router_on(VLLM_ROUTER_POLICY, &workers).await,
        };
        match peer {
            Ok(peer) => targets.push(Target {
                name,
                url: peer.url.clone(),
                process: Process::Peer(peer),
            }),
            Err(e) => {
                eprintln!("overhead: {name} skipped: {e}");
                skipped.push((name, e));
            }
        }
    }
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(THROUGHPUT_CLIENTS)
        .build()
        .map_err(|e| e.to_string())?;
    let phase = Duration::from_secs(seconds.max(1));
    // Latency targets: the backends directly (index 0), then every config.
    let mut urls = vec![workers.clone()];
    urls.extend(targets.iter().map(|t| vec![t.url.clone()]));

    // Once every VM has compiled and seen traffic, as it is between the load phases.
    warm_up(&client, &urls, &bodies(SIZES[0])).await?;
    let idle = idle_cpu(&targets, IDLE).await;
    let mut rows = Vec::new();
    for size in SIZES {
        let bodies = bodies(size);
        warm_up(&client, &urls, &bodies).await?;
        let lat = latency(&client, &urls, &bodies, phase).await?;
        let p = |i: usize, q: f64| percentile(&lat[i], q);
        let (rates, [cpu, picker_cpu]) = cpu_per_request(&client, &targets, &bodies, phase).await?;
        for (i, t) in targets.iter().enumerate() {
            let base = match t.over() {
                "plain" => 1,
                _ => 0,
            };
            let added = |q: f64| Some(p(i + 1, q)? - p(base, q)?);
            rows.push(Row {
                config: t.name.to_string(),
                prompt_bytes: size,
                cpu_us_per_request: cpu[i],
                picker_cpu_us_per_request: picker_cpu[i],
                added_p50_us: added(0.5),
                added_p99_us: added(0.99),
                over: t.over(),
                requests_per_s: Some(rates[i]),
                idle_cpu_ms_per_s: idle[i],
                skipped: None,
            });
        }
        for (name, why) in &skipped {
            rows.push(Row {
                config: name.to_string(),
                prompt_bytes: size,
                cpu_us_per_request: None,
                picker_cpu_us_per_request: None,
                added_p50_us: None,
                added_p99_us: None,
                over: match *name == epp::CONFIG {
                    true => "plain",
                    false => "backend",
                },
                requests_per_s: None,
                idle_cpu_ms_per_s: None,
                skipped: Some(why.clone()),
            });
        }
    }
    rows.sort_by_key(|r| {
        let at = known.iter().position(|c| *c == r.config);
        (r.prompt_bytes, at)
    });
    let load_after = load_average();

    print_table(&rows);
    let idle: Vec<String> = targets
        .iter()
        .zip(&idle)
        .map(|(t, ms)| match ms {
            Some(ms) => format!("{} {ms:.1}", t.name),
            None => format!("{} ?", t.name),
        })
        .collect();
    println!(
        "\nidle CPU (ms per s, after a warm-up): {}",
        idle.join(", ")
    );
    println!(
        "\nmachine: {} cores, load average (1 min) {} before, {} after",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        load_before.map_or("?".into(), |l| format!("{l:.2}")),
        load_after.map_or("?".into(), |l| format!("{l:.2}")),
    );
    print_ratios(&rows);
    for t in &targets {
        if let Some(envoy) = t.envoy_of() {
            let stats = envoy
                .stats("cluster.inference_pool.upstream_")
                .await
                .map_err(|e| e.to_string())?;
            let get = |s: &str| stats.get(&format!("cluster.inference_pool.{s}")).copied();
            if let (Some(cx), Some(rq)) = (get("upstream_cx_total"), get("upstream_rq_total")) {
                println!(
                    "{}: {rq} upstream requests on {cx} upstream connections",
                    t.name
                );
            }
        }
    }
    let kvroutes = targets
        .iter()
        .filter_map(|t| match &t.process {
            Process::Envoy(envoy) => Some((t.name, envoy)),
            _ => None,
        })
        .filter(|(name, _)| name.starts_with("kvroute"));
    let precise_decisions = precise::print_decisions(kvroutes).await?;
    for t in &targets {
        if let Process::Epp(gateway) = &t.process {
            epp::print_decisions(t.name, &gateway.picker).await?;
        }
    }
    if let Some(path) = json_out {
        let doc = json!({
            "seconds_per_phase": seconds,
            "latency_clients": LATENCY_CLIENTS,
            "throughput_clients": THROUGHPUT_CLIENTS,
            "cores": std::thread::available_parallelism().map_or(0, |n| n.get()),
            "load_average_1m": { "before": load_before, "after": load_after },
            "rows": rows,
            "precise_decisions": precise_decisions,
        });
        let text = serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?;
        std::fs::write(path, text + "\n").map_err(|e| format!("{}: {e}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    // After `--json` is written: a run whose engine index decided too little measured nothing.
    precise_decisions.as_ref().map_or(Ok(()), precise::check)
}

/// The four in-process backends every config goes to, and their addresses. They keep no copy
/// of the requests: hundreds of thousands of 24 KB bodies grew the bench to tens of GB, and the
/// machine's paging then measured itself.
pub(crate) async fn quiet_backends() -> Result<(Vec<Backend>, Vec<SocketAddr>), String> {
    let backends = Backend::start_many(4)
        .await
        .map_err(|e| format!("backends: {e}"))?;
    for b in &backends {
        b.set_recording(false);
    }
    let addrs = backends.iter().map(Backend::addr).collect();
    Ok((backends, addrs))
}

/// Checks `--configs` against `known` and says which configs run: those given (all when none is),
/// `plain`, the baseline, always, and `kvroute-b` only when `--compare-wasm` gives its build.
pub(crate) fn wanted_configs<'a>(
    known: &[&str],
    configs: &'a [String],
    compare_wasm: bool,
) -> Result<impl Fn(&str) -> bool + 'a, String> {
    if let Some(unknown) = configs.iter().find(|c| !known.contains(&c.as_str())) {
        return Err(format!(
            "--configs: unknown config {unknown:?} (known: {})",
            known.join(", ")
        ));
    }
    if !compare_wasm && configs.iter().any(|c| c == "kvroute-b") {
        return Err("--configs: kvroute-b is the build --compare-wasm names; give it".into());
    }
    Ok(move |name: &str| {
        let given = name != "kvroute-b" || compare_wasm;
        given && (name == "plain" || configs.is_empty() || configs.iter().any(|c| c == name))
    })
}

/// The Envoy configs, by name, over the backends `addrs`: `kvroute` and `kvroute-b` with
/// `plugin_config`, `kvroute-b` with the build `compare_wasm` names.
pub(crate) fn envoy_configs(
    addrs: &[SocketAddr],
    plugin_config: Value,
    compare_wasm: Option<&Path>,
) -> Vec<(&'static str, EnvoyOptions)> {
    // Like kvroute's list: each backend first in turn, then the next ones as fallbacks.
    let header_values: Vec<String> = (0..addrs.len())
        .map(|i| {
            (0..FLOOR_HEADER_ADDRESSES.min(addrs.len()))
                .map(|k| addrs[(i + k) % addrs.len()].to_string())
                .collect::<Vec<_>>()
                .join(",")
        })
        .collect();
    [
        ("plain", Lb::RoundRobin),
        ("floor", Lb::Floor),
        (
            "floor+header",
            Lb::FloorHeader {
                plugin_config: json!({ "header_values": header_values }),
            },
        ),
        (
            "floor+reads",
            Lb::FloorHeader {
                plugin_config: json!({ "header_values": header_values, "reads": true }),
            },
        ),
        (
            "kvroute",
            Lb::Kvroute {
                plugin_config: plugin_config.clone(),
            },
        ),
        ("kvroute-b", Lb::Kvroute { plugin_config }),
    ]
    .into_iter()
    .map(|(name, lb)| {
        let opts = EnvoyOptions {
            backends: addrs.to_vec(),
            lb,
            kvroute_wasm: compare_wasm
                .filter(|_| name == "kvroute-b")
                .map(Path::to_path_buf),
            ..EnvoyOptions::default()
        };
        (name, opts)
    })
    .collect()
}

fn print_table(rows: &[Row]) {
    let us = |v: Option<f64>| v.map_or("–".to_string(), |v| format!("{v:.0} µs"));
    let added = |v: Option<f64>| v.map_or("–".to_string(), |v| format!("{v:+.0} µs"));
    println!(
        "| config | prompt | CPU/request | added p50 | added p99 | over | req/s (32 clients) |"
    );
    println!("|---|---|---|---|---|---|---|");
    for r in rows {
        let rate = match (&r.skipped, r.requests_per_s) {
            (Some(why), _) => format!("skipped: {}", why.chars().take(60).collect::<String>()),
            (None, Some(rate)) => format!("{rate:.0}"),
            (None, None) => "–".into(),
        };
        println!(
            "| {} | {} KB | {} | {} | {} | {} | {} |",
            r.config,
            r.prompt_bytes / 1024,
            us(r.cpu_us_per_request),
            added(r.added_p50_us),
            added(r.added_p99_us),
            r.over,
            rate,
        );
    }
}

/// The two numbers the overhead target is stated in: kvroute's CPU over the floor's, and its
/// added p50 as a share of smg's hop; with `kvroute-b`, its difference from `kvroute`.
fn print_ratios(rows: &[Row]) {
    for size in SIZES {
        let get = |config: &str| {
            rows.iter()
                .find(|r| r.config == config && r.prompt_bytes == size)
        };
        if let (Some(kv), Some(b)) = (get("kvroute"), get("kvroute-b")) {
            let diff = |x: Option<f64>, y: Option<f64>| {
                x.zip(y)
                    .map_or("?".into(), |(x, y)| format!("{:+.0} µs", x - y))
            };
            println!(
                "{} KB: kvroute-b − kvroute: CPU/request {}, added p50 {}",
                size / 1024,
                diff(b.cpu_us_per_request, kv.cpu_us_per_request),
                diff(b.added_p50_us, kv.added_p50_us)
            );
        }
        if let Some(line) = precise::ratio_line(rows, size) {
            println!("{line}");
        }
        if let Some(line) = epp::ratio_line(rows, size) {
            println!("{line}");
        }
        let (Some(kv), Some(floor)) = (get("kvroute"), get("floor")) else {
            continue;
        };
        let mut line = format!("{} KB:", size / 1024);
        if let (Some(a), Some(b)) = (kv.cpu_us_per_request, floor.cpu_us_per_request) {
            line += &format!(" kvroute CPU/request − floor's = {:+.0} µs;", a - b);
        }
        let cpu = |config: &str| get(config).and_then(|r| r.cpu_us_per_request);
        if let (Some(a), Some(h), Some(b)) =
            (kv.cpu_us_per_request, cpu("floor+header"), cpu("floor"))
        {
            line += &format!(
                " of which Envoy honouring the header (floor+header − floor) {:+.0} µs",
                h - b
            );
            match cpu("floor+reads") {
                Some(r) => {
                    line += &format!(
                        ", the host calls kvroute makes (floor+reads − floor+header) {:+.0} µs, \
                         kvroute's own code (kvroute − floor+reads) {:+.0} µs;",
                        r - h,
                        a - r
                    )
                }
                None => {
                    line += &format!(", kvroute's own (kvroute − floor+header) {:+.0} µs;", a - h)
                }
            }
        }
        if let (Some(a), Some(b)) = (kv.added_p50_us, get("smg").and_then(|s| s.added_p50_us)) {
            line += &format!(" kvroute added p50 / smg's hop = {:.2}", a / b);
        }
        println!("{line}");
    }
}

/// Each target's CPU per second of wall time while nobody sends it anything, in ms.
async fn idle_cpu(targets: &[Target], window: Duration) -> Vec<Option<f64>> {
    let before: Vec<_> = targets.iter().map(Target::cpu_time).collect();
    let start = Instant::now();
    tokio::time::sleep(window).await;
    let wall = start.elapsed().as_secs_f64();
    targets
        .iter()
        .zip(before)
        .map(|(t, b)| Some((t.cpu_time()? - b?).as_secs_f64() * 1e3 / wall))
        .collect()
}

/// The 1-minute load average, from `/proc/loadavg` (Linux only).
fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// `GROUPS` × 8 chat bodies of about `size` bytes: a shared system prompt per group and a short
/// question, as OpenAI clients send them. The model is the one the test backends list (the
/// peers route only to workers serving the requested model).
pub(crate) fn bodies(size: usize) -> Vec<String> {
    (0..GROUPS * 8)
        .map(|i| {
            let group = i % GROUPS;
            let system = format!("Group {group} system prompt. ").repeat(size / 24);
            json!({
                "model": "test",
                "max_tokens": 16,
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": format!("Question {i}: what is in the context?")}
                ]
            })
            .to_string()
        })
        .collect()
}

pub(crate) async fn send(
    client: &reqwest::Client,
    base: &str,
    body: &str,
) -> Result<Duration, String> {
    let t = Instant::now();
    let resp = client
        .post(format!("{base}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .map_err(|e| format!("{base}: {e}"))?;
    let status = resp.status();
    resp.bytes().await.map_err(|e| e.to_string())?;
    if !status.is_success() {
        return Err(format!("{base}: status {status}"));
    }
    Ok(t.elapsed())
}

/// Where request `n` to target `urls` goes: the backends directly take turns.
fn pick(urls: &[String], n: usize) -> &str {
    &urls[n % urls.len()]
}

async fn warm_up(
    client: &reqwest::Client,
    targets: &[Vec<String>],
    bodies: &[String],
) -> Result<(), String> {
    for (n, body) in bodies.iter().enumerate() {
        for t in targets {
            send(client, pick(t, n), body).await?;
        }
    }
    Ok(())
}

/// Per-target latencies (µs): each client sends one body to every target in turn, starting at a
/// different target each time so none always sees a warmer connection.
async fn latency(
    client: &reqwest::Client,
    targets: &[Vec<String>],
    bodies: &[String],
    phase: Duration,
) -> Result<Vec<Vec<f64>>, String> {
    let deadline = Instant::now() + phase;
    let k = targets.len();
    let tasks: Vec<_> = (0..LATENCY_CLIENTS)
        .map(|c| {
            let (client, targets, bodies) = (client.clone(), targets.to_vec(), bodies.to_vec());
            tokio::spawn(async move {
                let mut out = vec![Vec::new(); k];
                let mut n = c;
                while Instant::now() < deadline {
                    let body = &bodies[n % bodies.len()];
                    for j in 0..k {
                        let i = (n + j) % k;
                        let took = send(&client, pick(&targets[i], n), body).await?;
                        out[i].push(took.as_secs_f64() * 1e6);
                    }
                    n += LATENCY_CLIENTS;
                }
                Ok::<_, String>(out)
            })
        })
        .collect();
    let mut all = vec![Vec::new(); k];
    for t in tasks {
        let out = t.await.map_err(|e| e.to_string())??;
        for (i, samples) in out.into_iter().enumerate() {
            all[i].extend(samples);
        }
    }
    Ok(all)
}

/// Requests/s and CPU µs per request of each target under `THROUGHPUT_CLIENTS` clients: all its
/// processes' ([`Target::cpu_time`]), then the picker's alone ([`Target::picker_cpu_time`]). Each
/// target runs two half phases, in forward then reverse order, so a slow spell of the shared
/// machine does not land on one config only.
async fn cpu_per_request(
    client: &reqwest::Client,
    targets: &[Target],
    bodies: &[String],
    phase: Duration,
) -> Result<(Vec<f64>, [Vec<Option<f64>>; 2]), String> {
    let k = targets.len();
    let clocks: [fn(&Target) -> Option<Duration>; 2] = [Target::cpu_time, Target::picker_cpu_time];
    let (mut rates, mut requests) = (vec![0.0; k], vec![0.0; k]);
    let mut cpu = [vec![Some(0.0); k], vec![Some(0.0); k]];
    let forward: Vec<usize> = (0..k).collect();
    let backward: Vec<usize> = (0..k).rev().collect();
    for order in [forward, backward] {
        for i in order {
            let before = clocks.map(|clock| clock(&targets[i]));
            let (rate, done) = throughput(client, &targets[i].url, bodies, phase / 2).await?;
            rates[i] += rate / 2.0;
            for (c, clock) in clocks.iter().enumerate() {
                cpu[c][i] = match (cpu[c][i], before[c], clock(&targets[i])) {
                    (Some(sum), Some(b), Some(a)) => Some(sum + (a - b).as_secs_f64()),
                    _ => None,
                };
            }
            requests[i] += done as f64;
        }
    }
    let per_req = cpu.map(|cpu| {
        (0..k)
            .map(|i| cpu[i].map(|c| c / f64::max(requests[i], 1.0) * 1e6))
            .collect()
    });
    Ok((rates, per_req))
}

/// Requests per second through `base` with `THROUGHPUT_CLIENTS` clients in a closed loop, and the
/// number of requests.
async fn throughput(
    client: &reqwest::Client,
    base: &str,
    bodies: &[String],
    phase: Duration,
) -> Result<(f64, u64), String> {
    let start = Instant::now();
    let deadline = start + phase;
    let tasks: Vec<_> = (0..THROUGHPUT_CLIENTS)
        .map(|c| {
            let (client, base, bodies) = (client.clone(), base.to_string(), bodies.to_vec());
            tokio::spawn(async move {
                let (mut n, mut done) = (c, 0u64);
                while Instant::now() < deadline {
                    send(&client, &base, &bodies[n % bodies.len()]).await?;
                    n += THROUGHPUT_CLIENTS;
                    done += 1;
                }
                Ok::<_, String>(done)
            })
        })
        .collect();
    let mut total = 0;
    for t in tasks {
        total += t.await.map_err(|e| e.to_string())??;
    }
    Ok((total as f64 / start.elapsed().as_secs_f64(), total))
}
