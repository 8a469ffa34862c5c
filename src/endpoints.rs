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
    /// Requests the engine itself reports running or waiting (all routers' traffic), when its
    /// metrics are polled (`engine_metrics_cluster`).
    #[serde(default)]
    pub engine_load: u64,
}

impl Host {
    /// A host known only from static config: assumed healthy, load from kvroute's own counts.
    pub fn fixed(addr: &str) -> Host {
        Host {
            addr: addr.to_string(),
            healthy: true,
            rq_active: 0,
            engine_load: 0,
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
        engine_load: 0,
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
pub type EngineLoads = HashMap<String, u64>;

/// Metric families whose samples add up to an engine's load: vLLM's and SGLang's names for
/// requests running and waiting.
const ENGINE_LOAD_METRICS: [&str; 4] = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
];

/// Reads an engine's Prometheus `/metrics` text: its requests running plus waiting, summed over
/// label sets (one per model). `None` when it exposes none of those metrics.
pub fn parse_engine_metrics(text: &[u8]) -> Option<u64> {
    let text = String::from_utf8_lossy(text);
    let mut total = None;
    for line in text.lines() {
        let Some(name_end) = line.find(['{', ' ']) else {
            continue;
        };
        if !ENGINE_LOAD_METRICS.contains(&&line[..name_end]) {
            continue;
        }
        let value = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok());
        if let Some(v) = value.filter(|v| v.is_finite() && *v >= 0.0) {
            *total.get_or_insert(0) += v.round() as u64;
        }
    }
    total
}

/// Writes the latest engine loads into a snapshot's hosts.
pub fn apply_engine_loads(snapshot: &mut Snapshot, loads: &EngineLoads) {
    for host in snapshot.values_mut().flatten() {
        host.engine_load = loads.get(&host.addr).copied().unwrap_or(0);
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
                engine_load: 0
            }
        );
        assert!(!pool[1].healthy, "failed active health check");
        assert!(!pool[2].healthy, "ejected by outlier detection");
        assert_eq!(pool[3].addr, "[::1]:8004");
        assert!(!pool[3].healthy, "draining");
        assert_eq!(s["kvroute_admin"].len(), 1);
    }

    #[test]
    fn engine_load_is_running_plus_waiting_over_every_model() {
        let text = "# HELP vllm:num_requests_running Number of requests running.\n\
            # TYPE vllm:num_requests_running gauge\n\
            vllm:num_requests_running{engine=\"0\",model_name=\"a\"} 3.0\n\
            vllm:num_requests_running{engine=\"0\",model_name=\"b\"} 1.0\n\
            vllm:num_requests_waiting{engine=\"0\",model_name=\"a\"} 12.0\n\
            vllm:num_requests_waiting_by_reason{reason=\"x\"} 99.0\n\
            vllm:kv_cache_usage_perc{engine=\"0\"} 0.5\n";
        assert_eq!(parse_engine_metrics(text.as_bytes()), Some(16));
        assert_eq!(
            parse_engine_metrics(b"sglang:num_queue_reqs 4\nsglang:num_running_reqs 2\n"),
            Some(6)
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
        let loads = EngineLoads::from_iter([("127.0.0.1:8001".to_string(), 7)]);
        apply_engine_loads(&mut s, &loads);
        assert_eq!(s["inference_pool"][0].engine_load, 7);
        assert_eq!(s["inference_pool"][2].engine_load, 0);
    }

    #[test]
    fn snapshots_round_trip_and_garbage_is_an_error() {
        let s = parse_admin_clusters(ADMIN.as_bytes()).unwrap();
        assert_eq!(decode_snapshot(&encode_snapshot(&s)), Some(s));
        assert!(parse_admin_clusters(b"<html>").is_err());
        assert!(parse_admin_clusters(b"{}").is_err());
    }
}
