//! Envoy asking kvroute-epp over ext_proc: the shipped `envoy/kvroute-epp.yaml` patched for one run
//! (ports, the pool's members, the picker's address, the ext_proc filter's failure mode, a subset
//! hint), and an Envoy started from it.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use serde_yaml::Value;

use crate::bootstrap::{
    cfg, first_listener, get_mut, hcm_of, seq_mut, set_endpoints, set_health_check_interval,
    with_ports, POOL_CLUSTER,
};
use crate::{paths, Envoy, EnvoyOptions, HarnessError};

/// The cluster of the picker's gRPC server (ext_proc and health) in the shipped bootstrap.
pub const EPP_CLUSTER: &str = "kvroute_epp";
const EXT_PROC_FILTER: &str = "envoy.filters.http.ext_proc";

/// How the Envoy differs from the shipped one, beyond its ports and the addresses it is given.
#[derive(Clone, Debug, Default)]
pub struct Shape {
    /// `failure_mode_allow` of the ext_proc filter: with the picker unreachable, requests go on
    /// to the pool's round robin (fail open) instead of a 503.
    pub fail_open: bool,
    /// A subset hint set on every request (`envoy.lb.subset_hint` metadata), as a gateway in
    /// front of the picker would.
    pub subset: Option<Vec<String>>,
}

/// What to change in the shipped bootstrap.
pub struct Patch<'a> {
    pub admin_port: u16,
    pub listener_port: u16,
    /// Members of the pool, in order.
    pub backends: &'a [SocketAddr],
    /// The picker's gRPC address.
    pub epp: SocketAddr,
    pub shape: &'a Shape,
    /// Replaces the shipped active health-check interval when set.
    pub health_check_interval: Option<Duration>,
}

/// Reads `shipped` (YAML text) and returns the patched bootstrap as YAML text.
pub fn render(shipped: &str, patch: &Patch) -> Result<String, HarnessError> {
    let mut root = with_ports(shipped, patch.admin_port, patch.listener_port)?;
    let listener = first_listener(&mut root)?;
    let filters = seq_mut(get_mut(hcm_of(listener)?, &["http_filters"])?)?;
    let ext_proc = filters
        .iter_mut()
        .find(|f| f.get("name").and_then(Value::as_str) == Some(EXT_PROC_FILTER))
        .ok_or_else(|| cfg(format!("no {EXT_PROC_FILTER} http filter")))?;
    *get_mut(ext_proc, &["typed_config", "failure_mode_allow"])? = patch.shape.fail_open.into();
    if let Some(subset) = &patch.shape.subset {
        let set_metadata = serde_json::json!({
            "name": "envoy.filters.http.set_metadata",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config",
                "metadata": [{
                    "metadata_namespace": "envoy.lb.subset_hint",
                    "value": { "x-gateway-destination-endpoint-subset": subset }
                }]
            }
        });
        // After the filter that drops a client's routing header, before ext_proc.
        let set_metadata = serde_yaml::to_value(set_metadata).map_err(|e| cfg(e.to_string()))?;
        filters.insert(1, set_metadata);
    }
    let clusters = seq_mut(get_mut(&mut root, &["static_resources", "clusters"])?)?;
    let mut found = (false, false);
    for cluster in clusters.iter_mut() {
        match cluster.get("name").and_then(Value::as_str) {
            Some(POOL_CLUSTER) => {
                set_endpoints(cluster, patch.backends)?;
                if let Some(every) = patch.health_check_interval {
                    set_health_check_interval(cluster, every)?;
                }
                found.0 = true;
            }
            Some(EPP_CLUSTER) => {
                set_endpoints(cluster, &[patch.epp])?;
                found.1 = true;
            }
            _ => {}
        }
    }
    match found {
        (false, _) => return Err(cfg(format!("no {POOL_CLUSTER} cluster"))),
        (_, false) => return Err(cfg(format!("no {EPP_CLUSTER} cluster"))),
        _ => {}
    }
    serde_yaml::to_string(&root).map_err(|e| cfg(format!("serialize: {e}")))
}

/// Envoy from the shipped `envoy/kvroute-epp.yaml` over `opts.backends`, asking the picker at
/// `epp`. Of `opts`, the backends, `concurrency`, `health_check_interval`, `wait_healthy`,
/// `ready_timeout`, `log_level` and `run_under` apply; the routing is the picker's.
pub async fn start(
    epp: SocketAddr,
    shape: Shape,
    opts: EnvoyOptions,
) -> Result<Envoy, HarnessError> {
    let shipped = std::fs::read_to_string(paths::epp_bootstrap())?;
    let backends = opts.backends.clone();
    let health_check_interval = opts.health_check_interval;
    let bootstrap = move |admin_port, listener_port, _: &Path| {
        let patch = Patch {
            admin_port,
            listener_port,
            backends: &backends,
            epp,
            shape: &shape,
            health_check_interval,
        };
        render(&shipped, &patch)
    };
    Envoy::start_with(bootstrap, opts).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rendered(shape: Shape) -> String {
        let shipped = std::fs::read_to_string(paths::epp_bootstrap()).unwrap();
        let backends = [
            "127.0.0.1:7001".parse().unwrap(),
            "127.0.0.1:7002".parse().unwrap(),
        ];
        let patch = Patch {
            admin_port: 5001,
            listener_port: 5002,
            backends: &backends,
            epp: "127.0.0.1:7100".parse().unwrap(),
            shape: &shape,
            health_check_interval: Some(Duration::from_millis(200)),
        };
        render(&shipped, &patch).unwrap()
    }

    #[test]
    fn the_ports_the_pool_and_the_picker_are_patched_and_the_routing_kept() {
        let text = rendered(Shape::default());
        for needle in [
            "port_value: 5001",
            "port_value: 5002",
            "port_value: 7002",
            "port_value: 7100",
            "failure_mode_allow: false",
            "override_host",
            "interval: 0.2s",
        ] {
            assert!(text.contains(needle), "{needle} missing from:\n{text}");
        }
        assert!(!text.contains("8001"), "shipped endpoints must be replaced");
        assert!(
            !text.contains("9002"),
            "the shipped picker address must be replaced"
        );
        assert!(!text.contains("set_metadata"));
    }

    #[test]
    fn the_shape_sets_the_failure_mode_and_a_subset_hint() {
        let text = rendered(Shape {
            fail_open: true,
            subset: Some(vec!["127.0.0.1:7002".into()]),
        });
        assert!(text.contains("failure_mode_allow: true"), "{text}");
        assert!(text.contains("envoy.lb.subset_hint"), "{text}");
    }
}
