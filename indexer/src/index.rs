//! The whole index: every stream's blocks, the endpoints' keys, and each stream's sequence and
//! health (gaps, restarts, reachability).
//!
//! A stream's messages are numbered from 0. The next expected number applies; a smaller one
//! means the engine restarted (its cache is empty: the stream starts over); a larger one is a
//! gap, which the subscriber tries to fill from the engine's replay socket. A gap that cannot
//! be filled drops the stream's blocks (what it holds now is partly unknown) and keeps the
//! stream stale for a while, so the filter falls back to its own guesses for that endpoint.
//!
//! An idle engine sends nothing (vLLM has no heartbeat), and its cache does not change while
//! it is idle, so silence alone is no evidence. An engine with a replay socket is asked, after
//! a silence, for what followed the last message applied (a probe): an answer proves it is up,
//! fills what the stream missed, and shows a restart (the engine no longer has that message);
//! no answer makes the stream stale. An engine without one is stale after the silence.
//!
//! Times are the indexer's clock: a monotonic [`Duration`] since it started, which the caller
//! supplies (the server its elapsed time, a virtual-time lab its own).

use crate::chains::{Shape, Stream};
use crate::dialect::Dialect;
use crate::holders::Holders;
use crate::token_bytes::TokenBytes;
use crate::wire::Batch;
use std::ops::Range;
use std::time::Duration;

/// When streams count as stale.
#[derive(Debug, Clone, Copy)]
pub struct Staleness {
    /// A stream that has sent nothing for this long is probed through its replay socket; one
    /// without a replay socket is stale (so an idle engine goes stale too, and fresh again
    /// with its next message).
    pub silence: Duration,
    /// How long a stream stays stale after a gap it could not fill.
    pub after_gap: Duration,
}

/// Health counters of one stream.
#[derive(Debug, Clone, Default)]
pub struct Health {
    pub gaps: u64,
    /// Gaps filled from the replay socket.
    pub resyncs: u64,
    /// Gaps not filled: the stream's blocks were dropped.
    pub drops: u64,
    pub restarts: u64,
    pub undecodable: u64,
    /// Probes the replay socket answered.
    pub probes: u64,
    /// Probes it did not answer in time.
    pub unanswered: u64,
    /// The last probe went unanswered, and nothing has been heard since.
    pub unreachable: bool,
    pub connected: bool,
    pub last_heard: Option<Duration>,
    pub stale_until: Option<Duration>,
}

#[derive(Debug)]
pub struct StreamEntry {
    /// The publisher's address (`tcp://host:port`).
    pub url: String,
    pub replay: Option<String>,
    pub stream: Stream,
    pub health: Health,
    expected: Option<u64>,
    /// The number and digest of the last message applied.
    last: Option<(u64, u64)>,
    /// Numbers a probe applied: the same messages may still arrive on the stream.
    replayed: Option<Range<u64>>,
}

impl StreamEntry {
    /// The sequence number expected next (none before the first message).
    pub fn next_seq(&self) -> Option<u64> {
        self.expected
    }

    /// The number and digest of the last message applied (none before the first).
    pub fn last_applied(&self) -> Option<(u64, u64)> {
        self.last
    }
}

/// What to do with a received batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Received {
    Applied,
    /// A message a probe already applied: ignored.
    Duplicate,
    /// Messages `from..batch.seq` are missing: fill them, then call [`Index::repair`].
    Gap {
        from: u64,
    },
}

#[derive(Debug)]
pub struct Index {
    pub holders: Holders,
    pub streams: Vec<StreamEntry>,
    chunk_size: usize,
}

impl Index {
    pub fn new(chunk_size: usize, feed_capacity: usize) -> Index {
        Index {
            holders: Holders::new(feed_capacity),
            streams: Vec::new(),
            chunk_size,
        }
    }

    /// Adds a vLLM stream publishing for endpoint `endpoint` (`ip:port`); returns its number.
    pub fn add_stream(
        &mut self,
        endpoint: &str,
        model: &str,
        url: &str,
        replay: Option<&str>,
    ) -> usize {
        self.add_stream_as(endpoint, model, url, replay, Dialect::Vllm)
    }

    /// [`Index::add_stream`] for an engine of `dialect`.
    pub fn add_stream_as(
        &mut self,
        endpoint: &str,
        model: &str,
        url: &str,
        replay: Option<&str>,
        dialect: Dialect,
    ) -> usize {
        let e = self.holders.endpoint(endpoint);
        let shape = Shape {
            model: model.to_owned(),
            chunk_size: self.chunk_size,
        };
        self.streams.push(StreamEntry {
            url: url.to_owned(),
            replay: replay.map(str::to_owned),
            stream: Stream::with_dialect(e, shape, dialect),
            health: Health::default(),
            expected: None,
            last: None,
            replayed: None,
        });
        self.streams.len() - 1
    }

    /// Takes message `batch` of stream `s`, unless messages before it are missing.
    pub fn receive(
        &mut self,
        s: usize,
        batch: &Batch,
        tokens: &TokenBytes,
        now: Duration,
    ) -> Received {
        let entry = &mut self.streams[s];
        entry.health.last_heard = Some(now);
        entry.health.unreachable = false;
        if let Some(replayed) = entry.replayed.take() {
            if replayed.contains(&batch.seq) {
                entry.replayed = Some(replayed);
                return Received::Duplicate;
            }
        }
        match entry.expected {
            Some(e) if batch.seq > e => {
                entry.health.gaps += 1;
                return Received::Gap { from: e };
            }
            Some(e) if batch.seq < e => {
                entry.health.restarts += 1;
                log::warn!(
                    "{}: sequence went back from {e} to {}: engine restarted",
                    entry.url,
                    batch.seq
                );
                entry.stream.clear(&mut self.holders);
            }
            _ => {}
        }
        self.apply(s, batch, tokens);
        Received::Applied
    }

    /// Finishes a gap before `batch`: `replayed` are the messages the replay socket gave (in
    /// order); when they do not reach from the gap to `batch`, the stream's blocks are dropped
    /// and it is stale for `hold`.
    pub fn repair(
        &mut self,
        s: usize,
        replayed: &[Batch],
        batch: &Batch,
        tokens: &TokenBytes,
        now: Duration,
        hold: Duration,
    ) {
        let from = self.streams[s].expected.unwrap_or(batch.seq);
        let needed: Vec<&Batch> = replayed
            .iter()
            .filter(|b| b.seq >= from && b.seq < batch.seq)
            .collect();
        let complete = needed.len() as u64 == batch.seq - from
            && needed.iter().zip(from..).all(|(b, seq)| b.seq == seq);
        if complete {
            self.streams[s].health.resyncs += 1;
            for b in needed {
                self.apply(s, b, tokens);
            }
        } else {
            let entry = &mut self.streams[s];
            entry.health.drops += 1;
            entry.health.stale_until = Some(now + hold);
            log::warn!(
                "{}: messages {from}..{} lost and not replayed: dropping its blocks",
                entry.url,
                batch.seq
            );
            entry.stream.clear(&mut self.holders);
        }
        self.apply(s, batch, tokens);
    }

    /// Takes a probe's answer: the engine is up. `restarted`: it no longer had the last
    /// message applied, so the stream starts over; `replayed` are its buffered messages from
    /// the one after the last applied (from its first after a restart or before any message).
    /// When they do not follow on, the stream's blocks are dropped and it is stale for `hold`.
    pub fn answered(
        &mut self,
        s: usize,
        restarted: bool,
        replayed: &[Batch],
        tokens: &TokenBytes,
        now: Duration,
        hold: Duration,
    ) {
        let entry = &mut self.streams[s];
        entry.health.probes += 1;
        entry.health.unreachable = false;
        if restarted {
            entry.health.restarts += 1;
            log::warn!(
                "{}: the replay socket no longer has message {} as it was: engine restarted",
                entry.url,
                entry.last.map_or(0, |(seq, _)| seq)
            );
            entry.stream.clear(&mut self.holders);
            entry.expected = None;
            entry.last = None;
        }
        let from = entry
            .expected
            .or_else(|| replayed.first().map(|b| b.seq))
            .unwrap_or(0);
        let news: Vec<&Batch> = replayed.iter().filter(|b| b.seq >= from).collect();
        let complete = news.iter().zip(from..).all(|(b, seq)| b.seq == seq);
        if entry.expected.is_some() && !news.is_empty() {
            entry.health.gaps += 1;
            entry.health.resyncs += u64::from(complete);
        }
        if !complete {
            entry.health.drops += 1;
            entry.health.stale_until = Some(now + hold);
            log::warn!(
                "{}: messages from {from} on lost and not replayed: dropping its blocks",
                entry.url
            );
            entry.stream.clear(&mut self.holders);
        }
        for b in &news {
            self.apply(s, b, tokens);
        }
        let entry = &mut self.streams[s];
        let until = entry.expected.unwrap_or(from);
        entry.expected = Some(until);
        entry.replayed = news.first().map(|b| b.seq..until);
    }

    /// A probe went unanswered: the engine is unreachable until it is heard again. Returns
    /// whether it was reachable until now.
    pub fn unanswered(&mut self, s: usize) -> bool {
        let h = &mut self.streams[s].health;
        h.unanswered += 1;
        !std::mem::replace(&mut h.unreachable, true)
    }

    fn apply(&mut self, s: usize, batch: &Batch, tokens: &TokenBytes) {
        let entry = &mut self.streams[s];
        entry
            .stream
            .apply_batch(&batch.events, tokens, &mut self.holders);
        entry.expected = Some(batch.seq + 1);
        entry.last = Some((batch.seq, batch.digest));
    }

    /// Forgets stream `s`'s blocks and sequence (its connection was replaced).
    pub fn reset(&mut self, s: usize) {
        let entry = &mut self.streams[s];
        entry.stream.clear(&mut self.holders);
        entry.expected = None;
        entry.last = None;
        entry.replayed = None;
    }

    /// Whether what stream `s` says can be trusted: it is connected, outside the hold of an
    /// unfilled gap, and known to be up: heard from or its probe answered, and its last probe
    /// not unanswered (with a replay socket), or heard from within the silence (without).
    pub fn stream_stale(&self, s: usize, now: Duration, staleness: Staleness) -> bool {
        let entry = &self.streams[s];
        let h = &entry.health;
        let unknown = match entry.replay {
            Some(_) => h.unreachable || (h.last_heard.is_none() && h.probes == 0),
            None => h
                .last_heard
                .is_none_or(|t| now.saturating_sub(t) > staleness.silence),
        };
        let held = h.stale_until.is_some_and(|t| now < t);
        !h.connected || unknown || held
    }

    /// Endpoint indexes with a stale stream.
    pub fn stale_endpoints(&self, now: Duration, staleness: Staleness) -> Vec<u32> {
        let mut stale: Vec<u32> = (0..self.streams.len())
            .filter(|&s| self.stream_stale(s, now, staleness))
            .map(|s| self.streams[s].stream.endpoint())
            .collect();
        stale.sort_unstable();
        stale.dedup();
        stale
    }

    /// Heap bytes of the index, estimated.
    pub fn memory(&self) -> usize {
        self.holders.memory()
            + self
                .streams
                .iter()
                .map(|e| e.stream.memory())
                .sum::<usize>()
    }
}
