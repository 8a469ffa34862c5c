//! A picker's worker driven one ext_proc message at a time, in the test's thread: each stream
//! step runs to its end with the worker handling the events it sends, as the worker's thread would.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request::Request, processing_response::Response, HttpBody, HttpHeaders,
    ProcessingRequest, ProcessingResponse, ProtocolConfiguration,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
use kvroute::config::Config;
use kvroute_epp::extproc::{Options, Stream};
use kvroute_epp::host::{NativeHost, Shared};
use kvroute_epp::stats::Stats;
use kvroute_epp::store::SyncStore;
use kvroute_epp::upstreams::Upstreams;
use kvroute_epp::worker::{Event, Worker};

/// A worker fed ext_proc messages through the picker's stream translation.
pub struct Picker {
    pub worker: Worker,
    events: Receiver<Event>,
    inbox: mpsc::Sender<Event>,
    options: Arc<Options>,
    open: Vec<(Stream, Option<String>)>,
    next_id: u64,
    _runtime: tokio::runtime::Runtime,
}

impl Picker {
    pub fn new(config: Config, clock: Arc<AtomicU64>) -> Picker {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let shared = Shared {
            store: Arc::new(SyncStore::new()),
            stats: Arc::new(Stats::default()),
            clock: Arc::new(move || clock.load(Ordering::Relaxed)),
            upstreams: Arc::new(Upstreams::new(&config.header)),
            runtime: runtime.handle().clone(),
        };
        let (inbox, events) = mpsc::channel();
        let options = Arc::new(Options {
            header: config.header.clone(),
            single_address: false,
            subset_from_header: false,
        });
        let host = NativeHost::new(shared, inbox.clone());
        Picker {
            worker: Worker::new(config, host, Some("inference_pool".into())),
            events,
            inbox,
            options,
            open: Vec::new(),
            next_id: 0,
            _runtime: runtime,
        }
    }

    /// Runs `step` to its end, handing the worker each event it sends, as its thread would.
    pub fn drive<T>(&mut self, step: impl Future<Output = T>) -> T {
        let mut step = std::pin::pin!(step);
        let mut cx = Context::from_waker(Waker::noop());
        for _ in 0..100 {
            let done = step.as_mut().poll(&mut cx);
            while let Ok(event) = self.events.try_recv() {
                self.worker.handle(event);
            }
            if let Poll::Ready(out) = done {
                return out;
            }
        }
        panic!("a stream step never finished");
    }

    /// A new stream, not yet opened.
    pub fn stream(&mut self) -> Stream {
        self.next_id += 1;
        Stream::new(self.next_id, self.inbox.clone(), self.options.clone())
    }

    /// A buffered request with `headers` and `body`: the pick its body's answer names (kept
    /// open, to be answered by [`Picker::answer_oldest`]).
    pub fn send(&mut self, headers: Vec<(String, Vec<u8>)>, body: String) -> Option<String> {
        let mut stream = self.stream();
        let headers = message(Request::RequestHeaders(HttpHeaders {
            headers: Some(header_map(headers)),
            end_of_stream: false,
            ..HttpHeaders::default()
        }));
        let answers = self.drive(stream.step(headers)).unwrap();
        let headers_answered = matches!(
            answers[..],
            [ProcessingResponse {
                response: Some(Response::RequestHeaders(_)),
                ..
            }]
        );
        assert!(headers_answered, "{answers:?}");
        let body = message(Request::RequestBody(HttpBody {
            body: body.into_bytes(),
            end_of_stream: true,
            ..HttpBody::default()
        }));
        let answers = self.drive(stream.step(body)).unwrap();
        let pick = picked(&answers);
        self.open.push((stream, pick.clone()));
        pick
    }

    pub fn answer_oldest(&mut self) {
        let (mut stream, pick) = self.open.remove(0);
        let served = pick
            .as_deref()
            .and_then(|p| p.split(',').next())
            .unwrap_or_default();
        let mut headers = message(Request::ResponseHeaders(HttpHeaders {
            headers: Some(header_map(vec![(":status".into(), b"200".to_vec())])),
            ..HttpHeaders::default()
        }));
        let attributes = Struct {
            fields: [("upstream.address".to_string(), string(served))].into(),
        };
        headers.attributes = [("envoy.filters.http.ext_proc".to_string(), attributes)].into();
        self.drive(stream.step(headers)).unwrap();
        stream.end();
        while let Ok(event) = self.events.try_recv() {
            self.worker.handle(event);
        }
    }
}

pub fn message(request: Request) -> ProcessingRequest {
    ProcessingRequest {
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: BodySendMode::Buffered as i32,
            ..ProtocolConfiguration::default()
        }),
        request: Some(request),
        ..ProcessingRequest::default()
    }
}

pub fn header_map(headers: Vec<(String, Vec<u8>)>) -> HeaderMap {
    HeaderMap {
        headers: headers
            .into_iter()
            .map(|(key, raw_value)| HeaderValue {
                key,
                raw_value,
                ..HeaderValue::default()
            })
            .collect(),
    }
}

fn string(s: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.to_string())),
    }
}

/// The pick in the answer to a body: the routing header's value, which the `envoy.lb` metadata
/// must repeat.
pub fn picked(answers: &[ProcessingResponse]) -> Option<String> {
    let [answer] = answers else {
        panic!("one answer to a buffered body, got {answers:?}");
    };
    let Some(Response::RequestBody(body)) = &answer.response else {
        panic!("not a body answer: {answer:?}");
    };
    let mutation = body.response.as_ref()?.header_mutation.as_ref()?;
    let header = mutation
        .set_headers
        .iter()
        .filter_map(|h| h.header.as_ref())
        .find(|h| h.key == "x-gateway-destination-endpoint")
        .map(|h| String::from_utf8_lossy(&h.raw_value).into_owned());
    let metadata = answer
        .dynamic_metadata
        .as_ref()
        .and_then(|m| m.fields.get("envoy.lb"))
        .and_then(|v| match &v.kind {
            Some(Kind::StructValue(s)) => s.fields.get("x-gateway-destination-endpoint"),
            _ => None,
        })
        .and_then(|v| match &v.kind {
            Some(Kind::StringValue(s)) => Some(s.clone()),
            _ => None,
        });
    assert_eq!(header, metadata, "the header and the metadata differ");
    header
}
