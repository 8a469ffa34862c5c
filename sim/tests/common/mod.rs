//! Helpers for the end-to-end tests: start a fleet in-process and talk HTTP/1.1 to it.

#![allow(dead_code)]

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{HeaderMap, Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use kvroute_sim::fleet::Fleet;
use kvroute_sim::kv_events::END_SEQ;
use kvroute_sim::spec::FleetSpec;
use serde_json::Value;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::net::TcpStream;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

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

/// Field `key` of a msgpack map (a KV event), which must have it.
pub fn field<'a>(event: &'a rmpv::Value, key: &str) -> &'a rmpv::Value {
    event
        .as_map()
        .and_then(|m| m.iter().find(|(k, _)| k.as_str() == Some(key)))
        .map(|(_, v)| v)
        .unwrap_or_else(|| panic!("no {key} in {event}"))
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

/// A ZeroMQ SUB socket on the KV events at `addr`, subscribed to `topic`, once it has joined the
/// stream, and the number the stream's next message gets.
///
/// A PUB tells no one when a subscription has reached it, and sends a message only to the
/// subscriptions it has by then, so `probe(n)` runs for n = 0, 1, ... until the subscriber hears
/// one; it then reads on to the last probe's message. Each probe must publish exactly one
/// message, on a stream nothing else publishes to meanwhile: the last probe's number is then
/// the count of probes less one, which this checks (the stream numbers its messages from 0).
pub async fn joined(addr: SocketAddr, topic: &str, mut probe: impl FnMut(u64)) -> (SubSocket, u64) {
    let mut sub = SubSocket::new();
    sub.subscribe(topic).await.expect("subscribed");
    sub.connect(&format!("tcp://{addr}"))
        .await
        .expect("connected");
    let mut sent = 0;
    let first = {
        let mut heard = std::pin::pin!(sub.recv());
        loop {
            assert!(sent < 100, "the subscriber heard none of {sent} probes");
            probe(sent);
            sent += 1;
            let wait = Duration::from_millis(100);
            if let Ok(message) = tokio::time::timeout(wait, heard.as_mut()).await {
                break message.expect("a well-formed message");
            }
        }
    };
    let frames = first.into_vec();
    let mut seq = seq_of(&frames[1]);
    assert!(seq < sent, "heard message {seq} after {sent} probes");
    while seq + 1 < sent {
        let next = seq_of(&next_message(&mut sub).await[1]);
        assert_eq!(next, seq + 1, "messages numbered one by one");
        seq = next;
    }
    (sub, sent)
}

/// A message's number, from its 8 big-endian bytes.
pub fn seq_of(frame: &[u8]) -> u64 {
    u64::from_be_bytes(frame.try_into().expect("8 bytes"))
}

/// The next message on `socket`, each frame as bytes.
pub async fn next_message(socket: &mut impl SocketRecv) -> Vec<Vec<u8>> {
    let next = tokio::time::timeout(Duration::from_secs(10), socket.recv()).await;
    let message = next
        .expect("a message in time")
        .expect("a well-formed message");
    message.into_vec().into_iter().map(|f| f.to_vec()).collect()
}

/// Every message the replay socket at `addr` answers a request from message `start` with, as a
/// DEALER receives them (`["", topic, seq, payload]`), checked to end with the end marker.
pub async fn replay_from(addr: SocketAddr, start: u64) -> Vec<Vec<Vec<u8>>> {
    let mut dealer = DealerSocket::new();
    dealer
        .connect(&format!("tcp://{addr}"))
        .await
        .expect("connected");
    let request = vec![Bytes::new(), Bytes::copy_from_slice(&start.to_be_bytes())];
    let request = ZmqMessage::try_from(request).expect("frames");
    dealer.send(request).await.expect("sent");
    let mut messages = Vec::new();
    loop {
        let frames = next_message(&mut dealer).await;
        assert_eq!(frames.len(), 4, "{frames:?}");
        if frames[2] == END_SEQ {
            assert_eq!(frames, [b"".to_vec(), vec![], END_SEQ.to_vec(), vec![]]);
            return messages;
        }
        messages.push(frames);
    }
}
