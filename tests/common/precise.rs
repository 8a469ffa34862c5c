//! Precise mode's fixtures beyond the harness's (`kvroute_harness::precise`): where kvroute
//! places a prompt an engine cached, and kvroute-indexer as a process of its own.

pub use kvroute_harness::precise::*;

use kvroute_indexer::config::Config as IndexerConfig;
use serde_json::Value;
use std::path::PathBuf;
use std::time::Duration;

/// Sends `body` to `replica` straight (not through kvroute), waits until the indexer at
/// `index_url` holds its prompt and `envoy` has polled since, then asks where kvroute places
/// `body`: (decision, endpoint).
pub async fn cached_then_decided(
    envoy: &kvroute_harness::Envoy,
    index_url: &str,
    replica: &kvroute_sim::fleet::ReplicaHandle,
    body: &Value,
) -> (String, String) {
    post(&format!("{}/v1/chat/completions", replica.url()), body).await;
    let cached = replica.addr.to_string();
    let indexed = || async { keys_held(index_url, &cached).await >= 2 };
    eventually("the indexer holds the prompt", indexed).await;
    super::index_applied(envoy, 3).await;
    super::decided(envoy, body).await
}

/// The built `kvroute-indexer` binary: `$KVROUTE_INDEXER`, else target/release's (`make build`).
pub fn indexer_binary() -> PathBuf {
    std::env::var_os("KVROUTE_INDEXER")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/release/kvroute-indexer")
        })
}

/// kvroute-indexer run as its own process with `config`'s engines (killed when dropped).
pub struct IndexerProcess {
    pub child: tokio::process::Child,
    pub addr: std::net::SocketAddr,
}

impl IndexerProcess {
    /// Starts the binary on a free port with `config`'s tokenizer, model and engines (their
    /// replay sockets too), and otherwise its defaults, and waits until it says where it listens.
    pub async fn start(config: &IndexerConfig) -> IndexerProcess {
        let mut args: Vec<String> = vec![
            format!("--tokenizer={}", config.events.tokenizer.display()),
            format!("--model={}", config.events.model),
            "--listen=127.0.0.1:0".into(),
        ];
        for e in &config.events.engines {
            let replay = e.replay.as_ref().map(|r| format!(",replay={r}"));
            let kind = e.kind.map(|k| format!(",kind={k}"));
            let events = format!(
                "{}={}{}{}",
                e.endpoint,
                e.events,
                replay.unwrap_or_default(),
                kind.unwrap_or_default()
            );
            args.push(format!("--engine={events}"));
        }
        IndexerProcess::with_args(&args).await
    }

    /// Starts the binary with these arguments (one of them `--listen` on a free port) and waits
    /// until it says where it listens.
    pub async fn with_args(args: &[String]) -> IndexerProcess {
        use tokio::io::AsyncBufReadExt;
        let bin = indexer_binary();
        let mut child = tokio::process::Command::new(&bin)
            .args(args)
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("{} (make build): {e}", bin.display()));
        let mut lines = tokio::io::BufReader::new(child.stderr.take().expect("stderr")).lines();
        let addr = loop {
            let line = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
                .await
                .expect("the indexer says where it listens")
                .expect("its stderr")
                .unwrap_or_else(|| panic!("the indexer exited before listening: {args:?}"));
            if let Some(at) = line.strip_prefix("kvroute-indexer: listening on http://") {
                break at.parse().expect("an address");
            }
        };
        // Keep reading its log, so a full pipe never blocks it.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        IndexerProcess { child, addr }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}
