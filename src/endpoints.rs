//! Which endpoints a request may go to, from Envoy's admin `/clusters?format=json` or static config.

use hashbrown::HashMap;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::rendezvous::endpoint_id;

/// One upstream host as Envoy sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Host {
    /// `ip:port`, exactly as override_host matches it.
    pub addr: String,
    pub healthy: bool,
    /// Envoy's active requests to this host at the last poll.
    pub rq_active: u64,
    /// What the engine itself reported at the last poll (all routers' traffic), when its metrics
    /// are polled (`engine_metrics_cluster`).
    #[serde(default)]
    pub engine: Option<EngineLoad>,
}

/// An engine's own report of its load, as the last poll of its `/metrics` found it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineLoad {
    /// Requests running (in the batch, prefilling or decoding).
    pub running: u64,
    /// Requests queued for admission: the engine is full (max_num_seqs or KV space).
    pub waiting: u64,
    /// The most requests it runs at once, learnt from what it ran when it last queued (its
    /// max_num_seqs, or what its KV space allowed); `None` until it has been seen full.
    pub capacity: Option<u64>,
    /// kvroute's own in-flight count to it when the metrics were read: requests sent since
    /// then are on top of what it reported.
    pub own_at_poll: u32,
}

impl EngineLoad {
    /// The engine's new report, learning its capacity from the previous ones: once it has queued,
    /// the most it was ever seen running. (A queue with nothing running is a stall, not a limit.)
    pub fn observe(previous: Option<&EngineLoad>, running: u64, waiting: u64, own: u32) -> Self {
        let known = previous.and_then(|p| p.capacity);
        let capacity = match known {
            Some(c) => Some(c.max(running)),
            None => (waiting > 0 && running > 0).then_some(running),
        };
        EngineLoad {
            running,
            waiting,
            capacity,
            own_at_poll: own,
        }
    }

    /// Requests at the engine now: what it reported, corrected by kvroute's own requests sent or
    /// finished since (other proxies' changes show at the next poll).
    pub fn estimate(&self, own_now: u32) -> u64 {
        let reported = (self.running + self.waiting) as i64;
        let since = i64::from(own_now) - i64::from(self.own_at_poll);
        (reported + since).max(i64::from(own_now)).max(0) as u64
    }

    /// Whether the engine queues new requests: it said so, or it has more than it can run.
    pub fn queueing(&self, estimate: u64) -> bool {
        self.waiting > 0 || self.capacity.is_some_and(|c| estimate > c)
    }
}

impl Host {
    /// A host known only from static config: assumed healthy, load from kvroute's own counts.
    pub fn fixed(addr: &str) -> Host {
        Host {
            addr: addr.to_string(),
            healthy: true,
            rq_active: 0,
            engine: None,
        }
    }

    pub fn id(&self) -> u32 {
        endpoint_id(&self.addr)
    }
}

/// Hosts by cluster name: what one stats poll learned.
pub type Snapshot = HashMap<String, Vec<Host>>;

/// Reads the admin `/clusters?format=json` document. Hosts with a socket address only.
pub fn parse_admin_clusters(body: &[u8]) -> Result<Snapshot, String> {
    let doc: Value = serde_json::from_slice(body).map_err(|e| format!("not JSON: {e}"))?;
    let clusters = doc
        .get("cluster_statuses")
        .and_then(Value::as_array)
        .ok_or("no cluster_statuses")?;
    let mut snapshot = Snapshot::new();
    for cluster in clusters {
        let Some(name) = cluster.get("name").and_then(Value::as_str) else {
            continue;
        };
        let hosts = cluster
            .get("host_statuses")
            .and_then(Value::as_array)
            .map(|hosts| hosts.iter().filter_map(host).collect())
            .unwrap_or_default();
        snapshot.insert(name.to_string(), hosts);
    }
    Ok(snapshot)
}

fn host(status: &Value) -> Option<Host> {
    let socket = status.get("address")?.get("socket_address")?;
    let ip = socket.get("address")?.as_str()?;
    let port = socket.get("port_value")?.as_u64()?;
    let addr = if ip.contains(':') {
        format!("[{ip}]:{port}")
    } else {
        format!("{ip}:{port}")
    };
    let rq_active = status
        .get("stats")
        .and_then(Value::as_array)
        .and_then(|stats| {
            stats
                .iter()
                .find(|s| s.get("name") == Some(&Value::from("rq_active")))
        })
        .and_then(|s| s.get("value"))
        .and_then(|v| v.as_u64().or_else(|| v.as_str()?.parse().ok()))
        .unwrap_or(0);
    Some(Host {
        addr,
        healthy: healthy(status.get("health_status")),
        rq_active,
        engine: None,
    })
}

/// A host is usable unless a health check or outlier detection failed it, or EDS says it is not
/// serving. override_host does not check health itself, so this is the only guard.
fn healthy(health: Option<&Value>) -> bool {
    let Some(health) = health else { return true };
    let flag = |name: &str| health.get(name).and_then(Value::as_bool).unwrap_or(false);
    let failed = [
        "failed_active_health_check",
        "failed_outlier_check",
        "failed_eds_health",
        "pending_dynamic_removal",
        "excluded_via_immediate_hc_fail",
        "active_hc_timeout",
    ]
    .iter()
    .any(|f| flag(f));
    let eds_ok = match health.get("eds_health_status").and_then(Value::as_str) {
        None => true,
        Some(status) => matches!(status, "HEALTHY" | "UNKNOWN" | "DEGRADED"),
    };
    !failed && eds_ok
}

/// Engine loads by host address, as the last metrics polls found them.
pub type EngineLoads = HashMap<String, EngineLoad>;

/// vLLM's and SGLang's metric families for requests running, then waiting.
const RUNNING: [&str; 2] = ["vllm:num_requests_running", "sglang:num_running_reqs"];
const WAITING: [&str; 2] = ["vllm:num_requests_waiting", "sglang:num_queue_reqs"];

/// Reads an engine's Prometheus `/metrics` text: its requests (running, waiting), each summed over
/// label sets (one per model). `None` when it exposes none of those metrics.
pub fn parse_engine_metrics(text: &[u8]) -> Option<(u64, u64)> {
    let text = String::from_utf8_lossy(text);
    let (mut running, mut waiting, mut seen) = (0, 0, false);
    for line in text.lines() {
        let Some(name_end) = line.find(['{', ' ']) else {
            continue;
        };
        let name = &line[..name_end];
        let total = if RUNNING.contains(&name) {
            &mut running
        } else if WAITING.contains(&name) {
            &mut waiting
        } else {
            continue;
        };
        let value = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok());
        if let Some(v) = value.filter(|v| v.is_finite() && *v >= 0.0) {
            *total += v.round() as u64;
            seen = true;
        }
    }
    seen.then_some((running, waiting))
}

/// Writes the latest engine loads into a snapshot's hosts.
pub fn apply_engine_loads(snapshot: &mut Snapshot, loads: &EngineLoads) {
    for host in snapshot.values_mut().flatten() {
        host.engine = loads.get(&host.addr).copied();
    }
}

/// Serialises a snapshot for shared data (addresses and numbers only).
pub fn encode_snapshot(snapshot: &Snapshot) -> Vec<u8> {
    serde_json::to_vec(snapshot).unwrap_or_default()
}

pub fn decode_snapshot(bytes: &[u8]) -> Option<Snapshot> {
    serde_json::from_slice(bytes).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const ADMIN: &str = r#"{"cluster_statuses":[
      {"name":"inference_pool","host_statuses":[
        {"address":{"socket_address":{"address":"127.0.0.1","port_value":8001}},
         "stats":[{"name":"cx_active","value":"2","type":"GAUGE"},{"name":"rq_active","value":"5","type":"GAUGE"}],
         "health_status":{"eds_health_status":"HEALTHY"}},
        {"address":{"socket_address":{"address":"127.0.0.1","port_value":8002}},
         "stats":[{"name":"rq_active","type":"GAUGE"}],
         "health_status":{"failed_active_health_check":true,"eds_health_status":"HEALTHY"}},
        {"address":{"socket_address":{"address":"127.0.0.1","port_value":8003}},
         "health_status":{"failed_outlier_check":true}},
        {"address":{"socket_address":{"address":"::1","port_value":8004}},
         "health_status":{"eds_health_status":"DRAINING"}}]},
      {"name":"kvroute_admin","host_statuses":[
        {"address":{"socket_address":{"address":"127.0.0.1","port_value":9901}}}]}]}"#;

    #[test]
    fn admin_clusters_give_hosts_with_health_and_active_requests() {
        let s = parse_admin_clusters(ADMIN.as_bytes()).unwrap();
        let pool = &s["inference_pool"];
        assert_eq!(pool.len(), 4);
        assert_eq!(
            pool[0],
            Host {
                addr: "127.0.0.1:8001".into(),
                healthy: true,
                rq_active: 5,
                engine: None
            }
        );
        assert!(!pool[1].healthy, "failed active health check");
        assert!(!pool[2].healthy, "ejected by outlier detection");
        assert_eq!(pool[3].addr, "[::1]:8004");
        assert!(!pool[3].healthy, "draining");
        assert_eq!(s["kvroute_admin"].len(), 1);
    }

    #[test]
    fn engine_load_is_running_and_waiting_over_every_model() {
        let text = "# HELP vllm:num_requests_running Number of requests running.\n\
            # TYPE vllm:num_requests_running gauge\n\
            vllm:num_requests_running{engine=\"0\",model_name=\"a\"} 3.0\n\
            vllm:num_requests_running{engine=\"0\",model_name=\"b\"} 1.0\n\
            vllm:num_requests_waiting{engine=\"0\",model_name=\"a\"} 12.0\n\
            vllm:num_requests_waiting_by_reason{reason=\"x\"} 99.0\n\
            vllm:kv_cache_usage_perc{engine=\"0\"} 0.5\n";
        assert_eq!(parse_engine_metrics(text.as_bytes()), Some((4, 12)));
        assert_eq!(
            parse_engine_metrics(b"sglang:num_queue_reqs 4\nsglang:num_running_reqs 2\n"),
            Some((2, 4))
        );
        assert_eq!(parse_engine_metrics(b"up 1\n"), None);
        assert_eq!(
            parse_engine_metrics(b"vllm:num_requests_waiting NaN\n"),
            None
        );
    }

    #[test]
    fn engine_loads_land_on_their_hosts() {
        let mut s = parse_admin_clusters(ADMIN.as_bytes()).unwrap();
        let load = EngineLoad::observe(None, 7, 0, 0);
        let loads = EngineLoads::from_iter([("127.0.0.1:8001".to_string(), load)]);
        apply_engine_loads(&mut s, &loads);
        assert_eq!(s["inference_pool"][0].engine, Some(load));
        assert_eq!(s["inference_pool"][2].engine, None);
    }

    #[test]
    fn an_engine_that_queues_teaches_its_capacity() {
        let idle = EngineLoad::observe(None, 3, 0, 0);
        assert_eq!(idle.capacity, None);
        assert!(!idle.queueing(idle.estimate(0)));
        let full = EngineLoad::observe(Some(&idle), 16, 5, 2);
        assert_eq!(full.capacity, Some(16));
        assert!(full.queueing(full.estimate(2)), "it reported a queue");
        let drained = EngineLoad::observe(Some(&full), 10, 0, 0);
        assert_eq!(drained.capacity, Some(16), "capacity is remembered");
        assert_eq!(EngineLoad::observe(None, 0, 9, 0).capacity, None, "a stall");
        assert!(!drained.queueing(drained.estimate(0)));
        assert!(
            drained.queueing(drained.estimate(7)),
            "7 more sent since the poll make 17 > 16"
        );
    }

    #[test]
    fn the_estimate_adds_what_kvroute_sent_since_the_poll() {
        let load = EngineLoad::observe(None, 4, 2, 3);
        assert_eq!(load.estimate(3), 6);
        assert_eq!(load.estimate(5), 8, "two more sent");
        assert_eq!(load.estimate(0), 3, "three of ours finished");
        let stale = EngineLoad::observe(None, 0, 0, 9);
        assert_eq!(stale.estimate(2), 2, "never below our own count");
    }

    #[test]
    fn snapshots_round_trip_and_garbage_is_an_error() {
        let s = parse_admin_clusters(ADMIN.as_bytes()).unwrap();
        assert_eq!(decode_snapshot(&encode_snapshot(&s)), Some(s));
        assert!(parse_admin_clusters(b"<html>").is_err());
        assert!(parse_admin_clusters(b"{}").is_err());
    }
}
