//! A client that asks `expect: 100-continue` (curl does for a body over 1 KB) gets its 100 at once,
//! though kvroute holds the request's headers until the body is in, and is routed on that body.

use crate::common;

use common::{chat_body, debug_config, system_prompt, Fleet};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expect_continue_gets_its_100_before_the_body_and_is_routed() {
    let fleet = Fleet::kvroute(4, debug_config(), |_| {}).await;
    let body = chat_body(&system_prompt(3), "q", false).to_string();
    let addr = fleet.envoy.url().replace("http://", "");
    let mut conn = tokio::net::TcpStream::connect(&addr)
        .await
        .expect("connect");
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: kvroute\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nexpect: 100-continue\r\nconnection: close\r\n\r\n",
        body.len()
    );
    conn.write_all(head.as_bytes()).await.expect("send headers");
    let mut first = vec![0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(5), conn.read(&mut first))
        .await
        .unwrap_or_else(|_| panic!("no 100 Continue in 5 s\n{}", fleet.envoy.log_tail()))
        .expect("read");
    let interim = String::from_utf8_lossy(&first[..n]).to_string();
    assert!(interim.starts_with("HTTP/1.1 100"), "{interim:?}");
    conn.write_all(body.as_bytes()).await.expect("send body");
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), conn.read_to_end(&mut raw))
        .await
        .expect("reply in 30 s")
        .expect("read reply");
    let text = String::from_utf8_lossy(&raw).to_ascii_lowercase();
    assert!(text.starts_with("http/1.1 200"), "{text}");
    assert!(text.contains("x-kvroute-decision: home"), "{text}");
}
