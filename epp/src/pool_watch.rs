//! The pool's members from an InferencePool's pods, kept current by watching the Kubernetes API.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ApiResource, DynamicObject};
use kube::core::Selector;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::Client;
use serde::Deserialize;
use tokio_stream::{Stream, StreamExt};

use crate::upstreams::Pool;

/// Where the file the Kubernetes service account mounts in every pod names its namespace.
pub const NAMESPACE_FILE: &str = "/var/run/secrets/kubernetes.io/serviceaccount/namespace";

/// The InferencePool the picker serves.
#[derive(Clone)]
pub struct Source {
    pub namespace: String,
    pub name: String,
    /// The Kubernetes API to ask; `None` infers it (the kubeconfig when there is one, else the
    /// pod's service account).
    pub api: Option<kube::Config>,
}

impl Source {
    /// `name` in `namespace`, else in the pod's own namespace, else in `default`.
    pub fn new(name: &str, namespace: Option<&str>) -> Source {
        let own = || std::fs::read_to_string(NAMESPACE_FILE).ok();
        let namespace = match namespace {
            Some(ns) => ns.to_string(),
            None => own().map_or_else(|| "default".to_string(), |ns| ns.trim().to_string()),
        };
        Source {
            namespace,
            name: name.to_string(),
            api: None,
        }
    }
}

/// The resource InferencePools are served as (`inference.networking.k8s.io/v1`).
pub fn inference_pools() -> ApiResource {
    ApiResource {
        group: "inference.networking.k8s.io".into(),
        version: "v1".into(),
        api_version: "inference.networking.k8s.io/v1".into(),
        kind: "InferencePool".into(),
        plural: "inferencepools".into(),
    }
}

/// What an InferencePool selects: the pods its labels match, served at each of its ports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub labels: BTreeMap<String, String>,
    pub ports: Vec<u16>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Spec {
    selector: SpecSelector,
    target_ports: Vec<SpecPort>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct SpecSelector {
    match_labels: BTreeMap<String, String>,
}

#[derive(Deserialize)]
struct SpecPort {
    number: u16,
}

impl Target {
    /// Reads an InferencePool's `spec`; the error names the field at fault.
    pub fn of(pool: &DynamicObject) -> Result<Target, String> {
        let spec = pool.data.get("spec").ok_or("no `spec`")?;
        let spec = Spec::deserialize(spec).map_err(|e| format!("`spec`: {e}"))?;
        if spec.selector.match_labels.is_empty() {
            return Err("`spec.selector.matchLabels` is empty".into());
        }
        let ports: Vec<u16> = spec.target_ports.iter().map(|p| p.number).collect();
        if !(1..=8).contains(&ports.len()) || ports.contains(&0) {
            return Err(format!(
                "`spec.targetPorts` {ports:?}: 1 to 8 ports, none 0"
            ));
        }
        Ok(Target {
            labels: spec.selector.match_labels,
            ports,
        })
    }
}

/// The address a pod takes requests at: one that runs, is ready, has an IP and is not being
/// deleted.
pub fn serving_ip(pod: &Pod) -> Option<IpAddr> {
    if pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let status = pod.status.as_ref()?;
    let mut conditions = status.conditions.iter().flatten();
    let ready = conditions.any(|c| c.type_ == "Ready" && c.status == "True");
    if !ready || status.phase.as_deref() != Some("Running") {
        return None;
    }
    status.pod_ip.as_deref()?.parse().ok()
}

/// The pool's members: each serving pod's IP at each port, sorted, without duplicates.
pub fn members<'a>(pods: impl IntoIterator<Item = &'a Pod>, ports: &[u16]) -> Vec<SocketAddr> {
    let mut members: Vec<SocketAddr> = pods
        .into_iter()
        .filter_map(serving_ip)
        .flat_map(|ip| ports.iter().map(move |&port| SocketAddr::new(ip, port)))
        .collect();
    members.sort();
    members.dedup();
    members
}

type Events<K> = Pin<Box<dyn Stream<Item = Result<K, watcher::Error>> + Send>>;

/// The pods one selector matches, as the watch has shown them so far.
struct Pods {
    store: Store<Pod>,
    events: Events<watcher::Event<Pod>>,
    /// Whether the store holds a whole list yet.
    listed: bool,
}

impl Pods {
    fn watch(client: &Client, namespace: &str, labels: &BTreeMap<String, String>) -> Pods {
        let api = Api::<Pod>::namespaced(client.clone(), namespace);
        let selector: Selector = labels.clone().into_iter().collect();
        let config = watcher::Config::default().labels_from(&selector);
        let (store, writer) = reflector::store();
        let events = watcher(api, config).default_backoff().reflect(writer);
        Pods {
            store,
            events: Box::pin(events),
            listed: false,
        }
    }
}

/// Keeps `pool`'s members the serving pods of the InferencePool `source` names, at its target
/// ports, as the API shows them: the InferencePool and its pods are both watched, and each
/// watch restarts with kube-runtime's backoff after an error. Returns only if a watch ends.
pub async fn run(client: Client, source: Source, pool: Arc<Pool>) {
    let Source {
        namespace, name, ..
    } = source;
    let api = Api::<DynamicObject>::namespaced_with(client.clone(), &namespace, &inference_pools());
    let mut inference_pool = Box::pin(watcher::watch_object(api, &name).default_backoff());
    let mut target: Option<Target> = None;
    let mut pods: Option<Pods> = None;
    loop {
        let next_pod = async {
            match pods.as_mut() {
                Some(pods) => pods.events.next().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            event = inference_pool.next() => match event {
                Some(Ok(Some(object))) => match Target::of(&object) {
                    Ok(new) => {
                        if target.as_ref().map(|t| &t.labels) != Some(&new.labels) {
                            pods = Some(Pods::watch(&client, &namespace, &new.labels));
                        }
                        target = Some(new);
                    }
                    Err(e) => log::error!("InferencePool {namespace}/{name}: {e}; kept as it was"),
                },
                Some(Ok(None)) => {
                    log::warn!("InferencePool {namespace}/{name} does not exist");
                    target = None;
                    pods = None;
                    if pool.listed() {
                        pool.set(Vec::new());
                    }
                }
                Some(Err(e)) => log::warn!("InferencePool {namespace}/{name}: {e}"),
                None => return,
            },
            event = next_pod => match event {
                Some(Ok(watcher::Event::InitDone)) => {
                    if let Some(pods) = pods.as_mut() {
                        pods.listed = true;
                    }
                }
                Some(Ok(_)) => {}
                Some(Err(e)) => log::warn!("the pods of InferencePool {namespace}/{name}: {e}"),
                None => return,
            },
        }
        if let (Some(target), Some(pods)) = (&target, &pods) {
            if pods.listed {
                let state = pods.store.state();
                let now = members(state.iter().map(|p| p.as_ref()), &target.ports);
                if pool.members().as_deref() != Some(&now[..]) {
                    log::info!(
                        "InferencePool {namespace}/{name}: {} endpoints, from {} matching pods",
                        now.len(),
                        state.len()
                    );
                    pool.set(now);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pool(spec: serde_json::Value) -> DynamicObject {
        let mut object = DynamicObject::new("pool", &inference_pools());
        object.data = json!({ "spec": spec });
        object
    }

    #[test]
    fn an_inference_pools_spec_reads_as_its_labels_and_ports() {
        let spec = json!({
            "selector": { "matchLabels": { "app": "vllm" } },
            "targetPorts": [{ "number": 8000 }, { "number": 8001 }],
            "endpointPickerRef": { "name": "kvroute-epp", "port": { "number": 9002 } }
        });
        let target = Target::of(&pool(spec)).unwrap();
        assert_eq!(target.labels, [("app".into(), "vllm".into())].into());
        assert_eq!(target.ports, [8000, 8001]);
    }

    #[test]
    fn a_spec_it_cannot_serve_is_refused_naming_the_field() {
        let labels = json!({ "matchLabels": { "app": "vllm" } });
        for (spec, field) in [
            (json!({ "selector": labels }), "targetPorts"),
            (
                json!({ "selector": labels, "targetPorts": [] }),
                "spec.targetPorts",
            ),
            (
                json!({ "selector": labels, "targetPorts": [{ "number": 70000 }] }),
                "spec",
            ),
            (
                json!({ "selector": { "matchLabels": {} }, "targetPorts": [{ "number": 1 }] }),
                "spec.selector.matchLabels",
            ),
        ] {
            let error = Target::of(&pool(spec.clone())).unwrap_err();
            assert!(error.contains(field), "{spec}: {error}");
        }
        let nine: Vec<_> = (1..=9).map(|n| json!({ "number": n })).collect();
        let spec = json!({ "selector": labels, "targetPorts": nine });
        assert!(Target::of(&pool(spec)).is_err());
    }

    fn pod(phase: &str, ready: &str, ip: Option<&str>, deleting: bool) -> Pod {
        let mut pod = json!({
            "metadata": { "name": "p" },
            "status": { "phase": phase, "conditions": [{ "type": "Ready", "status": ready }] }
        });
        if let Some(ip) = ip {
            pod["status"]["podIP"] = ip.into();
        }
        if deleting {
            pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z".into();
        }
        serde_json::from_value(pod).unwrap()
    }

    #[test]
    fn a_pod_serves_when_running_ready_addressed_and_not_being_deleted() {
        let ip = Some("10.1.2.3");
        assert_eq!(
            serving_ip(&pod("Running", "True", ip, false)),
            Some("10.1.2.3".parse().unwrap())
        );
        assert_eq!(serving_ip(&pod("Pending", "True", ip, false)), None);
        assert_eq!(serving_ip(&pod("Running", "False", ip, false)), None);
        assert_eq!(serving_ip(&pod("Running", "True", None, false)), None);
        assert_eq!(serving_ip(&pod("Running", "True", ip, true)), None);
    }

    #[test]
    fn members_are_each_serving_pod_at_each_port_sorted_once() {
        let a = pod("Running", "True", Some("10.0.0.2"), false);
        let b = pod("Running", "True", Some("fd00::1"), false);
        let twin = pod("Running", "True", Some("10.0.0.2"), false);
        let down = pod("Running", "False", Some("10.0.0.1"), false);
        let got = members([&b, &a, &twin, &down], &[9000, 8000]);
        let want: Vec<SocketAddr> = [
            "10.0.0.2:8000",
            "10.0.0.2:9000",
            "[fd00::1]:8000",
            "[fd00::1]:9000",
        ]
        .iter()
        .map(|a| a.parse().unwrap())
        .collect();
        assert_eq!(got, want);
    }
}
