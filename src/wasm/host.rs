//! Envoy's services through proxy-wasm, as the gateway asks for them: the worker's
//! ([`EnvoyHost`]: shared data, clock, stats, HTTP calls, log) and the effective stream's
//! ([`EnvoyStream`]).

use std::time::{Duration, UNIX_EPOCH};

use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, LogLevel, MapType, MetricType, Status};

use crate::gateway::{HostApi, Level, MetricKind, StreamApi};
use crate::store::{SharedStore, StoreError};

/// Envoy, for a worker VM. Shared data is one namespace for every worker VM with kvroute's
/// `vm_id`; stats of the same name are one stat across them.
pub struct EnvoyHost;

impl SharedStore for EnvoyHost {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        hostcalls::get_shared_data(key).unwrap_or((None, None))
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        hostcalls::set_shared_data(key, Some(value), cas).map_err(|status| match status {
            Status::CasMismatch => StoreError::CasMismatch,
            _ => StoreError::Failed,
        })
    }
}

impl HostApi for EnvoyHost {
    fn now_ms(&self) -> u64 {
        hostcalls::get_current_time()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_millis() as u64)
    }

    fn define_metric(&self, kind: MetricKind, name: &str) -> Option<u32> {
        let kind = match kind {
            MetricKind::Counter => MetricType::Counter,
            MetricKind::Gauge => MetricType::Gauge,
            MetricKind::Histogram => MetricType::Histogram,
        };
        hostcalls::define_metric(kind, name).ok()
    }

    fn increment_metric(&self, id: u32, delta: i64) {
        let _ = hostcalls::increment_metric(id, delta);
    }

    fn record_metric(&self, id: u32, value: u64) -> bool {
        hostcalls::record_metric(id, value).is_ok()
    }

    fn http_call(&self, cluster: &str, headers: &[(&str, &str)], timeout_ms: u64) -> Option<u32> {
        let timeout = Duration::from_millis(timeout_ms);
        hostcalls::dispatch_http_call(cluster, headers.to_vec(), None, vec![], timeout).ok()
    }

    fn log(&self, level: Level, message: &str) {
        let level = match level {
            Level::Info => LogLevel::Info,
            Level::Warn => LogLevel::Warn,
            Level::Error => LogLevel::Error,
        };
        let _ = hostcalls::log(level, message);
    }
}

/// The stream Envoy made effective for the callback running.
pub struct EnvoyStream;

impl StreamApi for EnvoyStream {
    /// `xds.cluster_name` on current Envoy (one host call), the older `cluster_name` only where
    /// that is missing.
    fn route_cluster(&self) -> Option<String> {
        [vec!["xds", "cluster_name"], vec!["cluster_name"]]
            .into_iter()
            .find_map(|path| hostcalls::get_property(path).ok().flatten())
            .and_then(|b| String::from_utf8(b).ok())
    }

    /// Read as bytes: the SDK's `get_map_value` panics on a value that is not UTF-8, which would
    /// trap the VM on a client's say-so.
    fn request_header(&self, name: &str) -> Option<String> {
        hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, name)
            .ok()
            .flatten()
            .map(|v| String::from_utf8_lossy(&v).into_owned())
    }

    fn upstream_address(&self) -> Option<String> {
        hostcalls::get_property(vec!["upstream", "address"])
            .ok()
            .flatten()
            .and_then(|b| String::from_utf8(b).ok())
    }

    fn response_status(&self) -> Option<u16> {
        status(MapType::HttpResponseHeaders)
    }

    fn response_flags(&self) -> u64 {
        hostcalls::get_property(vec!["response", "flags"])
            .ok()
            .flatten()
            .and_then(|b| b.get(..8)?.try_into().ok())
            .map_or(0, u64::from_le_bytes)
    }

    fn response_body_end(&self, size: usize, len: usize) -> Option<Vec<u8>> {
        hostcalls::get_buffer(BufferType::HttpResponseBody, size.saturating_sub(len), len)
            .ok()
            .flatten()
    }
}

/// The `:status` of a header map (a response's, or an HTTP call's), read as bytes: the SDK's
/// string read panics on a value that is not UTF-8.
pub fn status(map: MapType) -> Option<u16> {
    hostcalls::get_map_value_bytes(map, ":status")
        .ok()
        .flatten()
        .and_then(|s| std::str::from_utf8(&s).ok()?.parse().ok())
}

/// The request's headers, values as bytes; names are tokens, which Envoy's codecs check, so they
/// are text. `None` when the map cannot be read.
pub fn request_headers() -> Option<Vec<(String, Vec<u8>)>> {
    hostcalls::get_map_bytes(MapType::HttpRequestHeaders).ok()
}
