//! What a results file was measured on: the build's git commit and the run's UTC date, so a table
//! copied into a README can be traced to the code that produced it.

use serde::{Deserialize, Serialize};
use std::process::Command;

/// Written at the top of results.json and results.md and at the foot of ttft.svg.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Stamp {
    /// `git rev-parse --short HEAD`, with `+dirty` when the files that make up what is measured
    /// (the filter, simulator, harness, bench, fleets and workloads, Envoy config) differ from it;
    /// `unknown` outside a git checkout.
    pub commit: String,
    /// When the run started, UTC, `YYYY-MM-DDTHH:MMZ`.
    pub date: String,
}

/// The paths whose edits change what a run measures; docs and READMEs do not.
const MEASURED: &[&str] = &[
    "src",
    "sim",
    "harness",
    "bench/src",
    "bench/fleets",
    "bench/workloads",
    "envoy",
    "Cargo.toml",
    "Cargo.lock",
];

impl Stamp {
    pub fn now() -> Stamp {
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Stamp {
            commit: commit(),
            date: utc_date(secs),
        }
    }
}

fn commit() -> String {
    let root = crate::paths::workspace_root();
    let git = |args: &[&str]| {
        Command::new("git")
            .arg("-C")
            .arg(&root)
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let Some(head) = git(&["rev-parse", "--short", "HEAD"]) else {
        return "unknown".into();
    };
    let mut status = vec!["status", "--porcelain", "--untracked-files=no", "--"];
    status.extend_from_slice(MEASURED);
    match git(&status) {
        Some(s) if s.is_empty() => head,
        _ => format!("{head}+dirty"),
    }
}

/// Seconds since the epoch as `YYYY-MM-DDTHH:MMZ` (the civil-from-days algorithm, proleptic
/// Gregorian calendar).
fn utc_date(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let (hh, mm) = ((secs % 86_400) / 3600, (secs % 3600) / 60);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}T{hh:02}:{mm:02}Z")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_are_utc_calendar_dates() {
        assert_eq!(utc_date(0), "1970-01-01T00:00Z");
        // 2024-02-29 12:34 UTC, a leap day.
        assert_eq!(utc_date(1_709_210_040), "2024-02-29T12:34Z");
        assert_eq!(utc_date(1_798_761_599), "2026-12-31T23:59Z");
    }

    #[test]
    fn a_stamp_names_a_commit() {
        let s = Stamp::now();
        assert!(!s.commit.is_empty());
        assert_eq!(s.date.len(), "2026-11-27T09:00Z".len());
    }
}
