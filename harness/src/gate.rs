//! A gate on 127.0.0.1 in front of another HTTP server, which a test opens, fails or jams: it
//! forwards GETs to its target, answers 503, or holds requests unanswered until told otherwise.
//! Put in front of Envoy's admin, it stands for an admin poll that stops answering.

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// What the gate does with a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateMode {
    /// Forward it to the target and pass the answer back.
    Open,
    /// Answer 503 at once.
    Failing,
    /// Hold it unanswered (until the mode changes, then handle it by the new mode).
    Jammed,
}

struct Shared {
    target: Mutex<Option<SocketAddr>>,
    forwarded: AtomicU64,
    client: reqwest::Client,
}

/// A running gate; stops listening when dropped.
pub struct Gate {
    addr: SocketAddr,
    shared: Arc<Shared>,
    mode: watch::Sender<GateMode>,
    accept: JoinHandle<()>,
}

impl Gate {
    /// Starts a gate in `mode` with no target yet (requests to an open gate without one get 502).
    pub async fn start(mode: GateMode) -> std::io::Result<Gate> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()
            .map_err(std::io::Error::other)?;
        let shared = Arc::new(Shared {
            target: Mutex::new(None),
            forwarded: AtomicU64::new(0),
            client,
        });
        let (mode, modes) = watch::channel(mode);
        let accept = tokio::spawn(accept_loop(listener, shared.clone(), modes));
        Ok(Gate {
            addr,
            shared,
            mode,
            accept,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Where an open gate forwards to.
    pub fn set_target(&self, target: SocketAddr) {
        *self.shared.target.lock().unwrap() = Some(target);
    }

    pub fn set_mode(&self, mode: GateMode) {
        self.mode.send_replace(mode);
    }

    /// Requests forwarded and answered by the target so far.
    pub fn forwarded(&self) -> u64 {
        self.shared.forwarded.load(Ordering::SeqCst)
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

async fn accept_loop(
    listener: tokio::net::TcpListener,
    shared: Arc<Shared>,
    modes: watch::Receiver<GateMode>,
) {
    while let Ok((stream, _)) = listener.accept().await {
        let shared = shared.clone();
        let modes = modes.clone();
        tokio::spawn(async move {
            let svc =
                hyper::service::service_fn(move |req| handle(shared.clone(), modes.clone(), req));
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

async fn handle(
    shared: Arc<Shared>,
    mut modes: watch::Receiver<GateMode>,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    // A jammed gate answers only once it is no longer jammed (a dropped gate never).
    let mode = modes
        .wait_for(|m| *m != GateMode::Jammed)
        .await
        .map(|mode| *mode);
    let Ok(mode) = mode else {
        return std::future::pending().await;
    };
    let target = *shared.target.lock().unwrap();
    let (status, body) = match (mode, target) {
        (GateMode::Open, Some(target)) => {
            let path = req.uri().path_and_query().map_or("/", |p| p.as_str());
            match shared
                .client
                .get(format!("http://{target}{path}"))
                .send()
                .await
            {
                Ok(resp) => {
                    let status = resp.status().as_u16();
                    let body = resp.bytes().await.unwrap_or_default();
                    shared.forwarded.fetch_add(1, Ordering::SeqCst);
                    (
                        StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY),
                        body,
                    )
                }
                Err(_) => (StatusCode::BAD_GATEWAY, Bytes::new()),
            }
        }
        (GateMode::Open, None) => (StatusCode::BAD_GATEWAY, Bytes::new()),
        _ => (
            StatusCode::SERVICE_UNAVAILABLE,
            Bytes::from_static(b"gate failing"),
        ),
    };
    let mut resp = Response::new(Full::new(body));
    *resp.status_mut() = status;
    Ok(resp)
}
