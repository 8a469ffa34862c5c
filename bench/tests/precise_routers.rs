//! The precise routers through `kvroute-bench compare`: their names parse (and bad ones are
//! refused before anything starts), and a tiny run of `kvroute-precise` and
//! `kvroute-precise@2` on the real sim, kvroute-indexer, Envoy and kvroute.wasm routes by what
//! the engines hold and reports how fresh the index was. Needs `make build`.

use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `$VAR` if set, else `default` under the workspace root.
fn artifact(var: &str, default: &str) -> PathBuf {
    std::env::var_os(var)
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join(default))
}

/// A fresh directory for one test's files.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvroute-bench-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `kvroute-bench compare` on `fleet` and `workload` with `routers`, writing into `dir/out`.
fn compare(dir: &Path, fleet: &Value, workload: &Value, routers: &str) -> Output {
    let (fleet_path, workload_path) = (dir.join("fleet.json"), dir.join("workload.json"));
    std::fs::write(&fleet_path, fleet.to_string()).unwrap();
    std::fs::write(&workload_path, workload.to_string()).unwrap();
    Command::new(env!("CARGO_BIN_EXE_kvroute-bench"))
        .arg("compare")
        .arg("--fleet")
        .arg(&fleet_path)
        .arg("--workload")
        .arg(&workload_path)
        .args(["--routers", routers, "--out"])
        .arg(dir.join("out"))
        .env(
            "KVROUTE_SIM",
            artifact("KVROUTE_SIM", "target/release/kvroute-sim"),
        )
        .env(
            "KVROUTE_INDEXER",
            artifact("KVROUTE_INDEXER", "target/release/kvroute-indexer"),
        )
        .output()
        .expect("run kvroute-bench")
}

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
    for (var, default) in [
        ("KVROUTE_SIM", "target/release/kvroute-sim"),
        ("KVROUTE_INDEXER", "target/release/kvroute-indexer"),
        ("KVROUTE_WASM", "target/wasm32-wasip1/release/kvroute.wasm"),
        ("ENVOY_BIN", ".venv/bin/envoy"),
    ] {
        let p = artifact(var, default);
        assert!(
            p.is_file(),
            "{} not found ({var}); run make build",
            p.display()
        );
    }
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
    let text = std::fs::read_to_string(dir.join("out/results.json")).unwrap();
    let results: Value = serde_json::from_str(&text).unwrap();
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
