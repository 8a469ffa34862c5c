//! The lab's host for one gateway worker: shared data in the gateway's in-memory store, the
//! virtual clock, stats by name, and the HTTP calls it sends, for the lab to answer in virtual time.

use kvroute::gateway::{HostApi, Level, MetricKind, StreamApi};
use kvroute::store::{MemoryStore, SharedStore, StoreError};
use std::cell::{Cell, RefCell};
use std::rc::Rc;

/// An HTTP call a worker sent: its token, cluster and `:path`, and the routing header's value
/// (the engine a metrics call is for).
#[derive(Debug, Clone)]
pub struct Call {
    pub token: u32,
    pub cluster: String,
    pub path: String,
    pub routed_to: Option<String>,
}

/// One worker's services. Workers of one gateway share `store` and `now`.
pub struct LabHost {
    store: Rc<MemoryStore>,
    now: Rc<Cell<u64>>,
    /// The header the gateway names its engine in, on metrics calls.
    routing_header: String,
    stats: RefCell<Vec<(String, i64)>>,
    calls: RefCell<Vec<Call>>,
    next_token: Cell<u32>,
}

impl LabHost {
    pub fn new(store: Rc<MemoryStore>, now: Rc<Cell<u64>>, routing_header: &str) -> LabHost {
        LabHost {
            store,
            now,
            routing_header: routing_header.to_owned(),
            stats: RefCell::default(),
            calls: RefCell::default(),
            next_token: Cell::new(0),
        }
    }

    /// The calls sent since the last take, in the order sent.
    pub fn take_calls(&self) -> Vec<Call> {
        std::mem::take(&mut *self.calls.borrow_mut())
    }
}

impl SharedStore for LabHost {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        self.store.get(key)
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        self.store.set(key, value, cas)
    }
}

impl HostApi for LabHost {
    fn now_ms(&self) -> u64 {
        self.now.get()
    }

    fn define_metric(&self, _kind: MetricKind, name: &str) -> Option<u32> {
        let mut stats = self.stats.borrow_mut();
        if let Some(i) = stats.iter().position(|s| s.0 == name) {
            return Some(i as u32);
        }
        stats.push((name.to_owned(), 0));
        Some(stats.len() as u32 - 1)
    }

    fn increment_metric(&self, id: u32, delta: i64) {
        if let Some(s) = self.stats.borrow_mut().get_mut(id as usize) {
            s.1 += delta;
        }
    }

    fn record_metric(&self, id: u32, value: u64) -> bool {
        match self.stats.borrow_mut().get_mut(id as usize) {
            Some(s) => {
                s.1 = value as i64;
                true
            }
            None => false,
        }
    }

    fn http_call(&self, cluster: &str, headers: &[(&str, &str)], _timeout_ms: u64) -> Option<u32> {
        let token = self.next_token.get() + 1;
        self.next_token.set(token);
        let header = |name: &str| headers.iter().find(|(n, _)| *n == name).map(|(_, v)| *v);
        self.calls.borrow_mut().push(Call {
            token,
            cluster: cluster.to_owned(),
            path: header(":path").unwrap_or("/").to_owned(),
            routed_to: header(&self.routing_header).map(str::to_owned),
        });
        Some(token)
    }

    fn log(&self, _level: Level, _message: &str) {}
}

/// One request's stream as Envoy would show it to the filter.
#[derive(Default)]
pub struct LabStream {
    pub cluster: Option<String>,
    pub headers: Vec<(String, String)>,
    pub upstream: Option<String>,
    pub status: Option<u16>,
    /// The response body so far.
    pub body: Vec<u8>,
}

impl StreamApi for LabStream {
    fn route_cluster(&self) -> Option<String> {
        self.cluster.clone()
    }

    fn request_header(&self, name: &str) -> Option<String> {
        let found = self.headers.iter().find(|(n, _)| n == name);
        found.map(|(_, v)| v.clone())
    }

    fn upstream_address(&self) -> Option<String> {
        self.upstream.clone()
    }

    fn response_status(&self) -> Option<u16> {
        self.status
    }

    fn response_flags(&self) -> u64 {
        0
    }

    fn response_body_end(&self, size: usize, len: usize) -> Option<Vec<u8>> {
        let body = &self.body[..size.min(self.body.len())];
        Some(body[body.len().saturating_sub(len)..].to_vec())
    }
}
