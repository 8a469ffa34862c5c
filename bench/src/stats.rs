//! Percentiles and the per-run summary numbers computed from raw request samples.

/// The value below which `q` (0..=1) of the samples fall, interpolating between neighbours.
/// `None` for no samples.
pub fn percentile(samples: &[f64], q: f64) -> Option<f64> {
    if samples.is_empty() {
        return None;
    }
    let mut s = samples.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let pos = q.clamp(0.0, 1.0) * (s.len() - 1) as f64;
    let lo = pos.floor() as usize;
    let hi = pos.ceil() as usize;
    let frac = pos - lo as f64;
    Some(s[lo] + (s[hi] - s[lo]) * frac)
}

/// Busiest over least-busy replica request count; `None` when some replica got nothing.
pub fn max_over_min(counts: &[u64]) -> Option<f64> {
    let max = *counts.iter().max()?;
    let min = *counts.iter().min()?;
    (min > 0).then(|| max as f64 / min as f64)
}

/// `part / whole`, or 0 when nothing was counted.
pub fn ratio(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 / whole as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentile_interpolates_between_samples() {
        let s = [4.0, 1.0, 3.0, 2.0, 5.0];
        assert_eq!(percentile(&s, 0.5), Some(3.0));
        assert_eq!(percentile(&s, 0.0), Some(1.0));
        assert_eq!(percentile(&s, 1.0), Some(5.0));
        assert_eq!(percentile(&s, 0.9), Some(4.6));
        assert_eq!(percentile(&[], 0.5), None);
    }

    #[test]
    fn share_ratio_is_none_when_a_replica_starved() {
        assert_eq!(max_over_min(&[10, 5, 20]), Some(4.0));
        assert_eq!(max_over_min(&[10, 0]), None);
    }
}
