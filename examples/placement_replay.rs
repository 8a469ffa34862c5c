//! Replays a bench run's requests (`samples.jsonl` from `kvroute-bench compare`) through the
//! groups table and the balanced assignment, as gateways' workers would see them (each worker
//! writes its counts to its gateway's table and reads the table back once a second, as
//! `cache_aware` does), and prints how often a group's home moved, on what, how even the homes'
//! traffic was (over the run and after 25 s), how much room the final weights give beyond the
//! groups' traffic, and how many requests went to a replica serving more than an even share of
//! the groups (10-25 s, after 25 s). With `--gateways N`, the requests are dealt round robin to N
//! gateways, each counting its own share, and with `--workers W` to each gateway's W workers in
//! turn (worker 0 weighs the groups, the others adopt its weights at their own ticks, as through
//! `leader`), and it also prints how often they would send a request to different replicas;
//! `--deals D` also replays D random deals (a real balancer's) and prints their means; `--ping`
//! adds the bench's first request (a one-off, before the run, at one gateway), `--ping-each` one
//! at every gateway; `--tick-ms` is `stats_interval_ms` (the shipped 500 unless given; the bench
//! runs kvroute with 1000); with `--endpoint-sets K`, the busiest/idlest after 25 s over K endpoint
//! sets (which groups share a home depends on the endpoints' ids):
//! `cargo run --release --example placement_replay -- .work/<run>/samples.jsonl [--moves]
//! [--gateways N] [--workers W] [--tick-ms MS] [--endpoint-sets K] [--deals D] [--ping]`.

use hashbrown::HashMap;
use kvroute::placement::homes::Homes;
use kvroute::placement::{self, FleetVolume, Shares, Tally};
use kvroute::policy::cache_aware::{HOLD_POLLS, WARMUP_POLLS};
use kvroute::rendezvous::{self, endpoint_id};
use kvroute::store::MemoryStore;

mod support;

/// How often a worker ticks unless `--tick-ms` says otherwise: the shipped `stats_interval_ms`.
const TICK_MS: u64 = 500;
/// How far back [`Replay::crowded`] looks at the groups an endpoint served.
const CROWDED_WINDOW_MS: u64 = 8_000;
/// Phases of a run by send time, as the bench reports hit rates: 0-10 s, 10-25 s, after 25 s.
const PHASES_MS: [u64; 2] = [10_000, 25_000];

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
        // The conversation is the whole user (`u<group>-<member>-<episode>`).
        let user = v["user"].as_str().unwrap_or_default();
        let group = support::group_of(user);
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

/// One gateway: its shared data (the groups table its workers write their counts to) and its
/// workers.
struct Gateway {
    table: MemoryStore,
    workers: Vec<Worker>,
    /// The worker the next request goes to.
    next_worker: usize,
}

impl Gateway {
    fn new(phase_ms: u64, workers: usize, tick_ms: u64) -> Gateway {
        Gateway {
            table: MemoryStore::new(),
            workers: (0..workers)
                .map(|w| {
                    Worker::new(
                        phase_ms + w as u64 * tick_ms / (2 * workers as u64),
                        tick_ms,
                    )
                })
                .collect(),
            next_worker: 0,
        }
    }

    /// Runs every worker's ticks due by `at_ms` in time order: worker 0 leads (it weighs the
    /// groups), the others adopt its weights at their own ticks, as `cache_aware` does through
    /// `leader`. Returns how many ticks recomputed the homes.
    fn tick_until(&mut self, at_ms: u64, finished: f64, eps: &[u32], show: Option<&str>) -> u32 {
        let mut recomputes = 0;
        loop {
            let Some(w) = (0..self.workers.len())
                .filter(|&w| self.workers[w].next_tick <= at_ms)
                .min_by_key(|&w| (self.workers[w].next_tick, w))
            else {
                return recomputes;
            };
            let now = self.workers[w].next_tick;
            let (lead, rest) = self.workers.split_at_mut(1);
            let (changed, worker) = match w {
                0 => (lead[0].tick(&self.table, finished, eps, show), &mut lead[0]),
                _ => (rest[w - 1].adopt(&self.table, &lead[0]), &mut rest[w - 1]),
            };
            if changed {
                worker.take_in(eps, now);
            }
            recomputes += u32::from(changed);
        }
    }
}

/// One worker of a gateway, as `cache_aware` keeps it: its copy of the table, the requests it
/// counted and has not written yet, its share of the traffic, and the homes it computed (first
/// rendezvous choice while warming up or for an uncounted group; a new home once it held).
struct Worker {
    tally: Tally,
    fleet: FleetVolume,
    counted: Vec<(u64, u32)>,
    shares: Shares,
    held: Homes,
    /// `held` has taken in `shares`, computed at `shares_ms`.
    assigned: bool,
    shares_ms: u64,
    /// Its ticks fall at `phase_ms` past each tick: gateways started at different moments.
    phase_ms: u64,
    /// From when it places by the assignment: its gateway's leader's warm-up end.
    warm_ms: u64,
    tick_ms: u64,
    next_tick: u64,
}

impl Worker {
    fn new(phase_ms: u64, tick_ms: u64) -> Worker {
        Worker {
            tally: Tally::default(),
            fleet: FleetVolume::default(),
            counted: Vec::new(),
            shares: Shares::new(),
            held: Homes::new(HOLD_POLLS * tick_ms),
            assigned: false,
            shares_ms: 0,
            phase_ms,
            warm_ms: phase_ms + WARMUP_POLLS * tick_ms,
            tick_ms,
            next_tick: phase_ms,
        }
    }

    /// Its next tick, as the leader, the fleet having finished `finished` requests: writes its
    /// counts to `table`, reads it and weighs the groups as `cache_aware`'s tick does. Returns
    /// whether the homes were recomputed; prints what moved if `show` (named `label`).
    fn tick(
        &mut self,
        table: &MemoryStore,
        finished: f64,
        eps: &[u32],
        show: Option<&str>,
    ) -> bool {
        let now = self.next_tick;
        self.next_tick += self.tick_ms;
        self.tally.sync(table, now);
        self.fleet.observe([("engines", finished)], now);
        let all = self.tally.seen();
        let min_requests = self.fleet.min_requests(placement::own_volume(&all, now));
        let seeing_ms = now.saturating_sub(self.phase_ms);
        let weighted = placement::weighted(&all, now, min_requests, seeing_ms);
        let counted = placement::steady(&self.counted, weighted);
        if counted == self.counted {
            return false;
        }
        let next = placement::shares(&counted, eps);
        let changed = moved(&self.shares, &next, &counted);
        if let Some(label) = show.filter(|_| !changed.is_empty()) {
            let added: Vec<_> = counted
                .iter()
                .copied()
                .filter(|c| !self.counted.contains(c))
                .collect();
            let gone: Vec<_> = self
                .counted
                .iter()
                .copied()
                .filter(|c| !counted.contains(c))
                .collect();
            println!(
                "{label}t={now} +{:?} -{:?} moved {changed:?}",
                names(&added),
                names(&gone)
            );
        }
        self.counted = counted;
        self.shares = next;
        self.assigned = false;
        self.shares_ms = now;
        true
    }

    /// Its next tick, as a follower: writes its counts to `table` and adopts what `leader`
    /// published. Returns whether that changed its homes.
    fn adopt(&mut self, table: &MemoryStore, leader: &Worker) -> bool {
        let now = self.next_tick;
        self.next_tick += self.tick_ms;
        self.tally.sync(table, now);
        self.warm_ms = leader.warm_ms;
        if (&self.counted, self.shares_ms) == (&leader.counted, leader.shares_ms) {
            return false;
        }
        self.counted = leader.counted.clone();
        self.shares = leader.shares.clone();
        self.shares_ms = leader.shares_ms;
        self.assigned = false;
        true
    }

    /// Takes in the assignment it just computed or adopted at its tick at `now`, as
    /// `cache_aware`'s tick does once warm (and once it has homes for an endpoint set).
    fn take_in(&mut self, eps: &[u32], now: u64) {
        if now >= self.warm_ms && !self.held.endpoints().is_empty() {
            self.held
                .update(eps, &self.shares, self.shares_ms.max(self.warm_ms));
            self.assigned = true;
        }
    }

    /// Where this worker sends `r` at `r.at_ms`, and whether the group is counted and split.
    fn home(&mut self, r: &Request, eps: &[u32]) -> (u32, bool, bool) {
        let (mut held, mut assigned) = (std::mem::take(&mut self.held), self.assigned);
        let out = self.place(&mut held, &mut assigned, r, eps);
        (self.held, self.assigned) = (held, assigned);
        out
    }

    /// Where this worker would send `r`, leaving its homes as they are: comparing the workers
    /// must not take in an assignment or move a held home for a worker that did not route `r`
    /// (before `cache_aware` took in assignments on its tick, that made every worker behave as
    /// if it had routed every request, and hid their disagreement).
    fn peek(&self, r: &Request, eps: &[u32]) -> u32 {
        let (mut held, mut assigned) = (self.held.clone(), self.assigned);
        self.place(&mut held, &mut assigned, r, eps).0
    }

    /// [`Worker::home`] with the homes `held` (and whether they took in the current shares).
    fn place(
        &self,
        held: &mut Homes,
        assigned: &mut bool,
        r: &Request,
        eps: &[u32],
    ) -> (u32, bool, bool) {
        let warm_ms = self.warm_ms;
        let warm = r.at_ms >= warm_ms;
        let first = eps[rendezvous::order(r.group, eps)[0]];
        let parts = self.shares.get(&r.group).filter(|_| warm);
        let (counted, split) = (parts.is_some(), parts.is_some_and(|h| h.len() > 1));
        if counted && !*assigned {
            held.update(eps, &self.shares, self.shares_ms.max(warm_ms));
            *assigned = true;
        }
        let home = counted
            .then(|| held.home(r.group, r.conversation, r.at_ms))
            .flatten()
            .unwrap_or(first);
        (home, counted, split)
    }

    /// Counts `r`, routed by this worker: a group new to it goes into `table` at once.
    fn saw(&mut self, table: &MemoryStore, r: &Request) {
        self.tally.count(table, r.group, r.at_ms);
    }
}

/// Requests per phase, and how many of them the gateways would have sent to different replicas.
#[derive(Default)]
struct Agreement {
    requests: [u64; 3],
    split: [u64; 3],
}

impl Agreement {
    fn add(&mut self, at_ms: u64, agree: bool) {
        let phase = PHASES_MS.iter().filter(|&&p| at_ms >= p).count();
        self.requests[phase] += 1;
        self.split[phase] += u64::from(!agree);
    }

    fn percent(&self, phase: usize) -> f64 {
        100.0 * self.split[phase] as f64 / self.requests[phase].max(1) as f64
    }
}

/// What a replay of one run's requests on one endpoint set found.
struct Replay {
    recomputes: u32,
    moves: usize,
    entry_moves: usize,
    split_requests: usize,
    /// Requests per home over the run, and after 25 s, in the order of the endpoints.
    loads: Vec<u64>,
    late: Vec<u64>,
    /// Gateway 0's weights at the end: their sum and the groups they cover.
    weight: u64,
    counted: usize,
    agreement: Agreement,
    /// Requests sent to an endpoint that served more groups over the last [`CROWDED_WINDOW_MS`]
    /// than an even share of the groups sent more than once (under cache pressure, its cache
    /// holds more prompts than it has room for): 10-25 s, and after 25 s.
    early_crowded: usize,
    crowded: usize,
}

#[derive(Clone, Copy)]
/// How a replay deals the requests: to `gateways` gateways in turn, each to its `workers` in
/// turn, which tick every `tick_ms` (`stats_interval_ms`).
struct Setup {
    gateways: usize,
    workers: usize,
    tick_ms: u64,
    /// Deal each request to a gateway and worker drawn by this seed instead of in turn.
    deal: Option<u64>,
    /// Every gateway first serves one request of its own ([`ping`]).
    ping_each: bool,
}

/// The bench's first request, sent to see a router answer before the run: a one-off prompt.
fn ping() -> Request {
    let key = xxhash_rust::xxh3::xxh3_64(b"ping");
    Request {
        at_ms: 0,
        group: key,
        conversation: key,
    }
}

/// Busiest over idlest of `loads`.
fn spread(loads: &[u64]) -> f64 {
    let (max, min) = (loads.iter().max(), loads.iter().min());
    max.zip(min)
        .map_or(0.0, |(&a, &b)| a as f64 / b.max(1) as f64)
}

/// The endpoint ids of `replicas` replicas on 127.0.0.1 from `first_port` on.
fn endpoint_set(replicas: usize, first_port: usize) -> Vec<u32> {
    (0..replicas)
        .map(|i| endpoint_id(&format!("127.0.0.1:{}", first_port + i)))
        .collect()
}

/// Replays `requests` through `gateways` gateways homing groups on `eps`.
fn replay(requests: &[Request], eps: &[u32], setup: &Setup, show_moves: bool) -> Replay {
    let Setup {
        gateways,
        workers,
        tick_ms,
        deal,
        ping_each,
    } = *setup;
    // Gateways started a little apart: their ticks fall at different moments.
    let mut gws: Vec<Gateway> = (0..gateways)
        .map(|k| Gateway::new(k as u64 * tick_ms / gateways as u64, workers, tick_ms))
        .collect();
    // Groups sent more than once (a unique prompt takes no room in a cache for long).
    let mut sent: HashMap<u64, usize> = HashMap::new();
    for r in requests {
        *sent.entry(r.group).or_default() += 1;
    }
    let recurring = |g: u64| sent.get(&g).is_some_and(|&n| n > 1);
    let groups = sent.keys().filter(|&&g| recurring(g)).count();
    let mut crowding = support::Crowding::new(CROWDED_WINDOW_MS as f64, groups, eps.len());
    if ping_each {
        for gw in gws.iter_mut() {
            gw.workers[0].saw(&gw.table, &ping());
        }
    }
    let (mut early_crowded, mut crowded) = (0, 0);
    // Each group's home for its previous request, and whether it was counted then.
    let mut last: HashMap<u64, (u32, bool)> = HashMap::new();
    let (mut recomputes, mut moves, mut entry_moves, mut split_requests) = (0, 0, 0, 0);
    let mut per_endpoint: HashMap<u32, u64> = HashMap::new();
    let mut per_endpoint_late: HashMap<u32, u64> = HashMap::new();
    let mut agreement = Agreement::default();
    for (i, r) in requests.iter().enumerate() {
        for (k, gw) in gws.iter_mut().enumerate() {
            let label = format!("gateway {k}: ");
            let show = show_moves.then_some(if gateways > 1 { label.as_str() } else { "" });
            recomputes += gw.tick_until(r.at_ms, i as f64, eps, show);
        }
        let homes: Vec<u32> = gws
            .iter()
            .flat_map(|gw| gw.workers.iter().map(|w| w.peek(r, eps)))
            .collect();
        agreement.add(r.at_ms, homes.iter().all(|&h| h == homes[0]));
        // The front balancer deals requests to the gateways in turn, each to its workers in turn.
        let (gw, at) = match deal {
            Some(seed) => {
                let draw = xxhash_rust::xxh3::xxh3_64_with_seed(&i.to_le_bytes(), seed) as usize;
                (&mut gws[draw % gateways], draw / gateways % workers)
            }
            None => {
                let gw = &mut gws[i % gateways];
                let at = gw.next_worker;
                gw.next_worker = (at + 1) % workers;
                (gw, at)
            }
        };
        let (home, is_counted, split) = gw.workers[at].home(r, eps);
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
        let group = Some(r.group).filter(|&g| recurring(g));
        let over = usize::from(crowding.served(u64::from(home), group, r.at_ms as f64));
        if r.at_ms >= PHASES_MS[1] {
            *per_endpoint_late.entry(home).or_default() += 1;
            crowded += over;
        } else if r.at_ms >= PHASES_MS[0] {
            early_crowded += over;
        }
        gw.workers[at].saw(&gw.table, r);
    }
    let loads_of = |counts: &HashMap<u32, u64>| -> Vec<u64> {
        eps.iter()
            .map(|e| counts.get(e).copied().unwrap_or(0))
            .collect()
    };
    let counted = &gws[0].workers[0].counted;
    Replay {
        recomputes,
        moves,
        entry_moves,
        split_requests,
        loads: loads_of(&per_endpoint),
        late: loads_of(&per_endpoint_late),
        weight: counted.iter().map(|&(_, w)| u64::from(w)).sum(),
        counted: counted.len(),
        agreement,
        early_crowded,
        crowded,
    }
}

/// The count after `flag` in `args`, at least 1; `default` without the flag.
fn count_arg(args: &[String], flag: &str, default: usize) -> usize {
    match args.iter().position(|a| a == flag) {
        Some(at) => match args.get(at + 1).and_then(|n| n.parse().ok()) {
            Some(n) if n >= 1 => n,
            _ => {
                eprintln!("placement_replay: {flag} needs a count of at least 1");
                std::process::exit(2);
            }
        },
        None => default,
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let show_moves = args.iter().any(|a| a == "--moves");
    let gateways = count_arg(&args, "--gateways", 1);
    let setup = Setup {
        gateways,
        workers: count_arg(&args, "--workers", 1),
        tick_ms: count_arg(&args, "--tick-ms", TICK_MS as usize) as u64,
        deal: None,
        ping_each: args.iter().any(|a| a == "--ping-each"),
    };
    let deals = count_arg(&args, "--deals", 1);
    let sets = count_arg(&args, "--endpoint-sets", 1);
    let path = args
        .iter()
        .enumerate()
        .find(|(i, a)| {
            !a.starts_with("--")
                && (*i == 0
                    || ![
                        "--gateways",
                        "--workers",
                        "--tick-ms",
                        "--endpoint-sets",
                        "--deals",
                    ]
                    .contains(&args[i - 1].as_str()))
        })
        .map(|(_, a)| a);
    let Some(path) = path else {
        eprintln!(
            "usage: placement_replay SAMPLES.jsonl [--moves] [--gateways N] [--workers W] \
             [--tick-ms MS] [--endpoint-sets K] [--deals D] [--ping | --ping-each]"
        );
        std::process::exit(2);
    };
    let (mut requests, replicas) = match read(path) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("placement_replay: {e}");
            std::process::exit(1);
        }
    };
    if args.iter().any(|a| a == "--ping") {
        requests.insert(0, ping());
    }
    let r = replay(&requests, &endpoint_set(replicas, 9001), &setup, show_moves);
    let groups = requests
        .iter()
        .map(|r| r.group)
        .collect::<hashbrown::HashSet<_>>()
        .len();
    println!(
        "{} requests, {groups} groups, {gateways} gateway(s), {} recomputes, {} moves of a \
         counted group, {} on being counted or dropped, {} requests of split groups, requests \
         per home {:?}",
        requests.len(),
        r.recomputes,
        r.moves,
        r.entry_moves,
        r.split_requests,
        r.loads
    );
    // Weights are in quarters of the mean group, so the groups' traffic is 4 per group: more
    // than that is the room the band around the mean adds (rare groups weighed as the mean).
    let traffic = placement::MEAN_WEIGHT * r.counted as u64;
    println!(
        "requests per home after 25 s {:?} (busiest/idlest {:.2}); weights at the end \
         (gateway 0): {} quarters over {} groups, {:.2}x their traffic's {traffic}",
        r.late,
        spread(&r.late),
        r.weight,
        r.counted,
        r.weight as f64 / traffic.max(1) as f64
    );
    if gateways * setup.workers > 1 {
        println!(
            "requests the gateways' workers would send to different replicas: 0-10 s {:.1}%, \
             10-25 s {:.1}%, after 25 s {:.1}%",
            r.agreement.percent(0),
            r.agreement.percent(1),
            r.agreement.percent(2)
        );
    }
    println!(
        "requests sent to a replica that served more than an even share of the groups in the {} \
         s before: 10-25 s {}, after 25 s {}",
        CROWDED_WINDOW_MS / 1000,
        r.early_crowded,
        r.crowded
    );
    if sets > 1 {
        // Which groups share a home depends on the endpoints' ids: other sets, other luck.
        let spreads: Vec<f64> = (0..sets)
            .map(|k| {
                let eps = endpoint_set(replicas, 9001 + 37 * k);
                spread(&replay(&requests, &eps, &setup, false).late)
            })
            .collect();
        let max = spreads.iter().copied().fold(0.0, f64::max);
        let over = spreads.iter().filter(|&&s| s > 2.5).count();
        println!(
            "busiest/idlest after 25 s over {sets} endpoint sets: mean {:.2}, max {max:.2}, over \
             2.5 in {over}",
            spreads.iter().sum::<f64>() / sets as f64
        );
    }
    if deals > 1 {
        // Which gateway and worker each request reaches is chance behind a real balancer: other
        // deals, other groups each gateway has yet to see.
        let runs: Vec<Replay> = (1..=deals as u64)
            .map(|seed| {
                let dealt = Setup {
                    deal: Some(seed),
                    ..setup
                };
                replay(&requests, &endpoint_set(replicas, 9001), &dealt, false)
            })
            .collect();
        let mean = |f: &dyn Fn(&Replay) -> f64| runs.iter().map(f).sum::<f64>() / deals as f64;
        let most = runs.iter().map(|r| r.crowded).max().unwrap_or(0);
        println!(
            "over {deals} random deals: requests to a crowded replica 10-25 s mean {:.1}, after \
             25 s mean {:.1} (most {most}), moves of a counted group {:.1}, requests the gateways' \
             workers would send to different replicas 10-25 s {:.1}%, after 25 s {:.1}%",
            mean(&|r| r.early_crowded as f64),
            mean(&|r| r.crowded as f64),
            mean(&|r| r.moves as f64),
            mean(&|r| r.agreement.percent(1)),
            mean(&|r| r.agreement.percent(2))
        );
    }
}
