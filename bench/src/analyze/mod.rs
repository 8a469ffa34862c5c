//! `kvroute-bench analyze`: what a `compare` run's requests say beyond its table, read from the
//! run's `samples.jsonl` (and its `results.json` for the fleet and workload): what the workload
//! allows ([`ceiling`]), where the uncached tokens were ([`misses`]), where the cold prefills
//! came from ([`crowding`]), and the run's requests replayed through kvroute's own placement
//! ([`placement`]).

pub mod ceiling;
pub mod crowding;
pub mod misses;
pub mod placement;

use crate::driver::Sample;
use crate::report::{Results, RouterResult};
use crate::workload::Workload;
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// The group of a workload user tag (`u<group>-<member>-<episode>`, `u<group>-t<tenant>-...`,
/// `a<app>-<slot>-<episode>`): the tag without its member and episode. A unique prompt
/// (`u-unique-<n>`) is a group of its own.
pub fn group_of(tag: &str) -> &str {
    if tag.starts_with("u-unique-") {
        return tag;
    }
    tag.rsplitn(3, '-').nth(2).unwrap_or(tag)
}

/// `samples`' successful requests in the order they were sent.
pub fn in_send_order(samples: &[Sample]) -> Vec<&Sample> {
    let mut sorted: Vec<&Sample> = samples.iter().filter(|s| s.error.is_none()).collect();
    sorted.sort_by(|a, b| a.sent_ms.total_cmp(&b.sent_ms));
    sorted
}

/// A run's `samples.jsonl`: `run` itself, or the file in the directory `run`.
fn samples_file(run: &Path) -> PathBuf {
    match run.is_dir() {
        true => run.join("samples.jsonl"),
        false => run.to_path_buf(),
    }
}

/// Every request of the run `run` (its directory or its `samples.jsonl`), by router in the
/// order the run had them.
pub fn samples(run: &Path) -> Result<Vec<(String, Vec<Sample>)>, String> {
    #[derive(Deserialize)]
    struct Line {
        router: String,
        #[serde(flatten)]
        sample: Sample,
    }
    let path = samples_file(run);
    let at = |e: String| format!("{}: {e}", path.display());
    let text = std::fs::read_to_string(&path).map_err(|e| at(e.to_string()))?;
    let mut runs: Vec<(String, Vec<Sample>)> = Vec::new();
    for (i, text) in text.lines().enumerate() {
        let line: Line =
            serde_json::from_str(text).map_err(|e| at(format!("line {}: {e}", i + 1)))?;
        match runs.iter_mut().find(|(r, _)| *r == line.router) {
            Some((_, samples)) => samples.push(line.sample),
            None => runs.push((line.router, vec![line.sample])),
        }
    }
    Ok(runs)
}

/// The run's `results.json`, beside its `samples.jsonl`.
fn results(run: &Path) -> Result<Results, String> {
    let samples = samples_file(run);
    let path = samples.with_file_name("results.json");
    let at = |e: String| format!("{}: {e}", path.display());
    let text = std::fs::read_to_string(&path).map_err(|e| at(e.to_string()))?;
    serde_json::from_str(&text).map_err(|e| at(e.to_string()))
}

/// What the workload of the run `run` allows on its fleet ([`ceiling::bounds`]), over as many
/// requests as its routers were sent, as `compare` computes it.
pub fn ceiling(run: &Path) -> Result<String, String> {
    let results = results(run)?;
    let workload: Workload =
        serde_json::from_value(results.workload.clone()).map_err(|e| format!("workload: {e}"))?;
    workload.validate()?;
    let sent = results
        .results
        .iter()
        .filter_map(|r| match r {
            RouterResult::Measured(m) => Some(m.requests as usize),
            RouterResult::Skipped { .. } => None,
        })
        .max()
        .unwrap_or(0);
    // A run with a precise router reports the simulator's BPE by name: write it out again.
    let (fleet, _, _tokenizer) = match crate::precise::is_sim_tokenizer(&results.fleet) {
        true => {
            let mut spec = results.fleet.clone();
            spec["tokenizer"] = serde_json::Value::Null;
            crate::precise::with_tokenizer(&spec)?
        }
        false => (results.fleet.clone(), results.fleet.clone(), None),
    };
    let b = ceiling::bounds(&workload, &fleet, sent)?.rounded();
    Ok(ceiling::describe(b.ceiling, b.capacity, b.fleet_lru))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_samples_file_reads_back_by_router_in_its_order() {
        let dir = std::env::temp_dir().join(format!("kvroute-analyze-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let line = |router: &str, user: &str| {
            serde_json::json!({"router": router, "user": user, "sent_ms": 1.5, "error": null,
                "ttft_ms": 2.0, "e2e_ms": 3.0, "output_tokens": 4, "replica": 1,
                "decision": "home", "gateway": null, "prompt_tokens": 10, "cached_tokens": 5})
            .to_string()
        };
        let text = [
            line("b", "u1-0-0"),
            line("a", "u2-0-0"),
            line("b", "u3-0-0"),
        ]
        .join("\n");
        std::fs::write(dir.join("samples.jsonl"), text + "\n").unwrap();
        let runs = samples(&dir);
        let file = samples(&dir.join("samples.jsonl"));
        std::fs::write(dir.join("samples.jsonl"), "{\"router\": 3}\n").unwrap();
        let bad = samples(&dir).unwrap_err();
        let _ = std::fs::remove_dir_all(&dir);
        let runs = runs.unwrap();
        let names: Vec<&str> = runs.iter().map(|(r, _)| r.as_str()).collect();
        assert_eq!(names, ["b", "a"]);
        let users: Vec<&str> = runs[0].1.iter().map(|s| s.user.as_str()).collect();
        assert_eq!(users, ["u1-0-0", "u3-0-0"]);
        assert_eq!(runs[1].1[0].cached_tokens, Some(5));
        assert_eq!(file.unwrap().len(), 2);
        assert!(bad.contains("line 1"), "{bad}");
    }

    #[test]
    fn groups_come_from_user_tags() {
        assert_eq!(group_of("u10-3-0"), "u10");
        assert_eq!(group_of("u1-t2-3-0"), "u1-t2");
        assert_eq!(group_of("a4-1-7"), "a4");
        assert_eq!(group_of("u-unique-9"), "u-unique-9");
    }
}
