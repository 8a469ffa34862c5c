//! The Istio manifests as a user applies them: rendered by kubectl's kustomize from `istio/`, then
//! looked up by kind, name and patch.

use serde::Deserialize;
use serde_yaml::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `kubectl kustomize DIR`: the YAML a user would apply.
pub fn kustomize(dir: &Path) -> String {
    let out = Command::new("kubectl")
        .arg("kustomize")
        .arg(dir)
        .output()
        .unwrap_or_else(|e| panic!("kubectl (make istio-deps installs it): {e}"));
    assert!(
        out.status.success(),
        "kubectl kustomize {}: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("UTF-8 YAML")
}

pub fn documents(yaml: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(yaml)
        .map(|doc| Value::deserialize(doc).expect("rendered YAML parses"))
        .collect()
}

/// The shipped `istio/<variant>` (body-routing or header-routing), rendered.
pub fn rendered(variant: &str) -> Vec<Value> {
    documents(&kustomize(&repo().join("istio").join(variant)))
}

/// The object of `kind` named `name`.
pub fn object<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} in the rendered manifests"))
}

/// The one config patch of EnvoyFilter `filter` that applies to `apply_to` (and, for
/// HTTP_FILTER, whose value is named `filter_name`).
pub fn patch<'a>(docs: &'a [Value], filter: &str, apply_to: &str, filter_name: &str) -> &'a Value {
    let patches = object(docs, "EnvoyFilter", filter)["spec"]["configPatches"]
        .as_sequence()
        .expect("configPatches");
    let found: Vec<&Value> = patches
        .iter()
        .filter(|p| p["applyTo"] == apply_to)
        .filter(|p| filter_name.is_empty() || p["patch"]["value"]["name"] == filter_name)
        .collect();
    assert_eq!(found.len(), 1, "{filter}: {apply_to} {filter_name} patches");
    found[0]
}

/// The name of the vLLM Service's cluster, as the cluster patch matches it.
pub fn pool_cluster(docs: &[Value]) -> String {
    let p = patch(docs, "kvroute-cluster", "CLUSTER", "");
    p["match"]["cluster"]["name"]
        .as_str()
        .expect("the cluster patch matches a cluster name")
        .to_string()
}

/// Runs tools/istio-validate.py (in the venv `make istio-deps` builds) on `yaml`: success, output.
pub fn validate(yaml: &str) -> (bool, String) {
    use std::io::Write;
    let python = std::env::var("KVROUTE_ISTIO_PYTHON")
        .expect("KVROUTE_ISTIO_PYTHON (run through make, which installs the validator)");
    let mut child = Command::new(python)
        .arg(repo().join("tools/istio-validate.py"))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("the validator starts");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(yaml.as_bytes())
        .expect("YAML to the validator");
    let out = child.wait_with_output().expect("the validator ends");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// Runs the validator once over several YAML texts: for each, whether all its objects passed and
/// its lines of output.
pub fn validate_each(texts: &[String]) -> Vec<(bool, String)> {
    let dir = std::env::temp_dir().join(format!("kvroute-validate-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let paths: Vec<PathBuf> = texts
        .iter()
        .enumerate()
        .map(|(i, text)| {
            let path = dir.join(format!("{i}.yaml"));
            std::fs::write(&path, text).expect("write YAML");
            path
        })
        .collect();
    let python = std::env::var("KVROUTE_ISTIO_PYTHON")
        .expect("KVROUTE_ISTIO_PYTHON (run through make, which installs the validator)");
    let out = Command::new(python)
        .arg(repo().join("tools/istio-validate.py"))
        .args(&paths)
        .output()
        .expect("the validator runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let _ = std::fs::remove_dir_all(&dir);
    paths
        .iter()
        .map(|path| {
            let prefix = format!("{}: ", path.display());
            let lines: Vec<&str> = stdout
                .lines()
                .filter_map(|l| l.strip_prefix(&prefix))
                .collect();
            let ok = lines
                .last()
                .is_some_and(|l| l.ends_with(" valid, 0 invalid"))
                && !lines.last().is_some_and(|l| l.starts_with("0 valid"));
            (ok, lines.join("\n"))
        })
        .collect()
}

/// The container `name` of `list` (`containers`, `initContainers`) in the precise overlay's
/// gateway pod.
pub fn container<'a>(docs: &'a [Value], list: &str, name: &str) -> &'a Value {
    let pod = &object(docs, "Deployment", "istio-ingressgateway")["spec"]["template"];
    pod["spec"][list]
        .as_sequence()
        .and_then(|c| c.iter().find(|c| c["name"] == name))
        .unwrap_or_else(|| panic!("no {list} {name} in the gateway pod"))
}

/// The value of `container`'s env variable `name`.
pub fn env<'a>(container: &'a Value, name: &str) -> &'a str {
    container["env"]
        .as_sequence()
        .and_then(|e| e.iter().find(|e| e["name"] == name))
        .and_then(|e| e["value"].as_str())
        .unwrap_or_else(|| panic!("no env {name}"))
}

/// kvroute-indexer's arguments in the precise overlay's gateway pod, `$(VAR)` expanded from the
/// container's env as Kubernetes expands them.
pub fn indexer_args(docs: &[Value]) -> Vec<String> {
    let indexer = container(docs, "containers", "kvroute-indexer");
    let vars: Vec<&str> = indexer["env"]
        .as_sequence()
        .expect("env")
        .iter()
        .filter_map(|e| e["name"].as_str())
        .collect();
    indexer["args"]
        .as_sequence()
        .expect("args")
        .iter()
        .map(|a| {
            let mut a = a.as_str().expect("a string").to_string();
            for var in &vars {
                a = a.replace(&format!("$({var})"), env(indexer, var));
            }
            a
        })
        .collect()
}
