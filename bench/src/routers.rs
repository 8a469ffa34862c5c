//! The routers under comparison: parsing their names and starting each in front of a sim fleet.

use crate::epp;
use crate::kvroute_stats;
use crate::oracle::Oracle;
use crate::peers::{self, PeerProcess};
use crate::precise::{self, Indexer};
use crate::sim_process::SimFleet;
use crate::workload::SESSION_HEADER;
use kvroute::gateway::stat_names::Counter;
use kvroute_harness::{Envoy, EnvoyOptions, Lb};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// Envoy worker threads of the Envoy-based routers unless `compare --envoy-workers` says
/// otherwise: the machine has 2 cores. (A standalone Envoy runs one worker per core; each worker
/// has its own kvroute VM.)
pub const ENVOY_WORKERS: u32 = 2;
/// How long kvroute's counters may lag the requests: it writes them on its tick (every 100 ms
/// at most), which a loaded machine may run late.
const KVROUTE_FLUSH: std::time::Duration = std::time::Duration::from_secs(3);

/// A router named on the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Router {
    RoundRobin,
    LeastRequest,
    RingHash,
    /// kvroute with the shipped plugin config, or with `policy` laid over it.
    Kvroute(Option<String>),
    /// `kvroute-precise`: kvroute in precise mode, polling its own kvroute-indexer subscribed to
    /// every replica's KV events.
    KvroutePrecise,
    /// `kvroute-epp`: kvroute's core as an endpoint picker process, asked over ext_proc by an
    /// Envoy of its own, with the config `Kvroute` gets (`policy` laid over it likewise).
    KvrouteEpp(Option<String>),
    /// `kvroute-b`: another build of the filter (`--compare-wasm`), with the shipped config, so
    /// two builds run side by side on the same requests.
    KvrouteB(PathBuf),
    Smg,
    Vllm(String),
    Oracle,
    /// `NAME@N`: N instances of a router, each with its own state, behind one round-robin Envoy.
    Scaled(Box<Router>, u32),
}

/// Most instances `NAME@N` starts (everything shares the machine's cores).
pub const MAX_INSTANCES: u32 = 8;

impl Router {
    /// The router `name` names; `kvroute-b` runs the build `b` (`--compare-wasm`), and is an error
    /// without it.
    pub fn parse(name: &str, b: Option<&Path>) -> Result<Router, String> {
        if let Some((base, n)) = name.rsplit_once('@') {
            let n: u32 = n
                .parse()
                .ok()
                .filter(|n| (1..=MAX_INSTANCES).contains(n))
                .ok_or_else(|| {
                    format!("{name:?}: the count after @ must be 1 to {MAX_INSTANCES}")
                })?;
            return match Router::parse(base, b)? {
                Router::Scaled(..) => Err(format!("{name:?}: only one @N per router")),
                inner => Ok(Router::Scaled(Box::new(inner), n)),
            };
        }
        let (base, arg) = match name.split_once(':') {
            Some((b, a)) => (b, Some(a.to_string())),
            None => (name, None),
        };
        Ok(match (base, arg) {
            ("round_robin", None) => Router::RoundRobin,
            ("least_request", None) => Router::LeastRequest,
            ("ring_hash", None) => Router::RingHash,
            ("kvroute", policy) => Router::Kvroute(policy),
            ("kvroute-precise", None) => Router::KvroutePrecise,
            ("kvroute-epp", policy) => Router::KvrouteEpp(policy),
            ("kvroute-b", None) => match b {
                Some(path) => Router::KvrouteB(path.to_path_buf()),
                None => return Err("kvroute-b is the build --compare-wasm names; give it".into()),
            },
            ("smg", None) => Router::Smg,
            ("vllm-router", Some(policy)) => Router::Vllm(policy),
            ("oracle", None) => Router::Oracle,
            _ => {
                return Err(format!(
                    "unknown router {name:?} (round_robin, least_request, ring_hash, kvroute, \
                     kvroute:<policy>, kvroute-precise, kvroute-epp, smg, vllm-router:<policy>, oracle, any of them as NAME@N)"
                ))
            }
        })
    }

    pub fn parse_list(list: &str, b: Option<&Path>) -> Result<Vec<Router>, String> {
        list.split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|name| Router::parse(name, b))
            .collect()
    }

    pub fn name(&self) -> String {
        match self {
            Router::RoundRobin => "round_robin".into(),
            Router::LeastRequest => "least_request".into(),
            Router::RingHash => "ring_hash".into(),
            Router::Kvroute(None) => "kvroute".into(),
            Router::Kvroute(Some(p)) => format!("kvroute:{p}"),
            Router::KvroutePrecise => "kvroute-precise".into(),
            Router::KvrouteEpp(None) => "kvroute-epp".into(),
            Router::KvrouteEpp(Some(p)) => format!("kvroute-epp:{p}"),
            Router::KvrouteB(_) => "kvroute-b".into(),
            Router::Smg => "smg".into(),
            Router::Vllm(p) => format!("vllm-router:{p}"),
            Router::Oracle => "oracle".into(),
            Router::Scaled(inner, n) => format!("{}@{n}", inner.name()),
        }
    }

    /// Whether this router runs kvroute in precise mode (its fleet must tokenize with a tokenizer
    /// file, and every indexer hear every replica before the run).
    pub fn is_precise(&self) -> bool {
        match self {
            Router::KvroutePrecise => true,
            Router::Scaled(inner, _) => inner.is_precise(),
            _ => false,
        }
    }

    /// Starts this router in front of `fleet`, its Envoys (if any) with `workers` worker
    /// threads. An `Err` is the reason to report it as skipped.
    pub async fn start(
        &self,
        fleet: &SimFleet,
        fleet_spec: &Value,
        workers: u32,
    ) -> Result<Running, String> {
        let Router::Scaled(inner, n) = self else {
            return self.start_one(fleet, fleet_spec, workers).await;
        };
        let mut instances = Vec::new();
        for _ in 0..*n {
            instances.push(inner.start_one(fleet, fleet_spec, workers).await?);
        }
        let backends = instances
            .iter()
            .map(|r| addr_of(&r.url))
            .collect::<Result<Vec<_>, _>>()?;
        // Active health checks off: each probe would be a request every instance handles (and
        // kvroute counts as a fallback); every instance already served or passed its own checks.
        let front = Envoy::start(EnvoyOptions {
            backends,
            lb: Lb::RoundRobin,
            concurrency: workers,
            active_health_checks: false,
            // Which instance served each request: how far the instances agree.
            name_upstream: true,
            ..EnvoyOptions::default()
        })
        .await
        .map_err(|e| format!("front Envoy: {e}"))?;
        Ok(Running {
            url: front.url(),
            process: Process::Scaled { front, instances },
        })
    }

    /// Starts one instance of a router that is not `NAME@N`.
    async fn start_one(
        &self,
        fleet: &SimFleet,
        fleet_spec: &Value,
        workers: u32,
    ) -> Result<Running, String> {
        let envoy = |lb: Lb, kvroute_wasm: Option<PathBuf>| async move {
            let backends = fleet
                .replicas
                .iter()
                .map(|r| addr_of(&r.url))
                .collect::<Result<Vec<_>, _>>()?;
            let opts = EnvoyOptions {
                backends,
                lb,
                concurrency: workers,
                kvroute_wasm,
                ..EnvoyOptions::default()
            };
            let envoy = Envoy::start(opts).await.map_err(|e| e.to_string())?;
            Ok::<_, String>(Running {
                url: envoy.url(),
                process: Process::Envoy(envoy),
            })
        };
        match self {
            Router::RoundRobin => envoy(Lb::RoundRobin, None).await,
            Router::LeastRequest => envoy(Lb::LeastRequest, None).await,
            Router::RingHash => {
                let header = SESSION_HEADER.into();
                envoy(Lb::RingHash { header }, None).await
            }
            Router::Kvroute(policy) => envoy(kvroute_lb(policy.as_deref()), None).await,
            Router::KvrouteB(wasm) => envoy(kvroute_lb(None), Some(wasm.clone())).await,
            Router::KvrouteEpp(policy) => {
                let backends = fleet
                    .replicas
                    .iter()
                    .map(|r| addr_of(&r.url))
                    .collect::<Result<Vec<_>, _>>()?;
                let config = epp::plugin_config(&kvroute_overrides(policy.as_deref()))?;
                let gateway = epp::Gateway::start(&backends, workers, &config).await?;
                Ok(Running {
                    url: gateway.envoy.url(),
                    process: Process::Epp(Box::new(gateway)),
                })
            }
            Router::KvroutePrecise => {
                let indexer = Indexer::start(fleet, fleet_spec).await?;
                let backends = fleet
                    .replicas
                    .iter()
                    .map(|r| addr_of(&r.url))
                    .collect::<Result<Vec<_>, _>>()?;
                let envoy = Envoy::start(EnvoyOptions {
                    backends,
                    lb: Lb::Kvroute {
                        plugin_config: precise::plugin_config(),
                    },
                    concurrency: workers,
                    indexer: Some(indexer.addr),
                    ..EnvoyOptions::default()
                })
                .await
                .map_err(|e| e.to_string())?;
                Ok(Running {
                    url: envoy.url(),
                    process: Process::Precise {
                        envoy,
                        indexer: Box::new(indexer),
                    },
                })
            }
            Router::Smg => peer(peers::start_smg(fleet).await),
            Router::Vllm(policy) => peer(peers::start_vllm_router(policy, fleet, fleet_spec).await),
            Router::Oracle if fleet.is_real() => Err(
                "the oracle reads the simulator's caches; real engines show theirs to no one"
                    .into(),
            ),
            Router::Oracle => {
                let oracle = Oracle::start(fleet.control_client(), fleet.replicas.clone()).await?;
                Ok(Running {
                    url: oracle.url.clone(),
                    process: Process::Oracle(oracle),
                })
            }
            Router::Scaled(..) => Err(format!("{}: only one @N per router", self.name())),
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
    /// kvroute-epp and the Envoy that asks it.
    Epp(Box<epp::Gateway>),
    /// kvroute in precise mode and its own indexer.
    Precise {
        envoy: Envoy,
        indexer: Box<Indexer>,
    },
    /// `NAME@N`: the round-robin front Envoy and the instances behind it.
    Scaled {
        front: Envoy,
        instances: Vec<Running>,
    },
}

/// kvroute with the shipped plugin config and [`kvroute_overrides`] laid over it.
fn kvroute_lb(policy: Option<&str>) -> Lb {
    let plugin_config = kvroute_overrides(policy);
    Lb::Kvroute { plugin_config }
}

/// What kvroute's routers lay over the shipped plugin config: `policy` when given, and the
/// decision header on, which lets each sample say why it went where it went.
fn kvroute_overrides(policy: Option<&str>) -> Value {
    match policy {
        Some(p) => json!({ "policy": p, "debug_header": true }),
        None => json!({ "debug_header": true }),
    }
}

/// Where a router runs kvroute's core: the filter in an Envoy, or a kvroute-epp process.
enum Core<'a> {
    Filter(&'a Envoy),
    Picker(&'a epp::Picker),
}

impl Core<'_> {
    /// kvroute's stats, each named as the Prometheus text names it (`kvroute_routed_home`): the
    /// filter's Envoy stat names from `kvroute.` on, dots as underscores; the picker's as it
    /// serves them. Empty when they cannot be read.
    async fn stats(&self) -> Vec<(String, u64)> {
        match self {
            Core::Filter(envoy) => {
                let all = kvroute_stats::all();
                let stats = envoy.stats(all).await.unwrap_or_default();
                stats
                    .into_iter()
                    .filter_map(|(name, v)| {
                        let own = &name[name.find(all)?..];
                        Some((kvroute_stats::prometheus(own), v))
                    })
                    .collect()
            }
            Core::Picker(picker) => picker.stats().await.unwrap_or_default(),
        }
    }
}

impl Running {
    /// Waits until kvroute's Envoys have written what they counted of the `sent` requests just
    /// sent (each worker writes its counters on its tick): until their decisions add up to at
    /// least `sent`, for [`KVROUTE_FLUSH`] at most. Nothing to wait for with another router or
    /// a plain Envoy.
    pub async fn settle_counters(&self, sent: u64) {
        let deadline = tokio::time::Instant::now() + KVROUTE_FLUSH;
        loop {
            let decisions = self.kvroute_decisions().await;
            // kvroute defines its decision counters at start: none, and no Envoy here runs it.
            let decided: u64 = decisions.iter().map(|(_, n)| n).sum();
            if decisions.is_empty() || decided >= sent || tokio::time::Instant::now() > deadline {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }

    /// The Envoys that may run kvroute: this router's own (a baseline's runs none), or for
    /// `kvroute@N` the N behind the front; none for the peers and the oracle.
    fn kvroute_envoys(&self) -> Vec<&Envoy> {
        match &self.process {
            Process::Envoy(envoy) | Process::Precise { envoy, .. } => vec![envoy],
            Process::Scaled { instances, .. } => instances
                .iter()
                .filter_map(|r| match &r.process {
                    Process::Envoy(envoy) | Process::Precise { envoy, .. } => Some(envoy),
                    _ => None,
                })
                .collect(),
            _ => Vec::new(),
        }
    }

    /// Waits until each of kvroute's Envoys has applied `n` more of its indexer's answers (each
    /// worker's poll), for 30 s at most: what the indexers hold now is what kvroute routes by.
    pub async fn wait_index_polls(&self, n: u64) {
        for envoy in self.kvroute_envoys() {
            let poll_ok = Counter::IndexPollOk.name();
            let before = envoy.stat(poll_ok).await.ok().flatten();
            let before = before.unwrap_or(0);
            let applied = |v: u64| v >= before + n;
            let wait = std::time::Duration::from_secs(30);
            let _ = envoy.wait_for_stat(poll_ok, applied, wait).await;
        }
    }

    /// The indexers of a precise router: its own, or for `kvroute-precise@N` each instance's.
    pub fn indexers(&self) -> Vec<&Indexer> {
        match &self.process {
            Process::Precise { indexer, .. } => vec![&**indexer],
            Process::Scaled { instances, .. } => {
                instances.iter().flat_map(Running::indexers).collect()
            }
            _ => Vec::new(),
        }
    }

    /// Where this router runs kvroute's core: each of its Envoys' filter and kvroute-epp
    /// processes, its own or for `NAME@N` the N behind the front. None for the peers and the
    /// oracle; a baseline's Envoys run no filter, and show no kvroute stats.
    fn kvroute_cores(&self) -> Vec<Core<'_>> {
        match &self.process {
            Process::Envoy(envoy) | Process::Precise { envoy, .. } => vec![Core::Filter(envoy)],
            Process::Epp(gateway) => vec![Core::Picker(&gateway.picker)],
            Process::Scaled { instances, .. } => {
                instances.iter().flat_map(Running::kvroute_cores).collect()
            }
            _ => Vec::new(),
        }
    }

    /// kvroute's stats so far, summed over its cores, by their Prometheus names.
    async fn kvroute_stats(&self) -> BTreeMap<String, u64> {
        let mut sum = BTreeMap::new();
        for core in self.kvroute_cores() {
            for (name, v) in core.stats().await {
                *sum.entry(name).or_insert(0) += v;
            }
        }
        sum
    }

    /// kvroute's engine-reported usage so far, `(cached_tokens, prompt_tokens)` from its stats,
    /// summed over its cores; `None` for other routers.
    pub async fn kvroute_usage(&self) -> Option<(u64, u64)> {
        let stats = self.kvroute_stats().await;
        let named = |c: Counter| stats.get(&kvroute_stats::prometheus(c.name())).copied();
        let cached = named(Counter::UsageCachedTokens)?;
        let prompt = named(Counter::UsagePromptTokens);
        Some((cached, prompt.unwrap_or(0)))
    }

    /// kvroute's routing decisions so far (`kvroute.routed.<decision>` counters), and the
    /// fallbacks that happened (requests kvroute left to Envoy, `fallback:<reason>`), if it is
    /// kvroute; for `NAME@N` summed over the N instances.
    pub async fn kvroute_decisions(&self) -> Vec<(String, u64)> {
        let stats = self.kvroute_stats().await;
        let routed = kvroute_stats::prometheus(kvroute_stats::routed());
        let fallback = kvroute_stats::prometheus(kvroute_stats::fallback());
        stats
            .into_iter()
            .filter_map(|(name, v)| {
                if let Some(decision) = name.strip_prefix(&routed) {
                    Some((decision.to_string(), v))
                } else {
                    let reason = name.strip_prefix(&fallback)?;
                    (v > 0).then(|| (format!("fallback:{reason}"), v))
                }
            })
            .collect::<BTreeMap<_, _>>()
            .into_iter()
            .collect()
    }

    /// The `counters` of kvroute, summed over kvroute's cores, each named by the last segment of
    /// its name; empty if this is not kvroute (kvroute defines them at zero on start).
    pub async fn kvroute_counters(&self, counters: &[Counter]) -> Vec<(String, u64)> {
        let stats = self.kvroute_stats().await;
        let names: Vec<&str> = counters.iter().map(|c| c.name()).collect();
        let found: Vec<Option<u64>> = names
            .iter()
            .map(|n| stats.get(&kvroute_stats::prometheus(n)).copied())
            .collect();
        if found.iter().all(Option::is_none) {
            return Vec::new();
        }
        names
            .iter()
            .zip(found)
            .map(|(n, v)| {
                (
                    n.rsplit('.').next().unwrap_or(n).to_string(),
                    v.unwrap_or(0),
                )
            })
            .collect()
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
        let names = "round_robin,least_request,ring_hash,kvroute,kvroute:prefix_hash,kvroute-precise,kvroute-epp,kvroute-epp:prefix_hash,smg,vllm-router:kv_aware,oracle";
        let parsed = Router::parse_list(names, None).unwrap();
        let back: Vec<String> = parsed.iter().map(Router::name).collect();
        assert_eq!(back.join(","), names);
    }

    #[test]
    fn unknown_router_is_an_error() {
        assert!(Router::parse("nginx", None).is_err());
        assert!(Router::parse("vllm-router", None).is_err());
        assert!(
            Router::parse("kvroute-b", None).is_err(),
            "kvroute-b without --compare-wasm"
        );
        let b = Router::parse("kvroute-b@3", Some(Path::new("other.wasm"))).unwrap();
        assert_eq!(b.name(), "kvroute-b@3");
        assert_eq!(
            b,
            Router::Scaled(Box::new(Router::KvrouteB("other.wasm".into())), 3)
        );
    }

    #[test]
    fn scaled_router_names_round_trip() {
        let names = "kvroute@3,smg@3,vllm-router:cache_aware@2,kvroute:prefix_hash@1,round_robin@4,oracle@2,kvroute-precise@8,kvroute-epp@3";
        let parsed = Router::parse_list(names, None).unwrap();
        assert_eq!(
            parsed[0],
            Router::Scaled(Box::new(Router::Kvroute(None)), 3)
        );
        assert_eq!(
            parsed[2],
            Router::Scaled(Box::new(Router::Vllm("cache_aware".into())), 2)
        );
        assert_eq!(
            parsed[7],
            Router::Scaled(Box::new(Router::KvrouteEpp(None)), 3)
        );
        let back: Vec<String> = parsed.iter().map(Router::name).collect();
        assert_eq!(back.join(","), names);
    }

    #[test]
    fn bad_instance_counts_and_nesting_are_errors() {
        for bad in [
            "kvroute@0",
            "kvroute@",
            "kvroute@x",
            "kvroute@-1",
            "kvroute@9",
            "@3",
            "nginx@2",
            "vllm-router@2",
            "kvroute@2@3",
            "kvroute-precise@9",
            "kvroute-precise:x",
            "kvroute-precise@3@2",
            "kvroute-epp@9",
            "kvroute-epp@3@2",
        ] {
            assert!(Router::parse(bad, None).is_err(), "{bad} parsed");
        }
    }
}
