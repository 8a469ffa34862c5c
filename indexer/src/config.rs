//! The indexer's command line: what to subscribe to, how to key, where to serve.

use crate::dialect::Dialect;
use crate::index::Staleness;
use clap::{Args, Parser};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// One engine: `ADDR=EVENTS[,replay=EVENTS][,model=NAME][,kind=vllm|sglang][,dp=N]`, EVENTS a
/// ZMQ address `tcp://HOST:PORT` or `ipc://PATH` (a Unix socket: an engine on the same host).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineSpec {
    /// The endpoint Envoy routes to (`ip:port`): the name the filter knows the engine by.
    pub endpoint: String,
    /// The engine's KV-event PUB socket (its data-parallel rank 0's).
    pub events: String,
    /// Its replay ROUTER socket, if it has one.
    pub replay: Option<String>,
    /// The served model, when it differs from `--model`.
    pub model: Option<String>,
    /// Which engine publishes, when it differs from `--engine-kind`.
    pub kind: Option<Dialect>,
    /// Data-parallel ranks, each publishing on the events (and replay) port plus its rank.
    pub dp_size: u16,
}

impl Default for EngineSpec {
    fn default() -> EngineSpec {
        EngineSpec {
            endpoint: String::new(),
            events: String::new(),
            replay: None,
            model: None,
            kind: None,
            dp_size: 1,
        }
    }
}

const ENGINE_USAGE: &str = "expected \
    ADDR=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,model=NAME][,kind=vllm|sglang][,dp=N]";

impl std::str::FromStr for EngineSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<EngineSpec, String> {
        let (endpoint, rest) = s.split_once('=').ok_or(ENGINE_USAGE)?;
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
            ..EngineSpec::default()
        };
        for part in parts {
            match part.split_once('=') {
                Some(("replay", url)) if zmq_address(url) => spec.replay = Some(url.into()),
                Some(("model", name)) if !name.is_empty() => spec.model = Some(name.into()),
                Some(("kind", kind)) => spec.kind = Some(kind.parse()?),
                Some(("dp", n)) => {
                    spec.dp_size = n
                        .parse()
                        .ok()
                        .filter(|n| *n > 0)
                        .ok_or_else(|| format!("dp={n}: the number of ranks, at least 1"))?;
                }
                _ => return Err(format!("{part:?}: {ENGINE_USAGE}")),
            }
        }
        // Fails now, naming the address, if a rank's port cannot be formed.
        spec.ranks()?;
        Ok(spec)
    }
}

impl EngineSpec {
    /// Each data-parallel rank's events and replay addresses: rank r publishes on the port plus
    /// r, as vLLM and SGLang offset them (neither offsets an `ipc://` address).
    pub fn ranks(&self) -> Result<Vec<(String, Option<String>)>, String> {
        (0..self.dp_size)
            .map(|r| {
                let replay = self
                    .replay
                    .as_deref()
                    .map(|u| rank_address(u, r))
                    .transpose()?;
                Ok((rank_address(&self.events, r)?, replay))
            })
            .collect()
    }
}

/// `url` with its port moved up by `rank` (`url` itself for rank 0).
pub fn rank_address(url: &str, rank: u16) -> Result<String, String> {
    if rank == 0 {
        return Ok(url.to_owned());
    }
    let port = url
        .strip_prefix("tcp://")
        .and_then(|rest| rest.rsplit_once(':'))
        .and_then(|(host, port)| Some((host, port.parse::<u16>().ok()?)));
    match port.and_then(|(host, port)| Some((host, port.checked_add(rank)?))) {
        Some((host, port)) => Ok(format!("tcp://{host}:{port}")),
        None => Err(format!(
            "{url:?}: data-parallel rank {rank} needs a tcp://HOST:PORT address to add its rank to"
        )),
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
    /// Bytes per key chunk: must equal the filter's `chunk_size`.
    #[arg(long, default_value_t = 512)]
    pub chunk_size: usize,
    #[command(flatten)]
    pub events: Events,
    #[command(flatten)]
    pub discovery: Discovery,
}

/// Whose KV events to follow and how to key them: what the indexer and kvroute-epp's precise
/// mode take alike.
#[derive(Debug, Clone, Args)]
pub struct Events {
    /// The model's tokenizer.json (a byte-level BPE).
    #[arg(long)]
    pub tokenizer: PathBuf,
    /// The served model name (seeds the keys, as the request's `model` does in the filter).
    #[arg(long)]
    pub model: String,
    /// An engine: ADDR=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,model=NAME]
    /// [,kind=vllm|sglang][,dp=N] (or ipc://PATH for an engine on this host: vLLM binds only
    /// wildcard and ipc endpoints); repeat for each engine. `dp=N`: N data-parallel ranks on
    /// the ports from PORT on (or repeat the engine per rank, same ADDR, its own port).
    #[arg(long = "engine")]
    pub engines: Vec<EngineSpec>,
    /// Which engine publishes (vllm or sglang), for engines without `kind=` and discovered ones.
    #[arg(long, default_value = "vllm")]
    pub engine_kind: Dialect,
    /// ZMQ topic to subscribe to (vLLM's `kv_events_config.topic`; empty: everything).
    #[arg(long, default_value = "")]
    pub topic: String,
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

/// Engines found in an Envoy cluster rather than listed.
#[derive(Debug, Clone, Args)]
pub struct Discovery {
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
    /// Data-parallel ranks of every discovered engine, each on the ports plus its rank.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
    pub dp_size: u16,
}

impl Events {
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
        assert_eq!(e.kind, None);
        assert_eq!(e.dp_size, 1);
    }

    #[test]
    fn an_sglang_engine_with_data_parallel_ranks_subscribes_to_port_plus_rank() {
        let e: EngineSpec =
            "10.0.0.1:30000=tcp://10.0.0.1:5557,replay=tcp://10.0.0.1:5600,kind=sglang,dp=3"
                .parse()
                .unwrap();
        assert_eq!(e.kind, Some(Dialect::Sglang));
        assert_eq!(
            e.ranks().unwrap(),
            [
                ("tcp://10.0.0.1:5557", "tcp://10.0.0.1:5600"),
                ("tcp://10.0.0.1:5558", "tcp://10.0.0.1:5601"),
                ("tcp://10.0.0.1:5559", "tcp://10.0.0.1:5602"),
            ]
            .map(|(e, r)| (e.to_string(), Some(r.to_string())))
        );
        let v6: EngineSpec = "[::1]:8000=tcp://[::1]:5557,dp=2".parse().unwrap();
        assert_eq!(v6.ranks().unwrap()[1].0, "tcp://[::1]:5558");
        let vllm: EngineSpec = "a:1=tcp://x:1,kind=vllm".parse().unwrap();
        assert_eq!(vllm.kind, Some(Dialect::Vllm));
        for bad in [
            "a:1=tcp://x:1,kind=trtllm",
            "a:1=tcp://x:1,dp=0",
            "a:1=tcp://x:1,dp=two",
            "a:1=ipc:///tmp/kv,dp=2",
            "a:1=tcp://x:65535,dp=2",
        ] {
            assert!(bad.parse::<EngineSpec>().is_err(), "{bad}");
        }
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
        assert_eq!(c.events.engines.len(), 2);
        assert_eq!(c.chunk_size, 512);
        assert_eq!(
            (c.events.engine_kind, c.discovery.dp_size),
            (Dialect::Vllm, 1)
        );
        assert!(Config::try_parse_from(["kvroute-indexer", "--model", "m"]).is_err());
    }
}
