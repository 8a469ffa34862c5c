//! One Envoy process started from the patched shipped bootstrap, killed when dropped.

use crate::{bootstrap, paths, HarnessError};
use serde_json::Value as Json;
use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::process::{Child, Command};

/// How the `inference_pool` cluster picks a replica.
#[derive(Clone, Debug)]
pub enum Lb {
    /// The shipped setup: the kvroute filter plus the `override_host` policy. `plugin_config`'s
    /// top-level keys are laid over the shipped plugin config (`null` removes a key).
    Kvroute { plugin_config: Json },
    /// No filter; Envoy's `round_robin` policy.
    RoundRobin,
    /// No filter; Envoy's `least_request` policy.
    LeastRequest,
    /// No filter; Envoy's `ring_hash` policy, hashing request header `header`.
    RingHash { header: String },
    /// The floor for kvroute's overhead: `round_robin` behind the floor filter
    /// (`tools/floor-filter`), which pauses for each request body and reads it, nothing else.
    Floor,
    /// The floor filter with `plugin_config` (its opt-in `header_values`: it also writes the
    /// routing header) in front of the shipped `override_host` policy, as kvroute has it.
    FloorHeader { plugin_config: Json },
}

/// What to start. Build with struct-update syntax over [`EnvoyOptions::default`].
#[derive(Clone, Debug)]
pub struct EnvoyOptions {
    /// Members of `inference_pool`, in order.
    pub backends: Vec<SocketAddr>,
    pub lb: Lb,
    /// Envoy worker threads (`--concurrency`); each has its own kvroute VM.
    pub concurrency: u32,
    /// Replaces the shipped 1 s active health-check interval (tests of failover want it faster).
    pub health_check_interval: Option<Duration>,
    /// Keep the shipped active health checks on the pool. A front Envoy over other proxies turns
    /// them off: each probe would be a request those proxies handle (and count).
    pub active_health_checks: bool,
    /// Wait in [`Envoy::start`] until every backend passed its health check.
    pub wait_healthy: bool,
    /// How long [`Envoy::start`] waits for readiness before failing with the log tail.
    pub ready_timeout: Duration,
    /// Envoy's `--log-level`.
    pub log_level: String,
    /// Load kvroute the way Istio's `WasmPlugin` does: without `allow_on_headers_stop_iteration`
    /// (which it has no field for), without a `vm_id`, named `<namespace>.<name>`.
    pub wasm_plugin_like: bool,
    /// Where the `kvroute_admin` cluster points instead of Envoy's own admin: a fake admin, or a
    /// [`Gate`](crate::gate::Gate) that forwards to [`Envoy::admin_url`] until told to fail.
    pub admin_target: Option<SocketAddr>,
    /// Where the `kvroute_indexer` cluster points: a kvroute-indexer (precise mode, with the
    /// plugin config's `index_cluster`).
    pub indexer: Option<SocketAddr>,
    /// Name the upstream that answered each request in a response header
    /// ([`bootstrap::UPSTREAM_HEADER`]): a front over router instances says which one served it.
    pub name_upstream: bool,
    /// Another build of the filter to load instead of [`paths::kvroute_wasm`]'s (two builds
    /// measured side by side).
    pub kvroute_wasm: Option<PathBuf>,
    /// A command Envoy runs under, with its arguments (valgrind counting instructions, say);
    /// empty: Envoy runs itself.
    pub run_under: Vec<String>,
    /// Another shipped bootstrap to start from instead of [`paths::shipped_bootstrap`]'s
    /// (`envoy/kvroute-precise.yaml`: [`paths::precise_bootstrap`]), patched alike.
    pub bootstrap: Option<PathBuf>,
}

impl Default for EnvoyOptions {
    fn default() -> Self {
        EnvoyOptions {
            backends: Vec::new(),
            lb: Lb::Kvroute {
                plugin_config: Json::Object(Default::default()),
            },
            concurrency: 2,
            health_check_interval: None,
            active_health_checks: true,
            wait_healthy: true,
            ready_timeout: Duration::from_secs(60),
            log_level: "warn".into(),
            wasm_plugin_like: false,
            admin_target: None,
            indexer: None,
            name_upstream: false,
            kvroute_wasm: None,
            run_under: Vec::new(),
            bootstrap: None,
        }
    }
}

/// A running Envoy. Its files live in a temp dir (removed on drop unless `KVROUTE_HARNESS_KEEP`
/// is set); its stderr goes to `envoy.log` there, which [`Envoy::log_tail`] reads.
pub struct Envoy {
    child: Child,
    dir: PathBuf,
    admin_port: u16,
    listener_port: u16,
    client: reqwest::Client,
}

impl Envoy {
    /// Renders the bootstrap, starts Envoy and waits until it is ready: admin `/ready` answers 200,
    /// the listener accepts, and (with `wait_healthy`) every pool host is healthy.
    pub async fn start(opts: EnvoyOptions) -> Result<Envoy, HarnessError> {
        let envoy_bin = paths::envoy_bin()?;
        let wasm = match opts.lb {
            Lb::Kvroute { .. } => match &opts.kvroute_wasm {
                Some(path) => Some(path.clone()),
                None => Some(paths::kvroute_wasm()?),
            },
            Lb::Floor | Lb::FloorHeader { .. } => Some(paths::floor_wasm()?),
            _ => None,
        };
        let shipped = opts
            .bootstrap
            .clone()
            .unwrap_or_else(paths::shipped_bootstrap);
        let shipped = std::fs::read_to_string(shipped)?;
        let render = |admin_port, listener_port, _: &std::path::Path| {
            bootstrap::render(
                &shipped,
                &bootstrap::Patch {
                    admin_port,
                    listener_port,
                    backends: &opts.backends,
                    lb: &opts.lb,
                    wasm: wasm.as_deref(),
                    health_check_interval: opts.health_check_interval,
                    active_health_checks: opts.active_health_checks,
                    wasm_plugin_like: opts.wasm_plugin_like,
                    admin_target: opts.admin_target,
                    indexer: opts.indexer,
                    name_upstream: opts.name_upstream,
                },
            )
        };
        Envoy::launch(&envoy_bin, render, &opts).await
    }

    /// Starts Envoy from a bootstrap the caller builds: `bootstrap(admin_port, listener_port, dir)`
    /// returns the YAML and may write files it refers to into `dir` (Envoy's temp dir). With
    /// `wait_healthy`, waits for `opts.backends` in the `inference_pool` cluster, as [`Envoy::start`].
    pub async fn start_with(
        bootstrap: impl FnMut(u16, u16, &std::path::Path) -> Result<String, HarnessError>,
        opts: EnvoyOptions,
    ) -> Result<Envoy, HarnessError> {
        let envoy_bin = paths::envoy_bin()?;
        Envoy::launch(&envoy_bin, bootstrap, &opts).await
    }

    /// Picks two free ports, renders the bootstrap for them and starts Envoy. A port is free only
    /// until Envoy binds it, and a parallel test may take it first: when Envoy exits because an
    /// address is in use, it starts again on fresh ports (a few times), so that race never fails
    /// a test.
    async fn launch(
        envoy_bin: &std::path::Path,
        mut bootstrap: impl FnMut(u16, u16, &std::path::Path) -> Result<String, HarnessError>,
        opts: &EnvoyOptions,
    ) -> Result<Envoy, HarnessError> {
        const ATTEMPTS: usize = 5;
        let mut attempt = 1;
        loop {
            let ports @ [admin_port, listener_port] = free_ports()?;
            let dir = temp_dir()?;
            let yaml = bootstrap(admin_port, listener_port, &dir)?;
            match Envoy::spawn(envoy_bin, yaml, ports, dir.clone(), opts).await {
                Err(HarnessError::Envoy { log_tail, .. })
                    if attempt < ATTEMPTS && log_tail.contains("Address already in use") =>
                {
                    attempt += 1;
                    let _ = std::fs::remove_dir_all(&dir);
                }
                started => return started,
            }
        }
    }

    async fn spawn(
        envoy_bin: &std::path::Path,
        yaml: String,
        [admin_port, listener_port]: [u16; 2],
        dir: PathBuf,
        opts: &EnvoyOptions,
    ) -> Result<Envoy, HarnessError> {
        let config = dir.join("envoy.yaml");
        std::fs::write(&config, yaml)?;
        let log = std::fs::File::create(dir.join("envoy.log"))?;
        let mut command = match opts.run_under.split_first() {
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(envoy_bin);
                c
            }
            None => Command::new(envoy_bin),
        };
        let child = command
            .arg("-c")
            .arg(&config)
            .args(["--concurrency", &opts.concurrency.to_string()])
            .args(["--use-dynamic-base-id", "--log-level", &opts.log_level])
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true)
            .spawn()?;
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()?;
        let mut envoy = Envoy {
            child,
            dir,
            admin_port,
            listener_port,
            client,
        };
        envoy.wait_ready(opts).await?;
        Ok(envoy)
    }

    /// Base URL of the listener, e.g. `http://127.0.0.1:40123`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.listener_port)
    }

    /// Address of the admin interface.
    pub fn admin_addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.admin_port))
    }

    /// Base URL of the admin interface.
    pub fn admin_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.admin_port)
    }

    /// The Envoy process's id (also that of the command it runs under: valgrind runs it in its
    /// own process).
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// CPU time (user + system) the Envoy process has used so far, from `/proc` (Linux only).
    pub fn cpu_time(&self) -> Option<Duration> {
        crate::cpu::time_of(self.child.id()?)
    }

    /// Counters and gauges whose name contains `filter`, by full name (e.g. custom wasm stats
    /// appear as `wasmcustom.kvroute.routed.affinity`).
    pub async fn stats(&self, filter: &str) -> Result<HashMap<String, u64>, HarnessError> {
        let body: Json = self.admin_json("/stats?format=json").await?;
        let stats = body["stats"].as_array().cloned().unwrap_or_default();
        Ok(stats
            .iter()
            .filter_map(|s| Some((s["name"].as_str()?, s["value"].as_u64()?)))
            .filter(|(name, _)| name.contains(filter))
            .map(|(name, v)| (name.to_string(), v))
            .collect())
    }

    /// The value of the one counter or gauge whose name ends with `suffix`, if any.
    pub async fn stat(&self, suffix: &str) -> Result<Option<u64>, HarnessError> {
        let stats = self.stats(suffix).await?;
        Ok(stats
            .into_iter()
            .find(|(n, _)| n.ends_with(suffix))
            .map(|(_, v)| v))
    }

    /// Polls [`Envoy::stat`] until `ok` holds for it, or fails after `timeout` with the log tail.
    pub async fn wait_for_stat(
        &self,
        suffix: &str,
        ok: impl Fn(u64) -> bool,
        timeout: Duration,
    ) -> Result<u64, HarnessError> {
        let deadline = Instant::now() + timeout;
        loop {
            let value = self.stat(suffix).await?;
            match value {
                Some(v) if ok(v) => return Ok(v),
                _ if Instant::now() > deadline => {
                    return Err(self.failure(format!(
                        "stat `{suffix}` stayed at {value:?} for {timeout:?}"
                    )));
                }
                _ => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }

    /// Whether Envoy considers each `inference_pool` host healthy (active health check passed,
    /// not ejected by outlier detection).
    pub async fn pool_health(&self) -> Result<HashMap<SocketAddr, bool>, HarnessError> {
        let body = self.admin_json("/clusters?format=json").await?;
        let clusters = body["cluster_statuses"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let pool = clusters
            .iter()
            .find(|c| c["name"] == bootstrap::POOL_CLUSTER);
        let hosts = pool
            .and_then(|p| p["host_statuses"].as_array().cloned())
            .unwrap_or_default();
        Ok(hosts
            .iter()
            .filter_map(|h| {
                let sa = &h["address"]["socket_address"];
                let addr = format!("{}:{}", sa["address"].as_str()?, sa["port_value"].as_u64()?);
                Some((addr.parse().ok()?, is_healthy(&h["health_status"])))
            })
            .collect())
    }

    /// Polls [`Envoy::pool_health`] until `ok` holds, or fails after `timeout` with the log tail.
    pub async fn wait_for_pool(
        &self,
        ok: impl Fn(&HashMap<SocketAddr, bool>) -> bool,
        timeout: Duration,
    ) -> Result<(), HarnessError> {
        let deadline = Instant::now() + timeout;
        loop {
            let health = self.pool_health().await?;
            if ok(&health) {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(self.failure(format!("pool health stayed {health:?} for {timeout:?}")));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Everything Envoy has written so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("envoy.log")).unwrap_or_default()
    }

    /// The last 60 lines Envoy wrote, for failure messages.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(self.dir.join("envoy.log")).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(60)..].join("\n")
    }

    /// An error carrying `what` and the log tail.
    pub fn failure(&self, what: String) -> HarnessError {
        HarnessError::Envoy {
            what,
            log_tail: self.log_tail(),
        }
    }

    async fn admin_json(&self, path: &str) -> Result<Json, HarnessError> {
        let resp = self
            .client
            .get(format!("{}{path}", self.admin_url()))
            .send()
            .await?;
        Ok(resp.error_for_status()?.json().await?)
    }

    async fn wait_ready(&mut self, opts: &EnvoyOptions) -> Result<(), HarnessError> {
        let deadline = Instant::now() + opts.ready_timeout;
        let mut stage = "admin /ready";
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Err(self.failure(format!("exited with {status} while waiting for {stage}")));
            }
            if Instant::now() > deadline {
                return Err(self.failure(format!(
                    "not ready after {:?} (waiting for {stage})",
                    opts.ready_timeout
                )));
            }
            let done = match stage {
                "admin /ready" => {
                    let url = format!("{}/ready", self.admin_url());
                    let ok = self
                        .client
                        .get(url)
                        .send()
                        .await
                        .is_ok_and(|r| r.status() == 200);
                    ok.then_some("listener")
                }
                "listener" => {
                    let ok = tokio::net::TcpStream::connect(("127.0.0.1", self.listener_port))
                        .await
                        .is_ok();
                    ok.then_some("healthy pool hosts")
                }
                _ => {
                    if !opts.wait_healthy || opts.backends.is_empty() {
                        return Ok(());
                    }
                    let health = self.pool_health().await.unwrap_or_default();
                    if health.len() == opts.backends.len() && health.values().all(|h| *h) {
                        return Ok(());
                    }
                    None
                }
            };
            match done {
                Some(next) => stage = next,
                None => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
        if std::env::var_os("KVROUTE_HARNESS_KEEP").is_none() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// Healthy means EDS says so and no `failed_*` flag (active check, outlier ejection) is set.
fn is_healthy(status: &Json) -> bool {
    let flags_clear = status
        .as_object()
        .map(|o| {
            o.iter()
                .all(|(k, v)| !k.starts_with("failed") || v != &Json::Bool(true))
        })
        .unwrap_or(false);
    flags_clear && status["eds_health_status"] == "HEALTHY"
}

/// Ports that were free a moment ago (both held at once so they differ). Whoever binds them
/// next may lose them to another process first; [`Envoy::launch`] retries when that happens.
pub(crate) fn free_ports() -> std::io::Result<[u16; 2]> {
    let a = TcpListener::bind("127.0.0.1:0")?;
    let b = TcpListener::bind("127.0.0.1:0")?;
    Ok([a.local_addr()?.port(), b.local_addr()?.port()])
}

fn temp_dir() -> std::io::Result<PathBuf> {
    static N: AtomicU64 = AtomicU64::new(0);
    let name = format!(
        "kvroute-harness-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    );
    let dir = std::env::temp_dir().join(name);
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}
