//! Real vLLM engines on 127.0.0.1, for `make real`, `make test-real` and `kvroute-bench compare`
//! with a fleet spec whose `engine` is `vllm`.
//!
//! vLLM for CPU is installed by `make vllm` into `.work/vllm` (`$KVROUTE_VLLM_VENV`), and the tiny
//! model it serves (random weights, a tokenizer trained on this repository's text) is built into
//! `.work/real/model` (`$KVROUTE_VLLM_MODEL`) by `tools/real/make-model.py`. Each engine runs with
//! prefix caching, KV events on its own ZMQ Unix socket, cached-token details in `usage`, and
//! the dev-mode endpoints (`/reset_prefix_cache`), in its own process group, killed on drop.

use crate::envoy::free_ports;
use crate::paths::workspace_root;
use crate::HarnessError;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The name the engines serve the model under (requests name it in `model`).
pub const SERVED_MODEL: &str = "kvroute-tiny";
/// How long engines started together may take to serve: 70-90 s for one alone on an idle
/// machine; three starting together on two cores other work also loads took over 6 minutes.
const START_TIMEOUT: Duration = Duration::from_secs(900);

/// How to start the engines.
#[derive(Debug, Clone)]
pub struct VllmOptions {
    pub replicas: usize,
    /// `--num-gpu-blocks-override`: KV blocks per engine (the CPU backend's blocks hold 128
    /// tokens); `None` leaves the cache at `VLLM_CPU_KVCACHE_SPACE` (1 GiB).
    pub num_gpu_blocks: Option<u64>,
    /// `--max-num-seqs`: requests an engine runs at once.
    pub max_num_seqs: u32,
    /// `--max-model-len`: longest prompt and answer; must fit the KV cache.
    pub max_model_len: u32,
    /// `--block-size`, where the backend takes another one.
    pub block_size: Option<u32>,
    /// Any other `vllm serve` arguments.
    pub extra_args: Vec<String>,
}

impl Default for VllmOptions {
    fn default() -> Self {
        VllmOptions {
            replicas: 1,
            num_gpu_blocks: None,
            max_num_seqs: 16,
            max_model_len: 4096,
            block_size: None,
            extra_args: Vec::new(),
        }
    }
}

/// One engine.
pub struct VllmEngine {
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    /// Its KV event publisher, `ipc:///tmp/...`: vLLM's publisher binds only wildcard and ipc
    /// endpoints (a `tcp://127.0.0.1:PORT` one it *connects* to, as a client), so a Unix socket
    /// is how it listens without a network interface.
    pub kv_events: String,
    /// Its replay socket (a ROUTER resending buffered batches), `ipc:///tmp/...` too.
    pub replay: String,
    child: Option<Child>,
    log: PathBuf,
}

/// Engines started together; all are killed when this is dropped.
pub struct VllmFleet {
    pub engines: Vec<VllmEngine>,
    http: reqwest::Client,
}

/// The venv `make vllm` installs: `$KVROUTE_VLLM_VENV`, else `.work/vllm` under the workspace.
pub fn vllm_venv() -> PathBuf {
    env_or("KVROUTE_VLLM_VENV", ".work/vllm")
}

/// The model directory `make vllm` builds: `$KVROUTE_VLLM_MODEL`, else `.work/real/model`.
pub fn vllm_model() -> PathBuf {
    env_or("KVROUTE_VLLM_MODEL", ".work/real/model")
}

fn env_or(var: &str, default: &str) -> PathBuf {
    std::env::var_os(var)
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join(default))
}

/// Whether vLLM and the model are in place (tests that need them say how to get them).
pub fn vllm_missing() -> Option<String> {
    let (venv, model) = (vllm_venv(), vllm_model());
    if !venv.join("bin/vllm").is_file() {
        return Some(format!(
            "vLLM not installed at {} (run make vllm)",
            venv.display()
        ));
    }
    if !model.join("config.json").is_file() {
        return Some(format!(
            "model not built at {} (run make vllm)",
            model.display()
        ));
    }
    None
}

impl VllmFleet {
    /// Starts `opts.replicas` engines at once and waits until every one serves.
    pub async fn start(opts: &VllmOptions) -> Result<VllmFleet, HarnessError> {
        if let Some(missing) = vllm_missing() {
            return Err(HarnessError::Missing(missing));
        }
        let mut fleet = VllmFleet {
            engines: Vec::new(),
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(10))
                .build()
                .map_err(|e| HarnessError::Http(e.to_string()))?,
        };
        for i in 0..opts.replicas {
            fleet.engines.push(spawn(i, opts)?);
        }
        let deadline = Instant::now() + START_TIMEOUT;
        for i in 0..fleet.engines.len() {
            fleet.wait_serving(i, deadline).await?;
        }
        Ok(fleet)
    }

    async fn wait_serving(&mut self, i: usize, deadline: Instant) -> Result<(), HarnessError> {
        let url = format!("{}/health", self.engines[i].url);
        loop {
            let engine = &mut self.engines[i];
            if let Some(Ok(Some(status))) = engine.child.as_mut().map(Child::try_wait) {
                return Err(engine.failure(format!("exited with {status} while starting")));
            }
            if self
                .http
                .get(&url)
                .send()
                .await
                .is_ok_and(|r| r.status().is_success())
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                let what = format!("not serving after {START_TIMEOUT:?}");
                return Err(self.engines[i].failure(what));
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// Engine `i`'s `/metrics` page.
    pub async fn metrics(&self, i: usize) -> Result<String, HarnessError> {
        let url = format!("{}/metrics", self.engines[i].url);
        let resp = self.http.get(&url).send().await;
        let resp = resp.map_err(|e| HarnessError::Http(format!("{url}: {e}")))?;
        resp.text()
            .await
            .map_err(|e| HarnessError::Http(format!("{url}: {e}")))
    }

    /// Waits until no engine runs or queues a request (for `timeout` at most), then empties
    /// every engine's prefix cache (`POST /reset_prefix_cache`, which vLLM refuses while
    /// requests run): the next run starts cold.
    pub async fn reset_prefix_caches(&self, timeout: Duration) -> Result<(), HarnessError> {
        let deadline = Instant::now() + timeout;
        for i in 0..self.engines.len() {
            if self.engines[i].child.is_none() {
                continue;
            }
            loop {
                let page = self.metrics(i).await?;
                let busy = ["vllm:num_requests_running", "vllm:num_requests_waiting"]
                    .iter()
                    .map(|m| gauge(&page, m))
                    .sum::<f64>();
                if busy == 0.0 {
                    break;
                }
                if Instant::now() > deadline {
                    return Err(HarnessError::Http(format!(
                        "engine {i} still busy after {timeout:?}"
                    )));
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            let url = format!("{}/reset_prefix_cache", self.engines[i].url);
            let resp = self.http.post(&url).send().await;
            let resp = resp.map_err(|e| HarnessError::Http(format!("{url}: {e}")))?;
            if !resp.status().is_success() {
                return Err(HarnessError::Http(format!("{url}: HTTP {}", resp.status())));
            }
        }
        Ok(())
    }

    /// Kills engine `i` at once (SIGKILL to its process group), as a crashed replica.
    pub fn kill(&mut self, i: usize) {
        self.engines[i].kill();
    }
}

impl VllmEngine {
    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            // Engine core and API server are separate processes: end the group.
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{}", child.id())])
                .stderr(Stdio::null())
                .status();
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The last lines of the engine's log.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    /// Where the engine logs.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    fn failure(&self, what: String) -> HarnessError {
        HarnessError::Engine {
            what: format!("{}: {what} (log {})", self.url, self.log.display()),
            log_tail: self.log_tail(),
        }
    }
}

impl Drop for VllmFleet {
    fn drop(&mut self) {
        for e in &mut self.engines {
            e.kill();
        }
    }
}

/// The sum of a metric's samples over its label sets (0 when absent).
pub fn gauge(page: &str, name: &str) -> f64 {
    page.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn spawn(i: usize, opts: &VllmOptions) -> Result<VllmEngine, HarnessError> {
    let [port, _] = free_ports()?;
    let stem = format!("kvroute-vllm-{}-{i}-{port}", std::process::id());
    let log = std::env::temp_dir().join(format!("{stem}.log"));
    let file = std::fs::File::create(&log)?;
    let socket = |suffix: &str| {
        let path = std::env::temp_dir().join(format!("{stem}{suffix}"));
        format!("ipc://{}", path.display())
    };
    let (kv_events, replay) = (socket(""), socket("-replay"));
    let events_config = serde_json::json!({
        "enable_kv_cache_events": true,
        "publisher": "zmq",
        "endpoint": kv_events,
        "replay_endpoint": replay,
        "topic": "kv-events",
    });
    let mut cmd = Command::new(vllm_venv().join("bin/vllm"));
    cmd.arg("serve").arg(vllm_model());
    cmd.args(["--host", "127.0.0.1", "--port", &port.to_string()]);
    cmd.args(["--served-model-name", SERVED_MODEL]);
    cmd.args(["--load-format", "dummy", "--enforce-eager"]);
    cmd.args(["--enable-prefix-caching", "--enable-prompt-tokens-details"]);
    cmd.args(["--kv-events-config", &events_config.to_string()]);
    cmd.args(["--max-num-seqs", &opts.max_num_seqs.to_string()]);
    cmd.args(["--max-model-len", &opts.max_model_len.to_string()]);
    if let Some(n) = opts.num_gpu_blocks {
        cmd.args(["--num-gpu-blocks-override", &n.to_string()]);
    }
    if let Some(b) = opts.block_size {
        cmd.args(["--block-size", &b.to_string()]);
    }
    cmd.args(&opts.extra_args);
    cmd.env("VLLM_CPU_KVCACHE_SPACE", "1")
        // `/reset_prefix_cache`, so one fleet serves several runs, each from a cold cache.
        .env("VLLM_SERVER_DEV_MODE", "1")
        .env("VLLM_HOST_IP", "127.0.0.1")
        .env("VLLM_NO_USAGE_STATS", "1")
        .env("DO_NOT_TRACK", "1")
        .env("HF_HUB_OFFLINE", "1")
        .env("TRANSFORMERS_OFFLINE", "1")
        // Several engines share two cores: none pins threads to them or spins on a core.
        .env("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        .env("OMP_NUM_THREADS", "1")
        .stdin(Stdio::null())
        .stdout(file.try_clone()?)
        .stderr(file)
        .process_group(0);
    let child = cmd.spawn().map_err(|e| {
        HarnessError::Missing(format!("cannot start {}: {e}", vllm_venv().display()))
    })?;
    Ok(VllmEngine {
        url: format!("http://127.0.0.1:{port}"),
        kv_events,
        replay,
        child: Some(child),
        log,
    })
}

#[cfg(test)]
mod tests {
    use super::gauge;

    #[test]
    fn gauge_sums_label_sets_and_skips_longer_names() {
        let page = "# TYPE vllm:num_requests_running gauge\n\
            vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 2.0\n\
            vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 1.0\n\
            vllm:num_requests_running_total 7\n";
        assert_eq!(gauge(page, "vllm:num_requests_running"), 3.0);
        assert_eq!(gauge(page, "vllm:num_requests_waiting"), 0.0);
    }
}
