//! In-process OpenAI-style test backends on 127.0.0.1 that record what reached them.
//!
//! Each backend answers `POST /v1/chat/completions` and `POST /v1/completions` (JSON, or SSE when
//! the body has `"stream": true`), `GET /health`, `GET /metrics`, `GET /v1/models`, and 404 otherwise; every
//! response carries `x-backend: <index>`. Knobs: delay, failing (with or without its health check),
//! a poison marker, kill, stop/resume. Health checks
//! are neither counted nor recorded, so counts are exactly the requests Envoy forwarded.

use bytes::Bytes;
use http_body_util::{BodyExt, Channel, Either, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Number of `data:` chunks in a streamed response, before `data: [DONE]`.
pub const STREAM_CHUNKS: usize = 8;

/// One request as the backend received it.
#[derive(Clone, Debug)]
pub struct Recorded {
    pub method: String,
    /// Path and query.
    pub path: String,
    /// Lower-case names, in arrival order; repeated headers appear repeatedly.
    pub headers: Vec<(String, String)>,
    pub body: Bytes,
}

impl Recorded {
    /// All values of header `name` (lower case).
    pub fn header_values(&self, name: &str) -> Vec<&str> {
        self.headers
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
            .collect()
    }
}

#[derive(Default)]
struct Shared {
    index: usize,
    delay_ms: AtomicU64,
    failing: AtomicBool,
    /// Set by [`Backend::set_engine_dead`]: requests 500 while `/health` says 200.
    engine_dead: AtomicBool,
    /// Set by [`Backend::set_poison`]: a request whose body holds the marker gets the status.
    poison: Mutex<Option<(Vec<u8>, u16)>>,
    /// What `/metrics` reports as `vllm:num_requests_waiting`.
    engine_waiting: AtomicU64,
    /// Set by [`Backend::set_metrics_missing`]: `/metrics` answers 404.
    metrics_missing: AtomicBool,
    not_recording: AtomicBool,
    received: AtomicU64,
    completed: AtomicU64,
    in_flight: AtomicU64,
    requests: Mutex<Vec<Recorded>>,
    /// Set by [`Backend::stop`]: every request is answered 503.
    stopped: AtomicBool,
    /// Set by [`Backend::stop_resetting`]: every request closes its connection unanswered.
    resetting: AtomicBool,
    /// Requests refused because the backend was stopped (health checks excluded).
    refused: AtomicU64,
    /// Connections being served, so a kill can wait until every one is closed.
    open_connections: AtomicU64,
}

/// A running backend; stops listening when killed or dropped.
pub struct Backend {
    shared: Arc<Shared>,
    addr: SocketAddr,
    kill: watch::Sender<bool>,
    accept: Mutex<Option<JoinHandle<()>>>,
    /// Closes the listener (not the open connections) when set; see [`Backend::stop`].
    stop: watch::Sender<bool>,
}

impl Backend {
    /// Starts backend number `index` on a free port of 127.0.0.1. Needs a tokio runtime.
    pub async fn start(index: usize) -> std::io::Result<Backend> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            index,
            ..Shared::default()
        });
        let (kill, killed) = watch::channel(false);
        let (stop, stopped) = watch::channel(false);
        let accept = tokio::spawn(accept_loop(listener, shared.clone(), killed, stopped));
        Ok(Backend {
            shared,
            addr,
            kill,
            accept: Mutex::new(Some(accept)),
            stop,
        })
    }

    /// Starts backends `0..n`.
    pub async fn start_many(n: usize) -> std::io::Result<Vec<Backend>> {
        let mut all = Vec::with_capacity(n);
        for i in 0..n {
            all.push(Backend::start(i).await?);
        }
        Ok(all)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The index this backend reports in `x-backend`.
    pub fn index(&self) -> usize {
        self.shared.index
    }

    /// Delay before each completion response (and before the first streamed chunk).
    pub fn set_delay(&self, delay: Duration) {
        self.shared
            .delay_ms
            .store(delay.as_millis() as u64, Ordering::Relaxed);
    }

    /// When failing, `/health` answers 503 and every other request 500.
    pub fn set_failing(&self, failing: bool) {
        self.shared.failing.store(failing, Ordering::Relaxed);
    }

    /// When set, every request but `/health` and `/metrics` is answered 500 while `/health` still
    /// answers 200: a vLLM whose engine died under a live API server.
    pub fn set_engine_dead(&self, dead: bool) {
        self.shared.engine_dead.store(dead, Ordering::Relaxed);
    }

    /// A request whose body contains `marker` is answered `status` (a prompt this replica cannot
    /// serve); `None` clears it. Such requests count as received and are recorded.
    pub fn set_poison(&self, poison: Option<(&str, u16)>) {
        *self.shared.poison.lock().unwrap() = poison.map(|(m, s)| (m.as_bytes().to_vec(), s));
    }

    /// When set, `GET /metrics` answers 404: the engine reports no load, while requests and
    /// health checks are served as before. Not a 5xx, which outlier detection would count: the
    /// host stays in the pool and only kvroute's view of its load goes stale.
    pub fn set_metrics_missing(&self, missing: bool) {
        self.shared
            .metrics_missing
            .store(missing, Ordering::Relaxed);
    }

    /// Requests `GET /metrics` reports waiting (`vllm:num_requests_waiting`), as an engine busy
    /// with other proxies' traffic would.
    pub fn set_engine_waiting(&self, n: u64) {
        self.shared.engine_waiting.store(n, Ordering::Relaxed);
    }

    /// Recording is on by default; floods turn it off to save memory.
    pub fn set_recording(&self, on: bool) {
        self.shared.not_recording.store(!on, Ordering::Relaxed);
    }

    /// Requests received (health checks excluded).
    pub fn received(&self) -> u64 {
        self.shared.received.load(Ordering::Relaxed)
    }

    /// Requests whose response was fully sent.
    pub fn completed(&self) -> u64 {
        self.shared.completed.load(Ordering::Relaxed)
    }

    /// Requests received whose response is not finished (client aborts end them too).
    pub fn in_flight(&self) -> u64 {
        self.shared.in_flight.load(Ordering::Relaxed)
    }

    /// A copy of the recorded requests.
    pub fn requests(&self) -> Vec<Recorded> {
        self.shared.requests.lock().unwrap().clone()
    }

    /// The recorded requests, clearing the record.
    pub fn take_requests(&self) -> Vec<Recorded> {
        std::mem::take(&mut *self.shared.requests.lock().unwrap())
    }

    /// Requests answered 503, or whose connection was closed under them, while stopped (health
    /// checks excluded).
    pub fn refused(&self) -> u64 {
        self.shared.refused.load(Ordering::Relaxed)
    }

    /// Stops listening and drops every open connection; returns once the listener and every
    /// connection are closed, so no request is served after it returns.
    pub async fn kill(&self) {
        let _ = self.kill.send(true);
        let accept = self.accept.lock().unwrap().take();
        if let Some(accept) = accept {
            let _ = accept.await;
        }
        self.wait_connections_closed().await;
    }

    /// Stops the way a replica that is shutting down does: the listener closes (new connections
    /// are refused), and every request arriving on a connection still open, health checks
    /// included, is answered 503 with `connection: close`. Responses already under way finish.
    /// Returns once the listener is closed.
    pub async fn stop(&self) {
        self.shared.stopped.store(true, Ordering::SeqCst);
        self.stop.send_replace(true);
        let accept = self.accept.lock().unwrap().take();
        if let Some(accept) = accept {
            let _ = accept.await;
        }
    }

    /// Like [`Backend::stop`], but a request arriving on a connection still open is not answered:
    /// the connection closes under it, as when a replica dies with requests already sent to it.
    pub async fn stop_resetting(&self) {
        self.shared.resetting.store(true, Ordering::SeqCst);
        self.stop().await;
    }

    /// After [`Backend::stop`] or [`Backend::stop_resetting`]: listens again on the same address
    /// and serves normally.
    pub async fn resume(&self) -> std::io::Result<()> {
        let listener = tokio::net::TcpListener::bind(self.addr).await?;
        self.shared.resetting.store(false, Ordering::SeqCst);
        self.shared.stopped.store(false, Ordering::SeqCst);
        // Not `send`: with the old accept loop gone there is no receiver, and `send` would then
        // leave the value at `true`, stopping the new loop at once.
        self.stop.send_replace(false);
        let accept = tokio::spawn(accept_loop(
            listener,
            self.shared.clone(),
            self.kill.subscribe(),
            self.stop.subscribe(),
        ));
        *self.accept.lock().unwrap() = Some(accept);
        Ok(())
    }

    async fn wait_connections_closed(&self) {
        // Each connection task ends at its next poll once killed; bounded in case one never does.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while self.shared.open_connections.load(Ordering::SeqCst) > 0
            && std::time::Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        let _ = self.kill.send(true);
    }
}

/// The JSON body of a non-streamed response from backend `index`.
pub fn json_response(index: usize, chat: bool) -> String {
    let choice = if chat {
        serde_json::json!({ "index": 0, "finish_reason": "stop",
            "message": { "role": "assistant", "content": format!("answer from backend {index}") } })
    } else {
        serde_json::json!({ "index": 0, "finish_reason": "stop", "text": format!("answer from backend {index}") })
    };
    let object = if chat {
        "chat.completion"
    } else {
        "text_completion"
    };
    serde_json::json!({ "id": format!("cmpl-{index}"), "object": object, "model": "test",
        "choices": [choice], "usage": { "prompt_tokens": 1, "completion_tokens": 4, "total_tokens": 5 } })
    .to_string()
}

/// The `data:` events of a streamed response from backend `index`, `[DONE]` last.
pub fn sse_events(index: usize, chat: bool) -> Vec<String> {
    let mut events: Vec<String> = (0..STREAM_CHUNKS)
        .map(|i| {
            let text = format!("token {i} from backend {index} ");
            let choice = if chat {
                serde_json::json!({ "index": 0, "delta": { "content": text } })
            } else {
                serde_json::json!({ "index": 0, "text": text })
            };
            let chunk = serde_json::json!({ "id": format!("cmpl-{index}"), "choices": [choice] });
            format!("data: {chunk}\n\n")
        })
        .collect();
    events.push("data: [DONE]\n\n".into());
    events
}

async fn accept_loop(
    listener: tokio::net::TcpListener,
    shared: Arc<Shared>,
    mut killed: watch::Receiver<bool>,
    mut stopped: watch::Receiver<bool>,
) {
    loop {
        let stream = tokio::select! {
            // A kill or stop wins over a connection waiting to be accepted.
            biased;
            _ = killed.wait_for(|k| *k) => return,
            _ = stopped.wait_for(|s| *s) => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(_) => continue,
            },
        };
        let _ = stream.set_nodelay(true);
        let shared = shared.clone();
        let mut killed = killed.clone();
        shared.open_connections.fetch_add(1, Ordering::SeqCst);
        tokio::spawn(async move {
            let open = OpenConnection(shared.clone());
            let svc = hyper::service::service_fn(move |req| {
                let shared = shared.clone();
                async move {
                    if shared.resetting.load(Ordering::SeqCst) {
                        if req.uri().path() != "/health" {
                            shared.refused.fetch_add(1, Ordering::Relaxed);
                        }
                        // A service error makes hyper close the connection without a response.
                        return Err("stopped: resetting the connection");
                    }
                    handle(shared, req).await.map_err(|never| match never {})
                }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc);
            // Dropping the connection future closes the socket: that is how kill cuts connections.
            // Checked first, so a killed connection never serves one more request.
            tokio::select! {
                biased;
                _ = killed.wait_for(|k| *k) => {}
                _ = conn => {}
            }
            drop(open);
        });
    }
}

/// Counts a connection task as open until it ends, however it ends.
struct OpenConnection(Arc<Shared>);

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.open_connections.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Decrements `in_flight` and counts completion when the response is done or abandoned.
struct InFlight(Arc<Shared>, bool);

impl InFlight {
    fn finish(mut self) {
        self.1 = true;
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
        if self.1 {
            self.0.completed.fetch_add(1, Ordering::Relaxed);
        }
    }
}

async fn handle(
    shared: Arc<Shared>,
    req: Request<Incoming>,
) -> Result<Response<ReplyBody>, Infallible> {
    if shared.stopped.load(Ordering::SeqCst) {
        if req.uri().path() != "/health" {
            shared.refused.fetch_add(1, Ordering::Relaxed);
        }
        let mut resp = reply(
            &shared,
            StatusCode::SERVICE_UNAVAILABLE,
            "text/plain",
            full("stopping"),
        );
        resp.headers_mut().insert(
            hyper::header::CONNECTION,
            hyper::header::HeaderValue::from_static("close"),
        );
        return Ok(resp);
    }
    let failing = shared.failing.load(Ordering::Relaxed);
    if req.uri().path() == "/health" {
        let status = if failing {
            StatusCode::SERVICE_UNAVAILABLE
        } else {
            StatusCode::OK
        };
        return Ok(reply(&shared, status, "text/plain", full("ok")));
    }
    if req.uri().path() == "/metrics" {
        if shared.metrics_missing.load(Ordering::Relaxed) {
            let body = full("no metrics");
            return Ok(reply(&shared, StatusCode::NOT_FOUND, "text/plain", body));
        }
        let waiting = shared.engine_waiting.load(Ordering::Relaxed);
        let text = format!(
            "vllm:num_requests_running{{model_name=\"m\"}} 0\nvllm:num_requests_waiting{{model_name=\"m\"}} {waiting}\n"
        );
        return Ok(reply(&shared, StatusCode::OK, "text/plain", full(text)));
    }
    shared.in_flight.fetch_add(1, Ordering::Relaxed);
    shared.received.fetch_add(1, Ordering::Relaxed);
    let guard = InFlight(shared.clone(), false);
    let (parts, body) = req.into_parts();
    let body = match body.collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => {
            return Ok(reply(
                &shared,
                StatusCode::BAD_REQUEST,
                "text/plain",
                full("bad body"),
            ))
        }
    };
    let path = parts
        .uri
        .path_and_query()
        .map(|p| p.to_string())
        .unwrap_or_default();
    let is_post = parts.method == hyper::Method::POST;
    if !shared.not_recording.load(Ordering::Relaxed) {
        let headers = parts
            .headers
            .iter()
            .map(|(n, v)| {
                (
                    n.as_str().to_string(),
                    String::from_utf8_lossy(v.as_bytes()).into_owned(),
                )
            })
            .collect();
        let method = parts.method.to_string();
        shared.requests.lock().unwrap().push(Recorded {
            method,
            path: path.clone(),
            headers,
            body: body.clone(),
        });
    }
    if failing || shared.engine_dead.load(Ordering::Relaxed) {
        return Ok(reply(
            &shared,
            StatusCode::INTERNAL_SERVER_ERROR,
            "text/plain",
            full("failing"),
        ));
    }
    let poisoned = shared
        .poison
        .lock()
        .unwrap()
        .as_ref()
        .filter(|(marker, _)| contains_bytes(&body, marker))
        .map(|(_, status)| *status);
    if let Some(status) = poisoned {
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        return Ok(reply(&shared, status, "text/plain", full("poisoned")));
    }
    let chat = match (is_post, parts.uri.path()) {
        (true, "/v1/chat/completions") => true,
        (true, "/v1/completions") => false,
        (false, "/v1/models") => {
            guard.finish();
            return Ok(reply(
                &shared,
                StatusCode::OK,
                "application/json",
                full(r#"{"data":[{"id":"test"}]}"#),
            ));
        }
        _ => {
            guard.finish();
            return Ok(reply(
                &shared,
                StatusCode::NOT_FOUND,
                "text/plain",
                full("not found"),
            ));
        }
    };
    let delay = Duration::from_millis(shared.delay_ms.load(Ordering::Relaxed));
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let stream = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v.get("stream").and_then(|s| s.as_bool()))
        .unwrap_or(false);
    if !stream {
        guard.finish();
        let body = full(json_response(shared.index, chat));
        return Ok(reply(&shared, StatusCode::OK, "application/json", body));
    }
    let (mut tx, rx) = Channel::new(2);
    let events = sse_events(shared.index, chat);
    tokio::spawn(async move {
        for event in events {
            // A send error means the client went away; the guard then counts it as abandoned.
            if tx.send_data(Bytes::from(event)).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        guard.finish();
    });
    Ok(reply(
        &shared,
        StatusCode::OK,
        "text/event-stream",
        Either::Right(rx),
    ))
}

/// Whether `needle` occurs in `haystack` (an empty needle always does).
fn contains_bytes(haystack: &[u8], needle: &[u8]) -> bool {
    needle.is_empty() || haystack.windows(needle.len()).any(|w| w == needle)
}

fn reply(
    shared: &Shared,
    status: StatusCode,
    content_type: &str,
    body: ReplyBody,
) -> Response<ReplyBody> {
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .header("x-backend", shared.index.to_string())
        .body(body)
        .expect("static response parts are valid")
}

/// A whole body (sent with content-length), or chunks from a bounded channel (SSE, each sent as
/// it comes; a send fails once the client is gone).
type ReplyBody = Either<Full<Bytes>, Channel<Bytes>>;

fn full(b: impl Into<Bytes>) -> ReplyBody {
    Either::Left(Full::new(b.into()))
}
