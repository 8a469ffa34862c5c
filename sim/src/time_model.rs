//! The time model: how long a prefill and a decode step take, in simulated milliseconds.
//!
//! ```text
//! prefill_ms  = prefill_base_ms + uncached_tokens * prefill_ms_per_token
//!                               + cached_tokens   * cached_token_ms
//! decode_step = decode_ms_per_token + decode_batch_slope * (running - 1)
//! real time   = simulated time * slow_factor * time_scale
//! ```
//!
//! Calibration (defaults): the llm-d precise-scheduling benchmark reports a 6,000-token
//! prompt on Qwen3-32B at about 4.3 s time-to-first-token cold and about 0.6 s when its
//! prefix is cached. Cold: 50 + 6000 * 0.7 = 4,250 ms. Warm (all but the last partial
//! block cached, 5,984 cached + 16 new): 50 + 16 * 0.7 + 5984 * 0.09 = 600 ms. Decode is
//! 30 ms per token alone, rising by 0.3 ms per extra running sequence (about 49 ms at 64).
//!
//! The engine serialises prefills per replica (a GPU is busy with one prefill at a time),
//! so a burst of cold prompts queues, which is what makes cache-aware routing pay off.

use crate::spec::FleetSpec;
use std::time::Duration;

/// Simulated milliseconds to prefill a prompt with this many cached and uncached tokens.
pub fn prefill_ms(spec: &FleetSpec, uncached_tokens: usize, cached_tokens: usize) -> f64 {
    spec.prefill_base_ms
        + uncached_tokens as f64 * spec.prefill_ms_per_token
        + cached_tokens as f64 * spec.cached_token_ms
}

/// Simulated milliseconds of one decode step (one token for every running request).
pub fn decode_step_ms(spec: &FleetSpec, running: usize) -> f64 {
    spec.decode_ms_per_token + spec.decode_batch_slope * running.saturating_sub(1) as f64
}

/// Converts simulated milliseconds to real time.
pub fn real(spec: &FleetSpec, simulated_ms: f64, slow_factor: f64) -> Duration {
    Duration::from_secs_f64((simulated_ms * slow_factor * spec.time_scale / 1000.0).max(0.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_reproduce_the_llm_d_calibration_points() {
        let spec = FleetSpec::default();
        let cold = prefill_ms(&spec, 6000, 0);
        let warm = prefill_ms(&spec, 16, 5984);
        assert!((4200.0..4400.0).contains(&cold), "cold {cold}");
        assert!((550.0..650.0).contains(&warm), "warm {warm}");
    }

    #[test]
    fn prefill_grows_with_uncached_tokens_and_decode_with_batch() {
        let spec = FleetSpec::default();
        assert!(prefill_ms(&spec, 1000, 0) > prefill_ms(&spec, 500, 500));
        assert_eq!(decode_step_ms(&spec, 1), spec.decode_ms_per_token);
        assert!(decode_step_ms(&spec, 64) > decode_step_ms(&spec, 8));
    }

    #[test]
    fn time_scale_and_slow_factor_scale_real_time() {
        let spec = FleetSpec {
            time_scale: 0.01,
            ..FleetSpec::default()
        };
        assert_eq!(real(&spec, 1000.0, 1.0), Duration::from_millis(10));
        assert_eq!(real(&spec, 1000.0, 3.0), Duration::from_millis(30));
    }
}
