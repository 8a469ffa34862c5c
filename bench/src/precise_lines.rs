//! Precise mode's targets: each line a `compare --repeat` run (`make bench-precise`) whose means
//! must meet the line's targets; reads each line's repeats.json and writes one table of the
//! figures, the targets, met or missed, and the build each line was measured on.

use serde_json::Value;
use std::fmt::Write as _;
use std::path::Path;

/// One line: a workload on a fleet through its routers, `--repeat N`, into `DIR/<name>/`.
pub struct Line {
    pub name: &'static str,
    /// The workload's `name` field, as repeats.json records it.
    pub workload: &'static str,
    /// The workload's file under bench/workloads, without `.json`.
    pub file: &'static str,
    /// The fleet spec's file name without `.json`, as repeats.json records it.
    pub fleet: &'static str,
    pub checks: &'static [Check],
}

/// One figure of one router, and what it must be.
pub struct Check {
    pub router: &'static str,
    pub metric: Metric,
    pub target: Target,
}

#[derive(Clone, Copy)]
pub enum Metric {
    HitRate,
    TtftP50,
    TtftP90,
    BusiestOverIdlest,
}

#[derive(Clone, Copy, PartialEq)]
pub enum Op {
    AtLeast,
    AtMost,
}

pub enum Target {
    /// The router's mean `op` `times` × `of`'s mean.
    Relative {
        op: Op,
        times: f64,
        of: &'static str,
    },
    /// The router's mean `op` `value`.
    Absolute { op: Op, value: f64 },
    /// No target: the router's figure beside `of`'s, for context.
    Context { of: &'static str },
}

const PRECISE: &str = "kvroute-precise";

const fn check(router: &'static str, metric: Metric, target: Target) -> Check {
    Check {
        router,
        metric,
        target,
    }
}

const fn rel(op: Op, times: f64, of: &'static str) -> Target {
    Target::Relative { op, times, of }
}

/// Hit rate at least kvroute's, TTFT p90 at most 1.05× kvroute's.
const AS_GOOD_AS_KVROUTE: &[Check] = &[
    check(PRECISE, Metric::HitRate, rel(Op::AtLeast, 1.0, "kvroute")),
    check(PRECISE, Metric::TtftP90, rel(Op::AtMost, 1.05, "kvroute")),
];

/// The lines, in the order of the table.
pub const LINES: &[Line] = &[
    Line {
        name: "zipf-pressure",
        workload: "zipf-pressure",
        file: "zipf-pressure",
        fleet: "pressure",
        checks: &[
            check(PRECISE, Metric::HitRate, rel(Op::AtLeast, 1.0, "smg")),
            check(PRECISE, Metric::TtftP50, rel(Op::AtMost, 1.0, "smg")),
            check(PRECISE, Metric::TtftP90, rel(Op::AtMost, 1.0, "smg")),
            check(
                PRECISE,
                Metric::BusiestOverIdlest,
                Target::Absolute {
                    op: Op::AtMost,
                    value: 2.0,
                },
            ),
        ],
    },
    Line {
        name: "grouped-pressure",
        workload: "grouped-pressure",
        file: "grouped-pressure",
        fleet: "pressure",
        checks: &[
            check(
                "kvroute-precise@3",
                Metric::HitRate,
                rel(Op::AtLeast, 0.98, PRECISE),
            ),
            check(
                "kvroute-precise@3",
                Metric::TtftP90,
                rel(Op::AtMost, 1.1, PRECISE),
            ),
            check(
                "kvroute-precise@8",
                Metric::HitRate,
                rel(Op::AtLeast, 0.95, PRECISE),
            ),
        ],
    },
    Line {
        name: "llm-d",
        workload: "llm-d-shared-prefix",
        file: "llm-d",
        fleet: "default",
        checks: AS_GOOD_AS_KVROUTE,
    },
    Line {
        name: "llm-d-sglang",
        workload: "llm-d-shared-prefix",
        file: "llm-d",
        fleet: "sglang",
        checks: AS_GOOD_AS_KVROUTE,
    },
    Line {
        name: "agentic",
        workload: "agentic",
        file: "agentic",
        fleet: "default",
        checks: AS_GOOD_AS_KVROUTE,
    },
    Line {
        name: "tenants",
        workload: "tenants",
        file: "tenants",
        fleet: "default",
        checks: AS_GOOD_AS_KVROUTE,
    },
    Line {
        name: "agentic-pressure",
        workload: "agentic",
        file: "agentic",
        fleet: "pressure",
        checks: &[
            check(PRECISE, Metric::HitRate, rel(Op::AtLeast, 0.95, "oracle")),
            check("smg", Metric::HitRate, Target::Context { of: "oracle" }),
        ],
    },
];

impl Metric {
    /// The field of repeats.json's `routers.<router>`.
    pub fn key(self) -> &'static str {
        match self {
            Metric::HitRate => "prefix_hit_rate",
            Metric::TtftP50 => "ttft_p50_ms",
            Metric::TtftP90 => "ttft_p90_ms",
            Metric::BusiestOverIdlest => "busiest_over_idlest",
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Metric::HitRate => "hit rate",
            Metric::TtftP50 => "TTFT p50",
            Metric::TtftP90 => "TTFT p90",
            Metric::BusiestOverIdlest => "busiest/idlest",
        }
    }

    pub fn show(self, v: f64) -> String {
        match self {
            Metric::HitRate => format!("{:.1}%", v * 100.0),
            Metric::TtftP50 | Metric::TtftP90 => format!("{v:.1} ms"),
            Metric::BusiestOverIdlest => format!("{v:.2}"),
        }
    }
}

impl Op {
    pub fn sign(self) -> &'static str {
        match self {
            Op::AtLeast => "≥",
            Op::AtMost => "≤",
        }
    }

    fn holds(self, value: f64, bound: f64) -> bool {
        match self {
            Op::AtLeast => value >= bound,
            Op::AtMost => value <= bound,
        }
    }
}

impl Line {
    /// The routers its checks name, in the order they first appear.
    pub fn routers(&self) -> Vec<&'static str> {
        let mut out: Vec<&'static str> = Vec::new();
        for c in self.checks {
            for r in std::iter::once(c.router).chain(c.target.of()) {
                if !out.contains(&r) {
                    out.push(r);
                }
            }
        }
        out
    }
}

impl Target {
    pub fn text(&self) -> String {
        match self {
            Target::Relative { op, times, of } if *times == 1.0 => format!("{} {of}'s", op.sign()),
            Target::Relative { op, times, of } => format!("{} {times}× {of}'s", op.sign()),
            Target::Absolute { op, value } => format!("{} {value:.1}", op.sign()),
            Target::Context { .. } => "for context".into(),
        }
    }

    /// The router whose figure this one is held against.
    pub fn of(&self) -> Option<&'static str> {
        match self {
            Target::Relative { of, .. } | Target::Context { of } => Some(of),
            Target::Absolute { .. } => None,
        }
    }
}

/// How a check came out.
#[derive(Debug, PartialEq)]
pub enum Outcome {
    Met,
    Missed,
    /// A figure it needs is absent (its router skipped or without the figure in every repeat).
    NoValue,
    /// A figure shown for context.
    Context,
}

impl Outcome {
    fn text(&self) -> &'static str {
        match self {
            Outcome::Met => "met",
            Outcome::Missed => "missed",
            Outcome::NoValue => "missed (no value)",
            Outcome::Context => "",
        }
    }
}

/// `router`'s mean of `metric` over the repeats that have it; `None` if none has.
pub fn mean(repeats: &Value, router: &str, metric: Metric) -> Option<f64> {
    let xs: Vec<f64> = repeats["routers"][router][metric.key()]
        .as_array()?
        .iter()
        .filter_map(Value::as_f64)
        .collect();
    (!xs.is_empty()).then(|| xs.iter().sum::<f64>() / xs.len() as f64)
}

/// Whether `value` meets `target`, `reference` being the mean of the router it names.
pub fn judge(target: &Target, value: Option<f64>, reference: Option<f64>) -> Outcome {
    match (target, value, reference) {
        (Target::Context { .. }, _, _) => Outcome::Context,
        (Target::Absolute { op, value: bound }, Some(v), _) => match op.holds(v, *bound) {
            true => Outcome::Met,
            false => Outcome::Missed,
        },
        (Target::Relative { op, times, .. }, Some(v), Some(r)) => match op.holds(v, times * r) {
            true => Outcome::Met,
            false => Outcome::Missed,
        },
        _ => Outcome::NoValue,
    }
}

/// The table's header.
const HEADER: &str =
    "| line | figure | mean | against | target | result | build, date, repeats |\n\
                      |---|---|---:|---|---|---|---|\n";

/// The table for the lines under `dir` (`dir/<line>/repeats.json`); a line without its file is
/// shown with its targets as not measured. A file whose workload, fleet or routers are not the
/// line's is an error.
pub fn summary(dir: &Path) -> Result<String, String> {
    let mut s = HEADER.to_string();
    for line in LINES {
        let path = dir.join(line.name).join("repeats.json");
        let repeats = match std::fs::read_to_string(&path) {
            Ok(text) => {
                let v: Value =
                    serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
                check_is_line(line, &v).map_err(|e| format!("{}: {e}", path.display()))?;
                Some(v)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(format!("{}: {e}", path.display())),
        };
        s += &rows(line, repeats.as_ref());
    }
    Ok(s)
}

/// An error naming what in `repeats` is not `line`'s.
fn check_is_line(line: &Line, repeats: &Value) -> Result<(), String> {
    for (field, want) in [("workload", line.workload), ("fleet", line.fleet)] {
        match repeats[field].as_str() {
            Some(got) if got != want => {
                return Err(format!(
                    "{field} is {got:?}, line {} runs {want:?}",
                    line.name
                ))
            }
            _ => {}
        }
    }
    for c in line.checks {
        for router in std::iter::once(c.router).chain(c.target.of()) {
            if repeats["routers"].get(router).is_none() {
                return Err(format!(
                    "no router {router}, which line {} needs",
                    line.name
                ));
            }
        }
    }
    Ok(())
}

/// `line`'s rows: one per check; its name and its build, date and repeats on the first.
fn rows(line: &Line, repeats: Option<&Value>) -> String {
    let mut s = String::new();
    for (i, c) in line.checks.iter().enumerate() {
        let (name, measured) = match (i, repeats) {
            (0, Some(r)) => (line.name, stamp_cell(r)),
            (0, None) => (line.name, String::new()),
            _ => ("", String::new()),
        };
        let figure = format!("{} {}", c.router, c.metric.name());
        let (mean_cell, against, result) = match repeats {
            None => ("not measured".to_string(), String::new(), ""),
            Some(r) => {
                let value = mean(r, c.router, c.metric);
                let reference = c.target.of().map(|of| (of, mean(r, of, c.metric)));
                let against = match reference {
                    None => String::new(),
                    Some((of, None)) => format!("{of} -"),
                    Some((of, Some(b))) => match value.filter(|_| b > 0.0) {
                        Some(v) => format!("{of} {} ({:.3}×)", c.metric.show(b), v / b),
                        None => format!("{of} {}", c.metric.show(b)),
                    },
                };
                let outcome = judge(&c.target, value, reference.and_then(|(_, b)| b));
                let shown = value.map_or("-".into(), |v| c.metric.show(v));
                (shown, against, outcome.text())
            }
        };
        let target = c.target.text();
        s += &table_row(&[
            name, &figure, &mean_cell, &against, &target, result, &measured,
        ]);
    }
    s
}

/// A markdown table row, `| a | | b |` for cells `a`, ``, `b`.
pub fn table_row(cells: &[&str]) -> String {
    let mut s = "|".to_string();
    for c in cells {
        match c.is_empty() {
            true => s += " |",
            false => {
                let _ = write!(s, " {c} |");
            }
        }
    }
    s + "\n"
}

/// `commit, date, N repeats` from repeats.json (`unstamped` where it has no stamp).
fn stamp_cell(repeats: &Value) -> String {
    let stamp = &repeats["stamp"];
    let build = match (stamp["commit"].as_str(), stamp["date"].as_str()) {
        (Some(c), Some(d)) => format!("{c}, {d}"),
        _ => "unstamped".into(),
    };
    let n = repeats["repeats"].as_u64().unwrap_or(0);
    format!("{build}, {n} repeats")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A real `compare --repeat 3` of kvroute-precise and smg on zipf-pressure (written before
    /// repeats.json named the workload, fleet and stamp).
    const ZIPF: &str = include_str!("../tests/fixtures/zipf-pressure-repeats.json");

    fn line(name: &str) -> &'static Line {
        LINES.iter().find(|l| l.name == name).unwrap()
    }

    #[test]
    fn means_skip_repeats_without_a_value() {
        let r = json!({"routers": {"a": {"ttft_p90_ms": [100.0, null, 200.0], "prefix_hit_rate": [null]}}});
        assert_eq!(mean(&r, "a", Metric::TtftP90), Some(150.0));
        assert_eq!(mean(&r, "a", Metric::HitRate), None);
        assert_eq!(mean(&r, "b", Metric::HitRate), None);
    }

    #[test]
    fn targets_are_met_at_the_bound_and_missed_past_it() {
        let at_least = rel(Op::AtLeast, 0.98, PRECISE);
        assert_eq!(judge(&at_least, Some(0.784), Some(0.8)), Outcome::Met);
        assert_eq!(judge(&at_least, Some(0.7839), Some(0.8)), Outcome::Missed);
        let at_most = rel(Op::AtMost, 1.1, PRECISE);
        assert_eq!(judge(&at_most, Some(110.0), Some(100.0)), Outcome::Met);
        assert_eq!(judge(&at_most, Some(110.1), Some(100.0)), Outcome::Missed);
        let bound = Target::Absolute {
            op: Op::AtMost,
            value: 2.0,
        };
        assert_eq!(judge(&bound, Some(2.0), None), Outcome::Met);
        assert_eq!(judge(&bound, Some(2.01), None), Outcome::Missed);
        // A figure that is absent never meets a target.
        assert_eq!(judge(&at_least, None, Some(0.8)), Outcome::NoValue);
        assert_eq!(judge(&at_least, Some(0.9), None), Outcome::NoValue);
        assert_eq!(judge(&bound, None, None), Outcome::NoValue);
        let context = Target::Context { of: "oracle" };
        assert_eq!(judge(&context, Some(0.1), Some(0.9)), Outcome::Context);
    }

    #[test]
    fn a_real_repeats_file_gives_the_zipf_line() {
        let r: Value = serde_json::from_str(ZIPF).unwrap();
        check_is_line(line("zipf-pressure"), &r).unwrap();
        let rows = rows(line("zipf-pressure"), Some(&r));
        let rows: Vec<&str> = rows.lines().collect();
        // Hit rate: mean of 0.6681, 0.687, 0.6764 against smg's 0.6591, 0.691, 0.6664.
        assert_eq!(
            rows[0],
            "| zipf-pressure | kvroute-precise hit rate | 67.7% | smg 67.2% (1.007×) | ≥ smg's | met | unstamped, 3 repeats |"
        );
        // TTFT p50: 53.77 against (53.25 + 51.75 + 75.87) / 3 = 60.29.
        assert_eq!(
            rows[1],
            "| | kvroute-precise TTFT p50 | 53.8 ms | smg 60.3 ms (0.892×) | ≤ smg's | met | |"
        );
        assert_eq!(
            rows[3],
            "| | kvroute-precise busiest/idlest | 1.85 | | ≤ 2.0 | met | |"
        );
        assert_eq!(rows.len(), 4);
    }

    #[test]
    fn a_target_missed_says_so() {
        let r = json!({
            "workload": "grouped-pressure", "fleet": "pressure", "repeats": 3,
            "stamp": {"commit": "abc1234", "date": "2026-11-27T09:00Z"},
            "routers": {
                "kvroute-precise": {"prefix_hit_rate": [0.80, 0.80, 0.80], "ttft_p90_ms": [100.0, 100.0, 100.0]},
                "kvroute-precise@3": {"prefix_hit_rate": [0.78, 0.79, 0.80], "ttft_p90_ms": [120.0, 100.0, 110.0]},
                "kvroute-precise@8": {"prefix_hit_rate": [null, null, null], "ttft_p90_ms": [null, null, null]},
            },
        });
        check_is_line(line("grouped-pressure"), &r).unwrap();
        let rows = rows(line("grouped-pressure"), Some(&r));
        let rows: Vec<&str> = rows.lines().collect();
        // 0.79 ≥ 0.98 × 0.80 = 0.784.
        assert_eq!(
            rows[0],
            "| grouped-pressure | kvroute-precise@3 hit rate | 79.0% | kvroute-precise 80.0% (0.987×) | ≥ 0.98× kvroute-precise's | met | abc1234, 2026-11-27T09:00Z, 3 repeats |"
        );
        // 110 ≤ 1.1 × 100 (at the bound); then @8 was skipped in every repeat.
        assert!(
            rows[1].ends_with("| ≤ 1.1× kvroute-precise's | met | |"),
            "{}",
            rows[1]
        );
        assert_eq!(
            rows[2],
            "| | kvroute-precise@8 hit rate | - | kvroute-precise 80.0% | ≥ 0.95× kvroute-precise's | missed (no value) | |"
        );
        let mut slower = r.clone();
        slower["routers"]["kvroute-precise@3"]["ttft_p90_ms"] = json!([120.0, 101.0, 110.0]);
        let rows = super::rows(line("grouped-pressure"), Some(&slower));
        assert!(
            rows.contains("(1.103×) | ≤ 1.1× kvroute-precise's | missed |"),
            "{rows}"
        );
    }

    #[test]
    fn a_file_of_another_workload_fleet_or_routers_is_refused() {
        let mut r: Value = serde_json::from_str(ZIPF).unwrap();
        r["fleet"] = json!("default");
        let e = check_is_line(line("zipf-pressure"), &r).unwrap_err();
        assert!(e.contains("fleet is \"default\""), "{e}");
        let r: Value = serde_json::from_str(ZIPF).unwrap();
        let e = check_is_line(line("llm-d"), &r).unwrap_err();
        assert!(e.contains("no router kvroute,"), "{e}");
        let mut r: Value = serde_json::from_str(ZIPF).unwrap();
        r["workload"] = json!("agentic");
        assert!(check_is_line(line("zipf-pressure"), &r).is_err());
    }

    #[test]
    fn lines_without_a_file_show_their_targets_as_not_measured() {
        let dir = std::env::temp_dir().join(format!("kvroute-precise-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("zipf-pressure")).unwrap();
        std::fs::write(dir.join("zipf-pressure/repeats.json"), ZIPF).unwrap();
        let table = summary(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        let table = table.unwrap();
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines[0], HEADER.lines().next().unwrap());
        let checks: usize = LINES.iter().map(|l| l.checks.len()).sum();
        assert_eq!(lines.len(), 2 + checks);
        assert!(lines[2].starts_with("| zipf-pressure | kvroute-precise hit rate | 67.7% |"));
        assert_eq!(
            lines[6],
            "| grouped-pressure | kvroute-precise@3 hit rate | not measured | | ≥ 0.98× kvroute-precise's | | |"
        );
        assert_eq!(
            lines.last().unwrap(),
            &"| | smg hit rate | not measured | | for context | | |"
        );
    }
}
