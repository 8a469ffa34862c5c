//! Every figure in the precise-mode table of README.md and bench/README.md comes from a
//! `repeats.json`: each mean, each figure it is held against and its ratio, each met or missed and
//! each build stamp is recomputed here from `bench/results/precise/<line>/repeats.json`, the files
//! `make bench-precise` writes; a line shown as not measured has no file.

use serde_json::Value;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

fn results_dir() -> PathBuf {
    Path::new(ROOT).join("bench/results/precise")
}

/// The text between the `<!-- precise` line and the `<!-- /precise -->` line of `file`.
fn block(file: &str) -> String {
    let text = std::fs::read_to_string(Path::new(ROOT).join(file)).expect(file);
    let open = text
        .find("<!-- precise")
        .unwrap_or_else(|| panic!("{file} has a precise block"));
    let body = open + text[open..].find('\n').expect("a line") + 1;
    let close = body
        + text[body..]
            .find("<!-- /precise -->")
            .unwrap_or_else(|| panic!("{file}'s precise block ends"));
    text[body..close].to_string()
}

/// The table's rows (header and separator aside), as cells.
fn rows(table: &str) -> Vec<Vec<String>> {
    table
        .lines()
        .filter(|l| l.starts_with('|') && !l.starts_with("|---"))
        .skip(1)
        .map(|l| {
            l.trim()
                .trim_matches('|')
                .split('|')
                .map(|c| c.trim().to_string())
                .collect()
        })
        .collect()
}

fn repeats(line: &str) -> Option<Value> {
    let path = results_dir().join(line).join("repeats.json");
    let text = std::fs::read_to_string(&path).ok()?;
    Some(serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
}

/// repeats.json's field of a figure named in the table.
fn key(metric: &str) -> &'static str {
    match metric {
        "hit rate" => "prefix_hit_rate",
        "TTFT p50" => "ttft_p50_ms",
        "TTFT p90" => "ttft_p90_ms",
        "busiest/idlest" => "busiest_over_idlest",
        other => panic!("a figure the table does not know: {other:?}"),
    }
}

fn show(metric: &str, v: f64) -> String {
    match metric {
        "hit rate" => format!("{:.1}%", v * 100.0),
        "busiest/idlest" => format!("{v:.2}"),
        _ => format!("{v:.1} ms"),
    }
}

/// The mean of `router`'s `metric` over the repeats that have one.
fn mean(file: &Value, router: &str, metric: &str) -> Option<f64> {
    let values = file["routers"][router][key(metric)]
        .as_array()
        .unwrap_or_else(|| panic!("repeats.json has {router}'s {metric}"));
    let xs: Vec<f64> = values.iter().filter_map(Value::as_f64).collect();
    (!xs.is_empty()).then(|| xs.iter().sum::<f64>() / xs.len() as f64)
}

/// A target cell: `≥ smg's`, `≤ 1.05× kvroute's`, `≤ 2.0` or `for context`, as
/// (at least?, factor, router held against); `None` for context.
fn target(cell: &str) -> Option<(bool, f64, Option<String>)> {
    if cell == "for context" {
        return None;
    }
    let (at_least, rest) = match (cell.strip_prefix("≥ "), cell.strip_prefix("≤ ")) {
        (Some(r), _) => (true, r),
        (_, Some(r)) => (false, r),
        _ => panic!("a target is ≥ or ≤: {cell:?}"),
    };
    if let Some(router) = rest.strip_suffix("'s") {
        return Some(match router.split_once("× ") {
            Some((times, of)) => (at_least, times.parse().expect(cell), Some(of.to_string())),
            None => (at_least, 1.0, Some(router.to_string())),
        });
    }
    Some((at_least, rest.parse().expect(cell), None))
}

#[test]
fn the_precise_table_is_the_same_in_both_readmes_and_summary_md() {
    let readme = block("README.md");
    assert_eq!(
        readme,
        block("bench/README.md"),
        "bench/README.md's precise block"
    );
    let summary = std::fs::read_to_string(results_dir().join("summary.md"))
        .expect("bench/results/precise/summary.md");
    assert_eq!(readme, summary, "README.md's precise block and summary.md");
}

#[test]
fn every_figure_in_the_precise_table_is_in_a_repeats_file() {
    let table = rows(&block("README.md"));
    assert!(table.len() >= 6, "a precise table with rows: {table:?}");
    let mut line = String::new();
    let mut lines = BTreeSet::new();
    let mut checked = 0;
    for row in &table {
        assert_eq!(row.len(), 7, "row {row:?}");
        if !row[0].is_empty() {
            line = row[0].clone();
            lines.insert(line.clone());
        }
        let file = repeats(&line);
        if row[2] == "not measured" {
            assert!(
                file.is_none(),
                "README shows {line} as not measured, but bench/results/precise/{line}/repeats.json \
                 exists: run `make bench-precise-summary`"
            );
            continue;
        }
        let file = file.unwrap_or_else(|| panic!("{line}: no repeats.json for {row:?}"));
        let at = |what: &str| format!("README's {what} of {line}'s {}", row[1]);
        if !row[0].is_empty() {
            let stamp = &file["stamp"];
            let commit = stamp["commit"].as_str().expect("a stamped repeats.json");
            let date = stamp["date"].as_str().expect("a stamped repeats.json");
            let n = file["repeats"].as_u64().expect("repeats");
            assert_eq!(
                row[6],
                format!("{commit}, {date}, {n} repeats"),
                "{}",
                at("build")
            );
            assert!(
                !commit.ends_with("+dirty"),
                "bench/results/precise/{line}: measured on a committed build, not {commit:?}"
            );
        } else {
            assert_eq!(row[6], "", "{}", at("build"));
        }
        let (router, metric) = row[1].split_once(' ').expect("a router and a figure");
        let value = mean(&file, router, metric);
        assert_eq!(
            row[2],
            value.map_or("-".into(), |v| show(metric, v)),
            "{}",
            at("mean")
        );
        let target = target(&row[4]);
        let of = match &target {
            None => Some(
                row[3]
                    .split_once(' ')
                    .expect("a router held against")
                    .0
                    .to_string(),
            ),
            Some((_, _, of)) => of.clone(),
        };
        let reference = of.as_deref().and_then(|of| mean(&file, of, metric));
        let against = match (&of, reference, value) {
            (None, _, _) => String::new(),
            (Some(of), None, _) => format!("{of} -"),
            (Some(of), Some(b), Some(v)) if b > 0.0 => {
                format!("{of} {} ({:.3}×)", show(metric, b), v / b)
            }
            (Some(of), Some(b), _) => format!("{of} {}", show(metric, b)),
        };
        assert_eq!(row[3], against, "{}", at("figure held against"));
        let result = match target {
            None => "",
            Some((at_least, times, of)) => {
                let bound = match of {
                    Some(_) => reference.map(|b| times * b),
                    None => Some(times),
                };
                match (value, bound) {
                    (Some(v), Some(b)) if (at_least && v >= b) || (!at_least && v <= b) => "met",
                    (Some(_), Some(_)) => "missed",
                    _ => "missed (no value)",
                }
            }
        };
        assert_eq!(row[5], result, "{}", at("result"));
        checked += 1;
    }
    // Every line run is in the table.
    if let Ok(dirs) = std::fs::read_dir(results_dir()) {
        for d in dirs.flatten() {
            let name = d.file_name().to_string_lossy().into_owned();
            if d.path().join("repeats.json").exists() {
                assert!(
                    lines.contains(&name),
                    "bench/results/precise/{name} is not in the table"
                );
            }
        }
    }
    eprintln!("{checked} measured figures checked");
}
