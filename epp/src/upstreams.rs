//! Where the gateway's HTTP calls go in this process, by the cluster it names: the endpoint pool
//! answers its own `/clusters` document, an Envoy admin or kvroute-indexer is called at its
//! address, and the engines' metrics cluster at the address the call's routing header names.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::RwLock;
use std::time::Duration;

use serde_json::json;

/// The endpoints this process picks from: a static list now (an InferencePool's pods later),
/// shown to the gateway as Envoy's admin would show a cluster of healthy hosts.
pub struct Pool {
    /// The cluster name the gateway knows the pool by (its requests' route cluster).
    pub cluster: String,
    endpoints: RwLock<Vec<SocketAddr>>,
}

impl Pool {
    pub fn new(cluster: &str, endpoints: Vec<SocketAddr>) -> Pool {
        Pool {
            cluster: cluster.to_string(),
            endpoints: RwLock::new(endpoints),
        }
    }

    /// Replaces the pool's members.
    pub fn set(&self, endpoints: Vec<SocketAddr>) {
        *self.endpoints.write().unwrap_or_else(|p| p.into_inner()) = endpoints;
    }

    /// The pool as an Envoy admin `/clusters?format=json` document: each member healthy, with no
    /// requests active (the gateway counts its own).
    pub fn clusters_document(&self) -> Vec<u8> {
        let endpoints = self.endpoints.read().unwrap_or_else(|p| p.into_inner());
        let hosts: Vec<_> = endpoints
            .iter()
            .map(|a| {
                json!({
                    "address": { "socket_address": {
                        "address": a.ip().to_string(), "port_value": a.port() } },
                    "health_status": { "eds_health_status": "HEALTHY" },
                    "stats": [{ "type": "GAUGE", "name": "rq_active", "value": "0" }]
                })
            })
            .collect();
        let document = json!({ "cluster_statuses": [
            { "name": self.cluster, "host_statuses": hosts }
        ] });
        document.to_string().into_bytes()
    }
}

/// What a call to one cluster reaches.
pub enum Target {
    /// The pool's own document, answered in process (the admin cluster, with a pool).
    Pool(std::sync::Arc<Pool>),
    /// A server at this `host:port` (an Envoy admin, kvroute-indexer).
    Fixed(String),
    /// The host the call's routing header names (the engines' metrics cluster).
    Named,
}

/// The call's answer: its status and body, both `None` when nothing answered.
pub type Answer = (Option<u16>, Option<Vec<u8>>);

/// The targets by cluster name, and the client that calls them.
pub struct Upstreams {
    targets: HashMap<String, Target>,
    /// The routing header, which names the host on a call to a [`Target::Named`] cluster.
    header: String,
    client: reqwest::Client,
}

impl Upstreams {
    pub fn new(header: &str) -> Upstreams {
        Upstreams {
            targets: HashMap::new(),
            header: header.to_string(),
            client: reqwest::Client::new(),
        }
    }

    pub fn with(mut self, cluster: &str, target: Target) -> Upstreams {
        self.targets.insert(cluster.to_string(), target);
        self
    }

    /// Whether a call to `cluster` can be sent.
    pub fn knows(&self, cluster: &str) -> bool {
        self.targets.contains_key(cluster)
    }

    /// `GET` of the call's `:path` from `cluster`'s target, with `headers` as the gateway gave
    /// them (pseudo-headers and the routing header are not sent on).
    pub async fn get(
        &self,
        cluster: &str,
        headers: &[(String, String)],
        timeout: Duration,
    ) -> Answer {
        let header = |name: &str| {
            let found = headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name));
            found.map(|(_, v)| v.as_str())
        };
        let authority = match self.targets.get(cluster) {
            None => return (None, None),
            Some(Target::Pool(pool)) => return (Some(200), Some(pool.clusters_document())),
            Some(Target::Fixed(addr)) => addr.as_str(),
            Some(Target::Named) => match header(&self.header) {
                Some(addr) => addr,
                None => return (None, None),
            },
        };
        let path = header(":path").unwrap_or("/");
        let url = format!("http://{authority}{path}");
        let sent = self.client.get(url).timeout(timeout).send().await;
        let Ok(response) = sent else {
            return (None, None);
        };
        let status = response.status().as_u16();
        let body = response.bytes().await.ok().map(|b| b.to_vec());
        (Some(status), body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute::endpoints::{parse_admin_clusters, PolledClusters};

    #[test]
    fn the_pool_reads_back_as_a_cluster_of_healthy_hosts() {
        let pool = Pool::new(
            "inference_pool",
            vec![
                "127.0.0.1:8001".parse().unwrap(),
                "127.0.0.1:8002".parse().unwrap(),
            ],
        );
        let snapshot =
            parse_admin_clusters(&pool.clusters_document(), PolledClusters::ALL).unwrap();
        let hosts = &snapshot["inference_pool"];
        let addrs: Vec<_> = hosts.iter().map(|h| h.addr.as_str()).collect();
        assert_eq!(addrs, ["127.0.0.1:8001", "127.0.0.1:8002"]);
        assert!(hosts.iter().all(|h| h.healthy && h.rq_active == 0));
        pool.set(vec!["127.0.0.1:8003".parse().unwrap()]);
        let snapshot =
            parse_admin_clusters(&pool.clusters_document(), PolledClusters::ALL).unwrap();
        assert_eq!(snapshot["inference_pool"][0].addr, "127.0.0.1:8003");
    }
}
