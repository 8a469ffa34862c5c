//! End to end: `kvroute-bench compare` with the real sim, real Envoy and the real kvroute.wasm,
//! on a tiny shared-prefix workload. Needs `make build` (the Makefile's `test` target does it).

use crate::common::{self, compare, read_json, require_built, scratch};
use serde_json::{json, Value};

#[test]
fn kvroute_beats_round_robin_hit_rate_and_results_file_is_complete() {
    require_built(&[common::SIM, common::WASM, common::ENVOY]);
    let dir = scratch("e2e");
    // Each replica holds two of the six system prompts, so round robin (which shows every
    // replica every prompt) keeps evicting while a cache-aware router does not.
    let fleet = tiny_fleet();
    let output = compare(
        &dir,
        &fleet,
        &tiny_workload(),
        "round_robin,kvroute,kvroute@2,oracle",
    );
    let progress = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "kvroute-bench compare failed:\n{progress}"
    );

    let results = read_json(&dir, "results.json");
    assert_eq!(results["fleet"], fleet);
    assert_eq!(results["workload"]["name"], "e2e-tiny");
    let rows = results["results"].as_array().unwrap();
    let names: Vec<&str> = rows.iter().map(|r| r["router"].as_str().unwrap()).collect();
    assert_eq!(names, ["round_robin", "kvroute", "kvroute@2", "oracle"]);
    for r in rows {
        assert!(
            r.get("skipped").is_none(),
            "{} was skipped: {}",
            r["router"],
            r["skipped"]
        );
        assert!(r["requests"].as_u64().unwrap() >= 30, "{r}");
        assert_eq!(r["errors"], 0, "{r}");
        assert!(r["ttft_ms"]["p90"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["output_tok_s"].as_f64().unwrap() > 0.0, "{r}");
    }
    let hit = |i: usize| rows[i]["prefix_hit_rate"].as_f64().unwrap();
    assert!(
        hit(1) > hit(0),
        "kvroute hit rate {} should beat round_robin's {}",
        hit(1),
        hit(0)
    );
    // kvroute@2's decisions are summed over both of its Envoys: together they decided every
    // measured request (one alone would have seen about half of them).
    let decided: u64 = decisions_of("kvroute@2", &progress)
        .iter()
        .map(|(_, n)| n)
        .sum();
    let requests = rows[2]["requests"].as_u64().unwrap();
    assert!(
        decided >= requests,
        "kvroute@2 decided {decided} of {requests} requests:\n{progress}"
    );
    let out = dir.join("out");
    let md = std::fs::read_to_string(out.join("results.md")).unwrap();
    assert!(md.contains("| kvroute |") && md.contains("| kvroute@2 |"));
    assert!(std::fs::read_to_string(out.join("ttft.svg"))
        .unwrap()
        .starts_with("<svg"));
    // samples.jsonl: every request of every row, with who sent it, where it went and what the
    // replica had cached for it (the sim always reports usage).
    let samples = common::samples(&dir);
    for (i, name) in names.iter().enumerate() {
        let mine: Vec<&Value> = samples.iter().filter(|s| s["router"] == *name).collect();
        assert_eq!(
            mine.len() as u64,
            rows[i]["requests"].as_u64().unwrap(),
            "{name}"
        );
        for s in mine {
            assert!(
                s["user"].as_str().is_some_and(|u| u.starts_with('u')),
                "{s}"
            );
            assert!(s["replica"].as_u64().is_some(), "{s}");
            let (prompt, cached) = (s["prompt_tokens"].as_u64(), s["cached_tokens"].as_u64());
            assert!(
                prompt.zip(cached).is_some_and(|(p, c)| p > 0 && c <= p),
                "{s}"
            );
        }
    }
    // `analyze` reads the run again: its tables are results.md's, and its requests replay.
    let misses = analyze(&["misses"], &out);
    assert!(
        misses.starts_with("Where the uncached prompt tokens were"),
        "{misses}"
    );
    assert!(
        md.contains(&misses),
        "results.md:\n{md}\nanalyze misses:\n{misses}"
    );
    let ceiling = analyze(&["ceiling"], &out);
    assert!(
        md.contains(ceiling.trim_end()),
        "results.md:\n{md}\nanalyze ceiling:\n{ceiling}"
    );
    let crowding = analyze(&["crowding"], &out.join("samples.jsonl"));
    assert!(
        crowding.contains(&format!("| oracle | {} |", rows[3]["requests"])),
        "{crowding}"
    );
    let placement = analyze(&["placement", "--gateways", "2", "--workers", "2"], &out);
    let first = format!("{} requests, ", rows[0]["requests"]);
    assert!(placement.starts_with(&first), "{placement}");
    assert!(
        placement.contains("would send to different replicas"),
        "{placement}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `kvroute-bench analyze ARGS RUN`'s output; fails the test if it fails.
fn analyze(args: &[&str], run: &std::path::Path) -> String {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute-bench"))
        .arg("analyze")
        .args(args)
        .arg(run)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    let err = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "analyze {args:?} failed:\n{err}");
    text
}

/// Three replicas whose caches each hold about two of [`tiny_workload`]'s six system prompts.
fn tiny_fleet() -> Value {
    json!({"replicas": 3, "kv_capacity_tokens": 1024, "time_scale": 0.02})
}

/// Six groups of two users sharing a 300-token system prompt, 15 requests a second for 4 s.
fn tiny_workload() -> Value {
    json!({
        "name": "e2e-tiny", "seed": 7, "groups": 6, "users_per_group": 2,
        "system_prompt_tokens": 300, "question_tokens": 20, "output_tokens": 4,
        "arrival": {"kind": "poisson", "qps": [15]}, "stage_duration_s": 4
    })
}

#[test]
fn kvroute_epp_and_three_of_it_route_every_request_through_their_envoys() {
    require_built(&[common::SIM, common::EPP, common::ENVOY]);
    let dir = scratch("epp-e2e");
    let output = compare(
        &dir,
        &tiny_fleet(),
        &tiny_workload(),
        "kvroute-epp,kvroute-epp@3",
    );
    let progress = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "compare failed:\n{progress}");
    let results = read_json(&dir, "results.json");
    let rows = results["results"].as_array().unwrap();
    let names: Vec<&str> = rows.iter().map(|r| r["router"].as_str().unwrap()).collect();
    assert_eq!(names, ["kvroute-epp", "kvroute-epp@3"]);
    let samples = common::samples(&dir);
    for row in rows {
        let name = row["router"].as_str().unwrap();
        assert!(row.get("skipped").is_none(), "{name} skipped: {row}");
        assert_eq!(row["errors"], 0, "{row}");
        let requests = row["requests"].as_u64().unwrap();
        assert!(requests >= 30, "{row}");
        // Every answer carries the decision the picker made for it (its debug header), and
        // none is a fallback to Envoy's own balancer.
        let mine: Vec<&Value> = samples.iter().filter(|s| s["router"] == name).collect();
        assert_eq!(mine.len() as u64, requests, "{name}");
        for s in &mine {
            let decision = s["decision"].as_str().unwrap_or("none");
            assert!(
                !decision.starts_with("fallback:") && decision != "none",
                "{name}: {s}"
            );
        }
        // The pickers' own counts say the same: summed over them, they routed every request.
        let decisions = decisions_of(name, &progress);
        let fallbacks: Vec<_> = decisions
            .iter()
            .filter(|(d, _)| d.starts_with("fallback:"))
            .collect();
        assert!(fallbacks.is_empty(), "{name}: {fallbacks:?}");
        let routed: u64 = decisions.iter().map(|(_, n)| n).sum();
        assert!(
            routed >= requests,
            "{name} routed {routed} of {requests}:\n{progress}"
        );
    }
    // Three gateway and picker pairs behind the front, each serving its share.
    let gateways: std::collections::BTreeSet<&str> = samples
        .iter()
        .filter(|s| s["router"] == "kvroute-epp@3")
        .filter_map(|s| s["gateway"].as_str())
        .collect();
    assert_eq!(gateways.len(), 3, "{gateways:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The `kvroute decisions:` counters printed for `router` (`== [i/n] router` header), routed
/// ones by decision and fallbacks as `fallback:<reason>`.
fn decisions_of(router: &str, progress: &str) -> Vec<(String, u64)> {
    let header = format!("] {router}");
    let mut section = progress
        .lines()
        .skip_while(|l| !(l.starts_with("== [") && l.ends_with(&header)))
        .skip(1)
        .take_while(|l| !l.starts_with("== ["));
    let line = section
        .find_map(|l| {
            l.trim()
                .strip_prefix("kvroute decisions:")
                .map(str::to_string)
        })
        .unwrap_or_else(|| panic!("no kvroute decisions for {router}:\n{progress}"));
    line.split_whitespace()
        .filter_map(|kv| {
            let (k, n) = kv.rsplit_once('=')?;
            Some((k.to_string(), n.parse::<u64>().ok()?))
        })
        .collect()
}
