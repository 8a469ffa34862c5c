//! Where the gateway's HTTP calls go in this process, by the cluster it names: the endpoint pool
//! answers its own `/clusters` document, precise mode's index in process answers as
//! kvroute-indexer would, an Envoy admin or kvroute-indexer is called at its address, and the
//! engines' metrics cluster at the address the call's routing header names.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::RwLock;
use std::time::Duration;

use kvroute_indexer::api;
use serde_json::json;

/// The endpoints this process picks from (a static list, or an InferencePool's pods), shown to
/// the gateway as Envoy's admin would show a cluster of healthy hosts.
pub struct Pool {
    /// The cluster name the gateway knows the pool by (its requests' route cluster).
    pub cluster: String,
    /// `None` until the members are first known.
    endpoints: RwLock<Option<Vec<SocketAddr>>>,
}

impl Pool {
    pub fn new(cluster: &str, endpoints: Vec<SocketAddr>) -> Pool {
        Pool {
            cluster: cluster.to_string(),
            endpoints: RwLock::new(Some(endpoints)),
        }
    }

    /// A pool whose members are not known yet (an InferencePool's, before its pods are listed).
    pub fn unlisted(cluster: &str) -> Pool {
        Pool {
            cluster: cluster.to_string(),
            endpoints: RwLock::new(None),
        }
    }

    /// Replaces the pool's members.
    pub fn set(&self, endpoints: Vec<SocketAddr>) {
        *self.endpoints.write().unwrap_or_else(|p| p.into_inner()) = Some(endpoints);
    }

    /// The members, once known.
    pub fn members(&self) -> Option<Vec<SocketAddr>> {
        self.endpoints
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Whether the members are known.
    pub fn listed(&self) -> bool {
        self.endpoints
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }

    /// The pool as an Envoy admin `/clusters?format=json` document: each member healthy, with no
    /// requests active (the gateway counts its own). A pool not yet listed has none.
    pub fn clusters_document(&self) -> Option<Vec<u8>> {
        let endpoints = self.endpoints.read().unwrap_or_else(|p| p.into_inner());
        let hosts: Vec<_> = endpoints
            .as_ref()?
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
        Some(document.to_string().into_bytes())
    }
}

/// What a call to one cluster reaches.
pub enum Target {
    /// The pool's own document, answered in process (the admin cluster, with a pool).
    Pool(std::sync::Arc<Pool>),
    /// A server at this `host:port` (an Envoy admin, kvroute-indexer).
    Fixed(String),
    /// Precise mode's index, answered in process as kvroute-indexer's API answers.
    Index(std::sync::Arc<kvroute_indexer::state::Shared>),
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

    /// Whether a call to `cluster` can be sent. A pool not yet listed cannot answer: the
    /// gateway's poll then fails (counted, not logged) and it publishes no snapshot, which keeps
    /// the picker from being ready on an empty pool it has not read.
    pub fn knows(&self, cluster: &str) -> bool {
        match self.targets.get(cluster) {
            Some(Target::Pool(pool)) => pool.listed(),
            Some(_) => true,
            None => false,
        }
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
        let path = header(":path").unwrap_or("/");
        let authority = match self.targets.get(cluster) {
            None => return (None, None),
            Some(Target::Pool(pool)) => match pool.clusters_document() {
                Some(document) => return (Some(200), Some(document)),
                None => return (None, None),
            },
            Some(Target::Index(index)) => {
                let (path, query) = path.split_once('?').unwrap_or((path, ""));
                let (status, _, body) =
                    api::get(|| index.lock(), index.serving(), path, query, index.now());
                return (Some(status.as_u16()), Some(body.into_bytes()));
            }
            Some(Target::Fixed(addr)) => addr.as_str(),
            Some(Target::Named) => match header(&self.header) {
                Some(addr) => addr,
                None => return (None, None),
            },
        };
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
    use kvroute::hosts::{parse_admin_clusters, PolledClusters};

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
            parse_admin_clusters(&pool.clusters_document().unwrap(), PolledClusters::ALL).unwrap();
        let hosts = &snapshot["inference_pool"];
        let addrs: Vec<_> = hosts.iter().map(|h| h.addr.as_str()).collect();
        assert_eq!(addrs, ["127.0.0.1:8001", "127.0.0.1:8002"]);
        assert!(hosts.iter().all(|h| h.healthy && h.rq_active == 0));
        pool.set(vec!["127.0.0.1:8003".parse().unwrap()]);
        let snapshot =
            parse_admin_clusters(&pool.clusters_document().unwrap(), PolledClusters::ALL).unwrap();
        assert_eq!(snapshot["inference_pool"][0].addr, "127.0.0.1:8003");
    }

    #[test]
    fn a_pool_not_yet_listed_cannot_be_called_until_it_is() {
        let pool = std::sync::Arc::new(Pool::unlisted("inference_pool"));
        let upstreams = Upstreams::new("x-gateway-destination-endpoint")
            .with("kvroute_admin", Target::Pool(pool.clone()));
        assert!(!upstreams.knows("kvroute_admin"));
        assert_eq!(pool.clusters_document(), None);
        pool.set(Vec::new());
        assert!(upstreams.knows("kvroute_admin"));
        let snapshot =
            parse_admin_clusters(&pool.clusters_document().unwrap(), PolledClusters::ALL).unwrap();
        assert!(snapshot["inference_pool"].is_empty());
    }
}
