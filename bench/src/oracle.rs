//! The oracle router: an in-process HTTP proxy that asks the sim which replica really holds the
//! most of each prompt (`POST /fleet/match`) and sends the request there unless that replica is
//! overloaded. It knows what no real router can, so it is the upper bound of the comparison.
//!
//! The sim only reports what is cached once a prefill finished, so the oracle also remembers the
//! prompts it sent in the last moments: a burst of requests sharing a new prefix then follows the
//! first one instead of each paying a cold prefill on a different replica.

use crate::sim_process::{ControlClient, MatchResult, Replica};
use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::Value;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// A replica is overloaded when its load (running + waiting) exceeds the least-loaded replica's
/// by more than this; the oracle then gives up its cache hit for a shorter queue.
pub const OVERLOAD_SLACK: u64 = 4;
/// How long a dispatched prompt counts as (about to be) cached on its replica.
pub const PENDING_WINDOW: Duration = Duration::from_secs(2);
/// At most this many recent dispatches are remembered.
pub const PENDING_MAX: usize = 256;
/// A pending shared prefix counts in whole KV blocks of this many tokens, like a real cache hit
/// (so a few shared template tokens do not attract unrelated prompts).
pub const PENDING_BLOCK_TOKENS: u64 = 16;

type Body = BoxBody<Bytes, hyper::Error>;

/// The running proxy; it stops when dropped.
pub struct Oracle {
    pub url: String,
    task: JoinHandle<()>,
}

impl Drop for Oracle {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct State {
    control: ControlClient,
    replicas: Vec<Replica>,
    /// Requests this proxy sent to each replica whose response headers have not come back yet:
    /// covers the moment between a `/fleet/match` answer and the replica counting the request.
    dispatching: Vec<AtomicU64>,
    /// Requests sent to each replica so far: the last tie-break, so new prefixes spread out.
    dispatched: Vec<AtomicU64>,
    /// Recently dispatched prompts: (replica index, prompt text, when).
    recent: Mutex<VecDeque<(usize, String, Instant)>>,
    client: Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
}

impl Oracle {
    pub async fn start(control: ControlClient, replicas: Vec<Replica>) -> Result<Oracle, String> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| format!("oracle bind: {e}"))?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        let state = Arc::new(State {
            control,
            dispatching: replicas.iter().map(|_| AtomicU64::new(0)).collect(),
            dispatched: replicas.iter().map(|_| AtomicU64::new(0)).collect(),
            recent: Mutex::new(VecDeque::new()),
            replicas,
            client: Client::builder(TokioExecutor::new()).build_http(),
        });
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let state = state.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| proxy(state.clone(), req));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Ok(Oracle {
            url: format!("http://{addr}"),
            task,
        })
    }
}

/// Picks the index into `m.replicas` with the most cached tokens among those not overloaded;
/// ties go to the less loaded, then to the one sent fewer requests so far (`sent[i]`), then the
/// lower id. `extra_load[i]` is added to the load of `m.replicas[i]`.
pub fn choose(m: &MatchResult, extra_load: &[u64], sent: &[u64]) -> Option<usize> {
    let load = |i: usize| {
        let r = &m.replicas[i];
        r.running + r.waiting + extra_load.get(i).copied().unwrap_or(0)
    };
    let min_load = (0..m.replicas.len()).map(load).min()?;
    (0..m.replicas.len())
        .filter(|&i| load(i) <= min_load + OVERLOAD_SLACK)
        .max_by(|&a, &b| {
            let (ra, rb) = (&m.replicas[a], &m.replicas[b]);
            ra.cached_tokens
                .cmp(&rb.cached_tokens)
                .then(load(b).cmp(&load(a)))
                .then(sent.get(b).cmp(&sent.get(a)))
                .then(rb.id.cmp(&ra.id))
        })
}

async fn proxy(state: Arc<State>, req: Request<Incoming>) -> Result<Response<Body>, hyper::Error> {
    let (parts, body) = req.into_parts();
    let bytes = body.collect().await?.to_bytes();
    let path = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "/".into());
    let target = match pick(&state, parts.uri.path(), &bytes).await {
        Ok(i) => i,
        Err(e) => return Ok(error(StatusCode::BAD_GATEWAY, &format!("oracle: {e}"))),
    };
    let replica = &state.replicas[target];
    let uri = format!("{}{path}", replica.url.trim_end_matches('/'));
    let mut out = Request::builder().method(parts.method).uri(&uri);
    for (name, value) in parts.headers.iter() {
        if name != hyper::header::HOST {
            out = out.header(name, value);
        }
    }
    let out = match out.body(Full::new(bytes)) {
        Ok(r) => r,
        Err(e) => return Ok(error(StatusCode::BAD_GATEWAY, &format!("oracle: {e}"))),
    };
    state.dispatching[target].fetch_add(1, Ordering::Relaxed);
    let resp = state.client.request(out).await;
    state.dispatching[target].fetch_sub(1, Ordering::Relaxed);
    match resp {
        Ok(resp) => Ok(resp.map(|b| b.boxed())),
        Err(e) => Ok(error(
            StatusCode::BAD_GATEWAY,
            &format!("oracle: {uri}: {e}"),
        )),
    }
}

/// Index into `state.replicas` for this request body.
async fn pick(state: &State, path: &str, body: &[u8]) -> Result<usize, String> {
    let json: Value = serde_json::from_slice(body).map_err(|e| format!("request body: {e}"))?;
    let mut m = state.control.best_match(path, &json).await?;
    let text = prompt_text(&json);
    let index_of = |id: usize| state.replicas.iter().position(|r| r.id == id);
    {
        let mut recent = state.recent.lock().map_err(|_| "oracle state poisoned")?;
        while recent
            .front()
            .is_some_and(|(_, _, t)| t.elapsed() > PENDING_WINDOW)
        {
            recent.pop_front();
        }
        // Tokens per character of this prompt, to turn a shared text prefix into tokens.
        let per_char = m.prompt_tokens as f64 / text.len().max(1) as f64;
        for r in m.replicas.iter_mut() {
            let Some(i) = index_of(r.id) else { continue };
            let shared = recent
                .iter()
                .filter(|(j, _, _)| *j == i)
                .map(|(_, t, _)| common_prefix(t, &text))
                .max();
            let pending = (shared.unwrap_or(0) as f64 * per_char) as u64;
            let pending = pending / PENDING_BLOCK_TOKENS * PENDING_BLOCK_TOKENS;
            r.cached_tokens = r.cached_tokens.max(pending);
        }
    }
    let extra: Vec<u64> = m
        .replicas
        .iter()
        .map(|r| index_of(r.id).map_or(0, |i| state.dispatching[i].load(Ordering::Relaxed)))
        .collect();
    let sent: Vec<u64> = m
        .replicas
        .iter()
        .map(|r| index_of(r.id).map_or(0, |i| state.dispatched[i].load(Ordering::Relaxed)))
        .collect();
    let chosen = choose(&m, &extra, &sent).ok_or("the fleet reported no replicas")?;
    let id = m.replicas[chosen].id;
    let target = index_of(id).ok_or_else(|| format!("unknown replica id {id}"))?;
    state.dispatched[target].fetch_add(1, Ordering::Relaxed);
    let mut recent = state.recent.lock().map_err(|_| "oracle state poisoned")?;
    if recent.len() >= PENDING_MAX {
        recent.pop_front();
    }
    recent.push_back((target, text, Instant::now()));
    Ok(target)
}

/// The prompt as text: the completion prompt, or the chat messages' roles and contents in order.
/// The cache salt comes first: prompts of different salts share no cached prefix.
pub fn prompt_text(body: &Value) -> String {
    let mut s = match body["cache_salt"].as_str() {
        Some(salt) => format!("{salt}\n"),
        None => String::new(),
    };
    if let Some(p) = body["prompt"].as_str() {
        s.push_str(p);
        return s;
    }
    for m in body["messages"].as_array().into_iter().flatten() {
        s.push_str(m["role"].as_str().unwrap_or(""));
        s.push('\n');
        match &m["content"] {
            Value::String(c) => s.push_str(c),
            other => s.push_str(&other.to_string()),
        }
        s.push('\n');
    }
    s
}

pub fn common_prefix(a: &str, b: &str) -> usize {
    a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count()
}

fn error(status: StatusCode, msg: &str) -> Response<Body> {
    let body = Full::new(Bytes::from(msg.to_string()))
        .map_err(|never| match never {})
        .boxed();
    let mut resp = Response::new(body);
    *resp.status_mut() = status;
    resp
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim_process::MatchReplica;

    fn m(rs: &[(u64, u64)]) -> MatchResult {
        MatchResult {
            prompt_tokens: 100,
            replicas: rs
                .iter()
                .enumerate()
                .map(|(id, &(cached_tokens, running))| MatchReplica {
                    id,
                    cached_tokens,
                    running,
                    waiting: 0,
                })
                .collect(),
        }
    }

    #[test]
    fn picks_the_replica_holding_most_of_the_prompt() {
        assert_eq!(choose(&m(&[(0, 0), (80, 2), (40, 0)]), &[], &[]), Some(1));
    }

    #[test]
    fn skips_an_overloaded_replica_for_the_next_best_hit() {
        assert_eq!(choose(&m(&[(0, 0), (80, 20), (40, 1)]), &[], &[]), Some(2));
    }

    #[test]
    fn a_new_prefix_goes_to_the_least_loaded() {
        assert_eq!(choose(&m(&[(0, 3), (0, 1), (0, 2)]), &[], &[]), Some(1));
        assert_eq!(choose(&m(&[(0, 0), (0, 0)]), &[1, 0], &[]), Some(1));
    }

    #[test]
    fn idle_fleet_spreads_new_prefixes_over_replicas() {
        assert_eq!(
            choose(&m(&[(0, 0), (0, 0), (0, 0)]), &[], &[5, 3, 4]),
            Some(1)
        );
    }

    #[test]
    fn prompt_text_of_chat_and_completions_starts_with_the_shared_part() {
        let a = prompt_text(
            &serde_json::json!({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "q1"}]}),
        );
        let b = prompt_text(
            &serde_json::json!({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "q2"}]}),
        );
        assert_eq!(common_prefix(&a, &b), "system\nS\nuser\nq".len());
        assert_eq!(prompt_text(&serde_json::json!({"prompt": "p"})), "p");
    }
}
