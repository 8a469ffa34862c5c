//! The precise routers through `kvroute-bench compare`: their names parse (and bad ones are
//! refused before anything starts), and a tiny run of `kvroute-precise` and
//! `kvroute-precise@2` on the real sim, kvroute-indexer, Envoy and kvroute.wasm routes by what
//! the engines hold and reports how fresh the index was. Needs `make build`.

use crate::common::{self, compare, read_json, require_built, scratch};
use serde_json::{json, Value};

fn tiny_workload(seconds: f64) -> Value {
    json!({
        "name": "precise-tiny", "seed": 5, "groups": 6, "users_per_group": 2,
        "system_prompt_tokens": 300, "question_tokens": 20, "output_tokens": 4,
        "arrival": {"kind": "poisson", "qps": [12]}, "stage_duration_s": seconds
    })
}

#[test]
fn bad_precise_router_names_are_refused_before_anything_starts() {
    let dir = scratch("precise-names");
    let fleet = json!({"replicas": 2});
    for (bad, says) in [
        ("kvroute-precise@9", "1 to 8"),
        ("kvroute-precise@2@2", "one @N"),
        ("kvroute-precise:cache_aware", "unknown router"),
        ("kvroute-precis", "unknown router"),
    ] {
        let out = compare(&dir, &fleet, &tiny_workload(1.0), bad);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{bad} was accepted");
        assert!(stderr.contains(says), "{bad}: {stderr}");
        assert!(!stderr.contains("== [1/"), "{bad} started a run: {stderr}");
    }
}

#[test]
fn precise_routers_route_by_the_engines_and_report_the_index_freshness() {
    require_built(&[common::SIM, common::INDEXER, common::WASM, common::ENVOY]);
    let dir = scratch("precise-e2e");
    let fleet = json!({"replicas": 3, "kv_capacity_tokens": 1024, "time_scale": 0.02});
    let out = compare(
        &dir,
        &fleet,
        &tiny_workload(4.0),
        "kvroute-precise,kvroute-precise@2",
    );
    let progress = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "compare failed:\n{progress}");
    let results = read_json(&dir, "results.json");
    // The fleet tokenized with the sim's BPE, said without this machine's path.
    let tokenizer = results["fleet"]["tokenizer"].as_str().unwrap_or_default();
    assert!(tokenizer.contains("BPE"), "{}", results["fleet"]);
    for row in results["results"].as_array().unwrap() {
        assert!(row.get("skipped").is_none(), "skipped: {row}");
        assert_eq!(row["errors"], 0, "{row}");
        let index = &row["index"];
        assert!(index["samples"].as_u64().unwrap() > 0, "{row}");
        assert!(index["polls_answered"].as_f64().unwrap() > 0.5, "{row}");
    }
    // kvroute sent requests where the engines said their prefix was (decision `engine`).
    let engine_decisions = progress
        .lines()
        .filter(|l| l.contains("kvroute decisions:"))
        .filter(|l| l.split_whitespace().any(|w| w.starts_with("engine=")))
        .count();
    assert_eq!(engine_decisions, 2, "{progress}");
    let md = std::fs::read_to_string(dir.join("out/results.md")).unwrap();
    assert!(md.contains("| kvroute-precise@2 | "), "{md}");
    assert!(md.contains("How fresh precise mode's index was"), "{md}");
    let _ = std::fs::remove_dir_all(&dir);
}
