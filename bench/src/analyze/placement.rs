//! A run's requests replayed through kvroute's own placement: each gateway a shared store
//! ([`MemoryStore`]) and its workers, each worker a [`GroupHomes`] as `cache_aware` keeps it,
//! counting the requests it routes, ticking every `stats_interval_ms` (the first worker to tick
//! leads and weighs the groups, the others adopt its weights) and placing each request. Prints how
//! often a group's home moved, on what, how even the homes' traffic was (over the run and after
//! 25 s), how much room the final weights give beyond the groups' traffic, and how many requests
//! went to a replica serving more than an even share of the groups (10-25 s, after 25 s); with
//! several gateways or workers, how often they would send a request to different replicas. For
//! that, twins of the gateways (their stores and workers, ticking and counting as they do, so
//! weighing alike) are asked where each of their workers would send each request, through the
//! same [`GroupHomes::home`]; asking moves a worker's held homes as routing would, so the
//! gateways that route are never asked about requests they did not route.

use super::crowding::Window;
use super::group_of;
use crate::driver::Sample;
use kvroute::placement::{self, leader, Shares};
use kvroute::policy::cache_aware::{GroupHomes, HOLD_POLLS, WARMUP_POLLS};
use kvroute::policy::Candidate;
use kvroute::prefix::PrefixKeys;
use kvroute::rendezvous::{self, endpoint_id};
use kvroute::store::MemoryStore;
use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// How far back [`Window`] looks at the groups an endpoint served.
const CROWDED_WINDOW_MS: u64 = 8_000;
/// Phases of a run by send time, as the bench reports hit rates: 0-10 s, 10-25 s, after 25 s.
const PHASES_MS: [u64; 2] = [10_000, 25_000];
/// The first port of the replicas' addresses the endpoint ids are made of (the simulator's).
const FIRST_PORT: usize = 9001;

/// How the replay deals the run's requests to gateways and workers, and what else it prints.
#[derive(Debug, Clone, Copy, clap::Args)]
pub struct Setup {
    /// Gateways the requests are dealt to in turn, each counting its own share.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
    pub gateways: u16,
    /// Worker VMs of each gateway, each dealt the gateway's requests in turn.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
    pub workers: u16,
    /// How often each worker ticks: `stats_interval_ms` (the shipped 500; the bench runs kvroute
    /// with 1000).
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u64).range(1..))]
    pub tick_ms: u64,
    /// Also replays over K endpoint sets (which groups share a home depends on the endpoints'
    /// ids) and prints how even the homes were after 25 s over them.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
    pub endpoint_sets: u16,
    /// Also replays D random deals (a real balancer's) and prints their means.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
    pub deals: u16,
    /// Prints each change of the weights at gateway 0's first worker that moved a group's home.
    #[arg(long)]
    pub moves: bool,
    /// Adds the bench's first request (a one-off, before the run) at the first gateway.
    #[arg(long, conflicts_with = "ping_each")]
    pub ping: bool,
    /// Has every gateway count one such request before the run.
    #[arg(long)]
    pub ping_each: bool,
}

struct Request {
    at_ms: u64,
    group: u64,
    conversation: u64,
}

/// The first router's requests of a run (every router was sent the same sequence), in the order
/// they were sent, and how many replicas served them.
fn requests(runs: &[(String, Vec<Sample>)]) -> (Vec<Request>, usize) {
    let samples = runs.first().map_or(&[][..], |(_, s)| s.as_slice());
    let replicas = samples
        .iter()
        .filter_map(|s| s.replica)
        .max()
        .map_or(0, |r| r + 1);
    let mut out: Vec<Request> = samples
        .iter()
        .map(|s| Request {
            at_ms: s.sent_ms as u64,
            group: xxh3_64(group_of(&s.user).as_bytes()),
            // The conversation is the whole user (`u<group>-<member>-<episode>`).
            conversation: xxh3_64(s.user.as_bytes()),
        })
        .collect();
    out.sort_by_key(|r| r.at_ms);
    (out, replicas)
}

/// The bench's first request, sent to see a router answer before the run: a one-off prompt.
fn ping() -> Request {
    let key = xxh3_64(b"ping");
    Request {
        at_ms: 0,
        group: key,
        conversation: key,
    }
}

/// The endpoints a replay places on: their addresses and ids.
struct Endpoints {
    addrs: Vec<String>,
    ids: Vec<u32>,
}

impl Endpoints {
    /// `replicas` replicas on 127.0.0.1 from `first_port` on.
    fn new(replicas: usize, first_port: usize) -> Endpoints {
        let addrs: Vec<String> = (0..replicas)
            .map(|i| format!("127.0.0.1:{}", first_port + i))
            .collect();
        let ids = addrs.iter().map(|a| endpoint_id(a)).collect();
        Endpoints { addrs, ids }
    }

    /// The endpoints as a policy sees them, idle.
    fn candidates(&self) -> Vec<Candidate<'_>> {
        (self.addrs.iter().zip(&self.ids))
            .map(|(addr, &id)| Candidate {
                addr,
                id,
                load: 0,
                queueing: false,
                retention_ms: None,
                queued_prefill: 0,
                prefill_rate: 0.0,
            })
            .collect()
    }
}

/// What a worker took in at its last tick: the published weights, since when they hold, the
/// end of the warm-up, and the balanced assignment of the weights.
#[derive(Default)]
struct View {
    weights: Vec<(u64, u32)>,
    weights_ms: u64,
    warm_ms: Option<u64>,
    shares: Shares,
}

/// One worker VM of a gateway: kvroute's [`GroupHomes`], and when it ticks next.
struct Worker {
    homes: GroupHomes,
    view: View,
    tick_ms: u64,
    next_tick: u64,
}

impl Worker {
    fn new(first_tick: u64, tick_ms: u64) -> Worker {
        Worker {
            homes: GroupHomes::new(WARMUP_POLLS * tick_ms, HOLD_POLLS * tick_ms),
            view: View::default(),
            tick_ms,
            next_tick: first_tick,
        }
    }

    /// Its next tick, the fleet having finished `finished` requests: writes its counts to
    /// `store` and leads or adopts ([`GroupHomes::tick`]). Returns the view it had before, if
    /// the weights changed.
    fn tick(&mut self, store: &MemoryStore, finished: f64, eps: &[u32]) -> Option<View> {
        let now = self.next_tick;
        self.next_tick += self.tick_ms;
        self.homes.tick(store, now, &[("engines", finished)]);
        // What the worker took in is what is published now: it wrote it, or adopted it.
        let published = leader::read(store).0.unwrap_or_default();
        self.view.warm_ms = Some(published.warm_ms);
        if (published.weights_ms, &published.weights) == (self.view.weights_ms, &self.view.weights)
        {
            return None;
        }
        let next = View {
            shares: placement::shares(&published.weights, eps),
            weights: published.weights,
            weights_ms: published.weights_ms,
            warm_ms: Some(published.warm_ms),
        };
        Some(std::mem::replace(&mut self.view, next))
    }

    /// Where this worker sends `r` ([`GroupHomes::home`]), and whether the group is counted and
    /// split between homes.
    fn place(&mut self, r: &Request, endpoints: &[Candidate]) -> (u32, bool, bool) {
        let ids: Vec<u32> = endpoints.iter().map(|c| c.id).collect();
        let keys = PrefixKeys {
            model: 0,
            keys: Vec::new(),
            group: r.group,
            head_chunks: 0,
            tail_from: 0,
            conversation: r.conversation,
        };
        let order = rendezvous::order(r.group, &ids);
        let at = self.homes.home(endpoints, &keys, &order, r.at_ms);
        let warm = self.view.warm_ms.is_some_and(|w| r.at_ms >= w);
        let weighed = |g: u64| self.view.weights.binary_search_by_key(&g, |&(k, _)| k);
        let counted = warm && weighed(r.group).is_ok();
        let split = counted && self.view.shares.get(&r.group).is_some_and(|h| h.len() > 1);
        (ids[at], counted, split)
    }
}

/// One gateway: its shared store, where its workers count the groups and the leader publishes
/// the weights, and its workers.
struct Gateway {
    store: MemoryStore,
    workers: Vec<Worker>,
    /// The worker the next request goes to.
    next_worker: usize,
}

impl Gateway {
    /// A gateway whose workers tick from `phase_ms` on, a little apart.
    fn new(phase_ms: u64, workers: usize, tick_ms: u64) -> Gateway {
        let start = |w: usize| phase_ms + w as u64 * tick_ms / (2 * workers as u64);
        Gateway {
            store: MemoryStore::new(),
            workers: (0..workers)
                .map(|w| Worker::new(start(w), tick_ms))
                .collect(),
            next_worker: 0,
        }
    }

    /// Runs every worker's ticks due by `at_ms`, in time order. Returns how many changed a
    /// worker's weights; writes to `log`, after `label`, what each change at the first worker
    /// moved if `show`.
    fn tick_until(
        &mut self,
        at_ms: u64,
        finished: f64,
        eps: &[u32],
        show: Option<&str>,
        log: &mut String,
    ) -> u32 {
        let mut changes = 0;
        loop {
            let Some(w) = (0..self.workers.len())
                .filter(|&w| self.workers[w].next_tick <= at_ms)
                .min_by_key(|&w| (self.workers[w].next_tick, w))
            else {
                return changes;
            };
            let now = self.workers[w].next_tick;
            let Some(before) = self.workers[w].tick(&self.store, finished, eps) else {
                continue;
            };
            changes += 1;
            if let Some(label) = show.filter(|_| w == 0) {
                *log += &moves_line(label, now, &before, &self.workers[0].view);
            }
        }
    }
}

/// `key/weight` of each group, short.
fn names(groups: &[(u64, u32)]) -> Vec<String> {
    groups
        .iter()
        .map(|(g, w)| format!("{:03x}/{w}", g >> 52))
        .collect()
}

/// What a change of the weights from `before` to `after` at `now` added, dropped and moved; empty
/// when it moved no group's home.
fn moves_line(label: &str, now: u64, before: &View, after: &View) -> String {
    let short =
        |h: &Vec<(u32, u64)>| -> Vec<(u32, u64)> { h.iter().map(|p| (p.0 % 100, p.1)).collect() };
    let homes = |h: &Vec<(u32, u64)>| -> Vec<u32> { h.iter().map(|p| p.0).collect() };
    let moved: Vec<String> = (after.weights.iter())
        .filter_map(|(g, w)| {
            let (b, a) = (before.shares.get(g)?, after.shares.get(g)?);
            (homes(a) != homes(b))
                .then(|| format!("{:03x}/{w}: {:?} -> {:?}", g >> 52, short(b), short(a)))
        })
        .collect();
    if moved.is_empty() {
        return String::new();
    }
    let not_in = |of: &[(u64, u32)], other: &[(u64, u32)]| -> Vec<(u64, u32)> {
        of.iter().copied().filter(|c| !other.contains(c)).collect()
    };
    let added = not_in(&after.weights, &before.weights);
    let gone = not_in(&before.weights, &after.weights);
    format!(
        "{label}t={now} +{:?} -{:?} moved {moved:?}\n",
        names(&added),
        names(&gone)
    )
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
    changes: u32,
    moves: usize,
    entry_moves: usize,
    split_requests: usize,
    /// Requests per home over the run, and after 25 s, in the order of the endpoints.
    loads: Vec<u64>,
    late: Vec<u64>,
    /// Gateway 0's first worker's weights at the end: their sum and the groups they cover.
    weight: u64,
    counted: usize,
    agreement: Agreement,
    /// Requests sent to an endpoint that served more groups over the last [`CROWDED_WINDOW_MS`]
    /// than an even share of the groups sent more than once (under cache pressure, its cache
    /// holds more prompts than it has room for): 10-25 s, and after 25 s.
    early_crowded: usize,
    crowded: usize,
    /// What moved at each change of the weights, when asked ([`moves_line`]).
    log: String,
}

/// Busiest over idlest of `loads`.
fn spread(loads: &[u64]) -> f64 {
    let (max, min) = (loads.iter().max(), loads.iter().min());
    max.zip(min)
        .map_or(0.0, |(&a, &b)| a as f64 / b.max(1) as f64)
}

/// Replays `requests` through the gateways of `setup` homing groups on `endpoints`, dealing each
/// request to a gateway and worker drawn by `deal`'s seed, or in turn without one; logs what
/// moved if `show_moves`.
fn replay(
    requests: &[Request],
    endpoints: &Endpoints,
    setup: &Setup,
    deal: Option<u64>,
    show_moves: bool,
) -> Replay {
    let (gateways, workers) = (setup.gateways as usize, setup.workers as usize);
    let (eps, candidates) = (&endpoints.ids, endpoints.candidates());
    // Gateways started a little apart: their ticks fall at different moments.
    let phase = |k: usize| k as u64 * setup.tick_ms / gateways as u64;
    let start = || -> Vec<Gateway> {
        (0..gateways)
            .map(|k| Gateway::new(phase(k), workers, setup.tick_ms))
            .collect()
    };
    let mut gws = start();
    // The twins asked where each worker would send each request; none for a lone worker.
    let mut asked = match gateways * workers {
        1 => Vec::new(),
        _ => start(),
    };
    // Groups sent more than once (a unique prompt takes no room in a cache for long).
    let mut sent: HashMap<u64, usize> = HashMap::new();
    for r in requests {
        *sent.entry(r.group).or_default() += 1;
    }
    let recurring = |g: u64| sent.get(&g).is_some_and(|&n| n > 1);
    let groups = sent.keys().filter(|&&g| recurring(g)).count();
    let mut window = Window::new(CROWDED_WINDOW_MS as f64, groups, eps.len());
    if setup.ping_each {
        for gw in gws.iter_mut().chain(asked.iter_mut()) {
            gw.workers[0].homes.count(&gw.store, ping().group, 0);
        }
    }
    let (mut early_crowded, mut crowded) = (0, 0);
    // Each group's home for its previous request, and whether it was counted then.
    let mut last: HashMap<u64, (u32, bool)> = HashMap::new();
    let (mut changes, mut moves, mut entry_moves, mut split_requests) = (0, 0, 0, 0);
    let mut per_endpoint: HashMap<u32, u64> = HashMap::new();
    let mut per_endpoint_late: HashMap<u32, u64> = HashMap::new();
    let mut agreement = Agreement::default();
    let mut log = String::new();
    for (i, r) in requests.iter().enumerate() {
        for (k, gw) in gws.iter_mut().enumerate() {
            let label = format!("gateway {k}: ");
            let show = show_moves.then_some(if gateways > 1 { label.as_str() } else { "" });
            changes += gw.tick_until(r.at_ms, i as f64, eps, show, &mut log);
        }
        if !asked.is_empty() {
            let mut homes = Vec::with_capacity(gateways * workers);
            for gw in asked.iter_mut() {
                gw.tick_until(r.at_ms, i as f64, eps, None, &mut String::new());
                for worker in gw.workers.iter_mut() {
                    homes.push(worker.place(r, &candidates).0);
                }
            }
            agreement.add(r.at_ms, homes.iter().all(|&h| h == homes[0]));
        }
        // The front balancer deals requests to the gateways in turn, each to its workers in turn.
        let (g, w) = match deal {
            Some(seed) => {
                let draw = xxh3_64_with_seed(&i.to_le_bytes(), seed) as usize;
                (draw % gateways, draw / gateways % workers)
            }
            None => {
                let gw = &mut gws[i % gateways];
                let w = gw.next_worker;
                gw.next_worker = (w + 1) % workers;
                (i % gateways, w)
            }
        };
        let (home, is_counted, split) = gws[g].workers[w].place(r, &candidates);
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
        let over = usize::from(window.served(u64::from(home), group, r.at_ms as f64));
        if r.at_ms >= PHASES_MS[1] {
            *per_endpoint_late.entry(home).or_default() += 1;
            crowded += over;
        } else if r.at_ms >= PHASES_MS[0] {
            early_crowded += over;
        }
        for gw in [gws.get_mut(g), asked.get_mut(g)].into_iter().flatten() {
            gw.workers[w].homes.count(&gw.store, r.group, r.at_ms);
        }
    }
    let loads_of = |counts: &HashMap<u32, u64>| -> Vec<u64> {
        eps.iter()
            .map(|e| counts.get(e).copied().unwrap_or(0))
            .collect()
    };
    let weights = &gws[0].workers[0].view.weights;
    Replay {
        changes,
        moves,
        entry_moves,
        split_requests,
        loads: loads_of(&per_endpoint),
        late: loads_of(&per_endpoint_late),
        weight: weights.iter().map(|&(_, w)| u64::from(w)).sum(),
        counted: weights.len(),
        agreement,
        early_crowded,
        crowded,
        log,
    }
}

/// The replay of a run's requests (`runs`, from its samples.jsonl) as `setup` deals them.
pub fn report(runs: &[(String, Vec<Sample>)], setup: &Setup) -> String {
    let (mut requests, replicas) = requests(runs);
    if setup.ping {
        requests.insert(0, ping());
    }
    let endpoints = Endpoints::new(replicas, FIRST_PORT);
    let r = replay(&requests, &endpoints, setup, None, setup.moves);
    let mut s = r.log.clone();
    let groups = requests
        .iter()
        .map(|r| r.group)
        .collect::<HashSet<_>>()
        .len();
    let _ = writeln!(
        s,
        "{} requests, {groups} groups, {} gateway(s), {} recomputes, {} moves of a counted group, \
         {} on being counted or dropped, {} requests of split groups, requests per home {:?}",
        requests.len(),
        setup.gateways,
        r.changes,
        r.moves,
        r.entry_moves,
        r.split_requests,
        r.loads
    );
    // Weights are in quarters of the mean group, so the groups' traffic is 4 per group: more
    // than that is the room the band around the mean adds (rare groups weighed as the mean).
    let traffic = placement::MEAN_WEIGHT * r.counted as u64;
    let _ = writeln!(
        s,
        "requests per home after 25 s {:?} (busiest/idlest {:.2}); weights at the end \
         (gateway 0): {} quarters over {} groups, {:.2}x their traffic's {traffic}",
        r.late,
        spread(&r.late),
        r.weight,
        r.counted,
        r.weight as f64 / traffic.max(1) as f64
    );
    if setup.gateways * setup.workers > 1 {
        let _ = writeln!(
            s,
            "requests the gateways' workers would send to different replicas: 0-10 s {:.1}%, \
             10-25 s {:.1}%, after 25 s {:.1}%",
            r.agreement.percent(0),
            r.agreement.percent(1),
            r.agreement.percent(2)
        );
    }
    let _ = writeln!(
        s,
        "requests sent to a replica that served more than an even share of the groups in the {} \
         s before: 10-25 s {}, after 25 s {}",
        CROWDED_WINDOW_MS / 1000,
        r.early_crowded,
        r.crowded
    );
    if setup.endpoint_sets > 1 {
        // Which groups share a home depends on the endpoints' ids: other sets, other luck.
        let sets = setup.endpoint_sets as usize;
        let spreads: Vec<f64> = (0..sets)
            .map(|k| {
                let eps = Endpoints::new(replicas, FIRST_PORT + 37 * k);
                spread(&replay(&requests, &eps, setup, None, false).late)
            })
            .collect();
        let max = spreads.iter().copied().fold(0.0, f64::max);
        let over = spreads.iter().filter(|&&s| s > 2.5).count();
        let _ = writeln!(
            s,
            "busiest/idlest after 25 s over {sets} endpoint sets: mean {:.2}, max {max:.2}, over \
             2.5 in {over}",
            spreads.iter().sum::<f64>() / sets as f64
        );
    }
    if setup.deals > 1 {
        // Which gateway and worker each request reaches is chance behind a real balancer: other
        // deals, other groups each gateway has yet to see.
        let deals = setup.deals as u64;
        let runs: Vec<Replay> = (1..=deals)
            .map(|seed| replay(&requests, &endpoints, setup, Some(seed), false))
            .collect();
        let mean = |f: &dyn Fn(&Replay) -> f64| runs.iter().map(f).sum::<f64>() / deals as f64;
        let most = runs.iter().map(|r| r.crowded).max().unwrap_or(0);
        let _ = writeln!(
            s,
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
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run of `groups` groups of two users each, one request every 100 ms for 40 s, the
    /// groups in turn, on four replicas.
    fn run(groups: usize) -> Vec<(String, Vec<Sample>)> {
        let samples = (0..400)
            .map(|t| Sample {
                user: format!("u{}-{}-0", t % groups, t / groups % 2),
                sent_ms: t as f64 * 100.0,
                replica: Some(t % 4),
                ..Sample::default()
            })
            .collect();
        vec![("kvroute".into(), samples)]
    }

    fn setup(gateways: u16, workers: u16) -> Setup {
        Setup {
            gateways,
            workers,
            tick_ms: 500,
            endpoint_sets: 1,
            deals: 1,
            moves: false,
            ping: false,
            ping_each: false,
        }
    }

    #[test]
    fn one_gateway_places_every_request_and_weighs_every_group() {
        let (requests, replicas) = requests(&run(8));
        assert_eq!((requests.len(), replicas), (400, 4));
        let endpoints = Endpoints::new(replicas, FIRST_PORT);
        let r = replay(&requests, &endpoints, &setup(1, 1), None, false);
        assert_eq!(r.loads.iter().sum::<u64>(), 400);
        assert_eq!(r.counted, 8, "every group is weighed by the end");
        assert!(r.changes >= 1);
        // Eight groups alike on four replicas, once placed: two each.
        assert!(spread(&r.late) < 1.2, "{:?}", r.late);
    }

    #[test]
    fn a_replay_is_the_same_every_time_and_several_workers_say_how_far_they_agree() {
        let one = report(&run(8), &setup(1, 1));
        assert_eq!(one, report(&run(8), &setup(1, 1)));
        assert!(
            one.starts_with("400 requests, 8 groups, 1 gateway(s), "),
            "{one}"
        );
        assert!(!one.contains("different replicas"), "{one}");
        let four = report(&run(8), &setup(2, 2));
        assert!(four.contains("would send to different replicas"), "{four}");
        assert_eq!(four, report(&run(8), &setup(2, 2)));
    }
}
