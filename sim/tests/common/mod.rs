//! Helpers for the end-to-end tests: start a fleet in-process and talk HTTP/1.1 to it.

#![allow(dead_code)]

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{HeaderMap, Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use kvroute_sim::fleet::Fleet;
use kvroute_sim::spec::FleetSpec;
use serde_json::Value;
use tokio::net::TcpStream;

/// A fleet running 1000x faster than real time, so tests take milliseconds.
pub async fn fast_fleet(replicas: usize) -> Fleet {
    let spec = FleetSpec {
        replicas,
        time_scale: 0.001,
        ..FleetSpec::default()
    };
    Fleet::start(spec, 0, 0).await.expect("fleet starts")
}

pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: String,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }

    pub fn replica(&self) -> Option<&str> {
        self.headers
            .get("x-sim-replica")
            .and_then(|v| v.to_str().ok())
    }
}

/// One request on a fresh connection.
pub async fn call(method: Method, url: &str, body: Option<&str>) -> std::io::Result<Reply> {
    let uri: hyper::Uri = url.parse().expect("valid url");
    let authority = uri.authority().expect("url has host").to_string();
    let stream = TcpStream::connect(&authority).await?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(std::io::Error::other)?;
    tokio::spawn(conn);
    let request = Request::builder()
        .method(method)
        .uri(uri.path_and_query().map_or("/", |p| p.as_str()))
        .header("host", authority)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.unwrap_or("").to_string())))
        .expect("valid request");
    let response = sender
        .send_request(request)
        .await
        .map_err(std::io::Error::other)?;
    let status = response.status();
    let headers = response.headers().clone();
    let bytes = response
        .into_body()
        .collect()
        .await
        .map_err(std::io::Error::other)?
        .to_bytes();
    Ok(Reply {
        status,
        headers,
        body: String::from_utf8_lossy(&bytes).into_owned(),
    })
}

pub async fn get(url: &str) -> Reply {
    call(Method::GET, url, None).await.expect("GET succeeds")
}

pub async fn post(url: &str, body: &str) -> Reply {
    call(Method::POST, url, Some(body))
        .await
        .expect("POST succeeds")
}

/// The token ids a replica at `base` gives `prompt` (its `/tokenize`).
pub async fn tokens_of(base: &str, prompt: &str) -> Vec<u64> {
    let body = serde_json::json!({ "prompt": prompt }).to_string();
    let tokens = post(&format!("{base}/tokenize"), &body).await.json();
    tokens["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .map(|t| t.as_u64().expect("a token id"))
        .collect()
}

/// Every message the replay socket at `addr` answers a request from message 0 with, as the
/// DEALER receives them (`["", topic, seq, payload]`), checked to end with the end marker.
pub async fn replay_all(addr: std::net::SocketAddr) -> Vec<Vec<Vec<u8>>> {
    use kvroute_sim::kv_events::END_SEQ;
    let mut dealer = kvroute_sim::zmtp::DealerSocket::connect(addr)
        .await
        .unwrap();
    dealer.send(&[b"", &0u64.to_be_bytes()]).await.unwrap();
    let mut messages = Vec::new();
    loop {
        let next = tokio::time::timeout(std::time::Duration::from_secs(10), dealer.recv()).await;
        let frames = next.expect("a replay message").unwrap();
        if frames[2] == END_SEQ {
            assert_eq!(frames, [b"".to_vec(), vec![], END_SEQ.to_vec(), vec![]]);
            return messages;
        }
        messages.push(frames);
    }
}
