//! Endpoints from an InferencePool's pods, through a Kubernetes API server on 127.0.0.1 that
//! lists and watches as the real one does: ready pods become members at every target port, a pod
//! that turns unready or is deleted leaves, the label selector is sent (a pod it does not match
//! is never a member), a changed InferencePool takes effect, and the picker started with
//! `--inference-pool` is ready only once the pods are listed and picks only members.
//!
//! The pods' addresses are data only: no call goes to them (the picker's config here polls no
//! engine metrics).

use crate::common;

use kvroute::gateway::stat_names::{Counter, Gauge};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use common::driven::{header_map, message, picked};
use common::kube_api::{inference_pool, pod, KubeApi, NAMESPACE, PODS, POOLS};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request::Request, HttpBody, HttpHeaders,
};
use kvroute::config::Config;
use kvroute::shared_keys;
use kvroute::store::SharedStore;
use kvroute_epp::pool_watch::{self, Source};
use kvroute_epp::settings::{Args, Settings};
use kvroute_epp::upstreams::Pool;
use kvroute_epp::Running;
use serde_json::Value;
use tokio_stream::wrappers::ReceiverStream;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

const POOL: &str = "vllm-llama";
const APP: (&str, &str) = ("app", "vllm-llama");
const OTHER: (&str, &str) = ("app", "other-model");

/// Starts the pool watch over `api`; it runs until the test ends.
fn watch(api: &KubeApi) -> Arc<Pool> {
    let pool = Arc::new(Pool::unlisted("inference_pool"));
    let client = kube::Client::try_from(api.config()).unwrap();
    let source = Source {
        namespace: NAMESPACE.into(),
        name: POOL.into(),
        api: None,
    };
    tokio::spawn(pool_watch::run(client, source, pool.clone()));
    pool
}

/// Waits until `ok()`, or fails after 10 s naming `what`.
async fn wait_for(what: &str, ok: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !ok() {
        assert!(Instant::now() < deadline, "{what} never happened");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until the pool's members are exactly `expected`.
async fn members_become(pool: &Pool, expected: &[&str]) {
    let expected: Vec<SocketAddr> = expected.iter().map(|a| a.parse().unwrap()).collect();
    let what = format!("members {expected:?} (they are {:?})", pool.members());
    wait_for(&what, || pool.members().as_ref() == Some(&expected)).await;
}

fn terminating(mut pod: Value) -> Value {
    pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z".into();
    pod
}

/// The query parameter `name` of each request to `path`.
fn sent(api: &KubeApi, path: &str, name: &str) -> Vec<Option<String>> {
    let requests = api.requests();
    let to_path = requests.iter().filter_map(|r| {
        let (p, query) = r.split_once('?').unwrap_or((r, ""));
        (p == path).then_some(query)
    });
    to_path
        .map(|query| {
            let mut pairs = url::form_urlencoded::parse(query.as_bytes()).into_owned();
            pairs.find(|(n, _)| n == name).map(|(_, v)| v)
        })
        .collect()
}

/// The InferencePool at port 8000 and its ready pods `a`, `b` and `c` (10.0.0.1 to 10.0.0.3).
fn a_b_c() -> Vec<Value> {
    vec![
        inference_pool(POOL, &[APP], &[8000]),
        pod("a", &[APP], Some("10.0.0.1"), true),
        pod("b", &[APP], Some("10.0.0.2"), true),
        pod("c", &[APP], Some("10.0.0.3"), true),
    ]
}

/// The pool's pod `ours` (10.0.0.1) beside another model's `theirs` (10.0.0.9), at port 8000,
/// watched until the pool shows `ours`.
async fn ours_and_theirs() -> (KubeApi, Arc<Pool>) {
    let api = KubeApi::start(
        vec![
            inference_pool(POOL, &[APP], &[8000]),
            pod("ours", &[APP], Some("10.0.0.1"), true),
            pod("theirs", &[OTHER], Some("10.0.0.9"), true),
        ],
        true,
    )
    .await;
    let pool = watch(&api);
    members_become(&pool, &["10.0.0.1:8000"]).await;
    (api, pool)
}

#[tokio::test]
async fn ready_pods_become_members_at_every_target_port() {
    let api = KubeApi::start(
        vec![
            inference_pool(POOL, &[APP], &[8000, 8001]),
            pod("ready-a", &[APP], Some("10.0.0.1"), true),
            pod("ready-b", &[APP], Some("10.0.0.2"), true),
            pod("unready", &[APP], Some("10.0.0.3"), false),
            pod("no-ip-yet", &[APP], None, true),
            terminating(pod("leaving", &[APP], Some("10.0.0.5"), true)),
        ],
        true,
    )
    .await;
    let pool = watch(&api);
    let listed = [
        "10.0.0.1:8000",
        "10.0.0.1:8001",
        "10.0.0.2:8000",
        "10.0.0.2:8001",
    ];
    members_become(&pool, &listed).await;
    api.put(pod("new", &[APP], Some("10.0.0.6"), false));
    api.bookmark();
    api.put(pod("new", &[APP], Some("10.0.0.6"), true));
    let with_new = [&listed[..], &["10.0.0.6:8000", "10.0.0.6:8001"]].concat();
    members_become(&pool, &with_new).await;
    api.put(pod("no-ip-yet", &[APP], Some("10.0.0.4"), true));
    let with_ip = [
        &with_new[..4],
        &["10.0.0.4:8000", "10.0.0.4:8001"],
        &with_new[4..],
    ]
    .concat();
    members_become(&pool, &with_ip).await;
}

#[tokio::test]
async fn a_pod_that_turns_unready_or_is_deleted_leaves() {
    let api = KubeApi::start(a_b_c(), true).await;
    let pool = watch(&api);
    members_become(&pool, &["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]).await;
    api.put(pod("a", &[APP], Some("10.0.0.1"), false));
    members_become(&pool, &["10.0.0.2:8000", "10.0.0.3:8000"]).await;
    api.delete("Pod", "b");
    members_become(&pool, &["10.0.0.3:8000"]).await;
    api.put(terminating(pod("c", &[APP], Some("10.0.0.3"), true)));
    members_become(&pool, &[]).await;
    api.delete("Pod", "c");
    api.put(pod("a", &[APP], Some("10.0.0.1"), true));
    members_become(&pool, &["10.0.0.1:8000"]).await;
    // Watched, not polled: one list, then every change through one watch.
    let watches = sent(&api, PODS, "watch");
    assert_eq!(watches, [None, Some("true".to_string())]);
}

#[tokio::test]
async fn a_pod_the_selector_does_not_match_is_never_a_member() {
    let (api, pool) = ours_and_theirs().await;
    api.put(pod("stranger", &[OTHER], Some("10.0.0.8"), true));
    api.put(pod("ours-2", &[APP], Some("10.0.0.2"), true));
    // The stranger came first: shown the second pod, the pool has been shown the stranger too.
    members_become(&pool, &["10.0.0.1:8000", "10.0.0.2:8000"]).await;
    api.put(pod("ours-2", &[OTHER], Some("10.0.0.2"), true));
    members_become(&pool, &["10.0.0.1:8000"]).await;

    let selectors = sent(&api, PODS, "labelSelector");
    let watches = sent(&api, PODS, "watch");
    assert!(watches.contains(&None), "no pod list");
    assert!(watches.contains(&Some("true".into())), "no pod watch");
    for selector in selectors {
        assert_eq!(selector.as_deref(), Some("app=vllm-llama"));
    }
    for selector in sent(&api, POOLS, "fieldSelector") {
        assert_eq!(selector.as_deref(), Some("metadata.name=vllm-llama"));
    }
}

#[tokio::test]
async fn a_changed_selector_or_target_ports_take_effect() {
    let (api, pool) = ours_and_theirs().await;
    api.put(inference_pool(POOL, &[APP], &[8000, 9000]));
    members_become(&pool, &["10.0.0.1:8000", "10.0.0.1:9000"]).await;
    api.put(inference_pool(POOL, &[OTHER], &[9000]));
    members_become(&pool, &["10.0.0.9:9000"]).await;
    assert!(
        sent(&api, PODS, "labelSelector").contains(&Some("app=other-model".into())),
        "the new selector was not sent"
    );
    api.delete("InferencePool", POOL);
    members_become(&pool, &[]).await;
}

/// The picker on the InferencePool `POOL` of `api`, with one worker: a request sent after a poll
/// is routed on that poll's snapshot.
async fn start_picker(api: &KubeApi) -> Running {
    let args = Args::parse_from([
        "kvroute-epp",
        "--listen",
        "127.0.0.1:0",
        "--inference-pool",
        POOL,
        "--namespace",
        NAMESPACE,
        "--workers",
        "1",
    ]);
    let json = r#"{"policy": "cache_aware", "clusters": ["inference_pool"],
        "admin_cluster": "kvroute_admin", "stats_interval_ms": 100}"#;
    let mut settings =
        Settings::with_config(args, Config::parse(json.as_bytes()).unwrap()).unwrap();
    let source = settings.inference_pool.as_mut().unwrap();
    assert_eq!(
        (source.namespace.as_str(), source.name.as_str()),
        (NAMESPACE, POOL)
    );
    source.api = Some(api.config());
    kvroute_epp::start(settings).await.unwrap()
}

async fn readiness(epp: &Running) -> ServingStatus {
    let url = format!("http://{}", epp.addr);
    let channel = tonic::transport::Channel::from_shared(url).unwrap();
    let mut health = HealthClient::new(channel.connect().await.unwrap());
    let request = HealthCheckRequest {
        service: "readiness".into(),
    };
    health.check(request).await.unwrap().into_inner().status()
}

/// A chat completion through the picker's ext_proc server: the routing header's value, the pick
/// then its fallbacks.
async fn pick(epp: &Running, prompt: &str) -> Vec<SocketAddr> {
    let body = serde_json::json!({
        "model": "m",
        "messages": [{ "role": "user", "content": prompt.repeat(40) }]
    })
    .to_string();
    let headers = [
        (":method", "POST"),
        (":path", "/v1/chat/completions"),
        ("content-length", &body.len().to_string()),
    ];
    let headers = headers
        .iter()
        .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
        .collect();
    let url = format!("http://{}", epp.addr);
    let mut client = ExternalProcessorClient::connect(url).await.unwrap();
    let (send, to_send) = tokio::sync::mpsc::channel(2);
    let headers = message(Request::RequestHeaders(HttpHeaders {
        headers: Some(header_map(headers)),
        ..HttpHeaders::default()
    }));
    send.send(headers).await.unwrap();
    let answers = client.process(ReceiverStream::new(to_send)).await;
    let mut answers = answers.unwrap().into_inner();
    answers
        .message()
        .await
        .unwrap()
        .expect("the headers' answer");
    let body = message(Request::RequestBody(HttpBody {
        body: body.into_bytes(),
        end_of_stream: true,
        ..HttpBody::default()
    }));
    send.send(body).await.unwrap();
    let answer = answers.message().await.unwrap().expect("the body's answer");
    let value = picked(&[answer]).expect("a pick");
    value.split(',').map(|a| a.parse().unwrap()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_picker_is_not_ready_until_the_pods_are_listed() {
    let api = KubeApi::start(
        vec![
            inference_pool(POOL, &[APP], &[8000]),
            pod("a", &[APP], Some("10.0.0.1"), true),
        ],
        false,
    )
    .await;
    let epp = start_picker(&api).await;
    let asked = || sent(&api, PODS, "watch").contains(&None);
    wait_for("the picker's pod list", asked).await;
    // The gateway polls on (a poll's snapshot is published before the next poll is counted)
    // and publishes nothing: the pool has not been read.
    let polled = [Counter::StatsPollOk, Counter::StatsPollFailed];
    let polls = || -> i64 { polled.iter().map(|c| epp.stats.value(c.name())).sum() };
    let before = polls();
    wait_for("two polls while the pods are not listed", || {
        polls() >= before + 2
    })
    .await;
    assert_eq!(epp.store.get(shared_keys::HOSTS).0, None);
    assert_eq!(readiness(&epp).await, ServingStatus::NotServing);

    api.open_pod_lists();
    let pool = epp.pool.clone().unwrap();
    members_become(&pool, &["10.0.0.1:8000"]).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while readiness(&epp).await != ServingStatus::Serving {
        assert!(Instant::now() < deadline, "never ready after the list");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_picker_picks_only_the_pools_members() {
    let mut objects = a_b_c();
    objects.push(pod("stranger", &[OTHER], Some("10.0.0.9"), true));
    let api = KubeApi::start(objects, true).await;
    let epp = start_picker(&api).await;
    let known = || epp.stats.value(Gauge::EndpointsKnown.name());
    wait_for("three endpoints known", || known() == 3).await;
    let members: Vec<SocketAddr> = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]
        .iter()
        .map(|a| a.parse().unwrap())
        .collect();
    let named = pick(&epp, "the first prompt ").await;
    assert!(named.iter().all(|a| members.contains(a)), "{named:?}");
    let first = named[0];
    // The pod the prompt went to leaves; the same prompt, its cache there, goes elsewhere.
    api.delete("Pod", pod_at(first));
    wait_for("two endpoints known", || known() == 2).await;
    for round in 0..6 {
        let prompt = if round == 0 {
            "the first prompt ".to_string()
        } else {
            format!("prompt {round} ")
        };
        let named = pick(&epp, &prompt).await;
        assert!(!named.contains(&first), "{first} picked after it left");
        assert!(named.iter().all(|a| members.contains(a)), "{named:?}");
    }
}

/// The name of the pod at `addr`.
fn pod_at(addr: SocketAddr) -> &'static str {
    match addr.ip().to_string().as_str() {
        "10.0.0.1" => "a",
        "10.0.0.2" => "b",
        "10.0.0.3" => "c",
        other => panic!("{other} is not a pod of the pool"),
    }
}
