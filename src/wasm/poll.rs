//! Polling, from one worker at a time: Envoy's admin `/clusters` (hosts, health, `rq_active`) and,
//! when `engine_metrics_cluster` is set, each engine's own `/metrics` (requests running and
//! waiting, which include other gateways' traffic). Once a round's answers are in, the snapshot
//! goes to shared data for every worker.

use std::time::Duration;

use hashbrown::HashMap;
use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, LogLevel, MapType, MetricType};

use super::host::{self, now_ms, HostStore};
use super::root::{Shared, HOSTS_KEY};
use crate::counters;
use crate::endpoints::{self, Snapshot};
use crate::engine::{self, EngineLoad, EngineLoads, Metrics};
use crate::engine_index::{EngineIndex, Feed, Status};
use crate::rendezvous::endpoint_id;
use crate::store::{self, SharedStore};

/// The poll round (see `freshness::RoundLease`); a new name, since the value is a round now.
pub const LEASE_KEY: &str = "kvroute.poll_round";
const ENGINE_KEY: &str = "kvroute.engine";
/// Format of the value under `ENGINE_KEY` (a version byte, then JSON): another version reads as
/// nothing.
const ENGINE_VERSION: u8 = 1;

/// The round of calls this worker has in flight.
#[derive(Default)]
pub struct Poller {
    admin: Option<u32>,
    /// The call to the indexer's change feed.
    index: Option<u32>,
    /// Engine metrics calls: token → host address.
    engines: HashMap<u32, String>,
    /// The admin answer, held until the engines' answers are in too.
    snapshot: Option<Snapshot>,
    /// This round's engine answers, with kvroute's own count there when each came.
    reports: HashMap<String, (Metrics, u32)>,
    /// By endpoint id: the least that kvroute's in-flight count was above Envoy's `rq_active`
    /// over this worker's last consecutive admin answers, and how many answers in a row showed an
    /// excess. Only an excess seen [`EXCESS_POLLS`] times running is corrected: a request counted
    /// just before Envoy attaches it upstream is not a lost one, and a busy host rarely has one
    /// in that gap at every poll of a row.
    excess: HashMap<u32, (u64, u32)>,
}

/// The engine index's counters, defined at configure time when an indexer is configured.
pub const INDEX_COUNTERS: [&str; 6] = [
    "kvroute.index.poll_ok",
    "kvroute.index.poll_failed",
    "kvroute.index.resyncs",
    "kvroute.index.held",
    "kvroute.index.dropped",
    "kvroute.index.overflowed",
];

/// Admin answers in a row that must show kvroute's count above Envoy's before it is lowered.
const EXCESS_POLLS: u32 = 3;

impl Poller {
    /// Dispatches this interval's polls.
    pub fn poll(&mut self, shared: &mut Shared, admin_cluster: &str) {
        // A round still waiting on a slow engine: share what it has before starting the next.
        if let Some(snapshot) = self.snapshot.take() {
            self.publish(shared, snapshot);
        }
        // Calls of the last round still unanswered after a whole interval (a jammed admin or
        // engine) failed: their late answers are ignored, so count them here or never.
        if self.admin.take().is_some() {
            shared.metrics.count("kvroute.stats_poll.failed");
        }
        if !self.engines.is_empty() {
            let late = self.engines.len() as i64;
            let m = &mut shared.metrics;
            m.add(MetricType::Counter, "kvroute.engine_poll.failed", late);
        }
        if self.index.take().is_some() {
            shared.metrics.count("kvroute.index.poll_failed");
        }
        self.reports.clear();
        self.engines.clear();
        let config = &shared.router.config;
        let timeout = Duration::from_millis(config.stats_interval_ms.max(1000));
        if let Some(cluster) = config.index_cluster.as_deref() {
            // Changes since what the index holds; an indexer of another epoch answers in full.
            let (epoch, version) = Status::read(&HostStore).map_or((0, 0), |s| s.since());
            let path = format!("{}?epoch={epoch}&since={version}", config.index_path);
            let headers = vec![
                (":method", "GET"),
                (":path", path.as_str()),
                (":authority", cluster),
            ];
            match hostcalls::dispatch_http_call(cluster, headers, None, vec![], timeout) {
                Ok(token) => self.index = Some(token),
                Err(_) => shared.metrics.count("kvroute.index.poll_failed"),
            }
        }
        let keep =
            endpoints::Keep::only(&config.clusters, config.engine_metrics_cluster.as_deref());
        let path = endpoints::admin_clusters_path(keep);
        let headers = vec![
            (":method", "GET"),
            (":path", path.as_str()),
            (":authority", admin_cluster),
        ];
        match hostcalls::dispatch_http_call(admin_cluster, headers, None, vec![], timeout) {
            Ok(token) => self.admin = Some(token),
            Err(_) => shared.metrics.count("kvroute.stats_poll.failed"),
        }
        let Some(cluster) = config.engine_metrics_cluster.as_deref() else {
            return;
        };
        let hosts = shared.snapshot.get(cluster).map_or(&[][..], Vec::as_slice);
        // Unhealthy hosts are never candidates: their load does not matter, and a call would fail.
        for host in hosts.iter().filter(|h| h.healthy) {
            // Through the engines' own cluster: the routing header picks the host, as for requests.
            let headers = vec![
                (":method", "GET"),
                (":path", config.engine_metrics_path.as_str()),
                (":authority", cluster),
                (config.header.as_str(), host.addr.as_str()),
            ];
            match hostcalls::dispatch_http_call(cluster, headers, None, vec![], timeout) {
                Ok(token) => {
                    self.engines.insert(token, host.addr.clone());
                }
                Err(_) => shared.metrics.count("kvroute.engine_poll.failed"),
            }
        }
    }

    /// Handles the answer to call `token`.
    pub fn response(&mut self, shared: &mut Shared, token: u32, body_size: usize) {
        let status = host::status(MapType::HttpCallResponseHeaders);
        let body = hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size)
            .ok()
            .flatten();
        let ok_body = match status {
            Some(200) => body,
            _ => None,
        };
        if self.index == Some(token) {
            self.index = None;
            index_response(shared, ok_body);
        } else if self.admin == Some(token) {
            self.admin = None;
            self.snapshot = admin_response(shared, ok_body, status);
            if let Some(snapshot) = self.snapshot.take() {
                self.correct_inflight(shared, &snapshot);
                self.snapshot = Some(snapshot);
            }
        } else if let Some(addr) = self.engines.remove(&token) {
            match ok_body.as_deref().and_then(engine::parse) {
                Some(metrics) => {
                    // What kvroute itself has in flight there as the engine answers: what it
                    // sends from now on comes on top of the engine's numbers.
                    let own = shared.inflight.inflight(endpoint_id(&addr));
                    self.reports.insert(addr, (metrics, own));
                    shared.metrics.count("kvroute.engine_poll.ok");
                }
                None => shared.metrics.count("kvroute.engine_poll.failed"),
            }
        }
        if self.admin.is_none() && self.engines.is_empty() {
            if let Some(snapshot) = self.snapshot.take() {
                self.publish(shared, snapshot);
            }
        }
    }

    /// Lowers in-flight counts that stay above Envoy's own `rq_active` (streams whose end kvroute
    /// never saw, as across a VM reload).
    fn correct_inflight(&mut self, shared: &mut Shared, snapshot: &Snapshot) {
        let config = &shared.router.config;
        let mut active: HashMap<u32, (u64, &str)> = HashMap::new();
        for (_, hosts) in snapshot
            .iter()
            .filter(|(name, _)| !config.is_own_cluster(name))
        {
            for h in hosts {
                let a = active.entry(h.id()).or_insert((0, h.addr.as_str()));
                a.0 = a.0.max(h.rq_active);
            }
        }
        let table = counters::read(&HostStore);
        let mut excess = HashMap::new();
        let mut caps = Vec::new();
        for (&id, &(rq_active, _)) in &active {
            let own = u64::from(table.inflight(id));
            let now = own.saturating_sub(rq_active);
            if now == 0 {
                continue;
            }
            let (least, polls) = match self.excess.get(&id) {
                Some(&(least, polls)) => (least.min(now), polls + 1),
                None => (now, 1),
            };
            if polls >= EXCESS_POLLS {
                caps.push((id, own - least));
            } else {
                excess.insert(id, (least, polls));
            }
        }
        self.excess = excess;
        if caps.is_empty() {
            return;
        }
        let removed = counters::correct(&HostStore, &caps);
        if removed > 0 {
            shared.metrics.add(
                MetricType::Counter,
                "kvroute.inflight_corrected",
                removed as i64,
            );
            // Shown now, from the corrected table, rather than at this worker's next flush.
            let table = counters::read(&HostStore);
            for (id, _) in &caps {
                if let Some((_, addr)) = active.get(id) {
                    shared
                        .metrics
                        .inflight(addr, u64::from(table.inflight(*id)));
                }
            }
        }
    }

    /// Folds this round's engine reports into the snapshot and shares it with every worker.
    fn publish(&mut self, shared: &mut Shared, mut snapshot: Snapshot) {
        if shared.router.config.engine_metrics_cluster.is_some() {
            let loads = engine_loads(&self.reports, &snapshot, now_ms());
            let stale = loads.values().filter(|l| l.stale()).count();
            if stale > 0 {
                shared.metrics.add(
                    MetricType::Counter,
                    "kvroute.engine_poll.stale",
                    stale as i64,
                );
            }
            endpoints::apply_engine_loads(&mut snapshot, &loads);
        }
        let _ = HostStore.set(HOSTS_KEY, &endpoints::encode_snapshot(&snapshot), None);
        shared.refresh_snapshot();
    }
}

/// Applies the indexer's answer to the engine index, counting what it changed.
fn index_response(shared: &mut Shared, body: Option<Vec<u8>>) {
    let feed = body.and_then(|b| serde_json::from_slice::<Feed>(&b).ok());
    let Some(feed) = feed else {
        shared.metrics.count("kvroute.index.poll_failed");
        return;
    };
    let capacity = shared.router.config.engine_index_capacity;
    let m = &mut shared.metrics;
    match EngineIndex::new(&HostStore, capacity).apply(&feed, now_ms()) {
        Ok(applied) => {
            m.count("kvroute.index.poll_ok");
            if applied.full {
                m.count("kvroute.index.resyncs");
            }
            m.add(
                MetricType::Counter,
                "kvroute.index.held",
                applied.held as i64,
            );
            m.add(
                MetricType::Counter,
                "kvroute.index.dropped",
                applied.dropped as i64,
            );
            let overflowed = applied.overflowed as i64;
            m.add(MetricType::Counter, "kvroute.index.overflowed", overflowed);
            m.gauge("kvroute.index.stale_engines", feed.stale.len() as u64);
        }
        Err(e) => {
            let _ = hostcalls::log(
                LogLevel::Warn,
                &format!("kvroute: the indexer's answer was not applied: {e:?}"),
            );
            m.count("kvroute.index.poll_failed");
        }
    }
}

/// The admin `/clusters` answer as a snapshot, counted and logged when it is not one.
fn admin_response(
    shared: &mut Shared,
    body: Option<Vec<u8>>,
    status: Option<u16>,
) -> Option<Snapshot> {
    let parsed = match body {
        Some(body) => {
            let config = &shared.router.config;
            let keep =
                endpoints::Keep::only(&config.clusters, config.engine_metrics_cluster.as_deref());
            endpoints::parse_admin_clusters(&body, keep)
        }
        None => Err(format!("admin answered status {status:?}")),
    };
    let snapshot = match parsed {
        Ok(snapshot) => snapshot,
        Err(e) => {
            let _ = hostcalls::log(LogLevel::Warn, &format!("kvroute: stats poll failed: {e}"));
            shared.metrics.count("kvroute.stats_poll.failed");
            return None;
        }
    };
    let config = &shared.router.config;
    let known = snapshot
        .iter()
        .filter(|(name, _)| !config.is_own_cluster(name))
        .flat_map(|(_, hosts)| hosts)
        .filter(|h| h.healthy)
        .count();
    shared
        .metrics
        .gauge("kvroute.endpoints_known", known as u64);
    shared.metrics.count("kvroute.stats_poll.ok");
    Some(snapshot)
}

/// Every engine's load: this round's reports over the last known (which carry what was learnt of
/// each engine's capacity, whichever worker polled it), kept only for hosts still in the snapshot.
fn engine_loads(
    reports: &HashMap<String, (Metrics, u32)>,
    snapshot: &Snapshot,
    now_ms: u64,
) -> EngineLoads {
    let mut loads = EngineLoads::default();
    store::update(&HostStore, ENGINE_KEY, |current| {
        let known: EngineLoads = current
            .and_then(|v| store::unversioned(ENGINE_VERSION, v))
            .and_then(|v| serde_json::from_slice(v).ok())
            .unwrap_or_default();
        loads = snapshot
            .values()
            .flatten()
            .filter_map(|h| {
                let previous = known.get(&h.addr);
                let load = match reports.get(&h.addr) {
                    Some((metrics, own)) => EngineLoad::observe(previous, metrics, *own, now_ms),
                    // No answer this round: the same numbers, one poll older.
                    None => previous?.missed_poll(),
                };
                Some((h.addr.clone(), load))
            })
            .collect();
        let json = serde_json::to_vec(&loads).ok()?;
        Some(store::versioned(ENGINE_VERSION, &json))
    });
    loads
}
