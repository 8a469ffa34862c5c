//! Helpers shared by the integration tests: fleets, OpenAI-style bodies, and a client that
//! reports which backend answered.
#![allow(dead_code)] // real_vllm.rs uses a subset

pub mod istio;

pub mod load;
pub mod precise;
pub mod template_corpus;

use kvroute::gateway::stat_names::{self, Counter, Gauge};
use kvroute_harness::backend::Backend;
use kvroute_harness::{Envoy, EnvoyOptions, Lb};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// Backends plus the Envoy in front of them.
pub struct Fleet {
    pub backends: Vec<Backend>,
    pub envoy: Envoy,
    pub client: reqwest::Client,
}

/// What came back for one request.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    /// Index from the `x-backend` response header.
    pub backend: Option<usize>,
    /// `x-kvroute-decision`, when the plugin runs with `debug_header: true`.
    pub decision: Option<String>,
    pub body: Vec<u8>,
}

impl Fleet {
    /// Starts `n` backends and an Envoy with `lb`; `tweak` adjusts the options further.
    pub async fn start(n: usize, lb: Lb, tweak: impl FnOnce(&mut EnvoyOptions)) -> Fleet {
        let backends = Backend::start_many(n).await.expect("backends start");
        let mut opts = EnvoyOptions {
            backends: backends.iter().map(Backend::addr).collect(),
            lb,
            ..EnvoyOptions::default()
        };
        tweak(&mut opts);
        let envoy = Envoy::start(opts).await.unwrap_or_else(|e| panic!("{e}"));
        Fleet {
            backends,
            envoy,
            client: client(),
        }
    }

    /// Starts a kvroute fleet with `plugin_config` over the shipped config and waits until the
    /// plugin has discovered every backend, so the first requests are routed, not fallbacks.
    pub async fn kvroute(
        n: usize,
        plugin_config: Value,
        tweak: impl FnOnce(&mut EnvoyOptions),
    ) -> Fleet {
        let fleet = Fleet::start(n, Lb::Kvroute { plugin_config }, tweak).await;
        fleet.wait_endpoints_known(n).await;
        fleet
    }

    /// Waits until kvroute's poller knows `n` healthy endpoints and every worker has picked that
    /// up: workers re-read the poller's snapshot on their own tick, so wait two more polls.
    pub async fn wait_endpoints_known(&self, n: usize) {
        let known = self.envoy.wait_for_stat(
            Gauge::EndpointsKnown.name(),
            |v| v == n as u64,
            Duration::from_secs(30),
        );
        known.await.unwrap_or_else(|e| panic!("{e}"));
        wait_for_fresh_poll(self).await;
    }

    /// POSTs `body` (JSON or raw bytes) to `path` with extra `headers`.
    pub async fn post(
        &self,
        path: &str,
        body: impl Into<reqwest::Body>,
        headers: &[(&str, &str)],
    ) -> Reply {
        let req = self.client.post(format!("{}{path}", self.envoy.url()));
        self.send(req.body(body), headers).await
    }

    /// [`post`](Self::post) with header values as raw bytes (HTTP allows bytes 0x80-0xFF).
    pub async fn post_raw_headers(
        &self,
        path: &str,
        body: impl Into<reqwest::Body>,
        headers: &[(&str, &[u8])],
    ) -> Reply {
        let mut req = self.client.post(format!("{}{path}", self.envoy.url()));
        for (k, v) in headers {
            let value = reqwest::header::HeaderValue::from_bytes(v).expect("a valid header value");
            req = req.header(*k, value);
        }
        self.send(req.body(body), &[]).await
    }

    /// POSTs an OpenAI chat request.
    pub async fn chat(&self, body: &Value) -> Reply {
        self.post(
            "/v1/chat/completions",
            body.to_string(),
            &[("content-type", "application/json")],
        )
        .await
    }

    pub async fn get(&self, path: &str, headers: &[(&str, &str)]) -> Reply {
        let req = self.client.get(format!("{}{path}", self.envoy.url()));
        self.send(req, headers).await
    }

    /// Sends `req` with extra `headers`; a transport failure fails the test with Envoy's log.
    async fn send(&self, mut req: reqwest::RequestBuilder, headers: &[(&str, &str)]) -> Reply {
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let resp = req.send().await;
        read(resp.unwrap_or_else(|e| panic!("request failed: {e}\n{}", self.envoy.log_tail())))
            .await
    }

    /// Sum of the stats whose names contain `filter`.
    pub async fn stat_sum(&self, filter: &str) -> u64 {
        self.envoy
            .stats(filter)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .values()
            .sum()
    }

    /// [`stat_sum`](Self::stat_sum) once it reaches `at_least`, or as it is after a few seconds:
    /// for counters kvroute writes on its tick (the routed and usage counters).
    pub async fn stat_sum_reaching(&self, filter: &str, at_least: u64) -> u64 {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            let sum = self.stat_sum(filter).await;
            if sum >= at_least || tokio::time::Instant::now() > deadline {
                return sum;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .pool_max_idle_per_host(256)
        .build()
        .expect("client builds")
}

async fn read(resp: reqwest::Response) -> Reply {
    let header = |name: &str| {
        resp.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let backend = header("x-backend").and_then(|v| v.parse().ok());
    let decision = header("x-kvroute-decision");
    let status = resp.status().as_u16();
    let body = resp.bytes().await.expect("response body").to_vec();
    Reply {
        status,
        backend,
        decision,
        body,
    }
}

/// A long system prompt unique to `group`: several chunks' worth, so the shared prefix dominates.
pub fn system_prompt(group: usize) -> String {
    let mut s = format!("You are assistant number {group}. ");
    for i in 0..60 {
        s.push_str(&format!(
            "Rule {i} of group {group}: answer precisely and cite the handbook section {i}. "
        ));
    }
    s
}

/// A chat request: `system` as the shared prefix, then a user turn.
pub fn chat_body(system: &str, user: &str, stream: bool) -> Value {
    json!({
        "model": "test",
        "stream": stream,
        "messages": [
            { "role": "system", "content": system },
            { "role": "user", "content": user },
        ],
    })
}

/// Question `q` to a simulated fleet serving `model`: one group's short system prompt, then the
/// question, answered in at most `max_tokens`.
pub fn sim_question(model: &str, q: usize, max_tokens: usize, stream: bool) -> Value {
    let system = "You are the group's assistant. ".repeat(60);
    let mut body = chat_body(&system, &format!("question {q}"), stream);
    body["model"] = model.into();
    body["max_tokens"] = max_tokens.into();
    body
}

/// Question `i` of group `g` (its `system_prompt`), not streamed.
pub fn ask(g: usize, i: usize) -> Value {
    chat_body(&system_prompt(g), &format!("question {i}"), false)
}

/// Sends question 0 of groups `0..groups`, one at a time: the backend that served each.
pub async fn first_homes(fleet: &Fleet, groups: usize) -> Vec<usize> {
    let mut homes = Vec::new();
    for g in 0..groups {
        homes.push(served_by(fleet, &fleet.chat(&ask(g, 0)).await));
    }
    homes
}

/// The plugin config most tests use: the shipped one plus the decision header, polled quickly.
pub fn debug_config() -> Value {
    json!({ "debug_header": true, "stats_interval_ms": 200 })
}

/// kvroute's stat `name` (a counter or gauge, named by [`stat_names`]), 0 when Envoy has not
/// created it.
pub async fn kv_stat(fleet: &Fleet, name: &str) -> u64 {
    stat_or_zero(fleet, name).await
}

/// The stat whose name ends in `suffix`, 0 when Envoy has not created it.
async fn stat_or_zero(fleet: &Fleet, suffix: &str) -> u64 {
    fleet
        .envoy
        .stat(suffix)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or(0)
}

/// `cluster.inference_pool.<name>` (Envoy's stat of the replicas' cluster), 0 when absent.
pub async fn pool_stat(fleet: &Fleet, name: &str) -> u64 {
    stat_or_zero(fleet, &format!("cluster.inference_pool.{name}")).await
}

/// Every per-endpoint in-flight gauge ([`stat_names::inflight`]).
pub async fn inflight_gauges(fleet: &Fleet) -> std::collections::BTreeMap<String, u64> {
    let stats = fleet
        .envoy
        .stats(stat_names::INFLIGHT_PREFIX)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    stats.into_iter().collect()
}

/// The gauge name kvroute uses for backend `addr`: dots and colon become `_`.
pub fn inflight_gauge_name(addr: std::net::SocketAddr) -> String {
    stat_names::inflight(&endpoint_segment(addr))
}

/// Backend `addr` as kvroute's per-endpoint stats name it (`127_0_0_1_8001`).
pub fn endpoint_segment(addr: std::net::SocketAddr) -> String {
    kvroute::usage::stat_segment(&addr.to_string())
}

/// The backend index serving `reply`, with the Envoy log in the panic message when absent.
pub fn served_by(fleet: &Fleet, reply: &Reply) -> usize {
    assert_eq!(
        reply.status,
        200,
        "status {} body {:?}\n{}",
        reply.status,
        String::from_utf8_lossy(&reply.body),
        fleet.envoy.log_tail()
    );
    reply.backend.expect("x-backend header")
}

/// Waits until kvroute has finished two more polls of Envoy's `/clusters`, so its view of host
/// health and load is newer than anything the test just changed.
pub async fn wait_for_fresh_poll(fleet: &Fleet) {
    wait_for_fresh_poll_of(&fleet.envoy).await;
}

/// [`wait_for_fresh_poll`] of this Envoy.
pub async fn wait_for_fresh_poll_of(envoy: &Envoy) {
    wait_for_polls(envoy, 2).await;
}

/// Waits until kvroute has finished `n` more polls of Envoy's `/clusters`.
pub async fn wait_for_polls(envoy: &Envoy, n: u64) {
    let now = envoy
        .stat(Counter::StatsPollOk.name())
        .await
        .ok()
        .flatten()
        .unwrap_or(0);
    let polled = envoy.wait_for_stat(
        Counter::StatsPollOk.name(),
        |v| v >= now + n,
        Duration::from_secs(30),
    );
    polled.await.unwrap_or_else(|e| panic!("{e}"));
}

/// Sends two requests of each of `groups` (their `system_prompt`) and waits until kvroute places
/// at least that many groups by its balanced assignment: the steady state of a gateway that has
/// warmed up and seen every group.
pub async fn warm_up(fleet: &Fleet, groups: impl Iterator<Item = usize>) {
    let bodies: Vec<Vec<Value>> = groups
        .map(|g| {
            (0..2)
                .map(|round| chat_body(&system_prompt(g), &format!("warm-up {round}"), false))
                .collect()
        })
        .collect();
    warm_up_with(fleet, &bodies).await;
}

/// Sends every body of `groups` (each group's requests, in rounds: the first of each group, then
/// the second, ...), then waits until kvroute places at least `groups.len()` groups by its
/// balanced assignment, every worker has seen them, and their homes have held.
pub async fn warm_up_with(fleet: &Fleet, groups: &[Vec<Value>]) {
    let rounds = groups.iter().map(Vec::len).max().unwrap_or(0);
    for round in 0..rounds {
        for body in groups.iter().filter_map(|g| g.get(round)) {
            served_by(fleet, &fleet.chat(body).await);
        }
    }
    let n = groups.len() as u64;
    let placed = fleet.envoy.wait_for_stat(
        Gauge::GroupsPlaced.name(),
        |v| v >= n,
        Duration::from_secs(30),
    );
    placed.await.unwrap_or_else(|e| panic!("{e}"));
    // The gauge is the last writer's: one worker has placed them. Another reads the groups table
    // once a `FLUSH_MS` on its tick, so it has them within a `FLUSH_MS` of that, and a request the
    // client sends on a new connection may reach it. Polls run on the same ticks, so a slow
    // machine stretches both alike.
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(kvroute::placement::FLUSH_MS) {
        wait_for_fresh_poll(fleet).await;
    }
    // Then its homes hold (`HOLD_POLLS`, 4 polls) before groups leave their first rendezvous
    // choice for them: six more polls.
    for _ in 0..3 {
        wait_for_fresh_poll(fleet).await;
    }
}

/// The routing header (`x-gateway-destination-endpoint`) of every request the backends recorded
/// since the last call, clearing their records: whom kvroute named, first address first. A
/// request Envoy retried elsewhere shows up at the backend that finally served it.
pub fn take_routing_headers(fleet: &Fleet) -> Vec<String> {
    fleet
        .backends
        .iter()
        .flat_map(Backend::take_requests)
        .map(|r| {
            r.header_values("x-gateway-destination-endpoint")
                .first()
                .map_or_else(String::new, |v| v.to_string())
        })
        .collect()
}

/// How many of `headers` name `addr` as the first choice.
pub fn first_named(headers: &[String], addr: std::net::SocketAddr) -> usize {
    let addr = addr.to_string();
    headers
        .iter()
        .filter(|h| h.split(',').next().map(str::trim) == Some(addr.as_str()))
        .count()
}

impl Fleet {
    /// POSTs an OpenAI chat request through `client` (e.g. one that opens a new connection per
    /// request, so requests spread over Envoy's workers).
    pub async fn chat_via(&self, client: &reqwest::Client, body: &Value) -> Reply {
        let req = client
            .post(format!("{}/v1/chat/completions", self.envoy.url()))
            .header("content-type", "application/json")
            .body(body.to_string());
        self.send(req, &[]).await
    }
}

/// A client that opens a new connection for every request: Envoy hands each connection to one
/// of its workers, so such requests reach every worker's kvroute VM, not just one.
pub fn client_per_request() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .pool_max_idle_per_host(0)
        .build()
        .expect("client builds")
}

/// A simulated vLLM fleet of `spec` behind an Envoy with kvroute (admin polled every 200 ms),
/// once kvroute knows every replica.
pub async fn kvroute_over_sim(
    spec: kvroute_sim::spec::FleetSpec,
) -> (kvroute_sim::fleet::Fleet, Envoy) {
    kvroute_over_sim_with(spec, json!({ "stats_interval_ms": 200 })).await
}

/// [`kvroute_over_sim`] with this plugin config.
pub async fn kvroute_over_sim_with(
    spec: kvroute_sim::spec::FleetSpec,
    plugin_config: Value,
) -> (kvroute_sim::fleet::Fleet, Envoy) {
    let sim = kvroute_sim::fleet::Fleet::start(spec, 0, 0)
        .await
        .expect("sim fleet starts");
    let envoy = kvroute_envoy_over(&sim, plugin_config).await;
    (sim, envoy)
}

/// One more Envoy with kvroute (this plugin config) in front of the simulated fleet `sim`, once
/// kvroute knows every replica: several gateways over one fleet.
pub async fn kvroute_envoy_over(sim: &kvroute_sim::fleet::Fleet, plugin_config: Value) -> Envoy {
    kvroute_envoy_on(sim.replicas.iter().map(|r| r.addr).collect(), plugin_config).await
}

/// An Envoy with kvroute (this plugin config) in front of `backends`, once kvroute knows every one.
pub async fn kvroute_envoy_on(backends: Vec<std::net::SocketAddr>, plugin_config: Value) -> Envoy {
    kvroute_envoy_with(backends, plugin_config, |_| {}).await
}

/// [`kvroute_envoy_on`] with the options `tweak` changes.
pub async fn kvroute_envoy_with(
    backends: Vec<std::net::SocketAddr>,
    plugin_config: Value,
    tweak: impl FnOnce(&mut EnvoyOptions),
) -> Envoy {
    let n = backends.len() as u64;
    let mut options = EnvoyOptions {
        backends,
        lb: Lb::Kvroute { plugin_config },
        ..EnvoyOptions::default()
    };
    tweak(&mut options);
    let envoy = Envoy::start(options)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    envoy
        .wait_for_stat(
            Gauge::EndpointsKnown.name(),
            |v| v == n,
            Duration::from_secs(30),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    envoy
}

/// Requests each backend received so far.
pub fn received(fleet: &Fleet) -> Vec<u64> {
    fleet.backends.iter().map(|b| b.received()).collect()
}

/// The backends that received a request since `before` (each index once per request).
pub fn reached_since(fleet: &Fleet, before: &[u64]) -> Vec<usize> {
    let now = received(fleet);
    let mut reached = Vec::new();
    for (i, (n, b)) in now.iter().zip(before).enumerate() {
        reached.extend(std::iter::repeat_n(i, (n - b) as usize));
    }
    reached
}

/// Precise mode: Envoy with kvroute (this plugin config, which names the `kvroute_indexer`
/// cluster) in front of `backends`, polling the indexer at `indexer` and naming the upstream
/// that served each response, once every worker knows every backend.
pub async fn kvroute_with_indexer(
    backends: Vec<std::net::SocketAddr>,
    indexer: std::net::SocketAddr,
    plugin_config: Value,
) -> Envoy {
    kvroute_with_indexer_from(None, backends, indexer, plugin_config).await
}

/// [`kvroute_with_indexer`] started from `bootstrap` (a shipped one: `envoy/kvroute-precise.yaml`)
/// instead of `envoy/kvroute.yaml`.
pub async fn kvroute_with_indexer_from(
    bootstrap: Option<std::path::PathBuf>,
    backends: Vec<std::net::SocketAddr>,
    indexer: std::net::SocketAddr,
    plugin_config: Value,
) -> Envoy {
    let envoy = kvroute_envoy_with(backends, plugin_config, |o| {
        o.indexer = Some(indexer);
        o.name_upstream = true;
        o.bootstrap = bootstrap;
    })
    .await;
    // Every worker re-reads the poller's snapshot on its own tick.
    wait_for_fresh_poll_of(&envoy).await;
    envoy
}

/// Waits until kvroute has applied `n` more of the indexer's answers than it had.
pub async fn index_applied(envoy: &Envoy, n: u64) {
    let polled = Counter::IndexPollOk.name();
    let before = envoy.stat(polled).await.ok().flatten();
    let before = before.unwrap_or(0);
    envoy
        .wait_for_stat(polled, |v| v >= before + n, Duration::from_secs(30))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
}

/// POSTs chat `body` through `envoy`: kvroute's decision and the upstream that served it.
pub async fn decided(envoy: &Envoy, body: &Value) -> (String, String) {
    let resp = client()
        .post(format!("{}/v1/chat/completions", envoy.url()))
        .json(body)
        .send()
        .await
        .expect("request");
    assert_eq!(resp.status(), 200, "never a failed request");
    let header = |name: &str| {
        resp.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string()
    };
    let decided = (
        header("x-kvroute-decision"),
        header(kvroute_harness::bootstrap::UPSTREAM_HEADER),
    );
    resp.bytes().await.expect("body");
    decided
}
