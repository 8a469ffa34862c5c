//! What the subscribers and the HTTP server share: the index behind a lock, the tokenizer's
//! byte table, the staleness rules, this process's epoch and its clock.

use crate::index::{Index, Staleness};
use crate::token_bytes::TokenBytes;
use std::hash::{BuildHasher, Hasher};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

pub struct Shared {
    index: Mutex<Index>,
    pub tokens: TokenBytes,
    pub staleness: Staleness,
    /// Random per start: a client's version from another epoch means nothing here.
    pub epoch: u64,
    started: Instant,
}

/// What the API's answers depend on besides the index and the time.
#[derive(Debug, Clone, Copy)]
pub struct Serving<'a> {
    pub epoch: u64,
    pub staleness: Staleness,
    pub tokens: &'a TokenBytes,
}

impl Shared {
    pub fn new(index: Index, tokens: TokenBytes, staleness: Staleness) -> Shared {
        Shared {
            index: Mutex::new(index),
            tokens,
            staleness,
            epoch: random_epoch(),
            started: Instant::now(),
        }
    }

    /// The index's clock: the time since this indexer started.
    pub fn now(&self) -> Duration {
        self.started.elapsed()
    }

    pub fn serving(&self) -> Serving<'_> {
        Serving {
            epoch: self.epoch,
            staleness: self.staleness,
            tokens: &self.tokens,
        }
    }

    pub fn lock(&self) -> MutexGuard<'_, Index> {
        self.index.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A random number below 2^53 (exact in any JSON parser), never 0.
fn random_epoch() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    (h.finish() >> 11).max(1)
}
