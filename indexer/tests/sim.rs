//! Against the simulator with its real (byte-level BPE) tokenizer, over real sockets: the keys
//! an indexer serves for a replica are `kvroute::prefix`'s over the replica's rendered prompt
//! bytes, for every whole chunk its stored blocks cover and nothing past them (a salted prompt's
//! seeded by its `cache_salt`, as the filter seeds them); evictions and cache resets take keys
//! away; several indexers on one publisher agree. The indexer runs with its default
//! `--stale-after` and every replica's replay socket: a replica idle past the silence is probed
//! and stays fresh (stale while stopped: its replay socket no longer answers), and a message its
//! stream dropped is filled from the replay socket.

use crate::common;

use common::{
    default_stale_after, get_json, indexer, post_json, tokenizer_file, whole_chunk_keys, Deadline,
    FeedClient,
};
use kvroute_indexer::token_bytes::TokenBytes;
use kvroute_indexer::Running;
use kvroute_sim::bpe::Vocab;
use kvroute_sim::fleet::Fleet;
use kvroute_sim::spec::FleetSpec;
use serde_json::{json, Value};
use std::collections::BTreeSet;

const CHUNK: usize = 512;

async fn fleet(replicas: usize, block_size: usize, kv_capacity_tokens: usize) -> Fleet {
    fleet_in(replicas, block_size, kv_capacity_tokens, "map").await
}

/// A fleet publishing events in `format` ("map" or "array").
async fn fleet_in(
    replicas: usize,
    block_size: usize,
    kv_capacity_tokens: usize,
    format: &str,
) -> Fleet {
    let spec = FleetSpec {
        kv_events_format: format.into(),
        replicas,
        block_size,
        kv_capacity_tokens,
        model: "m".into(),
        time_scale: 0.001,
        tokenizer: Some(tokenizer_file().to_string_lossy().into_owned()),
        ..FleetSpec::default()
    };
    Fleet::start(spec, 0, 0).await.expect("fleet starts")
}

/// Every replica: its endpoint, KV-event and replay sockets.
fn engines(fleet: &Fleet) -> Vec<(String, String, Option<String>)> {
    fleet
        .replicas
        .iter()
        .map(|r| {
            let replay = r.kv_events_replay_endpoint();
            assert!(
                replay.is_some(),
                "the sim gives each replica a replay socket"
            );
            (r.addr.to_string(), r.kv_events_endpoint(), replay)
        })
        .collect()
}

/// Waits until every stream of the indexer at `base` has taken a message (the publisher
/// drops messages until a subscription reaches it), sending small requests meanwhile, then
/// resets the replicas' caches and waits until the indexer holds nothing.
async fn settle(fleet: &Fleet, bases: &[String]) {
    let mut probe = 0;
    for base in bases {
        let deadline = Deadline::start();
        loop {
            probe += 1;
            for r in &fleet.replicas {
                let prompt = format!("probe {probe} {}", "word ".repeat(400));
                let body = json!({"prompt": prompt, "max_tokens": 1});
                post_json(&format!("{}/v1/completions", r.url()), &body).await;
            }
            let health = get_json(&format!("{base}/health")).await;
            let streams = health["streams"].as_array().unwrap();
            if streams.iter().all(|s| !s["next_seq"].is_null()) {
                break;
            }
            deadline
                .tick(|| format!("every stream to take a message: {health}"))
                .await;
        }
    }
    for r in &fleet.replicas {
        post_json(&format!("{}/reset_prefix_cache", r.url()), &Value::Null).await;
    }
    for base in bases {
        let mut client = FeedClient::default();
        let deadline = Deadline::start();
        loop {
            client.poll(base).await;
            if client.endpoints.iter().all(|e| client.held(e).is_empty()) {
                break;
            }
            deadline
                .tick(|| "the reset to empty the index".into())
                .await;
        }
    }
}

/// An indexer (`--stale-after` `stale_after`) following every replica of `fleet`, settled
/// ([`settle`]): it, and its base URL.
async fn following(fleet: &Fleet, stale_after: f64) -> (Running, String) {
    let idx = indexer(&engines(fleet), CHUNK, stale_after).await;
    let base = format!("http://{}", idx.addr);
    settle(fleet, std::slice::from_ref(&base)).await;
    (idx, base)
}

/// A long chat whose text has multi-byte characters everywhere.
fn chat(tag: &str) -> Value {
    let system: String = (0..120)
        .map(|i| format!("Règle {i} de {tag}: le café coûte {i}€, 漢字{i} 🙂. "))
        .collect();
    json!({"model": "m", "max_tokens": 5, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": format!("Question {tag}: où est la gare?")}]})
}

/// What a replica caches for `body` after answering it: its rendered prompt and answer, as
/// token ids and as bytes, cut to the whole blocks.
async fn covered(fleet: &Fleet, replica: usize, body: &Value, block: usize) -> Vec<u8> {
    let url = fleet.replicas[replica].url();
    let reply = post_json(&format!("{url}/v1/chat/completions"), body).await;
    let answer = reply["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    let rendered = post_json(&format!("{url}/v1/chat/completions/render"), body).await;
    let prompt = rendered["prompt"].as_str().unwrap().to_owned();
    let mut ids: Vec<u32> = rendered["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    let vocab = Vocab::load(&tokenizer_file()).unwrap();
    ids.extend(vocab.tokenize(&answer));
    ids.truncate(ids.len() / block * block);
    let mut bytes = Vec::new();
    TokenBytes::load(&tokenizer_file())
        .unwrap()
        .decode(&ids, &mut bytes)
        .unwrap();
    let text = format!("{prompt}{answer}");
    assert!(
        text.as_bytes().starts_with(&bytes),
        "the blocks' bytes are the rendered prompt's"
    );
    assert!(bytes.len() > 4 * CHUNK && bytes.len() < text.len() + block * 4);
    bytes
}

/// kvroute's keys for every whole chunk of `bytes`.
fn keys(bytes: &[u8]) -> BTreeSet<u64> {
    salted_keys(None, bytes)
}

/// kvroute's keys for every whole chunk of `bytes` of a request with the cache salt `salt`.
fn salted_keys(salt: Option<&str>, bytes: &[u8]) -> BTreeSet<u64> {
    whole_chunk_keys(salt, "m", bytes, CHUNK)
}

async fn held_becomes(base: &str, endpoint: &str, want: &BTreeSet<u64>) -> FeedClient {
    let mut client = FeedClient::default();
    let deadline = Deadline::start();
    loop {
        client.poll(base).await;
        let held = client.held(endpoint);
        if held == *want {
            return client;
        }
        deadline
            .tick(|| {
                format!(
                    "{endpoint} holds {} keys, {} expected; {} missing, {} extra",
                    held.len(),
                    want.len(),
                    want.difference(&held).count(),
                    held.difference(want).count()
                )
            })
            .await;
    }
}

async fn keys_match_the_rendered_prompt(block: usize, format: &str) {
    let fleet = fleet_in(2, block, 1 << 20, format).await;
    let (_idx, base) = following(&fleet, default_stale_after()).await;
    let bytes = covered(&fleet, 0, &chat("a"), block).await;
    let want = keys(&bytes);
    let (a, b) = (
        fleet.replicas[0].addr.to_string(),
        fleet.replicas[1].addr.to_string(),
    );
    let client = held_becomes(&base, &a, &want).await;
    assert!(
        client.held(&b).is_empty(),
        "the other replica holds nothing"
    );
    // A second conversation on replica 1 shows up there, and not on replica 0.
    let other = covered(&fleet, 1, &chat("b"), block).await;
    held_becomes(&base, &b, &keys(&other)).await;
    held_becomes(&base, &a, &want).await;
    let metrics = common::http(hyper::Method::GET, &format!("{base}/metrics"), "")
        .await
        .1;
    assert!(
        metrics.contains("kvroute_indexer_clears_total{"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_match_the_rendered_prompt_with_16_token_blocks() {
    keys_match_the_rendered_prompt(16, "map").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_match_the_rendered_prompt_in_the_older_array_format() {
    keys_match_the_rendered_prompt(16, "array").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_match_the_rendered_prompt_with_128_token_blocks() {
    keys_match_the_rendered_prompt(128, "map").await;
}

/// `chat(tag)` under vLLM's `cache_salt` `salt`.
fn salted_chat(tag: &str, salt: &str) -> Value {
    let mut body = chat(tag);
    body["cache_salt"] = json!(salt);
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_salted_prompts_are_held_under_its_salts_keys() {
    let fleet = fleet(2, 16, 1 << 20).await;
    let (_idx, base) = following(&fleet, default_stale_after()).await;
    let (a, b) = (
        fleet.replicas[0].addr.to_string(),
        fleet.replicas[1].addr.to_string(),
    );
    // Two requests of tenant 1 on replica 0: the second finds the first's blocks.
    let first = covered(&fleet, 0, &salted_chat("a", "tenant-1"), 16).await;
    let url = format!("{}/v1/chat/completions", fleet.replicas[0].url());
    let again = post_json(&url, &salted_chat("a", "tenant-1")).await;
    let cached = again["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
    assert!(cached > Some(1000), "the same tenant shares: {again}");
    let want = salted_keys(Some("tenant-1"), &first);
    assert!(want.is_disjoint(&keys(&first)), "the salt seeds every key");
    let client = held_becomes(&base, &a, &want).await;
    assert!(
        client.held(&b).is_empty(),
        "the other replica holds nothing"
    );
    // Another tenant's request for the same text on replica 1 is held under its own keys.
    let other = covered(&fleet, 1, &salted_chat("a", "tenant-2"), 16).await;
    let other_keys = salted_keys(Some("tenant-2"), &other);
    assert!(other_keys.is_disjoint(&want));
    held_becomes(&base, &b, &other_keys).await;
    held_becomes(&base, &a, &want).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_and_reset_take_keys_away() {
    // Room for one and a half long chats: the second evicts part of the first.
    let fleet = fleet(1, 16, 7000).await;
    let (_idx, base) = following(&fleet, default_stale_after()).await;
    let endpoint = fleet.replicas[0].addr.to_string();
    let first = keys(&covered(&fleet, 0, &chat("a"), 16).await);
    held_becomes(&base, &endpoint, &first).await;
    let second = keys(&covered(&fleet, 0, &chat("b"), 16).await);
    let mut client = FeedClient::default();
    let deadline = Deadline::start();
    loop {
        client.poll(&base).await;
        if second.is_subset(&client.held(&endpoint)) {
            break;
        }
        deadline.tick(|| "the second chat's keys".into()).await;
    }
    let held = client.held(&endpoint);
    let union: BTreeSet<u64> = first.union(&second).copied().collect();
    assert!(held.is_subset(&union), "nothing but the two chats' keys");
    assert!(
        !first.is_subset(&held),
        "the second chat evicted some of the first"
    );
    let metrics = common::http(hyper::Method::GET, &format!("{base}/metrics"), "")
        .await
        .1;
    let removed: u64 = metrics
        .lines()
        .find(|l| l.starts_with("kvroute_indexer_blocks_removed_total{"))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap();
    assert!(removed > 0);
    post_json(
        &format!("{}/reset_prefix_cache", fleet.replicas[0].url()),
        &Value::Null,
    )
    .await;
    held_becomes(&base, &endpoint, &BTreeSet::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_indexers_and_their_clients_agree() {
    let fleet = fleet(2, 16, 1 << 20).await;
    let mut bases = Vec::new();
    let mut running = Vec::new();
    for _ in 0..3 {
        let idx = indexer(&engines(&fleet), CHUNK, default_stale_after()).await;
        bases.push(format!("http://{}", idx.addr));
        running.push(idx);
    }
    settle(&fleet, &bases).await;
    let want = keys(&covered(&fleet, 1, &chat("c"), 16).await);
    let endpoint = fleet.replicas[1].addr.to_string();
    let mut early = Vec::new();
    for base in &bases {
        early.push(held_becomes(base, &endpoint, &want).await);
    }
    // Two clients of one indexer, one polling since its version and one new: the same.
    let mut late = FeedClient::default();
    late.poll(&bases[0]).await;
    early[0].poll(&bases[0]).await;
    assert_eq!(late.held(&endpoint), early[0].held(&endpoint));
    assert_eq!(late.fulls, 1);
    assert_eq!(
        early[0].fulls, 1,
        "an up-to-date client gets changes, not snapshots"
    );
    assert!(running.iter().all(|r| r.shared.epoch != 0));
}

/// Answers every connection with Envoy's `/clusters?format=json` naming `hosts`.
async fn fake_envoy_admin(cluster: &str, hosts: Vec<std::net::SocketAddr>) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let statuses: Vec<Value> = hosts
        .iter()
        .map(|a| json!({"address": {"socket_address": {"address": a.ip().to_string(), "port_value": a.port()}}}))
        .collect();
    let body =
        json!({"cluster_statuses": [{"name": cluster, "host_statuses": statuses}]}).to_string();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let mut buf = [0u8; 4096];
            let _ = stream.read(&mut buf).await;
            let reply = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = stream.write_all(reply.as_bytes()).await;
        }
    });
    url
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_found_in_envoys_admin_are_indexed() {
    let fleet = fleet(1, 16, 1 << 20).await;
    let replica = &fleet.replicas[0];
    let admin = fake_envoy_admin("vllm", vec![replica.addr]).await;
    let mut config = common::config(&[], CHUNK, default_stale_after());
    config.discovery.envoy_admin = Some(admin);
    config.discovery.cluster = Some("vllm".into());
    config.discovery.kv_events_port = Some(replica.kv_events_addr.port());
    config.discovery.replay_port = replica.kv_events_replay_addr.map(|a| a.port());
    let idx = kvroute_indexer::start(config).await.unwrap();
    let base = format!("http://{}", idx.addr);
    let deadline = Deadline::start();
    loop {
        let health = get_json(&format!("{base}/health")).await;
        if health["streams"][0]["connected"] == json!(true) {
            assert_eq!(
                health["streams"][0]["endpoint"],
                json!(replica.addr.to_string())
            );
            break;
        }
        deadline
            .tick(|| format!("the engine to be found: {health}"))
            .await;
    }
    settle(&fleet, std::slice::from_ref(&base)).await;
    let bytes = covered(&fleet, 0, &chat("d"), 16).await;
    held_becomes(&base, &replica.addr.to_string(), &keys(&bytes)).await;
}

/// The sum of metric `name` over every stream in `/metrics` of the indexer at `base`.
async fn metric_sum(base: &str, name: &str) -> u64 {
    let text = common::http(hyper::Method::GET, &format!("{base}/metrics"), "")
        .await
        .1;
    let prefix = format!("kvroute_indexer_{name}{{");
    let values: Vec<u64> = text
        .lines()
        .filter(|l| l.starts_with(&prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
        .collect();
    assert!(!values.is_empty(), "no {name} in {text}");
    values.iter().sum()
}

/// Polls `client` until `check` holds of it.
async fn until(
    base: &str,
    client: &mut FeedClient,
    what: &str,
    check: impl Fn(&FeedClient) -> bool,
) {
    let deadline = Deadline::start();
    loop {
        client.poll(base).await;
        if check(client) {
            return;
        }
        deadline
            .tick(|| format!("{what}: stale {:?}", client.stale))
            .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_replicas_stay_fresh_while_their_replay_sockets_answer_probes() {
    let fleet = fleet(2, 16, 1 << 20).await;
    // A second of silence: each idle replica is probed about once a second.
    let (_idx, base) = following(&fleet, 1.0).await;
    let endpoint = fleet.replicas[0].addr.to_string();
    let want = keys(&covered(&fleet, 0, &chat("idle"), 16).await);
    held_becomes(&base, &endpoint, &want).await;
    let events = metric_sum(&base, "events_total").await;
    let probed = metric_sum(&base, "probes_total").await;
    // Three answered probes of each replica: seconds of silence, several times the limit.
    let deadline = Deadline::start();
    while metric_sum(&base, "probes_total").await < probed + 6 {
        deadline.tick(|| "six more answered probes".into()).await;
    }
    let mut client = FeedClient::default();
    until(&base, &mut client, "fresh, holding the chat", |c| {
        c.stale.is_empty() && c.held(&endpoint) == want
    })
    .await;
    assert_eq!(metric_sum(&base, "events_total").await, events, "all idle");
    assert_eq!(metric_sum(&base, "unanswered_probes_total").await, 0);
    assert_eq!(metric_sum(&base, "gaps_total").await, 0);

    // The same silence without replay sockets makes both replicas stale.
    let mute: Vec<_> = engines(&fleet)
        .into_iter()
        .map(|(endpoint, events, _)| (endpoint, events, None))
        .collect();
    let without = indexer(&mute, CHUNK, 1.0).await;
    let without = format!("http://{}", without.addr);
    settle(&fleet, std::slice::from_ref(&without)).await;
    let mut client = FeedClient::default();
    until(&without, &mut client, "both stale", |c| c.stale.len() == 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_the_stream_dropped_is_filled_from_the_replay_socket() {
    let fleet = fleet(2, 16, 1 << 20).await;
    let (_idx, base) = following(&fleet, default_stale_after()).await;
    let endpoint = fleet.replicas[0].addr.to_string();
    let faults = format!("http://{}/fleet/replica/0", fleet.control_addr);
    post_json(&faults, &json!({"drop_kv_events": 1})).await;
    // The first chat's message never reaches the indexer on the stream; the second's shows the
    // gap, and the replay socket fills it.
    let first = keys(&covered(&fleet, 0, &chat("lost"), 16).await);
    let second = keys(&covered(&fleet, 0, &chat("after"), 16).await);
    let want: BTreeSet<u64> = first.union(&second).copied().collect();
    let client = held_becomes(&base, &endpoint, &want).await;
    assert!(client.stale.is_empty(), "stale: {:?}", client.stale);
    assert_eq!(metric_sum(&base, "gaps_total").await, 1);
    assert_eq!(metric_sum(&base, "resyncs_total").await, 1);
    assert_eq!(metric_sum(&base, "drops_total").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_replica_leaves_probes_unanswered_and_is_stale_until_started() {
    let fleet = fleet(2, 16, 1 << 20).await;
    let (_idx, base) = following(&fleet, 1.0).await;
    let (stopped, running) = (
        fleet.replicas[0].addr.to_string(),
        fleet.replicas[1].addr.to_string(),
    );
    let faults = format!("http://{}/fleet/replica/0", fleet.control_addr);
    post_json(&faults, &json!({"stopped": true})).await;
    let mut client = FeedClient::default();
    until(&base, &mut client, "the stopped replica stale", |c| {
        c.stale == [stopped.clone()]
    })
    .await;
    assert!(metric_sum(&base, "unanswered_probes_total").await >= 1);
    assert!(!client.stale.contains(&running));
    post_json(&faults, &json!({"stopped": false})).await;
    until(&base, &mut client, "fresh again", |c| c.stale.is_empty()).await;
}
