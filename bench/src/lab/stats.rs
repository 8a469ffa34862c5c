//! Means over paired seeds with Student-t 95% confidence intervals, and the verdicts they support.

use serde::Serialize;
use statrs::distribution::{ContinuousCDF, StudentsT};

/// Two-sided confidence level of every interval here.
const LEVEL: f64 = 0.95;

/// The mean of `n` samples and the two-sided 95% confidence interval of that mean
/// (Student's t with n-1 degrees of freedom).
///
/// With one sample there is no spread to estimate: the interval is the mean alone
/// (`lo == hi == mean`) and `n == 1` marks it as such, so a reader never takes it for a
/// measured zero-width interval.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Interval {
    pub n: usize,
    pub mean: f64,
    pub lo: f64,
    pub hi: f64,
}

impl Interval {
    /// Half the interval's width: the mean is known to within this.
    pub fn half_width(&self) -> f64 {
        (self.hi - self.lo) / 2.0
    }
}

/// Mean and 95% interval of `samples`; `None` when there are none or one is not finite.
pub fn interval(samples: &[f64]) -> Option<Interval> {
    let n = samples.len();
    if n == 0 || samples.iter().any(|x| !x.is_finite()) {
        return None;
    }
    let mean = samples.iter().sum::<f64>() / n as f64;
    if n == 1 {
        return Some(Interval {
            n,
            mean,
            lo: mean,
            hi: mean,
        });
    }
    let dof = (n - 1) as f64;
    let variance = samples.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / dof;
    let t = StudentsT::new(0.0, 1.0, dof)
        .ok()?
        .inverse_cdf(1.0 - (1.0 - LEVEL) / 2.0);
    let half = t * (variance / n as f64).sqrt();
    Some(Interval {
        n,
        mean,
        lo: mean - half,
        hi: mean + half,
    })
}

/// The interval of the paired differences `a[i] - b[i]` (sample `i` of both taken on the same
/// seed), which cancels whatever the seed does to both; `None` when the lengths differ or
/// [`interval`] gives none.
pub fn paired(a: &[f64], b: &[f64]) -> Option<Interval> {
    if a.len() != b.len() {
        return None;
    }
    let diffs: Vec<f64> = a.iter().zip(b).map(|(x, y)| x - y).collect();
    interval(&diffs)
}

/// What a paired difference (router − baseline) says about the router.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    Better,
    Worse,
    NotDistinguishable,
}

impl Verdict {
    /// How a table shows it.
    pub fn name(self) -> &'static str {
        match self {
            Verdict::Better => "better",
            Verdict::Worse => "worse",
            Verdict::NotDistinguishable => "tie",
        }
    }
}

/// `Better` when the whole interval of `diff` lies strictly on the good side of 0 (above it when
/// `higher_is_better`, below it otherwise), `Worse` when it lies strictly on the other side, and
/// `NotDistinguishable` when it touches or straddles 0. A single pair (`n == 1`) never decides.
pub fn verdict(diff: &Interval, higher_is_better: bool) -> Verdict {
    if diff.n < 2 {
        return Verdict::NotDistinguishable;
    }
    let (good_side, bad_side) = if higher_is_better {
        (diff.lo > 0.0, diff.hi < 0.0)
    } else {
        (diff.hi < 0.0, diff.lo > 0.0)
    };
    if good_side {
        Verdict::Better
    } else if bad_side {
        Verdict::Worse
    } else {
        Verdict::NotDistinguishable
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn half_width(i: &Interval) -> f64 {
        (i.hi - i.lo) / 2.0
    }

    fn close(a: f64, b: f64, tol: f64) -> bool {
        (a - b).abs() < tol
    }

    #[test]
    fn one_to_five_gives_the_textbook_t_interval() {
        let i = interval(&[1.0, 2.0, 3.0, 4.0, 5.0]).unwrap();
        assert_eq!(i.n, 5);
        assert!(close(i.mean, 3.0, 1e-12));
        // t(0.975, 4) = 2.7764; s = sqrt(2.5); half = t * s / sqrt(5).
        let half = 2.776_445 * 2.5_f64.sqrt() / 5.0_f64.sqrt();
        assert!(close(half_width(&i), half, 1e-5), "{i:?}");
        assert!(close(i.lo, 3.0 - 1.963, 1e-3) && close(i.hi, 3.0 + 1.963, 1e-3));
    }

    #[test]
    fn identical_samples_give_a_zero_width_interval() {
        let i = interval(&[0.42; 6]).unwrap();
        assert_eq!((i.lo, i.mean, i.hi), (0.42, 0.42, 0.42));
    }

    #[test]
    fn one_sample_is_the_mean_alone_and_decides_nothing() {
        let i = interval(&[7.0]).unwrap();
        assert_eq!((i.n, i.lo, i.mean, i.hi), (1, 7.0, 7.0, 7.0));
        assert_eq!(verdict(&i, true), Verdict::NotDistinguishable);
        assert!(interval(&[]).is_none());
        assert!(interval(&[1.0, f64::NAN]).is_none());
    }

    #[test]
    fn pairing_cancels_a_shared_seed_effect() {
        // Seeds move both routers by hundreds; the router is always 2 ahead.
        let seed_effect = [100.0, 900.0, 350.0, 20.0, 610.0];
        let baseline: Vec<f64> = seed_effect.iter().map(|s| s + 10.0).collect();
        let router: Vec<f64> = seed_effect.iter().map(|s| s + 12.0).collect();
        let unpaired_r = interval(&router).unwrap();
        let unpaired_b = interval(&baseline).unwrap();
        assert!(unpaired_r.lo < unpaired_b.hi, "unpaired intervals overlap");
        let d = paired(&router, &baseline).unwrap();
        assert!(close(d.mean, 2.0, 1e-9) && half_width(&d) < 1e-9, "{d:?}");
        assert_eq!(verdict(&d, true), Verdict::Better);
        assert_eq!(verdict(&d, false), Verdict::Worse);
        assert!(paired(&router, &baseline[..4]).is_none());
    }

    #[test]
    fn an_interval_across_zero_is_not_distinguishable() {
        let d = paired(&[1.0, 3.0, 2.0, 5.0], &[2.0, 1.0, 3.0, 4.0]).unwrap();
        assert!(d.lo < 0.0 && d.hi > 0.0, "{d:?}");
        assert_eq!(verdict(&d, true), Verdict::NotDistinguishable);
        assert_eq!(verdict(&d, false), Verdict::NotDistinguishable);
    }

    #[test]
    fn lower_is_better_reads_a_negative_interval_as_better() {
        let d = paired(&[10.0, 11.0, 12.0], &[20.0, 20.5, 22.0]).unwrap();
        assert!(d.hi < 0.0);
        assert_eq!(verdict(&d, false), Verdict::Better);
        assert_eq!(verdict(&d, true), Verdict::Worse);
    }

    #[test]
    fn verdicts_serialize_in_snake_case() {
        let names: Vec<String> = [Verdict::Better, Verdict::Worse, Verdict::NotDistinguishable]
            .iter()
            .map(|v| serde_json::to_string(v).unwrap())
            .collect();
        assert_eq!(
            names,
            ["\"better\"", "\"worse\"", "\"not_distinguishable\""]
        );
        let i = serde_json::to_value(interval(&[1.0, 3.0]).unwrap()).unwrap();
        assert_eq!(i["n"], 2);
        assert_eq!(i["mean"], 2.0);
    }
}
