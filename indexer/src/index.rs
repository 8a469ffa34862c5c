//! The whole index: every stream's blocks, the endpoints' keys, and each stream's sequence and
//! health (gaps, restarts, silence).
//!
//! A stream's messages are numbered from 0. The next expected number applies; a smaller one
//! means the engine restarted (its cache is empty: the stream starts over); a larger one is a
//! gap, which the subscriber tries to fill from the engine's replay socket. A gap that cannot
//! be filled drops the stream's blocks (what it holds now is partly unknown) and keeps the
//! stream stale for a while, so the filter falls back to its own guesses for that endpoint.

use crate::chains::{Shape, Stream};
use crate::holders::Holders;
use crate::token_bytes::TokenBytes;
use crate::wire::Batch;
use std::time::{Duration, Instant};

/// When streams count as stale.
#[derive(Debug, Clone, Copy)]
pub struct Staleness {
    /// A stream that has sent nothing for this long is stale (vLLM sends no heartbeat, so an
    /// idle engine goes stale too, and fresh again with its next contiguous message).
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
    pub connected: bool,
    pub last_heard: Option<Instant>,
    pub stale_until: Option<Instant>,
}

#[derive(Debug)]
pub struct StreamEntry {
    /// The publisher's address (`tcp://host:port`).
    pub url: String,
    pub replay: Option<String>,
    pub stream: Stream,
    pub health: Health,
    expected: Option<u64>,
}

impl StreamEntry {
    /// The sequence number expected next (none before the first message).
    pub fn next_seq(&self) -> Option<u64> {
        self.expected
    }
}

/// What to do with a received batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Received {
    Applied,
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

    /// Adds a stream publishing for endpoint `endpoint` (`ip:port`); returns its number.
    pub fn add_stream(
        &mut self,
        endpoint: &str,
        model: &str,
        url: &str,
        replay: Option<&str>,
    ) -> usize {
        let e = self.holders.endpoint(endpoint);
        let shape = Shape {
            model: model.to_owned(),
            chunk_size: self.chunk_size,
        };
        self.streams.push(StreamEntry {
            url: url.to_owned(),
            replay: replay.map(str::to_owned),
            stream: Stream::new(e, shape),
            health: Health::default(),
            expected: None,
        });
        self.streams.len() - 1
    }

    /// Takes message `batch` of stream `s`, unless messages before it are missing.
    pub fn receive(
        &mut self,
        s: usize,
        batch: &Batch,
        tokens: &TokenBytes,
        now: Instant,
    ) -> Received {
        let entry = &mut self.streams[s];
        entry.health.last_heard = Some(now);
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
        now: Instant,
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

    fn apply(&mut self, s: usize, batch: &Batch, tokens: &TokenBytes) {
        let entry = &mut self.streams[s];
        for event in &batch.events {
            entry.stream.apply(event, tokens, &mut self.holders);
        }
        entry.expected = Some(batch.seq + 1);
    }

    /// Forgets stream `s`'s blocks and sequence (its connection was replaced).
    pub fn reset(&mut self, s: usize) {
        let entry = &mut self.streams[s];
        entry.stream.clear(&mut self.holders);
        entry.expected = None;
    }

    pub fn stream_stale(&self, s: usize, now: Instant, staleness: Staleness) -> bool {
        let h = &self.streams[s].health;
        let silent = h
            .last_heard
            .is_none_or(|t| now.saturating_duration_since(t) > staleness.silence);
        let held = h.stale_until.is_some_and(|t| now < t);
        !h.connected || silent || held
    }

    /// Endpoint indexes with a stale stream.
    pub fn stale_endpoints(&self, now: Instant, staleness: Staleness) -> Vec<u32> {
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
