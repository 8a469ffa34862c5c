//! How long an engine keeps a prefix that nobody uses, from its own metrics: the KV cache that
//! running requests leave free, over the rate at which it writes new tokens into it.
//!
//! An engine keeps finished requests' blocks cached and reuses the least recently used first, so
//! a block nobody touches survives about as long as the engine takes to write a free cache's
//! worth of new tokens (prompt tokens it did not find cached, and generated ones). Under cache
//! pressure that is seconds: a conversation's history on a replica its group no longer lives on
//! is gone by its next turn, and following it there costs a full prefill. The numbers are the
//! engine's, read by every gateway alike.

use serde::{Deserialize, Serialize};

/// How much of each new poll's rate counts against the average so far.
const NEW_RATE_WEIGHT: f64 = 0.5;

/// What one `/metrics` page says of the engine's KV cache (vLLM's or SGLang's names).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct KvMetrics {
    /// The KV cache's size in tokens (vLLM `cache_config_info` blocks × block size, SGLang
    /// `max_total_num_tokens`).
    pub capacity_tokens: Option<f64>,
    /// The share of it running requests hold, 0 to 1.
    pub usage: Option<f64>,
    /// Prompt tokens looked up in the prefix cache, and those found there (counters).
    pub prompt_tokens: Option<f64>,
    pub cached_tokens: Option<f64>,
    /// Tokens generated (a counter).
    pub generated_tokens: Option<f64>,
}

impl KvMetrics {
    /// Tokens written into the cache since the engine started: prompt tokens it computed and
    /// generated ones.
    fn written(&self) -> Option<f64> {
        Some(self.prompt_tokens? - self.cached_tokens? + self.generated_tokens?)
    }
}

/// An engine's cache churn as kvroute keeps it between polls.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Churn {
    /// Tokens of cache not held by running requests at the last poll.
    pub free_tokens: f64,
    /// [`KvMetrics::written`] at the last poll, and when that was.
    pub written: f64,
    pub at_ms: u64,
    /// Tokens written per second lately (an average over polls); `None` until two polls.
    pub rate: Option<f64>,
}

impl Churn {
    /// The engine's new report over the previous one; `None` when it does not say enough.
    pub fn observe(previous: Option<&Churn>, m: &KvMetrics, now_ms: u64) -> Option<Churn> {
        let written = m.written()?;
        let free_tokens = m.capacity_tokens? * (1.0 - m.usage.unwrap_or(0.0).clamp(0.0, 1.0));
        let rate = match previous {
            // A counter that went down: the engine restarted; keep what was known.
            Some(p) if written < p.written || now_ms <= p.at_ms => p.rate,
            Some(p) => {
                let now = (written - p.written) * 1000.0 / (now_ms - p.at_ms) as f64;
                Some(p.rate.map_or(now, |r| r + NEW_RATE_WEIGHT * (now - r)))
            }
            None => None,
        };
        Some(Churn {
            free_tokens,
            written,
            at_ms: now_ms,
            rate,
        })
    }

    /// How long a block nobody uses stays cached: `None` while the engine writes nothing (it
    /// keeps everything).
    pub fn retention_ms(&self) -> Option<u64> {
        let rate = self.rate.filter(|r| *r > 0.0)?;
        Some((self.free_tokens / rate * 1000.0) as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(usage: f64, prompt: f64, cached: f64, generated: f64) -> KvMetrics {
        KvMetrics {
            capacity_tokens: Some(10_000.0),
            usage: Some(usage),
            prompt_tokens: Some(prompt),
            cached_tokens: Some(cached),
            generated_tokens: Some(generated),
        }
    }

    #[test]
    fn a_block_lasts_as_long_as_the_engine_takes_to_write_its_free_cache() {
        let first = Churn::observe(None, &page(0.5, 0.0, 0.0, 0.0), 0).unwrap();
        assert_eq!(first.retention_ms(), None, "no rate from one poll");
        // 1 s later: 3000 prompt tokens, 1000 of them cached, 500 generated: 2500 written.
        let second = Churn::observe(Some(&first), &page(0.5, 3000.0, 1000.0, 500.0), 1000);
        let second = second.unwrap();
        assert_eq!(second.rate, Some(2500.0));
        assert_eq!(
            second.retention_ms(),
            Some(2000),
            "5000 free tokens at 2500/s"
        );
        // The next second writes nothing: the rate halves, a block lasts twice as long.
        let idle = Churn::observe(Some(&second), &page(0.5, 3000.0, 1000.0, 500.0), 2000);
        assert_eq!(idle.unwrap().retention_ms(), Some(4000));
    }

    #[test]
    fn an_engine_that_writes_nothing_keeps_everything() {
        let a = Churn::observe(None, &page(0.9, 10.0, 0.0, 0.0), 0).unwrap();
        let b = Churn::observe(Some(&a), &page(0.9, 10.0, 0.0, 0.0), 1000).unwrap();
        assert_eq!(b.rate, Some(0.0));
        assert_eq!(b.retention_ms(), None);
    }

    #[test]
    fn a_restarted_engine_keeps_the_rate_it_had() {
        let a = Churn::observe(None, &page(0.0, 0.0, 0.0, 0.0), 0).unwrap();
        let b = Churn::observe(Some(&a), &page(0.0, 1000.0, 0.0, 0.0), 1000).unwrap();
        let restarted = Churn::observe(Some(&b), &page(0.0, 5.0, 0.0, 0.0), 2000).unwrap();
        assert_eq!(restarted.rate, Some(1000.0));
        assert_eq!(restarted.retention_ms(), Some(10_000));
    }

    #[test]
    fn a_page_without_cache_numbers_says_nothing() {
        let mut m = page(0.5, 1.0, 0.0, 0.0);
        m.capacity_tokens = None;
        assert_eq!(Churn::observe(None, &m, 0), None);
        let mut m = page(0.5, 1.0, 0.0, 0.0);
        m.cached_tokens = None;
        assert_eq!(Churn::observe(None, &m, 0), None);
    }
}
