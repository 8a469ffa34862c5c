//! Envoy host services for the core: shared data as a [`SharedStore`], the clock, and metrics.

use std::time::UNIX_EPOCH;

use hashbrown::HashMap;
use proxy_wasm::hostcalls;
use proxy_wasm::types::{MetricType, Status};

use crate::store::{SharedStore, StoreError};

/// Envoy shared data: one namespace for every worker VM with kvroute's `vm_id`.
pub struct HostStore;

impl SharedStore for HostStore {
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

/// Milliseconds since the Unix epoch, by Envoy's clock.
pub fn now_ms() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_millis() as u64)
}

/// Envoy stats defined through proxy-wasm; Envoy shows them as `wasmcustom.<name>`. Metrics of the
/// same name are one stat across all worker VMs.
#[derive(Default)]
pub struct Metrics {
    ids: HashMap<String, u32>,
}

impl Metrics {
    fn id(&mut self, kind: MetricType, name: &str) -> Option<u32> {
        if let Some(id) = self.ids.get(name) {
            return Some(*id);
        }
        let id = hostcalls::define_metric(kind, name).ok()?;
        self.ids.insert(name.to_string(), id);
        Some(id)
    }

    /// Makes a counter exist (at zero) so dashboards see it before it first moves.
    pub fn define_counter(&mut self, name: &str) {
        self.id(MetricType::Counter, name);
    }

    pub fn count(&mut self, name: &str) {
        self.add(MetricType::Counter, name, 1);
    }

    pub fn add(&mut self, kind: MetricType, name: &str, delta: i64) {
        if let Some(id) = self.id(kind, name) {
            let _ = hostcalls::increment_metric(id, delta);
        }
    }

    pub fn gauge(&mut self, name: &str, value: u64) {
        if let Some(id) = self.id(MetricType::Gauge, name) {
            let _ = hostcalls::record_metric(id, value);
        }
    }

    pub fn histogram(&mut self, name: &str, value: u64) {
        if let Some(id) = self.id(MetricType::Histogram, name) {
            let _ = hostcalls::record_metric(id, value);
        }
    }
}

/// The gauge mirroring kvroute's in-flight count for an endpoint: `kvroute.inflight.<ip>_<port>`.
pub fn inflight_gauge(addr: &str) -> String {
    let clean: String = addr
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    format!("kvroute.inflight.{}", clean.trim_matches('_'))
}
