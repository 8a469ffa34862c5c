//! Envoy host services for the core: shared data as a [`SharedStore`], the clock, and metrics.

use std::time::UNIX_EPOCH;

use hashbrown::HashMap;
use proxy_wasm::hostcalls;
use proxy_wasm::types::{MapType, MetricType, Status};

use crate::policy::Decision;
use crate::router::Fallback;
use crate::store::{SharedStore, StoreError};
use crate::usage::{self, Usage};

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

/// The `:status` of a header map (a response's, or an HTTP call's), read as bytes: the SDK's
/// string read panics on a value that is not UTF-8.
pub fn status(map: MapType) -> Option<u16> {
    hostcalls::get_map_value_bytes(map, ":status")
        .ok()
        .flatten()
        .and_then(|s| std::str::from_utf8(&s).ok()?.parse().ok())
}

/// Envoy stats defined through proxy-wasm; Envoy shows them as `wasmcustom.<name>`. Metrics of the
/// same name are one stat across all worker VMs. The ones a request moves are resolved to ids once,
/// when the VM is configured (or, for per-endpoint gauges, when an endpoint is first seen): a
/// request formats no name and hashes none but its endpoint's address. The decisions, and what the
/// engines report of their usage, are counted in the VM and written on the tick
/// ([`Metrics::flush`]).
#[derive(Default)]
pub struct Metrics {
    ids: HashMap<String, u32>,
    routed: [Option<u32>; Decision::ALL.len()],
    fallback: [Option<u32>; Fallback::ALL.len()],
    match_percent: Option<u32>,
    slots_used: Option<u32>,
    /// The in-flight gauge of each endpoint address seen.
    inflight: HashMap<String, [u32; 1]>,
    /// What this worker last wrote to each endpoint's in-flight gauge.
    inflight_shown: HashMap<String, u64>,
    /// The usage counters (prompt tokens, cached tokens) of each endpoint address seen.
    usage: HashMap<String, [u32; 2]>,
    /// Usage reported since the last flush.
    unwritten: Unwritten,
    /// Requests routed with each decision since the last flush.
    decided: [i64; Decision::ALL.len()],
}

/// Usage reported since the last flush: responses, prompt and cached tokens, in all and of each
/// endpoint (an endpoint's entry stays, at zero, once seen).
#[derive(Default)]
struct Unwritten {
    responses: i64,
    tokens: [i64; 2],
    by_endpoint: HashMap<String, [i64; 2]>,
}

impl Metrics {
    /// Defines the per-request metrics (counters at zero, so dashboards see them before they move).
    pub fn new() -> Metrics {
        let mut m = Metrics::default();
        for (i, d) in Decision::ALL.iter().enumerate() {
            m.routed[i] = m.id(MetricType::Counter, &format!("kvroute.routed.{}", d.name()));
        }
        for (i, f) in Fallback::ALL.iter().enumerate() {
            m.fallback[i] = m.id(
                MetricType::Counter,
                &format!("kvroute.fallback.{}", f.name()),
            );
        }
        m.match_percent = m.id(MetricType::Histogram, "kvroute.match_percent");
        m.slots_used = m.id(MetricType::Gauge, "kvroute.affinity.slots_used");
        m
    }

    fn id(&mut self, kind: MetricType, name: &str) -> Option<u32> {
        define(&mut self.ids, kind, name)
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

    /// `kvroute.routed.<decision>`: counted now, written on the next [`flush`](Self::flush) (a
    /// metric call per request saved).
    pub fn routed(&mut self, decision: Decision) {
        if let Some(i) = Decision::ALL.iter().position(|d| *d == decision) {
            self.decided[i] += 1;
        }
    }

    /// `kvroute.fallback.<reason>`.
    pub fn fallback(&mut self, reason: Fallback) {
        let at = Fallback::ALL.iter().position(|f| *f == reason);
        increment(at.and_then(|i| self.fallback[i]), 1);
    }

    pub fn match_percent(&mut self, percent: u64) {
        if let Some(id) = self.match_percent {
            let _ = hostcalls::record_metric(id, percent);
        }
    }

    pub fn slots_used(&mut self, created: i64) {
        increment(self.slots_used, created);
    }

    /// The gauge mirroring kvroute's in-flight count for endpoint `addr`:
    /// `kvroute.inflight.<ip>_<port>`, written when `value` is not what this worker last wrote.
    pub fn inflight(&mut self, addr: &str, value: u64) {
        if self.inflight_shown.get(addr) == Some(&value) {
            return;
        }
        let Metrics {
            ids,
            inflight,
            inflight_shown,
            ..
        } = self;
        let resolved = per_endpoint(ids, inflight, addr, |seg| {
            [(MetricType::Gauge, format!("kvroute.inflight.{seg}"))]
        });
        if let Some([id]) = resolved {
            if hostcalls::record_metric(id, value).is_ok() {
                inflight_shown.entry_ref(addr).insert(value);
            }
        }
    }

    /// Whether this worker has written endpoint `addr`'s in-flight gauge.
    pub fn shows_inflight(&self, addr: &str) -> bool {
        self.inflight_shown.contains_key(addr)
    }

    /// Rewrites every in-flight gauge this worker has shown whose count (`count` of its address)
    /// moved since, also of an endpoint no longer polled whose last requests just ended.
    pub fn refresh_inflight(&mut self, count: impl Fn(&str) -> u64) {
        let Metrics {
            inflight,
            inflight_shown,
            ..
        } = self;
        for (addr, shown) in inflight_shown.iter_mut() {
            let value = count(addr);
            if *shown == value {
                continue;
            }
            if let Some([id]) = inflight.get(addr.as_str()) {
                if hostcalls::record_metric(*id, value).is_ok() {
                    *shown = value;
                }
            }
        }
    }

    /// What an engine reported for one response, served by `served` when known: counted now,
    /// written to `kvroute.usage.*` on the next [`flush`](Self::flush). A response
    /// costs no metric call, where writing at once cost five.
    pub fn usage(&mut self, served: Option<&str>, u: Usage) {
        let tokens = [u.prompt_tokens as i64, u.cached_tokens as i64];
        let pending = &mut self.unwritten;
        pending.responses += 1;
        add_tokens(&mut pending.tokens, tokens);
        if let Some(addr) = served {
            add_tokens(pending.by_endpoint.entry_ref(addr).or_default(), tokens);
        }
    }

    /// Writes what was counted since the last flush: the decisions (`kvroute.routed.*`), then
    /// `kvroute.usage.{prompt,cached}_tokens`, the same per endpoint (`.<endpoint>`), and
    /// `kvroute.usage.responses` last, so a reader that sees the responses counted sees their
    /// tokens too.
    pub fn flush(&mut self) {
        for (id, n) in self.routed.iter().zip(&mut self.decided) {
            if *n != 0 {
                increment(*id, std::mem::take(n));
            }
        }
        if self.unwritten.responses == 0 {
            return;
        }
        let Metrics {
            ids,
            usage,
            unwritten,
            ..
        } = self;
        for (addr, sum) in unwritten
            .by_endpoint
            .iter_mut()
            .filter(|(_, s)| **s != [0; 2])
        {
            let resolved = per_endpoint(ids, usage, addr, |seg| {
                ["prompt_tokens", "cached_tokens"]
                    .map(|n| (MetricType::Counter, format!("kvroute.usage.{n}.{seg}")))
            });
            for (id, n) in resolved.into_iter().flatten().zip(std::mem::take(sum)) {
                increment(Some(id), n);
            }
        }
        let [prompt, cached] = std::mem::take(&mut unwritten.tokens);
        let responses = std::mem::take(&mut unwritten.responses);
        self.add(MetricType::Counter, "kvroute.usage.prompt_tokens", prompt);
        self.add(MetricType::Counter, "kvroute.usage.cached_tokens", cached);
        self.add(MetricType::Counter, "kvroute.usage.responses", responses);
    }
}

fn add_tokens(sum: &mut [i64; 2], tokens: [i64; 2]) {
    sum[0] += tokens[0];
    sum[1] += tokens[1];
}

/// The ids of endpoint `addr`'s stats, from `cache` once they have all been defined; else defined
/// now from their kinds and names (`names` gets the address as a stat segment). Per request, an
/// endpoint's stats cost a lookup by its address, not a formatted name.
fn per_endpoint<const N: usize>(
    ids: &mut HashMap<String, u32>,
    cache: &mut HashMap<String, [u32; N]>,
    addr: &str,
    names: impl FnOnce(&str) -> [(MetricType, String); N],
) -> Option<[u32; N]> {
    if let Some(found) = cache.get(addr) {
        return Some(*found);
    }
    let mut resolved = [0; N];
    for (slot, (kind, name)) in resolved.iter_mut().zip(names(&usage::stat_segment(addr))) {
        *slot = define(ids, kind, &name)?;
    }
    cache.insert(addr.to_string(), resolved);
    Some(resolved)
}

/// The id of the stat `name`, from `ids` or defined now (and kept there).
fn define(ids: &mut HashMap<String, u32>, kind: MetricType, name: &str) -> Option<u32> {
    if let Some(id) = ids.get(name) {
        return Some(*id);
    }
    let id = hostcalls::define_metric(kind, name).ok()?;
    ids.insert(name.to_string(), id);
    Some(id)
}

fn increment(id: Option<u32>, delta: i64) {
    if let Some(id) = id {
        let _ = hostcalls::increment_metric(id, delta);
    }
}
