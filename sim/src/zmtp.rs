//! A minimal ZeroMQ PUB socket, and a ROUTER that answers each request (ZMTP 3.0, NULL
//! security) over tokio TCP.
//!
//! Why not a ZeroMQ crate: a PUB socket only needs the greeting, the READY handshake,
//! subscription messages and multipart frames, about two hundred lines, and a ROUTER that only
//! answers requests on the connection they came by needs no identities; the pure-Rust
//! `zeromq` crate would add a dozen dependencies (regex, dashmap, futures...) to a build that
//! must stay light. Interoperability with libzmq SUB sockets (pyzmq, the `zmq` crate used by
//! vllm-router) was checked by hand; see sim/README.md.
//!
//! Semantics follow libzmq's PUB: a message goes to every connected subscriber whose
//! subscription is a prefix of the first frame; subscribers that connect late miss earlier
//! messages; a subscriber that falls `HWM` messages behind loses messages instead of
//! slowing the publisher. The ROUTER's replies go back on the connection of the request; a
//! peer sees them as libzmq's ROUTER would send them (the routing identity is the connection).

use bytes::Bytes;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

/// Messages queued per subscriber before new ones are dropped (vLLM uses 100,000).
const HWM: usize = 100_000;
const FLAG_MORE: u8 = 0x01;
const FLAG_LONG: u8 = 0x02;
const FLAG_COMMAND: u8 = 0x04;
/// Largest frame accepted from a subscriber (they only send subscriptions).
const MAX_INBOUND_FRAME: u64 = 1 << 20;

type Message = Arc<Vec<Bytes>>;

struct Peer {
    subscriptions: Arc<Mutex<Vec<Vec<u8>>>>,
    tx: mpsc::Sender<Message>,
}

/// The publishing side; cheap to clone.
#[derive(Clone)]
pub struct PubSocket {
    peers: Arc<Mutex<Vec<Peer>>>,
}

impl PubSocket {
    /// Binds `addr` and accepts subscribers in the background.
    pub async fn bind(addr: SocketAddr) -> io::Result<(PubSocket, SocketAddr)> {
        let listener = TcpListener::bind(addr).await?;
        let local = listener.local_addr()?;
        let socket = PubSocket {
            peers: Arc::new(Mutex::new(Vec::new())),
        };
        let peers = socket.peers.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let peers = peers.clone();
                tokio::spawn(async move {
                    // A failed handshake is a client problem; drop the connection.
                    let _ = accept_subscriber(stream, peers).await;
                });
            }
        });
        Ok((socket, local))
    }

    /// Sends a multipart message to every matching subscriber without waiting.
    pub fn send(&self, frames: Vec<Bytes>) {
        let Some(topic) = frames.first().cloned() else {
            return;
        };
        let message: Message = Arc::new(frames);
        let mut peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        peers.retain(|peer| !peer.tx.is_closed());
        for peer in peers.iter() {
            let subs = peer.subscriptions.lock().unwrap_or_else(|e| e.into_inner());
            if subs.iter().any(|s| topic.starts_with(s)) {
                // Full queue: drop, as libzmq does at the high-water mark.
                let _ = peer.tx.try_send(message.clone());
            }
        }
    }

    /// Number of connected subscribers (for tests and readiness checks).
    pub fn peer_count(&self) -> usize {
        let peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        peers.iter().filter(|p| !p.tx.is_closed()).count()
    }
}

/// Our 64-byte greeting: signature, version 3.0, NULL mechanism, not a server.
pub fn greeting() -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xFF;
    g[9] = 0x7F;
    g[10] = 3;
    g[11] = 0;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// A READY command announcing `socket_type`.
pub fn ready_command(socket_type: &str) -> Vec<u8> {
    let mut body = Vec::new();
    body.push(5);
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
    body.extend_from_slice(socket_type.as_bytes());
    encode_frame(&body, FLAG_COMMAND)
}

/// One frame on the wire: flags, short or long size, body.
pub fn encode_frame(body: &[u8], flags: u8) -> Vec<u8> {
    let mut out = Vec::with_capacity(body.len() + 9);
    if body.len() < 256 {
        out.push(flags);
        out.push(body.len() as u8);
    } else {
        out.push(flags | FLAG_LONG);
        out.extend_from_slice(&(body.len() as u64).to_be_bytes());
    }
    out.extend_from_slice(body);
    out
}

/// Reads one frame: (flags, body).
pub async fn read_frame<R: AsyncReadExt + Unpin>(r: &mut R) -> io::Result<(u8, Vec<u8>)> {
    let flags = r.read_u8().await?;
    let len = if flags & FLAG_LONG != 0 {
        r.read_u64().await?
    } else {
        u64::from(r.read_u8().await?)
    };
    if len > MAX_INBOUND_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "frame too large",
        ));
    }
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body).await?;
    Ok((flags, body))
}

/// Exchanges greetings and READY commands; returns the peer's socket type.
pub async fn handshake(stream: &mut TcpStream, our_type: &str) -> io::Result<String> {
    stream.write_all(&greeting()).await?;
    let mut theirs = [0u8; 64];
    stream.read_exact(&mut theirs).await?;
    if theirs[0] != 0xFF || theirs[9] & 0x01 != 0x01 || theirs[10] < 3 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "not a ZMTP 3 peer",
        ));
    }
    if &theirs[12..16] != b"NULL" {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "only the NULL mechanism is supported",
        ));
    }
    stream.write_all(&ready_command(our_type)).await?;
    let (flags, body) = read_frame(stream).await?;
    if flags & FLAG_COMMAND == 0 || !body.starts_with(b"\x05READY") {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "expected READY"));
    }
    Ok(socket_type_of(&body[6..]).unwrap_or_default())
}

/// The Socket-Type property of READY metadata.
fn socket_type_of(mut props: &[u8]) -> Option<String> {
    while let Some((&name_len, rest)) = props.split_first() {
        let name = rest.get(..name_len as usize)?;
        let rest = &rest[name_len as usize..];
        let value_len = u32::from_be_bytes(rest.get(..4)?.try_into().ok()?) as usize;
        let value = rest.get(4..4 + value_len)?;
        if name.eq_ignore_ascii_case(b"Socket-Type") {
            return Some(String::from_utf8_lossy(value).into_owned());
        }
        props = &rest[4 + value_len..];
    }
    None
}

async fn accept_subscriber(mut stream: TcpStream, peers: Arc<Mutex<Vec<Peer>>>) -> io::Result<()> {
    let _ = stream.set_nodelay(true);
    let peer_type = handshake(&mut stream, "PUB").await?;
    if peer_type != "SUB" && peer_type != "XSUB" {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "PUB only accepts SUB peers",
        ));
    }
    let (reader, writer) = stream.into_split();
    let subscriptions = Arc::new(Mutex::new(Vec::new()));
    let (tx, rx) = mpsc::channel(HWM);
    peers.lock().unwrap_or_else(|e| e.into_inner()).push(Peer {
        subscriptions: subscriptions.clone(),
        tx,
    });
    tokio::spawn(write_messages(writer, rx));
    read_subscriptions(reader, subscriptions).await
}

/// A multipart message on the wire: every frame but the last flagged MORE.
pub fn encode_message<B: AsRef<[u8]>>(frames: &[B]) -> Vec<u8> {
    let mut wire = Vec::new();
    for (i, frame) in frames.iter().enumerate() {
        let more = if i + 1 < frames.len() { FLAG_MORE } else { 0 };
        wire.extend_from_slice(&encode_frame(frame.as_ref(), more));
    }
    wire
}

/// Reads one multipart message, skipping commands (a peer's PING, for one).
pub async fn read_message<R: AsyncReadExt + Unpin>(r: &mut R) -> io::Result<Vec<Vec<u8>>> {
    let mut frames = Vec::new();
    loop {
        let (flags, body) = read_frame(r).await?;
        if flags & FLAG_COMMAND != 0 {
            continue;
        }
        frames.push(body);
        if flags & FLAG_MORE == 0 {
            return Ok(frames);
        }
    }
}

async fn write_messages(mut writer: OwnedWriteHalf, mut rx: mpsc::Receiver<Message>) {
    while let Some(message) = rx.recv().await {
        if writer.write_all(&encode_message(&message)).await.is_err() {
            return;
        }
    }
}

/// Applies (un)subscriptions until the subscriber disconnects. ZMTP 3.0 peers send them
/// as messages prefixed 1/0; ZMTP 3.1 peers may send SUBSCRIBE/CANCEL commands.
async fn read_subscriptions(
    mut reader: OwnedReadHalf,
    subs: Arc<Mutex<Vec<Vec<u8>>>>,
) -> io::Result<()> {
    loop {
        let (flags, body) = read_frame(&mut reader).await?;
        let change = if flags & FLAG_COMMAND != 0 {
            if let Some(topic) = body.strip_prefix(b"\x09SUBSCRIBE") {
                Some((true, topic.to_vec()))
            } else {
                body.strip_prefix(b"\x06CANCEL")
                    .map(|topic| (false, topic.to_vec()))
            }
        } else {
            match body.split_first() {
                Some((1, topic)) => Some((true, topic.to_vec())),
                Some((0, topic)) => Some((false, topic.to_vec())),
                _ => None,
            }
        };
        let Some((subscribe, topic)) = change else {
            continue;
        };
        let mut subs = subs.lock().unwrap_or_else(|e| e.into_inner());
        if subscribe {
            subs.push(topic);
        } else if let Some(i) = subs.iter().position(|s| *s == topic) {
            subs.remove(i);
        }
    }
}

/// How a ROUTER answers one request: the frames a peer sent (without a routing identity), and
/// the messages to send back to it (none: the request is dropped).
pub type Answer = dyn Fn(Vec<Vec<u8>>) -> Vec<Vec<Bytes>> + Send + Sync;

/// Binds a ROUTER socket on `addr` and answers every request of its DEALER, REQ or ROUTER peers
/// with `answer`'s messages, in the background.
pub async fn bind_router(addr: SocketAddr, answer: Arc<Answer>) -> io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let answer = answer.clone();
            tokio::spawn(async move {
                // A failed handshake or a peer gone is the peer's problem; drop the connection.
                let _ = serve_requests(stream, answer).await;
            });
        }
    });
    Ok(local)
}

async fn serve_requests(mut stream: TcpStream, answer: Arc<Answer>) -> io::Result<()> {
    let _ = stream.set_nodelay(true);
    let peer_type = handshake(&mut stream, "ROUTER").await?;
    if !matches!(peer_type.as_str(), "DEALER" | "REQ" | "ROUTER") {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "ROUTER only accepts DEALER, REQ and ROUTER peers",
        ));
    }
    loop {
        let request = read_message(&mut stream).await?;
        let mut wire = Vec::new();
        for message in answer(request) {
            wire.extend_from_slice(&encode_message(&message));
        }
        stream.write_all(&wire).await?;
    }
}

/// A tiny DEALER client, for tests: sends requests to a ROUTER and reads its replies.
pub struct DealerSocket {
    stream: TcpStream,
}

impl DealerSocket {
    pub async fn connect(addr: SocketAddr) -> io::Result<DealerSocket> {
        let mut stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        handshake(&mut stream, "DEALER").await?;
        Ok(DealerSocket { stream })
    }

    pub async fn send(&mut self, frames: &[&[u8]]) -> io::Result<()> {
        self.stream.write_all(&encode_message(frames)).await
    }

    /// Receives one multipart message.
    pub async fn recv(&mut self) -> io::Result<Vec<Vec<u8>>> {
        read_message(&mut self.stream).await
    }
}

/// A tiny SUB client, enough for tests and the smoke check in sim/README.md.
pub struct SubSocket {
    stream: TcpStream,
}

impl SubSocket {
    pub async fn connect(addr: SocketAddr, topic: &[u8]) -> io::Result<SubSocket> {
        let mut stream = TcpStream::connect(addr).await?;
        // As libzmq does; without it Nagle holds the subscription back for a delayed ACK.
        stream.set_nodelay(true)?;
        handshake(&mut stream, "SUB").await?;
        let mut body = vec![1u8];
        body.extend_from_slice(topic);
        stream.write_all(&encode_frame(&body, 0)).await?;
        Ok(SubSocket { stream })
    }

    /// Receives one multipart message.
    pub async fn recv(&mut self) -> io::Result<Vec<Vec<u8>>> {
        read_message(&mut self.stream).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    async fn wait_for_peers(socket: &PubSocket, n: usize) {
        for _ in 0..200 {
            if socket.peer_count() >= n {
                // Subscriptions travel after the handshake; give them a moment.
                tokio::time::sleep(Duration::from_millis(20)).await;
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        panic!("subscriber never connected");
    }

    #[tokio::test]
    async fn subscriber_receives_matching_multipart_messages_only() {
        let (socket, addr) = PubSocket::bind("127.0.0.1:0".parse().unwrap())
            .await
            .unwrap();
        let mut sub = SubSocket::connect(addr, b"kv").await.unwrap();
        wait_for_peers(&socket, 1).await;
        socket.send(vec![Bytes::from_static(b"other"), Bytes::from_static(b"x")]);
        let big = Bytes::from(vec![7u8; 300]);
        socket.send(vec![
            Bytes::from_static(b"kv-events"),
            Bytes::from_static(b"12345678"),
            big.clone(),
        ]);
        let frames = tokio::time::timeout(Duration::from_secs(2), sub.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            frames,
            vec![b"kv-events".to_vec(), b"12345678".to_vec(), big.to_vec()]
        );
    }

    async fn recv(s: &mut DealerSocket) -> Vec<Vec<u8>> {
        let next = tokio::time::timeout(Duration::from_secs(2), s.recv()).await;
        next.unwrap().unwrap()
    }

    #[tokio::test]
    async fn a_router_answers_each_request_on_its_own_connection() {
        let echo: Arc<Answer> = Arc::new(|request: Vec<Vec<u8>>| {
            let last = Bytes::from(request.last().cloned().unwrap_or_default());
            vec![
                vec![Bytes::new(), last.clone()],
                vec![Bytes::new(), last, Bytes::from_static(b"end")],
            ]
        });
        let addr = bind_router("127.0.0.1:0".parse().unwrap(), echo)
            .await
            .unwrap();
        let mut a = DealerSocket::connect(addr).await.unwrap();
        let mut b = DealerSocket::connect(addr).await.unwrap();
        b.send(&[b"", b"to b"]).await.unwrap();
        a.send(&[b"", b"to a"]).await.unwrap();
        assert_eq!(recv(&mut a).await, vec![b"".to_vec(), b"to a".to_vec()]);
        assert_eq!(recv(&mut a).await[2], b"end");
        assert_eq!(recv(&mut b).await, vec![b"".to_vec(), b"to b".to_vec()]);
    }

    #[test]
    fn frames_use_long_size_above_255_bytes() {
        assert_eq!(encode_frame(b"ab", FLAG_MORE), vec![1, 2, b'a', b'b']);
        let long = encode_frame(&[0u8; 300], 0);
        assert_eq!(long[0], FLAG_LONG);
        assert_eq!(&long[1..9], &300u64.to_be_bytes());
    }

    #[test]
    fn ready_metadata_round_trips() {
        let cmd = ready_command("PUB");
        assert_eq!(cmd[0], FLAG_COMMAND);
        assert_eq!(socket_type_of(&cmd[2 + 6..]).as_deref(), Some("PUB"));
    }
}
