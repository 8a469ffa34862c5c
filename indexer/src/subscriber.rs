//! Subscribing to one engine's KV events over ZeroMQ, and asking its replay socket for what a
//! gap lost, or, after a silence, whether the engine is up (a probe).
//!
//! vLLM's and SGLang's replay socket is a ROUTER: a DEALER sends `["", start_seq as 8 bytes
//! big-endian]` and gets back `["", topic, seq, payload]` for every buffered message from
//! `start_seq` on, then `["", "", -1 as 8 bytes, ""]` (vLLM 0.32, SGLang 0.5.23; older versions
//! of both send no topic frame).

use crate::dialect::Dialect;
use crate::state::Shared;
use crate::wire::{self, Batch};
use bytes::Bytes;
use std::sync::Arc;
use std::time::Duration;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

/// How long a replay may take before the gap counts as unfilled, or the engine as unreachable.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(3);
/// Pause between attempts to reach an engine that is down.
const RETRY: Duration = Duration::from_millis(500);

/// Runs stream `s` for as long as the process: connect, receive, reconnect.
pub async fn run(shared: Arc<Shared>, s: usize, topic: String) {
    let (url, replay, dialect) = {
        let index = shared.lock();
        let entry = &index.streams[s];
        (
            entry.url.clone(),
            entry.replay.clone(),
            entry.stream.dialect(),
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
            // With a replay socket, a silence is a question for the engine, not an answer.
            let next = match &replay {
                Some(_) => tokio::time::timeout(shared.staleness.silence, socket.recv()).await,
                None => Ok(socket.recv().await),
            };
            match (next, &replay) {
                (Ok(Ok(message)), _) => {
                    receive(&shared, s, replay.as_deref(), dialect, message).await
                }
                (Ok(Err(e)), _) => {
                    log::warn!("{url}: {e}");
                    break;
                }
                (Err(_), Some(replay)) => probe(&shared, s, replay, dialect).await,
                (Err(_), None) => {}
            }
        }
        shared.lock().streams[s].health.connected = false;
        tokio::time::sleep(RETRY).await;
    }
}

async fn receive(
    shared: &Shared,
    s: usize,
    replay: Option<&str>,
    dialect: Dialect,
    message: ZmqMessage,
) {
    let frames = message.into_vec();
    let batch = match wire::decode_message_as(&frames, dialect) {
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
        .receive(s, &batch, &shared.tokens, shared.now());
    if let crate::index::Received::Gap { from } = received {
        let replayed = match replay {
            Some(url) => fetch_replay(url, from, batch.seq, dialect)
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
            shared.now(),
            shared.staleness.after_gap,
        );
    }
}

/// Asks a silent engine's replay socket for its messages from the last one applied: an answer
/// proves the engine is up and fills what the stream missed; an answer without that message
/// (or with another message of that number) means the engine restarted, and its new run is
/// asked for from the start; no answer in time makes the stream stale.
async fn probe(shared: &Shared, s: usize, url: &str, dialect: Dialect) {
    let last = shared.lock().streams[s].last_applied();
    let from = last.map_or(0, |(seq, _)| seq);
    let mut answer = fetch_replay(url, from, u64::MAX, dialect).await;
    let restarted = matches!(&answer, Ok(batches) if shows_restart(batches, last));
    if restarted {
        answer = fetch_replay(url, 0, u64::MAX, dialect).await;
    }
    let mut index = shared.lock();
    match answer {
        Ok(batches) => index.answered(
            s,
            restarted,
            &batches,
            &shared.tokens,
            shared.now(),
            shared.staleness.after_gap,
        ),
        Err(e) => {
            if index.unanswered(s) {
                log::warn!("{url}: no answer to a probe ({e}): stale until heard again");
            }
        }
    }
}

/// Whether a probe's answer (the replay from the last message applied, `last`) shows that the
/// engine restarted: it no longer has that message, or has another message of its number.
pub fn shows_restart(answer: &[Batch], last: Option<(u64, u64)>) -> bool {
    match (answer.first(), last) {
        (Some(first), Some((seq, digest))) => first.seq == seq && first.digest != digest,
        (None, Some(_)) => true,
        (_, None) => false,
    }
}

/// Asks the replay socket at `url` of an engine of `dialect` for messages `from..until`.
pub async fn fetch_replay(
    url: &str,
    from: u64,
    until: u64,
    dialect: Dialect,
) -> Result<Vec<Batch>, String> {
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
            let Some(batch) = replayed(&frames, dialect)? else {
                return Ok(batches);
            };
            if batch.seq >= until {
                return Ok(batches);
            }
            batches.push(batch);
        }
    })
    .await
    .map_err(|_| "timed out".to_string())?
}

/// One message of a replay, as a DEALER receives it (`["", topic, seq, payload]`, or without
/// the topic frame); `None` for the end marker.
pub fn replayed(frames: &[Bytes], dialect: Dialect) -> Result<Option<Batch>, String> {
    let frames = match frames.split_first() {
        Some((empty, rest)) if empty.is_empty() => rest,
        _ => frames,
    };
    let seq = match frames {
        [_, seq, _] | [seq, _] => seq,
        _ => return Err(format!("replay message of {} frames", frames.len())),
    };
    if seq.as_ref() == (-1i64).to_be_bytes() {
        return Ok(None);
    }
    wire::decode_message_as(frames, dialect)
        .map(Some)
        .map_err(|e| e.to_string())
}

/// Where one stream comes from: its endpoint, the model it serves, its publisher (and replay
/// socket) and which engine publishes.
#[derive(Debug, Clone, Copy)]
pub struct Source<'a> {
    pub endpoint: &'a str,
    pub model: &'a str,
    pub url: &'a str,
    pub replay: Option<&'a str>,
    pub dialect: Dialect,
}

/// Adds a stream from `source` and starts subscribing to `topic`.
pub fn spawn(shared: &Arc<Shared>, source: Source<'_>, topic: &str) {
    let Source {
        endpoint,
        model,
        url,
        replay,
        dialect,
    } = source;
    let s = shared
        .lock()
        .add_stream_as(endpoint, model, url, replay, dialect);
    tokio::spawn(run(shared.clone(), s, topic.to_owned()));
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_sim::kv_events::{encode_batch, Format};

    fn frames(parts: &[&[u8]]) -> Vec<Bytes> {
        parts.iter().map(|p| Bytes::copy_from_slice(p)).collect()
    }

    #[test]
    fn replay_messages_parse_with_and_without_the_topic_frame() {
        let payload = encode_batch(0.0, &[], 16, Format::Map);
        let seq = 7u64.to_be_bytes();
        let end = (-1i64).to_be_bytes();
        for message in [
            frames(&[b"", b"kv-events", &seq, &payload]),
            frames(&[b"", b"", &seq, &payload]),
            frames(&[b"", &seq, &payload]),
        ] {
            let batch = replayed(&message, Dialect::Vllm).unwrap().unwrap();
            assert_eq!(batch.seq, 7);
        }
        let end_marker = replayed(&frames(&[b"", b"", &end, b""]), Dialect::Sglang);
        assert!(end_marker.unwrap().is_none());
        let bare_end = replayed(&frames(&[b"", &end, b""]), Dialect::Vllm);
        assert!(bare_end.unwrap().is_none());
        assert!(replayed(&frames(&[b"", &seq]), Dialect::Vllm).is_err());
    }
}
