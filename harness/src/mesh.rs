//! A large mesh as a gateway's admin sees it: an Envoy-shaped `/clusters?format=json` document
//! with thousands of clusters, and a fake admin on 127.0.0.1 that serves it.

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::task::JoinHandle;

/// One host status the way Envoy 1.40 writes it (counters and gauges, health, weight, locality).
fn host_status(addr: SocketAddr, rq_active: u64) -> Value {
    json!({
        "address": { "socket_address": { "address": addr.ip().to_string(), "port_value": addr.port() } },
        "stats": [
            { "name": "cx_connect_fail" },
            { "value": "3", "name": "cx_total" },
            { "name": "rq_error" },
            { "value": "3", "name": "rq_success" },
            { "name": "rq_timeout" },
            { "value": "3", "name": "rq_total" },
            { "type": "GAUGE", "name": "cx_active" },
            { "type": "GAUGE", "value": rq_active.to_string(), "name": "rq_active" }
        ],
        "health_status": { "eds_health_status": "HEALTHY" },
        "weight": 1,
        "locality": { "region": "r", "zone": "z" }
    })
}

fn cluster(name: &str, hosts: impl Iterator<Item = Value>) -> Value {
    json!({
        "name": name,
        "added_via_api": true,
        "host_statuses": hosts.collect::<Vec<_>>(),
        "circuit_breakers": { "thresholds": [ { "max_connections": 4294967295u32 } ] },
        "observability_name": name
    })
}

/// The `/clusters?format=json` of a gateway on a mesh of `decoys` other services of `per_cluster`
/// hosts each (addresses in 127.16.0.0/12, never dialled), with `pool`'s hosts listed in the
/// middle: in Envoy's order, the routed cluster is not conveniently first.
pub fn clusters_json(
    pool: &str,
    pool_hosts: &[SocketAddr],
    decoys: usize,
    per_cluster: usize,
) -> String {
    let decoy = |c: usize| {
        let hosts = (0..per_cluster).map(move |h| {
            let n = (c * per_cluster + h) as u32;
            let ip = std::net::Ipv4Addr::from(0x7f10_0000 + n);
            host_status(SocketAddr::from((ip, 8000)), (n % 7) as u64)
        });
        cluster(
            &format!("outbound|8000||svc-{c}.ns-{}.svc.cluster.local", c % 50),
            hosts,
        )
    };
    let mut clusters: Vec<Value> = (0..decoys / 2).map(decoy).collect();
    clusters.push(cluster(pool, pool_hosts.iter().map(|a| host_status(*a, 0))));
    clusters.extend((decoys / 2..decoys).map(decoy));
    json!({ "cluster_statuses": clusters }).to_string()
}

/// An HTTP server on 127.0.0.1 that answers every request with one JSON document, whatever its
/// query (as an Envoy without `/clusters?filter` would), counting them. The document and the
/// status can be changed while it runs (a fake kvroute-indexer's feed, an indexer that fails).
pub struct FakeAdmin {
    addr: SocketAddr,
    answer: Arc<std::sync::Mutex<(u16, Bytes)>>,
    served: Arc<AtomicU64>,
    last_path: Arc<std::sync::Mutex<String>>,
    accept: JoinHandle<()>,
}

impl FakeAdmin {
    pub async fn start(document: String) -> std::io::Result<FakeAdmin> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let served = Arc::new(AtomicU64::new(0));
        let answer = Arc::new(std::sync::Mutex::new((200, Bytes::from(document))));
        let counter = served.clone();
        let last_path = Arc::new(std::sync::Mutex::new(String::new()));
        let last = last_path.clone();
        let current = answer.clone();
        let accept = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let (current, counter, last) = (current.clone(), counter.clone(), last.clone());
                let svc = hyper::service::service_fn(move |req: Request<_>| {
                    if let (Ok(mut path), Some(asked)) = (last.lock(), req.uri().path_and_query()) {
                        *path = asked.to_string();
                    }
                    counter.fetch_add(1, Ordering::SeqCst);
                    let (status, body) = current
                        .lock()
                        .map(|a| a.clone())
                        .unwrap_or((500, Bytes::new()));
                    let resp = Response::builder()
                        .status(status)
                        .header("content-type", "application/json")
                        .body(Full::new(body));
                    async move { Ok::<_, Infallible>(resp.expect("static response")) }
                });
                tokio::spawn(
                    hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc),
                );
            }
        });
        Ok(FakeAdmin {
            addr,
            answer,
            served,
            last_path,
            accept,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Answers from now on with `status` and `document`.
    pub fn answer(&self, status: u16, document: String) {
        if let Ok(mut a) = self.answer.lock() {
            *a = (status, Bytes::from(document));
        }
    }

    /// Path and query of the last request.
    pub fn last_path(&self) -> String {
        self.last_path.lock().map(|p| p.clone()).unwrap_or_default()
    }

    /// Requests answered so far (each one a poll).
    pub fn served(&self) -> u64 {
        self.served.load(Ordering::SeqCst)
    }
}

impl Drop for FakeAdmin {
    fn drop(&mut self) {
        self.accept.abort();
    }
}
