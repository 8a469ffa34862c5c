//! The root context (one per worker VM): loads the config, ticks the poller (one worker at a time
//! polls), the policy's view of shared data, other workers' suspect marks and the watch on paused
//! streams, and hands each HTTP stream the shared view it needs.

use std::borrow::Cow;
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{ContextType, LogLevel, MetricType};

use super::host::{now_ms, HostStore, Metrics};
use super::http::{route_from_headers, Stream};
use super::poll::{self, Poller};
use crate::body_access::{self, BodyWatch, WATCH_TICK_MS};
use crate::config::Config;
use crate::counters;
use crate::endpoints::{self, Host, Snapshot};
use crate::freshness::{self, Age, MonoClock, RoundLease};
use crate::router::Router;
use crate::store::SharedStore;
use crate::suspects::{self, Suspects};

pub(super) const HOSTS_KEY: &str = "kvroute.hosts";
/// Tick and poll period until the first host snapshot: requests fall back to Envoy until then.
const STARTUP_TICK_MS: u64 = 100;
/// Endpoints that just failed a request, marked by any worker (see `suspects`).
const SUSPECTS_KEY: &str = "kvroute.suspects";
/// Longest tick, whatever `stats_interval_ms` says: how late another worker's suspect marks and
/// requests in flight reach this one. The poll itself still runs once per interval (the lease
/// decides).
const MAX_TICK_MS: u64 = 100;

/// What a worker VM's streams share: the configured router, the last host snapshot, metrics.
pub struct Shared {
    pub router: Router,
    pub metrics: Metrics,
    /// This worker's view of the requests in flight, written to shared data on each tick.
    pub inflight: counters::Local,
    pub(super) snapshot: Snapshot,
    pub(super) snapshot_cas: Option<u32>,
    /// Whether Envoy delivers bodies during a pause, and the paused streams watched until known.
    pub body: BodyWatch,
    /// The root's tick period now (0: not ticking).
    tick_ms: u64,
    /// Endpoints to avoid for now: this worker's own marks at once, other workers' from the tick.
    suspects: Suspects,
    suspects_cas: Option<u32>,
    /// This worker's monotonic time, advanced on its ticks, and how long the host snapshot has
    /// gone unchanged by it (every successful poll publishes a new version).
    clock: MonoClock,
    snapshot_age: Age<Option<u32>>,
}

impl Shared {
    /// Sets the root's tick period. Only on a change: Envoy restarts the timer on every call, so
    /// setting it per request could keep it from ever firing.
    pub fn tick_every(&mut self, ms: u64) {
        if ms != self.tick_ms {
            let _ = hostcalls::set_tick_period(Duration::from_millis(ms));
            self.tick_ms = ms;
        }
    }

    /// The host snapshot is older than polls allow: the admin poll has been failing. Requests go
    /// to Envoy's own load balancer until a poll succeeds again.
    pub fn snapshot_stale(&self) -> bool {
        let config = &self.router.config;
        config.admin_cluster.is_some()
            && self.snapshot_cas.is_some()
            && self
                .snapshot_age
                .age(self.clock.now())
                .is_some_and(|age| age > freshness::max_age_ms(config.stats_interval_ms))
    }

    /// Writes this worker's requests in flight to shared data, reads the other workers', and
    /// sets the gauges from what it read. The gauges are written on the tick, not per request: a
    /// gauge is one stat for every worker, and a worker writing its own view between ticks could
    /// be overwritten by another's older one.
    fn flush_inflight(&mut self) {
        self.inflight.flush(&HostStore);
        let Shared {
            inflight,
            metrics,
            snapshot,
            router,
            ..
        } = self;
        let polled = snapshot.values().flatten().map(|h| h.addr.as_str());
        let count = |addr: &str| u64::from(inflight.inflight(crate::rendezvous::endpoint_id(addr)));
        for addr in polled.chain(router.config.endpoints.iter().map(String::as_str)) {
            if !metrics.shows_inflight(addr) {
                metrics.inflight(addr, count(addr));
            }
        }
        metrics.refresh_inflight(count);
    }

    /// A paused stream is now watched: tick at least every [`WATCH_TICK_MS`] until a verdict.
    pub fn watch_started(&mut self) {
        if self.tick_ms == 0 || self.tick_ms > WATCH_TICK_MS {
            self.tick_every(WATCH_TICK_MS);
        }
    }

    /// The hosts a request to `cluster` may go to: the static list if configured (with health and
    /// load from the last poll where known), else the cluster's hosts from the last poll.
    /// Borrowed from the snapshot in the common case: nothing is copied per request. A suspect
    /// endpoint is reported unhealthy, so the router's candidate filter drops it.
    pub fn hosts(&self, cluster: Option<&str>, now_ms: u64) -> Option<Cow<'_, [Host]>> {
        let hosts = self.known_hosts(cluster)?;
        Some(match self.suspects.apply(&hosts, now_ms) {
            Some(marked) => Cow::Owned(marked),
            None => hosts,
        })
    }

    fn known_hosts(&self, cluster: Option<&str>) -> Option<Cow<'_, [Host]>> {
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

    /// `addr`, which kvroute chose for a request, failed it: this worker avoids it from the next
    /// request on, the others from their next tick.
    pub fn mark_suspect(&mut self, addr: &str, now_ms: u64) {
        if !self.suspects.mark(addr, now_ms) {
            return;
        }
        suspects::mark_shared(&HostStore, SUSPECTS_KEY, addr, now_ms);
        self.metrics.count("kvroute.suspect_marked");
        let _ = hostcalls::log(
            LogLevel::Info,
            &format!(
                "kvroute: {addr} failed a request; not routing to it for {} ms",
                suspects::SUSPECT_MS
            ),
        );
    }

    /// Takes in the marks other workers wrote since the last tick and forgets expired ones.
    fn refresh_suspects(&mut self, now_ms: u64) {
        let (shared, cas) = suspects::read_shared(&HostStore, SUSPECTS_KEY);
        if cas != self.suspects_cas {
            let learned = shared.map_or(0, |shared| self.suspects.merge(&shared, now_ms));
            if learned > 0 {
                let m = &mut self.metrics;
                m.add(
                    MetricType::Counter,
                    "kvroute.suspect_learned",
                    learned as i64,
                );
            }
            self.suspects_cas = cas;
        }
        self.suspects.prune(now_ms);
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
    lease: RoundLease,
}

impl Root {
    /// Refreshes the host snapshot and the policy's view of shared data and, if this worker holds
    /// the lease, polls Envoy's admin.
    fn poll(&mut self, shared: &RefCell<Shared>) {
        let (admin, interval) = {
            let s = shared.borrow();
            let config = &s.router.config;
            (config.admin_cluster.clone(), config.stats_interval_ms)
        };
        let now = now_ms();
        let (has_snapshot, mono) = {
            let mut s = shared.borrow_mut();
            let tick = s.tick_ms.max(1);
            let mono = s.clock.advance(now, tick);
            s.refresh_snapshot();
            s.flush_inflight();
            s.metrics.flush();
            for (name, n) in s.router.config.templates.take_counts() {
                if n > 0 {
                    s.metrics.add(MetricType::Counter, name, n as i64);
                }
            }
            let version = s.snapshot_cas;
            s.snapshot_age.observe(version, mono);
            s.refresh_suspects(now);
            let completed = endpoints::completed(&s.snapshot);
            let placed = s.router.tick(&HostStore, now, &completed);
            s.metrics.gauge("kvroute.groups_placed", placed as u64);
            (s.snapshot_cas.is_some(), mono)
        };
        let Some(admin) = admin else { return };
        let lease = if has_snapshot {
            interval
        } else {
            STARTUP_TICK_MS.min(interval)
        };
        if self.lease.take(&HostStore, poll::LEASE_KEY, mono, lease) {
            self.poller.poll(&mut shared.borrow_mut(), &admin);
        }
    }

    /// The tick the poller needs: fast until the first host snapshot is in, then (and without an
    /// admin cluster, for the policy's view and other workers' suspect marks) every
    /// `stats_interval_ms`, at most [`MAX_TICK_MS`].
    fn poll_period(&self, s: &Shared) -> u64 {
        let config = &s.router.config;
        match config.admin_cluster {
            Some(_) if s.snapshot_cas.is_none() => STARTUP_TICK_MS.min(config.stats_interval_ms),
            _ => config.stats_interval_ms.min(MAX_TICK_MS),
        }
    }
}

/// Looks at every watched paused stream for a body Envoy read but never delivered. On the first
/// such evidence, concludes the flag is missing: logs it once, then routes every paused stream from
/// its headers and resumes it.
fn watch_paused(shared: &RefCell<Shared>) {
    let now = now_ms();
    let mut evidence = false;
    let watched = shared.borrow().body.watched();
    for id in watched {
        if hostcalls::set_effective_context(id).is_err() {
            shared.borrow_mut().body.forget(id);
            continue;
        }
        let Some(received) = body_received() else {
            continue;
        };
        evidence |= shared.borrow_mut().body.observe(id, received, now);
    }
    if !evidence {
        return;
    }
    let Some(paused) = shared.borrow_mut().body.conclude_missing() else {
        return;
    };
    let _ = hostcalls::log(
        LogLevel::Error,
        "Envoy holds request bodies back from the filter: the Wasm filter config lacks \
         `allow_on_headers_stop_iteration: true` (Istio's WasmPlugin cannot set it; use the \
         EnvoyFilter in istio/). Routing from headers only (session header, else Envoy's load \
         balancer) from now on; counted as kvroute.fallback.no_body_access.",
    );
    for id in paused {
        if hostcalls::set_effective_context(id).is_ok() {
            route_from_headers(shared);
            let _ = hostcalls::resume_http_request();
        }
    }
}

/// Body bytes Envoy has read for the effective stream.
fn body_received() -> Option<u64> {
    let total = hostcalls::get_property(vec!["request", "total_size"])
        .ok()
        .flatten()?;
    let headers = super::http::request_headers()?;
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
        let mut metrics = Metrics::new();
        for poll in ["stats_poll", "engine_poll"] {
            metrics.define_counter(&format!("kvroute.{poll}.ok"));
            metrics.define_counter(&format!("kvroute.{poll}.failed"));
        }
        metrics.define_counter("kvroute.suspect_marked");
        metrics.define_counter("kvroute.suspect_learned");
        metrics.define_counter("kvroute.inflight_corrected");
        metrics.define_counter("kvroute.engine_poll.stale");
        for name in super::response::COUNTERS {
            metrics.define_counter(name);
        }
        for outcome in crate::template::Outcome::ALL {
            metrics.define_counter(outcome.counter());
        }
        self.shared = Some(Rc::new(RefCell::new(Shared {
            router: Router::new(config),
            metrics,
            inflight: counters::Local::default(),
            snapshot: Snapshot::new(),
            snapshot_cas: None,
            body: BodyWatch::default(),
            tick_ms: 0,
            suspects: Suspects::new(),
            suspects_cas: None,
            clock: MonoClock::default(),
            snapshot_age: Age::default(),
        })));
        self.on_tick();
        true
    }

    fn on_tick(&mut self) {
        let Some(shared) = self.shared.clone() else {
            return;
        };
        self.poll(&shared);
        // After the poll: it switches the effective context to paused streams (the tick period set
        // below is the root's whichever context is effective).
        if shared.borrow().body.watching() {
            watch_paused(&shared);
        }
        let mut s = shared.borrow_mut();
        let poll_ms = self.poll_period(&s);
        let ms = match poll_ms {
            _ if !s.body.watching() => poll_ms,
            0 => WATCH_TICK_MS,
            ms => ms.min(WATCH_TICK_MS),
        };
        s.tick_every(ms);
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Stream::new(self.shared.clone()?, context_id)))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
