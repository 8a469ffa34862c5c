//! Polling, from one worker at a time: Envoy's admin `/clusters` (hosts, health, `rq_active`) and,
//! when `engine_metrics_cluster` is set, each engine's own `/metrics` (requests running and
//! waiting, which include other gateways' traffic). Once a round's answers are in, the snapshot
//! goes to shared data for every worker.

use std::time::Duration;

use hashbrown::HashMap;
use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, LogLevel, MapType};

use super::host::HostStore;
use super::root::{Shared, HOSTS_KEY};
use crate::counters;
use crate::endpoints::{self, Snapshot};
use crate::engine::{self, EngineLoad, EngineLoads, Metrics};
use crate::rendezvous::endpoint_id;
use crate::store::{self, SharedStore};

const LEASE_KEY: &str = "kvroute.poll_lease";
const ENGINE_KEY: &str = "kvroute.engine";
/// Formats of the values under `ENGINE_KEY` (a version byte, then JSON) and `LEASE_KEY` (a
/// version byte, then the deadline): another version reads as nothing.
const ENGINE_VERSION: u8 = 1;
const LEASE_VERSION: u8 = 1;

/// The round of calls this worker has in flight.
#[derive(Default)]
pub struct Poller {
    admin: Option<u32>,
    /// Engine metrics calls: token → host address.
    engines: HashMap<u32, String>,
    /// The admin answer, held until the engines' answers are in too.
    snapshot: Option<Snapshot>,
    /// This round's engine answers, with kvroute's own count there when each came.
    reports: HashMap<String, (Metrics, u32)>,
}

impl Poller {
    /// Dispatches this interval's polls.
    pub fn poll(&mut self, shared: &mut Shared, admin_cluster: &str) {
        // A round still waiting on a slow engine: share what it has before starting the next.
        if let Some(snapshot) = self.snapshot.take() {
            self.publish(shared, snapshot);
        }
        self.reports.clear();
        self.engines.clear();
        let config = &shared.router.config;
        let timeout = Duration::from_millis(config.stats_interval_ms.max(1000));
        let headers = vec![
            (":method", "GET"),
            (":path", "/clusters?format=json"),
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
        let status = hostcalls::get_map_value(MapType::HttpCallResponseHeaders, ":status")
            .ok()
            .flatten();
        let body = hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size)
            .ok()
            .flatten();
        let ok_body = match status.as_deref() {
            Some("200") => body,
            _ => None,
        };
        if self.admin == Some(token) {
            self.admin = None;
            self.snapshot = admin_response(shared, ok_body, status);
        } else if let Some(addr) = self.engines.remove(&token) {
            match ok_body.as_deref().and_then(engine::parse) {
                Some(metrics) => {
                    // What kvroute itself has in flight there as the engine answers: what it
                    // sends from now on comes on top of the engine's numbers.
                    let own = counters::read(&HostStore).inflight(endpoint_id(&addr));
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

    /// Folds this round's engine reports into the snapshot and shares it with every worker.
    fn publish(&mut self, shared: &mut Shared, mut snapshot: Snapshot) {
        if shared.router.config.engine_metrics_cluster.is_some() {
            let loads = engine_loads(&self.reports, &snapshot);
            endpoints::apply_engine_loads(&mut snapshot, &loads);
        }
        let _ = HostStore.set(HOSTS_KEY, &endpoints::encode_snapshot(&snapshot), None);
        shared.refresh_snapshot();
    }
}

/// The admin `/clusters` answer as a snapshot, counted and logged when it is not one.
fn admin_response(
    shared: &mut Shared,
    body: Option<Vec<u8>>,
    status: Option<String>,
) -> Option<Snapshot> {
    let parsed = match body {
        Some(body) => endpoints::parse_admin_clusters(&body),
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
    let admin = shared.router.config.admin_cluster.as_deref();
    let known = snapshot
        .iter()
        .filter(|(name, _)| Some(name.as_str()) != admin)
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
fn engine_loads(reports: &HashMap<String, (Metrics, u32)>, snapshot: &Snapshot) -> EngineLoads {
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
                    Some((metrics, own)) => EngineLoad::observe(previous, metrics, *own),
                    None => *previous?,
                };
                Some((h.addr.clone(), load))
            })
            .collect();
        let json = serde_json::to_vec(&loads).ok()?;
        Some(store::versioned(ENGINE_VERSION, &json))
    });
    loads
}

/// One poll per interval across all workers: whoever first moves the shared deadline polls.
pub fn take_lease(now: u64, interval_ms: u64) -> bool {
    let mut taken = false;
    store::update(&HostStore, LEASE_KEY, |current| {
        let deadline = current
            .and_then(|v| store::unversioned(LEASE_VERSION, v))
            .and_then(|v| v.try_into().ok())
            .map(u64::from_le_bytes)
            .unwrap_or(0);
        taken = now >= deadline;
        // A little under the interval, so tick jitter does not skip every other poll.
        let next = now + interval_ms * 9 / 10;
        taken.then(|| store::versioned(LEASE_VERSION, &next.to_le_bytes()))
    });
    taken
}
