//! The lines judged in wall-clock time (`precise-summary`): each line a `compare --repeat` run
//! (`make bench-precise`) whose means over the repeats (its repeats.json) must meet the line's
//! targets; a table of the figures, the targets, met or missed, and the build each line was
//! measured on.

use super::{Cells, Check, Judge, Line, Metric, Target};
use serde_json::Value;
use std::path::Path;

/// The precise-summary table of the lines under `dir` (`dir/<line>/repeats.json`). A file whose
/// workload, fleet or routers are not its line's is an error.
pub fn summary(dir: &Path) -> Result<String, String> {
    super::table(dir, &Repeats)
}

/// Judges each check on the means over the repeats.
pub struct Repeats;

impl Judge for Repeats {
    const FILE: &'static str = "repeats.json";
    const HEADER: &'static str =
        "| line | figure | mean | against | target | result | build, date, repeats |\n\
         |---|---|---:|---|---|---|---|\n";

    fn check_file(&self, line: &Line, repeats: &Value) -> Result<(), String> {
        for (field, want) in [("workload", &line.workload), ("fleet", &line.fleet)] {
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
        for router in line.routers() {
            if repeats["routers"].get(router).is_none() {
                return Err(format!(
                    "no router {router}, which line {} needs",
                    line.name
                ));
            }
        }
        Ok(())
    }

    fn cells(&self, c: &Check, r: &Value) -> Result<Cells, String> {
        let value = mean(r, &c.router, c.metric);
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
        Ok(Cells {
            value: value.map_or("-".into(), |v| c.metric.show(v)),
            against,
            after_target: vec![outcome.text().to_string()],
        })
    }

    fn stamp(&self, repeats: &Value) -> String {
        let n = repeats["repeats"].as_u64().unwrap_or(0) as usize;
        super::stamp_cell(repeats, n, "repeats")
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

#[cfg(test)]
mod tests {
    use super::super::{lines, Op};
    use super::*;
    use serde_json::json;

    /// A real `compare --repeat 3` of kvroute-precise and smg on zipf-pressure (written before
    /// repeats.json named the workload, fleet and stamp).
    const ZIPF: &str = include_str!("../../tests/fixtures/zipf-pressure-repeats.json");

    fn line(name: &str) -> Line {
        lines()
            .unwrap()
            .into_iter()
            .find(|l| l.name == name)
            .unwrap()
    }

    fn table_rows(line: &Line, repeats: &Value) -> String {
        super::super::rows(line, Some(repeats), &Repeats, 7).unwrap()
    }

    fn rel(op: Op, times: f64, of: &str) -> Target {
        let of = of.to_string();
        Target::Relative { op, times, of }
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
        let at_least = rel(Op::AtLeast, 0.98, "kvroute-precise");
        assert_eq!(judge(&at_least, Some(0.784), Some(0.8)), Outcome::Met);
        assert_eq!(judge(&at_least, Some(0.7839), Some(0.8)), Outcome::Missed);
        let at_most = rel(Op::AtMost, 1.1, "kvroute-precise");
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
        let context = Target::Context {
            of: "oracle".into(),
        };
        assert_eq!(judge(&context, Some(0.1), Some(0.9)), Outcome::Context);
    }

    #[test]
    fn a_real_repeats_file_gives_the_zipf_line() {
        let r: Value = serde_json::from_str(ZIPF).unwrap();
        let zipf = line("zipf-pressure");
        Repeats.check_file(&zipf, &r).unwrap();
        let rows = table_rows(&zipf, &r);
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
        let grouped = line("grouped-pressure");
        Repeats.check_file(&grouped, &r).unwrap();
        let rows = table_rows(&grouped, &r);
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
        let rows = table_rows(&grouped, &slower);
        assert!(
            rows.contains("(1.103×) | ≤ 1.1× kvroute-precise's | missed |"),
            "{rows}"
        );
    }

    #[test]
    fn a_file_of_another_workload_fleet_or_routers_is_refused() {
        let mut r: Value = serde_json::from_str(ZIPF).unwrap();
        r["fleet"] = json!("default");
        let e = Repeats.check_file(&line("zipf-pressure"), &r).unwrap_err();
        assert!(e.contains("fleet is \"default\""), "{e}");
        let r: Value = serde_json::from_str(ZIPF).unwrap();
        let e = Repeats.check_file(&line("llm-d"), &r).unwrap_err();
        assert!(e.contains("no router kvroute,"), "{e}");
        let mut r: Value = serde_json::from_str(ZIPF).unwrap();
        r["workload"] = json!("agentic");
        assert!(Repeats.check_file(&line("zipf-pressure"), &r).is_err());
    }

    #[test]
    fn lines_without_a_file_show_their_targets_as_not_measured() {
        let dir = std::env::temp_dir().join(format!("kvroute-precise-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("zipf-pressure")).unwrap();
        std::fs::write(dir.join("zipf-pressure/repeats.json"), ZIPF).unwrap();
        let table = summary(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        let table = table.unwrap();
        let rows: Vec<&str> = table.lines().collect();
        assert_eq!(rows[0], Repeats::HEADER.lines().next().unwrap());
        let checks: usize = lines().unwrap().iter().map(|l| l.checks.len()).sum();
        assert_eq!(rows.len(), 2 + checks);
        assert!(rows[2].starts_with("| zipf-pressure | kvroute-precise hit rate | 67.7% |"));
        assert_eq!(
            rows[6],
            "| grouped-pressure | kvroute-precise@3 hit rate | not measured | | ≥ 0.98× kvroute-precise's | | |"
        );
        assert_eq!(
            rows.last().unwrap(),
            &"| | smg hit rate | not measured | | for context | | |"
        );
    }
}
