//! Requests kvroute cannot route still reach a backend byte for byte, the client gets the whole
//! response, and the matching fallback counter moves; streamed responses are not disturbed.

use crate::common;

use common::{chat_body, debug_config, kv_stat, served_by, system_prompt, Fleet};
use kvroute::gateway::stat_names;
use kvroute::router::Fallback;
use kvroute_harness::backend;

/// Sends `body` to `path` and checks it arrived unchanged, was answered in full, and was
/// counted as a fallback for `reason` (and reported so in the debug header).
async fn assert_passes_through(fleet: &Fleet, path: &str, body: Vec<u8>, reason: Fallback) {
    let counter = stat_names::fallback(reason);
    let before = kv_stat(fleet, &counter).await;
    let reply = fleet
        .post(path, body.clone(), &[("content-type", "application/json")])
        .await;
    let index = served_by(fleet, &reply);
    let chat = path == "/v1/chat/completions";
    assert_eq!(
        reply.body,
        backend::json_response(index, chat).as_bytes(),
        "truncated or altered response"
    );
    let got = fleet.backends[index]
        .take_requests()
        .pop()
        .expect("backend recorded the request");
    assert_eq!(got.body.len(), body.len());
    assert!(got.body == body, "body bytes changed on the way");
    assert_eq!(
        reply.decision.as_deref(),
        Some(format!("fallback:{}", reason.name()).as_str())
    );
    assert_eq!(kv_stat(fleet, &counter).await, before + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unparseable_bodies_pass_through_unchanged() {
    let fleet = Fleet::kvroute(2, debug_config(), |_| {}).await;
    let chat = "/v1/chat/completions";
    assert_passes_through(
        &fleet,
        chat,
        b"this is not json".to_vec(),
        Fallback::BadJson,
    )
    .await;
    // Invalid UTF-8 where kvroute reads a name is no JSON string kvroute can read.
    let body = b"{\"model\":\"\xff\",\"prompt\":\"p\"}".to_vec();
    assert_passes_through(&fleet, "/v1/completions", body, Fallback::BadJson).await;
    let deep = format!(
        "{{\"model\":\"m\",\"messages\":{}{}}}",
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    assert_passes_through(&fleet, chat, deep.into_bytes(), Fallback::BadJson).await;
    assert_passes_through(
        &fleet,
        chat,
        br#"{"model":"m"}"#.to_vec(),
        Fallback::NoPrompt,
    )
    .await;
    assert_passes_through(
        &fleet,
        "/v1/completions",
        br#"{"prompt":"no model here"}"#.to_vec(),
        Fallback::NoModel,
    )
    .await;
}

/// Invalid UTF-8 inside a prompt is hashed as its bytes and routed like any prompt (the engine
/// answers it); the bytes reach the backend unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_utf8_in_a_prompt_is_routed_and_arrives_unchanged() {
    let fleet = Fleet::kvroute(2, debug_config(), |_| {}).await;
    let bodies: [(&str, &[u8]); 2] = [
        (
            "/v1/chat/completions",
            b"{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"\xff\xfe\"}]}",
        ),
        (
            "/v1/completions",
            b"{\"model\":\"m\",\"prompt\":\"caf\xe9\"}",
        ),
    ];
    for (path, body) in bodies {
        let reply = fleet
            .post(path, body.to_vec(), &[("content-type", "application/json")])
            .await;
        let decision = reply.decision.clone().unwrap_or_default();
        assert!(
            !decision.is_empty() && !decision.starts_with("fallback"),
            "{path}: decision {decision:?}"
        );
        let index = served_by(&fleet, &reply);
        let got = fleet.backends[index]
            .take_requests()
            .pop()
            .expect("backend recorded the request");
        assert!(got.body == body, "{path}: body bytes changed on the way");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_body_passes_through() {
    let fleet = Fleet::kvroute(2, debug_config(), |_| {}).await;
    assert_passes_through(
        &fleet,
        "/v1/chat/completions",
        Vec::new(),
        Fallback::EmptyBody,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_megabyte_body_passes_through_unrouted() {
    let fleet = Fleet::kvroute(2, debug_config(), |_| {}).await;
    let question = "x".repeat(10 << 20);
    let body = chat_body(&system_prompt(1), &question, false)
        .to_string()
        .into_bytes();
    assert!(body.len() > 10 << 20);
    // Several times: how Envoy buffers depends on whether an upstream connection is already open.
    for _ in 0..3 {
        assert_passes_through(
            &fleet,
            "/v1/chat/completions",
            body.clone(),
            Fallback::BodyTooLarge,
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_and_other_paths_pass_through() {
    let fleet = Fleet::kvroute(2, debug_config(), |_| {}).await;
    let before = kv_stat(&fleet, &stat_names::fallback(Fallback::Method)).await;
    let reply = fleet.get("/v1/models?x=1", &[]).await;
    let index = served_by(&fleet, &reply);
    assert_eq!(reply.body, br#"{"data":[{"id":"test"}]}"#);
    assert_eq!(reply.decision.as_deref(), Some("fallback:method"));
    let got = fleet.backends[index].take_requests().pop().unwrap();
    assert_eq!(
        (got.method.as_str(), got.path.as_str()),
        ("GET", "/v1/models?x=1")
    );
    assert_eq!(
        kv_stat(&fleet, &stat_names::fallback(Fallback::Method)).await,
        before + 1
    );

    let before = kv_stat(&fleet, &stat_names::fallback(Fallback::Path)).await;
    let reply = fleet
        .post("/v1/embeddings", r#"{"model":"m","input":"hi"}"#, &[])
        .await;
    assert_eq!(reply.status, 404, "the backend's own answer must come back");
    assert_eq!(reply.decision.as_deref(), Some("fallback:path"));
    assert_eq!(
        kv_stat(&fleet, &stat_names::fallback(Fallback::Path)).await,
        before + 1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_responses_arrive_whole_for_both_apis() {
    let fleet = Fleet::kvroute(2, debug_config(), |_| {}).await;
    let chat = fleet
        .chat(&chat_body(&system_prompt(3), "stream it", true))
        .await;
    let index = served_by(&fleet, &chat);
    assert_eq!(
        String::from_utf8(chat.body).unwrap(),
        backend::sse_events(index, true).concat()
    );
    assert_eq!(chat.decision.as_deref(), Some("home"));

    let body =
        serde_json::json!({ "model": "m", "prompt": system_prompt(4), "stream": true }).to_string();
    let reply = fleet
        .post(
            "/v1/completions",
            body.clone(),
            &[("content-type", "application/json")],
        )
        .await;
    let index = served_by(&fleet, &reply);
    assert_eq!(
        String::from_utf8(reply.body).unwrap(),
        backend::sse_events(index, false).concat()
    );
    assert!(
        !reply.decision.unwrap().starts_with("fallback"),
        "a streaming request is routable"
    );
    assert_eq!(
        fleet.backends[index].requests().last().unwrap().body,
        body.as_bytes()
    );
}
