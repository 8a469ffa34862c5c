//! One worker's gateway: the routing core behind one entry type, driven by whatever proxy hosts it.
//!
//! [`Gateway`] is what a worker VM keeps: the configured [`Router`], the last host snapshot, its
//! own requests in flight, the suspects, the poll and the stats. The proxy-wasm adapter (`wasm/`)
//! only turns Envoy's callbacks into calls of its entry points: [`Gateway::tick`] on the worker's
//! timer, [`Gateway::on_poll_answer`] for each answer to a poll, and, for each request, an
//! [`Exchange`] taken through [`Gateway::on_request_headers`], [`Gateway::on_request_body`],
//! [`Gateway::route`], [`Gateway::on_response_headers`], [`Gateway::on_response_body`] and
//! [`Gateway::on_end`]. What it needs of the proxy is [`HostApi`] (shared data, clock, stats,
//! HTTP calls) and, per request, [`StreamApi`]; tests give it in-memory ones.

mod exchange;
mod host;
mod poll;
mod settle;
pub mod stat_names;
mod stats;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
#[cfg(test)]
mod tests;

pub use exchange::{Body, Exchange, RequestHeaders};
pub use host::{HostApi, Level, MetricKind, StreamApi};
pub use stat_names::{Counter, Gauge};
pub use stats::Stats;

use std::borrow::Cow;

use crate::config::Config;
use crate::freshness::{self, Age, MonoClock, RoundLease};
use crate::hosts::{self, Host, Snapshot};
use crate::in_flight;
use crate::prefill::PrefillModel;
use crate::rendezvous::endpoint_id;
use crate::router::Router;
use crate::shared_keys;
use crate::suspects::{self, Suspects};

/// Tick and poll period until the first host snapshot: requests fall back to Envoy until then.
const STARTUP_TICK_MS: u64 = 100;
/// Longest tick, whatever `stats_interval_ms` says: how late another worker's suspect marks and
/// requests in flight reach this one. The poll itself still runs once per interval (the lease
/// decides).
const MAX_TICK_MS: u64 = 100;

/// One worker's routing core (see the module doc).
pub struct Gateway<H: HostApi> {
    host: H,
    router: Router,
    stats: Stats,
    /// This worker's view of the requests in flight, written to shared data on each tick.
    inflight: in_flight::Local,
    /// What this worker has learnt of the endpoints' prefill.
    prefill: PrefillModel,
    snapshot: Snapshot,
    snapshot_cas: Option<u32>,
    /// Endpoints to avoid for now: this worker's own marks at once, other workers' from the tick.
    suspects: Suspects,
    suspects_cas: Option<u32>,
    /// This worker's monotonic time, advanced on its ticks, and how long the host snapshot has
    /// gone unchanged by it (every successful poll publishes a new version).
    clock: MonoClock,
    snapshot_age: Age<Option<u32>>,
    poller: poll::Poller,
    lease: RoundLease,
}

impl<H: HostApi> Gateway<H> {
    /// A gateway for `config`, its stats defined.
    pub fn new(config: Config, host: H) -> Gateway<H> {
        let stats = Stats::new(&host);
        Gateway {
            host,
            prefill: PrefillModel::new(config.prefill_bytes_per_ms),
            router: Router::new(config),
            stats,
            inflight: in_flight::Local::default(),
            snapshot: Snapshot::new(),
            snapshot_cas: None,
            suspects: Suspects::new(),
            suspects_cas: None,
            clock: MonoClock::default(),
            snapshot_age: Age::default(),
            poller: poll::Poller::default(),
            lease: RoundLease::default(),
        }
    }

    /// A gateway from the plugin configuration's bytes, or the error to log.
    pub fn configure(bytes: &[u8], host: H) -> Result<Gateway<H>, String> {
        Config::parse(bytes)
            .map(|config| Gateway::new(config, host))
            .map_err(|e| e.to_string())
    }

    pub fn host(&self) -> &H {
        &self.host
    }

    /// The request header that names the chosen endpoints (Envoy's override_host reads it).
    pub fn routing_header(&self) -> &str {
        &self.router.config.header
    }

    /// The worker's periodic work, `tick_ms` after the last (its current period), in this order:
    /// the host snapshot other workers published, this worker's requests in flight written and
    /// everyone's read, the stats counted since the last tick, other workers' suspect marks, the
    /// policy's view of shared data; then, if this worker holds the round's lease, the poll.
    pub fn tick(&mut self, tick_ms: u64) {
        let now = self.host.now_ms();
        let mono = self.clock.advance(now, tick_ms.max(1));
        self.refresh_snapshot();
        self.flush_inflight();
        self.stats.flush(&self.host);
        self.snapshot_age.observe(self.snapshot_cas, mono);
        self.refresh_suspects(now);
        let completed = hosts::completed(&self.snapshot);
        let placed = self.router.tick(&self.host, now, &completed);
        self.stats
            .gauge(&self.host, Gauge::GroupsPlaced, placed as u64);
        let config = &self.router.config;
        if let Some(admin) = config.admin_cluster.clone() {
            let lease = if self.snapshot_cas.is_some() {
                config.stats_interval_ms
            } else {
                STARTUP_TICK_MS.min(config.stats_interval_ms)
            };
            if self
                .lease
                .take(&self.host, shared_keys::POLL_ROUND, mono, lease)
            {
                self.dispatch_polls(&admin);
            }
        }
    }

    /// The tick the poll needs: fast until the first host snapshot is in, then (and without an
    /// admin cluster, for the policy's view and other workers' suspect marks) every
    /// `stats_interval_ms`, at most [`MAX_TICK_MS`].
    pub fn tick_period(&self) -> u64 {
        let config = &self.router.config;
        match config.admin_cluster {
            Some(_) if self.snapshot_cas.is_none() => STARTUP_TICK_MS.min(config.stats_interval_ms),
            _ => config.stats_interval_ms.min(MAX_TICK_MS),
        }
    }

    /// The host snapshot is older than polls allow: the admin poll has been failing. Requests go
    /// to Envoy's own load balancer until a poll succeeds again.
    fn snapshot_stale(&self) -> bool {
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
        self.inflight.flush(&self.host);
        let Gateway {
            host,
            inflight,
            stats,
            snapshot,
            router,
            ..
        } = self;
        let polled = snapshot.values().flatten().map(|h| h.addr.as_str());
        let count = |addr: &str| u64::from(inflight.inflight(endpoint_id(addr)));
        for addr in polled.chain(router.config.endpoints.iter().map(String::as_str)) {
            if !stats.shows_inflight(addr) {
                stats.inflight(host, addr, count(addr));
            }
        }
        stats.refresh_inflight(host, count);
    }

    /// The hosts a request to `cluster` may go to ([`candidate_hosts`]).
    fn hosts(&self, cluster: Option<&str>, now_ms: u64) -> Option<Cow<'_, [Host]>> {
        candidate_hosts(
            &self.router.config,
            &self.snapshot,
            &self.suspects,
            cluster,
            now_ms,
        )
    }

    /// Which cluster's hosts a request's candidates are: the one its route chose, with a host
    /// snapshot read first if this worker has none yet. A static endpoint list does not depend on
    /// the route, so it costs no host call then.
    fn candidate_cluster(&mut self, stream: &dyn StreamApi) -> Option<String> {
        self.ensure_snapshot();
        if self.router.config.endpoints.is_empty() {
            stream.route_cluster()
        } else {
            None
        }
    }

    /// `addr`, which kvroute chose for a request, failed it: this worker avoids it from the next
    /// request on, the others from their next tick.
    fn mark_suspect(&mut self, addr: &str, now_ms: u64) {
        if !self.suspects.mark(addr, now_ms) {
            return;
        }
        suspects::mark_shared(&self.host, shared_keys::SUSPECTS, addr, now_ms);
        self.stats.count(&self.host, Counter::SuspectMarked);
        self.host.log(
            Level::Info,
            &format!(
                "kvroute: {addr} failed a request; not routing to it for {} ms",
                suspects::SUSPECT_MS
            ),
        );
    }

    /// Takes in the marks other workers wrote since the last tick and forgets expired ones.
    fn refresh_suspects(&mut self, now_ms: u64) {
        let (shared, cas) = suspects::read_shared(&self.host, shared_keys::SUSPECTS);
        if cas != self.suspects_cas {
            let learned = shared.map_or(0, |shared| self.suspects.merge(&shared, now_ms));
            if learned > 0 {
                let learned = learned as i64;
                self.stats.add(&self.host, Counter::SuspectLearned, learned);
            }
            self.suspects_cas = cas;
        }
        self.suspects.prune(now_ms);
    }

    /// Until this worker's first tick has read a snapshot, looks for one on every request:
    /// another worker may already have polled.
    fn ensure_snapshot(&mut self) {
        if self.snapshot_cas.is_none() {
            self.refresh_snapshot();
        }
    }

    /// Re-reads the snapshot another worker's poll wrote, if it changed. Done on each tick rather
    /// than per request: requests then cost no host call for it.
    fn refresh_snapshot(&mut self) {
        let (value, cas) = self.host.get(shared_keys::HOSTS);
        if cas == self.snapshot_cas {
            return;
        }
        if let Some(snapshot) = value.as_deref().and_then(hosts::decode_snapshot) {
            self.snapshot = snapshot;
            self.snapshot_cas = cas;
        }
    }
}

/// The hosts a request to `cluster` may go to: the static list if configured (with health and
/// load from the last poll where known), else the cluster's hosts from the last poll. Borrowed
/// from the snapshot in the common case: nothing is copied per request. A suspect endpoint is
/// reported unhealthy, so the router's candidate filter drops it.
fn candidate_hosts<'s>(
    config: &Config,
    snapshot: &'s Snapshot,
    suspects: &Suspects,
    cluster: Option<&str>,
    now_ms: u64,
) -> Option<Cow<'s, [Host]>> {
    let known = if config.endpoints.is_empty() {
        Cow::Borrowed(snapshot.get(cluster?)?.as_slice())
    } else {
        let polled: Vec<&Host> = snapshot.values().flatten().collect();
        let listed = config.endpoints.iter().map(|addr| {
            polled
                .iter()
                .find(|h| &h.addr == addr)
                .map_or_else(|| Host::fixed(addr), |h| (*h).clone())
        });
        Cow::Owned(listed.collect())
    };
    Some(match suspects.apply(&known, now_ms) {
        Some(marked) => Cow::Owned(marked),
        None => known,
    })
}
