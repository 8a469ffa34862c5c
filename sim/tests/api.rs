//! End-to-end: a replica's OpenAI API, served on 127.0.0.1, as a client sees it.

use crate::common;

use common::{fast_fleet, get, post};
use hyper::StatusCode;
use serde_json::{json, Value};

fn chat(content: &str, extra: Value) -> String {
    let mut body = json!({"model": "Qwen/Qwen3-32B",
                          "messages": [{"role": "system", "content": "You are a helpful assistant. ".repeat(20)},
                                       {"role": "user", "content": content}]});
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    body.to_string()
}

#[tokio::test]
async fn chat_completion_has_openai_shape_and_second_call_reports_cached_tokens() {
    let fleet = fast_fleet(1).await;
    let url = format!("{}/v1/chat/completions", fleet.replicas[0].url());
    let first = post(&url, &chat("What is a KV cache?", json!({"max_tokens": 4}))).await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.body);
    assert_eq!(first.replica(), Some("0"));
    let v = first.json();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    let usage = &v["usage"];
    assert_eq!(usage["completion_tokens"], 4);
    let prompt = usage["prompt_tokens"].as_u64().unwrap();
    assert_eq!(usage["total_tokens"].as_u64().unwrap(), prompt + 4);
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 0);

    let second = post(&url, &chat("What is a KV cache?", json!({"max_tokens": 4})))
        .await
        .json();
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert_eq!(cached, (prompt - 1) / 16 * 16);
    assert_eq!(
        second["choices"][0]["message"]["content"],
        v["choices"][0]["message"]["content"]
    );
}

#[tokio::test]
async fn completion_streams_one_chunk_per_token_then_usage_then_done() {
    let fleet = fast_fleet(1).await;
    let url = format!("{}/v1/completions", fleet.replicas[0].url());
    let body = json!({"prompt": "Once upon a time", "max_tokens": 12, "stream": true,
                      "stream_options": {"include_usage": true}, "ignore_eos": true});
    let reply = post(&url, &body.to_string()).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert!(reply.headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    assert_eq!(reply.replica(), Some("0"));
    let events: Vec<&str> = reply
        .body
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| e.strip_prefix("data: ").expect("SSE data line"))
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let (usage_chunk, token_chunks) = chunks.split_last().unwrap();
    assert_eq!(token_chunks.len(), 12);
    assert!(token_chunks
        .iter()
        .all(|c| c["object"] == "text_completion"));
    assert_eq!(token_chunks[11]["choices"][0]["finish_reason"], "length");
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_eq!(usage_chunk["usage"]["completion_tokens"], 12);
    assert_eq!(usage_chunk["usage"]["prompt_tokens"], 4);
}

#[tokio::test]
async fn chat_stream_without_include_usage_sends_role_first_and_no_usage() {
    let fleet = fast_fleet(1).await;
    let url = format!("{}/v1/chat/completions", fleet.replicas[0].url());
    let reply = post(&url, &chat("hi", json!({"max_tokens": 3, "stream": true}))).await;
    let chunks: Vec<Value> = reply
        .body
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(chunks.len(), 4);
    assert!(chunks.iter().all(|c| c.get("usage").is_none()));
}

#[tokio::test]
async fn bad_json_gets_openai_style_400_and_unknown_paths_404() {
    let fleet = fast_fleet(1).await;
    let base = fleet.replicas[0].url();
    let bad = post(&format!("{base}/v1/chat/completions"), "{not json").await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    assert_eq!(bad.replica(), Some("0"));
    let err = &bad.json()["error"];
    assert_eq!(err["type"], "BadRequestError");
    assert_eq!(err["code"], 400);
    assert!(err["message"].as_str().unwrap().contains("JSON"));
    let missing = post(&format!("{base}/v1/completions"), r#"{"max_tokens": 3}"#).await;
    assert_eq!(missing.status, StatusCode::BAD_REQUEST);
    let nowhere = get(&format!("{base}/v1/embeddings")).await;
    assert_eq!(nowhere.status, StatusCode::NOT_FOUND);
    assert_eq!(nowhere.replica(), Some("0"));
    let wrong_model = post(
        &format!("{base}/v1/completions"),
        r#"{"model":"gpt-4","prompt":"x"}"#,
    )
    .await;
    assert_eq!(wrong_model.status, StatusCode::NOT_FOUND);
    let too_long = post(
        &format!("{base}/v1/completions"),
        r#"{"prompt":"x","max_tokens":40000}"#,
    )
    .await;
    assert_eq!(too_long.status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn models_health_version_tokenize_and_render() {
    let fleet = fast_fleet(1).await;
    let base = fleet.replicas[0].url();
    let models = get(&format!("{base}/v1/models")).await.json();
    assert_eq!(models["data"][0]["id"], "Qwen/Qwen3-32B");
    assert_eq!(models["data"][0]["owned_by"], "vllm");
    assert_eq!(get(&format!("{base}/health")).await.status, StatusCode::OK);
    assert!(get(&format!("{base}/version")).await.json()["version"].is_string());

    let messages = json!({"messages": [{"role": "user", "content": "Hello, world"}]});
    let tokenized = post(&format!("{base}/tokenize"), &messages.to_string())
        .await
        .json();
    let rendered = post(
        &format!("{base}/v1/chat/completions/render"),
        &messages.to_string(),
    )
    .await
    .json();
    assert_eq!(tokenized["tokens"], rendered["token_ids"]);
    assert_eq!(
        tokenized["count"].as_u64().unwrap() as usize,
        rendered["token_ids"].as_array().unwrap().len()
    );
    let chat = post(
        &format!("{base}/v1/chat/completions"),
        &json!({"messages": messages["messages"], "max_tokens": 1}).to_string(),
    )
    .await
    .json();
    assert_eq!(chat["usage"]["prompt_tokens"], tokenized["count"]);
    let completion = post(
        &format!("{base}/v1/completions/render"),
        r#"{"prompt":"a b c"}"#,
    )
    .await
    .json();
    assert_eq!(completion["token_ids"].as_array().unwrap().len(), 3);
}

#[tokio::test]
async fn metrics_count_prefix_hits_in_tokens_with_vllm_names() {
    let fleet = fast_fleet(1).await;
    let base = fleet.replicas[0].url();
    let body = json!({"prompt": "word ".repeat(100).trim_end(), "max_tokens": 2}).to_string();
    post(&format!("{base}/v1/completions"), &body).await;
    post(&format!("{base}/v1/completions"), &body).await;
    let page = get(&format!("{base}/metrics")).await.body;
    let value = |name: &str| -> f64 {
        page.lines()
            .find(|l| l.starts_with(name) && l.contains("model_name=\"Qwen/Qwen3-32B\""))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} missing in\n{page}"))
    };
    assert_eq!(value("vllm:prefix_cache_queries_total{"), 200.0);
    assert_eq!(value("vllm:prefix_cache_hits_total{"), 96.0);
    assert_eq!(value("vllm:time_to_first_token_seconds_count{"), 2.0);
    assert_eq!(value("vllm:num_requests_running{"), 0.0);
    assert!(page.contains("vllm:cache_config_info{block_size=\"16\""));
}
