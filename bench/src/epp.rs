//! kvroute-epp in the bench: the endpoint picker as a process of its own (`$KVROUTE_EPP`), behind
//! an Envoy from the shipped `envoy/kvroute-epp.yaml` that asks it over ext_proc.
//!
//! It runs with the plugin config the `kvroute` router's filter gets, as many gateways
//! (`--workers`) as that filter has VMs (one per Envoy worker), and `--envoy-admin` at its own
//! Envoy's admin: it polls the pool, its health checks and each host's active requests there, as
//! the filter polls its Envoy's. With `--endpoints` it would see every host healthy and no request
//! active but its own, and its in-flight correction (which lowers counts that stay above Envoy's
//! `rq_active`) would take its own requests for leaks: the two would not decide on the same inputs.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use kvroute::gateway::stat_names::Counter;
use kvroute_harness::epp::Shape;
use kvroute_harness::{bootstrap, paths, Envoy, EnvoyOptions};
use serde_json::Value;
use tokio::process::{Child, Command};

use crate::kvroute_stats;
use crate::sim_process::{spawn_logging, TempFile};

/// How long the picker may take to serve, then to have polled its Envoy's admin once.
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// Starts tried when the port reserved for the picker was taken before it bound it.
const ATTEMPTS: usize = 5;
/// What the picker says when its `--listen` address is taken.
const LISTEN_FAILED: &str = "cannot listen on --listen";

/// The picker binary: `$KVROUTE_EPP`, else `target/release/kvroute-epp` under the workspace root.
pub fn epp_binary() -> PathBuf {
    std::env::var_os("KVROUTE_EPP")
        .map(PathBuf::from)
        .unwrap_or_else(|| crate::paths::workspace_root().join("target/release/kvroute-epp"))
}

/// The filter's plugin config as `envoy/kvroute.yaml` ships it, `overrides`' top-level keys laid
/// over it (JSON text): what the harness gives the filter for the same overrides.
pub fn plugin_config(overrides: &Value) -> Result<String, String> {
    let path = paths::shipped_bootstrap();
    let shipped = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let shipped = bootstrap::shipped_plugin_config(&shipped).map_err(|e| e.to_string())?;
    bootstrap::merge_plugin_config(&shipped, overrides).map_err(|e| e.to_string())
}

/// An Envoy asking a kvroute-epp of its own; both stop when dropped.
pub struct Gateway {
    pub envoy: Envoy,
    pub picker: Picker,
}

impl Gateway {
    /// Envoy over `backends` with `workers` worker threads, and its picker with as many workers
    /// and `config` (the plugin config, JSON text); ready once the picker has polled the Envoy.
    pub async fn start(
        backends: &[SocketAddr],
        workers: u32,
        config: &str,
    ) -> Result<Gateway, String> {
        let mut attempt = 1;
        loop {
            // Envoy must know the picker's address and the picker Envoy's admin: the picker's
            // port is reserved first, and taken again if something else bound it meanwhile.
            let listen = free_addr()?;
            let opts = EnvoyOptions {
                backends: backends.to_vec(),
                concurrency: workers,
                ..EnvoyOptions::default()
            };
            let envoy = kvroute_harness::epp::start(listen, Shape::default(), opts)
                .await
                .map_err(|e| format!("Envoy: {e}"))?;
            match Picker::start(listen, envoy.admin_addr(), workers, config).await {
                Ok(picker) => return Ok(Gateway { envoy, picker }),
                Err(e) if e.contains(LISTEN_FAILED) && attempt < ATTEMPTS => attempt += 1,
                Err(e) => return Err(e),
            }
        }
    }

    /// CPU time of the Envoy and the picker together so far.
    pub fn cpu_time(&self) -> Option<Duration> {
        Some(self.envoy.cpu_time()? + self.picker.cpu_time()?)
    }
}

/// A kvroute-epp process, killed when dropped.
pub struct Picker {
    /// Where it serves `/metrics`.
    pub metrics: SocketAddr,
    child: Child,
    http: reqwest::Client,
    _config: TempFile,
}

impl Picker {
    /// Starts the picker on `listen`, polling the Envoy admin at `admin`, and waits until it has.
    async fn start(
        listen: SocketAddr,
        admin: SocketAddr,
        workers: u32,
        config: &str,
    ) -> Result<Picker, String> {
        let bin = epp_binary();
        if !bin.exists() {
            return Err(format!(
                "kvroute-epp not found at {} (run make epp)",
                bin.display()
            ));
        }
        let file = TempFile::write("epp-config.json", config)?;
        let mut cmd = Command::new(&bin);
        cmd.args(["--listen", &listen.to_string(), "--metrics", "127.0.0.1:0"])
            .args(["--envoy-admin", &admin.to_string()])
            .args(["--workers", &workers.to_string(), "--config"])
            .arg(&file.0)
            // The line that names the metrics address is an INFO one.
            .env("RUST_LOG", "info");
        let (child, mut lines) = spawn_logging(&mut cmd, &bin)?;
        let metrics = tokio::time::timeout(START_TIMEOUT, async {
            let mut said = Vec::new();
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(at) = line.split("stats on http://").nth(1) {
                    let at = at.trim().trim_end_matches("/metrics");
                    return at.parse::<SocketAddr>().map_err(|e| format!("{at}: {e}"));
                }
                said.push(line);
            }
            Err(format!(
                "kvroute-epp exited before it served: {}",
                said.join(" / ")
            ))
        })
        .await
        .map_err(|_| format!("kvroute-epp did not serve within {START_TIMEOUT:?}"))??;
        // Keep draining (and showing all but its INFO lines: `[INFO  target] ...`, or with a
        // timestamp first) so it never blocks on a full pipe.
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                let mut words = line.split_whitespace().take(2);
                if !words.any(|w| w.trim_start_matches('[') == "INFO") {
                    eprintln!("   kvroute-epp: {line}");
                }
            }
        });
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(5))
            .build()
            .map_err(|e| e.to_string())?;
        let mut picker = Picker {
            metrics,
            child,
            http,
            _config: file,
        };
        picker.wait_polled().await?;
        Ok(picker)
    }

    /// Waits until the picker has read its Envoy's admin once: it knows the pool.
    async fn wait_polled(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!("kvroute-epp exited with {status}"));
            }
            let stats = self.stats().await.unwrap_or_default();
            let polled = kvroute_stats::prometheus(Counter::StatsPollOk.name());
            if stats.iter().any(|(n, v)| *n == polled && *v > 0) {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "kvroute-epp did not poll its Envoy's admin within {START_TIMEOUT:?}"
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Its stats as it serves them on `/metrics` (label-free Prometheus text: `name value`
    /// lines), those with a value of 0 or more.
    pub async fn stats(&self) -> Result<Vec<(String, u64)>, String> {
        let url = format!("http://{}/metrics", self.metrics);
        let answer = self.http.get(&url).send().await;
        let text = answer
            .and_then(|r| r.error_for_status())
            .map_err(|e| format!("{url}: {e}"))?
            .text()
            .await
            .map_err(|e| format!("{url}: {e}"))?;
        Ok(text
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| {
                let (name, value) = l.split_once(' ')?;
                let value: f64 = value.trim().parse().ok()?;
                (value >= 0.0).then(|| (name.to_string(), value as u64))
            })
            .collect())
    }

    /// CPU time the picker has used so far.
    pub fn cpu_time(&self) -> Option<Duration> {
        kvroute_harness::cpu::time_of(self.child.id()?)
    }
}

/// An address of 127.0.0.1 that was free a moment ago.
fn free_addr() -> Result<SocketAddr, String> {
    let listener =
        std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| format!("free port: {e}"))?;
    listener.local_addr().map_err(|e| format!("free port: {e}"))
}
