//! The lab held against the wall-clock bench (`make lab-calibrate`): for each results.json the
//! bench wrote, the lab runs the same fleet, workload and seed through the same routers, and the
//! table shows each figure side by side with whether it is within the tolerances.

use super::{measure, report, Knobs};
use crate::report::{Measured, RouterResult};
use crate::routers::Router;
use crate::targets::{self, table_row};
use crate::workload::Workload;
use serde_json::Value;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// The routers calibrated, where a results file has them.
const CALIBRATED: [&str; 5] = [
    "round_robin",
    "kvroute",
    "kvroute@3",
    "kvroute-precise",
    "smg",
];
/// Most the lab's hit rate may differ from the wall-clock bench's, in points.
pub const HIT_POINTS: f64 = 2.0;
/// Most the lab's TTFT p50 and p90 may differ from the wall-clock bench's, as a share of it.
pub const TTFT_SHARE: f64 = 0.2;

/// The wall-clock results the lab is held against, under `results`: each workload's set, and
/// each precise line's first run.
pub fn sources(results: &Path) -> Result<Vec<PathBuf>, String> {
    let sets = [
        "llm-d",
        "zipf-pressure",
        "grouped-pressure",
        "agentic",
        "multimodal",
        "tenants",
    ];
    let lines = targets::lines()?
        .into_iter()
        .map(|l| format!("precise/{}/run-1", l.name));
    Ok(sets
        .iter()
        .map(|s| s.to_string())
        .chain(lines)
        .map(|d| results.join(d).join("results.json"))
        .filter(|p| p.is_file())
        .collect())
}

/// The calibration table over `files` (each a wall-clock results.json), the lab on `seeds`
/// seeds from each file's own.
pub fn calibrate(files: &[PathBuf], seeds: u64, knobs: &Knobs) -> Result<String, String> {
    let mut s = String::from(
        "| results (build) | router | hit rate: bench · lab | TTFT p50: bench · lab | TTFT p90: bench · lab | within |\n\
         |---|---|---|---|---|---|\n",
    );
    let (mut within, mut total) = (0, 0);
    for file in files {
        let text = std::fs::read_to_string(file).map_err(|e| format!("{}: {e}", file.display()))?;
        let wall: Value =
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", file.display()))?;
        let workload: Workload = serde_json::from_value(wall["workload"].clone())
            .map_err(|e| format!("{}: workload: {e}", file.display()))?;
        let measured: Vec<Measured> =
            serde_json::from_value::<Vec<RouterResult>>(wall["results"].clone())
                .map_err(|e| format!("{}: results: {e}", file.display()))?
                .into_iter()
                .filter_map(|r| match r {
                    RouterResult::Measured(m) => Some(m),
                    RouterResult::Skipped { .. } => None,
                })
                .filter(|m| CALIBRATED.contains(&m.router.as_str()))
                .collect();
        let names: Vec<&str> = measured.iter().map(|m| m.router.as_str()).collect();
        if names.is_empty() {
            continue;
        }
        let routers = Router::parse_list(&names.join(","), None)?;
        // A run with a precise router tokenizes with the BPE for every router, as `compare` does.
        let fleet = wall["fleet"].clone();
        let (_, figures) = measure(&fleet, &workload, &routers, seeds, knobs)?;
        let stamp = wall["stamp"]["commit"].as_str().unwrap_or("unstamped");
        let label = format!("{} ({stamp})", label_of(file));
        for (m, figs) in measured.iter().zip(&figures) {
            let lab =
                |name| report::per_seed(&figs.runs, name).and_then(|v| super::stats::interval(&v));
            let (hit, p50, p90) = (
                lab("prefix_hit_rate"),
                lab("ttft_p50_ms"),
                lab("ttft_p90_ms"),
            );
            let hit_ok =
                hit.is_some_and(|h| (h.mean - m.prefix_hit_rate).abs() * 100.0 <= HIT_POINTS);
            let near = |wall: Option<f64>, lab: Option<super::stats::Interval>| match (wall, lab) {
                (Some(w), Some(l)) if w > 0.0 => (l.mean - w).abs() / w <= TTFT_SHARE,
                _ => false,
            };
            let p50_ok = near(m.ttft_ms.p50, p50);
            let p90_ok = near(m.ttft_ms.p90, p90);
            total += 3;
            within += usize::from(hit_ok) + usize::from(p50_ok) + usize::from(p90_ok);
            let pct = |v: Option<f64>| v.map_or("-".into(), |v| format!("{:.1}%", v * 100.0));
            let ms = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.0} ms"));
            let cell = |wall: String, lab: String, ok: bool| {
                format!("{wall} · {lab}{}", if ok { "" } else { " ✗" })
            };
            let cells = [
                cell(
                    pct(Some(m.prefix_hit_rate)),
                    pct(hit.map(|h| h.mean)),
                    hit_ok,
                ),
                cell(ms(m.ttft_ms.p50), ms(p50.map(|i| i.mean)), p50_ok),
                cell(ms(m.ttft_ms.p90), ms(p90.map(|i| i.mean)), p90_ok),
            ];
            let ok = format!(
                "{}/3",
                usize::from(hit_ok) + usize::from(p50_ok) + usize::from(p90_ok)
            );
            s += &table_row(&[&label, &m.router, &cells[0], &cells[1], &cells[2], &ok]);
        }
    }
    let _ = writeln!(
        s,
        "\n{within} of {total} figures within the tolerances (hit rate ±{HIT_POINTS} points, TTFT ±{:.0}%; ✗: outside).",
        TTFT_SHARE * 100.0
    );
    Ok(s)
}

/// A results file's place under bench/results: `zipf-pressure`, `precise/llm-d`.
fn label_of(file: &Path) -> String {
    let dir = file.parent().unwrap_or(file);
    let name = |p: &Path| {
        p.file_name()
            .map_or(String::new(), |n| n.to_string_lossy().into_owned())
    };
    match dir
        .file_name()
        .is_some_and(|n| n.to_string_lossy().starts_with("run-"))
    {
        true => {
            let line = dir.parent().unwrap_or(dir);
            format!("precise/{}", name(line))
        }
        false => name(dir),
    }
}
