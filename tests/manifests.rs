//! The shipped Envoy and Istio configurations carry a kvroute config the filter accepts, and the
//! Envoy settings kvroute depends on (header stop-iteration, override_host on the same header,
//! an admin cluster under the configured name). The Istio manifests, rendered by kustomize as a
//! user applies them, take every name from one file and pass Istio's own schemas (and Kubernetes',
//! Gateway API's and the InferencePool's); the inference-pool overlay's kvroute-epp serves the pool
//! that names it, with no more rights than it needs.

use crate::common::istio;

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

/// The settings kvroute depends on, in any configuration: the routing header that override_host
/// reads is kvroute's, and a client-sent one is removed first.
fn check_routing_header(docs: &[Value], config: &Config, what: &str) {
    let all = mappings(docs);
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
        "{what}: override_host reads kvroute's header"
    );
    assert!(
        all.iter()
            .any(|m| get(m, "remove") == Some(&Value::from(config.header.as_str()))),
        "{what}: client-sent routing headers are removed before kvroute runs"
    );
}

#[test]
fn the_envoy_bootstrap_is_consistent_with_kvroute() {
    let path = "envoy/kvroute.yaml";
    let docs = documents(path);
    let (plugin, config) = plugin(&docs);
    assert_eq!(
        get(plugin, "allow_on_headers_stop_iteration"),
        Some(&Value::from(true)),
        "{path}: body routing needs allow_on_headers_stop_iteration"
    );
    check_routing_header(&docs, &config, path);
    let admin = config.admin_cluster.as_deref().expect("admin_cluster set");
    assert!(
        mappings(&docs)
            .iter()
            .any(|m| get(m, "name") == Some(&Value::from(admin))
                && get(m, "load_assignment").is_some()),
        "{path}: a cluster named {admin} exists"
    );
}

/// The configuration string of the kvroute Wasm filter in an Envoy bootstrap.
fn plugin_value(bootstrap: &mut Value) -> &mut Value {
    let hcm = &mut bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0];
    let filters = hcm["typed_config"]["http_filters"]
        .as_sequence_mut()
        .expect("http_filters");
    let wasm = filters
        .iter_mut()
        .find(|f| f["name"] == "envoy.filters.http.wasm")
        .expect("the Wasm filter");
    &mut wasm["typed_config"]["config"]["configuration"]["value"]
}

fn plugin_json(bootstrap: &mut Value) -> serde_json::Value {
    let text = plugin_value(bootstrap).as_str().expect("a StringValue");
    serde_json::from_str(text).expect("the plugin configuration is JSON")
}

/// The precise config's JSON is the shipped one's plus precise mode's own fields; everything else
/// in the two files is the same, so envoy/kvroute.yaml stays the one source of every other setting.
#[test]
fn the_precise_envoy_bootstrap_is_the_shipped_one_plus_the_indexer() {
    let (shipped_path, precise_path) = ("envoy/kvroute.yaml", "envoy/kvroute-precise.yaml");
    let mut shipped = documents(shipped_path).remove(0);
    let mut precise = documents(precise_path).remove(0);
    let docs = [precise.clone()];
    let (_, config) = plugin(&docs);
    check_routing_header(&docs, &config, precise_path);
    assert!(
        config.templates.for_model("any model").is_some(),
        "{precise_path}: a chat_template for every model"
    );
    let index = config.index_cluster.clone().expect("index_cluster set");
    let indexer = mappings(&docs)
        .into_iter()
        .find(|m| get(m, "name") == Some(&Value::from(index.as_str())))
        .and_then(|m| get(m, "load_assignment"))
        .unwrap_or_else(|| panic!("{precise_path}: a cluster named {index}"))
        .clone();
    let address = &indexer["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"];
    assert_eq!(
        address["socket_address"]["port_value"],
        Value::from(9400),
        "kvroute-indexer's default --listen port"
    );

    let base = plugin_json(&mut shipped);
    let mut json = plugin_json(&mut precise);
    let own = json.as_object_mut().expect("an object");
    let mut added: Vec<String> = own
        .keys()
        .filter(|k| base.get(*k).is_none())
        .cloned()
        .collect();
    added.sort();
    assert_eq!(
        added,
        ["chat_template", "index_cluster"],
        "precise mode's own fields"
    );
    own.remove("chat_template");
    own.remove("index_cluster");
    assert_eq!(json, base, "every other field as shipped");

    // With the shipped configuration string in place of its own, the file is the shipped one.
    *plugin_value(&mut precise) = plugin_value(&mut shipped).clone();
    assert!(
        precise == shipped,
        "{precise_path} differs from {shipped_path} outside the plugin configuration"
    );
}

/// `values.yaml`, the one file a user edits.
fn values() -> Value {
    documents("istio/values/values.yaml").remove(0)
}

/// Istio's name for the Service's cluster, from values.yaml.
fn cluster_from(values: &Value) -> String {
    let v = |k: &str| match &values[k] {
        Value::Number(n) => n.to_string(),
        other => other.as_str().expect(k).to_string(),
    };
    format!(
        "outbound|{}||{}.{}.svc.cluster.local",
        v("port"),
        v("service"),
        v("namespace")
    )
}

#[test]
fn the_body_routing_envoy_filter_is_consistent_with_kvroute() {
    let docs = istio::rendered("body-routing");
    let values = values();
    let pool = istio::pool_cluster(&docs);
    assert_eq!(pool, cluster_from(&values));
    let ecds = &istio::patch(&docs, "kvroute", "EXTENSION_CONFIG", "kvroute")["patch"]["value"];
    let plugin = &ecds["typed_config"]["config"];
    assert_eq!(plugin["allow_on_headers_stop_iteration"], Value::from(true));
    assert_eq!(plugin["failure_policy"], "FAIL_RELOAD");
    let json = plugin["configuration"]["value"]
        .as_str()
        .expect("a StringValue");
    let config = Config::parse(json.as_bytes()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        config.clusters,
        vec![pool.clone()],
        "the poll keeps the pool"
    );
    assert_eq!(
        config.engine_metrics_cluster.as_deref(),
        Some(pool.as_str())
    );
    // Istio's bootstrap has it, pointing at the admin port: no cluster of our own.
    assert_eq!(config.admin_cluster.as_deref(), Some("prometheus_stats"));
    let remote = &plugin["vm_config"]["code"]["remote"];
    assert_eq!(remote["http_uri"]["uri"], values["image"]);
    assert!(values["image"].as_str().unwrap().starts_with("oci://"));
    assert_eq!(remote["sha256"], values["sha256"]);
    let filter = &istio::patch(&docs, "kvroute", "HTTP_FILTER", "kvroute")["patch"];
    assert_eq!(filter["operation"], "INSERT_BEFORE");
    assert_eq!(
        filter["value"]["config_discovery"]["type_urls"][0],
        plugin_type_url(ecds)
    );
    check_routing_header(&docs, &config, "istio/body-routing");
}

fn plugin_type_url(ecds: &Value) -> Value {
    ecds["typed_config"]["@type"].clone()
}

#[test]
fn the_header_routing_wasm_plugin_is_consistent_with_kvroute() {
    let docs = istio::rendered("header-routing");
    let values = values();
    let pool = istio::pool_cluster(&docs);
    let spec = &istio::object(&docs, "WasmPlugin", "kvroute")["spec"];
    assert_eq!(spec["url"], values["image"]);
    assert_eq!(spec["sha256"], values["sha256"]);
    assert_eq!(spec["failStrategy"], "FAIL_RELOAD");
    let json = serde_json::to_vec(&spec["pluginConfig"]).expect("pluginConfig as JSON");
    let config = Config::parse(&json).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(config.clusters, vec![pool.clone()]);
    assert_eq!(
        config.engine_metrics_cluster.as_deref(),
        Some(pool.as_str())
    );
    assert_eq!(config.admin_cluster.as_deref(), Some("prometheus_stats"));
    check_routing_header(&docs, &config, "istio/header-routing");
    assert!(
        docs.iter()
            .all(|d| d["metadata"]["name"] != "kvroute" || d["kind"] == "WasmPlugin"),
        "header routing has no body-routing EnvoyFilter"
    );
}

#[test]
fn the_precise_overlay_runs_the_indexer_in_the_gateway_pod_and_points_kvroute_at_it() {
    use clap::Parser;
    use istio::{container, env};
    let docs = istio::rendered("precise");
    let body = istio::rendered("body-routing");
    let values = values();
    let pool = istio::pool_cluster(&docs);
    let json = |docs: &[Value]| -> serde_json::Value {
        let ecds = &istio::patch(docs, "kvroute", "EXTENSION_CONFIG", "kvroute")["patch"]["value"];
        let text = ecds["typed_config"]["config"]["configuration"]["value"].as_str();
        serde_json::from_str(text.expect("a StringValue")).expect("JSON")
    };

    // The plugin: body-routing's configuration plus the indexer's cluster and the chat template.
    let mut config = json(&docs);
    let text = config.to_string();
    let parsed = Config::parse(text.as_bytes()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(parsed.clusters, vec![pool.clone()]);
    assert!(
        parsed.templates.for_model("any").is_some(),
        "a chat_template"
    );
    let index = parsed.index_cluster.clone().expect("index_cluster");
    let own = config.as_object_mut().expect("an object");
    assert!(own.remove("chat_template").is_some() && own.remove("index_cluster").is_some());
    assert_eq!(config, json(&body), "every other field as in body-routing");
    check_routing_header(&docs, &parsed, "istio/precise");

    // The cluster it names: the indexer's address in the pod.
    let cluster = &istio::patch(&docs, "kvroute-indexer", "CLUSTER", "")["patch"];
    assert_eq!(cluster["operation"], "ADD");
    assert_eq!(cluster["value"]["name"], Value::from(index.as_str()));
    let at = &cluster["value"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0];
    let at = &at["endpoint"]["address"]["socket_address"];
    let indexer_at = format!(
        "{}:{}",
        at["address"].as_str().unwrap(),
        at["port_value"].as_u64().unwrap()
    );

    // The gateway's pods are the ones every EnvoyFilter and the Gateway select.
    let pod = &istio::object(&docs, "Deployment", "istio-ingressgateway")["spec"]["template"];
    for ef in docs.iter().filter(|d| d["kind"] == "EnvoyFilter") {
        for (k, v) in ef["spec"]["workloadSelector"]["labels"]
            .as_mapping()
            .expect("labels")
        {
            assert_eq!(
                &pod["metadata"]["labels"][k], v,
                "{:?}",
                ef["metadata"]["name"]
            );
        }
    }
    let gateway = istio::object(&docs, "Gateway", "llm-gateway");
    for (k, v) in gateway["spec"]["selector"].as_mapping().expect("selector") {
        assert_eq!(&pod["metadata"]["labels"][k], v);
    }
    assert_eq!(
        pod["metadata"]["annotations"]["inject.istio.io/templates"],
        "gateway"
    );
    let proxy = container(&docs, "containers", "istio-proxy");
    assert_eq!(proxy["image"], "auto", "istiod injects the gateway's Envoy");

    // The indexer's command line, as Kubernetes expands it, is one it accepts: it listens where
    // the cluster points, reads the gateway's own admin for the Service's hosts, keys for the
    // served model and reads the tokenizer the init container fetched.
    let indexer = container(&docs, "containers", "kvroute-indexer");
    assert_eq!(indexer["image"], values["indexer_image"]);
    let args = istio::indexer_args(&docs);
    assert!(args.iter().all(|a| !a.contains("$(")), "{args:?}");
    let command = std::iter::once("kvroute-indexer".to_string()).chain(args.clone());
    let parsed = kvroute_indexer::config::Config::try_parse_from(command)
        .unwrap_or_else(|e| panic!("{args:?}: {e}"));
    assert_eq!(parsed.listen.to_string(), indexer_at);
    assert_eq!(
        parsed.discovery.envoy_admin.as_deref(),
        Some("http://127.0.0.1:15000"),
        "Istio's admin port"
    );
    assert_eq!(parsed.discovery.cluster.as_deref(), Some(pool.as_str()));
    assert_eq!(Some(parsed.events.model.as_str()), values["model"].as_str());
    assert_eq!(
        Some(u64::from(parsed.discovery.kv_events_port.expect("a port"))),
        values["kv_events_port"].as_u64()
    );
    assert_eq!(
        Some(parsed.events.topic.as_str()),
        values["kv_events_topic"].as_str()
    );
    // Every engine's replay socket: an idle engine is probed there after the default silence
    // and stays fresh while it answers (without one it would be stale after 30 s).
    let replay_port = parsed.discovery.replay_port.expect("a replay port");
    assert_eq!(
        Some(u64::from(replay_port)),
        values["kv_events_replay_port"].as_u64()
    );
    assert_ne!(Some(replay_port), parsed.discovery.kv_events_port);
    assert!(
        args.iter().all(|a| !a.starts_with("--stale-after")),
        "the default silence: {args:?}"
    );
    assert_eq!(parsed.chunk_size, 512, "the filter's default chunk_size");
    let fetch = container(&docs, "initContainers", "tokenizer");
    assert_eq!(
        Some(env(fetch, "TOKENIZER_URL")),
        values["tokenizer_url"].as_str()
    );
    let fetched = fetch["args"].as_sequence().expect("args");
    let out = fetched.iter().position(|a| a == "-o").expect("curl -o");
    assert_eq!(fetched[out + 1].as_str(), parsed.events.tokenizer.to_str());
    let mount = |c: &Value| {
        c["volumeMounts"][0]["mountPath"]
            .as_str()
            .map(str::to_string)
    };
    assert_eq!(mount(indexer), mount(fetch));
    assert!(parsed
        .events
        .tokenizer
        .starts_with(mount(indexer).expect("a mount")));
}

/// The item of `list` (containers, ports, volumes) whose `name` is `name`.
fn named<'a>(list: &'a Value, name: &str) -> &'a Value {
    list.as_sequence()
        .and_then(|l| l.iter().find(|item| item["name"] == name))
        .unwrap_or_else(|| panic!("nothing named {name} in {list:?}"))
}

/// kvroute-epp's `--flag=value` arguments in the inference-pool overlay, by flag.
fn epp_args(docs: &[Value]) -> std::collections::BTreeMap<String, String> {
    let pod = &istio::object(docs, "Deployment", "kvroute-epp")["spec"]["template"]["spec"];
    named(&pod["containers"], "kvroute-epp")["args"]
        .as_sequence()
        .expect("args")
        .iter()
        .map(|a| {
            let a = a.as_str().expect("a string");
            let (flag, value) = a
                .split_once('=')
                .unwrap_or_else(|| panic!("{a}: --flag=value"));
            (flag.to_string(), value.to_string())
        })
        .collect()
}

#[test]
fn the_inference_pool_asks_kvroute_epp_which_watches_that_pool() {
    let docs = istio::rendered("inference-pool");
    let values = values();
    let pool = istio::object(&docs, "InferencePool", values["service"].as_str().unwrap());
    let namespace = &values["namespace"];
    assert!(
        docs.iter()
            .all(|d| &d["metadata"]["namespace"] == namespace),
        "every object in values.yaml's namespace"
    );

    // The pool: the engines' pods on their port, kvroute-epp as its picker, failing open.
    let spec = &pool["spec"];
    assert_eq!(spec["selector"]["matchLabels"], values["pod_selector"]);
    assert_eq!(spec["targetPorts"][0]["number"], values["port"]);
    assert_eq!(spec["targetPorts"].as_sequence().map(Vec::len), Some(1));
    let picker = &spec["endpointPickerRef"];
    assert_eq!(
        picker["failureMode"], "FailOpen",
        "no picker: served anyway"
    );
    assert!(picker["kind"].is_null() || picker["kind"] == "Service");
    let service = istio::object(&docs, "Service", picker["name"].as_str().unwrap());
    let grpc = named(&service["spec"]["ports"], "grpc-ext-proc");
    assert_eq!(picker["port"]["number"], grpc["port"]);
    assert_eq!(grpc["appProtocol"], "kubernetes.io/h2c");
    let grpc_target = grpc["targetPort"].as_u64().expect("a port number");

    // The picker reads that pool in that namespace and listens where the Service sends.
    let args = epp_args(&docs);
    for flag in [
        "--inference-pool",
        "--namespace",
        "--listen",
        "--metrics",
        "--config",
    ] {
        assert!(args.contains_key(flag), "{flag} in {args:?}");
    }
    assert_eq!(
        Some(args["--inference-pool"].as_str()),
        pool["metadata"]["name"].as_str()
    );
    assert_eq!(Some(args["--namespace"].as_str()), namespace.as_str());
    let listen: std::net::SocketAddr = args["--listen"].parse().expect("--listen ip:port");
    let metrics: std::net::SocketAddr = args["--metrics"].parse().expect("--metrics ip:port");
    assert!(listen.ip().is_unspecified() && metrics.ip().is_unspecified());
    assert_eq!(u64::from(listen.port()), grpc_target);
    let metrics_port = &named(&service["spec"]["ports"], "http-metrics")["targetPort"];
    assert_eq!(Some(u64::from(metrics.port())), metrics_port.as_u64());
    let deployment = istio::object(&docs, "Deployment", "kvroute-epp");
    let template = &deployment["spec"]["template"];
    for (k, v) in service["spec"]["selector"].as_mapping().expect("selector") {
        assert_eq!(
            &template["metadata"]["labels"][k], v,
            "the Service selects the picker"
        );
    }
    let epp = named(&template["spec"]["containers"], "kvroute-epp");
    assert_eq!(epp["image"], values["epp_image"]);
    // gRPC health on the ext_proc port, under the names kvroute-epp serves.
    for (probe, name) in [
        ("readinessProbe", "readiness"),
        ("livenessProbe", "liveness"),
    ] {
        assert_eq!(
            epp[probe]["grpc"]["port"].as_u64(),
            Some(grpc_target),
            "{probe}"
        );
        assert_eq!(epp[probe]["grpc"]["service"], name, "{probe}");
    }
    let pod_security = &template["spec"]["securityContext"];
    assert_eq!(pod_security["runAsNonRoot"], true);
    assert_eq!(epp["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(epp["securityContext"]["allowPrivilegeEscalation"], false);

    // --config is the ConfigMap's file, mounted, and kvroute accepts it.
    let config = std::path::Path::new(&args["--config"]);
    let mount = &epp["volumeMounts"][0];
    assert_eq!(
        config.parent().and_then(|p| p.to_str()),
        mount["mountPath"].as_str()
    );
    let volume = named(
        &template["spec"]["volumes"],
        mount["name"].as_str().unwrap(),
    );
    let map = istio::object(
        &docs,
        "ConfigMap",
        volume["configMap"]["name"].as_str().unwrap(),
    );
    let file = config.file_name().and_then(|f| f.to_str()).unwrap();
    let json = map["data"][file]
        .as_str()
        .expect("the config file in the ConfigMap");
    let parsed = Config::parse(json.as_bytes()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        parsed.header, "x-gateway-destination-endpoint",
        "the endpoint picker protocol's header"
    );

    // The Gateway API route: the Gateway's traffic goes to the pool.
    let gateway = istio::object(&docs, "Gateway", "inference-gateway");
    assert_eq!(gateway["apiVersion"], "gateway.networking.k8s.io/v1");
    assert_eq!(gateway["spec"]["gatewayClassName"], "istio");
    let route = &istio::object(&docs, "HTTPRoute", "inference-route")["spec"];
    assert_eq!(route["parentRefs"][0]["name"], gateway["metadata"]["name"]);
    let backend = &route["rules"][0]["backendRefs"][0];
    assert_eq!(backend["group"], "inference.networking.k8s.io");
    assert_eq!(backend["kind"], "InferencePool");
    assert_eq!(backend["name"], pool["metadata"]["name"]);
}

#[test]
fn kvroute_epp_may_read_inference_pools_and_watch_pods_in_its_namespace_and_nothing_else() {
    let docs = istio::rendered("inference-pool");
    let role = istio::object(&docs, "Role", "kvroute-epp");
    let strings = |v: &Value| -> Vec<String> {
        v.as_sequence()
            .expect("a list")
            .iter()
            .map(|s| s.as_str().expect("a string").to_string())
            .collect()
    };
    let mut granted: Vec<(String, String, Vec<String>)> = Vec::new();
    for rule in role["rules"].as_sequence().expect("rules") {
        let keys: Vec<&str> = rule
            .as_mapping()
            .expect("a rule")
            .keys()
            .filter_map(Value::as_str)
            .collect();
        assert!(
            keys.iter()
                .all(|k| ["apiGroups", "resources", "verbs"].contains(k)),
            "no resourceNames or nonResourceURLs: {keys:?}"
        );
        for group in strings(&rule["apiGroups"]) {
            for resource in strings(&rule["resources"]) {
                let mut verbs = strings(&rule["verbs"]);
                verbs.sort();
                granted.push((group.clone(), resource, verbs));
            }
        }
    }
    granted.sort();
    let verbs = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(
        granted,
        vec![
            ("".into(), "pods".into(), verbs(&["list", "watch"])),
            (
                "inference.networking.k8s.io".into(),
                "inferencepools".into(),
                verbs(&["get", "list", "watch"])
            ),
        ]
    );
    assert!(
        docs.iter()
            .all(|d| d["kind"] != "ClusterRole" && d["kind"] != "ClusterRoleBinding"),
        "no rights outside the namespace"
    );

    // Bound to the picker's own ServiceAccount, in the pool's namespace.
    let binding = istio::object(&docs, "RoleBinding", "kvroute-epp");
    assert_eq!(binding["roleRef"]["kind"], "Role");
    assert_eq!(binding["roleRef"]["name"], role["metadata"]["name"]);
    let pod = &istio::object(&docs, "Deployment", "kvroute-epp")["spec"]["template"]["spec"];
    let account = pod["serviceAccountName"]
        .as_str()
        .expect("a ServiceAccount");
    istio::object(&docs, "ServiceAccount", account);
    let subjects = binding["subjects"].as_sequence().expect("subjects");
    assert_eq!(subjects.len(), 1);
    assert_eq!(subjects[0]["kind"], "ServiceAccount");
    assert_eq!(subjects[0]["name"], account);
    assert_eq!(subjects[0]["namespace"], role["metadata"]["namespace"]);
}

/// Copies `from` to `to`, recursively.
fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for entry in std::fs::read_dir(from).expect("read_dir") {
        let entry = entry.expect("entry");
        let target = to.join(entry.file_name());
        if entry.file_type().expect("type").is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).expect("copy");
        }
    }
}

#[test]
fn values_yaml_sets_every_name_in_one_place() {
    let dir = std::env::temp_dir().join(format!("kvroute-istio-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    copy_dir(&root().join("istio"), &dir);
    let path = dir.join("values/values.yaml");
    let text = std::fs::read_to_string(&path).expect("values.yaml");
    let digest = "ab".repeat(32);
    let changed: String = text
        .lines()
        .map(|l| match l.split_once(':').map(|(k, _)| k) {
            Some("service") => "service: qwen".to_string(),
            Some("namespace") => "namespace: serving".to_string(),
            Some("port") => "port: 8081".to_string(),
            Some("image") => "image: oci://r.example/team/kvroute:v9".to_string(),
            Some("sha256") => format!("sha256: \"{digest}\""),
            Some("indexer_image") => "indexer_image: r.example/team/kvroute-indexer:v9".to_string(),
            Some("model") => "model: meta-llama/Llama-3.1-8B-Instruct".to_string(),
            Some("tokenizer_url") => {
                "tokenizer_url: https://models.example/llama/tokenizer.json".to_string()
            }
            Some("kv_events_port") => "kv_events_port: 6001".to_string(),
            Some("kv_events_topic") => "kv_events_topic: llama-events".to_string(),
            Some("kv_events_replay_port") => "kv_events_replay_port: 6002".to_string(),
            Some("epp_image") => "epp_image: r.example/team/kvroute-epp:v9".to_string(),
            // pod_selector's one label, replaced by two.
            Some("  app") => "  app.kubernetes.io/name: qwen\n  tier: gpu".to_string(),
            _ => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n");
    std::fs::write(&path, changed).expect("write values.yaml");
    let pool = "outbound|8081||qwen.serving.svc.cluster.local";
    for variant in ["body-routing", "header-routing", "precise"] {
        let text = istio::kustomize(&dir.join(variant));
        let precise_names = ["Qwen", "huggingface.co", "5557", "value: kv-events", "5558"];
        let old_names = ["vllm.llm.svc", "|8000|", "registry.example", "00000000"];
        let olds = old_names.iter().chain(if variant == "precise" {
            &precise_names[..]
        } else {
            &[]
        });
        for old in olds {
            assert!(
                !text.contains(old),
                "{variant}: {old} left after changing values.yaml"
            );
        }
        // The cluster patch, `clusters`, `engine_metrics_cluster`, and the indexer's `--cluster`.
        let pools = if variant == "precise" { 4 } else { 3 };
        assert_eq!(
            text.matches(pool).count(),
            pools,
            "{variant}: every place the cluster is named"
        );
        if variant == "precise" {
            for new in [
                "r.example/team/kvroute-indexer:v9",
                "meta-llama/Llama-3.1-8B-Instruct",
                "https://models.example/llama/tokenizer.json",
                "value: \"6001\"",
                "value: llama-events",
                "value: \"6002\"",
            ] {
                assert_eq!(text.matches(new).count(), 1, "{variant}: {new}");
            }
        }
        assert_eq!(text.matches(&digest).count(), 1, "{variant}");
        assert_eq!(text.matches("oci://r.example/team/kvroute:v9").count(), 1);
        let docs = istio::documents(&text);
        assert_eq!(istio::pool_cluster(&docs), pool);
        let vs = istio::object(&docs, "VirtualService", "vllm");
        let dest = &vs["spec"]["http"][0]["route"][0]["destination"];
        assert_eq!(dest["host"], Value::from("qwen.serving.svc.cluster.local"));
        assert_eq!(dest["port"]["number"], Value::from(8081));
        assert_eq!(vs["metadata"]["namespace"], "serving");
        let gw = istio::object(&docs, "Gateway", "llm-gateway");
        assert_eq!(gw["metadata"]["namespace"], "serving");
        assert!(
            istio::validate(&text).0,
            "{variant} with other names is still valid"
        );
    }

    let text = istio::kustomize(&dir.join("inference-pool"));
    for old in ["vllm", "namespace: llm", "8000", "registry.example"] {
        assert!(
            !text.contains(old),
            "inference-pool: {old} left after changing values.yaml"
        );
    }
    let docs = istio::documents(&text);
    assert!(docs.iter().all(|d| d["metadata"]["namespace"] == "serving"));
    let pool = &istio::object(&docs, "InferencePool", "qwen")["spec"];
    assert_eq!(pool["targetPorts"][0]["number"], Value::from(8081));
    let labels: Value = serde_yaml::from_str("{app.kubernetes.io/name: qwen, tier: gpu}").unwrap();
    assert_eq!(pool["selector"]["matchLabels"], labels);
    let route = &istio::object(&docs, "HTTPRoute", "inference-route")["spec"];
    assert_eq!(route["rules"][0]["backendRefs"][0]["name"], "qwen");
    let binding = istio::object(&docs, "RoleBinding", "kvroute-epp");
    assert_eq!(binding["subjects"][0]["namespace"], "serving");
    let args = epp_args(&docs);
    assert_eq!(args["--inference-pool"], "qwen");
    assert_eq!(args["--namespace"], "serving");
    assert_eq!(
        text.matches("image: r.example/team/kvroute-epp:v9").count(),
        1
    );
    assert!(
        istio::validate(&text).0,
        "inference-pool with other names is still valid"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Applies `change` to a copy of `docs` and renders it back to YAML.
fn mutated(docs: &[Value], change: impl Fn(&mut Vec<Value>)) -> String {
    let mut docs = docs.to_vec();
    change(&mut docs);
    docs.iter()
        .map(|d| serde_yaml::to_string(d).expect("YAML"))
        .collect::<Vec<_>>()
        .join("---\n")
}

fn at<'a>(docs: &'a mut [Value], kind: &str) -> &'a mut serde_yaml::Mapping {
    docs.iter_mut()
        .find(|d| d["kind"] == kind)
        .and_then(Value::as_mapping_mut)
        .unwrap_or_else(|| panic!("a {kind}"))
}

fn map<'a>(v: &'a mut Value, path: &[&str]) -> &'a mut serde_yaml::Mapping {
    let mut v = v;
    for key in path {
        v = match key.parse::<usize>() {
            Ok(i) => &mut v[i],
            Err(_) => &mut v[*key],
        };
    }
    v.as_mapping_mut()
        .unwrap_or_else(|| panic!("a mapping at {path:?}"))
}

#[test]
fn every_istio_object_passes_istio_schemas_and_unknown_fields_are_rejected() {
    // (what, YAML, whether valid, what the output must name)
    let mut cases: Vec<(String, String, bool, &str)> = Vec::new();
    for variant in [
        "body-routing",
        "header-routing",
        "precise",
        "inference-pool",
    ] {
        let docs = istio::rendered(variant);
        cases.push((
            variant.into(),
            mutated(&docs, |_| {}),
            true,
            " valid, 0 invalid",
        ));
        // The validator can fail: an unknown field in any object's spec is an error.
        for (i, doc) in docs.iter().enumerate() {
            let kind = doc["kind"].as_str().unwrap_or_default();
            // A ServiceAccount, ConfigMap, Role or RoleBinding has no spec: at its top level.
            let at: &[&str] = if doc["spec"].is_null() {
                &[]
            } else {
                &["spec"]
            };
            let bad = mutated(&docs, |d| {
                map(&mut d[i], at).insert("replicaz".into(), 1.into());
            });
            cases.push((
                format!("{variant} {kind}.{}replicaz", at.join(".")),
                bad,
                false,
                "replicaz",
            ));
        }
    }
    let body = istio::rendered("body-routing");
    let header = istio::rendered("header-routing");
    let mut wrong: Vec<(&str, String, &str)> = vec![
        (
            "a misspelt key deep in an EnvoyFilter match",
            mutated(&body, |d| {
                let ef = d
                    .iter_mut()
                    .find(|x| x["metadata"]["name"] == "kvroute-cluster")
                    .unwrap();
                let cluster_patch = &mut ef["spec"]["configPatches"][1];
                assert_eq!(cluster_patch["applyTo"], "CLUSTER");
                map(cluster_patch, &["match", "cluster"]).insert("nmae".into(), "x".into());
            }),
            "nmae",
        ),
        (
            "a snake_case spelling of a camelCase field",
            mutated(&header, |d| {
                let spec = at(d, "WasmPlugin").get_mut("spec").unwrap();
                let spec = spec.as_mapping_mut().unwrap();
                let v = spec.remove("failStrategy").unwrap();
                spec.insert("fail_strategy".into(), v);
            }),
            "fail_strategy",
        ),
        (
            "a value outside an enum",
            mutated(&header, |d| {
                let spec = at(d, "WasmPlugin").get_mut("spec").unwrap();
                spec["failStrategy"] = "FAIL_SOMETIMES".into();
            }),
            "failStrategy",
        ),
        (
            "a port number as a string",
            mutated(&body, |d| {
                let vs = d
                    .iter_mut()
                    .find(|x| x["kind"] == "VirtualService")
                    .unwrap();
                vs["spec"]["http"][0]["route"][0]["destination"]["port"]["number"] = "8000".into();
            }),
            "number",
        ),
        (
            "a digest that is not one",
            mutated(&header, |d| {
                let spec = at(d, "WasmPlugin").get_mut("spec").unwrap();
                spec["sha256"] = "sha256:abc".into();
            }),
            "sha256",
        ),
    ];
    // The InferencePool's own rules.
    let pool_docs = istio::rendered("inference-pool");
    let pool = |change: &dyn Fn(&mut serde_yaml::Mapping)| {
        mutated(&pool_docs, |d| {
            let spec = at(d, "InferencePool").get_mut("spec").unwrap();
            change(spec.as_mapping_mut().unwrap());
        })
    };
    let ports = |numbers: &[u64]| -> Value {
        let ports: Vec<Value> = numbers
            .iter()
            .map(|n| serde_yaml::from_str(&format!("{{number: {n}}}")).unwrap())
            .collect();
        Value::Sequence(ports)
    };
    fn picker(spec: &mut serde_yaml::Mapping) -> &mut serde_yaml::Mapping {
        spec.get_mut("endpointPickerRef")
            .and_then(Value::as_mapping_mut)
            .expect("endpointPickerRef")
    }
    wrong.extend([
        (
            "an InferencePool failureMode outside the enum",
            pool(&|spec| {
                picker(spec).insert("failureMode".into(), "FailSometimes".into());
            }),
            "failureMode",
        ),
        (
            "nine target ports (at most eight)",
            pool(&|spec| {
                let nine: Vec<u64> = (8000..8009).collect();
                spec.insert("targetPorts".into(), ports(&nine));
            }),
            "at most 8 items",
        ),
        (
            "a target port number twice",
            pool(&|spec| {
                spec.insert("targetPorts".into(), ports(&[8000, 8001, 8000]));
            }),
            "port number must be unique",
        ),
        (
            "a picker Service without its port",
            pool(&|spec| {
                let picker = picker(spec);
                picker.insert("kind".into(), "Service".into());
                picker.remove("port");
            }),
            "port is required",
        ),
    ]);
    cases.extend(
        wrong
            .into_iter()
            .map(|(what, yaml, field)| (what.to_string(), yaml, false, field)),
    );
    let texts: Vec<String> = cases.iter().map(|c| c.1.clone()).collect();
    let results = istio::validate_each(&texts);
    for ((what, _, valid, named), (ok, out)) in cases.iter().zip(results) {
        assert_eq!(ok, *valid, "{what}: {out}");
        assert!(
            out.contains(named),
            "{what}: the output does not name {named}: {out}"
        );
    }
}
