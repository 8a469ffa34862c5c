//! `GET /metrics`: the gateway's stats as Prometheus text, on an HTTP listener of its own.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use crate::stats::Stats;

/// Serves `stats` on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, stats: Arc<Stats>) {
    loop {
        let Ok((conn, _)) = listener.accept().await else {
            continue;
        };
        let stats = stats.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| answer(req, stats.clone()));
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(conn), service)
                .await;
        });
    }
}

async fn answer<B>(
    req: Request<B>,
    stats: Arc<Stats>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let response = match req.uri().path() {
        "/metrics" => Response::builder()
            .header("content-type", "text/plain; version=0.0.4")
            .body(Full::new(Bytes::from(stats.render()))),
        _ => Response::builder()
            .status(StatusCode::NOT_FOUND)
            .body(Full::new(Bytes::new())),
    };
    Ok(response.unwrap_or_else(|_| Response::new(Full::new(Bytes::new()))))
}
