//! Patches the shipped `envoy/kvroute.yaml` for one harness run: ports, endpoints, filter, LB policy.
//!
//! Every lookup names the field it expected, so when the shipped file changes shape the error says
//! which assumption broke instead of Envoy rejecting a half-patched config.

use crate::{HarnessError, Lb};
use serde_json::Value as Json;
use serde_yaml::{Mapping, Value};
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

/// Cluster that holds the inference replicas in the shipped bootstrap.
pub const POOL_CLUSTER: &str = "inference_pool";
/// Cluster through which kvroute polls Envoy's own admin `/clusters`.
pub const ADMIN_CLUSTER: &str = "kvroute_admin";
/// Cluster through which kvroute polls kvroute-indexer's change feed (precise mode).
pub const INDEXER_CLUSTER: &str = "kvroute_indexer";
const WASM_FILTER: &str = "envoy.filters.http.wasm";

/// What to change in the shipped bootstrap.
pub struct Patch<'a> {
    pub admin_port: u16,
    pub listener_port: u16,
    pub backends: &'a [SocketAddr],
    pub lb: &'a Lb,
    /// Required for [`Lb::Kvroute`], ignored otherwise.
    pub wasm: Option<&'a Path>,
    /// Replaces the shipped active health-check interval when set.
    pub health_check_interval: Option<Duration>,
    /// Keeps the pool's shipped active health checks; `false` removes them.
    pub active_health_checks: bool,
    /// Loads the filter the way Istio's `WasmPlugin` does (see [`as_wasm_plugin`]).
    pub wasm_plugin_like: bool,
    /// Points the admin cluster here instead of at Envoy's own admin.
    pub admin_target: Option<SocketAddr>,
    /// Points the indexer cluster here (the shipped address otherwise).
    pub indexer: Option<SocketAddr>,
    /// Names the upstream that answered in the [`UPSTREAM_HEADER`] response header (the front of
    /// a scaled-out router: which instance served the request).
    pub name_upstream: bool,
}

impl<'a> Patch<'a> {
    /// The ports, the backends and the LB policy, nothing else changed: no filter, the shipped
    /// health-check interval, no active health checks, the filter loaded as shipped, the admin
    /// and indexer clusters as shipped, no upstream named.
    pub fn new(
        admin_port: u16,
        listener_port: u16,
        backends: &'a [SocketAddr],
        lb: &'a Lb,
    ) -> Self {
        Patch {
            admin_port,
            listener_port,
            backends,
            lb,
            wasm: None,
            health_check_interval: None,
            active_health_checks: false,
            wasm_plugin_like: false,
            admin_target: None,
            indexer: None,
            name_upstream: false,
        }
    }
}

/// Response header naming the upstream address that answered, where [`Patch::name_upstream`].
pub const UPSTREAM_HEADER: &str = "x-bench-upstream";

/// Reads `shipped` (YAML text) and returns the patched bootstrap as YAML text.
pub fn render(shipped: &str, patch: &Patch) -> Result<String, HarnessError> {
    let mut root = with_ports(shipped, patch.admin_port, patch.listener_port)?;
    patch_filters(first_listener(&mut root)?, patch)?;

    let clusters = seq_mut(get_mut(&mut root, &["static_resources", "clusters"])?)?;
    for cluster in clusters.iter_mut() {
        match cluster.get("name").and_then(Value::as_str) {
            Some(POOL_CLUSTER) => patch_pool(cluster, patch)?,
            Some(ADMIN_CLUSTER) => {
                let own = SocketAddr::from(([127, 0, 0, 1], patch.admin_port));
                let admin = patch.admin_target.unwrap_or(own);
                set_endpoints(cluster, &[admin])?;
            }
            Some(INDEXER_CLUSTER) => {
                if let Some(indexer) = patch.indexer {
                    set_endpoints(cluster, &[indexer])?;
                }
            }
            _ => {}
        }
    }
    serde_yaml::to_string(&root).map_err(|e| cfg(format!("serialize: {e}")))
}

/// The kvroute plugin configuration (JSON text) that `shipped` (YAML text) gives its filter.
pub fn shipped_plugin_config(shipped: &str) -> Result<String, HarnessError> {
    let mut root: Value = serde_yaml::from_str(shipped).map_err(|e| cfg(format!("parse: {e}")))?;
    let listeners = get_mut(&mut root, &["static_resources", "listeners"])?;
    let listener = seq_mut(listeners)?
        .first_mut()
        .ok_or_else(|| cfg("no listener".into()))?;
    let hcm = hcm_of(listener)?;
    let filter = seq_mut(get_mut(hcm, &["http_filters"])?)?
        .iter_mut()
        .find(|f| f.get("name").and_then(Value::as_str) == Some(WASM_FILTER))
        .ok_or_else(|| cfg(format!("no {WASM_FILTER} http filter")))?;
    let path = ["typed_config", "config", "configuration", "value"];
    let value = get_mut(filter, &path)?;
    value
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| cfg("configuration.value is not a string".into()))
}

/// `shipped` parsed, with Envoy's admin port and its (first) listener's port set: where every
/// render starts.
pub(crate) fn with_ports(
    shipped: &str,
    admin_port: u16,
    listener_port: u16,
) -> Result<Value, HarnessError> {
    let mut root: Value = serde_yaml::from_str(shipped).map_err(|e| cfg(format!("parse: {e}")))?;
    set_port(
        get_mut(&mut root, &["admin", "address", "socket_address"])?,
        admin_port,
    )?;
    let listener = first_listener(&mut root)?;
    set_port(
        get_mut(listener, &["address", "socket_address"])?,
        listener_port,
    )?;
    Ok(root)
}

/// The first listener of the bootstrap's static resources.
pub(crate) fn first_listener(root: &mut Value) -> Result<&mut Value, HarnessError> {
    seq_mut(get_mut(root, &["static_resources", "listeners"])?)?
        .first_mut()
        .ok_or_else(|| cfg("no listener".into()))
}

/// The HTTP connection manager's config in `listener`'s first filter chain.
pub(crate) fn hcm_of(listener: &mut Value) -> Result<&mut Value, HarnessError> {
    let chain = seq_mut(get_mut(listener, &["filter_chains"])?)?
        .first_mut()
        .ok_or_else(|| cfg("no filter chain".into()))?;
    let hcm = seq_mut(get_mut(chain, &["filters"])?)?
        .first_mut()
        .ok_or_else(|| cfg("no network filter".into()))?;
    get_mut(hcm, &["typed_config"])
}

/// Points the wasm filter at the built filter and its config, or removes it for the plain policies.
fn patch_filters(listener: &mut Value, patch: &Patch) -> Result<(), HarnessError> {
    let hcm = hcm_of(listener)?;
    let yaml = |json: Json| serde_yaml::to_value(json).map_err(|e| cfg(e.to_string()));
    if let Lb::RingHash { header } = patch.lb {
        // ring_hash needs the route to say what to hash.
        let policy = yaml(serde_json::json!([{ "header": { "header_name": header } }]))?;
        map_mut(get_mut(first_route(hcm)?, &["route"])?)?.insert("hash_policy".into(), policy);
    }
    if patch.name_upstream {
        let header = yaml(serde_json::json!([{ "header": {
            "key": UPSTREAM_HEADER, "value": "%UPSTREAM_REMOTE_ADDRESS%"
        } }]))?;
        map_mut(first_route(hcm)?)?.insert("response_headers_to_add".into(), header);
    }
    let filters = seq_mut(get_mut(hcm, &["http_filters"])?)?;
    let wasm_at = filters
        .iter()
        .position(|f| f.get("name").and_then(Value::as_str) == Some(WASM_FILTER))
        .ok_or_else(|| cfg(format!("no {WASM_FILTER} http filter")))?;
    let plugin_config = match patch.lb {
        Lb::Kvroute { plugin_config } | Lb::FloorHeader { plugin_config } => plugin_config,
        Lb::Floor => &Json::Object(Default::default()),
        _ => {
            filters.remove(wasm_at);
            return Ok(());
        }
    };
    let config = get_mut(&mut filters[wasm_at], &["typed_config", "config"])?;
    let wasm = patch
        .wasm
        .ok_or_else(|| cfg("the wasm filter needs a wasm path".into()))?;
    let local = get_mut(config, &["vm_config", "code", "local"])?;
    map_mut(local)?.insert("filename".into(), wasm.display().to_string().into());
    if let Lb::Floor | Lb::FloorHeader { .. } = patch.lb {
        // Same filter slot and VM settings as kvroute's; the floor reads only its opt-in list.
        map_mut(get_mut(config, &["vm_config"])?)?.insert("vm_id".into(), "floor".into());
        *get_mut(config, &["configuration", "value"])? = plugin_config.to_string().into();
        return Ok(());
    }
    let value = get_mut(config, &["configuration", "value"])?;
    let shipped = value
        .as_str()
        .ok_or_else(|| cfg("configuration.value is not a string".into()))?;
    *value = merge_plugin_config(shipped, plugin_config)?.into();
    if patch.wasm_plugin_like {
        as_wasm_plugin(config)?;
    }
    Ok(())
}

/// The first route of the first virtual host of the HTTP connection manager `hcm`.
fn first_route(hcm: &mut Value) -> Result<&mut Value, HarnessError> {
    let host = get_mut(hcm, &["route_config", "virtual_hosts"])
        .and_then(seq_mut)?
        .first_mut()
        .ok_or_else(|| cfg("no virtual host".into()))?;
    get_mut(host, &["routes"])
        .and_then(seq_mut)?
        .first_mut()
        .ok_or_else(|| cfg("no route".into()))
}

/// Rewrites the Wasm `PluginConfig` into what istiod generates for a `WasmPlugin` (pilot's
/// `extensions.go`): `name` is `<namespace>.<name>`, `root_id` the `pluginName`, no `vm_id`, and no
/// `allow_on_headers_stop_iteration`, which `WasmPlugin` has no field for.
fn as_wasm_plugin(config: &mut Value) -> Result<(), HarnessError> {
    map_mut(get_mut(config, &["vm_config"])?)?.remove("vm_id");
    let config = map_mut(config)?;
    config
        .remove("allow_on_headers_stop_iteration")
        .ok_or_else(|| cfg("missing field `allow_on_headers_stop_iteration`".into()))?;
    config.insert("name".into(), "llm.kvroute".into());
    config.insert("root_id".into(), "kvroute".into());
    Ok(())
}

/// The shipped plugin config with `overrides`' top-level keys laid over it, so tests keep the
/// shipped `admin_cluster` and poll interval unless they say otherwise. A `null` removes a key.
pub fn merge_plugin_config(shipped: &str, overrides: &Json) -> Result<String, HarnessError> {
    let mut merged: Json =
        serde_json::from_str(shipped).map_err(|e| cfg(format!("shipped plugin config: {e}")))?;
    let (Some(base), Some(over)) = (merged.as_object_mut(), overrides.as_object()) else {
        return Err(cfg("plugin configs must be JSON objects".into()));
    };
    for (k, v) in over {
        if v.is_null() {
            base.remove(k);
        } else {
            base.insert(k.clone(), v.clone());
        }
    }
    Ok(merged.to_string())
}

/// The most a host waits for its first health check with [`Patch::health_check_interval`] set.
const FIRST_CHECK: Duration = Duration::from_millis(200);

fn patch_pool(cluster: &mut Value, patch: &Patch) -> Result<(), HarnessError> {
    set_endpoints(cluster, patch.backends)?;
    if !patch.active_health_checks {
        map_mut(cluster)?.remove("health_checks");
    } else if let Some(every) = patch.health_check_interval {
        set_health_check_interval(cluster, every)?;
    }
    let plain = match patch.lb {
        Lb::Kvroute { .. } | Lb::FloorHeader { .. } => return Ok(()),
        Lb::RoundRobin | Lb::Floor => ("round_robin", "round_robin.v3.RoundRobin"),
        Lb::LeastRequest => ("least_request", "least_request.v3.LeastRequest"),
        Lb::RingHash { .. } => ("ring_hash", "ring_hash.v3.RingHash"),
    };
    let policy = serde_json::json!({ "policies": [{ "typed_extension_config": {
        "name": format!("envoy.load_balancing_policies.{}", plain.0),
        "typed_config": {
            "@type": format!("type.googleapis.com/envoy.extensions.load_balancing_policies.{}", plain.1)
        }
    }}]});
    let policy = serde_yaml::to_value(policy).map_err(|e| cfg(e.to_string()))?;
    map_mut(cluster)?.insert("load_balancing_policy".into(), policy);
    Ok(())
}

/// Checks `cluster`'s hosts every `every`. A host not yet healthy and without traffic (every
/// host at start) is checked every `no_traffic_interval`: soon, so that a long interval does not
/// hold up the start. A healthy host is checked every `every`, with traffic or without (whose
/// default is 60 s).
pub(crate) fn set_health_check_interval(
    cluster: &mut Value,
    every: Duration,
) -> Result<(), HarnessError> {
    let first = every.min(FIRST_CHECK);
    let [every, first] = [every, first].map(|d| format!("{}s", d.as_secs_f64()));
    for hc in seq_mut(get_mut(cluster, &["health_checks"])?)? {
        let hc = map_mut(hc)?;
        hc.insert("interval".into(), every.clone().into());
        hc.insert("no_traffic_healthy_interval".into(), every.clone().into());
        hc.insert("no_traffic_interval".into(), first.clone().into());
    }
    Ok(())
}

pub(crate) fn set_endpoints(cluster: &mut Value, addrs: &[SocketAddr]) -> Result<(), HarnessError> {
    let endpoints: Vec<Json> = addrs
        .iter()
        .map(|a| {
            serde_json::json!({ "endpoint": { "address": { "socket_address": {
                "address": a.ip().to_string(), "port_value": a.port() } } } })
        })
        .collect();
    let groups = seq_mut(get_mut(cluster, &["load_assignment", "endpoints"])?)?;
    let group = groups
        .first_mut()
        .ok_or_else(|| cfg("no endpoint group".into()))?;
    let endpoints = serde_yaml::to_value(endpoints).map_err(|e| cfg(e.to_string()))?;
    map_mut(group)?.insert("lb_endpoints".into(), endpoints);
    Ok(())
}

pub(crate) fn set_port(socket_address: &mut Value, port: u16) -> Result<(), HarnessError> {
    map_mut(socket_address)?.insert("port_value".into(), port.into());
    Ok(())
}

pub(crate) fn get_mut<'v>(
    mut v: &'v mut Value,
    path: &[&str],
) -> Result<&'v mut Value, HarnessError> {
    for key in path {
        v = v
            .get_mut(*key)
            .ok_or_else(|| cfg(format!("missing field `{key}` (path {path:?})")))?;
    }
    Ok(v)
}

pub(crate) fn seq_mut(v: &mut Value) -> Result<&mut Vec<Value>, HarnessError> {
    v.as_sequence_mut()
        .ok_or_else(|| cfg("expected a list".into()))
}

pub(crate) fn map_mut(v: &mut Value) -> Result<&mut Mapping, HarnessError> {
    v.as_mapping_mut()
        .ok_or_else(|| cfg("expected a mapping".into()))
}

pub(crate) fn cfg(msg: String) -> HarnessError {
    HarnessError::Config(msg)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shipped() -> String {
        std::fs::read_to_string(crate::paths::shipped_bootstrap()).unwrap()
    }

    fn render_with(lb: &Lb) -> Value {
        render_checked(lb, true)
    }

    fn render_checked(lb: &Lb, active_health_checks: bool) -> Value {
        let backends = [
            "127.0.0.1:7001".parse().unwrap(),
            "127.0.0.1:7002".parse().unwrap(),
        ];
        let patch = Patch {
            wasm: Some(Path::new("/x/kvroute.wasm")),
            health_check_interval: Some(Duration::from_millis(200)),
            active_health_checks,
            ..Patch::new(5001, 5002, &backends, lb)
        };
        serde_yaml::from_str(&render(&shipped(), &patch).unwrap()).unwrap()
    }

    #[test]
    fn a_front_names_the_upstream_that_answered_only_when_asked() {
        let backends = ["127.0.0.1:7001".parse().unwrap()];
        let render_as = |name_upstream| {
            let patch = Patch {
                name_upstream,
                ..Patch::new(5001, 5002, &backends, &Lb::RoundRobin)
            };
            render(&shipped(), &patch).unwrap()
        };
        let named = render_as(true);
        assert!(named.contains(UPSTREAM_HEADER), "{named}");
        assert!(named.contains("%UPSTREAM_REMOTE_ADDRESS%"));
        assert!(!render_as(false).contains(UPSTREAM_HEADER));
    }

    #[test]
    fn wasm_plugin_like_drops_the_stop_iteration_flag_and_the_vm_id() {
        let backends = ["127.0.0.1:7001".parse().unwrap()];
        let lb = Lb::Kvroute {
            plugin_config: serde_json::json!({}),
        };
        let render_as = |wasm_plugin_like| {
            let patch = Patch {
                wasm: Some(Path::new("/x/kvroute.wasm")),
                active_health_checks: true,
                wasm_plugin_like,
                ..Patch::new(5001, 5002, &backends, &lb)
            };
            render(&shipped(), &patch).unwrap()
        };
        let shipped_like = render_as(false);
        assert!(shipped_like.contains("allow_on_headers_stop_iteration: true"));
        assert!(shipped_like.contains("vm_id: kvroute"));
        let plugin_like = render_as(true);
        assert!(!plugin_like.contains("allow_on_headers_stop_iteration"));
        assert!(!plugin_like.contains("vm_id"));
        assert!(plugin_like.contains("name: llm.kvroute"));
        assert!(plugin_like.contains("root_id: kvroute"));
    }

    #[test]
    fn the_floor_is_the_same_filter_slot_and_failure_policy_in_front_of_round_robin() {
        let text = serde_yaml::to_string(&render_with(&Lb::Floor)).unwrap();
        for needle in [
            "filename: /x/kvroute.wasm",
            "vm_id: floor",
            "allow_on_headers_stop_iteration: true",
            "failure_policy: FAIL_RELOAD",
            "round_robin.v3.RoundRobin",
        ] {
            assert!(text.contains(needle), "{needle} missing from:\n{text}");
        }
        assert!(!text.contains("override_host"));
    }

    #[test]
    fn the_floor_with_a_header_keeps_override_host_and_gets_its_values() {
        let lb = Lb::FloorHeader {
            plugin_config: serde_json::json!({ "header_values": ["127.0.0.1:8001"] }),
        };
        let text = serde_yaml::to_string(&render_with(&lb)).unwrap();
        for needle in ["vm_id: floor", "override_host", "127.0.0.1:8001"] {
            assert!(text.contains(needle), "{needle} missing from:\n{text}");
        }
        assert!(!text.contains("admin_cluster"), "not kvroute's config");
    }

    #[test]
    fn kvroute_render_keeps_shipped_plugin_config_and_patches_the_rest() {
        let text = serde_yaml::to_string(&render_with(&Lb::Kvroute {
            plugin_config: serde_json::json!({ "debug_header": true }),
        }))
        .unwrap();
        for needle in [
            "port_value: 5001",
            "port_value: 5002",
            "port_value: 7002",
            "/x/kvroute.wasm",
        ] {
            assert!(text.contains(needle), "{needle} missing in\n{text}");
        }
        assert!(text.contains("override_host"));
        assert!(text.contains("interval: 0.2s"));
        assert!(text.contains("no_traffic_interval: 0.2s"));
        assert!(text.contains("no_traffic_healthy_interval: 0.2s"));
        assert!(
            text.contains(r#"\"debug_header\":true"#) || text.contains(r#""debug_header":true"#)
        );
        assert!(
            text.contains("kvroute_admin"),
            "admin cluster config must stay"
        );
        assert!(!text.contains("8001"), "shipped endpoints must be replaced");
    }

    #[test]
    fn plain_policies_drop_the_filter_and_override_host() {
        for (lb, name) in [
            (Lb::RoundRobin, "round_robin.v3.RoundRobin"),
            (Lb::LeastRequest, "least_request.v3.LeastRequest"),
            (
                Lb::RingHash {
                    header: "x-user".into(),
                },
                "ring_hash.v3.RingHash",
            ),
        ] {
            let text = serde_yaml::to_string(&render_with(&lb)).unwrap();
            assert!(!text.contains(WASM_FILTER), "{text}");
            assert!(!text.contains("override_host"), "{text}");
            assert!(text.contains(name), "{text}");
        }
        let text = serde_yaml::to_string(&render_with(&Lb::RingHash {
            header: "x-user".into(),
        }))
        .unwrap();
        assert!(text.contains("header_name: x-user"), "{text}");
    }

    #[test]
    fn active_health_checks_can_be_removed_and_outlier_detection_stays() {
        let pool = |root: &Value| {
            root["static_resources"]["clusters"]
                .as_sequence()
                .unwrap()
                .iter()
                .find(|c| c["name"].as_str() == Some(POOL_CLUSTER))
                .unwrap()
                .clone()
        };
        let with = pool(&render_checked(&Lb::RoundRobin, true));
        assert!(with.get("health_checks").is_some());
        let without = pool(&render_checked(&Lb::RoundRobin, false));
        assert!(without.get("health_checks").is_none(), "{without:?}");
        assert!(without.get("outlier_detection").is_some());
    }

    #[test]
    fn null_override_removes_a_shipped_key() {
        let merged =
            merge_plugin_config(r#"{"a":1,"b":2}"#, &serde_json::json!({"a": null, "c": 3}))
                .unwrap();
        assert_eq!(
            serde_json::from_str::<Json>(&merged).unwrap(),
            serde_json::json!({"b": 2, "c": 3})
        );
    }
}
