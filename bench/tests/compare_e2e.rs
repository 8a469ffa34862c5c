//! End to end: `kvroute-bench compare` with the real sim, real Envoy and the real kvroute.wasm,
//! on a tiny shared-prefix workload. Needs `make build` (the Makefile's `test` target does it).

use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::Command;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `$VAR` if set, else `default` under the workspace root.
fn artifact(var: &str, default: &str) -> PathBuf {
    std::env::var_os(var)
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join(default))
}

fn require_built() {
    let needed = [
        ("KVROUTE_SIM", "target/release/kvroute-sim"),
        ("KVROUTE_WASM", "target/wasm32-wasip1/release/kvroute.wasm"),
        ("ENVOY_BIN", ".venv/bin/envoy"),
    ];
    for (var, default) in needed {
        let p = artifact(var, default);
        assert!(
            p.is_file(),
            "{} not found ({var}); run make build (make deps for Envoy) first",
            p.display()
        );
    }
}

#[test]
fn kvroute_beats_round_robin_hit_rate_and_results_file_is_complete() {
    require_built();
    let dir = std::env::temp_dir().join(format!("kvroute-bench-e2e-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // Each replica holds two of the six system prompts, so round robin (which shows every
    // replica every prompt) keeps evicting while a cache-aware router does not.
    let fleet = json!({"replicas": 3, "kv_capacity_tokens": 1024, "time_scale": 0.02});
    let workload = json!({
        "name": "e2e-tiny", "seed": 7, "groups": 6, "users_per_group": 2,
        "system_prompt_tokens": 300, "question_tokens": 20, "output_tokens": 4,
        "arrival": {"kind": "poisson", "qps": [15]}, "stage_duration_s": 4
    });
    let (fleet_path, workload_path, out) = (
        dir.join("fleet.json"),
        dir.join("workload.json"),
        dir.join("out"),
    );
    std::fs::write(&fleet_path, fleet.to_string()).unwrap();
    std::fs::write(&workload_path, workload.to_string()).unwrap();

    let output = Command::new(env!("CARGO_BIN_EXE_kvroute-bench"))
        .arg("compare")
        .arg("--fleet")
        .arg(&fleet_path)
        .arg("--workload")
        .arg(&workload_path)
        .args(["--routers", "round_robin,kvroute,kvroute@2,oracle", "--out"])
        .arg(&out)
        .env(
            "KVROUTE_SIM",
            artifact("KVROUTE_SIM", "target/release/kvroute-sim"),
        )
        .output()
        .expect("run kvroute-bench");
    let progress = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "kvroute-bench compare failed:\n{progress}"
    );

    let results: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("results.json")).unwrap()).unwrap();
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
    let decided = decisions_of("kvroute@2", &progress);
    let requests = rows[2]["requests"].as_u64().unwrap();
    assert!(
        decided >= requests,
        "kvroute@2 decided {decided} of {requests} requests:\n{progress}"
    );
    let md = std::fs::read_to_string(out.join("results.md")).unwrap();
    assert!(md.contains("| kvroute |") && md.contains("| kvroute@2 |"));
    assert!(std::fs::read_to_string(out.join("ttft.svg"))
        .unwrap()
        .starts_with("<svg"));
    // samples.jsonl: every request of every row, with who sent it, where it went and what the
    // replica had cached for it (the sim always reports usage).
    let samples: Vec<Value> = std::fs::read_to_string(out.join("samples.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
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
    let _ = std::fs::remove_dir_all(&dir);
}

/// The sum of the `kvroute decisions:` counters printed for `router` (`== [i/n] router` header).
fn decisions_of(router: &str, progress: &str) -> u64 {
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
        .filter_map(|kv| kv.rsplit_once('=')?.1.parse::<u64>().ok())
        .sum()
}
