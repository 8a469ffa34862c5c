//! What kvroute costs inside Envoy: latency added over the same Envoy without the filter (p50,
//! p99) for 1 KB and 24 KB prompts at a steady load, and requests/s with and without it.
//!
//! Both Envoys run side by side against the same in-process backends, and every client alternates
//! between them request by request, so machine noise (this box is shared) hits both alike; the
//! numbers that matter are the differences and ratios, not the absolute values.

use std::time::{Duration, Instant};

use kvroute_harness::backend::Backend;
use kvroute_harness::{Envoy, EnvoyOptions, Lb};
use serde_json::json;

use crate::stats::percentile;

/// Prompt sizes measured, in bytes of prompt text.
const SIZES: [usize; 2] = [1024, 24 * 1024];
/// Concurrent clients for the latency runs: a steady load well below saturation.
const LATENCY_CLIENTS: usize = 4;
/// Concurrent clients for the throughput runs: enough to saturate a 2-core box.
const THROUGHPUT_CLIENTS: usize = 32;
/// Prefix groups: requests mostly follow affinity, the common path in production.
const GROUPS: usize = 16;

pub async fn overhead(seconds: u64, plugin_config: serde_json::Value) -> Result<(), String> {
    let backends = Backend::start_many(4)
        .await
        .map_err(|e| format!("backends: {e}"))?;
    let addrs: Vec<_> = backends.iter().map(Backend::addr).collect();
    let start = |lb: Lb| {
        Envoy::start(EnvoyOptions {
            backends: addrs.clone(),
            lb,
            ..EnvoyOptions::default()
        })
    };
    let plain = start(Lb::RoundRobin).await.map_err(|e| e.to_string())?;
    let kvroute = start(Lb::Kvroute { plugin_config })
        .await
        .map_err(|e| e.to_string())?;
    let targets = [plain.url(), kvroute.url()];
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(THROUGHPUT_CLIENTS)
        .build()
        .map_err(|e| e.to_string())?;
    let phase = Duration::from_secs(seconds.max(1));

    println!("kvroute overhead: Envoy+kvroute vs the same Envoy without it (--concurrency 2), side by side");
    println!("| prompt | clients | plain p50 | kvroute p50 | added p50 | plain p99 | kvroute p99 | added p99 |");
    println!("|---|---|---|---|---|---|---|---|");
    for size in SIZES {
        let bodies = bodies(size);
        warm_up(&client, &targets, &bodies).await?;
        let lat = latency(&client, &targets, &bodies, phase).await?;
        let p = |i: usize, q: f64| percentile(&lat[i], q).unwrap_or(f64::NAN);
        println!(
            "| {} KB | {LATENCY_CLIENTS} | {:.0} µs | {:.0} µs | {:+.0} µs | {:.0} µs | {:.0} µs | {:+.0} µs |",
            size / 1024,
            p(0, 0.5),
            p(1, 0.5),
            p(1, 0.5) - p(0, 0.5),
            p(0, 0.99),
            p(1, 0.99),
            p(1, 0.99) - p(0, 0.99),
        );
    }
    println!();
    println!("| prompt | clients | plain req/s | kvroute req/s | kvroute / plain | plain Envoy CPU/req | kvroute Envoy CPU/req |");
    println!("|---|---|---|---|---|---|---|");
    let envoys = [&plain, &kvroute];
    for size in SIZES {
        let bodies = bodies(size);
        // ABAB, so a slow spell of the shared machine does not land on one side only.
        let (mut rates, mut cpu, mut requests) = ([0.0f64; 2], [0.0f64; 2], [0.0f64; 2]);
        for order in [[0, 1], [1, 0]] {
            for i in order {
                let before = envoys[i].cpu_time().unwrap_or_default();
                let (rate, done) = throughput(&client, &targets[i], &bodies, phase / 2).await?;
                let after = envoys[i].cpu_time().unwrap_or_default();
                rates[i] += rate / 2.0;
                cpu[i] += (after - before).as_secs_f64();
                requests[i] += done as f64;
            }
        }
        let per_req = |i: usize| cpu[i] / requests[i].max(1.0) * 1e6;
        println!(
            "| {} KB | {THROUGHPUT_CLIENTS} | {:.0} | {:.0} | {:.2} | {:.0} µs | {:.0} µs |",
            size / 1024,
            rates[0],
            rates[1],
            rates[1] / rates[0],
            per_req(0),
            per_req(1),
        );
    }
    let routed = kvroute
        .stats("kvroute.routed.")
        .await
        .map_err(|e| e.to_string())?;
    let mut routed: Vec<_> = routed.into_iter().filter(|(_, v)| *v > 0).collect();
    routed.sort();
    println!("\nkvroute decisions during the run: {routed:?}");
    Ok(())
}

/// `GROUPS` × 8 chat bodies of about `size` bytes: a shared system prompt per group and a short
/// question, as OpenAI clients send them.
fn bodies(size: usize) -> Vec<String> {
    (0..GROUPS * 8)
        .map(|i| {
            let group = i % GROUPS;
            let system = format!("Group {group} system prompt. ").repeat(size / 24);
            json!({
                "model": "Qwen/Qwen3-32B",
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

async fn send(client: &reqwest::Client, base: &str, body: &str) -> Result<Duration, String> {
    let t = Instant::now();
    let resp = client
        .post(format!("{base}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let status = resp.status();
    resp.bytes().await.map_err(|e| e.to_string())?;
    if !status.is_success() {
        return Err(format!("{base}: status {status}"));
    }
    Ok(t.elapsed())
}

async fn warm_up(
    client: &reqwest::Client,
    targets: &[String],
    bodies: &[String],
) -> Result<(), String> {
    for body in bodies {
        for t in targets {
            send(client, t, body).await?;
        }
    }
    Ok(())
}

/// Per-target latencies (µs): each client alternates plain, kvroute, plain, ...
async fn latency(
    client: &reqwest::Client,
    targets: &[String; 2],
    bodies: &[String],
    phase: Duration,
) -> Result<[Vec<f64>; 2], String> {
    let deadline = Instant::now() + phase;
    let tasks: Vec<_> = (0..LATENCY_CLIENTS)
        .map(|c| {
            let (client, targets, bodies) = (client.clone(), targets.clone(), bodies.to_vec());
            tokio::spawn(async move {
                let mut out = [Vec::new(), Vec::new()];
                let mut n = c;
                while Instant::now() < deadline {
                    let body = &bodies[n % bodies.len()];
                    // Alternate which side goes first, so neither always sees a warmer connection.
                    for k in 0..2 {
                        let i = (n + k) % 2;
                        out[i].push(send(&client, &targets[i], body).await?.as_secs_f64() * 1e6);
                    }
                    n += LATENCY_CLIENTS;
                }
                Ok::<_, String>(out)
            })
        })
        .collect();
    let mut all = [Vec::new(), Vec::new()];
    for t in tasks {
        let [a, b] = t.await.map_err(|e| e.to_string())??;
        all[0].extend(a);
        all[1].extend(b);
    }
    Ok(all)
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
