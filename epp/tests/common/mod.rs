//! Helpers of the picker's tests: a kvroute-epp started in the test's process, and a real Envoy
//! started from the shipped `envoy/kvroute-epp.yaml` (the harness patches its ports, pool and
//! picker).

#![allow(dead_code)]

pub mod driven;
pub mod kube_api;

use kvroute::gateway::stat_names::Counter;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvroute::config::Config;
use kvroute_epp::settings::{Args, Settings};
use kvroute_epp::Running;
use kvroute_harness::backend::Backend;
pub use kvroute_harness::epp::Shape;
use kvroute_harness::{Envoy, EnvoyOptions};

/// The picker over `endpoints`, on free ports of 127.0.0.1, with the filter's `config` (JSON).
pub async fn start_epp(endpoints: &[SocketAddr], config: &str, single_address: bool) -> Running {
    start_epp_with(endpoints, config, |args| {
        args.single_address = single_address
    })
    .await
}

/// [`start_epp`] with `change` made to its command line.
pub async fn start_epp_with(
    endpoints: &[SocketAddr],
    config: &str,
    change: impl FnOnce(&mut Args),
) -> Running {
    let mut args = Args {
        listen: "127.0.0.1:0".parse().unwrap(),
        metrics: Some("127.0.0.1:0".parse().unwrap()),
        config: None,
        endpoints: endpoints.to_vec(),
        envoy_admin: None,
        inference_pool: None,
        namespace: None,
        pool: "inference_pool".into(),
        indexer: None,
        workers: Some(2),
        single_address: false,
        subset_from_header: false,
        events: None,
    };
    change(&mut args);
    let config = Config::parse(config.as_bytes()).expect("config");
    let settings = Settings::with_config(args, config).expect("settings");
    kvroute_epp::start(settings)
        .await
        .expect("kvroute-epp starts")
}

/// Envoy over `backends`, asking the picker at `epp`.
pub async fn start_envoy(backends: &[Backend], epp: SocketAddr, shape: Shape) -> Envoy {
    start_envoy_over(backends.iter().map(Backend::addr).collect(), epp, shape).await
}

/// Envoy over the servers at `addrs`, asking the picker at `epp`.
pub async fn start_envoy_over(addrs: Vec<SocketAddr>, epp: SocketAddr, shape: Shape) -> Envoy {
    let opts = EnvoyOptions {
        backends: addrs,
        health_check_interval: Some(Duration::from_millis(200)),
        ..EnvoyOptions::default()
    };
    match kvroute_harness::epp::start(epp, shape, opts).await {
        Ok(envoy) => envoy,
        Err(e) => panic!("{e}"),
    }
}

/// `n` backends, a picker over them with the shipped config (`single_address` as given), ready,
/// and Envoy in front of them asking it.
pub async fn fleet(n: usize, single_address: bool, shape: Shape) -> (Vec<Backend>, Running, Envoy) {
    let backends = Backend::start_many(n).await.unwrap();
    let addrs: Vec<SocketAddr> = backends.iter().map(Backend::addr).collect();
    let config = kvroute_epp::settings::DEFAULT_CONFIG;
    let epp = start_epp(&addrs, config, single_address).await;
    wait_ready(&epp).await;
    let envoy = start_envoy(&backends, epp.addr, shape).await;
    (backends, epp, envoy)
}

/// A chat completion whose prompt opens with `system`: requests with one system prompt share
/// their prefix.
pub fn chat(system: &str, user: &str) -> String {
    let long = system.repeat(40);
    serde_json::json!({
        "model": "m",
        "messages": [
            { "role": "system", "content": long },
            { "role": "user", "content": user }
        ]
    })
    .to_string()
}

/// A request's answer: status, the backend that served it (`x-backend`), body.
pub struct Reply {
    pub status: u16,
    pub backend: Option<usize>,
    pub body: String,
}

pub async fn post(envoy: &Envoy, body: impl Into<reqwest::Body>) -> Reply {
    let client = reqwest::Client::new();
    let response = client
        .post(format!("{}/v1/chat/completions", envoy.url()))
        .header("content-type", "application/json")
        .body(body)
        .timeout(Duration::from_secs(20))
        .send()
        .await
        .expect("Envoy answers");
    let status = response.status().as_u16();
    let backend = response
        .headers()
        .get("x-backend")
        .and_then(|v| v.to_str().ok()?.parse().ok());
    let body = response.text().await.unwrap_or_default();
    Reply {
        status,
        backend,
        body,
    }
}

/// Waits until `stat` of the picker satisfies `ok`, or fails after 10 s.
pub async fn wait_for_stat(epp: &Running, stat: &str, ok: impl Fn(i64) -> bool) -> i64 {
    wait_until(stat, || epp.stats.value(stat), ok).await
}

/// Waits until `value()` satisfies `ok` (the workers write their counts on their ticks), or
/// fails after 10 s naming `what`.
pub async fn wait_until(what: &str, value: impl Fn() -> i64, ok: impl Fn(i64) -> bool) -> i64 {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let v = value();
        if ok(v) {
            return v;
        }
        assert!(Instant::now() < deadline, "{what} stayed at {v}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until the picker's readiness: its first poll has shown it the pool.
pub async fn wait_ready(epp: &Running) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while epp.stats.value(Counter::StatsPollOk.name()) == 0 {
        assert!(
            Instant::now() < deadline,
            "the picker never polled its pool"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
