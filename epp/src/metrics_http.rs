//! `GET /metrics`: the gateway's stats as Prometheus text, on an HTTP listener of its own; with
//! precise mode in process, the index's metrics too, and its health page at `/index/health` (as
//! kvroute-indexer serves them at `/metrics` and `/health`).

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use kvroute_indexer::state::Shared as Index;

use crate::stats::Stats;

/// Serves `stats` (and `index`'s) on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, stats: Arc<Stats>, index: Option<Arc<Index>>) {
    loop {
        let Ok((conn, _)) = listener.accept().await else {
            continue;
        };
        let (stats, index) = (stats.clone(), index.clone());
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                std::future::ready(answer(&req, &stats, index.as_deref()))
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(conn), service)
                .await;
        });
    }
}

fn answer<B>(
    req: &Request<B>,
    stats: &Stats,
    index: Option<&Index>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let indexed = |path| {
        index.map(|index| {
            kvroute_indexer::api::get(|| index.lock(), index.serving(), path, "", index.now())
        })
    };
    let (status, content_type, body) = match req.uri().path() {
        "/metrics" => {
            let mut text = stats.render();
            if let Some((_, _, more)) = indexed("/metrics") {
                text.push_str(&more);
            }
            (StatusCode::OK, "text/plain; version=0.0.4", text)
        }
        "/index/health" => {
            indexed("/health").unwrap_or((StatusCode::NOT_FOUND, "text/plain", String::new()))
        }
        _ => (StatusCode::NOT_FOUND, "text/plain", String::new()),
    };
    let response = Response::builder()
        .status(status)
        .header("content-type", content_type)
        .body(Full::new(Bytes::from(body)));
    Ok(response.unwrap_or_else(|_| Response::new(Full::new(Bytes::new()))))
}
