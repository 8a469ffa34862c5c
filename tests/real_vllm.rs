#![cfg(not(target_arch = "wasm32"))]
//! kvroute against real vLLM engines (CPU, a tiny model with random weights) on this machine,
//! and the simulator held against them. Not part of `make test`: `make test-real` installs vLLM
//! (about 3 GB) and runs this with `--ignored`.
//!
//! One fleet of two engines serves every check, in order (an engine takes a minute or more to
//! start on two cores); each check says what failed, and the test fails if any did:
//! - the metrics kvroute polls are there, under the names and labels `src/engine.rs` parses;
//! - the simulator says the same as vLLM wherever kvroute reads it: those metric families and
//!   labels, the `usage` of plain and streamed answers, the KV events' framing and fields;
//! - kvroute's `kvroute.usage.*` stats equal the engines' own counters;
//! - a group's requests stay on one replica;
//! - an engine that evicted a conversation's prefix is noticed (the closed loop, `src/eviction.rs`);
//! - an engine killed under load loses no request.
//!
//! Two more tests start engines of their own (`make test-real` runs the three one at a time):
//! precise mode on three engines and the indexer ([`precise`]), and the filter's chat template
//! rendering against vLLM's ([`templates`]).

mod common;
#[path = "real_vllm/precise.rs"]
mod precise;
#[path = "real_vllm/templates.rs"]
mod templates;

use kvroute::gateway::stat_names::Counter;
use kvroute_harness::vllm::{gauge, vllm_missing, VllmFleet, VllmOptions, SERVED_MODEL};
use kvroute_harness::Envoy;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::time::Duration;

/// KV blocks of 128 tokens per engine: 6144 tokens, a few conversations.
const BLOCKS: u64 = 48;
const BLOCK_SIZE: u64 = 128;

type Check = Result<(), String>;

fn ensure(ok: bool, what: impl FnOnce() -> String) -> Check {
    match ok {
        true => Ok(()),
        false => Err(what()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs real vLLM (about 3 GB): make test-real"]
async fn real_vllm() {
    if let Some(missing) = vllm_missing() {
        panic!("{missing}");
    }
    let opts = VllmOptions {
        replicas: 2,
        num_gpu_blocks: Some(BLOCKS),
        max_num_seqs: 8,
        ..VllmOptions::default()
    };
    let started = std::time::Instant::now();
    let mut fleet = VllmFleet::start(&opts)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    eprintln!("engines serving after {:.0?}", started.elapsed());
    let mut outcomes: Vec<(&str, Check)> = Vec::new();
    macro_rules! check {
        ($name:literal, $f:expr) => {{
            let t = std::time::Instant::now();
            let outcome = $f.await;
            match &outcome {
                Ok(()) => eprintln!("check {}: ok ({:.1?})", $name, t.elapsed()),
                Err(e) => eprintln!("check {}: FAILED: {e}", $name),
            }
            outcomes.push(($name, outcome));
        }};
    }
    check!("metrics kvroute polls", metrics_kvroute_polls(&fleet));
    check!("sim metrics match", sim_metrics_match(&fleet));
    check!("sim usage matches", sim_usage_matches(&fleet));
    check!("sim kv events match", sim_kv_events_match(&fleet));
    let envoy = kvroute_envoy(&fleet).await;
    check!(
        "usage stats equal engine counters",
        usage_equals_engines(&fleet, &envoy)
    );
    check!("group stays on its replica", group_stays(&fleet, &envoy));
    check!("eviction noticed", eviction_noticed(&fleet, &envoy));
    check!(
        "killed replica loses no request",
        kill_under_load(&mut fleet, &envoy)
    );
    let failed: Vec<String> = outcomes
        .iter()
        .filter_map(|(n, o)| o.as_ref().err().map(|e| format!("{n}: {e}")))
        .collect();
    eprintln!(
        "real_vllm: {} passed, {} failed",
        outcomes.len() - failed.len(),
        failed.len()
    );
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

// ---------------------------------------------------------------------------------------------
// Requests.

/// A system prompt of about `words` tokens for group `g`, as the bench's workloads make them.
fn system(g: usize, words: usize) -> String {
    const W: [&str; 12] = [
        "cache", "route", "token", "fleet", "prefix", "block", "model", "query", "answer", "node",
        "hash", "load",
    ];
    let mut s = format!("[doc {g}]");
    for i in 0..words {
        s.push(' ');
        s.push_str(W[(i * 7 + g * 5 + i / 13) % W.len()]);
    }
    s
}

fn chat(system: &str, user: &str, stream: bool) -> Value {
    let mut body = json!({
        "model": SERVED_MODEL, "max_tokens": 4, "stream": stream,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    });
    if stream {
        body["stream_options"] = json!({"include_usage": true});
    }
    body
}

/// POSTs a chat request to `base`; returns the status and the body (a stream read to its end).
async fn post(base: &str, body: &Value) -> Result<(u16, String), String> {
    let url = format!("{base}/v1/chat/completions");
    let resp = common::client().post(&url).json(body).send().await;
    let resp = resp.map_err(|e| format!("{url}: {e}"))?;
    let status = resp.status().as_u16();
    let text = resp.text().await.map_err(|e| format!("{url}: {e}"))?;
    Ok((status, text))
}

/// The `usage` object of a plain answer, or of a stream's final chunk.
fn usage_of(text: &str) -> Option<Value> {
    match serde_json::from_str::<Value>(text) {
        Ok(v) => Some(v["usage"].clone()),
        Err(_) => usage_chunk(text).map(|c| c["usage"].clone()),
    }
}

/// The final chunk of a stream (the one with `usage`), whole.
fn usage_chunk(text: &str) -> Option<Value> {
    text.lines()
        .rev()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find(|v| v["usage"].is_object())
}

/// A JSON value's shape: objects by their keys (recursively), arrays by their first element,
/// scalars by their type. Two answers with the same shape carry the same fields.
fn shape(v: &Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(m.iter().map(|(k, v)| (k.clone(), shape(v))).collect()),
        Value::Array(a) => json!([a.first().map(shape).unwrap_or(Value::Null)]),
        Value::String(_) => json!("string"),
        Value::Number(n) if n.is_f64() => json!("float"),
        Value::Number(_) => json!("int"),
        Value::Bool(_) => json!("bool"),
        Value::Null => json!("null"),
    }
}

/// Every engine's value of metric `name` (summed over label sets).
async fn counters(fleet: &VllmFleet, name: &str) -> Result<Vec<f64>, String> {
    let mut out = Vec::new();
    for i in 0..fleet.engines.len() {
        let page = fleet.metrics(i).await.map_err(|e| e.to_string())?;
        out.push(gauge(&page, name));
    }
    Ok(out)
}

/// Which engine's finished-request counter moved between `before` and now (requests sent one
/// at a time).
async fn served_by(fleet: &VllmFleet, before: &[f64]) -> Result<usize, String> {
    let now = counters(fleet, "vllm:request_success_total").await?;
    now.iter()
        .zip(before)
        .position(|(a, b)| a > b)
        .ok_or_else(|| "no engine counted the request".to_string())
}

async fn reset(fleet: &VllmFleet) -> Check {
    fleet
        .reset_prefix_caches(Duration::from_secs(60))
        .await
        .map_err(|e| e.to_string())
}

// ---------------------------------------------------------------------------------------------
// The metrics kvroute polls.

/// The families kvroute reads from a vLLM engine (src/engine.rs), and the labels it reads.
const FAMILIES: [(&str, &[&str]); 8] = [
    ("vllm:num_requests_running", &[]),
    ("vllm:num_requests_waiting", &[]),
    ("vllm:request_success_total", &[]),
    ("vllm:kv_cache_usage_perc", &[]),
    ("vllm:prefix_cache_queries_total", &[]),
    ("vllm:prefix_cache_hits_total", &[]),
    ("vllm:generation_tokens_total", &[]),
    ("vllm:cache_config_info", &["block_size", "num_gpu_blocks"]),
];

/// Each sample line's metric name and label names.
fn label_sets(page: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for line in page.lines().filter(|l| !l.starts_with('#')) {
        let Some(end) = line.find(['{', ' ']) else {
            continue;
        };
        let labels = out.entry(line[..end].to_string()).or_default();
        if let (Some(a), Some(b)) = (line.find('{'), line.rfind('}')) {
            for pair in line[a + 1..b].split(',') {
                if let Some((k, _)) = pair.split_once('=') {
                    labels.insert(k.trim().to_string());
                }
            }
        }
    }
    out
}

async fn metrics_kvroute_polls(fleet: &VllmFleet) -> Check {
    // A request first, so every counter has moved off zero.
    let (status, _) = post(
        &fleet.engines[0].url,
        &chat(&system(0, 300), "hello", false),
    )
    .await?;
    ensure(status == 200, || format!("engine answered {status}"))?;
    for i in 0..fleet.engines.len() {
        let page = fleet.metrics(i).await.map_err(|e| e.to_string())?;
        let sets = label_sets(&page);
        for (family, labels) in FAMILIES {
            let found = sets
                .get(family)
                .ok_or_else(|| format!("engine {i}: no {family}"))?;
            for l in labels {
                ensure(found.contains(*l), || {
                    format!("engine {i}: {family} has no label {l} ({found:?})")
                })?;
            }
        }
        let m = kvroute::engine_load::parse(page.as_bytes())
            .ok_or_else(|| format!("engine {i}: kvroute parses no load from its /metrics"))?;
        let capacity = (BLOCKS * BLOCK_SIZE) as f64;
        ensure(m.kv.capacity_tokens == Some(capacity), || {
            format!(
                "engine {i}: KV capacity {:?}, not {capacity}",
                m.kv.capacity_tokens
            )
        })?;
        let kv = m.kv;
        let read = [
            ("completed", m.completed),
            ("kv usage", kv.usage),
            ("prompt tokens", kv.prompt_tokens),
            ("cached tokens", kv.cached_tokens),
            ("generated tokens", kv.generated_tokens),
        ];
        for (what, v) in read {
            ensure(v.is_some(), || {
                format!("engine {i}: kvroute read no {what}")
            })?;
        }
        if i == 0 {
            ensure(m.completed >= Some(1.0), || {
                "engine 0 counted no request".into()
            })?;
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The simulator against vLLM.

/// A one-replica sim fleet shaped like the engines (block size, cache), fast.
async fn sim() -> Result<kvroute_sim::fleet::Fleet, String> {
    let spec = kvroute_sim::spec::FleetSpec {
        replicas: 1,
        model: SERVED_MODEL.into(),
        block_size: BLOCK_SIZE as usize,
        kv_capacity_tokens: (BLOCKS * BLOCK_SIZE) as usize,
        max_model_len: 4096,
        time_scale: 0.01,
        ..kvroute_sim::spec::FleetSpec::default()
    };
    kvroute_sim::fleet::Fleet::start(spec, 0, 0)
        .await
        .map_err(|e| format!("sim: {e}"))
}

async fn get_text(url: &str) -> Result<String, String> {
    let resp = common::client().get(url).send().await;
    let resp = resp.map_err(|e| format!("{url}: {e}"))?;
    resp.text().await.map_err(|e| format!("{url}: {e}"))
}

async fn sim_metrics_match(fleet: &VllmFleet) -> Check {
    let sim = sim().await?;
    let sim_url = sim.replicas[0].url();
    post(&sim_url, &chat(&system(0, 300), "hello", false)).await?;
    let real = label_sets(&fleet.metrics(0).await.map_err(|e| e.to_string())?);
    let simulated = label_sets(&get_text(&format!("{sim_url}/metrics")).await?);
    let mut diffs = Vec::new();
    for (family, _) in FAMILIES {
        match (real.get(family), simulated.get(family)) {
            (Some(r), Some(s)) if r == s => {}
            (Some(r), Some(s)) => {
                // vLLM's cache_config_info carries every cache setting as a label; kvroute reads
                // two, which the family check above holds the sim to.
                if family != "vllm:cache_config_info"
                    || !FAMILIES[7].1.iter().all(|l| s.contains(*l))
                {
                    diffs.push(format!("{family}: labels {r:?} in vLLM, {s:?} in the sim"));
                }
            }
            (r, s) => diffs.push(format!(
                "{family}: in vLLM {}, in the sim {}",
                r.is_some(),
                s.is_some()
            )),
        }
    }
    let parse = |page: &str| kvroute::engine_load::parse(page.as_bytes());
    let real_page = fleet.metrics(0).await.map_err(|e| e.to_string())?;
    let sim_page = get_text(&format!("{sim_url}/metrics")).await?;
    let (r, s) = (parse(&real_page), parse(&sim_page));
    let fields = |m: Option<kvroute::engine_load::Metrics>| {
        m.map(|m| {
            [
                m.completed.is_some(),
                m.kv.capacity_tokens.is_some(),
                m.kv.usage.is_some(),
                m.kv.prompt_tokens.is_some(),
                m.kv.cached_tokens.is_some(),
                m.kv.generated_tokens.is_some(),
            ]
        })
    };
    if fields(r) != fields(s) {
        diffs.push(format!(
            "kvroute reads {:?} from vLLM, {:?} from the sim",
            fields(r),
            fields(s)
        ));
    }
    ensure(diffs.is_empty(), || diffs.join("; "))
}

async fn sim_usage_matches(fleet: &VllmFleet) -> Check {
    let sim = sim().await?;
    let sim_url = sim.replicas[0].url();
    let real_url = &fleet.engines[0].url;
    let mut diffs = Vec::new();
    for stream in [false, true] {
        let body = chat(&system(1, 400), "What is the cache?", stream);
        // Twice: the second finds the prompt cached, so cached_tokens is a number in both.
        let mut answers = Vec::new();
        for url in [real_url.as_str(), sim_url.as_str()] {
            post(url, &body).await?;
            let (status, text) = post(url, &body).await?;
            ensure(status == 200, || format!("{url} answered {status}"))?;
            answers.push(text);
        }
        let (real, simulated) = (&answers[0], &answers[1]);
        let (ru, su) = (usage_of(real), usage_of(simulated));
        let ru = ru.ok_or_else(|| format!("vLLM's answer has no usage: {real}"))?;
        let su = su.ok_or_else(|| format!("the sim's answer has no usage: {simulated}"))?;
        if shape(&ru) != shape(&su) {
            diffs.push(format!(
                "usage (stream {stream}): vLLM {}, sim {}",
                shape(&ru),
                shape(&su)
            ));
        }
        ensure(
            ru["prompt_tokens_details"]["cached_tokens"].as_u64() > Some(0),
            || format!("vLLM reported no cached tokens for a repeated prompt: {ru}"),
        )?;
        if stream {
            // The final chunk's other fields (id, model, vLLM's `system_fingerprint`) are not
            // read by kvroute; its `choices` are empty in both.
            let choices = |t: &str| usage_chunk(t).map(|c| c["choices"].clone());
            let (rc, sc) = (choices(real), choices(simulated));
            if rc != Some(json!([])) || sc != rc {
                diffs.push(format!(
                    "final stream chunk's choices: vLLM {rc:?}, sim {sc:?}"
                ));
            }
        }
    }
    ensure(diffs.is_empty(), || diffs.join("; "))
}

/// A subscriber to one KV event endpoint (tools/real/kv-events.py): the lines it printed that
/// were read, and the rest as they come.
struct Subscriber {
    child: std::process::Child,
    read: Vec<String>,
    lines: tokio::sync::mpsc::UnboundedReceiver<String>,
}

/// Subscribes to `endpoint` for `seconds` at most (tools/real/kv-events.py, with the vLLM venv's
/// pyzmq), returning once the script says it has connected: Python starts slowly on a loaded
/// machine. The subscription has yet to reach the publisher: [`joined`] waits for that.
fn subscribe(endpoint: &str, seconds: u64) -> Result<Subscriber, String> {
    use std::io::BufRead;
    let python = kvroute_harness::vllm::vllm_venv().join("bin/python");
    let script = kvroute_harness::paths::workspace_root().join("tools/real/kv-events.py");
    let mut child = std::process::Command::new(python)
        .arg(script)
        .arg(endpoint)
        .arg(seconds.to_string())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| format!("kv-events.py: {e}"))?;
    let out = child.stdout.take().ok_or("kv-events.py: no stdout")?;
    let mut lines = std::io::BufReader::new(out).lines();
    let first = lines.next().and_then(Result::ok).unwrap_or_default();
    if !first.contains("subscribed") {
        return Err(format!("kv-events.py: {first:?}"));
    }
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in lines.map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    Ok(Subscriber {
        child,
        read: Vec::new(),
        lines: rx,
    })
}

/// Sends distinct prompts to the engine at `base` until `sub` has printed one of its messages:
/// a PUB tells no one when a subscription has reached it, and sends a message only to the
/// subscriptions it has by then.
async fn joined(sub: &mut Subscriber, base: &str) -> Check {
    const PROBES: usize = 30;
    for probe in 0..PROBES {
        let (status, text) = post(base, &chat(&system(700 + probe, 300), "probe", false)).await?;
        ensure(status == 200, || format!("probe: {status}: {text}"))?;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
        loop {
            match tokio::time::timeout_at(deadline, sub.lines.recv()).await {
                Ok(Some(line)) => {
                    let message = line.contains("\"frames\"");
                    sub.read.push(line);
                    if message {
                        return Ok(());
                    }
                }
                Ok(None) => return Err("kv-events.py ended before it heard a message".into()),
                Err(_) => break,
            }
        }
    }
    Err(format!("kv-events.py heard none of {PROBES} probes"))
}

/// Every message `sub` printed, once it has ended.
fn messages(mut sub: Subscriber) -> Result<Vec<Value>, String> {
    sub.child.wait().map_err(|e| e.to_string())?;
    while let Some(line) = sub.lines.blocking_recv() {
        sub.read.push(line);
    }
    Ok(sub
        .read
        .iter()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v.get("frames").is_some())
        .collect())
}

/// The shape of every kind of event seen, by its tag, and of the messages around them.
fn event_shapes(msgs: &[Value]) -> BTreeMap<String, Value> {
    let mut out = BTreeMap::new();
    for m in msgs {
        let mut frame = m.clone();
        frame["batch"] = Value::Null;
        frame["seq"] = json!(0);
        out.insert("message".into(), shape(&frame));
        let batch = &m["batch"];
        let mut outer = batch.clone();
        if let Some(a) = outer.as_array_mut() {
            if a.len() > 1 {
                a[1] = json!([]);
            }
        }
        out.insert("batch".into(), shape(&outer));
        for e in batch[1].as_array().into_iter().flatten() {
            let tag = match e {
                Value::Object(o) => o.get("type").and_then(Value::as_str).unwrap_or("?"),
                Value::Array(a) => a.first().and_then(Value::as_str).unwrap_or("?"),
                _ => "?",
            };
            out.entry(tag.to_string()).or_insert_with(|| shape(e));
        }
    }
    out
}

/// Sends a conversation, then distinct prompts enough to make the cache evict, then empties it:
/// BlockStored, BlockRemoved and AllBlocksCleared each at least once.
async fn provoke_events(base: &str) -> Check {
    post(base, &chat(&system(3, 600), "first", false)).await?;
    for i in 0..10 {
        post(base, &chat(&system(100 + i, 900), "flood", false)).await?;
    }
    let url = format!("{base}/reset_prefix_cache");
    common::client()
        .post(&url)
        .send()
        .await
        .map_err(|e| format!("{url}: {e}"))?;
    Ok(())
}

/// An event with its long lists cut to their first three items, for the log.
fn abridged(e: Option<Value>) -> String {
    let Some(Value::Object(mut m)) = e else {
        return "none".into();
    };
    for v in m.values_mut() {
        if let Value::Array(a) = v {
            let n = a.len();
            a.truncate(3);
            if n > 3 {
                a.push(json!(format!("... {n} in all")));
            }
        }
    }
    Value::Object(m).to_string()
}

async fn sim_kv_events_match(fleet: &VllmFleet) -> Check {
    reset(fleet).await?;
    let sim = sim().await?;
    // Each subscriber stops at the reset that ends what is sent, 3 minutes at most.
    let seconds = 180;
    let mut real_sub = subscribe(&fleet.engines[0].kv_events, seconds)?;
    let mut sim_sub = subscribe(&sim.replicas[0].kv_events_endpoint(), seconds)?;
    joined(&mut sim_sub, &sim.replicas[0].url()).await?;
    joined(&mut real_sub, &fleet.engines[0].url).await?;
    provoke_events(&sim.replicas[0].url()).await?;
    provoke_events(&fleet.engines[0].url).await?;
    let (real, simulated) = tokio::task::spawn_blocking(move || {
        Ok::<_, String>((messages(real_sub)?, messages(sim_sub)?))
    })
    .await
    .map_err(|e| e.to_string())??;
    let (r, s) = (event_shapes(&real), event_shapes(&simulated));
    for kind in ["BlockStored", "BlockRemoved", "AllBlocksCleared"] {
        ensure(r.contains_key(kind), || {
            format!("vLLM published no {kind}: {r:?}")
        })?;
    }
    let mut diffs: Vec<String> = r
        .keys()
        .chain(s.keys())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .filter(|k| r.get(*k) != s.get(*k))
        .map(|k| format!("{k}: vLLM {:?}, sim {:?}", r.get(k), s.get(k)))
        .collect();
    // Sequence numbers count every batch since the engine started, one by one.
    for (who, msgs) in [("vLLM", &real), ("the sim", &simulated)] {
        let seqs: Vec<i64> = msgs.iter().filter_map(|m| m["seq"].as_i64()).collect();
        if seqs.windows(2).any(|w| w[1] != w[0] + 1) {
            diffs.push(format!("{who}'s seq numbers skip: {seqs:?}"));
        }
    }
    for kind in ["BlockStored", "BlockRemoved"] {
        let first = |msgs: &[Value]| {
            msgs.iter()
                .flat_map(|m| m["batch"][1].as_array().cloned().unwrap_or_default())
                .find(|e| e["type"] == kind)
        };
        eprintln!(
            "  first {kind}: vLLM {}\n  sim {}",
            abridged(first(&real)),
            abridged(first(&simulated))
        );
    }
    ensure(diffs.is_empty(), || diffs.join("; "))
}

// ---------------------------------------------------------------------------------------------
// kvroute in front of the engines.

fn addr(url: &str) -> SocketAddr {
    url.trim_start_matches("http://")
        .parse()
        .expect("engine address")
}

async fn kvroute_envoy(fleet: &VllmFleet) -> Envoy {
    let config = json!({"stats_interval_ms": 200, "debug_header": true,
                        "eviction_grace_ms": 300});
    let backends = fleet.engines.iter().map(|e| addr(&e.url)).collect();
    common::kvroute_envoy_on(backends, config).await
}

async fn stat(envoy: &Envoy, name: &str) -> u64 {
    envoy.stat(name).await.ok().flatten().unwrap_or(0)
}

async fn usage_equals_engines(fleet: &VllmFleet, envoy: &Envoy) -> Check {
    reset(fleet).await?;
    let names = ["vllm:prompt_tokens_total", "vllm:prefix_cache_hits_total"];
    let before = [
        counters(fleet, names[0]).await?,
        counters(fleet, names[1]).await?,
    ];
    let responses = stat(envoy, Counter::UsageResponses.name()).await;
    let (p0, c0) = (
        stat(envoy, Counter::UsagePromptTokens.name()).await,
        stat(envoy, Counter::UsageCachedTokens.name()).await,
    );
    let mut per_endpoint_before = Vec::new();
    for e in &fleet.engines {
        let key = kvroute::usage::stat_segment(e.url.trim_start_matches("http://"));
        per_endpoint_before.push((
            stat(envoy, &Counter::UsagePromptTokens.of_endpoint(&key)).await,
            stat(envoy, &Counter::UsageCachedTokens.of_endpoint(&key)).await,
        ));
    }
    let url = envoy.url();
    let mut sent = 0;
    for g in 0..3 {
        for u in 0..3 {
            let body = chat(&system(10 + g, 500), &format!("user {u} asks"), u % 2 == 0);
            let (status, text) = post(&url, &body).await?;
            ensure(status == 200, || format!("{status}: {text}"))?;
            sent += 1;
        }
    }
    envoy
        .wait_for_stat(
            Counter::UsageResponses.name(),
            |v| v >= responses + sent,
            Duration::from_secs(10),
        )
        .await
        .map_err(|e| e.to_string())?;
    let after = [
        counters(fleet, names[0]).await?,
        counters(fleet, names[1]).await?,
    ];
    let grew = |k: usize, i: usize| (after[k][i] - before[k][i]).round() as u64;
    let n = fleet.engines.len();
    let engines_prompt: u64 = (0..n).map(|i| grew(0, i)).sum();
    let engines_cached: u64 = (0..n).map(|i| grew(1, i)).sum();
    let prompt = stat(envoy, Counter::UsagePromptTokens.name()).await - p0;
    let cached = stat(envoy, Counter::UsageCachedTokens.name()).await - c0;
    ensure(prompt == engines_prompt && cached == engines_cached, || {
        format!(
            "kvroute counted {prompt} prompt / {cached} cached tokens, the engines {engines_prompt} / {engines_cached}"
        )
    })?;
    ensure(cached > 0, || "nothing was cached".into())?;
    for (i, e) in fleet.engines.iter().enumerate() {
        let key = kvroute::usage::stat_segment(e.url.trim_start_matches("http://"));
        let p = stat(envoy, &Counter::UsagePromptTokens.of_endpoint(&key)).await;
        let c = stat(envoy, &Counter::UsageCachedTokens.of_endpoint(&key)).await;
        let (p, c) = (p - per_endpoint_before[i].0, c - per_endpoint_before[i].1);
        ensure(p == grew(0, i) && c == grew(1, i), || {
            format!(
                "engine {i}: kvroute counted {p} / {c}, the engine {} / {}",
                grew(0, i),
                grew(1, i)
            )
        })?;
    }
    Ok(())
}

async fn group_stays(fleet: &VllmFleet, envoy: &Envoy) -> Check {
    reset(fleet).await?;
    let url = envoy.url();
    for g in [20, 21] {
        let mut replicas = Vec::new();
        for u in 0..5 {
            let before = counters(fleet, "vllm:request_success_total").await?;
            let body = chat(&system(g, 500), &format!("user {u}: a question"), false);
            let (status, text) = post(&url, &body).await?;
            ensure(status == 200, || format!("{status}: {text}"))?;
            replicas.push(served_by(fleet, &before).await?);
        }
        ensure(replicas.iter().all(|&r| r == replicas[0]), || {
            format!("group {g}'s requests went to {replicas:?}")
        })?;
    }
    Ok(())
}

/// A conversation kvroute placed on one engine; that engine then serves distinct prompts sent to
/// it directly (kvroute sees none of them) until the conversation's blocks are evicted; the
/// conversation's next turn, sent there by affinity, finds nothing cached, and kvroute counts the
/// eviction.
async fn eviction_noticed(fleet: &VllmFleet, envoy: &Envoy) -> Check {
    reset(fleet).await?;
    let url = envoy.url();
    let seen = stat(envoy, Counter::EvictionsSeen.name()).await;
    let system = system(30, 500);
    let first = chat(&system, &"my order has not arrived. ".repeat(60), false);
    let before = counters(fleet, "vllm:request_success_total").await?;
    let (status, text) = post(&url, &first).await?;
    ensure(status == 200, || format!("{status}: {text}"))?;
    let home = served_by(fleet, &before).await?;
    let answer = serde_json::from_str::<Value>(&text).map_err(|e| e.to_string())?;
    let reply = answer["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or("")
        .to_string();
    let mut second = first.clone();
    if let Some(m) = second["messages"].as_array_mut() {
        m.push(json!({"role": "assistant", "content": reply}));
        m.push(json!({"role": "user", "content": "any news?"}));
    }
    // The scenario itself, not a wait for an event: the second turn is routed more than the
    // eviction grace (300 ms) after the first, so what its engine reports counts.
    tokio::time::sleep(Duration::from_millis(600)).await;
    // 10 distinct prompts of ~900 tokens: more than the engine's 6144-token cache.
    for i in 0..10 {
        let body = chat(&self::system(200 + i, 900), "flood", false);
        post(&fleet.engines[home].url, &body).await?;
    }
    let before = counters(fleet, "vllm:request_success_total").await?;
    let resp = common::client()
        .post(format!("{url}/v1/chat/completions"))
        .json(&second)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let decision = resp
        .headers()
        .get("x-kvroute-decision")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let body: Value = resp.json().await.map_err(|e| e.to_string())?;
    let cached = body["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
    let there = served_by(fleet, &before).await?;
    // With two engines the group's home is where its first request went too: `home` or
    // `affinity`, what matters is that the map still sent it there.
    ensure(there == home, || {
        format!("the second turn went to {there} ({decision}), not to {home}")
    })?;
    ensure(cached.unwrap_or(0) < BLOCK_SIZE * 2, || {
        format!("the engine still had {cached:?} tokens cached: not evicted")
    })?;
    envoy
        .wait_for_stat(
            Counter::EvictionsSeen.name(),
            |v| v > seen,
            Duration::from_secs(10),
        )
        .await
        .map_err(|e| format!("kvroute did not notice: {e}"))?;
    Ok(())
}

/// 24 requests (plain answers: Envoy retries a request whose engine went away before answering;
/// a stream's headers would have gone out already), four at a time; one engine is killed after
/// the sixth answer. Every request must be answered.
async fn kill_under_load(fleet: &mut VllmFleet, envoy: &Envoy) -> Check {
    reset(fleet).await?;
    let url = envoy.url();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    let (tx, rx) = tokio::sync::watch::channel(());
    for w in 0..4 {
        let (url, done, _rx) = (url.clone(), done.clone(), rx.clone());
        tasks.spawn(async move {
            let mut failures = Vec::new();
            for k in 0..6 {
                let body = chat(
                    &system(40 + (w * 6 + k) % 5, 600),
                    &format!("q {w}.{k}"),
                    false,
                );
                match post(&url, &body).await {
                    Ok((200, _)) => {}
                    Ok((s, t)) => failures.push(format!("{s}: {}", &t[..t.len().min(200)])),
                    Err(e) => failures.push(e),
                }
                done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            failures
        });
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while done.load(std::sync::atomic::Ordering::Relaxed) < 6 {
        if tokio::time::Instant::now() > deadline {
            return Err("six answers took over two minutes".into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    fleet.kill(1);
    drop(tx);
    let mut failures = Vec::new();
    while let Some(r) = tasks.join_next().await {
        failures.extend(r.map_err(|e| e.to_string())?);
    }
    ensure(failures.is_empty(), || {
        format!("{} of 24 requests failed: {failures:?}", failures.len())
    })
}
