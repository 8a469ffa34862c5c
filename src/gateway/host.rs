//! What the gateway needs from the proxy it runs in: shared data, a clock, stats, HTTP calls and
//! a log, for the worker; and, for one request, the few things it reads of the stream.

use crate::store::SharedStore;

/// The kind of a stat, as proxy-wasm defines them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MetricKind {
    Counter,
    Gauge,
    Histogram,
}

/// Log severity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    Info,
    Warn,
    Error,
}

/// A worker's services: Envoy's through proxy-wasm in the filter, in-memory ones in tests.
/// Shared data is the [`SharedStore`] this extends.
pub trait HostApi: SharedStore {
    /// Milliseconds since the Unix epoch.
    fn now_ms(&self) -> u64;
    /// The id of stat `name`, defined now if new; `None` when the host refuses it.
    fn define_metric(&self, kind: MetricKind, name: &str) -> Option<u32>;
    fn increment_metric(&self, id: u32, delta: i64);
    /// Sets a gauge or records a histogram value; whether the host took it.
    fn record_metric(&self, id: u32, value: u64) -> bool;
    /// Sends `GET` with `headers` to `cluster`; the answer comes back, under the returned token,
    /// to [`Gateway::on_poll_answer`](super::Gateway::on_poll_answer). `None` when it could not
    /// be sent.
    fn http_call(&self, cluster: &str, headers: &[(&str, &str)], timeout_ms: u64) -> Option<u32>;
    fn log(&self, level: Level, message: &str);
}

/// What the gateway reads of one stream, each only when it needs it (every read is a host call).
pub trait StreamApi {
    /// The upstream cluster the request's route chose.
    fn route_cluster(&self) -> Option<String>;
    /// A request header's value (bytes read as text, invalid sequences as U+FFFD).
    fn request_header(&self, name: &str) -> Option<String>;
    /// The host that gave the final answer (after Envoy's retries).
    fn upstream_address(&self) -> Option<String>;
    /// The response's `:status`.
    fn response_status(&self) -> Option<u16>;
    /// Envoy's `response.flags` (legacy bit set), 0 when unavailable.
    fn response_flags(&self) -> u64;
    /// The last `len` bytes of the response body chunk of `size` bytes now buffered.
    fn response_body_end(&self, size: usize, len: usize) -> Option<Vec<u8>>;
}
