//! An in-memory host for driving a [`Gateway`](super::Gateway) in tests: shared data in a map, a
//! clock the test sets, stats by name, HTTP calls recorded for the test to answer.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use super::host::{HostApi, Level, MetricKind, StreamApi};
use crate::store::{MemoryStore, SharedStore, StoreError};

/// An HTTP call sent: token, cluster, headers.
type Call = (u32, String, Vec<(String, String)>);

#[derive(Default)]
pub struct MemoryHost {
    /// Shared data; workers of one gateway share it.
    pub store: Rc<MemoryStore>,
    pub now: Cell<u64>,
    /// Stats by name: kind and value.
    stats: RefCell<Vec<(String, MetricKind, i64)>>,
    /// HTTP calls sent and not yet taken by the test: token, cluster, headers.
    calls: RefCell<Vec<Call>>,
    next_token: Cell<u32>,
    pub logs: RefCell<Vec<String>>,
}

impl MemoryHost {
    pub fn at(now_ms: u64) -> MemoryHost {
        let host = MemoryHost::default();
        host.now.set(now_ms);
        host
    }

    /// Another worker of the same gateway: the same shared data and time, its own stats.
    pub fn sibling(&self) -> MemoryHost {
        let host = MemoryHost::at(self.now.get());
        MemoryHost {
            store: self.store.clone(),
            ..host
        }
    }

    /// A stat's value (0 when never defined or moved).
    pub fn stat(&self, name: &str) -> i64 {
        let stats = self.stats.borrow();
        stats.iter().find(|s| s.0 == name).map_or(0, |s| s.2)
    }

    pub fn defined(&self, name: &str) -> bool {
        self.stats.borrow().iter().any(|s| s.0 == name)
    }

    /// The HTTP calls sent since the last take: token, cluster, `:path`.
    pub fn take_calls(&self) -> Vec<(u32, String, String)> {
        let calls = std::mem::take(&mut *self.calls.borrow_mut());
        calls
            .into_iter()
            .map(|(token, cluster, headers)| {
                let path = headers
                    .iter()
                    .find(|(n, _)| n == ":path")
                    .map(|(_, v)| v.clone())
                    .unwrap_or_default();
                (token, cluster, path)
            })
            .collect()
    }
}

impl SharedStore for MemoryHost {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        self.store.get(key)
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        self.store.set(key, value, cas)
    }
}

impl HostApi for MemoryHost {
    fn now_ms(&self) -> u64 {
        self.now.get()
    }

    fn define_metric(&self, kind: MetricKind, name: &str) -> Option<u32> {
        let mut stats = self.stats.borrow_mut();
        if let Some(i) = stats.iter().position(|s| s.0 == name) {
            return Some(i as u32);
        }
        stats.push((name.to_string(), kind, 0));
        Some(stats.len() as u32 - 1)
    }

    fn increment_metric(&self, id: u32, delta: i64) {
        if let Some(s) = self.stats.borrow_mut().get_mut(id as usize) {
            s.2 += delta;
        }
    }

    fn record_metric(&self, id: u32, value: u64) -> bool {
        match self.stats.borrow_mut().get_mut(id as usize) {
            Some(s) => {
                s.2 = value as i64;
                true
            }
            None => false,
        }
    }

    fn http_call(&self, cluster: &str, headers: &[(&str, &str)], _timeout_ms: u64) -> Option<u32> {
        let token = self.next_token.get() + 1;
        self.next_token.set(token);
        let headers = headers
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect();
        (self.calls.borrow_mut()).push((token, cluster.to_string(), headers));
        Some(token)
    }

    fn log(&self, _level: Level, message: &str) {
        self.logs.borrow_mut().push(message.to_string());
    }
}

/// One stream as a test sets it up: its route's cluster, request headers, and the response.
#[derive(Default)]
pub struct MemoryStream {
    pub cluster: Option<String>,
    pub headers: Vec<(String, String)>,
    pub upstream: Option<String>,
    pub status: Option<u16>,
    pub flags: u64,
    pub body: Vec<u8>,
    /// Host calls this stream answered.
    pub reads: Cell<u32>,
}

impl MemoryStream {
    fn read(&self) {
        self.reads.set(self.reads.get() + 1);
    }
}

impl StreamApi for MemoryStream {
    fn route_cluster(&self) -> Option<String> {
        self.read();
        self.cluster.clone()
    }

    fn request_header(&self, name: &str) -> Option<String> {
        self.read();
        let found = self.headers.iter().find(|(n, _)| n == name);
        found.map(|(_, v)| v.clone())
    }

    fn upstream_address(&self) -> Option<String> {
        self.read();
        self.upstream.clone()
    }

    fn response_status(&self) -> Option<u16> {
        self.read();
        self.status
    }

    fn response_flags(&self) -> u64 {
        self.read();
        self.flags
    }

    fn response_body_end(&self, size: usize, len: usize) -> Option<Vec<u8>> {
        self.read();
        let body = &self.body[..size.min(self.body.len())];
        Some(body[body.len().saturating_sub(len)..].to_vec())
    }
}
