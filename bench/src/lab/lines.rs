//! Precise mode's lines decided in the lab: each line's routers on its fleet and workload over
//! paired seeds (`make lab-precise`), and a table of each check's paired interval against its
//! target: met when the whole interval is on the target's side, missed when it is on the other,
//! undecided when it straddles it.

use super::stats::{self, Interval};
use super::{measure, report, Knobs};
use crate::report::Measured;
use crate::routers::Router;
use crate::targets::{self, Cells, Check, Judge, Op, Target};
use crate::workload::Workload;
use serde_json::Value;
use std::path::Path;

/// Runs `names` (every line when empty), each into `dir/<line>/`.
pub fn run(dir: &Path, names: &[String], seeds: u64, knobs: &Knobs) -> Result<(), String> {
    for line in targets::lines()?
        .iter()
        .filter(|l| names.is_empty() || names.contains(&l.name))
    {
        eprintln!("lab-precise: {}", line.name);
        let root = crate::paths::workspace_root();
        let fleet_path = root.join(format!("bench/fleets/{}.json", line.fleet));
        let fleet_text = std::fs::read_to_string(&fleet_path)
            .map_err(|e| format!("{}: {e}", fleet_path.display()))?;
        let fleet: Value = serde_json::from_str(&fleet_text).map_err(|e| e.to_string())?;
        let workload =
            Workload::from_file(&root.join(format!("bench/workloads/{}.json", line.file)))?;
        let routers = Router::parse_list(&line.routers().join(","), None)?;
        let (seeds, figures) = measure(&fleet, &workload, &routers, seeds, knobs)?;
        let table = report::Table {
            workload: &workload,
            fleet,
            seeds: &seeds,
            routers: &routers,
            figures: &figures,
            baseline: None,
            knobs: *knobs,
        };
        table.write(&dir.join(&line.name))?;
    }
    Ok(())
}

/// The table of every line under `dir` (`dir/<line>/results.json`); a line not run shows as not
/// measured.
pub fn summary(dir: &Path) -> Result<String, String> {
    targets::table(dir, &Lab)
}

/// Judges each check on its paired interval over the lab's seeds.
struct Lab;

impl Judge for Lab {
    const FILE: &'static str = "results.json";
    const HEADER: &'static str = "| line | figure | mean (95%) | against | target | router − target (95%) | result | build, date, seeds |\n\
                      |---|---|---:|---|---|---:|---|---|\n";

    fn cells(&self, c: &Check, results: &Value) -> Result<Cells, String> {
        let (own, diff) = against_target(c, results)?;
        let show = |v: f64| c.metric.show(v);
        let delta = |v: f64| report::delta(c.metric.key(), v);
        let mean = format!("{} ± {}", show(own.mean), show(own.half_width()));
        let against = match c.target.of() {
            Some(of) => {
                let theirs = stats::interval(&per_seed(results, of, c.metric.key())?);
                theirs.map_or(String::new(), |t| format!("{of} {}", show(t.mean)))
            }
            None => String::new(),
        };
        let (interval, result) = match (&c.target, diff) {
            (Target::Relative { op, .. } | Target::Absolute { op, .. }, Some(d)) => {
                let interval = format!("{} [{}, {}]", delta(d.mean), delta(d.lo), delta(d.hi));
                (interval, decide(*op, &d))
            }
            _ => (String::new(), ""),
        };
        Ok(Cells {
            value: mean,
            against,
            after_target: vec![interval, result.to_string()],
        })
    }

    fn stamp(&self, results: &Value) -> String {
        let n = results["seeds"].as_array().map_or(0, Vec::len);
        targets::stamp_cell(results, n, "seeds")
    }
}

/// Each seed's value of `check`'s figure for `router`, from a lab results.json.
fn per_seed(results: &Value, router: &str, key: &str) -> Result<Vec<f64>, String> {
    let row = results["results"]
        .as_array()
        .and_then(|rows| rows.iter().find(|r| r["router"] == router))
        .ok_or_else(|| format!("no router {router}"))?;
    let runs: Vec<Measured> =
        serde_json::from_value(row["runs"].clone()).map_err(|e| format!("{router}: {e}"))?;
    report::per_seed(&runs, key).ok_or_else(|| format!("{router}: {key} missing in a run"))
}

/// The paired interval of the router's figure minus the target's bound, seed by seed, and the
/// router's own interval.
fn against_target(c: &Check, results: &Value) -> Result<(Interval, Option<Interval>), String> {
    let key = c.metric.key();
    let values = per_seed(results, &c.router, key)?;
    let own = stats::interval(&values).ok_or("no runs")?;
    let bounds: Vec<f64> = match &c.target {
        Target::Relative { times, of, .. } => per_seed(results, of, key)?
            .iter()
            .map(|b| times * b)
            .collect(),
        Target::Absolute { value, .. } => vec![*value; values.len()],
        Target::Context { .. } => return Ok((own, None)),
    };
    Ok((own, stats::paired(&values, &bounds)))
}

/// Met when the whole interval of (figure − bound) is on `op`'s side of 0, missed when it is
/// wholly on the other, undecided when it touches or straddles 0.
fn decide(op: Op, d: &Interval) -> &'static str {
    match op {
        Op::AtLeast if d.lo > 0.0 || (d.lo == 0.0 && d.hi == 0.0) => "met",
        Op::AtMost if d.hi < 0.0 || (d.lo == 0.0 && d.hi == 0.0) => "met",
        Op::AtLeast if d.hi < 0.0 => "missed",
        Op::AtMost if d.lo > 0.0 => "missed",
        _ => "undecided",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn interval(lo: f64, hi: f64) -> Interval {
        Interval {
            n: 30,
            mean: (lo + hi) / 2.0,
            lo,
            hi,
        }
    }

    /// README.md's and bench/README.md's lab-precise blocks are the table of the lines committed
    /// under bench/results/lab/precise, figure for figure.
    #[test]
    fn the_readmes_show_the_committed_lines() {
        let root = crate::paths::workspace_root();
        let table = summary(&root.join("bench/results/lab/precise")).unwrap();
        for file in ["README.md", "bench/README.md"] {
            let text = std::fs::read_to_string(root.join(file)).unwrap();
            let replaced = crate::report::replace_block(&text, "lab-precise", &table);
            assert_eq!(
                replaced.as_deref(),
                Some(text.as_str()),
                "{file}: its lab-precise block is not the lines' table \
                 (kvroute-bench lab-precise --summary-only --readme {file})"
            );
        }
    }

    #[test]
    fn a_check_is_met_only_when_its_whole_interval_is_on_the_targets_side() {
        assert_eq!(decide(Op::AtLeast, &interval(0.1, 0.3)), "met");
        assert_eq!(decide(Op::AtLeast, &interval(-0.1, 0.3)), "undecided");
        assert_eq!(decide(Op::AtLeast, &interval(-0.3, -0.1)), "missed");
        assert_eq!(decide(Op::AtMost, &interval(-0.3, -0.1)), "met");
        assert_eq!(decide(Op::AtMost, &interval(-0.1, 0.3)), "undecided");
        assert_eq!(decide(Op::AtMost, &interval(0.1, 0.3)), "missed");
    }
}
