//! Starts a fresh kvroute-sim fleet as a child process and talks to its control API (or stands
//! for real engines, [`crate::real_fleet`], in the same role).

use crate::real_fleet::RealFleet;
use serde::Deserialize;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStderr, Command};

/// How long the sim may take to print its ready line.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// One replica as the sim announces it.
#[derive(Debug, Clone, Deserialize)]
pub struct Replica {
    pub id: usize,
    pub url: String,
    pub kv_events: Option<String>,
    /// Its replay socket (vLLM's `replay_endpoint`), if it has one.
    pub kv_events_replay: Option<String>,
    /// The engine it plays (`vllm` or `sglang`; none from a fleet that does not say).
    #[serde(default)]
    pub engine_kind: Option<String>,
}

#[derive(Debug, Deserialize)]
struct Ready {
    replicas: Vec<Replica>,
    control: String,
}

/// A replica's counters from `GET /fleet/state`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct ReplicaState {
    pub id: usize,
    pub running: u64,
    pub waiting: u64,
    pub kv_usage: f64,
    pub prefix_queries_tokens: u64,
    pub prefix_hits_tokens: u64,
    pub requests: u64,
    pub healthy: bool,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct FleetState {
    pub replicas: Vec<ReplicaState>,
}

impl FleetState {
    /// How much counter `f` grew on each replica since `before` (replicas in `self`'s order).
    pub fn growth_since(&self, before: &FleetState, f: fn(&ReplicaState) -> u64) -> Vec<u64> {
        self.replicas
            .iter()
            .map(|a| {
                let b = before.replicas.iter().find(|b| b.id == a.id).map_or(0, f);
                f(a).saturating_sub(b)
            })
            .collect()
    }
}

/// A replica's view of one prompt from `POST /fleet/match`.
#[derive(Debug, Clone, Deserialize)]
pub struct MatchReplica {
    pub id: usize,
    #[serde(default)]
    pub cached_tokens: u64,
    #[serde(default)]
    pub running: u64,
    #[serde(default)]
    pub waiting: u64,
}

#[derive(Debug, Clone, Deserialize)]
pub struct MatchResult {
    #[serde(default)]
    pub prompt_tokens: u64,
    pub replicas: Vec<MatchReplica>,
}

/// A running fleet; the process is killed when this is dropped.
pub struct SimFleet {
    pub replicas: Vec<Replica>,
    pub control: String,
    /// The served model name (from a replica's `/v1/models`), sent in every request.
    pub model: String,
    http: reqwest::Client,
    _child: Option<Child>,
    _fleet_file: Option<TempFile>,
    /// Real engines in place of the sim (`"engine": "vllm"`), shared by every router's run.
    real: Option<Arc<RealFleet>>,
}

/// The sim binary: `$KVROUTE_SIM`, else `target/release/kvroute-sim` under the workspace root.
pub fn sim_binary() -> PathBuf {
    std::env::var_os("KVROUTE_SIM")
        .map(PathBuf::from)
        .unwrap_or_else(|| crate::paths::workspace_root().join("target/release/kvroute-sim"))
}

impl SimFleet {
    /// Starts a fleet described by `fleet` (passed to the sim as `--fleet`), caches cold.
    pub async fn start(fleet: &Value) -> Result<SimFleet, String> {
        let bin = sim_binary();
        if !bin.exists() {
            return Err(format!(
                "simulator not found at {} (run make build)",
                bin.display()
            ));
        }
        let fleet_file = TempFile::write("fleet.json", &fleet.to_string())?;
        let mut child = Command::new(&bin)
            .arg("--fleet")
            .arg(&fleet_file.0)
            .args(["--base-port", "0", "--control-port", "0"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", bin.display()))?;
        let stdout = child.stdout.take().ok_or("sim stdout not captured")?;
        let mut lines = BufReader::new(stdout).lines();
        let line = tokio::time::timeout(READY_TIMEOUT, lines.next_line())
            .await
            .map_err(|_| "simulator did not print its ready line within 30 s".to_string())?
            .map_err(|e| format!("reading simulator stdout: {e}"))?
            .ok_or("simulator exited before it was ready")?;
        let ready: Ready = serde_json::from_str(&line)
            .map_err(|e| format!("simulator ready line {line:?}: {e}"))?;
        // Keep draining stdout so the sim never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        let http = reqwest::Client::new();
        let first = ready
            .replicas
            .first()
            .ok_or("the simulator announced no replicas")?;
        let model = served_model(&http, &first.url).await?;
        Ok(SimFleet {
            replicas: ready.replicas,
            control: ready.control.trim_end_matches('/').to_string(),
            model,
            http,
            _child: Some(child),
            _fleet_file: Some(fleet_file),
            real: None,
        })
    }

    /// The real engines of `real` as a fleet for one router's run, their prefix caches emptied
    /// first. There is no control API: the oracle cannot run.
    pub async fn on_real(real: Arc<RealFleet>) -> Result<SimFleet, String> {
        real.reset().await?;
        let http = reqwest::Client::new();
        let first = real.replicas.first().ok_or("no engines")?;
        let model = served_model(&http, &first.url).await?;
        Ok(SimFleet {
            replicas: real.replicas.clone(),
            control: String::new(),
            model,
            http,
            _child: None,
            _fleet_file: None,
            real: Some(real),
        })
    }

    /// Whether these are real engines, not the sim.
    pub fn is_real(&self) -> bool {
        self.real.is_some()
    }

    pub async fn state(&self) -> Result<FleetState, String> {
        if let Some(real) = &self.real {
            return real.state().await;
        }
        let url = format!("{}/fleet/state", self.control);
        let resp = self
            .http
            .get(&url)
            .send()
            .await
            .map_err(|e| format!("{url}: {e}"))?;
        resp.json().await.map_err(|e| format!("{url}: {e}"))
    }

    pub fn control_client(&self) -> ControlClient {
        ControlClient {
            control: self.control.clone(),
            http: self.http.clone(),
        }
    }
}

async fn served_model(http: &reqwest::Client, replica: &str) -> Result<String, String> {
    let url = format!("{}/v1/models", replica.trim_end_matches('/'));
    let v: Value = http
        .get(&url)
        .send()
        .await
        .map_err(|e| format!("{url}: {e}"))?
        .json()
        .await
        .map_err(|e| format!("{url}: {e}"))?;
    v["data"][0]["id"]
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| format!("{url}: no model in {v}"))
}

/// A cheap handle on the control API, for the oracle proxy.
#[derive(Clone)]
pub struct ControlClient {
    control: String,
    http: reqwest::Client,
}

impl ControlClient {
    pub async fn best_match(&self, path: &str, body: &Value) -> Result<MatchResult, String> {
        let url = format!("{}/fleet/match", self.control);
        let resp = self
            .http
            .post(&url)
            .json(&json!({"path": path, "body": body}))
            .send()
            .await
            .map_err(|e| format!("{url}: {e}"))?;
        if !resp.status().is_success() {
            return Err(format!("{url}: HTTP {}", resp.status()));
        }
        resp.json().await.map_err(|e| format!("{url}: {e}"))
    }
}

/// A file in the temp dir, removed on drop.
pub struct TempFile(pub PathBuf);

impl TempFile {
    pub fn write(name: &str, contents: &str) -> Result<TempFile, String> {
        use std::sync::atomic::{AtomicU64, Ordering};
        static N: AtomicU64 = AtomicU64::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let path =
            std::env::temp_dir().join(format!("kvroute-bench-{}-{n}-{name}", std::process::id()));
        std::fs::write(&path, contents).map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(TempFile(path))
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Starts `cmd` (the binary `bin`) with no stdin or stdout, killed when dropped, and its stderr's
/// lines, where a helper process (the indexer, kvroute-epp) says when it is ready.
pub fn spawn_logging(
    cmd: &mut Command,
    bin: &std::path::Path,
) -> Result<(Child, Lines<BufReader<ChildStderr>>), String> {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", bin.display()))?;
    let stderr = child.stderr.take().ok_or("stderr not captured")?;
    Ok((child, BufReader::new(stderr).lines()))
}
