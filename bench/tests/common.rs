//! What the compare tests share: where the built binaries are (the Makefile's variables, else
//! their default paths), a scratch directory, and `kvroute-bench compare` run on a fleet and a
//! workload given as JSON.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The binaries and files the compare runs start, each as its variable and its default path
/// under the workspace root.
pub const SIM: (&str, &str) = ("KVROUTE_SIM", "target/release/kvroute-sim");
pub const INDEXER: (&str, &str) = ("KVROUTE_INDEXER", "target/release/kvroute-indexer");
pub const EPP: (&str, &str) = ("KVROUTE_EPP", "target/release/kvroute-epp");
pub const WASM: (&str, &str) = ("KVROUTE_WASM", "target/wasm32-wasip1/release/kvroute.wasm");
pub const ENVOY: (&str, &str) = ("ENVOY_BIN", ".venv/bin/envoy");

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `$VAR` if set, else `default` under the workspace root.
pub fn artifact((var, default): (&str, &str)) -> PathBuf {
    std::env::var_os(var)
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join(default))
}

/// Fails, saying how to build it, unless each of `needed` is there.
pub fn require_built(needed: &[(&str, &str)]) {
    for &(var, default) in needed {
        let p = artifact((var, default));
        assert!(
            p.is_file(),
            "{} not found ({var}); run make build (make deps for Envoy, make epp for kvroute-epp) first",
            p.display()
        );
    }
}

/// A fresh directory for one test's files.
pub fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvroute-bench-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `kvroute-bench compare` on `fleet` and `workload` with `routers`, writing into `dir/out`.
pub fn compare(dir: &Path, fleet: &Value, workload: &Value, routers: &str) -> Output {
    let (fleet_path, workload_path) = (dir.join("fleet.json"), dir.join("workload.json"));
    std::fs::write(&fleet_path, fleet.to_string()).unwrap();
    std::fs::write(&workload_path, workload.to_string()).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvroute-bench"));
    cmd.arg("compare")
        .arg("--fleet")
        .arg(&fleet_path)
        .arg("--workload")
        .arg(&workload_path)
        .args(["--routers", routers, "--out"])
        .arg(dir.join("out"));
    for binary in [SIM, INDEXER, EPP] {
        cmd.env(binary.0, artifact(binary));
    }
    cmd.output().expect("run kvroute-bench")
}

/// `dir/out/<file>`, read as JSON.
pub fn read_json(dir: &Path, file: &str) -> Value {
    let text = std::fs::read_to_string(dir.join("out").join(file)).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Every line of `dir/out/samples.jsonl`: one per request of every row.
pub fn samples(dir: &Path) -> Vec<Value> {
    std::fs::read_to_string(dir.join("out/samples.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}
