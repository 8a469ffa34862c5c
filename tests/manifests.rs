#![cfg(not(target_arch = "wasm32"))]
//! The shipped Envoy and Istio configurations carry a kvroute config the filter accepts, and the
//! Envoy settings kvroute depends on (header stop-iteration, override_host on the same header,
//! an admin cluster under the configured name).

use kvroute::config::Config;
use serde::Deserialize;
use serde_yaml::Value;

fn root() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn documents(path: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(root().join(path)).expect(path);
    serde_yaml::Deserializer::from_str(&text)
        .map(|doc| Value::deserialize(doc).expect(path))
        .collect()
}

/// Every mapping in the tree, depth first.
fn walk<'a>(v: &'a Value, out: &mut Vec<&'a serde_yaml::Mapping>) {
    match v {
        Value::Mapping(m) => {
            out.push(m);
            m.values().for_each(|child| walk(child, out));
        }
        Value::Sequence(s) => s.iter().for_each(|child| walk(child, out)),
        _ => {}
    }
}

fn mappings(docs: &[Value]) -> Vec<&serde_yaml::Mapping> {
    let mut out = Vec::new();
    docs.iter().for_each(|d| walk(d, &mut out));
    out
}

fn get<'a>(m: &'a serde_yaml::Mapping, key: &str) -> Option<&'a Value> {
    m.get(Value::from(key))
}

/// The Wasm PluginConfig (the mapping with `vm_config`) of kvroute, and its parsed configuration.
fn plugin(docs: &[Value]) -> (&serde_yaml::Mapping, Config) {
    let plugin = mappings(docs)
        .into_iter()
        .find(|m| {
            get(m, "vm_config").is_some() && get(m, "root_id") == Some(&Value::from("kvroute"))
        })
        .expect("a kvroute Wasm plugin config");
    let json = get(plugin, "configuration")
        .and_then(|c| c.as_mapping())
        .and_then(|c| get(c, "value"))
        .and_then(Value::as_str)
        .expect("configuration as a StringValue");
    let config = Config::parse(json.as_bytes()).unwrap_or_else(|e| panic!("{e}"));
    (plugin, config)
}

fn check(path: &str) {
    let docs = documents(path);
    let (plugin, config) = plugin(&docs);
    assert_eq!(
        get(plugin, "allow_on_headers_stop_iteration"),
        Some(&Value::from(true)),
        "{path}: body routing needs allow_on_headers_stop_iteration"
    );
    let all = mappings(&docs);
    let override_headers: Vec<&str> = all
        .iter()
        .filter_map(|m| get(m, "override_host_sources"))
        .filter_map(Value::as_sequence)
        .flatten()
        .filter_map(|s| {
            s.as_mapping()
                .and_then(|s| get(s, "header"))
                .and_then(Value::as_str)
        })
        .collect();
    assert_eq!(
        override_headers,
        vec![config.header.as_str()],
        "{path}: override_host reads kvroute's header"
    );
    assert!(
        all.iter()
            .any(|m| get(m, "remove") == Some(&Value::from(config.header.as_str()))),
        "{path}: client-sent routing headers are removed before kvroute runs"
    );
    let admin = config.admin_cluster.as_deref().expect("admin_cluster set");
    assert!(
        all.iter()
            .any(|m| get(m, "name") == Some(&Value::from(admin))
                && get(m, "load_assignment").is_some()),
        "{path}: a cluster named {admin} exists"
    );
}

#[test]
fn the_envoy_bootstrap_is_consistent_with_kvroute() {
    check("envoy/kvroute.yaml");
}

#[test]
fn the_istio_manifests_are_consistent_with_kvroute() {
    check("istio/kvroute-gateway.yaml");
}
