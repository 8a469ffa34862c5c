//! Precise mode's lines and their targets, read from `bench/targets/precise.toml`, and the one
//! renderer of their tables: a row per check, judged by the wall-clock repeats
//! ([`repeats`], `precise-summary`) or by the lab's paired seeds (`lab-precise`).

pub mod repeats;

use serde::Deserialize;
use serde_json::Value;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// One line: a workload on a fleet through the routers its checks name, into `DIR/<name>/`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Line {
    pub name: String,
    /// The workload's `name` field, as repeats.json records it.
    pub workload: String,
    /// The workload's file under bench/workloads, without `.json`.
    pub file: String,
    /// The fleet spec's file name without `.json`, as repeats.json records it.
    pub fleet: String,
    pub checks: Vec<Check>,
}

/// One figure of one router, and what it must be.
#[derive(Debug, Deserialize)]
#[serde(try_from = "CheckFields")]
pub struct Check {
    pub router: String,
    pub metric: Metric,
    pub target: Target,
}

/// A check as the file spells it (see its header).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CheckFields {
    router: String,
    metric: Metric,
    at_least: Option<f64>,
    at_most: Option<f64>,
    of: Option<String>,
}

impl TryFrom<CheckFields> for Check {
    type Error = String;

    fn try_from(c: CheckFields) -> Result<Check, String> {
        let bound = match (c.at_least, c.at_most) {
            (Some(_), Some(_)) => {
                return Err(format!("{}: at_least and at_most both given", c.router))
            }
            (Some(x), None) => Some((Op::AtLeast, x)),
            (None, Some(x)) => Some((Op::AtMost, x)),
            (None, None) => None,
        };
        let target = match (bound, c.of) {
            (Some((op, times)), Some(of)) => Target::Relative { op, times, of },
            (Some((op, value)), None) => Target::Absolute { op, value },
            (None, Some(of)) => Target::Context { of },
            (None, None) => return Err(format!("{}: neither a bound nor `of`", c.router)),
        };
        Ok(Check {
            router: c.router,
            metric: c.metric,
            target,
        })
    }
}

/// A figure, named by its field in repeats.json's `routers.<router>` and the lab's runs.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Metric {
    #[serde(rename = "prefix_hit_rate")]
    HitRate,
    #[serde(rename = "ttft_p50_ms")]
    TtftP50,
    #[serde(rename = "ttft_p90_ms")]
    TtftP90,
    BusiestOverIdlest,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Op {
    AtLeast,
    AtMost,
}

#[derive(Debug)]
pub enum Target {
    /// The router's figure `op` `times` × `of`'s.
    Relative { op: Op, times: f64, of: String },
    /// The router's figure `op` `value`.
    Absolute { op: Op, value: f64 },
    /// No target: the router's figure beside `of`'s, for context.
    Context { of: String },
}

/// The file of the lines: `bench/targets/precise.toml` under the workspace root.
pub fn path() -> PathBuf {
    crate::paths::workspace_root().join("bench/targets/precise.toml")
}

/// The lines of [`path`], in table order.
pub fn lines() -> Result<Vec<Line>, String> {
    let path = path();
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    parse(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// The lines of a targets file's text.
pub fn parse(text: &str) -> Result<Vec<Line>, String> {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct File {
        line: Vec<Line>,
    }
    let file: File = toml::from_str(text).map_err(|e| e.to_string())?;
    Ok(file.line)
}

impl Metric {
    /// The field of repeats.json's `routers.<router>`, and of the lab's runs.
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

    pub fn holds(self, value: f64, bound: f64) -> bool {
        match self {
            Op::AtLeast => value >= bound,
            Op::AtMost => value <= bound,
        }
    }
}

impl Line {
    /// The routers its checks name, in the order they first appear.
    pub fn routers(&self) -> Vec<&str> {
        let mut out: Vec<&str> = Vec::new();
        for c in &self.checks {
            for r in std::iter::once(c.router.as_str()).chain(c.target.of()) {
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
    pub fn of(&self) -> Option<&str> {
        match self {
            Target::Relative { of, .. } | Target::Context { of } => Some(of),
            Target::Absolute { .. } => None,
        }
    }
}

/// What a table shows of a measured check, between its figure and its build column: the
/// figure's value, what it is held against, and the cells after the target.
pub struct Cells {
    pub value: String,
    pub against: String,
    pub after_target: Vec<String>,
}

/// How one table judges the checks from the file each line's runs wrote.
pub trait Judge {
    /// The file under `DIR/<line>/` (`repeats.json`, `results.json`).
    const FILE: &'static str;
    /// The header and separator rows: line, figure, value, against, target, the cells after the
    /// target, and the build.
    const HEADER: &'static str;

    /// An error naming what in `file` is not `line`'s.
    fn check_file(&self, _line: &Line, _file: &Value) -> Result<(), String> {
        Ok(())
    }

    /// The cells of `check` measured in `file`.
    fn cells(&self, check: &Check, file: &Value) -> Result<Cells, String>;

    /// The build column of a line's first row: [`stamp_cell`].
    fn stamp(&self, file: &Value) -> String;
}

/// The table of every line under `dir` (`dir/<line>/<J::FILE>`), judged by `judge`; a line
/// without its file shows its targets as not measured.
pub fn table<J: Judge>(dir: &Path, judge: &J) -> Result<String, String> {
    let columns = J::HEADER
        .lines()
        .next()
        .map_or(0, |h| h.matches('|').count() - 1);
    let mut s = J::HEADER.to_string();
    for line in lines()? {
        let path = dir.join(&line.name).join(J::FILE);
        let at = |e: String| format!("{}: {e}", path.display());
        let file = match std::fs::read_to_string(&path) {
            Ok(text) => {
                let v: Value = serde_json::from_str(&text).map_err(|e| at(e.to_string()))?;
                judge.check_file(&line, &v).map_err(at)?;
                Some(v)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(at(e.to_string())),
        };
        s += &rows(&line, file.as_ref(), judge, columns).map_err(at)?;
    }
    Ok(s)
}

/// `line`'s rows of a table of `columns` columns: one per check; its name, and its build on the
/// first.
pub fn rows<J: Judge>(
    line: &Line,
    file: Option<&Value>,
    judge: &J,
    columns: usize,
) -> Result<String, String> {
    let mut s = String::new();
    for (i, c) in line.checks.iter().enumerate() {
        let name = if i == 0 { line.name.as_str() } else { "" };
        let figure = format!("{} {}", c.router, c.metric.name());
        let target = c.target.text();
        let (cells, stamp) = match file {
            None => {
                let after = vec![String::new(); columns.saturating_sub(6)];
                let cells = Cells {
                    value: "not measured".into(),
                    against: String::new(),
                    after_target: after,
                };
                (cells, String::new())
            }
            Some(f) => {
                let stamp = if i == 0 {
                    judge.stamp(f)
                } else {
                    String::new()
                };
                (judge.cells(c, f)?, stamp)
            }
        };
        let mut row = vec![name, &figure, &cells.value, &cells.against, &target];
        row.extend(cells.after_target.iter().map(String::as_str));
        row.push(&stamp);
        s += &table_row(&row);
    }
    Ok(s)
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

/// `commit, date, N <unit>` from a results file's `stamp` (`unstamped` where it has none).
pub fn stamp_cell(file: &Value, n: usize, unit: &str) -> String {
    let stamp = &file["stamp"];
    let build = match (stamp["commit"].as_str(), stamp["date"].as_str()) {
        (Some(c), Some(d)) => format!("{c}, {d}"),
        _ => "unstamped".into(),
    };
    format!("{build}, {n} {unit}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_file_reads_and_names_each_line_once() {
        let lines = lines().unwrap();
        let mut names: Vec<&str> = lines.iter().map(|l| l.name.as_str()).collect();
        assert_eq!(names[0], "zipf-pressure");
        names.sort();
        names.dedup();
        assert_eq!(names.len(), lines.len());
        assert!(lines.iter().all(|l| !l.checks.is_empty()));
        let zipf = &lines[0];
        assert_eq!(zipf.routers(), ["kvroute-precise", "smg"]);
        assert_eq!(zipf.checks[3].target.text(), "≤ 2.0");
    }

    #[test]
    fn a_check_is_a_relative_bound_an_absolute_one_or_context() {
        let lines = parse(
            r#"
            [[line]]
            name = "l"
            workload = "w"
            file = "w"
            fleet = "f"
            checks = [
                { router = "a", metric = "ttft_p90_ms", at_most = 1.1, of = "b" },
                { router = "a", metric = "busiest_over_idlest", at_most = 2.0 },
                { router = "c", metric = "prefix_hit_rate", of = "b" },
            ]
            "#,
        )
        .unwrap();
        let texts: Vec<String> = lines[0].checks.iter().map(|c| c.target.text()).collect();
        assert_eq!(texts, ["≤ 1.1× b's", "≤ 2.0", "for context"]);
        assert_eq!(lines[0].routers(), ["a", "b", "c"]);
    }

    #[test]
    fn a_check_without_a_target_or_with_two_bounds_is_refused() {
        let file = |check: &str| {
            format!(
                "[[line]]\nname = \"l\"\nworkload = \"w\"\nfile = \"w\"\nfleet = \"f\"\n\
                 checks = [{check}]\n"
            )
        };
        let e = parse(&file(r#"{ router = "a", metric = "prefix_hit_rate" }"#)).unwrap_err();
        assert!(e.contains("neither a bound nor `of`"), "{e}");
        let both = r#"{ router = "a", metric = "prefix_hit_rate", at_least = 1.0, at_most = 2.0 }"#;
        let e = parse(&file(both)).unwrap_err();
        assert!(e.contains("at_least and at_most both given"), "{e}");
        let e = parse(&file(r#"{ router = "a", metric = "hits", of = "b" }"#)).unwrap_err();
        assert!(e.contains("hits"), "{e}");
    }
}
