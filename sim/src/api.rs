//! The OpenAI-compatible HTTP API of one replica, with vLLM's extra routes (an SGLang
//! replica's metric names, and its `/v1/loads`).

use crate::engine::{Emit, GenError, Replica};
use crate::http::{
    bad_request, empty_response, json_response, method_not_allowed, not_found, openai_error,
    parse_json_object, read_body, text_response, Resp,
};
use crate::metrics;
use crate::request::{self, Endpoint, GenRequest};
use crate::sglang_metrics;
use crate::spec::EngineKind;
use crate::sse::{self, ChunkWriter};
use crate::tokenizer::seed_of;
use http_body_util::{Channel, Either};
use hyper::body::{Frame, Incoming};
use hyper::header::{HeaderValue, CACHE_CONTROL, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

/// Reported by `GET /version`; the suffix says it is not a real vLLM.
pub const VERSION: &str = "0.11.0+kvroute.sim";

/// Everything a replica's request handler needs.
pub struct Api {
    pub replica: Arc<Replica>,
    created: u64,
    next_id: AtomicU64,
}

impl Api {
    pub fn new(replica: Arc<Replica>) -> Arc<Self> {
        Arc::new(Api {
            replica,
            created: unix_now(),
            next_id: AtomicU64::new(0),
        })
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

const ROUTES: &[&str] = &[
    "/health",
    "/version",
    "/v1/models",
    "/metrics",
    "/tokenize",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/completions/render",
    "/v1/chat/completions/render",
    "/reset_prefix_cache",
    "/v1/loads",
];

const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Handles one request; every response says which replica served it.
pub async fn handle(api: Arc<Api>, req: Request<Incoming>) -> Resp {
    let mut resp = route(&api, req).await;
    if let Ok(id) = HeaderValue::from_str(&api.replica.id.to_string()) {
        resp.headers_mut().insert("x-sim-replica", id);
    }
    resp
}

async fn route(api: &Arc<Api>, req: Request<Incoming>) -> Resp {
    let path = req.uri().path().to_string();
    if api.replica.faults().stopped {
        // Connections opened before the stop still get an answer: the replica is down.
        return openai_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailableError",
            "replica is stopped",
        );
    }
    let spec = &api.replica.spec;
    let sglang = spec.kind(api.replica.id) == EngineKind::Sglang;
    match (req.method().clone(), path.as_str()) {
        (Method::GET, "/health") => empty_response(StatusCode::OK),
        (Method::GET, "/version") => json_response(StatusCode::OK, &json!({"version": VERSION})),
        (Method::GET, "/v1/models") => json_response(
            StatusCode::OK,
            &json!({"object": "list", "data": [{
                "id": spec.model, "object": "model", "created": api.created,
                "owned_by": "vllm", "root": spec.model, "parent": null,
                "max_model_len": spec.max_model_len,
            }]}),
        ),
        (Method::GET, "/metrics") if sglang => text_response(
            StatusCode::OK,
            PROMETHEUS_TEXT,
            sglang_metrics::render(spec, &api.replica.snapshot()),
        ),
        (Method::GET, "/metrics") => text_response(
            StatusCode::OK,
            PROMETHEUS_TEXT,
            metrics::render(spec, &api.replica.snapshot()),
        ),
        (Method::GET, "/v1/loads") if sglang => {
            let (snap, backlog) = (api.replica.snapshot(), api.replica.backlog());
            let query = req.uri().query().unwrap_or("");
            match query.split('&').any(|kv| kv == "format=prometheus") {
                true => text_response(
                    StatusCode::OK,
                    PROMETHEUS_TEXT,
                    sglang_metrics::loads_prometheus(spec, &snap, backlog),
                ),
                false => json_response(
                    StatusCode::OK,
                    &sglang_metrics::loads_json(spec, &snap, backlog),
                ),
            }
        }
        (Method::GET, "/v1/loads") => not_found(),
        (Method::POST, "/tokenize") => tokenize(api, req).await,
        (Method::POST, "/reset_prefix_cache") => {
            api.replica.reset_prefix_cache();
            empty_response(StatusCode::OK)
        }
        (Method::POST, "/v1/completions/render") => render(api, Endpoint::Completion, req).await,
        (Method::POST, "/v1/chat/completions/render") => render(api, Endpoint::Chat, req).await,
        (Method::POST, "/v1/completions") => generate(api, Endpoint::Completion, req).await,
        (Method::POST, "/v1/chat/completions") => generate(api, Endpoint::Chat, req).await,
        (_, p) if ROUTES.contains(&p) => method_not_allowed(),
        _ => not_found(),
    }
}

/// A JSON object body, and its bytes as sent (what a chat template renders over).
async fn json_body(req: Request<Incoming>) -> Result<(Value, bytes::Bytes), Resp> {
    let bytes = read_body(req).await?;
    Ok((parse_json_object(&bytes)?, bytes))
}

/// vLLM's `/tokenize`: `{"prompt": ..}` or `{"messages": ..}` in, token ids out.
async fn tokenize(api: &Arc<Api>, req: Request<Incoming>) -> Resp {
    let (body, raw) = match json_body(req).await {
        Ok(b) => b,
        Err(resp) => return resp,
    };
    let endpoint = if body.get("messages").is_some() {
        Endpoint::Chat
    } else {
        Endpoint::Completion
    };
    match request::prompt_tokens_with(&api.replica.frontend(), endpoint, &body, Some(&raw)) {
        Ok((tokens, _)) => json_response(
            StatusCode::OK,
            &json!({"count": tokens.len(), "max_model_len": api.replica.spec.max_model_len,
                    "tokens": tokens, "token_strs": null}),
        ),
        Err(e) => bad_request(e),
    }
}

/// The `/render` routes: the prompt as the server would see it, without generating.
async fn render(api: &Arc<Api>, endpoint: Endpoint, req: Request<Incoming>) -> Resp {
    let (body, raw) = match json_body(req).await {
        Ok(b) => b,
        Err(resp) => return resp,
    };
    match request::prompt_tokens_with(&api.replica.frontend(), endpoint, &body, Some(&raw)) {
        Ok((tokens, text)) => json_response(
            StatusCode::OK,
            &json!({"token_ids": tokens, "num_tokens": tokens.len(), "prompt": text}),
        ),
        Err(e) => bad_request(e),
    }
}

async fn generate(api: &Arc<Api>, endpoint: Endpoint, req: Request<Incoming>) -> Resp {
    let (body, raw) = match json_body(req).await {
        Ok(b) => b,
        Err(resp) => return resp,
    };
    let gen = match request::parse_with(&api.replica.frontend(), endpoint, &body, Some(&raw)) {
        Ok(g) => g,
        Err(e) => return bad_request(e),
    };
    let spec = &api.replica.spec;
    if let Some(model) = gen.model.as_deref().filter(|m| *m != spec.model) {
        return openai_error(
            StatusCode::NOT_FOUND,
            "NotFoundError",
            format!("The model `{model}` does not exist."),
        );
    }
    api.replica.note_request();
    if api.replica.roll_failure() {
        return openai_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalServerError",
            "simulated failure (fail_rate)",
        );
    }
    let output_len = gen.max_tokens.unwrap_or(spec.default_max_tokens);
    let prompt_len = gen.prompt_tokens.len();
    if prompt_len + output_len > spec.max_model_len {
        return bad_request(format!(
            "This model's maximum context length is {} tokens. However, you requested {} tokens \
             ({prompt_len} in the messages, {output_len} in the completion). Please reduce the \
             length of the messages or completion.",
            spec.max_model_len,
            prompt_len + output_len
        ));
    }
    // The simulated model "stops" by itself only when the client set no limit.
    let finish_reason = if gen.max_tokens.is_some() {
        "length"
    } else {
        "stop"
    };
    let (pieces, ids) = api
        .replica
        .vocab
        .output(seed_of(&gen.prompt_tokens), output_len);
    let n = api.next_id.fetch_add(1, Ordering::Relaxed);
    let prefix = if endpoint == Endpoint::Chat {
        "chatcmpl"
    } else {
        "cmpl"
    };
    let id = format!("{prefix}-sim{}-{n:x}", api.replica.id);
    if gen.stream {
        stream(api.clone(), gen, pieces, ids, id, finish_reason)
    } else {
        complete(api, gen, pieces, ids, id, finish_reason).await
    }
}

async fn complete(
    api: &Arc<Api>,
    gen: GenRequest,
    pieces: Vec<String>,
    ids: Vec<u32>,
    id: String,
    finish_reason: &str,
) -> Resp {
    let outcome = match api
        .replica
        .generate(&gen.prompt_tokens, gen.cache_salt.as_deref(), &ids, |_| {
            true
        })
        .await
    {
        Ok(o) => o,
        Err(GenError::TooLong(msg)) => return bad_request(msg),
        Err(GenError::Aborted) => {
            return openai_error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "InternalServerError",
                "aborted",
            )
        }
    };
    let text: String = pieces.concat();
    let block = api.replica.spec.block_size;
    let usage = sse::usage(
        gen.prompt_tokens.len(),
        ids.len(),
        outcome.cached_tokens,
        block,
        false,
    );
    let model = &api.replica.spec.model;
    let body = match gen.endpoint {
        Endpoint::Chat => json!({
            "id": id, "object": "chat.completion", "created": unix_now(), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text,
                         "tool_calls": []}, "logprobs": null, "finish_reason": finish_reason,
                         "stop_reason": null}],
            "usage": usage,
        }),
        Endpoint::Completion => json!({
            "id": id, "object": "text_completion", "created": unix_now(), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": null,
                         "finish_reason": finish_reason, "stop_reason": null}],
            "usage": usage,
        }),
    };
    json_response(StatusCode::OK, &body)
}

/// Starts the request in its own task and streams its tokens as SSE. If the client goes
/// away, sending fails, the engine aborts the request and frees its slot and blocks.
fn stream(
    api: Arc<Api>,
    gen: GenRequest,
    pieces: Vec<String>,
    ids: Vec<u32>,
    id: String,
    finish_reason: &'static str,
) -> Resp {
    // Room for every chunk (role, tokens, usage, done): the engine never waits on the client.
    let (mut tx, rx) = Channel::new(pieces.len() + 4);
    let writer = ChunkWriter {
        endpoint: gen.endpoint,
        id,
        created: unix_now(),
        model: api.replica.spec.model.clone(),
    };
    let block_size = api.replica.spec.block_size;
    tokio::spawn(async move {
        let total = ids.len();
        let mut sent = 0;
        let result = api
            .replica
            .generate(
                &gen.prompt_tokens,
                gen.cache_salt.as_deref(),
                &ids,
                |emit| {
                    let upto = match emit {
                        Emit::First { .. } => {
                            if let Some(role) = writer.role() {
                                if tx.try_send(Frame::data(role)).is_err() {
                                    return false;
                                }
                            }
                            1
                        }
                        Emit::Tokens { upto } => upto,
                        Emit::Done { .. } => total,
                    };
                    while sent < upto {
                        let finish = (sent + 1 == total).then_some(finish_reason);
                        if tx
                            .try_send(Frame::data(writer.token(&pieces[sent], finish)))
                            .is_err()
                        {
                            return false;
                        }
                        sent += 1;
                    }
                    true
                },
            )
            .await;
        match result {
            Ok(outcome) => {
                if gen.include_usage {
                    let (prompt, cached) = (gen.prompt_tokens.len(), outcome.cached_tokens);
                    let usage = sse::usage(prompt, total, cached, block_size, true);
                    let _ = tx.try_send(Frame::data(writer.usage(&usage)));
                }
                let _ = tx.try_send(Frame::data(ChunkWriter::done()));
            }
            Err(GenError::TooLong(msg)) => {
                let _ = tx.try_send(Frame::data(ChunkWriter::error(&msg, 400)));
                let _ = tx.try_send(Frame::data(ChunkWriter::done()));
            }
            Err(GenError::Aborted) => {}
        }
    });
    let mut resp = Response::new(Either::Right(rx));
    resp.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    resp.headers_mut()
        .insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}
