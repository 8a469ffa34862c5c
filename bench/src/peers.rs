//! Peer routers from PyPI (smg, vllm-router), each run from its own venv under `.work/peers/`
//! (installed by `make peers`) in front of the sim fleet.

use crate::paths::peers_dir;
use crate::sim_process::SimFleet;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::process::{Child, Command};

/// How long a peer may take to answer `/health` after it was started.
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// KV block size the sim's KV events use unless the fleet spec says `block_size`.
const DEFAULT_BLOCK_SIZE: u64 = 16;

/// A peer router process (and its process group), killed when dropped.
pub struct PeerProcess {
    pub url: String,
    child: Child,
    log: PathBuf,
}

impl Drop for PeerProcess {
    fn drop(&mut self) {
        // The Python launchers may start helpers of their own: end the whole group we created.
        if let Some(pid) = self.child.id() {
            let _ = std::process::Command::new("kill")
                .args(["-KILL", "--", &format!("-{pid}")])
                .stderr(Stdio::null())
                .status();
        }
        let _ = self.child.start_kill();
        let _ = std::fs::remove_file(&self.log);
    }
}

/// `smg` (SGLang Model Gateway) with `--policy cache_aware`.
pub async fn start_smg(fleet: &SimFleet) -> Result<PeerProcess, String> {
    let workers: Vec<String> = fleet.replicas.iter().map(|r| r.url.clone()).collect();
    start_smg_on(&workers).await
}

/// `smg --policy cache_aware` in front of `workers` (base URLs).
pub async fn start_smg_on(workers: &[String]) -> Result<PeerProcess, String> {
    let venv = venv("smg")?;
    let [port, metrics_port] = free_ports()?;
    let mut cmd = Command::new(venv.join("bin/python"));
    cmd.args([
        "-m",
        "smg",
        "launch",
        "--host",
        "127.0.0.1",
        "--port",
        &port.to_string(),
    ]);
    cmd.args([
        "--prometheus-port",
        &metrics_port.to_string(),
        "--prometheus-host",
        "127.0.0.1",
    ]);
    cmd.args([
        "--policy",
        "cache_aware",
        "--backend",
        "vllm",
        "--log-level",
        "warn",
    ]);
    cmd.arg("--worker-urls").args(workers);
    spawn("smg", cmd, port).await
}

/// `vllm-router --policy <policy>`; `kv_aware` is fed the sim's ZMQ KV event streams.
pub async fn start_vllm_router(
    policy: &str,
    fleet: &SimFleet,
    fleet_spec: &serde_json::Value,
) -> Result<PeerProcess, String> {
    let workers: Vec<String> = fleet.replicas.iter().map(|r| r.url.clone()).collect();
    let (mut cmd, port) = vllm_router_command(policy, &workers)?;
    if policy == "kv_aware" {
        let block = fleet_spec["block_size"]
            .as_u64()
            .unwrap_or(DEFAULT_BLOCK_SIZE);
        cmd.args([
            "--kv-event-block-size",
            &block.to_string(),
            "--kv-event-model",
            &fleet.model,
        ]);
        for r in &fleet.replicas {
            let events = r
                .kv_events
                .as_deref()
                .ok_or("the sim announced no kv_events endpoint")?;
            cmd.arg("--kv-event-source")
                .arg(format!("{}={events}", r.url));
        }
    }
    spawn("vllm-router", cmd, port).await
}

/// `vllm-router --policy <policy>` in front of `workers` (base URLs), for policies that need
/// nothing else (not `kv_aware`).
pub async fn start_vllm_router_on(policy: &str, workers: &[String]) -> Result<PeerProcess, String> {
    let (cmd, port) = vllm_router_command(policy, workers)?;
    spawn("vllm-router", cmd, port).await
}

fn vllm_router_command(policy: &str, workers: &[String]) -> Result<(Command, u16), String> {
    let venv = venv("vllm-router")?;
    let [port, metrics_port] = free_ports()?;
    let mut cmd = Command::new(venv.join("bin/vllm-router"));
    cmd.args([
        "--host",
        "127.0.0.1",
        "--port",
        &port.to_string(),
        "--policy",
        policy,
    ]);
    cmd.args([
        "--prometheus-port",
        &metrics_port.to_string(),
        "--prometheus-host",
        "127.0.0.1",
    ]);
    cmd.args([
        "--worker-startup-check-interval",
        "1",
        "--log-level",
        "warning",
    ]);
    cmd.arg("--worker-urls").args(workers);
    Ok((cmd, port))
}

fn venv(name: &str) -> Result<PathBuf, String> {
    let dir = peers_dir().join(name);
    if dir.join(".installed").exists() {
        Ok(dir)
    } else {
        Err(format!(
            "{name} is not installed in {} (run make peers)",
            dir.display()
        ))
    }
}

async fn spawn(name: &str, mut cmd: Command, port: u16) -> Result<PeerProcess, String> {
    let log = std::env::temp_dir().join(format!(
        "kvroute-bench-{}-{name}-{port}.log",
        std::process::id()
    ));
    let file = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
    let file2 = file.try_clone().map_err(|e| e.to_string())?;
    let child = cmd
        .stdin(Stdio::null())
        .stdout(file)
        .stderr(file2)
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("cannot start {name}: {e}"))?;
    let mut peer = PeerProcess {
        url: format!("http://127.0.0.1:{port}"),
        child,
        log,
    };
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .map_err(|e| e.to_string())?;
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        if let Ok(Some(status)) = peer.child.try_wait() {
            return Err(format!("{name} exited with {status}: {}", peer.log_tail()));
        }
        if http
            .get(format!("{}/health", peer.url))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
        {
            return Ok(peer);
        }
        if Instant::now() > deadline {
            return Err(format!(
                "{name} not healthy after {START_TIMEOUT:?}: {}",
                peer.log_tail()
            ));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

impl PeerProcess {
    /// CPU time (user + system) used so far by the peer's process group (its launcher and
    /// whatever it started), from `/proc` (Linux only).
    pub fn cpu_time(&self) -> Option<Duration> {
        let group = self.child.id()?;
        let mut ticks = 0u64;
        for entry in std::fs::read_dir("/proc").ok()?.flatten() {
            let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
                continue;
            };
            // Fields after the command name, which is parenthesised and may contain spaces.
            let Some((_, rest)) = stat.rsplit_once(')') else {
                continue;
            };
            let fields: Vec<&str> = rest.split_whitespace().collect();
            if fields.get(2).and_then(|g| g.parse::<u32>().ok()) != Some(group) {
                continue;
            }
            let field = |i: usize| fields.get(i).and_then(|v| v.parse::<u64>().ok());
            ticks += field(11).unwrap_or(0) + field(12).unwrap_or(0);
        }
        // Clock ticks of 1/100 s (USER_HZ) on every common Linux platform.
        Some(Duration::from_millis(ticks * 10))
    }

    /// What the peer logged, squeezed onto one line for a `skipped` reason: its last error line
    /// if it logged one, else its last three lines.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<String> = text
            .lines()
            .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
            .filter(|l| !l.is_empty())
            .collect();
        let picked = match lines
            .iter()
            .rev()
            .find(|l| l.to_lowercase().contains("error"))
        {
            Some(error) => error.clone(),
            None => lines[lines.len().saturating_sub(3)..].join(" / "),
        };
        picked.chars().take(400).collect()
    }
}

/// Two ports that were free a moment ago (held together so they differ).
fn free_ports() -> Result<[u16; 2], String> {
    let bind = || std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| format!("free port: {e}"));
    let (a, b) = (bind()?, bind()?);
    let port =
        |l: &std::net::TcpListener| l.local_addr().map(|a| a.port()).map_err(|e| e.to_string());
    Ok([port(&a)?, port(&b)?])
}
