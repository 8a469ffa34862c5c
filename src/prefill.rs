//! Each endpoint's prefill as one worker models it: how fast its engine gets through prompt bytes
//! it must compute, learnt from first response bytes, and how big a request's uncached prompt
//! usually is. A request's expected time to first token at an endpoint is the prefill work queued
//! ahead of it there plus its own uncached bytes, over that rate.
//!
//! Work is counted in bytes of the rendered prompt, the unit kvroute's keys cut it in: the rate is
//! learnt in the same unit, so no tokenizer is needed and the ratio holds for any model. Where an
//! engine counts its queue in tokens, bytes per token are learnt from the `usage` engines report.

use hashbrown::HashMap;

/// How much a new observation counts: the decayed sums forget an old one over about this many.
const MEMORY: f64 = 64.0;
/// A learnt rate stays within this factor of the configured one: a replica whose first bytes come
/// slow for other reasons (a restart, a long decode batch) is not written off, nor one that
/// answered a handful of cached prompts fast taken for a far faster engine.
const CLAMP: f64 = 16.0;
/// Observations an endpoint needs before its own rate replaces the configured one.
const SEEN: f64 = 8.0;
/// Bytes per token until responses' usage has said: a BPE tokenizer's usual on English text.
pub const BYTES_PER_TOKEN: f64 = 4.0;

/// Decayed sums of prompt bytes and of what they took: one endpoint's prefill time, or the
/// tokens engines counted in them.
#[derive(Debug, Clone, Copy, Default)]
struct Sums {
    bytes: f64,
    /// Milliseconds, or tokens.
    over: f64,
    seen: f64,
}

/// What one worker has learnt of the endpoints' prefill (see the module doc).
#[derive(Debug)]
pub struct PrefillModel {
    /// Bytes per millisecond, as configured: every endpoint's until its own is learnt.
    default_rate: f64,
    rates: HashMap<u32, Sums>,
    /// Decayed mean of the uncached bytes of the requests this worker routed.
    mean_uncached: f64,
    /// Decayed sums of prompt bytes and the prompt tokens engines counted for them.
    tokenized: Sums,
}

impl PrefillModel {
    pub fn new(default_rate: f64) -> Self {
        PrefillModel {
            default_rate: default_rate.max(f64::MIN_POSITIVE),
            rates: HashMap::new(),
            mean_uncached: 0.0,
            tokenized: Sums::default(),
        }
    }

    /// Rendered prompt bytes per token of the engines' tokenizer: what turns an engine's queue,
    /// when it counts it in tokens, into kvroute's unit.
    pub fn bytes_per_token(&self) -> f64 {
        self.tokenized.ratio(BYTES_PER_TOKEN)
    }

    /// An engine reported `tokens` prompt tokens for a prompt of `bytes` rendered bytes.
    pub fn tokenized(&mut self, bytes: u64, tokens: u64) {
        if tokens > 0 {
            self.tokenized.add(bytes as f64, tokens as f64);
        }
    }

    /// Endpoint `id`'s prefill rate, in bytes per millisecond.
    pub fn rate(&self, id: u32) -> f64 {
        self.rates
            .get(&id)
            .map_or(self.default_rate, |s| s.ratio(self.default_rate))
    }

    /// The mean uncached bytes of a request: what a request another gateway queued at an engine
    /// is taken to cost.
    pub fn mean_uncached(&self) -> f64 {
        self.mean_uncached
    }

    /// A request with `uncached` bytes to prefill was routed.
    pub fn routed(&mut self, uncached: u64) {
        self.mean_uncached += (uncached as f64 - self.mean_uncached) / MEMORY;
    }

    /// Endpoint `id` gave a request's first byte `waited_ms` after it was routed, having had
    /// `work` bytes to prefill for it (the work queued ahead and its own).
    pub fn first_byte(&mut self, id: u32, work: u64, waited_ms: u64) {
        let s = self.rates.entry(id).or_default();
        s.add(work as f64, waited_ms.max(1) as f64);
    }
}

impl Sums {
    /// One more observation of `bytes` over `per` (milliseconds, or tokens).
    fn add(&mut self, bytes: f64, per: f64) {
        let keep = 1.0 - 1.0 / MEMORY;
        self.bytes = self.bytes * keep + bytes;
        self.over = self.over * keep + per;
        self.seen += 1.0;
    }

    /// Bytes per unit once seen [`SEEN`] times, within [`CLAMP`]× of `default`; `default` until.
    fn ratio(&self, default: f64) -> f64 {
        match self.seen >= SEEN && self.over > 0.0 {
            true => (self.bytes / self.over).clamp(default / CLAMP, default * CLAMP),
            false => default,
        }
    }
}

/// A routed request's prefill at its endpoint, as expected when it was routed.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Expected {
    /// Bytes of its rendered prompt.
    pub prompt: u64,
    /// Bytes of its prompt the endpoint is taken not to hold.
    pub uncached: u64,
    /// Bytes queued there to prefill before it.
    pub ahead: u64,
    /// Milliseconds to its first token.
    pub ttft_ms: f64,
}

/// Milliseconds to the first token of a request with `uncached` bytes to prefill at an endpoint
/// with `queued` bytes ahead of it, computing `rate` bytes per millisecond.
pub fn expected_ttft_ms(queued: u64, uncached: u64, rate: f64) -> f64 {
    (queued + uncached) as f64 / rate.max(f64::MIN_POSITIVE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_endpoint_keeps_the_configured_rate_until_it_has_been_seen_enough() {
        let mut m = PrefillModel::new(10.0);
        for _ in 0..7 {
            m.first_byte(1, 2_000, 100);
        }
        assert_eq!(m.rate(1), 10.0);
        m.first_byte(1, 2_000, 100);
        assert!((m.rate(1) - 20.0).abs() < 1e-9, "{}", m.rate(1));
        assert_eq!(m.rate(2), 10.0, "another endpoint keeps the default");
    }

    #[test]
    fn a_learnt_rate_follows_a_slower_engine_within_its_clamp() {
        let mut m = PrefillModel::new(10.0);
        for _ in 0..40 {
            m.first_byte(1, 1_000, 1_000);
        }
        assert!((m.rate(1) - 1.0).abs() < 1e-9);
        for _ in 0..40 {
            m.first_byte(2, 1, 100_000);
        }
        assert_eq!(m.rate(2), 10.0 / CLAMP, "clamped");
        for _ in 0..400 {
            m.first_byte(1, 10_000, 1_000);
        }
        assert!(m.rate(1) > 9.0, "it recovered: {}", m.rate(1));
    }

    #[test]
    fn the_mean_uncached_size_follows_the_routed_requests() {
        let mut m = PrefillModel::new(1.0);
        for _ in 0..1_000 {
            m.routed(4_000);
        }
        assert!((m.mean_uncached() - 4_000.0).abs() < 1.0);
    }

    #[test]
    fn expected_ttft_is_the_work_ahead_and_its_own_over_the_rate() {
        assert_eq!(expected_ttft_ms(3_000, 1_000, 10.0), 400.0);
        assert!(expected_ttft_ms(1, 0, 0.0).is_finite());
    }

    #[test]
    fn bytes_per_token_follow_the_engines_usage_once_seen_enough() {
        let mut m = PrefillModel::new(1.0);
        m.tokenized(3_000, 0);
        for _ in 0..7 {
            m.tokenized(3_000, 1_000);
        }
        assert_eq!(m.bytes_per_token(), BYTES_PER_TOKEN);
        m.tokenized(3_000, 1_000);
        assert!(
            (m.bytes_per_token() - 3.0).abs() < 1e-9,
            "{}",
            m.bytes_per_token()
        );
        for _ in 0..400 {
            m.tokenized(1, 1_000);
        }
        assert_eq!(m.bytes_per_token(), BYTES_PER_TOKEN / CLAMP, "clamped");
    }
}
