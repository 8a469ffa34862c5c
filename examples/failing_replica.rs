//! Requests lost while one replica of a simulated fleet fails, through the shipped
//! `envoy/kvroute.yaml` with kvroute and with plain round robin: streamed chat requests at a steady
//! rate, one replica answering 500 to everything (or stopped, or slowed) for a while in the middle.
//! `cargo run --release --example failing_replica -- [--fault fail|stop|slow] [--rate 12]
//! [--seconds 30] [--from 10] [--for 10]` after `make build` (Envoy from `.venv`, the filter from
//! `target/`, or wherever `ENVOY_BIN` and `KVROUTE_WASM` say).

use kvroute::gateway::stat_names::{Counter, Gauge};
use kvroute_harness::{Envoy, EnvoyOptions, Lb};
use kvroute_sim::engine::Faults;
use kvroute_sim::fleet::Fleet;
use kvroute_sim::spec::FleetSpec;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Groups sharing a system prompt; requests cycle through them.
const GROUPS: usize = 12;
/// The replica that fails.
const FAULTY: usize = 1;

#[derive(Clone, Copy, Debug)]
enum Fault {
    /// Every generation request answered 500, `/health` still 200 (a dead engine).
    Fail,
    /// Listener closed, 503 on open connections.
    Stop,
    /// Ten times slower.
    Slow,
}

struct Args {
    fault: Fault,
    rate: f64,
    seconds: f64,
    from: f64,
    duration: f64,
}

fn args() -> Result<Args, String> {
    let mut a = Args {
        fault: Fault::Fail,
        rate: 12.0,
        seconds: 30.0,
        from: 10.0,
        duration: 10.0,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let number = || value.parse::<f64>().map_err(|e| format!("{flag}: {e}"));
        match flag.as_str() {
            "--fault" => {
                a.fault = match value.as_str() {
                    "fail" => Fault::Fail,
                    "stop" => Fault::Stop,
                    "slow" => Fault::Slow,
                    other => return Err(format!("--fault {other}: fail, stop or slow")),
                }
            }
            "--rate" => a.rate = number()?,
            "--seconds" => a.seconds = number()?,
            "--from" => a.from = number()?,
            "--for" => a.duration = number()?,
            other => return Err(format!("unknown flag {other}")),
        }
    }
    if a.rate <= 0.0 || a.seconds <= 0.0 {
        return Err("--rate and --seconds must be positive".into());
    }
    Ok(a)
}

fn faults(fault: Fault, on: bool, base: Faults) -> Faults {
    match fault {
        Fault::Fail => Faults {
            fail_rate: if on { 1.0 } else { 0.0 },
            ..base
        },
        Fault::Stop => Faults {
            stopped: on,
            ..base
        },
        Fault::Slow => Faults {
            slow_factor: if on { 10.0 } else { 1.0 },
            ..base
        },
    }
}

/// A streamed chat request of group `g`.
fn body(model: &str, g: usize, i: u64) -> Value {
    let system = format!("You are the assistant of team {g}. ").repeat(80);
    json!({
        "model": model,
        "stream": true,
        "stream_options": { "include_usage": true },
        "max_tokens": 32,
        "messages": [
            { "role": "system", "content": system },
            { "role": "user", "content": format!("question {i}") },
        ],
    })
}

/// Whether one streamed request came back whole.
async fn send(client: &reqwest::Client, url: &str, body: String) -> bool {
    let Ok(resp) = client
        .post(url)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
    else {
        return false;
    };
    let ok = resp.status() == 200;
    match resp.text().await {
        Ok(text) => ok && text.contains("data: [DONE]"),
        Err(_) => false,
    }
}

/// What one router's run gave.
struct Run {
    sent: u64,
    lost: u64,
    reached_faulty: u64,
    retries: u64,
    marks: u64,
}

async fn run(name: &str, lb: Lb, a: &Args) -> Result<Run, String> {
    let spec = FleetSpec {
        replicas: 4,
        kv_capacity_tokens: 16384,
        time_scale: 0.1,
        ..FleetSpec::default()
    };
    let sim = Fleet::start(spec, 0, 0)
        .await
        .map_err(|e| format!("sim fleet: {e}"))?;
    let envoy = Envoy::start(EnvoyOptions {
        backends: sim.replicas.iter().map(|r| r.addr).collect(),
        lb,
        ..EnvoyOptions::default()
    })
    .await
    .map_err(|e| e.to_string())?;
    if name == "kvroute" {
        let known = envoy.wait_for_stat(
            Gauge::EndpointsKnown.name(),
            |v| v == sim.replicas.len() as u64,
            Duration::from_secs(30),
        );
        known.await.map_err(|e| e.to_string())?;
    }
    let url = format!("{}/v1/chat/completions", envoy.url());
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .map_err(|e| e.to_string())?;
    let lost = Arc::new(AtomicU64::new(0));
    let faulty = &sim.replicas[FAULTY].replica;
    let base = faulty.faults();
    let start = Instant::now();
    let every = Duration::from_secs_f64(1.0 / a.rate);
    let total = (a.seconds * a.rate).round() as u64;
    let (mut on, mut reached_before, mut reached) = (false, 0, 0);
    let mut tasks = Vec::with_capacity(total as usize);
    for i in 0..total {
        tokio::time::sleep_until((start + every.mul_f64(i as f64)).into()).await;
        let t = start.elapsed().as_secs_f64();
        let want = t >= a.from && t < a.from + a.duration;
        if want != on {
            if want {
                reached_before = faulty.snapshot().requests;
            } else {
                reached += faulty.snapshot().requests - reached_before;
            }
            faulty.set_faults(faults(a.fault, want, base));
            on = want;
        }
        let (client, url, lost) = (client.clone(), url.clone(), lost.clone());
        let body = body(&sim.spec.model, i as usize % GROUPS, i).to_string();
        tasks.push(tokio::spawn(async move {
            if !send(&client, &url, body).await {
                lost.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    if on {
        reached += faulty.snapshot().requests - reached_before;
        faulty.set_faults(faults(a.fault, false, base));
    }
    let stat = |s: &'static str| {
        let envoy = &envoy;
        async move { envoy.stat(s).await.ok().flatten().unwrap_or(0) }
    };
    Ok(Run {
        sent: total,
        lost: lost.load(Ordering::Relaxed),
        reached_faulty: reached,
        retries: stat("cluster.inference_pool.upstream_rq_retry").await,
        marks: stat(Counter::SuspectMarked.name()).await,
    })
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let a = match args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("failing_replica: {e}");
            std::process::exit(2);
        }
    };
    println!(
        "replica {FAULTY} of 4: {:?} from {} s for {} s; {} streamed requests/s for {} s",
        a.fault, a.from, a.duration, a.rate, a.seconds
    );
    println!("| router | sent | lost | reached the faulty replica while faulty | Envoy retries | kvroute suspect marks |");
    println!("|---|---:|---:|---:|---:|---:|");
    let routers = [
        (
            "kvroute",
            Lb::Kvroute {
                plugin_config: json!({}),
            },
        ),
        ("round robin", Lb::RoundRobin),
    ];
    for (name, lb) in routers {
        match run(name, lb, &a).await {
            Ok(r) => println!(
                "| {name} | {} | {} | {} | {} | {} |",
                r.sent, r.lost, r.reached_faulty, r.retries, r.marks
            ),
            Err(e) => {
                eprintln!("failing_replica: {name}: {e}");
                std::process::exit(1);
            }
        }
    }
}
