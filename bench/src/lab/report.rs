//! The lab's outputs: per router the mean and 95% interval of each figure over the seeds, the
//! paired difference from the baseline with its verdict, as a table and as results.json.

use super::stats::{self, Interval, Verdict};
use crate::report::Measured;
use crate::routers::Router;
use crate::stamp::Stamp;
use crate::workload::Workload;
use serde::Serialize;
use serde_json::Value;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

/// One router's runs, one per seed in seed order, or why it was not run.
#[derive(Default)]
pub struct Figures {
    pub runs: Vec<Measured>,
    pub skipped: Option<String>,
}

/// A figure the lab decides on: its name, its column title, whether more is better, and how to
/// read it from a run.
struct Figure {
    name: &'static str,
    title: &'static str,
    higher_is_better: bool,
    read: fn(&Measured) -> Option<f64>,
    /// How a value prints (a share as a percentage, milliseconds, a ratio, a count).
    shown: fn(f64) -> String,
}

impl Figure {
    /// How a difference prints: signed, a share's in points.
    fn delta(&self, v: f64) -> String {
        match self.name {
            "prefix_hit_rate" => format!("{:+.1} pts", v * 100.0),
            _ if v >= 0.0 => format!("+{}", (self.shown)(v)),
            _ => (self.shown)(v),
        }
    }
}

const FIGURES: [Figure; 6] = [
    Figure {
        name: "prefix_hit_rate",
        title: "hit rate",
        higher_is_better: true,
        read: |m| Some(m.prefix_hit_rate),
        shown: |v| format!("{:.1}%", v * 100.0),
    },
    Figure {
        name: "ttft_p50_ms",
        title: "TTFT p50",
        higher_is_better: false,
        read: |m| m.ttft_ms.p50,
        shown: |v| format!("{v:.1} ms"),
    },
    Figure {
        name: "ttft_p90_ms",
        title: "TTFT p90",
        higher_is_better: false,
        read: |m| m.ttft_ms.p90,
        shown: |v| format!("{v:.1} ms"),
    },
    Figure {
        name: "ttft_p99_ms",
        title: "TTFT p99",
        higher_is_better: false,
        read: |m| m.ttft_ms.p99,
        shown: |v| format!("{v:.1} ms"),
    },
    Figure {
        name: "busiest_over_idlest",
        title: "busiest/idlest",
        higher_is_better: false,
        read: |m| m.share_max_over_min,
        shown: |v| format!("{v:.2}"),
    },
    Figure {
        name: "errors",
        title: "errors",
        higher_is_better: false,
        read: |m| Some(m.errors as f64),
        shown: |v| format!("{v:.1}"),
    },
];

/// Every figure's name, as results.json names it, and whether more of it is better.
pub fn figure_names() -> impl Iterator<Item = (&'static str, bool)> {
    FIGURES.iter().map(|f| (f.name, f.higher_is_better))
}

/// A value of the figure named `name`, as the tables print it.
pub fn shown(name: &str, v: f64) -> String {
    FIGURES
        .iter()
        .find(|f| f.name == name)
        .map_or_else(|| format!("{v}"), |f| (f.shown)(v))
}

/// A difference of the figure named `name`, as the tables print it.
pub fn delta(name: &str, v: f64) -> String {
    FIGURES
        .iter()
        .find(|f| f.name == name)
        .map_or_else(|| format!("{v:+}"), |f| f.delta(v))
}

/// Each run's value of the figure named `name` (a `FIGURES` name, as results.json names it);
/// `None` when a run lacks it.
pub fn per_seed(runs: &[Measured], name: &str) -> Option<Vec<f64>> {
    let f = FIGURES.iter().find(|f| f.name == name)?;
    runs.iter().map(f.read).collect()
}

impl Figures {
    /// The figure's value in each run; `None` when some run has none (so pairs stay aligned).
    fn values(&self, f: &Figure) -> Option<Vec<f64>> {
        self.runs.iter().map(f.read).collect()
    }
}

/// A paired difference from the baseline and what it says.
#[derive(Serialize)]
struct Paired {
    difference: Interval,
    verdict: Verdict,
}

/// One router's line of results.json.
#[derive(Serialize)]
struct Row {
    router: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    skipped: Option<String>,
    /// Mean and interval of each figure over the seeds.
    figures: BTreeMap<&'static str, Interval>,
    /// Router minus baseline, seed by seed.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    vs_baseline: BTreeMap<&'static str, Paired>,
    /// Each seed's run as `compare` reports one.
    runs: Vec<Measured>,
}

#[derive(Serialize)]
struct Document<'a> {
    stamp: Stamp,
    workload: &'a Workload,
    fleet: &'a Value,
    seeds: &'a [u64],
    baseline: Option<String>,
    knobs: super::Knobs,
    results: Vec<Row>,
}

/// Everything one lab invocation reports.
pub struct Table<'a> {
    pub workload: &'a Workload,
    pub fleet: Value,
    pub seeds: &'a [u64],
    pub routers: &'a [Router],
    pub figures: &'a [Figures],
    pub baseline: Option<usize>,
    pub knobs: super::Knobs,
}

impl Table<'_> {
    fn rows(&self) -> Vec<Row> {
        let base = self.baseline.map(|b| &self.figures[b]);
        self.routers
            .iter()
            .zip(self.figures)
            .map(|(router, figs)| {
                let mut figures = BTreeMap::new();
                let mut vs_baseline = BTreeMap::new();
                for f in &FIGURES {
                    let Some(values) = figs.values(f) else {
                        continue;
                    };
                    if let Some(i) = stats::interval(&values) {
                        figures.insert(f.name, i);
                    }
                    let base_values = base
                        .filter(|b| !std::ptr::eq(*b, figs))
                        .and_then(|b| b.values(f));
                    if let Some(difference) = base_values.and_then(|b| stats::paired(&values, &b)) {
                        let verdict = stats::verdict(&difference, f.higher_is_better);
                        vs_baseline.insert(
                            f.name,
                            Paired {
                                difference,
                                verdict,
                            },
                        );
                    }
                }
                Row {
                    router: router.name(),
                    skipped: figs.skipped.clone(),
                    figures,
                    vs_baseline,
                    runs: figs.runs.clone(),
                }
            })
            .collect()
    }

    /// The tables: each figure's mean ± half-width per router, then the paired differences.
    pub fn markdown(&self) -> String {
        let rows = self.rows();
        let mut s = String::new();
        let _ = writeln!(
            s,
            "## lab: {} on {} seeds ({}..={})\n",
            self.workload.name,
            self.seeds.len(),
            self.seeds.first().copied().unwrap_or(0),
            self.seeds.last().copied().unwrap_or(0)
        );
        let titles: Vec<&str> = FIGURES.iter().map(|f| f.title).collect();
        let _ = writeln!(s, "| router | {} |", titles.join(" | "));
        let _ = writeln!(s, "|---|{}", "---:|".repeat(FIGURES.len()));
        for row in &rows {
            let cells: Vec<String> = FIGURES
                .iter()
                .map(|f| match row.figures.get(f.name) {
                    Some(i) => format!("{} ± {}", (f.shown)(i.mean), (f.shown)(i.half_width())),
                    None => String::new(),
                })
                .collect();
            let name = match &row.skipped {
                Some(why) => format!("{} (skipped: {why})", row.router),
                None => row.router.clone(),
            };
            let _ = writeln!(s, "| {name} | {} |", cells.join(" | "));
        }
        if let Some(b) = self.baseline {
            let _ = writeln!(
                s,
                "\nPaired against {} (router − baseline, seed by seed; 95% interval):\n",
                self.routers[b].name()
            );
            let _ = writeln!(s, "| router | {} |", titles.join(" | "));
            let _ = writeln!(s, "|---|{}", "---|".repeat(FIGURES.len()));
            for row in rows.iter().filter(|r| !r.vs_baseline.is_empty()) {
                let cells: Vec<String> = FIGURES
                    .iter()
                    .map(|f| match row.vs_baseline.get(f.name) {
                        Some(p) => format!(
                            "{} [{}, {}] {}",
                            f.delta(p.difference.mean),
                            f.delta(p.difference.lo),
                            f.delta(p.difference.hi),
                            p.verdict.name()
                        ),
                        None => String::new(),
                    })
                    .collect();
                let _ = writeln!(s, "| {} | {} |", row.router, cells.join(" | "));
            }
        }
        s
    }

    /// results.json and results.md in `dir`, stamped with the build and date.
    pub fn write(&self, dir: &Path) -> Result<(), String> {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let stamp = Stamp::now();
        let doc = Document {
            stamp: stamp.clone(),
            workload: self.workload,
            fleet: &self.fleet,
            seeds: self.seeds,
            baseline: self.baseline.map(|b| self.routers[b].name()),
            knobs: self.knobs,
            results: self.rows(),
        };
        let json = serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?;
        let md = format!(
            "{}\nbuild {}, {}\n",
            self.markdown(),
            stamp.commit,
            stamp.date
        );
        for (name, text) in [("results.json", json + "\n"), ("results.md", md)] {
            let path = dir.join(name);
            std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
        }
        Ok(())
    }
}
