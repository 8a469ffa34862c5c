//! One lab run: one workload seed through one router against a fresh fleet, on the virtual clock.
//! Arrivals follow the wall-clock driver's schedule (the same RNG and stages); every request is
//! timed at its first token and its end, as the client sees them.

use super::fleet::{Fleet, Prepared};
use super::gateways::{self, Held, LabGateway};
use super::index::LabIndex;
use super::queue::Queue;
use super::smg::{self, Smg};
use super::Options;
use crate::driver::{RunOutcome, Sample};
use crate::oracle;
use crate::routers::Router;
use crate::sim_process::{MatchReplica, MatchResult};
use crate::workload::{Arrival, Request, RequestStream, Workload};
use kvroute_sim::engine::core::{Emit, Happened};
use kvroute_sim::kv_events::Published;
use kvroute_sim::request::Endpoint;
use kvroute_sim::sse::{self, ChunkWriter};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::VecDeque;
use std::time::Duration;

/// Open-loop arrivals beyond this many in flight are not sent and count as errors (the
/// wall-clock driver's cap).
const MAX_IN_FLIGHT: usize = 512;
/// After the last stage, how long in-flight requests may take to finish.
const DRAIN: Duration = Duration::from_secs(60);

enum Event {
    /// The next open-loop arrival.
    Arrive,
    /// A closed-loop stage begins.
    Stage(usize),
    /// Replica `r`'s engine has something due (if this is still its next event).
    Wake(usize),
    /// Worker `w` of gateway `g` ticks.
    Tick { g: usize, w: usize, period_ms: u64 },
    /// A poll's answer reaches worker `w` of gateway `g`.
    Answer {
        g: usize,
        w: usize,
        token: u32,
        status: u16,
        body: Vec<u8>,
    },
    /// KV events of replica `r` reach the indexer.
    Publish { r: usize, batch: Published },
    /// smg instance `i` reads every engine's `/metrics`.
    SmgPoll(usize),
}

/// How each router's instances decide.
enum Routing {
    RoundRobin {
        next: usize,
    },
    LeastRequest {
        rng: Box<ChaCha8Rng>,
    },
    Kvroute {
        gateways: Vec<LabGateway>,
        next: usize,
    },
    Smg {
        instances: Vec<Smg>,
        next: usize,
    },
    Oracle {
        sent: Vec<u64>,
        recent: VecDeque<(usize, String, Duration)>,
    },
}

/// A request on its way: when it was sent, where it went, and what the router holds of it.
struct Flight {
    sample: Sample,
    sent: Duration,
    replica: usize,
    instance: usize,
    held: Option<Held>,
    prompt_tokens: usize,
    output_tokens: usize,
    include_usage: bool,
    endpoint: Endpoint,
}

pub struct Run<'a> {
    opts: &'a Options,
    q: Queue<Event>,
    fleet: Fleet,
    index: Option<LabIndex>,
    routing: Routing,
    /// Requests in flight at each replica, over all instances (Envoy's view for least_request).
    active: Vec<u64>,
    wakes: Vec<Option<Duration>>,
    flights: Vec<Option<Flight>>,
    samples: Vec<Sample>,
    in_flight: usize,
    requests: RequestStream,
    workload: Workload,
    arrivals: ChaCha8Rng,
    /// Open loop: the next arrival's time and its stage.
    next_arrival: Option<(Duration, usize)>,
    /// Closed loop: requests to keep in flight now.
    level: usize,
    end: Duration,
    loss: ChaCha8Rng,
}

impl<'a> Run<'a> {
    pub fn new(opts: &'a Options, workload: &Workload, router: &Router) -> Result<Run<'a>, String> {
        let fleet = Fleet::new(opts.spec.clone(), opts.vocab.clone(), workload.seed);
        let replicas = fleet.addrs.len();
        let (inner, instances) = match router {
            Router::Scaled(inner, n) => (inner.as_ref(), *n as usize),
            other => (other, 1),
        };
        let mut index = None;
        let routing = match inner {
            Router::RoundRobin => Routing::RoundRobin { next: 0 },
            Router::LeastRequest => Routing::LeastRequest {
                rng: Box::new(ChaCha8Rng::seed_from_u64(workload.seed ^ 0x1ea5)),
            },
            Router::Kvroute(_) | Router::KvroutePrecise => {
                let config = opts.plugin_config(inner)?;
                if inner.is_precise() {
                    let model = &opts.spec.model;
                    let kinds: Vec<_> = (0..replicas).map(|r| opts.spec.kind(r)).collect();
                    let block = opts.spec.block_size;
                    index = Some(LabIndex::new(&fleet.addrs, model, block, &kinds)?);
                }
                let gateways = (0..instances)
                    .map(|_| LabGateway::new(&config, opts.workers, replicas))
                    .collect::<Result<Vec<_>, _>>()?;
                Routing::Kvroute { gateways, next: 0 }
            }
            Router::Smg => Routing::Smg {
                instances: (0..instances)
                    .map(|i| Smg::new(replicas, workload.seed ^ ((i as u64) << 8)))
                    .collect(),
                next: 0,
            },
            Router::Oracle => Routing::Oracle {
                sent: vec![0; replicas],
                recent: VecDeque::new(),
            },
            other => return Err(format!("{}: not modelled in the lab", other.name())),
        };
        let stages = workload.arrival.stages();
        let stage_len = Duration::from_secs_f64(workload.stage_duration_s);
        let mut run = Run {
            opts,
            q: Queue::default(),
            index,
            routing,
            active: vec![0; replicas],
            wakes: vec![None; replicas],
            flights: Vec::new(),
            samples: Vec::new(),
            in_flight: 0,
            requests: workload.stream(&opts.spec.model),
            workload: workload.clone(),
            arrivals: ChaCha8Rng::seed_from_u64(workload.seed ^ 0xA11_7E5),
            next_arrival: None,
            level: 0,
            end: stage_len * stages as u32,
            loss: ChaCha8Rng::seed_from_u64(workload.seed ^ 0x1055),
            fleet,
        };
        run.start_ticks();
        run.start_smg_polls();
        match &workload.arrival {
            Arrival::Poisson { .. } => {
                run.next_arrival = run.arrival_after(Duration::ZERO, 0);
                if let Some((at, _)) = run.next_arrival {
                    run.q.at(at, Event::Arrive);
                }
            }
            Arrival::Concurrency { .. } => {
                for s in 0..stages {
                    run.q.at(stage_len * s as u32, Event::Stage(s));
                }
            }
        }
        Ok(run)
    }

    /// Every gateway worker's first tick, each at its own phase within the first interval.
    fn start_ticks(&mut self) {
        let Routing::Kvroute { gateways, .. } = &self.routing else {
            return;
        };
        let mut phases = ChaCha8Rng::seed_from_u64(self.workload.seed ^ 0x71c);
        let mut first = Vec::new();
        for (g, gateway) in gateways.iter().enumerate() {
            for (w, worker) in gateway.workers.iter().enumerate() {
                let period = worker.tick_period().max(1);
                let phase = phases.random_range(0..period);
                first.push((Duration::from_millis(phase), g, w, period));
            }
        }
        for (at, g, w, period_ms) in first {
            self.q.at(at, Event::Tick { g, w, period_ms });
        }
    }

    /// Every smg instance's first poll of the engines, at its own phase within the interval.
    fn start_smg_polls(&mut self) {
        let Routing::Smg { instances, .. } = &self.routing else {
            return;
        };
        let mut phases = ChaCha8Rng::seed_from_u64(self.workload.seed ^ 0x5a6);
        for i in 0..instances.len() {
            let phase = phases.random_range(0..smg::POLL_INTERVAL_MS);
            self.q.at(Duration::from_millis(phase), Event::SmgPoll(i));
        }
    }

    /// smg instance `i` reads each engine's load, as its worker monitor does.
    fn smg_poll(&mut self, now: Duration, i: usize) {
        let Routing::Smg { instances, .. } = &mut self.routing else {
            return;
        };
        for (r, core) in self.fleet.cores.iter().enumerate() {
            let s = core.snapshot();
            let report = smg::Report {
                running: s.running as u32,
                waiting: s.waiting as u32,
                kv_usage: s.kv_usage,
            };
            instances[i].report(r, report);
        }
        let next = now + Duration::from_millis(smg::POLL_INTERVAL_MS);
        self.q.at(next, Event::SmgPoll(i));
    }

    /// The open-loop arrival after `from` in stage `stage` or a later one, as the wall-clock
    /// driver draws it: exponential gaps at the stage's rate from the stage's start.
    fn arrival_after(&mut self, from: Duration, mut stage: usize) -> Option<(Duration, usize)> {
        let Arrival::Poisson { qps } = &self.workload.arrival else {
            return None;
        };
        let stage_len = Duration::from_secs_f64(self.workload.stage_duration_s);
        let mut next = from;
        while stage < qps.len() {
            let deadline = stage_len * (stage as u32 + 1);
            let rate = qps[stage];
            if rate > 0.0 {
                let gap: f64 = -(1.0 - self.arrivals.random::<f64>()).ln() / rate;
                next += Duration::from_secs_f64(gap);
            } else {
                next = deadline;
            }
            if next < deadline {
                return Some((next, stage));
            }
            stage += 1;
            next = deadline;
        }
        None
    }

    /// Runs to the end: every request answered, or the drain time over.
    pub fn finish(mut self) -> (RunOutcome, Vec<u64>, u64, u64) {
        let mut happened = Vec::new();
        while let Some((now, event)) = self.q.pop() {
            if now > self.end + DRAIN {
                break;
            }
            match event {
                Event::Arrive => self.arrive(now),
                Event::Stage(s) => {
                    if let Arrival::Concurrency { levels } = &self.workload.arrival {
                        self.level = levels[s].max(1);
                    }
                    self.top_up(now);
                }
                Event::Wake(r) => {
                    if self.wakes[r] != Some(now) {
                        continue;
                    }
                    self.wakes[r] = None;
                    happened.clear();
                    let published = self.fleet.advance(r, now, &mut happened);
                    self.published(now, r, published);
                    for h in happened.drain(..) {
                        self.happened(now, r, h);
                    }
                    self.rewake(r);
                }
                Event::Tick { g, w, period_ms } => self.tick(now, g, w, period_ms),
                Event::Answer {
                    g,
                    w,
                    token,
                    status,
                    body,
                } => {
                    if let Routing::Kvroute { gateways, .. } = &mut self.routing {
                        gateways[g].set_clock(now);
                        gateways[g].workers[w].on_poll_answer(token, Some(status), Some(body));
                    }
                    self.send_calls(now, g, w);
                }
                Event::SmgPoll(i) => self.smg_poll(now, i),
                Event::Publish { r, batch } => {
                    if let Some(index) = self.index.as_mut() {
                        index.publish(now, r, &batch);
                    }
                }
            }
            if self.done(now) {
                break;
            }
        }
        for _ in 0..self.in_flight {
            self.samples.push(Sample {
                error: Some("unfinished after drain".into()),
                ..Sample::default()
            });
        }
        let last = self.q.now().max(self.end);
        let mut hits = 0;
        let mut queries = 0;
        let mut per_replica = Vec::new();
        for core in &self.fleet.cores {
            let s = core.snapshot();
            hits += s.prefix_hits_tokens;
            queries += s.prefix_queries_tokens;
            per_replica.push(s.requests);
        }
        let outcome = RunOutcome {
            samples: self.samples,
            wall_s: last.as_secs_f64(),
        };
        (outcome, per_replica, hits, queries)
    }

    /// Nothing more will arrive and nothing is in flight.
    fn done(&self, now: Duration) -> bool {
        let arriving = match &self.workload.arrival {
            Arrival::Poisson { .. } => self.next_arrival.is_some(),
            Arrival::Concurrency { .. } => now < self.end,
        };
        !arriving && self.in_flight == 0
    }

    fn arrive(&mut self, now: Duration) {
        let Some((_, stage)) = self.next_arrival else {
            return;
        };
        self.next_arrival = self.arrival_after(now, stage);
        if let Some((at, _)) = self.next_arrival {
            self.q.at(at, Event::Arrive);
        }
        let Some(req) = self.requests.next() else {
            return;
        };
        if self.in_flight >= MAX_IN_FLIGHT {
            self.samples.push(Sample {
                error: Some("client in-flight cap".into()),
                ..Sample::default()
            });
            return;
        }
        self.send(now, req);
    }

    /// Closed loop: sends requests until `level` are in flight, while the stages last.
    fn top_up(&mut self, now: Duration) {
        while now < self.end && self.in_flight < self.level {
            let Some(req) = self.requests.next() else {
                return;
            };
            self.send(now, req);
        }
    }

    /// Sends one request through the router to a replica.
    fn send(&mut self, now: Duration, req: Request) {
        let id = self.flights.len() as u64;
        let path = self.workload.path();
        let raw = serde_json::to_vec(&req.body).unwrap_or_default();
        let prepared = self.fleet.prepare(path, &req.body, &raw);
        let session = self.workload.session_header.then_some(req.user.as_str());
        let replicas = self.fleet.addrs.len();
        let (replica, instance, held) = match &mut self.routing {
            Routing::RoundRobin { next } => {
                *next = (*next + 1) % replicas;
                (*next, 0, None)
            }
            Routing::LeastRequest { rng } => {
                let a = rng.random_range(0..replicas);
                let b = rng.random_range(0..replicas);
                let pick = if self.active[b] < self.active[a] {
                    b
                } else {
                    a
                };
                (pick, 0, None)
            }
            Routing::Kvroute { gateways, next } => {
                let g = *next;
                *next = (g + 1) % gateways.len();
                let gateway = &mut gateways[g];
                gateway.set_clock(now);
                let (r, held) = gateway.route(path, &raw, session, id, &self.fleet);
                (r, g, Some(held))
            }
            Routing::Smg { instances, next } => {
                let i = *next;
                *next = (i + 1) % instances.len();
                let text = smg::routing_text(&req.body);
                let r = instances[i].pick(&text, now.as_millis() as u64);
                (r, i, None)
            }
            Routing::Oracle { sent, recent } => {
                let r = match &prepared {
                    Ok(p) => oracle_pick(&self.fleet, p, &req, now, sent, recent),
                    Err(_) => 0,
                };
                (r, 0, None)
            }
        };
        let endpoint = Endpoint::from_path(path).unwrap_or(Endpoint::Chat);
        let mut flight = Flight {
            sample: Sample {
                user: req.user.clone(),
                sent_ms: now.as_secs_f64() * 1000.0,
                replica: Some(replica),
                gateway: (instance > 0 || self.instances() > 1).then(|| instance.to_string()),
                ..Sample::default()
            },
            sent: now,
            replica,
            instance,
            held,
            prompt_tokens: 0,
            output_tokens: 0,
            include_usage: false,
            endpoint,
        };
        self.flights.push(None);
        self.in_flight += 1;
        let submitted = prepared.and_then(|p| {
            flight.prompt_tokens = p.prompt.len();
            flight.output_tokens = p.output.len();
            flight.include_usage = p.include_usage;
            self.fleet.submit(now, replica, id, p)
        });
        match submitted {
            Ok(()) => {
                self.active[replica] += 1;
                if let (Some(held), Routing::Kvroute { gateways, .. }) =
                    (flight.held.as_mut(), &mut self.routing)
                {
                    let gateway = &mut gateways[instance];
                    gateway.active[replica] += 1;
                    gateway.answered(held, &self.fleet.addrs[replica], 200);
                    flight.sample.decision = held.decision.clone();
                }
                self.flights[id as usize] = Some(flight);
                let published = self.fleet.published(replica);
                self.published(now, replica, published);
                self.rewake(replica);
            }
            Err(e) => {
                self.flights[id as usize] = Some(flight);
                self.fail(now, id, e);
            }
        }
    }

    fn instances(&self) -> usize {
        match &self.routing {
            Routing::Kvroute { gateways, .. } => gateways.len(),
            Routing::Smg { instances, .. } => instances.len(),
            _ => 1,
        }
    }

    /// The replica refused the request (a 400): answered at once.
    fn fail(&mut self, now: Duration, id: u64, error: String) {
        let Some(mut flight) = self.flights[id as usize].take() else {
            return;
        };
        self.in_flight -= 1;
        let addr = self.fleet.addrs[flight.replica].clone();
        match (&mut self.routing, flight.held.as_mut()) {
            (Routing::Kvroute { gateways, .. }, Some(held)) => {
                let gateway = &mut gateways[flight.instance];
                gateway.set_clock(now);
                gateway.answered(held, &addr, 400);
                gateway.ended(held, ChunkWriter::error(&error, 400).to_vec());
            }
            (Routing::Smg { instances, .. }, _) => instances[flight.instance].done(flight.replica),
            _ => {}
        }
        flight.sample.error = Some(error);
        flight.sample.e2e_ms = (now - flight.sent).as_secs_f64() * 1000.0;
        self.samples.push(flight.sample);
        self.top_up(now);
    }

    /// One thing an engine did for request `h.id`.
    fn happened(&mut self, now: Duration, r: usize, h: Happened) {
        let id = h.id as usize;
        let Some(flight) = self.flights.get_mut(id).and_then(Option::as_mut) else {
            return;
        };
        match h.what {
            Emit::First { .. } => {
                flight.sample.ttft_ms = Some((h.at - flight.sent).as_secs_f64() * 1000.0);
                let chunk = first_chunk(flight, &self.fleet);
                if let (Routing::Kvroute { gateways, .. }, Some(held)) =
                    (&mut self.routing, flight.held.as_mut())
                {
                    let gateway = &mut gateways[flight.instance];
                    gateway.set_clock(now);
                    gateway.first_token(held, chunk);
                }
            }
            Emit::Tokens { .. } => {}
            Emit::Done { cached_tokens } => {
                let Some(mut flight) = self.flights[id].take() else {
                    return;
                };
                self.in_flight -= 1;
                self.active[r] -= 1;
                let output = flight.output_tokens;
                flight.sample.output_tokens = output as u64;
                flight.sample.e2e_ms = (h.at - flight.sent).as_secs_f64() * 1000.0;
                flight.sample.prompt_tokens = Some(flight.prompt_tokens as u64);
                flight.sample.cached_tokens = Some(cached_tokens as u64);
                let last = last_chunk(&flight, output, cached_tokens, &self.fleet);
                match (&mut self.routing, flight.held.as_mut()) {
                    (Routing::Kvroute { gateways, .. }, Some(held)) => {
                        let gateway = &mut gateways[flight.instance];
                        gateway.set_clock(now);
                        gateway.active[r] -= 1;
                        gateway.ended(held, last);
                    }
                    (Routing::Smg { instances, .. }, _) => instances[flight.instance].done(r),
                    _ => {}
                }
                self.samples.push(flight.sample);
                self.top_up(now);
            }
        }
    }

    /// Schedules replica `r`'s next wake where its engine has something due.
    fn rewake(&mut self, r: usize) {
        let next = self.fleet.next_event(r);
        if next.is_some() && next != self.wakes[r] {
            self.wakes[r] = next;
            if let Some(at) = next {
                self.q.at(at, Event::Wake(r));
            }
        }
    }

    /// KV events replica `r` published now reach the indexer after the transport's lag; a
    /// share of them is lost on the way, as the loss option says.
    fn published(&mut self, now: Duration, r: usize, batches: Vec<Published>) {
        if self.index.is_none() {
            return;
        }
        for mut batch in batches {
            if self.opts.kv_event_loss > 0.0 && self.loss.random::<f64>() < self.opts.kv_event_loss
            {
                batch.dropped = true;
            }
            self.q
                .at(now + self.opts.kv_event_lag, Event::Publish { r, batch });
        }
    }

    fn tick(&mut self, now: Duration, g: usize, w: usize, period_ms: u64) {
        let Routing::Kvroute { gateways, .. } = &mut self.routing else {
            return;
        };
        let gateway = &mut gateways[g];
        gateway.set_clock(now);
        let worker = &mut gateway.workers[w];
        worker.tick(period_ms);
        let next = worker.tick_period().max(1);
        self.q.at(
            now + Duration::from_millis(next),
            Event::Tick {
                g,
                w,
                period_ms: next,
            },
        );
        self.send_calls(now, g, w);
    }

    /// Answers the calls worker `w` of gateway `g` sent, after the poll latency.
    fn send_calls(&mut self, now: Duration, g: usize, w: usize) {
        let Routing::Kvroute { gateways, .. } = &self.routing else {
            return;
        };
        let gateway = &gateways[g];
        for call in gateway.workers[w].host().take_calls() {
            let (status, body) =
                gateways::answer(&call, gateway, &self.fleet, self.index.as_mut(), now);
            let token = call.token;
            let at = now + self.opts.poll_latency;
            self.q.at(
                at,
                Event::Answer {
                    g,
                    w,
                    token,
                    status,
                    body,
                },
            );
        }
    }
}

/// The first chunk of a response as the engine streams it: the assistant's role.
fn first_chunk(flight: &Flight, fleet: &Fleet) -> Vec<u8> {
    let writer = ChunkWriter {
        endpoint: flight.endpoint,
        id: "lab".into(),
        created: 0,
        model: fleet.spec.model.clone(),
    };
    writer
        .role()
        .map_or_else(|| writer.token("", None).to_vec(), |b| b.to_vec())
}

/// The end of a response as the engine streams it: the usage chunk when asked for, and `[DONE]`.
fn last_chunk(flight: &Flight, output: usize, cached: usize, fleet: &Fleet) -> Vec<u8> {
    let writer = ChunkWriter {
        endpoint: flight.endpoint,
        id: "lab".into(),
        created: 0,
        model: fleet.spec.model.clone(),
    };
    let mut last = Vec::new();
    if flight.include_usage {
        let usage = sse::usage(
            flight.prompt_tokens,
            output,
            cached,
            fleet.spec.block_size,
            true,
        );
        last.extend_from_slice(&writer.usage(&usage));
    }
    last.extend_from_slice(&ChunkWriter::done());
    last
}

/// The oracle's pick: the replica that really holds the most of the prompt (counting prompts it
/// sent within its pending window), unless overloaded, as `oracle::choose` decides.
fn oracle_pick(
    fleet: &Fleet,
    p: &Prepared,
    req: &Request,
    now: Duration,
    sent: &mut [u64],
    recent: &mut VecDeque<(usize, String, Duration)>,
) -> usize {
    while recent
        .front()
        .is_some_and(|(_, _, t)| now - *t > oracle::PENDING_WINDOW)
    {
        recent.pop_front();
    }
    let text = oracle::prompt_text(&req.body);
    let per_char = p.prompt.len() as f64 / text.len().max(1) as f64;
    let replicas = fleet
        .cores
        .iter()
        .enumerate()
        .map(|(i, core)| {
            let snap = core.snapshot();
            let shared = recent
                .iter()
                .filter(|(j, _, _)| *j == i)
                .map(|(_, t, _)| oracle::common_prefix(t, &text))
                .max()
                .unwrap_or(0);
            let pending = (shared as f64 * per_char) as u64;
            let pending = pending / oracle::PENDING_BLOCK_TOKENS * oracle::PENDING_BLOCK_TOKENS;
            let cached = core.cached_tokens(&p.prompt, p.salt.as_deref()) as u64;
            MatchReplica {
                id: i,
                cached_tokens: cached.max(pending),
                running: snap.running as u64,
                waiting: snap.waiting as u64,
            }
        })
        .collect();
    let m = MatchResult {
        prompt_tokens: p.prompt.len() as u64,
        replicas,
    };
    let chosen = oracle::choose(&m, &[], sent).unwrap_or(0);
    sent[chosen] += 1;
    if recent.len() >= oracle::PENDING_MAX {
        recent.pop_front();
    }
    recent.push_back((chosen, text, now));
    chosen
}
