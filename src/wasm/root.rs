//! The root context (one per worker VM): builds the gateway from the plugin configuration, runs
//! its tick on Envoy's timer, hands it the poll's answers, watches paused streams for a body
//! Envoy withholds, and gives each HTTP stream the worker's state.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{BufferType, ContextType, LogLevel, MapType};

use super::host::{self, EnvoyHost, EnvoyStream};
use super::http::Stream;
use crate::body_access::{self, BodyWatch, WATCH_TICK_MS};
use crate::gateway::{stat_names, Gateway, HostApi};
use crate::router::Fallback;

/// What a worker VM's streams share: its gateway, whether Envoy delivers bodies during a pause
/// (and the paused streams watched until that is known), and the timer's period.
pub struct Worker {
    pub gateway: Gateway<EnvoyHost>,
    pub body: BodyWatch,
    /// The root's tick period now (0: not ticking).
    tick_ms: u64,
}

impl Worker {
    /// Sets the root's tick period. Only on a change: Envoy restarts the timer on every call, so
    /// setting it per request could keep it from ever firing.
    fn tick_every(&mut self, ms: u64) {
        if ms != self.tick_ms {
            let _ = hostcalls::set_tick_period(Duration::from_millis(ms));
            self.tick_ms = ms;
        }
    }

    /// A paused stream is now watched: tick at least every [`WATCH_TICK_MS`] until a verdict.
    pub fn watch_started(&mut self) {
        if self.tick_ms == 0 || self.tick_ms > WATCH_TICK_MS {
            self.tick_every(WATCH_TICK_MS);
        }
    }

    /// Routes the effective stream from its headers alone (see [`Gateway::route_from_headers`]).
    pub fn route_from_headers(&mut self) {
        if let Some(value) = self.gateway.route_from_headers(&EnvoyStream) {
            let header = self.gateway.routing_header();
            let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, header, Some(&value));
        }
    }
}

#[derive(Default)]
pub struct Root {
    worker: Option<Rc<RefCell<Worker>>>,
}

/// Looks at every watched paused stream for a body Envoy read but never delivered. On the first
/// such evidence, concludes the flag is missing: logs it once, then routes every paused stream from
/// its headers and resumes it.
fn watch_paused(worker: &RefCell<Worker>) {
    let now = EnvoyHost.now_ms();
    let mut evidence = false;
    let watched = worker.borrow().body.watched();
    for id in watched {
        if hostcalls::set_effective_context(id).is_err() {
            worker.borrow_mut().body.forget(id);
            continue;
        }
        let Some(received) = body_received() else {
            continue;
        };
        evidence |= worker.borrow_mut().body.observe(id, received, now);
    }
    if !evidence {
        return;
    }
    let Some(paused) = worker.borrow_mut().body.conclude_missing() else {
        return;
    };
    let counted = stat_names::fallback(Fallback::NoBodyAccess);
    let _ = hostcalls::log(
        LogLevel::Error,
        &format!(
            "Envoy holds request bodies back from the filter: the Wasm filter config lacks \
             `allow_on_headers_stop_iteration: true` (Istio's WasmPlugin cannot set it; use the \
             EnvoyFilter in istio/). Routing from headers only (session header, else Envoy's \
             load balancer) from now on; counted as {counted}."
        ),
    );
    for id in paused {
        if hostcalls::set_effective_context(id).is_ok() {
            worker.borrow_mut().route_from_headers();
            let _ = hostcalls::resume_http_request();
        }
    }
}

/// Body bytes Envoy has read for the effective stream.
fn body_received() -> Option<u64> {
    let total = hostcalls::get_property(vec!["request", "total_size"])
        .ok()
        .flatten()?;
    let headers = host::request_headers()?;
    body_access::body_received(&total, body_access::header_bytes(&headers))
}

impl Context for Root {
    fn on_http_call_response(
        &mut self,
        token: u32,
        _headers: usize,
        body: usize,
        _trailers: usize,
    ) {
        if let Some(worker) = &self.worker {
            let status = host::status(MapType::HttpCallResponseHeaders);
            let body = hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body)
                .ok()
                .flatten();
            (worker.borrow_mut().gateway).on_poll_answer(token, status, body);
        }
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let bytes = hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX)
            .ok()
            .flatten()
            .unwrap_or_default();
        let gateway = match Gateway::configure(&bytes, EnvoyHost) {
            Ok(gateway) => gateway,
            Err(e) => {
                let _ = hostcalls::log(LogLevel::Critical, &e);
                return false;
            }
        };
        self.worker = Some(Rc::new(RefCell::new(Worker {
            gateway,
            body: BodyWatch::default(),
            tick_ms: 0,
        })));
        self.on_tick();
        true
    }

    fn on_tick(&mut self) {
        let Some(worker) = self.worker.clone() else {
            return;
        };
        {
            let mut w = worker.borrow_mut();
            let tick_ms = w.tick_ms;
            w.gateway.tick(tick_ms);
        }
        // After the gateway's tick: this switches the effective context to paused streams (the
        // tick period set below is the root's whichever context is effective).
        if worker.borrow().body.watching() {
            watch_paused(&worker);
        }
        let mut w = worker.borrow_mut();
        let poll_ms = w.gateway.tick_period();
        let ms = match poll_ms {
            _ if !w.body.watching() => poll_ms,
            0 => WATCH_TICK_MS,
            ms => ms.min(WATCH_TICK_MS),
        };
        w.tick_every(ms);
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Stream::new(self.worker.clone()?, context_id)))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
