//! The HTTP stream context: hands each of Envoy's stream callbacks to the gateway and carries out
//! what it answers (strip or write the routing header, pause or go on, the debug header). Where
//! Envoy withholds bodies from paused filters, it routes from headers instead.

use std::cell::RefCell;
use std::rc::Rc;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, BufferType, MapType};

use super::host::{request_headers, EnvoyStream};
use super::root::Worker;
use crate::body_access::BodyAccess;
use crate::gateway::{Body, Exchange};

pub struct Stream {
    worker: Rc<RefCell<Worker>>,
    id: u32,
    /// Paused while the root watches whether Envoy delivers bodies (see `body_access`).
    watched: bool,
    exchange: Exchange,
}

impl Stream {
    pub fn new(worker: Rc<RefCell<Worker>>, id: u32) -> Self {
        Stream {
            worker,
            id,
            watched: false,
            exchange: Exchange::default(),
        }
    }

    /// Holds the headers until the body is in. Until it is known whether Envoy delivers bodies
    /// during a pause, the root watches the stream.
    fn pause(&mut self, content_length: Option<usize>) -> Action {
        let mut worker = self.worker.borrow_mut();
        let (watched, first) = worker
            .body
            .paused(self.id, content_length.map(|n| n as u64));
        self.watched = watched;
        if first {
            worker.watch_started();
        }
        Action::Pause
    }

    /// A callback on a watched stream: either the root found Envoy withholding bodies and already
    /// routed this stream from its headers and resumed it, or, if `body` is here during the pause,
    /// Envoy delivers bodies. Returns whether the stream is done with routing.
    fn settle_watch(&mut self, body: bool) -> bool {
        if !self.watched {
            return false;
        }
        self.watched = false;
        let mut worker = self.worker.borrow_mut();
        if worker.body.state() == BodyAccess::Missing {
            self.exchange.routed_from_headers();
            return true;
        }
        if body {
            worker.body.delivered();
        } else {
            // A local reply (a timeout, say) ended the pause: no evidence either way.
            worker.body.forget(self.id);
        }
        false
    }

    /// The body is complete (or all we will buffer): route it.
    fn route(&mut self) -> Action {
        let Some(size) = self.exchange.body_to_route() else {
            return Action::Continue;
        };
        let body = hostcalls::get_buffer(BufferType::HttpRequestBody, 0, size)
            .ok()
            .flatten()
            .unwrap_or_default();
        let mut worker = self.worker.borrow_mut();
        let gateway = &mut worker.gateway;
        if let Some(value) = gateway.route(&mut self.exchange, &body, &EnvoyStream) {
            let header = gateway.routing_header();
            let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, header, Some(&value));
        }
        Action::Continue
    }

    /// The stream is over, however it ended (Envoy calls both `on_done` and `on_log`; the
    /// gateway does the work once).
    fn end(&mut self) {
        let mut worker = self.worker.borrow_mut();
        if self.watched {
            self.watched = false;
            worker.body.forget(self.id);
        }
        worker.gateway.on_end(&mut self.exchange, &EnvoyStream);
    }
}

impl Context for Stream {
    fn on_done(&mut self) -> bool {
        self.end();
        true
    }
}

impl HttpContext for Stream {
    fn on_http_request_headers(&mut self, _headers: usize, end_of_stream: bool) -> Action {
        // One host call for every header this needs (each call crosses into the VM twice).
        let headers = request_headers().unwrap_or_default();
        let mut worker = self.worker.borrow_mut();
        let verdict =
            (worker.gateway).on_request_headers(&mut self.exchange, &headers, end_of_stream);
        if verdict.strip_routing_header {
            let header = worker.gateway.routing_header();
            let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, header, None);
        }
        if !verdict.buffer {
            return Action::Continue;
        }
        if worker.body.state() == BodyAccess::Missing {
            // Pausing would hang the request: Envoy would never hand over the body.
            worker.route_from_headers();
            self.exchange.routed_from_headers();
            return Action::Continue;
        }
        drop(worker);
        self.pause(verdict.content_length)
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.settle_watch(true) {
            return Action::Continue;
        }
        let verdict = {
            let gateway = &mut self.worker.borrow_mut().gateway;
            gateway.on_request_body(&mut self.exchange, body_size, end_of_stream)
        };
        match verdict {
            Body::Continue => Action::Continue,
            Body::Wait => Action::Pause,
            Body::Route => self.route(),
        }
    }

    fn on_http_request_trailers(&mut self, _trailers: usize) -> Action {
        if self.settle_watch(true) {
            return Action::Continue;
        }
        self.route()
    }

    fn on_http_response_headers(&mut self, _headers: usize, end_of_stream: bool) -> Action {
        self.settle_watch(false);
        let mut worker = self.worker.borrow_mut();
        let gateway = &mut worker.gateway;
        let debug = gateway.on_response_headers(&mut self.exchange, end_of_stream, &EnvoyStream);
        if let Some(outcome) = debug {
            let _ = hostcalls::set_map_value(
                MapType::HttpResponseHeaders,
                "x-kvroute-decision",
                Some(outcome),
            );
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let gateway = &mut self.worker.borrow_mut().gateway;
        gateway.on_response_body(&mut self.exchange, body_size, end_of_stream, &EnvoyStream);
        Action::Continue
    }

    fn on_log(&mut self) {
        self.end();
    }
}
