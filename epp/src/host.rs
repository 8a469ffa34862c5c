//! The gateway's services in a native process: the shared store, the clock, the process's stats,
//! HTTP calls sent from the tokio runtime with their answers delivered to the worker's inbox, and
//! the `log` crate.

use std::cell::Cell;
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvroute::gateway::{HostApi, Level, MetricKind};
use kvroute::store::{SharedStore, StoreError};

use crate::stats::Stats;
use crate::store::SyncStore;
use crate::upstreams::Upstreams;
use crate::worker::Event;

/// Milliseconds since the Unix epoch, as the gateway reads time.
pub type Clock = Arc<dyn Fn() -> u64 + Send + Sync>;

/// The system's clock.
pub fn system_clock() -> Clock {
    Arc::new(|| {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64)
    })
}

/// What every worker of the process shares: the store, the stats, the clock, where calls go and
/// the runtime that sends them.
#[derive(Clone)]
pub struct Shared {
    pub store: Arc<SyncStore>,
    pub stats: Arc<Stats>,
    pub clock: Clock,
    pub upstreams: Arc<Upstreams>,
    pub runtime: tokio::runtime::Handle,
}

/// One worker's host: the process's shared services, and the worker's inbox, where the answers
/// to its calls arrive.
pub struct NativeHost {
    shared: Shared,
    inbox: Sender<Event>,
    next_token: Cell<u32>,
}

impl NativeHost {
    pub fn new(shared: Shared, inbox: Sender<Event>) -> NativeHost {
        NativeHost {
            shared,
            inbox,
            next_token: Cell::new(0),
        }
    }
}

impl SharedStore for NativeHost {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        self.shared.store.get(key)
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        self.shared.store.set(key, value, cas)
    }
}

impl HostApi for NativeHost {
    fn now_ms(&self) -> u64 {
        (self.shared.clock)()
    }

    fn define_metric(&self, kind: MetricKind, name: &str) -> Option<u32> {
        Some(self.shared.stats.define(kind, name))
    }

    fn increment_metric(&self, id: u32, delta: i64) {
        self.shared.stats.increment(id, delta);
    }

    fn record_metric(&self, id: u32, value: u64) -> bool {
        self.shared.stats.record(id, value)
    }

    fn http_call(&self, cluster: &str, headers: &[(&str, &str)], timeout_ms: u64) -> Option<u32> {
        if !self.shared.upstreams.knows(cluster) {
            return None;
        }
        let token = self.next_token.get().wrapping_add(1);
        self.next_token.set(token);
        let upstreams = self.shared.upstreams.clone();
        let inbox = self.inbox.clone();
        let cluster = cluster.to_string();
        let headers: Vec<(String, String)> = headers
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect();
        let timeout = Duration::from_millis(timeout_ms);
        self.shared.runtime.spawn(async move {
            let (status, body) = upstreams.get(&cluster, &headers, timeout).await;
            // A worker that stopped no longer wants its answers.
            let _ = inbox.send(Event::Answer {
                token,
                status,
                body,
            });
        });
        Some(token)
    }

    fn log(&self, level: Level, message: &str) {
        let level = match level {
            Level::Info => log::Level::Info,
            Level::Warn => log::Level::Warn,
            Level::Error => log::Level::Error,
        };
        log::log!(level, "{message}");
    }
}
