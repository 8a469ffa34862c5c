//! Which endpoints a request may go to, from Envoy's admin `/clusters?format=json` or static config.

use hashbrown::HashMap;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::engine::{EngineLoad, EngineLoads};
use crate::rendezvous::endpoint_id;

/// One upstream host as Envoy sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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

/// Writes the latest engine loads into a snapshot's hosts.
pub fn apply_engine_loads(snapshot: &mut Snapshot, loads: &EngineLoads) {
    for host in snapshot.values_mut().flatten() {
        host.engine = loads.get(&host.addr).copied();
    }
}

/// Format of the snapshot in shared data: a version byte, then JSON.
const SNAPSHOT_VERSION: u8 = 1;

/// Serialises a snapshot for shared data (addresses and numbers only).
pub fn encode_snapshot(snapshot: &Snapshot) -> Vec<u8> {
    let json = serde_json::to_vec(snapshot).unwrap_or_default();
    crate::store::versioned(SNAPSHOT_VERSION, &json)
}

/// The snapshot [`encode_snapshot`] wrote; `None` for another version or a damaged value.
pub fn decode_snapshot(bytes: &[u8]) -> Option<Snapshot> {
    serde_json::from_slice(crate::store::unversioned(SNAPSHOT_VERSION, bytes)?).ok()
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
    fn engine_loads_land_on_their_hosts() {
        let mut s = parse_admin_clusters(ADMIN.as_bytes()).unwrap();
        let load = EngineLoad::default();
        let loads = EngineLoads::from_iter([("127.0.0.1:8001".to_string(), load)]);
        apply_engine_loads(&mut s, &loads);
        assert_eq!(s["inference_pool"][0].engine, Some(load));
        assert_eq!(s["inference_pool"][2].engine, None);
    }

    #[test]
    fn snapshots_round_trip_and_garbage_is_an_error() {
        let s = parse_admin_clusters(ADMIN.as_bytes()).unwrap();
        assert_eq!(decode_snapshot(&encode_snapshot(&s)), Some(s.clone()));
        let mut other = encode_snapshot(&s);
        other[0] = SNAPSHOT_VERSION + 1;
        assert_eq!(decode_snapshot(&other), None, "another version is ignored");
        let unversioned = serde_json::to_vec(&s).unwrap();
        assert_eq!(
            decode_snapshot(&unversioned),
            None,
            "so is the old bare JSON"
        );
        assert!(parse_admin_clusters(b"<html>").is_err());
        assert!(parse_admin_clusters(b"{}").is_err());
    }
}
