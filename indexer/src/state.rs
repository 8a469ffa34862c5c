//! What the subscribers and the HTTP server share: the index behind a lock, the tokenizer's
//! byte table, the staleness rules and this process's epoch.

use crate::index::{Index, Staleness};
use crate::token_bytes::TokenBytes;
use std::hash::{BuildHasher, Hasher};
use std::sync::{Mutex, MutexGuard};

pub struct Shared {
    index: Mutex<Index>,
    pub tokens: TokenBytes,
    pub staleness: Staleness,
    /// Random per start: a client's version from another epoch means nothing here.
    pub epoch: u64,
}

impl Shared {
    pub fn new(index: Index, tokens: TokenBytes, staleness: Staleness) -> Shared {
        Shared {
            index: Mutex::new(index),
            tokens,
            staleness,
            epoch: random_epoch(),
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
