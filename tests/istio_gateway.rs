//! The gateway config istiod and istio-agent would hand Envoy from `istio/body-routing` (and from
//! `istio/precise`, with kvroute-indexer), assembled from the rendered manifests (every value read
//! from them) and run with real traffic.
//!
//! Stand-ins for what only a cluster has: ADS becomes a file (the ECDS resource the EnvoyFilter
//! adds, in a path config source); the `oci://` remote code becomes the local module, as
//! istio-agent rewrites it after the pull; the Service's endpoints are the test backends (STATIC
//! instead of EDS); `prometheus_stats` is the cluster Istio's bootstrap has, on the admin port.

use crate::common;
use crate::common::istio;

use common::{ask, chat_body, client, reached_since, received, served_by, system_prompt};
use common::{warm_up, Fleet};
use kvroute::gateway::stat_names::{self, Gauge};
use kvroute::hosts::{admin_clusters_path, PolledClusters};
use kvroute_harness::backend::Backend;
use kvroute_harness::{paths, Envoy, EnvoyOptions, HarnessError};
use serde_json::{json, Value as Json};
use serde_yaml::Value;
use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;

const GROUPS: usize = 6;
const TYPED_EXTENSION_CONFIG: &str =
    "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig";

fn to_json(v: &Value) -> Json {
    serde_json::to_value(v).expect("YAML as JSON")
}

/// Every config patch of every EnvoyFilter, in order.
fn patches(docs: &[Value]) -> Vec<&Value> {
    docs.iter()
        .filter(|d| d["kind"] == "EnvoyFilter")
        .flat_map(|d| {
            d["spec"]["configPatches"]
                .as_sequence()
                .expect("configPatches")
        })
        .collect()
}

/// Merges `patch` into `base` the way Envoy's proto MERGE does for these fields: objects field
/// by field, lists appended, anything else replaced.
fn merge(base: &mut Json, patch: &Json) {
    match (base, patch) {
        (Json::Object(b), Json::Object(p)) => {
            for (k, v) in p {
                merge(b.entry(k.clone()).or_insert(Json::Null), v);
            }
        }
        (Json::Array(b), Json::Array(p)) => b.extend(p.iter().cloned()),
        (b, p) => *b = p.clone(),
    }
}

/// The Wasm ECDS resource with the module pulled: `remote` (oci://) becomes a local file.
fn extension_config(docs: &[Value], wasm: &Path) -> Json {
    let value = &istio::patch(docs, "kvroute", "EXTENSION_CONFIG", "kvroute")["patch"]["value"];
    let mut ec = to_json(value);
    let code = &mut ec["typed_config"]["config"]["vm_config"]["code"];
    let uri = code["remote"]["http_uri"]["uri"]
        .as_str()
        .expect("remote code");
    assert!(uri.starts_with("oci://"), "{uri}");
    *code = json!({ "local": { "filename": wasm.display().to_string() } });
    ec["@type"] = TYPED_EXTENSION_CONFIG.into();
    ec
}

/// The gateway's HTTP filters: Istio's own (cors, fault, router) with the HTTP_FILTER patches
/// applied as istiod applies them, ADS replaced by the ECDS file.
fn http_filters(docs: &[Value], ecds: &Path) -> Json {
    let mut chain = vec![
        json!({ "name": "envoy.filters.http.cors", "typed_config": { "@type": "type.googleapis.com/envoy.extensions.filters.http.cors.v3.Cors" } }),
        json!({ "name": "envoy.filters.http.fault", "typed_config": { "@type": "type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault" } }),
        json!({ "name": "envoy.filters.http.router", "typed_config": { "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router" } }),
    ];
    for p in patches(docs)
        .into_iter()
        .filter(|p| p["applyTo"] == "HTTP_FILTER")
    {
        let mut value = to_json(&p["patch"]["value"]);
        if let Some(source) = value.pointer_mut("/config_discovery/config_source") {
            assert_eq!(source["ads"], json!({}), "istiod serves ECDS over ADS");
            *source = json!({ "path_config_source": { "path": ecds.display().to_string() } });
        }
        let sub = p["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"].as_str();
        let at = |name: Option<&str>| {
            chain
                .iter()
                .position(|f| Some(f["name"].as_str().unwrap_or_default()) == name)
                .unwrap_or_else(|| panic!("no filter {name:?} in the chain"))
        };
        match p["patch"]["operation"].as_str() {
            Some("INSERT_FIRST") => chain.insert(0, value),
            Some("INSERT_BEFORE") => chain.insert(at(sub), value),
            Some("INSERT_AFTER") => chain.insert(at(sub) + 1, value),
            other => panic!("HTTP_FILTER operation {other:?} not assembled here"),
        }
    }
    Json::Array(chain)
}

/// The route istiod builds from the VirtualService: its name, Istio's cluster name for the
/// destination, and the retry policy with the predicate istiod adds.
fn route_config(docs: &[Value]) -> (Json, String) {
    let vs = istio::object(docs, "VirtualService", "vllm");
    let http = &vs["spec"]["http"][0];
    let dest = &http["route"][0]["destination"];
    let cluster = format!(
        "outbound|{}||{}",
        dest["port"]["number"].as_u64().expect("port"),
        dest["host"].as_str().expect("host")
    );
    let retries = &http["retries"];
    // As istiod: status codes in retryOn become retriable_status_codes.
    let tokens: Vec<&str> = retries["retryOn"]
        .as_str()
        .expect("retryOn")
        .split(',')
        .collect();
    let codes: Vec<u32> = tokens.iter().filter_map(|t| t.parse().ok()).collect();
    let mut retry_on: Vec<&str> = tokens
        .iter()
        .copied()
        .filter(|t| t.parse::<u32>().is_err())
        .collect();
    if !codes.is_empty() {
        retry_on.push("retriable-status-codes");
    }
    let route = json!({
        "name": "http.80",
        "virtual_hosts": [{
            "name": "*:80",
            "domains": ["*"],
            "routes": [{
                "name": http["name"].as_str().expect("the route's name"),
                "match": { "prefix": http["match"][0]["uri"]["prefix"].as_str().expect("prefix") },
                "route": {
                    "cluster": cluster,
                    "timeout": http["timeout"].as_str().expect("timeout"),
                    "retry_policy": {
                        "retry_on": retry_on.join(","),
                        "retriable_status_codes": codes,
                        "num_retries": retries["attempts"].as_u64().expect("attempts"),
                        "retry_host_predicate": [{
                            "name": "envoy.retry_host_predicates.previous_hosts",
                            "typed_config": { "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate" }
                        }],
                        "host_selection_retry_max_attempts": 5
                    }
                }
            }]
        }]
    });
    (route, cluster)
}

fn static_cluster(name: &str, hosts: &[SocketAddr]) -> Json {
    let endpoints: Vec<Json> = hosts
        .iter()
        .map(|a| json!({ "endpoint": { "address": { "socket_address": { "address": a.ip().to_string(), "port_value": a.port() } } } }))
        .collect();
    json!({
        "name": name,
        "type": "STATIC",
        "connect_timeout": "10s",
        "load_assignment": { "cluster_name": name, "endpoints": [{ "lb_endpoints": endpoints }] }
    })
}

/// The gateway's Envoy config (bootstrap, ECDS file) from the rendered `istio/body-routing` (or
/// `istio/precise`). With `indexer` (precise mode), the `kvroute_indexer` cluster the overlay adds
/// points there instead of the pod's 127.0.0.1:9400, and the test reads what kvroute decided: the
/// plugin gains `debug_header` and a quicker poll, the route names the upstream that answered.
fn gateway(
    docs: &[Value],
    backends: &[SocketAddr],
    ports: (u16, u16),
    dir: &Path,
    ecds_inline: bool,
    indexer: Option<SocketAddr>,
) -> Json {
    let wasm = paths::kvroute_wasm().expect("KVROUTE_WASM");
    let ecds_path = dir.join("kvroute-ecds.json");
    let mut ec = extension_config(docs, &wasm);
    if indexer.is_some() {
        let value = &mut ec["typed_config"]["config"]["configuration"]["value"];
        let mut config: Json = serde_json::from_str(value.as_str().expect("a StringValue"))
            .expect("the plugin configuration is JSON");
        config["debug_header"] = true.into();
        config["stats_interval_ms"] = 200.into();
        *value = config.to_string().into();
    }
    std::fs::write(&ecds_path, json!({ "resources": [ec] }).to_string()).expect("ECDS file");
    let mut filters = http_filters(docs, &ecds_path);
    if ecds_inline {
        // For --mode validate, which does not load dynamic config: the same config in place.
        for f in filters.as_array_mut().expect("filters") {
            if f["name"] == ec["name"] {
                *f = json!({ "name": ec["name"], "typed_config": ec["typed_config"] });
            }
        }
    }
    let (mut route, pool) = route_config(docs);
    if indexer.is_some() {
        let header = json!([{ "header": {
            "key": kvroute_harness::bootstrap::UPSTREAM_HEADER, "value": "%UPSTREAM_REMOTE_ADDRESS%"
        } }]);
        route["virtual_hosts"][0]["routes"][0]["response_headers_to_add"] = header;
    }
    assert_eq!(
        pool,
        istio::pool_cluster(docs),
        "the cluster patch matches the route's cluster"
    );
    let mut listener = json!({
        "name": "0.0.0.0_8080",
        "address": { "socket_address": { "address": "127.0.0.1", "port_value": ports.1 } },
        "filter_chains": [{ "filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": "outbound_0.0.0.0_8080",
                "route_config": route,
                "http_filters": filters
            }
        }]}]
    });
    // Istio's default for a service cluster is least-request; the patch's policy must win over it.
    let mut pool_cluster = static_cluster(&pool, backends);
    pool_cluster["lb_policy"] = "LEAST_REQUEST".into();
    let mut added = Vec::new();
    for p in patches(docs) {
        let value = to_json(&p["patch"]["value"]);
        match (p["applyTo"].as_str(), p["patch"]["operation"].as_str()) {
            (Some("LISTENER"), Some("MERGE")) => merge(&mut listener, &value),
            (Some("CLUSTER"), Some("MERGE")) => {
                assert_eq!(p["match"]["cluster"]["name"], Value::from(pool.as_str()));
                merge(&mut pool_cluster, &value);
            }
            (Some("HTTP_ROUTE"), Some("MERGE")) => {
                let entry = listener
                    .pointer_mut(
                        "/filter_chains/0/filters/0/typed_config/route_config/virtual_hosts/0/routes/0",
                    )
                    .expect("the route");
                let name = &p["match"]["routeConfiguration"]["vhost"]["route"]["name"];
                assert_eq!(Some(to_json(name)), entry.get("name").cloned());
                merge(entry, &value);
            }
            (Some("CLUSTER"), Some("ADD")) => {
                let mut cluster = value;
                if let Some(at) = indexer {
                    let name = cluster["name"].as_str().expect("a name").to_string();
                    cluster = static_cluster(&name, &[at]);
                }
                added.push(cluster);
            }
            (Some("HTTP_FILTER" | "EXTENSION_CONFIG"), _) => {}
            other => panic!("patch {other:?} not assembled here"),
        }
    }
    let admin = SocketAddr::from(([127, 0, 0, 1], ports.0));
    let mut clusters = vec![pool_cluster, static_cluster("prometheus_stats", &[admin])];
    clusters.extend(added);
    json!({
        // What istio-agent puts in every gateway's bootstrap; ECDS needs a node.
        "node": {
            "id": "router~127.0.0.1~istio-ingressgateway.istio-system~istio-system.svc.cluster.local",
            "cluster": "istio-ingressgateway.istio-system"
        },
        "admin": { "address": { "socket_address": { "address": "127.0.0.1", "port_value": ports.0 } } },
        "static_resources": {
            "listeners": [listener],
            "clusters": clusters
        }
    })
}

#[test]
fn the_assembled_gateway_config_passes_envoy_validation() {
    for variant in ["body-routing", "precise"] {
        assembled_config_passes_envoy_validation(variant);
    }
}

fn assembled_config_passes_envoy_validation(variant: &str) {
    let docs = istio::rendered(variant);
    let dir = std::env::temp_dir().join(format!("kvroute-istio-validate-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let backends: Vec<SocketAddr> = vec!["127.0.0.1:1".parse().unwrap()];
    let validate = |config: &Json| {
        let path = dir.join("envoy.json");
        std::fs::write(&path, config.to_string()).expect("write config");
        let envoy = paths::envoy_bin().expect("ENVOY_BIN");
        let out = Command::new(envoy)
            .args(["--mode", "validate", "--use-dynamic-base-id", "-c"])
            .arg(&path)
            .output()
            .expect("envoy runs");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let config = gateway(&docs, &backends, (1, 2), &dir, true, None);
    let (ok, log) = validate(&config);
    assert!(
        ok,
        "{variant}: Envoy rejects the assembled gateway config:\n{log}"
    );
    // Envoy's validation is strict here too: a field the override_host policy lacks is rejected.
    let mut bad = config.clone();
    let policy = bad
        .pointer_mut("/static_resources/clusters/0/load_balancing_policy/policies/0/typed_extension_config/typed_config")
        .expect("the merged override_host policy");
    policy["override_host_source"] = json!([]);
    let (ok, log) = validate(&bad);
    assert!(
        !ok,
        "a misspelt override_host field passed validation:\n{log}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_routes_by_prefix_through_the_istio_config() {
    let docs = istio::rendered("body-routing");
    let backends = Backend::start_many(4).await.expect("backends start");
    let addrs: Vec<SocketAddr> = backends.iter().map(Backend::addr).collect();
    let envoy = Envoy::start_with(
        |admin, listener, dir| -> Result<String, HarnessError> {
            Ok(gateway(&docs, &addrs, (admin, listener), dir, false, None).to_string())
        },
        EnvoyOptions {
            wait_healthy: false,
            ..EnvoyOptions::default()
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let fleet = Fleet {
        backends,
        envoy,
        client: client(),
    };
    // The filter came over ECDS, and its poll of prometheus_stats found the Service's hosts.
    fleet.wait_endpoints_known(addrs.len()).await;
    // The admin honours the poll's filter: only the Service's cluster, not prometheus_stats.
    let pool = [istio::pool_cluster(&docs)];
    let path = admin_clusters_path(PolledClusters::new(&pool, Some(pool[0].as_str())));
    let url = format!("{}{path}", fleet.envoy.admin_url());
    let listed: Json = fleet
        .client
        .get(url)
        .send()
        .await
        .expect("admin")
        .json()
        .await
        .expect("JSON");
    let names: Vec<&str> = listed["cluster_statuses"]
        .as_array()
        .expect("cluster_statuses")
        .iter()
        .filter_map(|c| c["name"].as_str())
        .collect();
    assert_eq!(names, [pool[0].as_str()], "{path}");
    let reloads = fleet
        .envoy
        .stat("extension_config_discovery.http_filter.kvroute.config_reload");
    assert_eq!(reloads.await.unwrap_or_else(|e| panic!("{e}")), Some(1));

    warm_up(&fleet, 0..GROUPS).await;
    let mut homes = Vec::new();
    for g in 0..GROUPS {
        homes.push(served_by(&fleet, &fleet.chat(&ask(g, 0)).await));
    }
    let distinct: std::collections::HashSet<_> = homes.iter().collect();
    assert!(distinct.len() > 1, "every group on one backend: {homes:?}");
    for round in 1..4 {
        for (g, home) in homes.iter().enumerate() {
            // A client naming a replica is ignored: the strip filter runs first.
            let other = addrs[(home + 1) % addrs.len()].to_string();
            let reply = fleet
                .post(
                    "/v1/chat/completions",
                    // One conversation per group: 6 groups on 4 replicas split some groups'
                    // conversations between two homes.
                    ask(g, 0).to_string(),
                    &[
                        ("content-type", "application/json"),
                        ("x-gateway-destination-endpoint", other.as_str()),
                    ],
                )
                .await;
            assert_eq!(served_by(&fleet, &reply), *home, "group {g} round {round}");
        }
    }
    let routed = fleet
        .stat_sum_reaching(stat_names::ROUTED_PREFIX, (GROUPS * 4) as u64)
        .await;
    assert!(
        routed >= (GROUPS * 4) as u64,
        "only {routed} requests routed by kvroute"
    );
    assert_eq!(
        fleet.stat_sum(stat_names::FALLBACK_PREFIX).await,
        0,
        "{}",
        fleet.envoy.log_tail()
    );

    // A 500 from the first attempt is retried once, on another replica, never again: a prompt
    // every replica fails on reaches two of them, and the stamp the retry policy reads stays in
    // the gateway.
    let poison = "kvroute-test-poison-istio";
    for b in &fleet.backends {
        b.set_poison(Some((poison, 500)));
    }
    let before = received(&fleet);
    let resp = fleet
        .client
        .post(format!("{}/v1/chat/completions", fleet.envoy.url()))
        .header("content-type", "application/json")
        .body(chat_body(&system_prompt(0), poison, false).to_string())
        .send()
        .await
        .expect("the poisoned request is answered");
    assert_eq!(resp.status(), 500);
    assert!(!resp.headers().contains_key("x-kvroute-attempt"));
    let mut reached = reached_since(&fleet, &before);
    reached.dedup();
    assert_eq!(
        reached.len(),
        2,
        "reached {reached:?}: not two replicas, once each"
    );
    assert_eq!(reached_since(&fleet, &before).len(), 2);
}

/// `istio/precise` assembled the same way, over a simulated fleet that tokenizes with the
/// repository's BPE and publishes vLLM's KV events. The overlay's plugin configuration (its
/// `index_cluster`, its ChatML template) and the cluster it adds send a prompt an engine cached to
/// that engine. The overlay's indexer command line, given this gateway's admin in place of the
/// pod's 127.0.0.1:15000, finds every host of the Service's cluster there and subscribes to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_precise_gateway_sends_a_cached_prompt_to_its_engine_and_its_indexer_finds_the_hosts() {
    use common::precise::{body, eventually, health, keys_held, post, BpeFleet, IndexerProcess};
    let docs = istio::rendered("precise");
    let fleet = BpeFleet::start(3, "istio-precise").await;
    let indexer = kvroute_indexer::start(fleet.indexer_config())
        .await
        .expect("indexer starts");
    let url = format!("http://{}", indexer.addr);
    fleet.until_heard(std::slice::from_ref(&url)).await;
    let addrs = fleet.backends();
    let envoy = Envoy::start_with(
        |admin, listener, dir| -> Result<String, HarnessError> {
            let config = gateway(
                &docs,
                &addrs,
                (admin, listener),
                dir,
                false,
                Some(indexer.addr),
            );
            Ok(config.to_string())
        },
        EnvoyOptions {
            wait_healthy: false,
            ..EnvoyOptions::default()
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    envoy
        .wait_for_stat(
            Gauge::EndpointsKnown.name(),
            |v| v == addrs.len() as u64,
            std::time::Duration::from_secs(30),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    common::wait_for_fresh_poll_of(&envoy).await;

    let r = &fleet.sim.replicas[2];
    let cached = r.addr.to_string();
    post(&format!("{}/v1/chat/completions", r.url()), &body("depot")).await;
    let indexed = || async { keys_held(&url, &cached).await >= 2 };
    eventually("the indexer holds the prompt", indexed).await;
    common::index_applied(&envoy, 3).await;
    assert_eq!(
        common::decided(&envoy, &body("depot")).await,
        ("engine".to_string(), cached)
    );

    // The pod's command line, with this machine's admin, tokenizer and a free port.
    let args: Vec<String> = istio::indexer_args(&docs)
        .into_iter()
        .map(|a| match a.split_once('=') {
            Some(("--envoy-admin", at)) => {
                assert_eq!(
                    at, "http://127.0.0.1:15000",
                    "the gateway's admin in the pod"
                );
                format!("--envoy-admin={}", envoy.admin_url())
            }
            Some(("--tokenizer", _)) => format!("--tokenizer={}", fleet.tokenizer.display()),
            Some(("--listen", _)) => "--listen=127.0.0.1:0".into(),
            _ => a,
        })
        .collect();
    let discovering = IndexerProcess::with_args(&args).await;
    let mut want: Vec<String> = addrs.iter().map(SocketAddr::to_string).collect();
    want.sort();
    eventually(
        "the indexer subscribes to every host of the Service",
        || async {
            let health = health(&discovering.url()).await;
            let mut found: Vec<String> = health["streams"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|s| s["endpoint"].as_str().map(str::to_string))
                .collect();
            found.sort();
            found == want
        },
    )
    .await;
}
