//! Reads a bench run's `samples.jsonl` (`kvroute-bench compare`) and prints, per router, where its
//! cold prefills came from: requests whose replica had under a quarter of the prompt cached, split
//! into a group's first request on that replica and a group that was served there before (the
//! replica evicted it), and how many requests after 25 s went to a replica that had served more
//! than an even share of the groups (sent more than once) in the 8 s before (under cache pressure,
//! one group more than its cache has room for):
//! `cargo run --release --example crowding -- .work/<run>/samples.jsonl`.

use std::collections::{BTreeMap, HashMap, HashSet};

mod support;

/// How far back a replica's groups count, and from when requests are counted as crowded.
const WINDOW_MS: f64 = 8_000.0;
const LATE_MS: f64 = 25_000.0;

struct Sample {
    sent_ms: f64,
    group: String,
    replica: u64,
    cold: bool,
}

#[derive(Default)]
struct Crowding {
    requests: usize,
    first_on_replica: usize,
    evicted: usize,
    late: usize,
    crowded: usize,
}

fn measure(samples: &mut [Sample]) -> Crowding {
    samples.sort_by(|a, b| a.sent_ms.total_cmp(&b.sent_ms));
    // Groups sent more than once (a unique prompt takes no room in a cache for long).
    let mut sent: HashMap<&str, usize> = HashMap::new();
    for s in samples.iter() {
        *sent.entry(s.group.as_str()).or_default() += 1;
    }
    let recurring = |g: &str| sent.get(g).is_some_and(|&n| n > 1);
    let replicas: HashSet<u64> = samples.iter().map(|s| s.replica).collect();
    let groups = sent.keys().filter(|g| recurring(g)).count();
    let mut crowding = support::Crowding::new(WINDOW_MS, groups, replicas.len());
    let mut served: HashSet<(&str, u64)> = HashSet::new();
    let mut c = Crowding {
        requests: samples.len(),
        ..Crowding::default()
    };
    for s in samples.iter() {
        let key = (s.group.as_str(), s.replica);
        if s.cold {
            if served.contains(&key) {
                c.evicted += 1;
            } else {
                c.first_on_replica += 1;
            }
        }
        served.insert(key);
        let group = Some(s.group.as_str()).filter(|g| recurring(g));
        let crowded = crowding.served(s.replica, group, s.sent_ms);
        if s.sent_ms >= LATE_MS {
            c.late += 1;
            c.crowded += usize::from(crowded);
        }
    }
    c
}

fn read(path: &str) -> Result<BTreeMap<String, Vec<Sample>>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
    let mut routers: BTreeMap<String, Vec<Sample>> = BTreeMap::new();
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).map_err(|e| e.to_string())?;
        let (Some(replica), Some(prompt)) = (v["replica"].as_u64(), v["prompt_tokens"].as_u64())
        else {
            continue; // an error, or a router that does not say which replica served it
        };
        let cached = v["cached_tokens"].as_u64().unwrap_or(0);
        let group = support::group_of(v["user"].as_str().unwrap_or_default());
        routers
            .entry(v["router"].as_str().unwrap_or_default().to_string())
            .or_default()
            .push(Sample {
                sent_ms: v["sent_ms"].as_f64().unwrap_or_default(),
                group: group.to_string(),
                replica,
                cold: cached * 4 < prompt,
            });
    }
    Ok(routers)
}

fn main() {
    let Some(path) = std::env::args().nth(1) else {
        eprintln!("usage: crowding SAMPLES.jsonl");
        std::process::exit(2);
    };
    let routers = match read(&path) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("crowding: {e}");
            std::process::exit(1);
        }
    };
    println!(
        "| router | requests | cold: first on its replica | cold: evicted | after 25 s | to a \
         crowded replica |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    for (name, mut samples) in routers {
        let c = measure(&mut samples);
        println!(
            "| {name} | {} | {} | {} | {} | {} |",
            c.requests, c.first_on_replica, c.evicted, c.late, c.crowded
        );
    }
}
