//! One ext_proc stream, translated: each of Envoy's processing requests becomes a step of the
//! request on its worker's gateway, and what the gateway answers becomes the processing
//! responses, in the endpoint picker protocol's terms (the pick as a header and as `envoy.lb`
//! metadata, the subset hint, a 503 when nothing in the subset is eligible).

use std::sync::mpsc::Sender;
use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::{
    header_value_option::HeaderAppendAction, HeaderValue, HeaderValueOption, Metadata,
};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::r#type::v3::{HttpStatus, StatusCode};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_request, processing_response, BodyMutation, BodyResponse,
    CommonResponse, HeaderMutation, HeadersResponse, HttpBody, HttpHeaders, ImmediateResponse,
    ProcessingRequest, ProcessingResponse, StreamedBodyResponse, TrailersResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
use kvroute::gateway::Body;
use kvroute::router::Fallback;
use kvroute::usage::Tail;
use tokio::sync::oneshot;

use crate::worker::{Event, Response, Routing};

/// The metadata namespace the pick is written to and the served endpoint read from.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// The pick's key there (and the routing header's default name).
pub const DESTINATION_KEY: &str = "x-gateway-destination-endpoint";
/// The namespace and key of the subset hint: the only endpoints a request may go to.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
/// The key, in [`LB_NAMESPACE`], of the endpoint that served the request.
pub const SERVED_KEY: &str = "x-gateway-destination-endpoint-served";
/// The ext_proc attribute that names the endpoint that served, where Envoy is asked for it.
const UPSTREAM_ATTRIBUTE: &str = "upstream.address";
const FLAGS_ATTRIBUTE: &str = "response.flags";
/// The response header with the gateway's decision, where `debug_header` is configured.
const DECISION_HEADER: &str = "x-kvroute-decision";
/// Largest body chunk sent back in full-duplex mode (the size Envoy's ext_proc recommends).
const CHUNK: usize = 64 << 10;

/// How the picker answers, for every stream.
#[derive(Debug, Clone)]
pub struct Options {
    /// The routing header (the configuration's `header`).
    pub header: String,
    /// Name only the pick, not its fallbacks (agentgateway reads one address).
    pub single_address: bool,
    /// Also read the subset from the request header [`SUBSET_KEY`], which the gateway sets
    /// (and must keep clients from setting).
    pub subset_from_header: bool,
}

/// One ext_proc stream's state between its messages.
pub struct Stream {
    id: u64,
    worker: Sender<Event>,
    options: Arc<Options>,
    /// The worker has this stream (its end must be told).
    opened: bool,
    /// The request waits for its body to be routed.
    routing: bool,
    /// The client sent the routing header: removed.
    strip: bool,
    body: Vec<u8>,
    subset: Option<Vec<String>>,
    /// Envoy streams the request body full-duplex: the headers' answer waits for the body, and
    /// the body goes back to Envoy through the answers.
    duplex_request: bool,
    duplex_response: bool,
}

/// The worker is gone (the process is stopping).
#[derive(Debug)]
pub struct WorkerGone;

impl Stream {
    pub fn new(id: u64, worker: Sender<Event>, options: Arc<Options>) -> Stream {
        Stream {
            id,
            worker,
            options,
            opened: false,
            routing: false,
            strip: false,
            body: Vec::new(),
            subset: None,
            duplex_request: false,
            duplex_response: false,
        }
    }

    async fn ask<T>(
        &self,
        event: impl FnOnce(oneshot::Sender<T>) -> Event,
    ) -> Result<T, WorkerGone> {
        let (reply, answer) = oneshot::channel();
        self.worker.send(event(reply)).map_err(|_| WorkerGone)?;
        answer.await.map_err(|_| WorkerGone)
    }

    /// One processing request: the responses to send back, in order.
    pub async fn step(
        &mut self,
        mut req: ProcessingRequest,
    ) -> Result<Vec<ProcessingResponse>, WorkerGone> {
        if let Some(config) = &req.protocol_config {
            let duplex = BodySendMode::FullDuplexStreamed as i32;
            self.duplex_request = config.request_body_mode == duplex;
            self.duplex_response = config.response_body_mode == duplex;
        }
        if let Some(subset) = subset_hint(req.metadata_context.as_ref()) {
            self.subset = Some(subset);
        }
        let Some(request) = req.request.take() else {
            return Ok(Vec::new());
        };
        match request {
            processing_request::Request::RequestHeaders(h) => self.request_headers(h).await,
            processing_request::Request::RequestBody(b) => self.request_body(b).await,
            processing_request::Request::RequestTrailers(_) => Ok(vec![answer(
                processing_response::Response::RequestTrailers(TrailersResponse::default()),
            )]),
            processing_request::Request::ResponseHeaders(h) => {
                let served = served(&req);
                let flags = attribute(&req, FLAGS_ATTRIBUTE)
                    .and_then(|v| match v {
                        Kind::NumberValue(n) => Some(*n as u64),
                        Kind::StringValue(s) => s.parse().ok(),
                        _ => None,
                    })
                    .unwrap_or(0);
                self.response_headers(h, served, flags).await
            }
            processing_request::Request::ResponseBody(b) => self.response_body(b),
            processing_request::Request::ResponseTrailers(_) => {
                self.end();
                Ok(vec![answer(
                    processing_response::Response::ResponseTrailers(TrailersResponse::default()),
                )])
            }
        }
    }

    /// The stream closed: the worker settles the request, once.
    pub fn end(&mut self) {
        if std::mem::take(&mut self.opened) {
            let _ = self.worker.send(Event::End { stream: self.id });
        }
    }

    async fn request_headers(
        &mut self,
        h: HttpHeaders,
    ) -> Result<Vec<ProcessingResponse>, WorkerGone> {
        let headers = header_pairs(&h);
        if self.options.subset_from_header {
            let hinted = headers.iter().find(|(n, _)| n == SUBSET_KEY);
            if let Some((_, v)) = hinted {
                self.subset = Some(comma_list(&String::from_utf8_lossy(v)));
            }
        }
        let end_of_stream = h.end_of_stream;
        let verdict = self
            .ask(|reply| Event::RequestHeaders {
                stream: self.id,
                headers,
                end_of_stream,
                reply,
            })
            .await?;
        self.opened = true;
        self.strip = verdict.strip_routing_header;
        self.routing = verdict.buffer;
        if self.routing && self.duplex_request {
            // Answered once the body is in: the routing header goes with the headers.
            return Ok(Vec::new());
        }
        Ok(vec![self.headers_answer(None)])
    }

    async fn request_body(&mut self, b: HttpBody) -> Result<Vec<ProcessingResponse>, WorkerGone> {
        if !self.routing {
            return Ok(self.pass_body(b.body, b.end_of_stream));
        }
        self.body.extend_from_slice(&b.body);
        let end = b.end_of_stream;
        let size = self.body.len();
        let body = if end {
            std::mem::take(&mut self.body)
        } else {
            Vec::new()
        };
        // Full-duplex: the body goes back to Envoy after the routing, so a copy stays here.
        let held = if self.duplex_request && end {
            body.clone()
        } else {
            Vec::new()
        };
        let subset = self.subset.clone();
        let routing = self
            .ask(|reply| Event::RequestBody {
                stream: self.id,
                size,
                end,
                body,
                subset,
                reply,
            })
            .await?;
        match routing.body {
            Body::Wait if self.duplex_request => Ok(Vec::new()),
            Body::Wait => Ok(vec![body_answer(None)]),
            Body::Continue => {
                // Too large to route: the request goes on unrouted.
                self.routing = false;
                if !self.duplex_request {
                    return Ok(vec![body_answer(None)]);
                }
                let held = if end {
                    held
                } else {
                    std::mem::take(&mut self.body)
                };
                let mut out = vec![self.headers_answer(None)];
                out.extend(self.pass_body(held, end));
                Ok(out)
            }
            Body::Route => {
                self.routing = false;
                Ok(self.routed(routing, held))
            }
        }
    }

    /// The answers once the request is routed (or left to Envoy's balancer).
    fn routed(&mut self, routing: Routing, body: Vec<u8>) -> Vec<ProcessingResponse> {
        let value = routing.value.map(|v| match self.options.single_address {
            true => v.split(',').next().unwrap_or_default().to_string(),
            false => v,
        });
        if value.is_none()
            && self.subset.is_some()
            && routing.fallback == Some(Fallback::NoHealthyEndpoint)
        {
            return vec![unavailable()];
        }
        let mut first = if self.duplex_request {
            self.headers_answer(value.as_deref())
        } else {
            let mut answer = body_answer(Some(self.mutation(value.as_deref())));
            answer.dynamic_metadata = value.as_deref().map(destination_metadata);
            answer
        };
        if self.duplex_request {
            first.dynamic_metadata = value.as_deref().map(destination_metadata);
            let mut out = vec![first];
            out.extend(self.pass_body(body, true));
            return out;
        }
        vec![first]
    }

    /// The answer to the request headers: the client's routing header removed, and the pick set
    /// (in full-duplex mode, where the headers wait for the body).
    fn headers_answer(&self, value: Option<&str>) -> ProcessingResponse {
        let mut answer = answer(processing_response::Response::RequestHeaders(
            HeadersResponse {
                response: Some(CommonResponse {
                    header_mutation: Some(self.mutation(value)),
                    ..CommonResponse::default()
                }),
            },
        ));
        answer.dynamic_metadata = value.map(destination_metadata);
        answer
    }

    /// The request header mutation: the pick written over whatever the client sent, or the
    /// client's routing header removed.
    fn mutation(&self, value: Option<&str>) -> HeaderMutation {
        let header = &self.options.header;
        match value {
            Some(value) => HeaderMutation {
                set_headers: vec![set_header(header, value)],
                ..HeaderMutation::default()
            },
            None => HeaderMutation {
                remove_headers: if self.strip {
                    vec![header.clone()]
                } else {
                    Vec::new()
                },
                ..HeaderMutation::default()
            },
        }
    }

    /// A body chunk not held for routing: acknowledged, or in full-duplex mode sent back.
    fn pass_body(&self, body: Vec<u8>, end: bool) -> Vec<ProcessingResponse> {
        if !self.duplex_request {
            return vec![body_answer(None)];
        }
        streamed(body, end, processing_response::Response::RequestBody)
    }

    async fn response_headers(
        &mut self,
        h: HttpHeaders,
        served: Option<String>,
        flags: u64,
    ) -> Result<Vec<ProcessingResponse>, WorkerGone> {
        let status = header_pairs(&h)
            .into_iter()
            .find(|(n, _)| n == ":status")
            .and_then(|(_, v)| std::str::from_utf8(&v).ok()?.parse().ok());
        let mut debug = None;
        if self.opened {
            let end = h.end_of_stream;
            let response = Response {
                served,
                status,
                flags,
            };
            debug = self
                .ask(|reply| Event::ResponseHeaders {
                    stream: self.id,
                    response,
                    end,
                    reply,
                })
                .await?;
            if end {
                self.end();
            }
        }
        let mutation = debug.map(|d| HeaderMutation {
            set_headers: vec![set_header(DECISION_HEADER, &d)],
            ..HeaderMutation::default()
        });
        Ok(vec![answer(
            processing_response::Response::ResponseHeaders(HeadersResponse {
                response: Some(CommonResponse {
                    header_mutation: mutation,
                    ..CommonResponse::default()
                }),
            }),
        )])
    }

    fn response_body(&mut self, b: HttpBody) -> Result<Vec<ProcessingResponse>, WorkerGone> {
        let end = b.end_of_stream;
        if self.opened {
            let size = b.body.len();
            let tail = b.body[size - Tail::wanted(size).min(size)..].to_vec();
            let _ = self.worker.send(Event::ResponseBody {
                stream: self.id,
                size,
                tail,
                end,
            });
            if end {
                self.end();
            }
        }
        if self.duplex_response {
            return Ok(streamed(
                b.body,
                end,
                processing_response::Response::ResponseBody,
            ));
        }
        Ok(vec![answer(processing_response::Response::ResponseBody(
            BodyResponse::default(),
        ))])
    }
}

fn answer(response: processing_response::Response) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(response),
        ..ProcessingResponse::default()
    }
}

fn body_answer(mutation: Option<HeaderMutation>) -> ProcessingResponse {
    answer(processing_response::Response::RequestBody(BodyResponse {
        response: Some(CommonResponse {
            header_mutation: mutation,
            ..CommonResponse::default()
        }),
    }))
}

/// `body` sent back to Envoy in full-duplex mode, in chunks (one, empty, for an empty body).
fn streamed(
    body: Vec<u8>,
    end: bool,
    phase: fn(BodyResponse) -> processing_response::Response,
) -> Vec<ProcessingResponse> {
    let chunks: Vec<&[u8]> = match body.is_empty() {
        true => vec![&[]],
        false => body.chunks(CHUNK).collect(),
    };
    let last = chunks.len() - 1;
    chunks
        .into_iter()
        .enumerate()
        .map(|(i, chunk)| {
            let mutation = BodyMutation {
                mutation: Some(body_mutation::Mutation::StreamedResponse(
                    StreamedBodyResponse {
                        body: chunk.to_vec(),
                        end_of_stream: end && i == last,
                        ..StreamedBodyResponse::default()
                    },
                )),
            };
            answer(phase(BodyResponse {
                response: Some(CommonResponse {
                    body_mutation: Some(mutation),
                    ..CommonResponse::default()
                }),
            }))
        })
        .collect()
}

/// The protocol's answer when nothing in the subset hint is eligible.
fn unavailable() -> ProcessingResponse {
    answer(processing_response::Response::ImmediateResponse(
        ImmediateResponse {
            status: Some(HttpStatus {
                code: StatusCode::ServiceUnavailable as i32,
            }),
            body: b"no endpoint of the request's subset is eligible\n".to_vec(),
            details: "kvroute_epp_subset_unavailable".to_string(),
            ..ImmediateResponse::default()
        },
    ))
}

fn set_header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_string(),
            raw_value: value.as_bytes().to_vec(),
            ..HeaderValue::default()
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..HeaderValueOption::default()
    }
}

/// `envoy.lb` / `x-gateway-destination-endpoint`: the pick (and its fallbacks, as the header has
/// them), where Envoy's override_host policy can read it as metadata.
fn destination_metadata(value: &str) -> Struct {
    let inner = Struct {
        fields: [(DESTINATION_KEY.to_string(), string(value))].into(),
    };
    Struct {
        fields: [(
            LB_NAMESPACE.to_string(),
            Value {
                kind: Some(Kind::StructValue(inner)),
            },
        )]
        .into(),
    }
}

fn string(s: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.to_string())),
    }
}

/// Header names and values as Envoy sent them (values as bytes: `raw_value`, else `value`).
fn header_pairs(h: &HttpHeaders) -> Vec<(String, Vec<u8>)> {
    let Some(map) = &h.headers else {
        return Vec::new();
    };
    map.headers
        .iter()
        .map(|hv| {
            let value = match hv.raw_value.is_empty() {
                true => hv.value.as_bytes().to_vec(),
                false => hv.raw_value.clone(),
            };
            (hv.key.to_ascii_lowercase(), value)
        })
        .collect()
}

/// The subset hint in the request's metadata: a list of `ip:port`, or one comma-separated string.
fn subset_hint(metadata: Option<&Metadata>) -> Option<Vec<String>> {
    let hint = metadata?.filter_metadata.get(SUBSET_NAMESPACE)?;
    let kind = hint.fields.get(SUBSET_KEY)?.kind.as_ref()?;
    Some(match kind {
        Kind::ListValue(list) => list
            .values
            .iter()
            .filter_map(|v| match &v.kind {
                Some(Kind::StringValue(s)) => Some(s.trim().to_string()),
                _ => None,
            })
            .collect(),
        Kind::StringValue(s) => comma_list(s),
        _ => Vec::new(),
    })
}

fn comma_list(s: &str) -> Vec<String> {
    s.split(',')
        .map(str::trim)
        .filter(|a| !a.is_empty())
        .map(str::to_string)
        .collect()
}

/// The endpoint that served: `envoy.lb` / `x-gateway-destination-endpoint-served` in the
/// request's metadata (the protocol's way), else Envoy's `upstream.address` attribute.
fn served(req: &ProcessingRequest) -> Option<String> {
    let from_metadata = req
        .metadata_context
        .as_ref()
        .and_then(|m| m.filter_metadata.get(LB_NAMESPACE))
        .and_then(|lb| lb.fields.get(SERVED_KEY))
        .and_then(|v| match &v.kind {
            Some(Kind::StringValue(s)) => Some(s.clone()),
            _ => None,
        });
    from_metadata.or_else(|| match attribute(req, UPSTREAM_ATTRIBUTE)? {
        Kind::StringValue(s) => Some(s.clone()),
        _ => None,
    })
}

/// An attribute Envoy sent with the request, in whichever namespace.
fn attribute<'r>(req: &'r ProcessingRequest, name: &str) -> Option<&'r Kind> {
    req.attributes
        .values()
        .find_map(|s| s.fields.get(name))
        .and_then(|v| v.kind.as_ref())
}
