//! A fleet of real vLLM engines for `compare`, from a fleet spec whose `engine` is `vllm`
//! (`bench/fleets/real.json`): started once for the whole comparison, each router's run from
//! emptied prefix caches (engines take a minute or more to start; the sim starts in
//! milliseconds, so it gives each router a fresh fleet).
//!
//! The routers reach each engine through a small proxy of this process that adds the
//! `x-sim-replica` header the sim sends, so every sample says which replica served it whatever the
//! router. The fleet's counters (`/fleet/state` for the sim) are read from each engine's
//! `/metrics`: the hit rate is the engines' own `vllm:prefix_cache_hits_total` over
//! `vllm:prefix_cache_queries_total`.

use crate::sim_process::{FleetState, Replica, ReplicaState};
use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use kvroute_harness::vllm::{gauge, VllmFleet, VllmOptions};
use serde_json::Value;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// How long the engines may take to finish what one run left in flight before the next.
const IDLE_TIMEOUT: Duration = Duration::from_secs(120);

/// Whether `spec` asks for real engines.
pub fn is_real(spec: &Value) -> bool {
    spec["engine"].as_str() == Some("vllm")
}

/// The engines' options from the fleet spec: `replicas`, `num_gpu_blocks`, `max_num_seqs`,
/// `max_model_len`, `block_size`, `extra_args`.
pub fn options(spec: &Value) -> Result<VllmOptions, String> {
    let d = VllmOptions::default();
    let num = |k: &str| spec[k].as_u64();
    let opts = VllmOptions {
        replicas: num("replicas").unwrap_or(d.replicas as u64) as usize,
        num_gpu_blocks: num("num_gpu_blocks"),
        max_num_seqs: num("max_num_seqs").map_or(d.max_num_seqs, |n| n as u32),
        max_model_len: num("max_model_len").map_or(d.max_model_len, |n| n as u32),
        block_size: num("vllm_block_size").map(|n| n as u32),
        extra_args: spec["extra_args"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|a| a.as_str().map(str::to_string))
            .collect(),
    };
    if opts.replicas == 0 {
        return Err("fleet spec: replicas must be at least 1".into());
    }
    Ok(opts)
}

/// The engines and the proxies in front of them; dropping it stops all.
pub struct RealFleet {
    pub engines: VllmFleet,
    /// The replicas as the routers see them (through the proxies).
    pub replicas: Vec<Replica>,
    proxies: Vec<JoinHandle<()>>,
    http: reqwest::Client,
}

impl Drop for RealFleet {
    fn drop(&mut self) {
        for p in &self.proxies {
            p.abort();
        }
    }
}

impl RealFleet {
    pub async fn start(spec: &Value) -> Result<RealFleet, String> {
        let opts = options(spec)?;
        eprintln!(
            "   starting {} vLLM engines (a minute or more on two cores)",
            opts.replicas
        );
        let started = std::time::Instant::now();
        let engines = VllmFleet::start(&opts).await.map_err(|e| e.to_string())?;
        eprintln!("   engines serving after {:.0?}", started.elapsed());
        let mut replicas = Vec::new();
        let mut proxies = Vec::new();
        for (id, e) in engines.engines.iter().enumerate() {
            let (url, task) = tag_proxy(id, e.url.clone()).await?;
            proxies.push(task);
            replicas.push(Replica {
                id,
                url,
                kv_events: Some(e.kv_events.clone()),
                kv_events_replay: Some(e.replay.clone()),
                engine_kind: Some("vllm".into()),
            });
        }
        Ok(RealFleet {
            engines,
            replicas,
            proxies,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(10))
                .build()
                .map_err(|e| e.to_string())?,
        })
    }

    /// Empties the engines' prefix caches once they are idle: the next run starts cold.
    pub async fn reset(&self) -> Result<(), String> {
        self.engines
            .reset_prefix_caches(IDLE_TIMEOUT)
            .await
            .map_err(|e| e.to_string())
    }

    /// The fleet's counters, each engine's from its `/metrics`.
    pub async fn state(&self) -> Result<FleetState, String> {
        let mut replicas = Vec::new();
        for (id, e) in self.engines.engines.iter().enumerate() {
            let page = match self.engines.metrics(id).await {
                Ok(p) => p,
                Err(_) => {
                    replicas.push(ReplicaState {
                        id,
                        ..ReplicaState::default()
                    });
                    continue;
                }
            };
            let healthy = self
                .http
                .get(format!("{}/health", e.url))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            replicas.push(replica_state(id, &page, healthy));
        }
        Ok(FleetState { replicas })
    }
}

/// A replica's counters from its `/metrics` page.
pub fn replica_state(id: usize, page: &str, healthy: bool) -> ReplicaState {
    let n = |name: &str| gauge(page, name).round() as u64;
    ReplicaState {
        id,
        running: n("vllm:num_requests_running"),
        waiting: n("vllm:num_requests_waiting"),
        kv_usage: gauge(page, "vllm:kv_cache_usage_perc"),
        prefix_queries_tokens: n("vllm:prefix_cache_queries_total"),
        prefix_hits_tokens: n("vllm:prefix_cache_hits_total"),
        requests: n("vllm:request_success_total"),
        healthy,
    }
}

type Body = BoxBody<Bytes, hyper::Error>;
type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

/// A proxy on 127.0.0.1 to `engine` that adds `x-sim-replica: <id>` to every response, streamed
/// through as it comes.
async fn tag_proxy(id: usize, engine: String) -> Result<(String, JoinHandle<()>), String> {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| format!("proxy bind: {e}"))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();
    let engine = Arc::new(engine);
    let task = tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (client, engine) = (client.clone(), engine.clone());
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req| {
                    forward(id, client.clone(), engine.clone(), req)
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    Ok((format!("http://{addr}"), task))
}

async fn forward(
    id: usize,
    client: HttpClient,
    engine: Arc<String>,
    req: Request<Incoming>,
) -> Result<Response<Body>, hyper::Error> {
    let (parts, body) = req.into_parts();
    let bytes = body.collect().await?.to_bytes();
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let uri = format!("{engine}{path}");
    let mut out = Request::builder().method(parts.method).uri(&uri);
    for (name, value) in parts.headers.iter() {
        if name != hyper::header::HOST {
            out = out.header(name, value);
        }
    }
    let resp = match out.body(Full::new(bytes)) {
        Ok(r) => client.request(r).await.map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    Ok(match resp {
        Ok(mut resp) => {
            resp.headers_mut()
                .insert("x-sim-replica", hyper::header::HeaderValue::from(id));
            resp.map(|b| b.boxed())
        }
        Err(e) => {
            let body = Full::new(Bytes::from(format!("proxy to {uri}: {e}")))
                .map_err(|never| match never {})
                .boxed();
            let mut r = Response::new(body);
            *r.status_mut() = StatusCode::BAD_GATEWAY;
            r
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replica_state_reads_vllms_counters() {
        let page = "vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 2.0\n\
            vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 1.0\n\
            vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.5\n\
            vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"m\"} 1000.0\n\
            vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 640.0\n\
            vllm:request_success_total{engine=\"0\",finished_reason=\"stop\",model_name=\"m\"} 3.0\n\
            vllm:request_success_total{engine=\"0\",finished_reason=\"length\",model_name=\"m\"} 4.0\n";
        let s = replica_state(2, page, true);
        assert_eq!((s.id, s.running, s.waiting, s.requests), (2, 2, 1, 7));
        assert_eq!((s.prefix_queries_tokens, s.prefix_hits_tokens), (1000, 640));
        assert!(s.healthy && s.kv_usage == 0.5);
    }

    #[test]
    fn options_come_from_the_fleet_spec() {
        let spec = serde_json::json!({"engine": "vllm", "replicas": 3, "num_gpu_blocks": 48,
            "max_num_seqs": 8, "extra_args": ["--seed", "1"]});
        assert!(is_real(&spec));
        let o = options(&spec).unwrap();
        assert_eq!(
            (o.replicas, o.num_gpu_blocks, o.max_num_seqs),
            (3, Some(48), 8)
        );
        assert_eq!(o.extra_args, ["--seed", "1"]);
        assert!(!is_real(&serde_json::json!({"replicas": 4})));
        assert!(options(&serde_json::json!({"replicas": 0})).is_err());
    }
}
