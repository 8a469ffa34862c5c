//! `kvroute-bench lab` end to end: same command same bytes, kvroute above round robin, bad names refused.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The tiny fleet and workload in fixtures/lab: three replicas that each hold about two of the
/// six 300-token system prompts, so round robin (which shows every replica every prompt) keeps
/// evicting while a cache-aware router does not.
fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/lab")
        .join(name)
}

/// A fresh directory for one test's outputs, removed when the test passes.
struct Scratch {
    dir: PathBuf,
}

impl Scratch {
    fn new(test: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("kvroute-lab-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch { dir }
    }

    /// `kvroute-bench lab` on the fixtures' fleet and workload with `args` after them, writing to
    /// the scratch directory's `out` (when given).
    fn lab(&self, args: &[&str], out: Option<&str>) -> Output {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvroute-bench"));
        cmd.arg("lab")
            .arg("--fleet")
            .arg(fixture("fleet.json"))
            .arg("--workload")
            .arg(fixture("workload.json"))
            .args(args);
        if let Some(out) = out {
            cmd.arg("--out").arg(self.dir.join(out));
        }
        cmd.output().expect("run kvroute-bench lab")
    }

    /// Runs the lab, which must succeed; its stdout and its results.json.
    fn lab_ok(&self, args: &[&str], out: &str) -> (String, Value) {
        let output = self.lab(args, Some(out));
        assert!(
            output.status.success(),
            "kvroute-bench lab {args:?} failed:\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
        let stdout = String::from_utf8(output.stdout).unwrap();
        (stdout, self.json(out))
    }

    fn json(&self, out: &str) -> Value {
        serde_json::from_str(&self.read(out, "results.json")).unwrap()
    }

    fn read(&self, out: &str, file: &str) -> String {
        std::fs::read_to_string(self.dir.join(out).join(file)).unwrap()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// The row of `router` in a results.json.
fn row<'a>(results: &'a Value, router: &str) -> &'a Value {
    results["results"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["router"] == router)
        .unwrap_or_else(|| panic!("no row for {router} in {results}"))
}

/// Every router was run on every seed, with requests and without errors.
fn assert_all_ran(results: &Value, routers: &str, seeds: usize) {
    for name in routers.split(',') {
        let r = row(results, name);
        assert!(r.get("skipped").is_none(), "{name} was skipped: {r}");
        let runs = r["runs"].as_array().unwrap();
        assert_eq!(runs.len(), seeds, "{name}: {r}");
        for run in runs {
            assert!(run["requests"].as_u64().unwrap() > 20, "{name}: {run}");
            assert_eq!(run["errors"], 0, "{name}: {run}");
        }
        assert_eq!(r["figures"]["errors"]["mean"], 0.0, "{name}: {r}");
    }
}

#[test]
fn the_same_lab_command_twice_gives_the_same_bytes() {
    let s = Scratch::new("twice");
    let routers = "round_robin,kvroute,kvroute@2,smg,oracle,kvroute-precise";
    let args = [
        "--routers",
        routers,
        "--seeds",
        "3",
        "--baseline",
        "round_robin",
        "--jobs",
        "2",
    ];
    let (stdout_a, json_a) = s.lab_ok(&args, "a");
    let (stdout_b, _) = s.lab_ok(&args, "b");
    assert_all_ran(&json_a, routers, 3);
    assert_eq!(stdout_a, stdout_b, "stdout differs between two runs");

    // Only the stamp (the build and the date) may differ; everything else must be the same bytes.
    let without_stamp = |out: &str| {
        let mut v: Value = serde_json::from_str(&s.read(out, "results.json")).unwrap();
        let stamp = v.as_object_mut().unwrap().remove("stamp");
        assert!(
            stamp.is_some_and(|st| st["commit"].is_string()),
            "no stamp in {out}"
        );
        serde_json::to_string_pretty(&v).unwrap()
    };
    assert_eq!(without_stamp("a"), without_stamp("b"));

    // results.md: the table as printed, then the build line.
    let (md_a, md_b) = (s.read("a", "results.md"), s.read("b", "results.md"));
    let body = |md: &str| {
        let (body, last) = md.trim_end().rsplit_once('\n').unwrap();
        assert!(
            last.starts_with("build "),
            "last line of results.md: {last}"
        );
        body.to_string()
    };
    assert_eq!(body(&md_a), body(&md_b));
    assert_eq!(body(&md_a).trim_end(), stdout_a.trim_end());
}

#[test]
fn kvroute_keeps_more_cached_than_round_robin_in_the_lab() {
    let s = Scratch::new("hits");
    let routers = "round_robin,kvroute,smg,oracle";
    let (_, results) = s.lab_ok(
        &[
            "--routers",
            routers,
            "--seeds",
            "5",
            "--baseline",
            "round_robin",
        ],
        "out",
    );
    assert_all_ran(&results, routers, 5);
    let (rr, kv) = (row(&results, "round_robin"), row(&results, "kvroute"));
    let paired = &kv["vs_baseline"]["prefix_hit_rate"];
    assert_eq!(
        paired["verdict"], "better",
        "kvroute vs round_robin: {paired}"
    );
    assert!(
        paired["difference"]["lo"].as_f64().unwrap() > 0.0,
        "{paired}"
    );
    let (kv_hit, rr_hit) = (
        &kv["figures"]["prefix_hit_rate"],
        &rr["figures"]["prefix_hit_rate"],
    );
    assert!(
        kv_hit["lo"].as_f64().unwrap() > rr_hit["hi"].as_f64().unwrap(),
        "kvroute's hit rate {kv_hit} should lie above round_robin's {rr_hit}"
    );
    // The baseline is not paired against itself.
    assert!(rr.get("vs_baseline").is_none(), "{rr}");
}

/// The lab refuses `args` before running anything: non-zero exit, a message naming `name`, and
/// no output directory.
fn assert_refused(s: &Scratch, args: &[&str], name: &str) {
    let output = s.lab(args, Some("out"));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{args:?} was accepted:\n{stderr}");
    assert!(
        stderr.contains(name),
        "{args:?}: the message does not name {name}:\n{stderr}"
    );
    assert!(!s.dir.join("out").exists(), "{args:?} wrote results");
}

#[test]
fn a_baseline_not_among_the_routers_is_refused() {
    let s = Scratch::new("baseline");
    assert_refused(
        &s,
        &["--routers", "round_robin,kvroute", "--baseline", "smg"],
        "--baseline smg",
    );
}

#[test]
fn an_unknown_router_is_refused() {
    let s = Scratch::new("unknown");
    assert_refused(&s, &["--routers", "round_robin,kvrout"], "\"kvrout\"");
}
