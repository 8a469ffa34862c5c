//! The control API: fleet state, per-replica cache matches for an oracle router, fault knobs.

use crate::bpe::Vocab;
use crate::engine::{Faults, Replica};
use crate::http::{
    bad_request, json_response, method_not_allowed, not_found, parse_json_object, read_body, Resp,
};
use crate::request::{self, Endpoint, Frontend};
use hyper::body::Incoming;
use hyper::{Method, Request, StatusCode};
use serde_json::{json, Value};
use std::sync::Arc;

pub async fn handle(fleet: Arc<Vec<Arc<Replica>>>, req: Request<Incoming>) -> Resp {
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    match (method, path.as_str()) {
        (Method::GET, "/fleet/state") => state(&fleet),
        (Method::POST, "/fleet/match") => match body(req).await {
            Ok(b) => match_prompt(&fleet, &b),
            Err(resp) => resp,
        },
        (m, p) if p.starts_with("/fleet/replica/") => {
            let Some(replica) = p["/fleet/replica/".len()..]
                .parse::<usize>()
                .ok()
                .and_then(|id| fleet.get(id))
            else {
                return not_found();
            };
            if m != Method::POST {
                return method_not_allowed();
            }
            match body(req).await {
                Ok(b) => set_faults(replica, &b),
                Err(resp) => resp,
            }
        }
        (_, "/fleet/state" | "/fleet/match") => method_not_allowed(),
        _ => not_found(),
    }
}

async fn body(req: Request<Incoming>) -> Result<Value, Resp> {
    let bytes = read_body(req).await?;
    parse_json_object(&bytes)
}

fn state(fleet: &[Arc<Replica>]) -> Resp {
    let replicas: Vec<Value> = fleet
        .iter()
        .map(|r| {
            let s = r.snapshot();
            json!({
                "id": r.id, "running": s.running, "waiting": s.waiting, "kv_usage": s.kv_usage,
                "prefix_queries_tokens": s.prefix_queries_tokens,
                "prefix_hits_tokens": s.prefix_hits_tokens,
                "requests": s.requests, "healthy": !s.faults.stopped,
            })
        })
        .collect();
    json_response(StatusCode::OK, &json!({"replicas": replicas}))
}

/// How many prompt tokens of `{"path", "body"}` each replica has cached right now.
fn match_prompt(fleet: &[Arc<Replica>], req: &Value) -> Resp {
    let path = req
        .get("path")
        .and_then(Value::as_str)
        .unwrap_or("/v1/chat/completions");
    let Some(endpoint) = Endpoint::from_path(path) else {
        return bad_request(format!(
            "'path' must be /v1/chat/completions or /v1/completions, not {path}"
        ));
    };
    let Some(body) = req.get("body") else {
        return bad_request("'body' is required");
    };
    let hash = Vocab::Hash;
    let frontend = fleet.first().map_or(Frontend::of(&hash), |r| r.frontend());
    let tokens = request::prompt_tokens_with(&frontend, endpoint, body, None);
    let (tokens, salt) = match (tokens, request::cache_salt(body)) {
        (Ok((tokens, _)), Ok(salt)) => (tokens, salt),
        (Err(e), _) | (_, Err(e)) => return bad_request(e),
    };
    let replicas: Vec<Value> = fleet
        .iter()
        .map(|r| {
            let s = r.snapshot();
            json!({"id": r.id, "cached_tokens": r.cached_tokens(&tokens, salt.as_deref()),
                   "running": s.running, "waiting": s.waiting})
        })
        .collect();
    json_response(
        StatusCode::OK,
        &json!({"prompt_tokens": tokens.len(), "replicas": replicas}),
    )
}

fn set_faults(replica: &Replica, patch: &Value) -> Resp {
    let mut faults: Faults = replica.faults();
    if let Some(v) = patch.get("slow_factor") {
        match v.as_f64() {
            Some(f) if f > 0.0 && f.is_finite() => faults.slow_factor = f,
            _ => return bad_request("'slow_factor' must be a positive number"),
        }
    }
    if let Some(v) = patch.get("fail_rate") {
        match v.as_f64() {
            Some(f) if (0.0..=1.0).contains(&f) => faults.fail_rate = f,
            _ => return bad_request("'fail_rate' must be a number in [0, 1]"),
        }
    }
    if let Some(v) = patch.get("stopped") {
        match v.as_bool() {
            Some(b) => faults.stopped = b,
            None => return bad_request("'stopped' must be a boolean"),
        }
    }
    if let Some(v) = patch.get("drop_kv_events") {
        match v.as_u64() {
            Some(n) => faults.drop_kv_events = n,
            None => return bad_request("'drop_kv_events' must be a non-negative integer"),
        }
    }
    replica.set_faults(faults);
    json_response(
        StatusCode::OK,
        &json!({"id": replica.id, "slow_factor": faults.slow_factor,
                "fail_rate": faults.fail_rate, "stopped": faults.stopped,
                "drop_kv_events": faults.drop_kv_events}),
    )
}
