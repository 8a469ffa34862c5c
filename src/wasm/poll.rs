//! Polling, from one worker at a time: Envoy's admin `/clusters` (hosts, health, `rq_active`) and,
//! when `engine_metrics_cluster` is set, each engine's own `/metrics` (requests running + waiting,
//! which include other proxies' traffic). Results go to shared data for every worker.

use std::time::Duration;

use hashbrown::HashMap;
use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, LogLevel, MapType};

use super::host::HostStore;
use super::root::{Shared, HOSTS_KEY};
use crate::endpoints::{self, EngineLoads};
use crate::store::{self, SharedStore};

const LEASE_KEY: &str = "kvroute.poll_lease";
const ENGINE_KEY: &str = "kvroute.engine";

/// The calls this worker has in flight.
#[derive(Default)]
pub struct Poller {
    admin: Option<u32>,
    /// Engine metrics calls: token → host address.
    engines: HashMap<u32, String>,
}

impl Poller {
    /// Dispatches this interval's polls.
    pub fn poll(&mut self, shared: &mut Shared, admin_cluster: &str) {
        let timeout = Duration::from_millis(shared.config.stats_interval_ms.max(1000));
        let headers = vec![
            (":method", "GET"),
            (":path", "/clusters?format=json"),
            (":authority", admin_cluster),
        ];
        match hostcalls::dispatch_http_call(admin_cluster, headers, None, vec![], timeout) {
            Ok(token) => self.admin = Some(token),
            Err(_) => shared.metrics.count("kvroute.stats_poll.failed"),
        }
        let Some(cluster) = shared.config.engine_metrics_cluster.clone() else {
            return;
        };
        let hosts = shared.snapshot.get(&cluster).cloned().unwrap_or_default();
        let (header, path) = (
            shared.config.header.clone(),
            shared.config.engine_metrics_path.clone(),
        );
        self.engines.clear();
        // Unhealthy hosts are never candidates: their load does not matter, and a call would fail.
        for host in hosts.into_iter().filter(|h| h.healthy) {
            // Through the engines' own cluster: the routing header picks the host, as for requests.
            let headers = vec![
                (":method", "GET"),
                (":path", path.as_str()),
                (":authority", cluster.as_str()),
                (header.as_str(), host.addr.as_str()),
            ];
            match hostcalls::dispatch_http_call(&cluster, headers, None, vec![], timeout) {
                Ok(token) => {
                    self.engines.insert(token, host.addr);
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
            admin_response(shared, ok_body, status);
        } else if let Some(addr) = self.engines.remove(&token) {
            engine_response(shared, &addr, ok_body);
        }
    }
}

fn admin_response(shared: &mut Shared, body: Option<Vec<u8>>, status: Option<String>) {
    let parsed = match body {
        Some(body) => endpoints::parse_admin_clusters(&body),
        None => Err(format!("admin answered status {status:?}")),
    };
    let mut snapshot = match parsed {
        Ok(snapshot) => snapshot,
        Err(e) => {
            let _ = hostcalls::log(LogLevel::Warn, &format!("kvroute: stats poll failed: {e}"));
            shared.metrics.count("kvroute.stats_poll.failed");
            return;
        }
    };
    if shared.config.engine_metrics_cluster.is_some() {
        endpoints::apply_engine_loads(&mut snapshot, &engine_loads());
    }
    let _ = HostStore.set(HOSTS_KEY, &endpoints::encode_snapshot(&snapshot), None);
    shared.refresh_snapshot();
    let admin = shared.config.admin_cluster.clone();
    let known = snapshot
        .iter()
        .filter(|(name, _)| Some(*name) != admin.as_ref())
        .flat_map(|(_, hosts)| hosts)
        .filter(|h| h.healthy)
        .count();
    shared
        .metrics
        .gauge("kvroute.endpoints_known", known as u64);
    shared.metrics.count("kvroute.stats_poll.ok");
}

/// Records one engine's load; the next admin poll folds it into the host snapshot.
fn engine_response(shared: &mut Shared, addr: &str, body: Option<Vec<u8>>) {
    let Some(load) = body.as_deref().and_then(endpoints::parse_engine_metrics) else {
        shared.metrics.count("kvroute.engine_poll.failed");
        return;
    };
    store::update(&HostStore, ENGINE_KEY, |current| {
        let mut loads: EngineLoads = current
            .and_then(|v| serde_json::from_slice(v).ok())
            .unwrap_or_default();
        loads.insert(addr.to_string(), load);
        // Only hosts still in the snapshot: the value stays as small as the fleet.
        loads.retain(|a, _| shared.snapshot.values().flatten().any(|h| &h.addr == a));
        serde_json::to_vec(&loads).ok()
    });
    shared.metrics.count("kvroute.engine_poll.ok");
}

fn engine_loads() -> EngineLoads {
    HostStore
        .get(ENGINE_KEY)
        .0
        .and_then(|v| serde_json::from_slice(&v).ok())
        .unwrap_or_default()
}

/// One poll per interval across all workers: whoever first moves the shared deadline polls.
pub fn take_lease(now: u64, interval_ms: u64) -> bool {
    let mut taken = false;
    store::update(&HostStore, LEASE_KEY, |current| {
        let deadline = current
            .and_then(|v| v.try_into().ok())
            .map(u64::from_le_bytes)
            .unwrap_or(0);
        taken = now >= deadline;
        // A little under the interval, so tick jitter does not skip every other poll.
        taken.then(|| (now + interval_ms * 9 / 10).to_le_bytes().to_vec())
    });
    taken
}
