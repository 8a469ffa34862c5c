//! Replays a bench run's requests (`samples.jsonl` from `kvroute-bench compare`) through the
//! groups table and the balanced assignment, as one gateway with one worker would see them, and
//! prints how often a group's home moved, on what, and how even the homes' traffic was:
//! `cargo run --release --example placement_replay -- .work/<run>/samples.jsonl [--moves]`.

use hashbrown::HashMap;
use kvroute::groups::{self, Seen, Shares};
use kvroute::rendezvous::{self, endpoint_id};

/// How often the table is read and the homes recomputed (the groups table's flush period).
const TICK_MS: u64 = groups::FLUSH_MS;

struct Request {
    at_ms: u64,
    group: u64,
    conversation: u64,
}

/// One router's requests (every router was sent the same sequence), in the order they were sent,
/// and how many replicas served them.
fn read(path: &str) -> Result<(Vec<Request>, usize), String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
    let mut out = Vec::new();
    let mut router = None;
    let mut replicas = 0;
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).map_err(|e| e.to_string())?;
        let name = v["router"].as_str().unwrap_or_default().to_string();
        if router.get_or_insert_with(|| name.clone()) != &name {
            continue;
        }
        if let Some(r) = v["replica"].as_u64() {
            replicas = replicas.max(r as usize + 1);
        }
        // `u<group>-<member>-<episode>`: the group is the first part, the conversation all of it.
        let user = v["user"].as_str().unwrap_or_default();
        let group = user.split('-').next().unwrap_or_default();
        out.push(Request {
            at_ms: v["sent_ms"].as_f64().unwrap_or_default() as u64,
            group: xxhash_rust::xxh3::xxh3_64(group.as_bytes()),
            conversation: xxhash_rust::xxh3::xxh3_64(user.as_bytes()),
        });
    }
    out.sort_by_key(|r| r.at_ms);
    Ok((out, replicas))
}

/// `key/weight` of each group, short.
fn names(groups: &[(u64, u32)]) -> Vec<String> {
    groups
        .iter()
        .map(|(g, w)| format!("{:03x}/{w}", g >> 52))
        .collect()
}

/// The groups whose homes (not only their shares) differ between two assignments, with both.
fn moved(before: &Shares, after: &Shares, counted: &[(u64, u32)]) -> Vec<String> {
    let short =
        |h: &Vec<(u32, u64)>| -> Vec<(u32, u64)> { h.iter().map(|p| (p.0 % 100, p.1)).collect() };
    counted
        .iter()
        .filter_map(|(g, w)| {
            let (b, a) = (before.get(g)?, after.get(g)?);
            let homes = |h: &Vec<(u32, u64)>| -> Vec<u32> { h.iter().map(|p| p.0).collect() };
            (homes(a) != homes(b))
                .then(|| format!("{:03x}/{w}: {:?} -> {:?}", g >> 52, short(b), short(a)))
        })
        .collect()
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let show_moves = args.iter().any(|a| a == "--moves");
    let Some(path) = args.iter().find(|a| !a.starts_with("--")) else {
        eprintln!("usage: placement_replay SAMPLES.jsonl [--moves]");
        std::process::exit(2);
    };
    let (requests, replicas) = match read(path) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("placement_replay: {e}");
            std::process::exit(1);
        }
    };
    let eps: Vec<u32> = (0..replicas)
        .map(|i| endpoint_id(&format!("127.0.0.1:{}", 9001 + i)))
        .collect();
    let mut seen: HashMap<u64, Seen> = HashMap::new();
    let mut shares = Shares::new();
    let mut counted: Vec<(u64, u32)> = Vec::new();
    let mut next_tick = 0;
    // Each group's home for its previous request, and whether it was counted then.
    let mut last: HashMap<u64, (u32, bool)> = HashMap::new();
    let (mut recomputes, mut moves, mut entry_moves, mut split_requests) = (0, 0, 0, 0);
    let mut per_endpoint: HashMap<u32, u64> = HashMap::new();
    for r in &requests {
        while r.at_ms >= next_tick {
            let all: Vec<Seen> = seen.values().copied().collect();
            let now = groups::weighted(&all, next_tick, groups::MIN_REQUESTS);
            if now != counted {
                let next = groups::shares(&now, &eps);
                let changed = moved(&shares, &next, &now);
                if show_moves && !changed.is_empty() {
                    let added: Vec<_> = now
                        .iter()
                        .copied()
                        .filter(|c| !counted.contains(c))
                        .collect();
                    let gone: Vec<_> = counted
                        .iter()
                        .copied()
                        .filter(|c| !now.contains(c))
                        .collect();
                    println!(
                        "t={next_tick} +{:?} -{:?} moved {changed:?}",
                        names(&added),
                        names(&gone)
                    );
                }
                counted = now;
                shares = next;
                recomputes += 1;
            }
            next_tick += TICK_MS;
        }
        let first = eps[rendezvous::order(r.group, &eps)[0]];
        let parts = shares.get(&r.group);
        let home = parts
            .and_then(|h| groups::home_of(h, r.conversation))
            .unwrap_or(first);
        let is_counted = parts.is_some();
        let split = parts.is_some_and(|h| h.len() > 1);
        split_requests += usize::from(split);
        // A move: the group's previous request went elsewhere, and no split keeps them apart.
        if let Some(&(before, was_counted)) = last.get(&r.group) {
            if before != home && !split {
                if was_counted == is_counted {
                    moves += 1;
                } else {
                    entry_moves += 1;
                }
            }
        }
        last.insert(r.group, (home, is_counted));
        *per_endpoint.entry(home).or_default() += 1;
        let entry = seen.entry(r.group).or_insert(Seen {
            key: r.group,
            last_ms: r.at_ms,
            requests: 0.0,
        });
        entry.requests = (entry.requests_at(r.at_ms) + 1.0) as f32;
        entry.last_ms = r.at_ms;
    }
    let loads: Vec<u64> = eps
        .iter()
        .map(|e| per_endpoint.get(e).copied().unwrap_or(0))
        .collect();
    println!(
        "{} requests, {} groups, {recomputes} recomputes, {moves} moves of a counted group, \
         {entry_moves} on being counted or dropped, {split_requests} requests of split groups, \
         requests per home {loads:?}",
        requests.len(),
        seen.len()
    );
}
