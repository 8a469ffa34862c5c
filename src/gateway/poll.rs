//! The poll, from one worker at a time: Envoy's admin `/clusters` (hosts, health, `rq_active`)
//! and, when `engine_metrics_cluster` is set, each engine's own `/metrics` (requests running and
//! waiting, which include other gateways' traffic) and, from an SGLang engine, its load snapshot
//! (the prefill work it has queued). Once a round's answers are in, the snapshot
//! goes to shared data for every worker. The admin's `rq_active` also corrects this gateway's
//! in-flight counts where they stay above Envoy's.

use hashbrown::HashMap;

use super::host::{HostApi, Level};
use super::stat_names::{Counter, Gauge};
use super::Gateway;
use crate::config::Config;
use crate::engine_load::{self, EngineLoad, EngineLoads, Metrics, Own};
use crate::holders::engine::{EngineIndex, Feed, Status};
use crate::hosts::{self, Snapshot};
use crate::in_flight;
use crate::rendezvous::endpoint_id;
use crate::shared_keys;
use crate::store::{self, SharedStore};

/// Format of the value under [`shared_keys::ENGINE_LOADS`] (a version byte, then JSON): another
/// version reads as nothing.
const ENGINE_VERSION: u8 = 1;

/// Admin answers in a row that must show kvroute's count above Envoy's before it is lowered.
const EXCESS_POLLS: u32 = 3;

/// The round of calls this worker has in flight.
#[derive(Default)]
pub struct Poller {
    admin: Option<u32>,
    /// The call to kvroute-indexer's change feed (precise mode).
    index: Option<u32>,
    /// Engine metrics calls: token → host address.
    engines: HashMap<u32, String>,
    /// Calls for an SGLang engine's load snapshot, made once its metrics answered: token → host
    /// address.
    loads: HashMap<u32, String>,
    /// The admin answer, held until the engines' answers are in too.
    snapshot: Option<Snapshot>,
    /// This round's engine answers, with what kvroute itself had there when each came.
    reports: HashMap<String, (Metrics, Own)>,
    /// By endpoint id: the least that kvroute's in-flight count was above Envoy's `rq_active`
    /// over this worker's last consecutive admin answers, and how many answers in a row showed an
    /// excess. Only an excess seen [`EXCESS_POLLS`] times running is corrected: a request counted
    /// just before Envoy attaches it upstream is not a lost one, and a busy host rarely has one
    /// in that gap at every poll of a row.
    excess: HashMap<u32, (u64, u32)>,
}

impl<H: HostApi> Gateway<H> {
    /// Sends this round's calls: the admin's `/clusters`, then each healthy engine's metrics.
    pub(super) fn dispatch_polls(&mut self, admin_cluster: &str) {
        // A round still waiting on a slow engine: share what it has before starting the next.
        if let Some(snapshot) = self.poller.snapshot.take() {
            self.publish(snapshot);
        }
        // Calls of the last round still unanswered after a whole interval (a jammed admin or
        // engine) failed: their late answers are ignored, so count them here or never.
        if self.poller.admin.take().is_some() {
            self.stats.count(&self.host, Counter::StatsPollFailed);
        }
        let late = [
            (self.poller.engines.len(), Counter::EnginePollFailed),
            (self.poller.loads.len(), Counter::LoadsPollFailed),
        ];
        for (n, counter) in late.into_iter().filter(|(n, _)| *n > 0) {
            self.stats.add(&self.host, counter, n as i64);
        }
        if self.poller.index.take().is_some() {
            self.stats.count(&self.host, Counter::IndexPollFailed);
        }
        self.poller.reports.clear();
        self.poller.engines.clear();
        self.poller.loads.clear();
        self.dispatch_index_poll();
        let Gateway {
            host,
            router,
            stats,
            snapshot,
            poller,
            ..
        } = self;
        let config = &router.config;
        let timeout_ms = config.stats_interval_ms.max(1000);
        let keep =
            hosts::PolledClusters::new(&config.clusters, config.engine_metrics_cluster.as_deref());
        let path = hosts::admin_clusters_path(keep);
        let headers = [
            (":method", "GET"),
            (":path", path.as_str()),
            (":authority", admin_cluster),
        ];
        match host.http_call(admin_cluster, &headers, timeout_ms) {
            Some(token) => poller.admin = Some(token),
            None => stats.count(host, Counter::StatsPollFailed),
        }
        let Some(cluster) = config.engine_metrics_cluster.as_deref() else {
            return;
        };
        let hosts = snapshot.get(cluster).map_or(&[][..], Vec::as_slice);
        // Unhealthy hosts are never candidates: their load does not matter, and a call would fail.
        for h in hosts.iter().filter(|h| h.healthy) {
            let path = config.engine_metrics_path.as_str();
            match engine_call(host, config, cluster, &h.addr, path) {
                Some(token) => {
                    poller.engines.insert(token, h.addr.clone());
                }
                None => stats.count(host, Counter::EnginePollFailed),
            }
        }
    }

    /// Asks an SGLang engine whose metrics just answered for its load snapshot.
    fn dispatch_loads_poll(&mut self, addr: &str) {
        let config = &self.router.config;
        let Some(cluster) = config.engine_metrics_cluster.as_deref() else {
            return;
        };
        match engine_call(&self.host, config, cluster, addr, engine_load::LOADS_PATH) {
            Some(token) => {
                self.poller.loads.insert(token, addr.to_string());
            }
            None => self.stats.count(&self.host, Counter::LoadsPollFailed),
        }
    }

    /// Asks kvroute-indexer, when one is configured, for the changes since what the engine index
    /// holds; an indexer of another epoch answers in full.
    fn dispatch_index_poll(&mut self) {
        let config = &self.router.config;
        let Some(cluster) = config.index_cluster.as_deref() else {
            return;
        };
        let (epoch, version) = Status::read(&self.host).map_or((0, 0), |s| s.since());
        let path = format!("{}?epoch={epoch}&since={version}", config.index_path);
        let headers = [
            (":method", "GET"),
            (":path", path.as_str()),
            (":authority", cluster),
        ];
        let timeout_ms = config.stats_interval_ms.max(1000);
        match self.host.http_call(cluster, &headers, timeout_ms) {
            Some(token) => self.poller.index = Some(token),
            None => self.stats.count(&self.host, Counter::IndexPollFailed),
        }
    }

    /// Applies the indexer's answer to the engine index, counting what it changed.
    fn index_answer(&mut self, body: Option<Vec<u8>>) {
        let feed = body.and_then(|b| serde_json::from_slice::<Feed>(&b).ok());
        let Some(feed) = feed else {
            self.stats.count(&self.host, Counter::IndexPollFailed);
            return;
        };
        let capacity = self.router.config.engine_index_capacity;
        let now = self.host.now_ms();
        let applied = EngineIndex::new(&self.host, capacity).apply(&feed, now);
        let (h, m) = (&self.host, &mut self.stats);
        match applied {
            Ok(applied) => {
                m.count(h, Counter::IndexPollOk);
                if applied.full {
                    m.count(h, Counter::IndexResyncs);
                }
                m.add(h, Counter::IndexHeld, applied.held as i64);
                m.add(h, Counter::IndexDropped, applied.dropped as i64);
                m.add(h, Counter::IndexOverflowed, applied.overflowed as i64);
                m.gauge(h, Gauge::IndexStaleEngines, feed.stale.len() as u64);
            }
            Err(e) => {
                let message = format!("kvroute: the indexer's answer was not applied: {e:?}");
                h.log(Level::Warn, &message);
                m.count(h, Counter::IndexPollFailed);
            }
        }
    }

    /// The answer to poll call `token`: its status and body.
    pub fn on_poll_answer(&mut self, token: u32, status: Option<u16>, body: Option<Vec<u8>>) {
        let ok_body = match status {
            Some(200) => body,
            _ => None,
        };
        if self.poller.index == Some(token) {
            self.poller.index = None;
            self.index_answer(ok_body);
        } else if self.poller.admin == Some(token) {
            self.poller.admin = None;
            let snapshot = self.admin_answer(ok_body, status);
            if let Some(snapshot) = &snapshot {
                self.correct_inflight(snapshot);
            }
            self.poller.snapshot = snapshot;
        } else if let Some(addr) = self.poller.engines.remove(&token) {
            match ok_body.as_deref().and_then(engine_load::parse) {
                Some(metrics) => {
                    // What kvroute itself has there as the engine answers: what it sends from
                    // now on comes on top of the engine's numbers.
                    let id = endpoint_id(&addr);
                    let own = Own {
                        inflight: self.inflight.inflight(id),
                        prefill: self.inflight.prefill(id),
                    };
                    if metrics.serves_loads {
                        self.dispatch_loads_poll(&addr);
                    }
                    self.poller.reports.insert(addr, (metrics, own));
                    self.stats.count(&self.host, Counter::EnginePollOk);
                }
                None => self.stats.count(&self.host, Counter::EnginePollFailed),
            }
        } else if let Some(addr) = self.poller.loads.remove(&token) {
            let tokens = ok_body.as_deref().and_then(engine_load::parse_loads);
            let report = self.poller.reports.get_mut(&addr);
            match tokens.zip(report) {
                Some((tokens, (metrics, own))) => {
                    metrics.waiting_uncached_tokens = Some(tokens);
                    // The queue as the snapshot saw it, against kvroute's own prefill then.
                    own.prefill = self.inflight.prefill(endpoint_id(&addr));
                    self.stats.count(&self.host, Counter::LoadsPollOk);
                }
                None => self.stats.count(&self.host, Counter::LoadsPollFailed),
            }
        }
        let answered = self.poller.engines.is_empty() && self.poller.loads.is_empty();
        if self.poller.admin.is_none() && answered {
            if let Some(snapshot) = self.poller.snapshot.take() {
                self.publish(snapshot);
            }
        }
    }

    /// Lowers in-flight counts that stay above Envoy's own `rq_active` (streams whose end kvroute
    /// never saw, as across a VM reload).
    fn correct_inflight(&mut self, snapshot: &Snapshot) {
        let config = &self.router.config;
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
        let table = in_flight::read(&self.host);
        let mut excess = HashMap::new();
        let mut caps = Vec::new();
        for (&id, &(rq_active, _)) in &active {
            let own = u64::from(table.inflight(id));
            let now = own.saturating_sub(rq_active);
            if now == 0 {
                continue;
            }
            let (least, polls) = match self.poller.excess.get(&id) {
                Some(&(least, polls)) => (least.min(now), polls + 1),
                None => (now, 1),
            };
            if polls >= EXCESS_POLLS {
                caps.push((id, own - least));
            } else {
                excess.insert(id, (least, polls));
            }
        }
        self.poller.excess = excess;
        if caps.is_empty() {
            return;
        }
        let removed = in_flight::correct(&self.host, &caps);
        if removed > 0 {
            let removed = removed as i64;
            (self.stats).add(&self.host, Counter::InflightCorrected, removed);
            // Shown now, from the corrected table, rather than at this worker's next flush.
            let table = in_flight::read(&self.host);
            for (id, _) in &caps {
                if let Some((_, addr)) = active.get(id) {
                    let count = u64::from(table.inflight(*id));
                    self.stats.inflight(&self.host, addr, count);
                }
            }
        }
    }

    /// Folds this round's engine reports into the snapshot and shares it with every worker.
    fn publish(&mut self, mut snapshot: Snapshot) {
        if self.router.config.engine_metrics_cluster.is_some() {
            let now = self.host.now_ms();
            let loads = engine_loads(&self.host, &self.poller.reports, &snapshot, now);
            let stale = loads.values().filter(|l| l.stale()).count();
            if stale > 0 {
                let stale = stale as i64;
                (self.stats).add(&self.host, Counter::EnginePollStale, stale);
            }
            hosts::apply_engine_loads(&mut snapshot, &loads);
        }
        let _ = self
            .host
            .set(shared_keys::HOSTS, &hosts::encode_snapshot(&snapshot), None);
        self.refresh_snapshot();
    }

    /// The admin `/clusters` answer as a snapshot, counted and logged when it is not one.
    fn admin_answer(&mut self, body: Option<Vec<u8>>, status: Option<u16>) -> Option<Snapshot> {
        let config = &self.router.config;
        let parsed = match body {
            Some(body) => {
                let keep = hosts::PolledClusters::new(
                    &config.clusters,
                    config.engine_metrics_cluster.as_deref(),
                );
                hosts::parse_admin_clusters(&body, keep)
            }
            None => Err(format!("admin answered status {status:?}")),
        };
        let snapshot = match parsed {
            Ok(snapshot) => snapshot,
            Err(e) => {
                let message = format!("kvroute: stats poll failed: {e}");
                self.host.log(Level::Warn, &message);
                self.stats.count(&self.host, Counter::StatsPollFailed);
                return None;
            }
        };
        let known = snapshot
            .iter()
            .filter(|(name, _)| !config.is_own_cluster(name))
            .flat_map(|(_, hosts)| hosts)
            .filter(|h| h.healthy)
            .count();
        self.stats
            .gauge(&self.host, Gauge::EndpointsKnown, known as u64);
        self.stats.count(&self.host, Counter::StatsPollOk);
        Some(snapshot)
    }
}

/// Every engine's load: this round's reports over the last known (which carry what was learnt of
/// each engine's capacity, whichever worker polled it), kept only for hosts still in the snapshot.
fn engine_loads(
    store: &dyn SharedStore,
    reports: &HashMap<String, (Metrics, Own)>,
    snapshot: &Snapshot,
    now_ms: u64,
) -> EngineLoads {
    let mut loads = EngineLoads::default();
    store::update(store, shared_keys::ENGINE_LOADS, |current| {
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

/// Asks engine `addr` for `path` through the engines' own cluster: the routing header picks the
/// host, as for requests.
fn engine_call<H: HostApi>(
    host: &H,
    config: &Config,
    cluster: &str,
    addr: &str,
    path: &str,
) -> Option<u32> {
    let headers = [
        (":method", "GET"),
        (":path", path),
        (":authority", cluster),
        (config.header.as_str(), addr),
    ];
    host.http_call(cluster, &headers, config.stats_interval_ms.max(1000))
}
