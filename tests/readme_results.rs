//! Every figure in README.md's results table comes from a results file: each cell (prefix hit
//! rate · TTFT p90), each ceiling and each build stamp is read back from
//! `bench/results/<workload>/results.json`, the files `make bench-results` writes.

use serde_json::Value;
use std::path::Path;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// The table between README's `<!-- results` and `<!-- /results -->` lines, as rows of cells.
fn readme_table() -> Vec<Vec<String>> {
    let readme = std::fs::read_to_string(Path::new(ROOT).join("README.md")).expect("README.md");
    let open = readme
        .find("<!-- results")
        .expect("README.md has a results block");
    let body = open + readme[open..].find('\n').expect("a line") + 1;
    let close = body
        + readme[body..]
            .find("<!-- /results -->")
            .expect("the block ends");
    readme[body..close]
        .lines()
        .filter(|l| l.starts_with('|') && !l.starts_with("|---"))
        .map(|l| {
            l.trim()
                .trim_matches('|')
                .split('|')
                .map(|c| c.trim().to_string())
                .collect()
        })
        .collect()
}

fn results(workload: &str) -> Value {
    let path = Path::new(ROOT)
        .join("bench/results")
        .join(workload)
        .join("results.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("README's column {workload}: {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// What a cell must say for `router` in `file`, as `kvroute-bench summary` writes it.
fn expected_cell(file: &Value, router: &str) -> String {
    let rows = file["results"].as_array().expect("results");
    let Some(m) = rows
        .iter()
        .find(|r| r["router"] == router && r.get("skipped").is_none())
    else {
        return String::new();
    };
    let hit = m["prefix_hit_rate"].as_f64().expect("prefix_hit_rate") * 100.0;
    let p90 = m["ttft_ms"]["p90"]
        .as_f64()
        .map_or("-".to_string(), |v| format!("{v:.0}"));
    format!("{hit:.1}% · {p90} ms")
}

#[test]
fn every_figure_in_the_readme_results_table_is_in_a_results_file() {
    let table = readme_table();
    assert!(table.len() >= 4, "a results table with rows: {table:?}");
    let header = &table[0];
    assert_eq!(header[0], "router");
    let workloads = &header[1..];
    assert!(!workloads.is_empty());
    let files: Vec<Value> = workloads.iter().map(|w| results(w)).collect();
    let mut checked = 0;
    for row in &table[1..] {
        assert_eq!(row.len(), header.len(), "row {row:?}");
        for ((cell, file), workload) in row[1..].iter().zip(&files).zip(workloads) {
            let want = match row[0].as_str() {
                "ceiling" => file["ceiling_hit_rate"]
                    .as_f64()
                    .map_or(String::new(), |c| format!("{:.1}%", c * 100.0)),
                "build, date" => {
                    let stamp = &file["stamp"];
                    format!(
                        "{}, {}",
                        stamp["commit"].as_str().expect("a stamped file"),
                        stamp["date"].as_str().expect("a stamped file")
                    )
                }
                router => expected_cell(file, router),
            };
            assert_eq!(
                cell, &want,
                "README's {} on {workload} differs from bench/results/{workload}/results.json",
                row[0]
            );
            checked += 1;
        }
    }
    assert!(checked >= workloads.len() * 3, "{checked} cells checked");
}

#[test]
fn every_results_file_is_stamped_and_builds_are_not_dirty() {
    let table = readme_table();
    for w in &table[0][1..] {
        let stamp = &results(w)["stamp"];
        let commit = stamp["commit"].as_str().unwrap_or_default();
        assert!(
            !commit.is_empty() && !commit.ends_with("+dirty"),
            "bench/results/{w}: measured on a committed build, not {commit:?}"
        );
    }
}
