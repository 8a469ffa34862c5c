//! The root context (one per worker VM): loads the config, ticks the poller (one worker at a time
//! polls), and hands each HTTP stream the shared view it needs.

use std::borrow::Cow;
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{ContextType, LogLevel};

use super::host::{now_ms, HostStore, Metrics};
use super::http::Stream;
use super::poll::{self, Poller};
use crate::config::Config;
use crate::endpoints::{self, Host, Snapshot};
use crate::policy::Decision;
use crate::router::{Fallback, Router};
use crate::store::SharedStore;

pub(super) const HOSTS_KEY: &str = "kvroute.hosts";
/// Tick and poll period until the first host snapshot: requests fall back to Envoy until then.
const STARTUP_TICK_MS: u64 = 100;

/// What a worker VM's streams share: the configured router, the last host snapshot, metrics.
pub struct Shared {
    pub router: Router,
    pub metrics: Metrics,
    pub(super) snapshot: Snapshot,
    pub(super) snapshot_cas: Option<u32>,
}

impl Shared {
    /// The hosts a request to `cluster` may go to: the static list if configured (with health and
    /// load from the last poll where known), else the cluster's hosts from the last poll.
    /// Borrowed from the snapshot in the common case: nothing is copied per request.
    pub fn hosts(&self, cluster: Option<&str>) -> Option<Cow<'_, [Host]>> {
        let config = &self.router.config;
        if !config.endpoints.is_empty() {
            let polled: Vec<&Host> = self.snapshot.values().flatten().collect();
            return Some(Cow::Owned(
                config
                    .endpoints
                    .iter()
                    .map(|addr| {
                        polled
                            .iter()
                            .find(|h| &h.addr == addr)
                            .map_or_else(|| Host::fixed(addr), |h| (*h).clone())
                    })
                    .collect(),
            ));
        }
        self.snapshot
            .get(cluster?)
            .map(|hosts| Cow::Borrowed(hosts.as_slice()))
    }

    /// Until this worker's first tick has read a snapshot, looks for one on every request:
    /// another worker may already have polled.
    pub fn ensure_snapshot(&mut self) {
        if self.snapshot_cas.is_none() {
            self.refresh_snapshot();
        }
    }

    /// Re-reads the snapshot another worker's poll wrote, if it changed. Done on each tick rather
    /// than per request: requests then cost no host call for it.
    pub(super) fn refresh_snapshot(&mut self) {
        let (value, cas) = HostStore.get(HOSTS_KEY);
        if cas == self.snapshot_cas {
            return;
        }
        if let Some(snapshot) = value.as_deref().and_then(endpoints::decode_snapshot) {
            self.snapshot = snapshot;
            self.snapshot_cas = cas;
        }
    }
}

#[derive(Default)]
pub struct Root {
    shared: Option<Rc<RefCell<Shared>>>,
    poller: Poller,
    /// Ticking at `stats_interval_ms`, now that a host snapshot exists.
    steady: bool,
}

impl Context for Root {
    fn on_http_call_response(
        &mut self,
        token: u32,
        _headers: usize,
        body: usize,
        _trailers: usize,
    ) {
        if let Some(shared) = &self.shared {
            self.poller.response(&mut shared.borrow_mut(), token, body);
        }
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let bytes = hostcalls::get_buffer(
            proxy_wasm::types::BufferType::PluginConfiguration,
            0,
            usize::MAX,
        )
        .ok()
        .flatten()
        .unwrap_or_default();
        let config = match Config::parse(&bytes) {
            Ok(config) => config,
            Err(e) => {
                let _ = hostcalls::log(LogLevel::Critical, &e.to_string());
                return false;
            }
        };
        let mut metrics = Metrics::default();
        for d in Decision::ALL {
            metrics.define_counter(&format!("kvroute.routed.{}", d.name()));
        }
        for reason in Fallback::ALL {
            metrics.define_counter(&format!("kvroute.fallback.{}", reason.name()));
        }
        for poll in ["stats_poll", "engine_poll"] {
            metrics.define_counter(&format!("kvroute.{poll}.ok"));
            metrics.define_counter(&format!("kvroute.{poll}.failed"));
        }
        // With an admin cluster, fast until the first host snapshot is in; then (and without
        // one) every `stats_interval_ms`.
        let first = match config.admin_cluster {
            Some(_) => STARTUP_TICK_MS.min(config.stats_interval_ms),
            None => config.stats_interval_ms,
        };
        let _ = hostcalls::set_tick_period(Duration::from_millis(first));
        self.shared = Some(Rc::new(RefCell::new(Shared {
            router: Router::new(config),
            metrics,
            snapshot: Snapshot::new(),
            snapshot_cas: None,
        })));
        self.on_tick();
        true
    }

    fn on_tick(&mut self) {
        let Some(shared) = &self.shared else { return };
        let (admin, interval) = {
            let s = shared.borrow();
            let config = &s.router.config;
            (config.admin_cluster.clone(), config.stats_interval_ms)
        };
        let has_snapshot = {
            let mut s = shared.borrow_mut();
            s.refresh_snapshot();
            let placed = s.router.tick(&HostStore, now_ms());
            s.metrics.gauge("kvroute.groups_placed", placed as u64);
            s.snapshot_cas.is_some()
        };
        let Some(admin) = admin else { return };
        if has_snapshot && !self.steady {
            let _ = hostcalls::set_tick_period(Duration::from_millis(interval));
            self.steady = true;
        }
        let lease = if has_snapshot {
            interval
        } else {
            STARTUP_TICK_MS.min(interval)
        };
        if poll::take_lease(now_ms(), lease) {
            self.poller.poll(&mut shared.borrow_mut(), &admin);
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Stream::new(self.shared.clone()?)))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
