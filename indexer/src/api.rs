//! The HTTP API the filter polls: the change feed, Prometheus metrics and health.
//!
//! `GET /v1/changes?since=V&epoch=E[&limit=N]` answers
//! `{"epoch":E,"version":V2,"full":bool,"endpoints":["ip:port",..],"stale":["ip:port",..],
//! "changes":[[endpoint_index,1|0,key],..]}`. Apply `changes` in order (1: the endpoint holds
//! the key, 0: it no longer does) after dropping everything when `full`, then ask again with
//! `since=V2&epoch=E`. A client without a version, from another epoch, or too far behind gets
//! `full`. Each answer stands alone, so any number of clients can poll one indexer.

use crate::holders::Delta;
use crate::index::Index;
use crate::metrics;
use crate::state::{Serving, Shared};
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use std::convert::Infallible;
use std::fmt::Write;
use std::ops::Deref;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

/// Changes per answer unless the client asks for fewer.
pub const DEFAULT_LIMIT: usize = 1 << 16;

type Resp = Response<Full<Bytes>>;

fn respond(status: StatusCode, content_type: &'static str, body: String) -> Resp {
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    resp
}

/// Serves the API on `listener` until the process ends.
pub async fn serve(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let shared = shared.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req| {
                let shared = shared.clone();
                async move { Ok::<_, Infallible>(route(&shared, &req)) }
            });
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

fn route(shared: &Shared, req: &Request<Incoming>) -> Resp {
    if req.method() != Method::GET {
        return respond(StatusCode::METHOD_NOT_ALLOWED, "text/plain", String::new());
    }
    let uri = req.uri();
    let (status, content_type, body) = get(
        || shared.lock(),
        shared.serving(),
        uri.path(),
        uri.query().unwrap_or(""),
        shared.now(),
    );
    respond(status, content_type, body)
}

/// The answer to `GET path?query` at `now`: its status, content type and body. `index` gives
/// the index for as long as the answer reads it (the server's lock: the change feed is written
/// out after it is let go).
pub fn get<G: Deref<Target = Index>>(
    index: impl FnOnce() -> G,
    serving: Serving,
    path: &str,
    query: &str,
    now: Duration,
) -> (StatusCode, &'static str, String) {
    match path {
        "/v1/changes" => match Query::parse(query) {
            Ok(q) => {
                let answer = changes(&index(), serving, &q, now);
                (StatusCode::OK, "application/json", answer.encode())
            }
            Err(e) => (StatusCode::BAD_REQUEST, "text/plain", e),
        },
        "/metrics" => (
            StatusCode::OK,
            "text/plain; version=0.0.4",
            metrics::render(&index(), serving, now),
        ),
        "/health" => (
            StatusCode::OK,
            "application/json",
            metrics::health(&index(), serving, now),
        ),
        _ => (StatusCode::NOT_FOUND, "text/plain", String::new()),
    }
}

/// The parameters of `/v1/changes`.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Query {
    pub since: Option<u64>,
    pub epoch: Option<u64>,
    pub limit: Option<usize>,
}

impl Query {
    pub fn parse(query: &str) -> Result<Query, String> {
        let mut q = Query::default();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            let number = || {
                value
                    .parse::<u64>()
                    .map_err(|_| format!("{name}: not a number: {value:?}"))
            };
            match name {
                "since" => q.since = Some(number()?),
                "epoch" => q.epoch = Some(number()?),
                "limit" => q.limit = Some(number()?.max(1) as usize),
                _ => {}
            }
        }
        Ok(q)
    }
}

/// A `/v1/changes` answer, before it is written out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Changes {
    pub epoch: u64,
    pub delta: Delta,
    /// Every endpoint's name, by index.
    pub endpoints: Vec<String>,
    /// Indexes of the endpoints stale now.
    pub stale: Vec<u32>,
}

/// The `/v1/changes` answer of the index for `q` at `now`.
pub fn changes(index: &Index, serving: Serving, q: &Query, now: Duration) -> Changes {
    let since = q.since.filter(|_| q.epoch == Some(serving.epoch));
    Changes {
        epoch: serving.epoch,
        delta: index.holders.since(since, q.limit.unwrap_or(DEFAULT_LIMIT)),
        endpoints: index.holders.endpoints().to_vec(),
        stale: index.stale_endpoints(now, serving.staleness),
    }
}

impl Changes {
    /// The answer as the API's JSON.
    pub fn encode(&self) -> String {
        let (delta, endpoints) = (&self.delta, &self.endpoints);
        let mut out = String::with_capacity(128 + delta.changes.len() * 26);
        let names = |ids: &mut dyn Iterator<Item = &String>| {
            ids.map(|e| serde_json::Value::from(e.as_str()).to_string())
                .collect::<Vec<_>>()
                .join(",")
        };
        let _ = write!(
            out,
            "{{\"epoch\":{},\"version\":{},\"full\":{},\"endpoints\":[{}],\"stale\":[{}],\"changes\":[",
            self.epoch,
            delta.version,
            delta.full,
            names(&mut endpoints.iter()),
            names(&mut self.stale.iter().filter_map(|&e| endpoints.get(e as usize))),
        );
        for (i, c) in delta.changes.iter().enumerate() {
            let sep = if i == 0 { "" } else { "," };
            let _ = write!(out, "{sep}[{},{},{}]", c.endpoint, u8::from(c.held), c.key);
        }
        out.push_str("]}");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::holders::Change;

    #[test]
    fn queries_parse_and_bad_numbers_are_refused() {
        assert_eq!(
            Query::parse("since=5&epoch=9&limit=0&x=1").unwrap(),
            Query {
                since: Some(5),
                epoch: Some(9),
                limit: Some(1)
            }
        );
        assert_eq!(Query::parse("").unwrap(), Query::default());
        assert!(Query::parse("since=-1").is_err());
    }

    #[test]
    fn the_answer_is_flat_json() {
        let delta = Delta {
            version: 3,
            full: false,
            changes: vec![
                Change {
                    endpoint: 1,
                    held: true,
                    key: u64::MAX,
                },
                Change {
                    endpoint: 0,
                    held: false,
                    key: 5,
                },
            ],
        };
        let answer = Changes {
            epoch: 7,
            delta,
            endpoints: vec!["a:1".into(), "b:2".into()],
            stale: vec![1],
        };
        let text = answer.encode();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["epoch"], 7);
        assert_eq!(v["stale"], serde_json::json!(["b:2"]));
        assert_eq!(v["changes"][0][2].as_u64(), Some(u64::MAX));
        assert_eq!(v["changes"][1], serde_json::json!([0, 0, 5]));
    }
}
