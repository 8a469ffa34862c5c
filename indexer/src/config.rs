//! The indexer's command line: what to subscribe to, how to key, where to serve.

use crate::index::Staleness;
use clap::Parser;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// One engine stream: `ADDR=EVENTS[,replay=EVENTS][,model=NAME]`, EVENTS a ZMQ address
/// `tcp://HOST:PORT` or `ipc://PATH` (a Unix socket: an engine on the same host).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineSpec {
    /// The endpoint Envoy routes to (`ip:port`): the name the filter knows the engine by.
    pub endpoint: String,
    /// The engine's KV-event PUB socket.
    pub events: String,
    /// Its replay ROUTER socket, if it has one.
    pub replay: Option<String>,
    /// The served model, when it differs from `--model`.
    pub model: Option<String>,
}

impl std::str::FromStr for EngineSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<EngineSpec, String> {
        let (endpoint, rest) = s
            .split_once('=')
            .ok_or("expected ADDR=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,model=NAME]")?;
        let mut parts = rest.split(',');
        let events = parts.next().unwrap_or_default().to_owned();
        if !zmq_address(&events) {
            return Err(format!(
                "{events:?}: the events address must be tcp://HOST:PORT or ipc://PATH"
            ));
        }
        let mut spec = EngineSpec {
            endpoint: endpoint.to_owned(),
            events,
            replay: None,
            model: None,
        };
        for part in parts {
            match part.split_once('=') {
                Some(("replay", url)) if zmq_address(url) => spec.replay = Some(url.into()),
                Some(("model", name)) if !name.is_empty() => spec.model = Some(name.into()),
                _ => {
                    return Err(format!(
                        "{part:?}: expected replay=tcp://HOST:PORT (or ipc://PATH) or model=NAME"
                    ))
                }
            }
        }
        Ok(spec)
    }
}

/// Whether `url` is a ZMQ address the subscriber can connect to.
fn zmq_address(url: &str) -> bool {
    url.strip_prefix("tcp://")
        .or_else(|| url.strip_prefix("ipc://"))
        .is_some_and(|rest| !rest.is_empty())
}

/// kvroute-indexer: subscribes to vLLM engines' KV-cache events and serves, over HTTP, which
/// engine holds which kvroute prefix key.
#[derive(Debug, Clone, Parser)]
#[command(name = "kvroute-indexer", version)]
pub struct Config {
    /// Address of the HTTP API.
    #[arg(long, default_value = "127.0.0.1:9400")]
    pub listen: SocketAddr,
    /// The model's tokenizer.json (a byte-level BPE).
    #[arg(long)]
    pub tokenizer: PathBuf,
    /// The served model name (seeds the keys, as the request's `model` does in the filter).
    #[arg(long)]
    pub model: String,
    /// Bytes per key chunk: must equal the filter's `chunk_size`.
    #[arg(long, default_value_t = 512)]
    pub chunk_size: usize,
    /// An engine: ADDR=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,model=NAME] (or ipc://PATH
    /// for an engine on this host: vLLM binds only wildcard and ipc endpoints); repeat for
    /// each engine and each data-parallel rank (same ADDR, its own port).
    #[arg(long = "engine")]
    pub engines: Vec<EngineSpec>,
    /// ZMQ topic to subscribe to (vLLM's `kv_events_config.topic`; empty: everything).
    #[arg(long, default_value = "")]
    pub topic: String,
    /// Envoy's admin address (http://127.0.0.1:PORT): find the engines in `--cluster`.
    #[arg(long, requires_all = ["cluster", "kv_events_port"])]
    pub envoy_admin: Option<String>,
    /// The Envoy cluster of the engines.
    #[arg(long)]
    pub cluster: Option<String>,
    /// The KV-event port on every discovered engine host.
    #[arg(long)]
    pub kv_events_port: Option<u16>,
    /// The replay port on every discovered engine host, if they have one.
    #[arg(long)]
    pub replay_port: Option<u16>,
    /// Seconds without a message after which an engine is probed: its replay socket is asked
    /// for what followed the last message (an answer keeps it fresh and fills what was missed;
    /// none within 3 s makes it stale until heard again). An engine without a replay socket is
    /// stale after this silence instead (vLLM sends no heartbeat, so an idle one too).
    #[arg(long, default_value_t = 30.0)]
    pub stale_after: f64,
    /// Seconds an engine stays stale after a gap it could not fill.
    #[arg(long, default_value_t = 60.0)]
    pub gap_hold: f64,
    /// Changes the feed keeps for clients that poll behind.
    #[arg(long, default_value_t = 1 << 18)]
    pub feed_capacity: usize,
}

impl Config {
    /// When streams count as stale: `--stale-after` and `--gap-hold`.
    pub fn staleness(&self) -> Result<Staleness, String> {
        let seconds = |s: f64, name: &str| {
            Duration::try_from_secs_f64(s).map_err(|_| format!("--{name}: not a duration: {s}"))
        };
        Ok(Staleness {
            silence: seconds(self.stale_after, "stale-after")?,
            after_gap: seconds(self.gap_hold, "gap-hold")?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engines_parse_with_their_options() {
        let e: EngineSpec =
            "127.0.0.1:8000=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558,model=m"
                .parse()
                .unwrap();
        assert_eq!(e.endpoint, "127.0.0.1:8000");
        assert_eq!(e.events, "tcp://127.0.0.1:5557");
        assert_eq!(e.replay.as_deref(), Some("tcp://127.0.0.1:5558"));
        assert_eq!(e.model.as_deref(), Some("m"));
        assert!("a:1".parse::<EngineSpec>().is_err());
        assert!("a:1=udp://x".parse::<EngineSpec>().is_err());
        assert!("a:1=ipc://".parse::<EngineSpec>().is_err());
        let ipc: EngineSpec = "127.0.0.1:8000=ipc:///tmp/kv-events,replay=ipc:///tmp/replay"
            .parse()
            .unwrap();
        assert_eq!(ipc.events, "ipc:///tmp/kv-events");
        assert_eq!(ipc.replay.as_deref(), Some("ipc:///tmp/replay"));
        assert!("a:1=tcp://x:1,bogus=1".parse::<EngineSpec>().is_err());
    }

    #[test]
    fn the_command_line_parses() {
        let c = Config::try_parse_from([
            "kvroute-indexer",
            "--tokenizer",
            "t.json",
            "--model",
            "m",
            "--engine",
            "a:1=tcp://127.0.0.1:2",
            "--engine",
            "a:1=tcp://127.0.0.1:3",
        ])
        .unwrap();
        assert_eq!(c.engines.len(), 2);
        assert_eq!(c.chunk_size, 512);
        assert!(Config::try_parse_from(["kvroute-indexer", "--model", "m"]).is_err());
    }
}
