//! The routers under comparison: parsing their names and starting each in front of a sim fleet.

use crate::oracle::Oracle;
use crate::peers::{self, PeerProcess};
use crate::sim_process::SimFleet;
use crate::workload::SESSION_HEADER;
use kvroute_harness::{Envoy, EnvoyOptions, Lb};
use serde_json::{json, Value};
use std::net::SocketAddr;

/// Envoy worker threads for the Envoy-based routers (the machine has 2 cores).
const ENVOY_CONCURRENCY: u32 = 2;

/// A router named on the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Router {
    RoundRobin,
    LeastRequest,
    RingHash,
    /// kvroute with the shipped plugin config, or with `policy` laid over it.
    Kvroute(Option<String>),
    Smg,
    Vllm(String),
    Oracle,
}

impl Router {
    pub fn parse(name: &str) -> Result<Router, String> {
        let (base, arg) = match name.split_once(':') {
            Some((b, a)) => (b, Some(a.to_string())),
            None => (name, None),
        };
        Ok(match (base, arg) {
            ("round_robin", None) => Router::RoundRobin,
            ("least_request", None) => Router::LeastRequest,
            ("ring_hash", None) => Router::RingHash,
            ("kvroute", policy) => Router::Kvroute(policy),
            ("smg", None) => Router::Smg,
            ("vllm-router", Some(policy)) => Router::Vllm(policy),
            ("oracle", None) => Router::Oracle,
            _ => {
                return Err(format!(
                    "unknown router {name:?} (round_robin, least_request, ring_hash, kvroute, \
                     kvroute:<policy>, smg, vllm-router:<policy>, oracle)"
                ))
            }
        })
    }

    pub fn parse_list(list: &str) -> Result<Vec<Router>, String> {
        list.split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(Router::parse)
            .collect()
    }

    pub fn name(&self) -> String {
        match self {
            Router::RoundRobin => "round_robin".into(),
            Router::LeastRequest => "least_request".into(),
            Router::RingHash => "ring_hash".into(),
            Router::Kvroute(None) => "kvroute".into(),
            Router::Kvroute(Some(p)) => format!("kvroute:{p}"),
            Router::Smg => "smg".into(),
            Router::Vllm(p) => format!("vllm-router:{p}"),
            Router::Oracle => "oracle".into(),
        }
    }

    /// Starts this router in front of `fleet`. An `Err` is the reason to report it as skipped.
    pub async fn start(&self, fleet: &SimFleet, fleet_spec: &Value) -> Result<Running, String> {
        let envoy = |lb: Lb| async move {
            let backends = fleet
                .replicas
                .iter()
                .map(|r| addr_of(&r.url))
                .collect::<Result<Vec<_>, _>>()?;
            let opts = EnvoyOptions {
                backends,
                lb,
                concurrency: ENVOY_CONCURRENCY,
                ..EnvoyOptions::default()
            };
            let envoy = Envoy::start(opts).await.map_err(|e| e.to_string())?;
            Ok::<_, String>(Running {
                url: envoy.url(),
                process: Process::Envoy(envoy),
            })
        };
        match self {
            Router::RoundRobin => envoy(Lb::RoundRobin).await,
            Router::LeastRequest => envoy(Lb::LeastRequest).await,
            Router::RingHash => {
                envoy(Lb::RingHash {
                    header: SESSION_HEADER.into(),
                })
                .await
            }
            Router::Kvroute(policy) => {
                let plugin_config = match policy {
                    Some(p) => json!({ "policy": p }),
                    None => json!({}),
                };
                envoy(Lb::Kvroute { plugin_config }).await
            }
            Router::Smg => peer(peers::start_smg(fleet).await),
            Router::Vllm(policy) => peer(peers::start_vllm_router(policy, fleet, fleet_spec).await),
            Router::Oracle => {
                let oracle = Oracle::start(fleet.control_client(), fleet.replicas.clone()).await?;
                Ok(Running {
                    url: oracle.url.clone(),
                    process: Process::Oracle(oracle),
                })
            }
        }
    }
}

fn peer(p: Result<PeerProcess, String>) -> Result<Running, String> {
    let p = p?;
    Ok(Running {
        url: p.url.clone(),
        process: Process::Peer(p),
    })
}

/// A started router; dropping it stops it.
pub struct Running {
    pub url: String,
    pub process: Process,
}

/// What keeps a router alive; held only so that dropping it stops the router.
#[allow(dead_code)]
pub enum Process {
    Envoy(Envoy),
    Peer(PeerProcess),
    Oracle(Oracle),
}

impl Running {
    /// kvroute's routing decisions so far (`kvroute.routed.<decision>` counters), if it is kvroute.
    pub async fn kvroute_decisions(&self) -> Vec<(String, u64)> {
        let Process::Envoy(envoy) = &self.process else {
            return Vec::new();
        };
        // Routed decisions, and the fallbacks that happened (requests kvroute left to Envoy).
        let stats = envoy.stats("kvroute.").await.unwrap_or_default();
        let mut out: Vec<(String, u64)> = stats
            .into_iter()
            .filter_map(|(name, v)| {
                if let Some((_, decision)) = name.rsplit_once("kvroute.routed.") {
                    return Some((decision.to_string(), v));
                }
                let (_, reason) = name.rsplit_once("kvroute.fallback.")?;
                (v > 0).then(|| (format!("fallback:{reason}"), v))
            })
            .collect();
        out.sort();
        out
    }
}

/// `http://127.0.0.1:8001` -> `127.0.0.1:8001`.
fn addr_of(url: &str) -> Result<SocketAddr, String> {
    let hostport = url.trim_start_matches("http://").trim_end_matches('/');
    hostport
        .parse()
        .map_err(|e| format!("replica url {url:?}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn router_names_round_trip() {
        let names = "round_robin,least_request,ring_hash,kvroute,kvroute:prefix_hash,smg,vllm-router:kv_aware,oracle";
        let parsed = Router::parse_list(names).unwrap();
        let back: Vec<String> = parsed.iter().map(Router::name).collect();
        assert_eq!(back.join(","), names);
    }

    #[test]
    fn unknown_router_is_an_error() {
        assert!(Router::parse("nginx").is_err());
        assert!(Router::parse("vllm-router").is_err());
    }
}
