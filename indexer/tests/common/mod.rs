//! Helpers for the tests: the simulator's tokenizer on disk, an indexer in-process, HTTP/1.1
//! calls, a change-feed client, polling with a generous deadline, msgpack maps, and the keys
//! kvroute computes over bytes.

#![allow(dead_code)]

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request};
use hyper_util::rt::TokioIo;
use kvroute::prefix::{PrefixKeys, Shape};
use kvroute_indexer::config::{Config, Discovery, EngineSpec, Events};
use kvroute_indexer::Running;
use serde_json::Value;
use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};
use tokio::net::TcpStream;

/// How long any awaited state may take to show (a loaded 2-core machine is slow; a test that
/// passes never waits this long).
pub const DEADLINE: Duration = Duration::from_secs(60);

/// The simulator's trained tokenizer.json, written once per test process.
pub fn tokenizer_file() -> PathBuf {
    static FILE: OnceLock<PathBuf> = OnceLock::new();
    FILE.get_or_init(|| {
        let path = std::env::temp_dir().join(format!(
            "kvroute-indexer-test-{}-tokenizer.json",
            std::process::id()
        ));
        kvroute_sim::bpe::write(&path).expect("tokenizer written");
        path
    })
    .clone()
}

/// The indexer's `--stale-after` when none is given.
pub fn default_stale_after() -> f64 {
    use clap::Parser;
    let args = ["kvroute-indexer", "--tokenizer", "t.json", "--model", "m"];
    Config::try_parse_from(args).unwrap().events.stale_after
}

/// An indexer on a free port for `engines` (`(endpoint, events url, replay url)`).
pub async fn indexer(
    engines: &[(String, String, Option<String>)],
    chunk_size: usize,
    stale_after: f64,
) -> Running {
    let config = config(engines, chunk_size, stale_after);
    kvroute_indexer::start(config)
        .await
        .expect("indexer starts")
}

/// The configuration [`indexer`] starts with.
pub fn config(
    engines: &[(String, String, Option<String>)],
    chunk_size: usize,
    stale_after: f64,
) -> Config {
    Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        chunk_size,
        events: Events {
            tokenizer: tokenizer_file(),
            model: "m".into(),
            engines: engines
                .iter()
                .map(|(endpoint, events, replay)| EngineSpec {
                    endpoint: endpoint.clone(),
                    events: events.clone(),
                    replay: replay.clone(),
                    ..EngineSpec::default()
                })
                .collect(),
            engine_kind: Default::default(),
            topic: String::new(),
            stale_after,
            gap_hold: 3600.0,
            feed_capacity: 1 << 16,
        },
        discovery: Discovery {
            envoy_admin: None,
            cluster: None,
            kv_events_port: None,
            replay_port: None,
            dp_size: 1,
        },
    }
}

/// One request on a fresh connection: (status, body).
pub async fn http(method: Method, url: &str, body: &str) -> (u16, String) {
    let uri: hyper::Uri = url.parse().expect("valid url");
    let authority = uri.authority().expect("url has host").to_string();
    let stream = TcpStream::connect(&authority).await.expect("connects");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(conn);
    let request = Request::builder()
        .method(method)
        .uri(uri.path_and_query().map_or("/", |p| p.as_str()))
        .header("host", authority)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let response = sender.send_request(request).await.expect("response");
    let status = response.status().as_u16();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&bytes).into_owned())
}

pub async fn get_json(url: &str) -> Value {
    let (status, body) = http(Method::GET, url, "").await;
    assert_eq!(status, 200, "{url}: {body}");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("{url}: {e}: {body}"))
}

pub async fn post_json(url: &str, body: &Value) -> Value {
    let (status, text) = http(Method::POST, url, &body.to_string()).await;
    assert_eq!(status, 200, "{url}: {text}");
    serde_json::from_str(&text).unwrap_or(Value::Null)
}

/// A wait with a generous deadline: call [`Deadline::tick`] between checks.
pub struct Deadline(Instant);

impl Deadline {
    pub fn start() -> Deadline {
        Deadline(Instant::now())
    }

    /// Pauses before the next check; panics with `what` once the deadline has passed.
    pub async fn tick(&self, what: impl FnOnce() -> String) {
        assert!(self.0.elapsed() < DEADLINE, "timed out: {}", what());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A client of `/v1/changes`, as the filter would be: it applies what it is sent.
#[derive(Debug, Default, Clone)]
pub struct FeedClient {
    pub epoch: Option<u64>,
    pub version: u64,
    pub endpoints: Vec<String>,
    pub stale: Vec<String>,
    pub fulls: usize,
    held: HashMap<u32, BTreeSet<u64>>,
}

impl FeedClient {
    /// Polls until it has caught up.
    pub async fn poll(&mut self, base: &str) {
        loop {
            let url = match self.epoch {
                Some(e) => format!(
                    "{base}/v1/changes?since={}&epoch={e}&limit=1000",
                    self.version
                ),
                None => format!("{base}/v1/changes?limit=1000"),
            };
            let v = get_json(&url).await;
            if v["full"].as_bool().unwrap() {
                self.held.clear();
                self.fulls += 1;
            }
            self.epoch = v["epoch"].as_u64();
            self.version = v["version"].as_u64().unwrap();
            self.endpoints = strings(&v["endpoints"]);
            self.stale = strings(&v["stale"]);
            let changes = v["changes"].as_array().unwrap();
            for c in changes {
                let (e, op, key) = (
                    c[0].as_u64().unwrap() as u32,
                    c[1].as_u64().unwrap(),
                    c[2].as_u64().unwrap(),
                );
                let set = self.held.entry(e).or_default();
                if op == 1 {
                    assert!(set.insert(key), "a key added twice");
                } else {
                    assert!(set.remove(&key), "a key removed that was not held");
                }
            }
            if changes.len() < 1000 || v["full"].as_bool().unwrap() {
                return;
            }
        }
    }

    /// The keys `endpoint` holds, as far as this client knows.
    pub fn held(&self, endpoint: &str) -> BTreeSet<u64> {
        self.endpoints
            .iter()
            .position(|e| e == endpoint)
            .and_then(|i| self.held.get(&(i as u32)).cloned())
            .unwrap_or_default()
    }
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_owned())
        .collect()
}

/// A msgpack map of `entries` (a msgspec struct without `array_like`).
pub fn msgpack_map(entries: Vec<(&str, rmpv::Value)>) -> rmpv::Value {
    rmpv::Value::Map(
        entries
            .into_iter()
            .map(|(k, v)| (rmpv::Value::from(k), v))
            .collect(),
    )
}

/// kvroute's keys for every whole `chunk`-byte chunk of `bytes`, a prompt of `model` under the
/// cache salt `salt`, as the filter computes them.
pub fn whole_chunk_keys(
    salt: Option<&str>,
    model: &str,
    bytes: &[u8],
    chunk: usize,
) -> BTreeSet<u64> {
    let shape = Shape {
        chunk_size: chunk,
        max_chunks: usize::MAX,
        group_bytes: 4096,
    };
    let keys = PrefixKeys::salted(salt, model, bytes, 0, false, shape).keys;
    keys[..bytes.len() / chunk].iter().copied().collect()
}
