//! `compare --repeat N`: the comparison N times, each with the next workload seed, and how often
//! the first router was at least as good as each other one, so that a tie reads as a tie.
//!
//! One run of a workload under cache pressure moves by a point or two of hit rate and a few ms
//! of TTFT between runs of the same routers; a line like "hit rate ≥ smg's" is then decided by
//! chance in one run. Each repeat is still a side-by-side run (every router on the same requests,
//! in the same minutes); the order of the routers is reversed every other repeat, so a slow spell
//! of the shared machine does not always fall on the same router's turn.

use crate::compare;
use crate::report::{Measured, Results, RouterResult};
use crate::routers::Router;
use crate::workload::Workload;
use serde_json::{json, Value};
use std::fmt::Write as _;
use std::path::Path;

/// The numbers compared across repeats, each with the direction that is better.
const METRICS: [Metric; 4] = [
    Metric {
        name: "prefix hit rate",
        key: "prefix_hit_rate",
        get: |m| Some(m.prefix_hit_rate),
        higher_is_better: true,
        percent: true,
    },
    Metric {
        name: "TTFT p50 ms",
        key: "ttft_p50_ms",
        get: |m| m.ttft_ms.p50,
        higher_is_better: false,
        percent: false,
    },
    Metric {
        name: "TTFT p90 ms",
        key: "ttft_p90_ms",
        get: |m| m.ttft_ms.p90,
        higher_is_better: false,
        percent: false,
    },
    Metric {
        name: "busiest/idlest",
        key: "busiest_over_idlest",
        get: |m| m.share_max_over_min,
        higher_is_better: false,
        percent: false,
    },
];

struct Metric {
    name: &'static str,
    key: &'static str,
    get: fn(&Measured) -> Option<f64>,
    higher_is_better: bool,
    /// Shown in percent (points for differences).
    percent: bool,
}

impl Metric {
    fn show(&self, v: f64) -> String {
        match self.percent {
            true => format!("{:.1}%", v * 100.0),
            false => format!("{v:.2}"),
        }
    }

    fn show_diff(&self, d: f64) -> String {
        match self.percent {
            true => format!("{:+.1} pts", d * 100.0),
            false => format!("{d:+.2}"),
        }
    }
}

/// What the repeats measured, written into repeats.md and repeats.json beside the build's stamp.
pub struct Measuring<'a> {
    /// The workload's `name`.
    pub workload: &'a str,
    /// The fleet spec's file name without `.json` (`pressure` for bench/fleets/pressure.json).
    pub fleet: &'a str,
}

/// Runs `compare` `n` times (seeds `workload.seed`, +1, …), writing each run to `out/run-<r>`
/// as a single run writes `out`; returns the summary, also written to `out/repeats.{md,json}`.
pub async fn repeat(
    fleet_name: &str,
    fleet_spec: &Value,
    workload: &Workload,
    routers: &[Router],
    n: usize,
    workers: u32,
    out: &Path,
) -> Result<String, String> {
    let seeds: Vec<u64> = (0..n)
        .map(|r| workload.seed.wrapping_add(r as u64))
        .collect();
    let mut runs = Vec::new();
    for (r, &seed) in seeds.iter().enumerate() {
        let mut w = workload.clone();
        w.seed = seed;
        let mut order = routers.to_vec();
        if r % 2 == 1 {
            order.reverse();
        }
        eprintln!("=== repeat {}/{n}: seed {}", r + 1, w.seed);
        let results = compare::compare(fleet_spec, &w, &order, workers).await?;
        let dir = out.join(format!("run-{}", r + 1));
        results.write_all(&dir)?;
        eprintln!("wrote {}/results.json, results.md, ttft.svg", dir.display());
        runs.push(results);
    }
    let names: Vec<String> = routers.iter().map(Router::name).collect();
    let what = Measuring {
        workload: &workload.name,
        fleet: fleet_name,
    };
    let (md, json) = summarize(&what, &names, &seeds, &runs);
    let text = serde_json::to_string_pretty(&json).map_err(|e| e.to_string())?;
    std::fs::create_dir_all(out).map_err(|e| format!("{}: {e}", out.display()))?;
    for (name, body) in [("repeats.md", md.clone()), ("repeats.json", text + "\n")] {
        let p = out.join(name);
        std::fs::write(&p, body).map_err(|e| format!("{}: {e}", p.display()))?;
    }
    Ok(md)
}

/// Each router's value of `metric` in each run (`None` where it was skipped or has none).
fn values(name: &str, metric: &Metric, runs: &[Results]) -> Vec<Option<f64>> {
    runs.iter()
        .map(|run| {
            run.results.iter().find_map(|r| match r {
                RouterResult::Measured(m) if m.router == name => (metric.get)(m),
                _ => None,
            })
        })
        .collect()
}

/// `first`'s and `other`'s value of `metric` in each run, where both have one.
fn paired_values(
    first: &str,
    other: &str,
    metric: &Metric,
    runs: &[Results],
) -> Vec<Option<(f64, f64)>> {
    values(first, metric, runs)
        .into_iter()
        .zip(values(other, metric, runs))
        .map(|(a, b)| Some((a?, b?)))
        .collect()
}

/// The summary of `runs` for `routers` (in the order given: the first is the one the others are
/// paired with): markdown, and the same as JSON; both say what was measured, and on which build
/// (the first run's stamp).
pub fn summarize(
    what: &Measuring,
    routers: &[String],
    seeds: &[u64],
    runs: &[Results],
) -> (String, Value) {
    let stamp = runs.first().and_then(|r| r.stamp.as_ref());
    let mut md = format!(
        "## {} repeats (seeds {})\n\nworkload {}, fleet {}, build {}\n\n",
        runs.len(),
        seeds
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(", "),
        what.workload,
        what.fleet,
        stamp.map_or("unstamped".into(), |s| format!("{}, {}", s.commit, s.date)),
    );
    md += "mean (min–max) over the repeats\n\n";
    md += &metrics_header("router");
    let mut per_router = serde_json::Map::new();
    for name in routers {
        let _ = write!(md, "| {name} |");
        let mut fields = serde_json::Map::new();
        for m in &METRICS {
            let vs = values(name, m, runs);
            let got: Vec<f64> = vs.iter().flatten().copied().collect();
            let cell = match spread(&got) {
                Some((mean, lo, hi)) => {
                    format!("{} ({}–{})", m.show(mean), m.show(lo), m.show(hi))
                }
                None => "-".into(),
            };
            let _ = write!(md, " {cell} |");
            fields.insert(m.key.into(), json!(vs));
        }
        md += "\n";
        per_router.insert(name.clone(), Value::Object(fields));
    }
    let mut paired = Vec::new();
    if let Some((first, others)) = routers.split_first().filter(|(_, o)| !o.is_empty()) {
        let _ = write!(
            md,
            "\n{first} against each other router, repeat by repeat: in how many it was at least as good, and the mean difference ({first} − other)\n\n"
        );
        md += &metrics_header("other");
        for other in others {
            let _ = write!(md, "| {other} |");
            let mut fields = serde_json::Map::new();
            for m in &METRICS {
                let pairs: Vec<(f64, f64)> = paired_values(first, other, m, runs)
                    .into_iter()
                    .flatten()
                    .collect();
                let as_good = pairs
                    .iter()
                    .filter(|(a, b)| match m.higher_is_better {
                        true => a >= b,
                        false => a <= b,
                    })
                    .count();
                let mean_diff = (!pairs.is_empty())
                    .then(|| pairs.iter().map(|(a, b)| a - b).sum::<f64>() / pairs.len() as f64);
                let cell = match mean_diff {
                    Some(d) => format!("{as_good}/{} ({})", pairs.len(), m.show_diff(d)),
                    None => "-".into(),
                };
                let _ = write!(md, " {cell} |");
                fields.insert(
                    m.key.into(),
                    json!({"as_good": as_good, "pairs": pairs.len(), "mean_difference": mean_diff}),
                );
            }
            md += "\n";
            paired.push(json!({"router": first, "other": other, "metrics": fields}));
        }
        md += &ratios(first, others, seeds, runs);
    }
    let json = json!({
        "workload": what.workload,
        "fleet": what.fleet,
        "stamp": stamp,
        "repeats": runs.len(),
        "seeds": seeds,
        "routers": per_router,
        "paired": paired,
    });
    (md, json)
}

/// A table's header: `first` column, then one right-aligned column per metric.
fn metrics_header(first: &str) -> String {
    let mut md = format!("| {first} |");
    for m in &METRICS {
        let _ = write!(md, " {} |", m.name);
    }
    md += "\n|---|";
    md += &"---:|".repeat(METRICS.len());
    md + "\n"
}

/// Each other router's hit rate and TTFT p50/p90 over `first`'s, repeat by repeat: lines such as
/// "three gateways keep 0.95× one gateway's hit rate" are ratios of one run's side-by-side rows.
fn ratios(first: &str, others: &[String], seeds: &[u64], runs: &[Results]) -> String {
    let mut md =
        format!("\nother / {first}, repeat by repeat: hit rate, TTFT p50, TTFT p90\n\n| other |");
    for seed in seeds {
        let _ = write!(md, " seed {seed} |");
    }
    md += "\n|---|";
    md += &"---|".repeat(seeds.len());
    md += "\n";
    for other in others {
        let _ = write!(md, "| {other} |");
        let per: Vec<Vec<Option<f64>>> = METRICS[..3]
            .iter()
            .map(|m| {
                paired_values(first, other, m, runs)
                    .into_iter()
                    .map(|p| p.map(|(a, b)| b / a).filter(|r| r.is_finite()))
                    .collect()
            })
            .collect();
        for r in 0..runs.len() {
            let cell: Vec<String> = per
                .iter()
                .map(|v| v[r].map_or("-".into(), |x| format!("{x:.2}×")))
                .collect();
            let _ = write!(md, " {} |", cell.join(", "));
        }
        md += "\n";
    }
    md
}

/// Mean, min and max; `None` for no values.
fn spread(xs: &[f64]) -> Option<(f64, f64, f64)> {
    let lo = xs.iter().copied().reduce(f64::min)?;
    let hi = xs.iter().copied().reduce(f64::max)?;
    Some((xs.iter().sum::<f64>() / xs.len() as f64, lo, hi))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::{E2e, Ttft};

    fn measured(router: &str, hit: f64, p50: f64, p90: f64, spread: f64) -> RouterResult {
        RouterResult::Measured(Measured {
            router: router.into(),
            requests: 100,
            errors: 0,
            ttft_ms: Ttft {
                p50: Some(p50),
                p90: Some(p90),
                p99: Some(p90),
            },
            e2e_ms: E2e {
                p50: Some(p50),
                p90: Some(p90),
            },
            output_tok_s: 1.0,
            req_s: 1.0,
            prefix_hit_rate: hit,
            share_max_over_min: Some(spread),
            engine_reported_hit_rate: None,
            index: None,
        })
    }

    fn run(results: Vec<RouterResult>) -> Results {
        Results {
            stamp: None,
            workload: json!({"name": "w"}),
            fleet: json!({}),
            envoy_workers: 2,
            ceiling_hit_rate: None,
            capacity_bound_hit_rate: None,
            fleet_lru_hit_rate: None,
            results,
            samples: Vec::new(),
        }
    }

    #[test]
    fn the_summary_pairs_the_first_router_with_each_other_repeat_by_repeat() {
        // Three repeats, the routers in either order as the reversed runs list them; smg is
        // skipped in the third.
        let runs = vec![
            run(vec![
                measured("kvroute", 0.70, 36.0, 130.0, 1.5),
                measured("smg", 0.68, 37.0, 130.0, 1.4),
            ]),
            run(vec![
                measured("smg", 0.69, 35.0, 140.0, 1.6),
                measured("kvroute", 0.67, 38.0, 135.0, 1.7),
            ]),
            run(vec![
                RouterResult::Skipped {
                    router: "smg".into(),
                    skipped: "not installed".into(),
                },
                measured("kvroute", 0.72, 37.0, 120.0, 1.2),
            ]),
        ];
        let mut runs = runs;
        runs[0].stamp = Some(crate::stamp::Stamp {
            commit: "abc1234".into(),
            date: "2026-11-27T09:00Z".into(),
        });
        let routers = vec!["kvroute".to_string(), "smg".to_string()];
        let what = Measuring {
            workload: "zipf-pressure",
            fleet: "pressure",
        };
        let (md, json) = summarize(&what, &routers, &[12, 13, 14], &runs);
        // What was measured, and the first run's build.
        assert!(
            md.starts_with(
                "## 3 repeats (seeds 12, 13, 14)\n\nworkload zipf-pressure, fleet pressure, \
                 build abc1234, 2026-11-27T09:00Z\n\n"
            ),
            "{md}"
        );
        assert_eq!(json["workload"], "zipf-pressure");
        assert_eq!(json["fleet"], "pressure");
        assert_eq!(
            json["stamp"],
            json!({"commit": "abc1234", "date": "2026-11-27T09:00Z"})
        );
        let hit = &json["routers"]["kvroute"]["prefix_hit_rate"];
        assert_eq!(hit, &json!([0.70, 0.67, 0.72]));
        assert_eq!(
            json["routers"]["smg"]["ttft_p50_ms"],
            json!([37.0, 35.0, null])
        );
        let paired = &json["paired"][0]["metrics"];
        // Hit rate: 0.70 ≥ 0.68 yes, 0.67 ≥ 0.69 no; the third has no pair.
        assert_eq!(paired["prefix_hit_rate"]["as_good"], 1);
        assert_eq!(paired["prefix_hit_rate"]["pairs"], 2);
        let d = paired["prefix_hit_rate"]["mean_difference"]
            .as_f64()
            .unwrap();
        assert!((d - 0.0).abs() < 1e-9, "{d}");
        // TTFT p90, lower is better: 130 ≤ 130 counts as at least as good; 135 ≤ 140 too.
        assert_eq!(paired["ttft_p90_ms"]["as_good"], 2);
        assert!(md.contains("| kvroute | 69.7% (67.0%–72.0%) |"), "{md}");
        assert!(
            md.contains("| smg | 1/2 (+0.0 pts) | 1/2 (+1.00) | 2/2 (-2.50) |"),
            "{md}"
        );
        // smg over kvroute: 0.68 / 0.70, 37 / 36, 130 / 130; nothing for the skipped repeat.
        assert!(
            md.contains("| smg | 0.97×, 1.03×, 1.00× | 1.03×, 0.92×, 1.04× | -, -, - |"),
            "{md}"
        );
    }

    #[test]
    fn repeats_without_a_stamp_say_so() {
        let runs = vec![run(vec![measured("kvroute", 0.7, 36.0, 130.0, 1.5)])];
        let what = Measuring {
            workload: "llm-d",
            fleet: "default",
        };
        let (md, json) = summarize(&what, &["kvroute".into()], &[12], &runs);
        assert!(
            md.contains("\nworkload llm-d, fleet default, build unstamped\n"),
            "{md}"
        );
        assert_eq!(json["stamp"], Value::Null);
    }
}
