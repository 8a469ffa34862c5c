//! HTTP/1.1 plumbing shared by replicas and the control port: a body type that is either
//! a full buffer or a stream of chunks, JSON/error helpers, and an accept loop.

use bytes::Bytes;
use http_body_util::{Channel, Either, Full};
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::future::Future;
use tokio::net::TcpListener;

/// A response body: a whole buffer (sent with Content-Length) or SSE chunks from a channel.
pub type SimBody = Either<Full<Bytes>, Channel<Bytes>>;

pub type Resp = Response<SimBody>;

fn with_body(status: StatusCode, content_type: &'static str, body: Bytes) -> Resp {
    let mut resp = Response::new(Either::Left(Full::new(body)));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    resp
}

pub fn json_response(status: StatusCode, value: &Value) -> Resp {
    with_body(status, "application/json", Bytes::from(value.to_string()))
}

pub fn text_response(status: StatusCode, content_type: &'static str, text: String) -> Resp {
    with_body(status, content_type, Bytes::from(text))
}

pub fn empty_response(status: StatusCode) -> Resp {
    let mut resp = Response::new(Either::Left(Full::new(Bytes::new())));
    *resp.status_mut() = status;
    resp
}

/// vLLM's (OpenAI-style) error body.
pub fn openai_error(status: StatusCode, kind: &str, message: impl Into<String>) -> Resp {
    json_response(
        status,
        &json!({"error": {"message": message.into(), "type": kind, "param": null, "code": status.as_u16()}}),
    )
}

pub fn bad_request(message: impl Into<String>) -> Resp {
    openai_error(StatusCode::BAD_REQUEST, "BadRequestError", message)
}

/// FastAPI's bodies for routing errors, which vLLM returns as they are.
pub fn not_found() -> Resp {
    json_response(StatusCode::NOT_FOUND, &json!({"detail": "Not Found"}))
}

pub fn method_not_allowed() -> Resp {
    json_response(
        StatusCode::METHOD_NOT_ALLOWED,
        &json!({"detail": "Method Not Allowed"}),
    )
}

/// Reads a whole request body (requests here are small JSON documents).
pub async fn read_body(req: Request<Incoming>) -> Result<Bytes, Resp> {
    use http_body_util::BodyExt;
    match req.into_body().collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) => Err(bad_request(format!("could not read request body: {e}"))),
    }
}

/// Parses a JSON body, answering 400 on anything that is not a JSON object.
pub fn parse_json_object(body: &[u8]) -> Result<Value, Resp> {
    match serde_json::from_slice::<Value>(body) {
        Ok(v @ Value::Object(_)) => Ok(v),
        Ok(_) => Err(bad_request("request body must be a JSON object")),
        Err(e) => Err(bad_request(format!("invalid JSON in request body: {e}"))),
    }
}

/// Serves HTTP/1.1 connections from `listener` with `handler` until `stop` resolves.
pub async fn serve<H, F>(listener: TcpListener, handler: H, stop: impl Future<Output = ()>)
where
    H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Resp> + Send + 'static,
{
    tokio::pin!(stop);
    loop {
        let stream = tokio::select! {
            _ = &mut stop => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    eprintln!("kvroute-sim: accept failed: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let handler = handler.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let fut = handler(req);
                async move { Ok::<_, Infallible>(fut.await) }
            });
            // Errors here are client disconnects; nothing to do about them.
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}
