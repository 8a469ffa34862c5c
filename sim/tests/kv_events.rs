//! End-to-end: a request on a replica shows up as a BlockStored event on its ZMQ socket, a
//! salted one with its `cache_salt` in the first block's extra keys, as vLLM publishes it (checked
//! against vLLM's own classes when the vLLM venv `make vllm` installs is there); a message the
//! stream dropped is resent by the replica's replay socket.

use crate::common;

use common::{fast_fleet, field, joined, next_message, post, replay_from, tokens_of};
use kvroute_sim::fleet::ReplicaHandle;
use rmpv::Value;
use serde_json::json;
use std::path::PathBuf;
use zeromq::SubSocket;

/// A subscriber that has joined `replica`'s KV events (each probe a reset of its empty prefix
/// cache, which publishes one `AllBlocksCleared`), and the number of the next message.
async fn subscriber(replica: &ReplicaHandle) -> (SubSocket, u64) {
    let probe = |_| replica.replica.reset_prefix_cache();
    joined(replica.kv_events_addr, "kv-events", probe).await
}

#[tokio::test]
async fn request_publishes_block_stored_with_the_prompt_tokens() {
    let fleet = fast_fleet(1).await;
    let (mut sub, next) = subscriber(&fleet.replicas[0]).await;

    let base = fleet.replicas[0].url();
    let prompt = "alpha beta gamma delta ".repeat(10);
    let tokens = tokens_of(&base, &prompt).await;
    post(
        &format!("{base}/v1/completions"),
        &json!({"prompt": prompt, "max_tokens": 1}).to_string(),
    )
    .await;

    let frames = next_message(&mut sub).await;
    assert_eq!(frames[0], b"kv-events");
    assert_eq!(frames[1], next.to_be_bytes());
    let batch = rmpv::decode::read_value(&mut &frames[2][..]).unwrap();
    let event = &batch.as_array().unwrap()[1].as_array().unwrap()[0];
    assert_eq!(field(event, "type").as_str(), Some("BlockStored"));
    assert!(field(event, "parent_block_hash").is_nil());
    let full = tokens.len() / 16 * 16;
    let ids: Vec<u64> = field(event, "token_ids")
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    assert_eq!(ids, tokens[..full]);
    assert_eq!(
        field(event, "block_hashes").as_array().unwrap().len(),
        full / 16
    );
}

#[tokio::test]
async fn a_message_dropped_from_the_stream_is_resent_by_the_replay_socket() {
    let fleet = fast_fleet(1).await;
    let replica = &fleet.replicas[0];
    let (mut sub, next) = subscriber(replica).await;
    let faults = format!("http://{}/fleet/replica/0", fleet.control_addr);
    let set = post(&faults, r#"{"drop_kv_events": 1}"#).await.json();
    assert_eq!(set["drop_kv_events"], 1);

    let url = format!("{}/v1/completions", replica.url());
    for text in ["first prompt ", "second prompt "] {
        let body = json!({"prompt": text.repeat(20), "max_tokens": 1});
        post(&url, &body.to_string()).await;
    }
    let frames = next_message(&mut sub).await;
    assert_eq!(
        frames[1],
        (next + 1).to_be_bytes(),
        "message {next} was dropped"
    );
    let second = first_event(&frames[2]);

    let replay = replica.kv_events_replay_addr.expect("a replay socket");
    let mut replayed = Vec::new();
    for frames in replay_from(replay, next).await {
        assert_eq!((&frames[0], &frames[1]), (&vec![], &b"kv-events".to_vec()));
        replayed.push((frames[2].clone(), first_event(&frames[3])));
    }
    assert_eq!(replayed.len(), 2, "both messages: {replayed:?}");
    assert_eq!(replayed[0].0, next.to_be_bytes());
    assert_eq!(field(&replayed[0].1, "type").as_str(), Some("BlockStored"));
    assert_ne!(replayed[0].1, second);
    assert_eq!(replayed[1], ((next + 1).to_be_bytes().to_vec(), second));
}

/// The payload of the next message on `sub`.
async fn next_payload(sub: &mut SubSocket) -> Vec<u8> {
    next_message(sub).await.swap_remove(2)
}

fn first_event(payload: &[u8]) -> Value {
    let batch = rmpv::decode::read_value(&mut &payload[..]).unwrap();
    batch.as_array().unwrap()[1].as_array().unwrap()[0].clone()
}

/// The vLLM venv `make vllm` installs: `$KVROUTE_VLLM_VENV`, else `.work/vllm` in the workspace.
fn vllm_venv() -> PathBuf {
    std::env::var_os("KVROUTE_VLLM_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join(".work/vllm"))
}

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the sim is in the workspace")
        .to_path_buf()
}

/// The vLLM venv's python, or `None` where `make vllm` has not run (saying what goes `unchecked`).
fn vllm_python(unchecked: &str) -> Option<PathBuf> {
    let python = vllm_venv().join("bin/python");
    if python.is_file() {
        return Some(python);
    }
    eprintln!(
        "vLLM not installed at {} (make vllm): {unchecked}",
        vllm_venv().display()
    );
    None
}

/// Runs `tools/real/<script>` with `python` (the vLLM venv's), `args` and `stdin`, and fails the
/// test with the script's output, after `disagreement`, unless it succeeds.
async fn vllm_agrees(
    python: PathBuf,
    script: &str,
    args: &[&str],
    stdin: Vec<u8>,
    disagreement: &str,
) {
    let script = workspace().join("tools/real").join(script);
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    let out = tokio::task::spawn_blocking(move || {
        use std::io::Write;
        let mut child = std::process::Command::new(python)
            .arg(script)
            .args(args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("the vLLM venv's python starts");
        child.stdin.take().unwrap().write_all(&stdin).unwrap();
        child.wait_with_output().unwrap()
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "{disagreement}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test]
async fn a_salted_prompt_publishes_its_salt_as_the_first_blocks_extra_key() {
    let fleet = fast_fleet(1).await;
    let (mut sub, _) = subscriber(&fleet.replicas[0]).await;

    let base = fleet.replicas[0].url();
    let prompt = "alpha beta gamma delta ".repeat(10);
    let send = |body: serde_json::Value| {
        let url = format!("{base}/v1/completions");
        async move { post(&url, &body.to_string()).await }
    };
    let unsalted = send(json!({"prompt": prompt, "max_tokens": 1}))
        .await
        .json();
    let plain = first_event(&next_payload(&mut sub).await);
    let salted = send(json!({"prompt": prompt, "max_tokens": 1, "cache_salt": "tenant-1"}))
        .await
        .json();
    let payload = next_payload(&mut sub).await;
    let event = first_event(&payload);

    // The same token ids, in other blocks: the salt keys the first block, not a token.
    assert_eq!(field(&event, "token_ids"), field(&plain, "token_ids"));
    assert!(field(&event, "parent_block_hash").is_nil());
    let hashes = |e: &Value| field(e, "block_hashes").as_array().unwrap().clone();
    let (salted_hashes, plain_hashes) = (hashes(&event), hashes(&plain));
    assert!(salted_hashes.len() >= 2, "{event}");
    assert!(salted_hashes.iter().all(|h| !plain_hashes.contains(h)));
    // Nothing cached for the salted prompt: the unsalted blocks are not its own.
    assert_eq!(
        unsalted["usage"]["prompt_tokens"],
        salted["usage"]["prompt_tokens"]
    );
    assert_eq!(salted["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let mut want = vec![Value::Array(vec![Value::from("tenant-1")])];
    want.resize(salted_hashes.len(), Value::Nil);
    assert_eq!(field(&event, "extra_keys").as_array().unwrap(), &want);
    let unsalted_keys = field(&plain, "extra_keys").as_array().unwrap().clone();
    assert!(unsalted_keys.iter().all(Value::is_nil));

    // The same salt again finds its blocks cached.
    let again = send(json!({"prompt": prompt, "max_tokens": 1, "cache_salt": "tenant-1"}))
        .await
        .json();
    let full = salted_hashes.len() as u64 * 16;
    assert_eq!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
        Some(full.min(again["usage"]["prompt_tokens"].as_u64().unwrap() - 1) / 16 * 16)
    );

    let Some(python) = vllm_python("the message is not checked against vLLM's classes") else {
        return;
    };
    let args = ["tenant-1"];
    vllm_agrees(
        python,
        "check-kv-event.py",
        &args,
        payload,
        "vLLM's classes disagree",
    )
    .await;
}

#[tokio::test]
async fn the_replay_socket_answers_a_libzmq_dealer_as_vllms_does() {
    let Some(python) = vllm_python("the replay socket is not checked against vLLM's") else {
        return;
    };
    let fleet = fast_fleet(1).await;
    let replica = &fleet.replicas[0];
    let (mut sub, _) = subscriber(replica).await;
    let body = json!({"prompt": "replayed prompt ".repeat(20), "max_tokens": 1});
    post(
        &format!("{}/v1/completions", replica.url()),
        &body.to_string(),
    )
    .await;
    next_payload(&mut sub).await;

    let replay = replica
        .kv_events_replay_endpoint()
        .expect("a replay socket");
    let args = [replay.as_str(), "kv-events"];
    vllm_agrees(
        python,
        "check-replay.py",
        &args,
        Vec::new(),
        "the replay sockets differ",
    )
    .await;
}
