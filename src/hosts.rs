//! Which endpoints a request may go to, from Envoy's admin `/clusters?format=json` or static config.

use hashbrown::HashMap;
use std::borrow::Cow;

use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use crate::engine_load::{EngineLoad, EngineLoads};
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

/// Each engine's finished-requests counter in `snapshot` (address, count), once per address
/// however many clusters list it, sorted by address.
pub fn completed(snapshot: &Snapshot) -> Vec<(&str, f64)> {
    let mut out: Vec<(&str, f64)> = snapshot
        .values()
        .flatten()
        .filter_map(|h| Some((h.addr.as_str(), h.engine?.completed?)))
        .collect();
    out.sort_by(|a, b| a.0.cmp(b.0));
    out.dedup_by(|a, b| a.0 == b.0);
    out
}

/// Which clusters a poll keeps: the routed ones (every cluster when none are named), and the
/// engines' metrics cluster.
#[derive(Debug, Clone, Copy)]
pub struct PolledClusters<'a> {
    routed: &'a [String],
    engines: Option<&'a str>,
}

impl<'a> PolledClusters<'a> {
    /// Every cluster (a small Envoy config, where nothing needs skipping).
    pub const ALL: PolledClusters<'static> = PolledClusters {
        routed: &[],
        engines: None,
    };

    /// `routed` (all clusters if empty), plus `engines` (the engine metrics cluster) when set.
    pub fn new(routed: &'a [String], engines: Option<&'a str>) -> PolledClusters<'a> {
        PolledClusters { routed, engines }
    }

    fn keeps(&self, cluster: &str) -> bool {
        self.routed.is_empty()
            || self.engines == Some(cluster)
            || self.routed.iter().any(|n| n == cluster)
    }
}

/// The admin path a poll asks: `/clusters?format=json`, with a `filter` (an RE2 regex on the
/// cluster name, which Envoy's admin applies before writing the document) naming only the kept
/// clusters. The parser filters again, for an Envoy that ignores the parameter.
pub fn admin_clusters_path(keep: PolledClusters) -> String {
    let mut path = "/clusters?format=json".to_string();
    if keep.routed.is_empty() {
        return path;
    }
    let names = keep.routed.iter().map(String::as_str).chain(keep.engines);
    let alternatives: Vec<String> = names.map(regex_literal).collect();
    path.push_str("&filter=");
    let regex = format!("^(?:{})$", alternatives.join("|"));
    for b in regex.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            path.push(b as char);
        } else {
            path.push_str(&format!("%{b:02X}"));
        }
    }
    path
}

/// `name` as a regex matching exactly it: ASCII punctuation escaped (RE2 takes `\` before any
/// of it), everything else literal.
fn regex_literal(name: &str) -> String {
    let mut out = String::with_capacity(name.len() * 2);
    for c in name.chars() {
        if c.is_ascii_punctuation() && c != '-' && c != '_' {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// Reads the admin `/clusters?format=json` document, keeping the hosts (those with a socket
/// address) of the clusters `keep` names. On a mesh gateway the document lists every cluster of
/// the mesh, thousands of hosts: the others are skipped by the parser without being built.
pub fn parse_admin_clusters(body: &[u8], keep: PolledClusters) -> Result<Snapshot, String> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let snapshot = DocumentSeed(keep)
        .deserialize(&mut de)
        .map_err(|e| format!("not a /clusters document: {e}"))?;
    de.end()
        .map_err(|e| format!("not a /clusters document: {e}"))?;
    snapshot.ok_or_else(|| "no cluster_statuses".to_string())
}

/// The document: only `cluster_statuses` is read.
struct DocumentSeed<'k>(PolledClusters<'k>);

impl<'de> DeserializeSeed<'de> for DocumentSeed<'_> {
    type Value = Option<Snapshot>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for DocumentSeed<'_> {
    type Value = Option<Snapshot>;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("an object with cluster_statuses")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut snapshot = None;
        while let Some(Text(key)) = map.next_key()? {
            if key == "cluster_statuses" {
                snapshot = Some(map.next_value_seed(ClustersSeed(self.0))?);
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(snapshot)
    }
}

/// The list of clusters, each kept or skipped by name.
struct ClustersSeed<'k>(PolledClusters<'k>);

impl<'de> DeserializeSeed<'de> for ClustersSeed<'_> {
    type Value = Snapshot;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for ClustersSeed<'_> {
    type Value = Snapshot;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a list of cluster statuses")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut snapshot = Snapshot::new();
        while let Some(cluster) = seq.next_element_seed(ClusterSeed(self.0))? {
            if let Some((name, hosts)) = cluster {
                snapshot.insert(name, hosts);
            }
        }
        Ok(snapshot)
    }
}

/// One cluster: its name and, if kept, its hosts.
struct ClusterSeed<'k>(PolledClusters<'k>);

impl<'de> DeserializeSeed<'de> for ClusterSeed<'_> {
    type Value = Option<(String, Vec<Host>)>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for ClusterSeed<'_> {
    type Value = Option<(String, Vec<Host>)>;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a cluster status")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut name: Option<Cow<'de, str>> = None;
        let mut hosts: Option<Vec<Host>> = None;
        while let Some(Text(key)) = map.next_key()? {
            match key.as_ref() {
                "name" => name = Some(map.next_value::<Text>()?.0),
                // Envoy writes `name` first; only if it did not are hosts read before knowing.
                "host_statuses" if name.as_deref().is_none_or(|n| self.0.keeps(n)) => {
                    let statuses: Vec<HostStatus<'de>> = map.next_value()?;
                    hosts = Some(statuses.into_iter().filter_map(HostStatus::host).collect());
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(name
            .filter(|n| self.0.keeps(n))
            .map(|n| (n.into_owned(), hosts.unwrap_or_default())))
    }
}

/// A string borrowed from the document where it has no escapes (keys and names never do).
#[derive(Deserialize)]
struct Text<'a>(#[serde(borrow)] Cow<'a, str>);

/// A host status as Envoy writes it; strings borrowed from the document where it has no escapes.
#[derive(Deserialize)]
struct HostStatus<'a> {
    #[serde(borrow)]
    address: Option<Address<'a>>,
    #[serde(borrow, default)]
    stats: Vec<Stat<'a>>,
    #[serde(borrow)]
    health_status: Option<Health<'a>>,
}

#[derive(Deserialize)]
struct Address<'a> {
    #[serde(borrow)]
    socket_address: Option<SocketAddress<'a>>,
}

#[derive(Deserialize)]
struct SocketAddress<'a> {
    #[serde(borrow)]
    address: Cow<'a, str>,
    port_value: u64,
}

#[derive(Deserialize)]
struct Stat<'a> {
    #[serde(borrow)]
    name: Cow<'a, str>,
    /// A uint64 in proto JSON: a string, or a number from some writers. Kept as written and
    /// read only for the one stat kvroute uses (an untagged enum would build and drop an error
    /// for every string value of every host on every poll).
    #[serde(borrow, default)]
    value: Option<&'a RawValue>,
}

/// A host is usable unless a health check or outlier detection failed it, or EDS says it is not
/// serving. override_host does not check health itself, so this is the only guard.
#[derive(Deserialize, Default)]
#[serde(default)]
struct Health<'a> {
    failed_active_health_check: bool,
    failed_outlier_check: bool,
    failed_eds_health: bool,
    pending_dynamic_removal: bool,
    excluded_via_immediate_hc_fail: bool,
    active_hc_timeout: bool,
    #[serde(borrow)]
    eds_health_status: Option<Cow<'a, str>>,
}

impl Health<'_> {
    fn healthy(&self) -> bool {
        let failed = self.failed_active_health_check
            || self.failed_outlier_check
            || self.failed_eds_health
            || self.pending_dynamic_removal
            || self.excluded_via_immediate_hc_fail
            || self.active_hc_timeout;
        let eds_ok = match self.eds_health_status.as_deref() {
            None => true,
            Some(status) => matches!(status, "HEALTHY" | "UNKNOWN" | "DEGRADED"),
        };
        !failed && eds_ok
    }
}

impl HostStatus<'_> {
    fn host(self) -> Option<Host> {
        let socket = self.address?.socket_address?;
        let (ip, port) = (socket.address, socket.port_value);
        let addr = if ip.contains(':') {
            format!("[{ip}]:{port}")
        } else {
            format!("{ip}:{port}")
        };
        let rq_active = self
            .stats
            .iter()
            .find(|s| s.name == "rq_active")
            .and_then(|s| s.value?.get().trim_matches('"').parse().ok())
            .unwrap_or(0);
        Some(Host {
            addr,
            healthy: self.health_status.is_none_or(|h| h.healthy()),
            rq_active,
            engine: None,
        })
    }
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
        let s = parse_admin_clusters(ADMIN.as_bytes(), PolledClusters::ALL).unwrap();
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
    fn only_the_routed_clusters_and_the_engine_cluster_are_kept() {
        let all = parse_admin_clusters(ADMIN.as_bytes(), PolledClusters::ALL).unwrap();
        let routed = ["inference_pool".to_string()];
        let s = parse_admin_clusters(ADMIN.as_bytes(), PolledClusters::new(&routed, None)).unwrap();
        assert_eq!(s.keys().collect::<Vec<_>>(), ["inference_pool"]);
        assert_eq!(s["inference_pool"], all["inference_pool"]);
        let other = ["elsewhere".to_string()];
        let s = parse_admin_clusters(
            ADMIN.as_bytes(),
            PolledClusters::new(&other, Some("kvroute_admin")),
        );
        assert_eq!(s.unwrap().keys().collect::<Vec<_>>(), ["kvroute_admin"]);
    }

    /// A skipped cluster's hosts are skipped whatever their shape; a kept one's are read even when
    /// its name comes after them.
    #[test]
    fn skipping_does_not_depend_on_field_order_or_the_skipped_hosts() {
        let doc = r#"{"cluster_statuses":[
          {"name":"other","host_statuses":[{"address":7,"stats":"odd"}]},
          {"host_statuses":[{"address":{"socket_address":{"address":"127.0.0.1","port_value":9}},
             "stats":[{"name":"rq_active","value":3}]}],"name":"pool"}]}"#;
        let routed = ["pool".to_string()];
        let s = parse_admin_clusters(doc.as_bytes(), PolledClusters::new(&routed, None)).unwrap();
        assert_eq!(s.len(), 1);
        assert_eq!(s["pool"][0].addr, "127.0.0.1:9");
        assert_eq!(s["pool"][0].rq_active, 3);
        assert!(
            parse_admin_clusters(doc.as_bytes(), PolledClusters::ALL).is_err(),
            "malformed if kept"
        );
    }

    #[test]
    fn the_poll_asks_envoy_for_the_kept_clusters_only() {
        assert_eq!(
            admin_clusters_path(PolledClusters::ALL),
            "/clusters?format=json"
        );
        let routed = ["outbound|8000||vllm.llm.svc.cluster.local".to_string()];
        let path = admin_clusters_path(PolledClusters::new(&routed, Some("pool-2")));
        let (base, filter) = path.split_once("&filter=").unwrap();
        assert_eq!(base, "/clusters?format=json");
        assert!(filter
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-._~%".contains(&b)));
        let decoded = filter
            .split('%')
            .enumerate()
            .map(|(i, part)| match i {
                0 => part.to_string(),
                _ => {
                    let byte = u8::from_str_radix(&part[..2], 16).unwrap();
                    format!("{}{}", byte as char, &part[2..])
                }
            })
            .collect::<String>();
        assert_eq!(
            decoded,
            r"^(?:outbound\|8000\|\|vllm\.llm\.svc\.cluster\.local|pool-2)$"
        );
    }

    #[test]
    fn engine_loads_land_on_their_hosts() {
        let mut s = parse_admin_clusters(ADMIN.as_bytes(), PolledClusters::ALL).unwrap();
        let load = EngineLoad::default();
        let loads = EngineLoads::from_iter([("127.0.0.1:8001".to_string(), load)]);
        apply_engine_loads(&mut s, &loads);
        assert_eq!(s["inference_pool"][0].engine, Some(load));
        assert_eq!(s["inference_pool"][2].engine, None);
    }

    #[test]
    fn snapshots_round_trip_and_garbage_is_an_error() {
        let s = parse_admin_clusters(ADMIN.as_bytes(), PolledClusters::ALL).unwrap();
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
        assert!(parse_admin_clusters(b"<html>", PolledClusters::ALL).is_err());
        assert!(parse_admin_clusters(b"{}", PolledClusters::ALL).is_err());
    }

    #[test]
    fn each_engines_finished_requests_count_once_however_many_clusters_list_it() {
        let host = |addr: &str, completed: Option<f64>| Host {
            engine: Some(EngineLoad {
                completed,
                ..EngineLoad::default()
            }),
            ..Host::fixed(addr)
        };
        let mut s = Snapshot::new();
        s.insert(
            "pool".into(),
            vec![host("b:1", Some(5.0)), host("a:1", Some(3.0))],
        );
        s.insert(
            "engines".into(),
            vec![host("a:1", Some(3.0)), host("c:1", None)],
        );
        s.insert("other".into(), vec![Host::fixed("d:1")]);
        assert_eq!(completed(&s), vec![("a:1", 3.0), ("b:1", 5.0)]);
    }
}
