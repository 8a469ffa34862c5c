//! End-to-end: the control API (state, oracle matches, fault knobs) and the binary's contract.

use crate::common;

use common::{call, fast_fleet, get, post};
use hyper::{Method, StatusCode};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

fn control(fleet: &kvroute_sim::fleet::Fleet, path: &str) -> String {
    format!("http://{}{path}", fleet.control_addr)
}

#[tokio::test]
async fn match_reports_cached_tokens_only_on_the_replica_that_served_the_prefix() {
    let fleet = fast_fleet(2).await;
    let request = json!({"messages": [{"role": "user", "content": "tell me about caches ".repeat(30)}], "max_tokens": 2});
    let served = post(
        &format!("{}/v1/chat/completions", fleet.replicas[1].url()),
        &request.to_string(),
    )
    .await;
    assert_eq!(served.replica(), Some("1"));
    let prompt_tokens = served.json()["usage"]["prompt_tokens"].as_u64().unwrap();

    let query = json!({"path": "/v1/chat/completions", "body": request});
    let matched = post(&control(&fleet, "/fleet/match"), &query.to_string())
        .await
        .json();
    assert_eq!(matched["prompt_tokens"].as_u64(), Some(prompt_tokens));
    let cached: Vec<u64> = matched["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["cached_tokens"].as_u64().unwrap())
        .collect();
    assert_eq!(cached, vec![0, (prompt_tokens - 1) / 16 * 16]);

    let state = get(&control(&fleet, "/fleet/state")).await.json();
    let r1 = &state["replicas"][1];
    assert_eq!(r1["requests"], 1);
    assert_eq!(r1["prefix_queries_tokens"].as_u64(), Some(prompt_tokens));
    assert_eq!(r1["healthy"], true);
    for key in ["id", "running", "waiting", "kv_usage", "prefix_hits_tokens"] {
        assert!(r1.get(key).is_some(), "missing {key}");
    }
    assert_eq!(state["replicas"][0]["requests"], 0);
}

#[tokio::test]
async fn fail_rate_one_turns_every_generation_into_a_500() {
    let fleet = fast_fleet(1).await;
    let set = post(
        &control(&fleet, "/fleet/replica/0"),
        r#"{"fail_rate": 1.0}"#,
    )
    .await;
    assert_eq!(set.status, StatusCode::OK);
    let reply = post(
        &format!("{}/v1/completions", fleet.replicas[0].url()),
        r#"{"prompt":"x"}"#,
    )
    .await;
    assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(reply.replica(), Some("0"));
    assert_eq!(
        get(&format!("{}/health", fleet.replicas[0].url()))
            .await
            .status,
        StatusCode::OK
    );
    let bad = post(&control(&fleet, "/fleet/replica/0"), r#"{"fail_rate": 2}"#).await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    let bad = post(
        &control(&fleet, "/fleet/replica/0"),
        r#"{"drop_kv_events": -1}"#,
    )
    .await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        post(&control(&fleet, "/fleet/replica/9"), "{}")
            .await
            .status,
        StatusCode::NOT_FOUND
    );
}

#[tokio::test]
async fn stopped_replica_refuses_connections_and_comes_back_on_the_same_port() {
    let fleet = fast_fleet(1).await;
    let health = format!("{}/health", fleet.replicas[0].url());
    post(&control(&fleet, "/fleet/replica/0"), r#"{"stopped": true}"#).await;
    let mut refused = false;
    for _ in 0..50 {
        if call(Method::GET, &health, None).await.is_err() {
            refused = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert!(refused, "listener should be closed while stopped");
    let state = get(&control(&fleet, "/fleet/state")).await.json();
    assert_eq!(state["replicas"][0]["healthy"], false);

    post(
        &control(&fleet, "/fleet/replica/0"),
        r#"{"stopped": false}"#,
    )
    .await;
    let mut back = false;
    for _ in 0..100 {
        if let Ok(reply) = call(Method::GET, &health, None).await {
            back = reply.status == StatusCode::OK;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert!(back, "replica should serve again after stopped=false");
}

#[tokio::test]
async fn slow_factor_makes_a_replica_slower() {
    let fleet = fast_fleet(2).await;
    post(
        &control(&fleet, "/fleet/replica/1"),
        r#"{"slow_factor": 200}"#,
    )
    .await;
    let body = json!({"prompt": "word ".repeat(1000), "max_tokens": 1}).to_string();
    let time = |url: String| {
        let body = body.clone();
        async move {
            let t = std::time::Instant::now();
            post(&format!("{url}/v1/completions"), &body).await;
            t.elapsed()
        }
    };
    // The prefill takes ~0.75 ms at time_scale 0.001, ~150 ms at 200 times slower. A
    // loaded machine can stretch the fast replica's answer (10 ms was seen) but never shorten the
    // slow one's, so the slow one is bounded from below and the fast one takes its best of three.
    let slow = time(fleet.replicas[1].url()).await;
    let mut fast = std::time::Duration::MAX;
    for _ in 0..3 {
        fast = fast.min(time(fleet.replicas[0].url()).await);
    }
    assert!(slow >= std::time::Duration::from_millis(100), "{slow:?}");
    assert!(fast * 3 < slow, "fast {fast:?}, slow {slow:?}");
}

#[test]
fn binary_prints_one_json_line_and_exits_on_stdin_eof() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute-sim"))
        .args([
            "--replicas",
            "3",
            "--time-scale",
            "0.01",
            "--exit-on-stdin-eof",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("binary starts");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(
        line.starts_with("{\"replicas\":[{\"id\":0,\"url\":\"http://127.0.0.1:"),
        "{line}"
    );
    let v: Value = serde_json::from_str(&line).unwrap();
    assert_eq!(v["replicas"].as_array().unwrap().len(), 3);
    assert!(v["replicas"][2]["kv_events"]
        .as_str()
        .unwrap()
        .starts_with("tcp://127.0.0.1:"));
    assert!(v["replicas"][2]["kv_events_replay"]
        .as_str()
        .unwrap()
        .starts_with("tcp://127.0.0.1:"));
    assert_ne!(
        v["replicas"][2]["kv_events_replay"],
        v["replicas"][2]["kv_events"]
    );
    assert!(v["control"]
        .as_str()
        .unwrap()
        .starts_with("http://127.0.0.1:"));
    drop(child.stdin.take());
    let status = child.wait().unwrap();
    assert!(status.success());
}
