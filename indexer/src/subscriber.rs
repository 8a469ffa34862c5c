//! Subscribing to one engine's KV events over ZeroMQ, and asking its replay socket for what a
//! gap lost.
//!
//! vLLM's replay socket is a ROUTER: a DEALER sends `["", start_seq as 8 bytes big-endian]` and
//! gets back `["", seq, payload]` for every buffered message from `start_seq` on, then
//! `["", -1 as 8 bytes, ""]`.

use crate::state::Shared;
use crate::wire::{self, Batch};
use bytes::Bytes;
use std::sync::Arc;
use std::time::{Duration, Instant};
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

/// How long a replay may take before the gap counts as unfilled.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(3);
/// Pause between attempts to reach an engine that is down.
const RETRY: Duration = Duration::from_millis(500);

/// Runs stream `s` for as long as the process: connect, receive, reconnect.
pub async fn run(shared: Arc<Shared>, s: usize, topic: String) {
    let (url, replay) = {
        let index = shared.lock();
        (
            index.streams[s].url.clone(),
            index.streams[s].replay.clone(),
        )
    };
    loop {
        let mut socket = SubSocket::new();
        if let Err(e) = socket.subscribe(&topic).await {
            log::warn!("{url}: cannot subscribe: {e}");
        }
        if let Err(e) = socket.connect(&url).await {
            log::debug!("{url}: cannot connect: {e}");
            tokio::time::sleep(RETRY).await;
            continue;
        }
        log::info!("{url}: subscribed");
        shared.lock().streams[s].health.connected = true;
        loop {
            match socket.recv().await {
                Ok(message) => receive(&shared, s, replay.as_deref(), message).await,
                Err(e) => {
                    log::warn!("{url}: {e}");
                    break;
                }
            }
        }
        shared.lock().streams[s].health.connected = false;
        tokio::time::sleep(RETRY).await;
    }
}

async fn receive(shared: &Shared, s: usize, replay: Option<&str>, message: ZmqMessage) {
    let frames = message.into_vec();
    let batch = match wire::decode_message(&frames) {
        Ok(batch) => batch,
        Err(e) => {
            let mut index = shared.lock();
            index.streams[s].health.undecodable += 1;
            log::warn!("{}: undecodable message: {e}", index.streams[s].url);
            return;
        }
    };
    let received = shared
        .lock()
        .receive(s, &batch, &shared.tokens, Instant::now());
    if let crate::index::Received::Gap { from } = received {
        let replayed = match replay {
            Some(url) => fetch_replay(url, from, batch.seq)
                .await
                .unwrap_or_else(|e| {
                    log::warn!("{url}: replay from {from} failed: {e}");
                    Vec::new()
                }),
            None => Vec::new(),
        };
        shared.lock().repair(
            s,
            &replayed,
            &batch,
            &shared.tokens,
            Instant::now(),
            shared.staleness.after_gap,
        );
    }
}

/// Asks the replay socket at `url` for messages `from..until`.
pub async fn fetch_replay(url: &str, from: u64, until: u64) -> Result<Vec<Batch>, String> {
    tokio::time::timeout(REPLAY_TIMEOUT, async {
        let mut socket = DealerSocket::new();
        socket.connect(url).await.map_err(|e| e.to_string())?;
        let request: ZmqMessage = vec![Bytes::new(), Bytes::copy_from_slice(&from.to_be_bytes())]
            .try_into()
            .map_err(|e: zeromq::ZmqEmptyMessageError| e.to_string())?;
        socket.send(request).await.map_err(|e| e.to_string())?;
        let mut batches = Vec::new();
        loop {
            let frames = socket.recv().await.map_err(|e| e.to_string())?.into_vec();
            let frames = match frames.split_first() {
                Some((empty, rest)) if empty.is_empty() => rest.to_vec(),
                _ => frames,
            };
            let [seq, payload] = frames.as_slice() else {
                return Err(format!("replay message of {} frames", frames.len()));
            };
            if seq.as_ref() == (-1i64).to_be_bytes() {
                return Ok(batches);
            }
            let batch = wire::decode_message(&[seq, payload]).map_err(|e| e.to_string())?;
            if batch.seq >= until {
                return Ok(batches);
            }
            batches.push(batch);
        }
    })
    .await
    .map_err(|_| "timed out".to_string())?
}

/// Adds a stream for `endpoint` from the publisher at `url` and starts subscribing.
pub fn spawn(
    shared: &Arc<Shared>,
    endpoint: &str,
    model: &str,
    url: &str,
    replay: Option<&str>,
    topic: &str,
) {
    let s = shared.lock().add_stream(endpoint, model, url, replay);
    tokio::spawn(run(shared.clone(), s, topic.to_owned()));
}
