//! `lab-diff`: two lab results of the same workload, fleet and seeds (two builds, or a config
//! change), each router's figures paired seed by seed: after − before, its 95% interval and the
//! verdict. How a change to kvroute is judged against the build before it.

use super::report;
use super::stats::{self, Verdict};
use crate::report::Measured;
use serde::Deserialize;
use std::fmt::Write as _;
use std::path::Path;

/// The part of a lab results.json the comparison reads.
#[derive(Deserialize)]
struct Document {
    seeds: Vec<u64>,
    workload: serde_json::Value,
    fleet: serde_json::Value,
    results: Vec<Row>,
}

#[derive(Deserialize)]
struct Row {
    router: String,
    runs: Vec<Measured>,
}

fn load(path: &Path) -> Result<Document, String> {
    let file = if path.is_dir() {
        path.join("results.json")
    } else {
        path.to_path_buf()
    };
    let text = std::fs::read_to_string(&file).map_err(|e| format!("{}: {e}", file.display()))?;
    serde_json::from_str(&text).map_err(|e| format!("{}: {e}", file.display()))
}

/// The table of `after` against `before` (results.json files or the directories holding them),
/// for every router both ran; an error when they were not run on the same workload, fleet and
/// seeds, since then the pairs mean nothing.
pub fn diff(before: &Path, after: &Path) -> Result<String, String> {
    let (b, a) = (load(before)?, load(after)?);
    if a.seeds != b.seeds || a.workload != b.workload || a.fleet != b.fleet {
        return Err("the two results differ in seeds, workload or fleet: nothing to pair".into());
    }
    let mut out = format!(
        "after − before over {} paired seeds (95% interval; tie: the interval touches 0)\n\n",
        a.seeds.len()
    );
    out.push_str("| router | figure | before | after | after − before | verdict |\n");
    out.push_str("|---|---|---:|---:|---:|---|\n");
    let mut any = false;
    for row in &a.results {
        let Some(old) = b.results.iter().find(|r| r.router == row.router) else {
            continue;
        };
        for (name, higher_is_better) in report::figure_names() {
            let (Some(x), Some(y)) = (
                report::per_seed(&row.runs, name),
                report::per_seed(&old.runs, name),
            ) else {
                continue;
            };
            let (Some(d), Some(ma), Some(mb)) = (
                stats::paired(&x, &y),
                stats::interval(&x),
                stats::interval(&y),
            ) else {
                continue;
            };
            let verdict: Verdict = stats::verdict(&d, higher_is_better);
            any = true;
            let _ = writeln!(
                out,
                "| {} | {name} | {} | {} | {} [{}, {}] | {} |",
                row.router,
                report::shown(name, mb.mean),
                report::shown(name, ma.mean),
                report::delta(name, d.mean),
                report::delta(name, d.lo),
                report::delta(name, d.hi),
                verdict.name()
            );
        }
    }
    if !any {
        return Err("no router ran in both results".into());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn line(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("results/lab/precise/{name}"))
    }

    #[test]
    fn a_result_against_itself_ties_on_every_figure_of_every_router() {
        let table = diff(&line("zipf-pressure"), &line("zipf-pressure")).unwrap();
        let rows: Vec<&str> = table
            .lines()
            .filter(|l| l.starts_with("| kvroute"))
            .collect();
        assert_eq!(rows.len(), 6, "{table}");
        assert!(rows.iter().all(|r| r.ends_with("| tie |")), "{table}");
        assert!(table.contains("| smg | prefix_hit_rate |"), "{table}");
    }

    #[test]
    fn results_of_another_workload_are_not_paired() {
        let e = diff(&line("zipf-pressure"), &line("llm-d")).unwrap_err();
        assert!(e.contains("nothing to pair"), "{e}");
        assert!(diff(&line("zipf-pressure"), &line("none")).is_err());
    }
}
