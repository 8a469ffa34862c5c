//! One ext_proc stream's messages and the picker's answers, without Envoy: a client's routing
//! header replaced, and Envoy's full-duplex body mode, where the headers' answer waits for the
//! body and the body goes back through the answers.

use crate::common;

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use common::driven::{header_map, message, Picker};
use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation::Mutation, processing_request::Request, processing_response::Response,
    CommonResponse, HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse,
    ProtocolConfiguration,
};
use kvroute::config::Config;

const HEADER: &str = "x-gateway-destination-endpoint";

fn picker() -> Picker {
    let json = r#"{"endpoints":["127.0.0.1:8001","127.0.0.1:8002"]}"#;
    Picker::new(
        Config::parse(json.as_bytes()).unwrap(),
        Arc::new(AtomicU64::new(1_000)),
    )
}

fn chat() -> String {
    r#"{"model":"m","messages":[{"role":"user","content":"hello there"}]}"#.to_string()
}

fn headers(body: &str, extra: &[(&str, &str)]) -> HttpHeaders {
    let length = body.len().to_string();
    let mut all = vec![
        (":method", "POST"),
        (":path", "/v1/chat/completions"),
        ("content-length", length.as_str()),
    ];
    all.extend_from_slice(extra);
    let all = all
        .iter()
        .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
        .collect();
    HttpHeaders {
        headers: Some(header_map(all)),
        ..HttpHeaders::default()
    }
}

fn common(answer: &ProcessingResponse) -> &CommonResponse {
    let response = match &answer.response {
        Some(Response::RequestHeaders(h)) => h.response.as_ref(),
        Some(Response::RequestBody(b)) => b.response.as_ref(),
        other => panic!("not a request answer: {other:?}"),
    };
    response.expect("a common response")
}

#[test]
fn a_clients_routing_header_is_removed_and_the_pick_written_over_it() {
    let mut picker = picker();
    let mut stream = picker.stream();
    let body = chat();
    let sent = message(Request::RequestHeaders(headers(
        &body,
        &[(HEADER, "10.9.9.9:80")],
    )));
    let answers = picker.drive(stream.step(sent)).unwrap();
    let mutation = common(&answers[0]).header_mutation.as_ref().unwrap();
    assert_eq!(mutation.remove_headers, [HEADER]);
    let sent = message(Request::RequestBody(HttpBody {
        body: body.into_bytes(),
        end_of_stream: true,
        ..HttpBody::default()
    }));
    let answers = picker.drive(stream.step(sent)).unwrap();
    let set = &common(&answers[0])
        .header_mutation
        .as_ref()
        .unwrap()
        .set_headers[0];
    assert_eq!(
        set.append_action,
        HeaderAppendAction::OverwriteIfExistsOrAdd as i32
    );
    let header = set.header.as_ref().unwrap();
    assert_eq!(header.key, HEADER);
    let value = String::from_utf8_lossy(&header.raw_value);
    assert!(value.starts_with("127.0.0.1:800"), "{value}");
    assert!(!value.contains("10.9.9.9"), "{value}");
}

#[test]
fn in_full_duplex_mode_the_headers_wait_for_the_body_and_the_body_goes_back_whole() {
    let mut picker = picker();
    let mut stream = picker.stream();
    let body = chat();
    let duplex = |request| ProcessingRequest {
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: BodySendMode::FullDuplexStreamed as i32,
            ..ProtocolConfiguration::default()
        }),
        request: Some(request),
        ..ProcessingRequest::default()
    };
    let answers = picker.drive(stream.step(duplex(Request::RequestHeaders(headers(&body, &[])))));
    assert!(
        answers.unwrap().is_empty(),
        "the headers were answered before the body"
    );
    let (first, rest) = body.as_bytes().split_at(10);
    for (chunk, end) in [(first, false), (rest, true)] {
        let sent = duplex(Request::RequestBody(HttpBody {
            body: chunk.to_vec(),
            end_of_stream: end,
            ..HttpBody::default()
        }));
        let answers = picker.drive(stream.step(sent)).unwrap();
        if !end {
            assert!(answers.is_empty(), "{answers:?}");
            continue;
        }
        let [headers, body_back] = &answers[..] else {
            panic!("the headers' answer then the body's: {answers:?}");
        };
        assert!(matches!(
            headers.response,
            Some(Response::RequestHeaders(_))
        ));
        let set = &common(headers)
            .header_mutation
            .as_ref()
            .unwrap()
            .set_headers;
        assert_eq!(set[0].header.as_ref().unwrap().key, HEADER);
        assert!(
            headers.dynamic_metadata.is_some(),
            "the pick as envoy.lb metadata too"
        );
        let mutation = common(body_back).body_mutation.as_ref().unwrap();
        let Some(Mutation::StreamedResponse(streamed)) = &mutation.mutation else {
            panic!("{mutation:?}");
        };
        assert_eq!(streamed.body, body.as_bytes());
        assert!(streamed.end_of_stream);
    }
}
