//! kvroute's Envoy stats (`wasmcustom.kvroute.*`), with the ids of the ones a request moves
//! resolved once, and the per-request ones counted in the worker and written on its tick.
//!
//! Stats of the same name are one stat across all worker VMs. A request formats no stat name
//! and hashes none but its endpoint's address (for per-endpoint gauges, resolved when the
//! endpoint is first seen); the decisions and the engines' reported usage cost no metric call per
//! request: [`Stats::flush`] writes them.

use hashbrown::HashMap;
use strum::{EnumCount, VariantArray};

use super::host::{HostApi, MetricKind};
use super::stat_names::{self, Counter, Gauge};
use crate::policy::Decision;
use crate::router::Fallback;
use crate::template::Outcome;
use crate::usage::{self, Usage};

#[derive(Default)]
pub struct Stats {
    ids: HashMap<String, u32>,
    routed: [Option<u32>; Decision::COUNT],
    fallback: [Option<u32>; Fallback::COUNT],
    template: [Option<u32>; Outcome::COUNT],
    match_percent: Option<u32>,
    slots_used: Option<u32>,
    /// The in-flight gauge of each endpoint address seen.
    inflight: HashMap<String, [u32; 1]>,
    /// What this worker last wrote to each endpoint's in-flight gauge.
    inflight_shown: HashMap<String, u64>,
    /// The usage counters (prompt tokens, cached tokens) of each endpoint address seen.
    usage: HashMap<String, [u32; 2]>,
    /// The time-to-first-token estimate's histogram of each endpoint address seen.
    ttft_estimate: HashMap<String, [u32; 1]>,
    /// Usage reported since the last flush.
    unwritten: Unwritten,
    /// Requests routed with each decision since the last flush.
    decided: [i64; Decision::COUNT],
    /// Chat requests of each template outcome since the last flush.
    templated: [i64; Outcome::COUNT],
}

/// Usage reported since the last flush: responses, prompt and cached tokens, in all and of each
/// endpoint (an endpoint's entry stays, at zero, once seen).
#[derive(Default)]
struct Unwritten {
    responses: i64,
    tokens: [i64; 2],
    by_endpoint: HashMap<String, [i64; 2]>,
}

impl Stats {
    /// Defines the per-request metrics and the counters (all at zero, so dashboards see them
    /// before they move).
    pub fn new<H: HostApi + ?Sized>(h: &H) -> Stats {
        let mut m = Stats::default();
        for &d in Decision::VARIANTS {
            m.routed[d as usize] = m.id(h, MetricKind::Counter, &stat_names::routed(d));
        }
        for &f in Fallback::VARIANTS {
            m.fallback[f as usize] = m.id(h, MetricKind::Counter, &stat_names::fallback(f));
        }
        m.match_percent = m.id(h, MetricKind::Histogram, stat_names::MATCH_PERCENT);
        m.slots_used = m.id(h, MetricKind::Gauge, Gauge::SlotsUsed.name());
        for c in Counter::VARIANTS {
            m.id(h, MetricKind::Counter, c.name());
        }
        for &o in Outcome::VARIANTS {
            m.template[o as usize] = m.id(h, MetricKind::Counter, &stat_names::template(o));
        }
        m
    }

    fn id<H: HostApi + ?Sized>(&mut self, h: &H, kind: MetricKind, name: &str) -> Option<u32> {
        define(h, &mut self.ids, kind, name)
    }

    pub fn count<H: HostApi + ?Sized>(&mut self, h: &H, counter: Counter) {
        self.add(h, counter, 1);
    }

    pub fn add<H: HostApi + ?Sized>(&mut self, h: &H, counter: Counter, delta: i64) {
        if let Some(id) = self.id(h, MetricKind::Counter, counter.name()) {
            h.increment_metric(id, delta);
        }
    }

    pub fn gauge<H: HostApi + ?Sized>(&mut self, h: &H, gauge: Gauge, value: u64) {
        if let Some(id) = self.id(h, MetricKind::Gauge, gauge.name()) {
            h.record_metric(id, value);
        }
    }

    /// `kvroute.routed.<decision>`: counted now, written on the next [`flush`](Self::flush).
    pub fn routed(&mut self, decision: Decision) {
        self.decided[decision as usize] += 1;
    }

    /// `kvroute.template.<outcome>`: counted now, written on the next [`flush`](Self::flush).
    pub fn template(&mut self, outcome: Outcome) {
        self.templated[outcome as usize] += 1;
    }

    /// `kvroute.fallback.<reason>`.
    pub fn fallback<H: HostApi + ?Sized>(&mut self, h: &H, reason: Fallback) {
        increment(h, self.fallback[reason as usize], 1);
    }

    pub fn match_percent<H: HostApi + ?Sized>(&mut self, h: &H, percent: u64) {
        if let Some(id) = self.match_percent {
            h.record_metric(id, percent);
        }
    }

    pub fn slots_used<H: HostApi + ?Sized>(&mut self, h: &H, created: i64) {
        increment(h, self.slots_used, created);
    }

    /// The gauge mirroring kvroute's in-flight count for endpoint `addr`:
    /// `kvroute.inflight.<ip>_<port>`, written when `value` is not what this worker last wrote.
    pub fn inflight<H: HostApi + ?Sized>(&mut self, h: &H, addr: &str, value: u64) {
        if self.inflight_shown.get(addr) == Some(&value) {
            return;
        }
        let Stats {
            ids,
            inflight,
            inflight_shown,
            ..
        } = self;
        let resolved = per_endpoint(h, ids, inflight, addr, |seg| {
            [(MetricKind::Gauge, stat_names::inflight(seg))]
        });
        if let Some([id]) = resolved {
            if h.record_metric(id, value) {
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
    pub fn refresh_inflight<H: HostApi + ?Sized>(&mut self, h: &H, count: impl Fn(&str) -> u64) {
        let Stats {
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
                if h.record_metric(*id, value) {
                    *shown = value;
                }
            }
        }
    }

    /// A request's first byte came from `addr` `measured_ms` after it was routed, where its
    /// prefill was expected to take `expected_ms`: `kvroute.ttft_estimate_percent.<ip>_<port>`
    /// records the measured time as a percent of the expected (100: the model held).
    pub fn ttft_estimate<H: HostApi + ?Sized>(
        &mut self,
        h: &H,
        addr: &str,
        expected_ms: f64,
        measured_ms: u64,
    ) {
        let Stats {
            ids, ttft_estimate, ..
        } = self;
        let resolved = per_endpoint(h, ids, ttft_estimate, addr, |seg| {
            [(MetricKind::Histogram, stat_names::ttft_estimate(seg))]
        });
        if let Some([id]) = resolved {
            let percent = measured_ms as f64 * 100.0 / expected_ms.max(1.0);
            h.record_metric(id, percent.round() as u64);
        }
    }

    /// What an engine reported for one response, served by `served` when known: counted now,
    /// written to `kvroute.usage.*` on the next [`flush`](Self::flush).
    pub fn usage(&mut self, served: Option<&str>, u: Usage) {
        let tokens = [u.prompt_tokens as i64, u.cached_tokens as i64];
        let pending = &mut self.unwritten;
        pending.responses += 1;
        add_tokens(&mut pending.tokens, tokens);
        if let Some(addr) = served {
            add_tokens(pending.by_endpoint.entry_ref(addr).or_default(), tokens);
        }
    }

    /// Writes what was counted since the last flush: the decisions (`kvroute.routed.*`) and
    /// template outcomes (`kvroute.template.*`), then `kvroute.usage.{prompt,cached}_tokens`, the
    /// same per endpoint (`.<endpoint>`), and `kvroute.usage.responses` last, so a reader that
    /// sees the responses counted sees their tokens too.
    pub fn flush<H: HostApi + ?Sized>(&mut self, h: &H) {
        let routed = self.routed.iter().zip(&mut self.decided);
        for (id, n) in routed.chain(self.template.iter().zip(&mut self.templated)) {
            if *n != 0 {
                increment(h, *id, std::mem::take(n));
            }
        }
        if self.unwritten.responses == 0 {
            return;
        }
        let Stats {
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
            let resolved = per_endpoint(h, ids, usage, addr, |seg| {
                [Counter::UsagePromptTokens, Counter::UsageCachedTokens]
                    .map(|c| (MetricKind::Counter, c.of_endpoint(seg)))
            });
            for (id, n) in resolved.into_iter().flatten().zip(std::mem::take(sum)) {
                increment(h, Some(id), n);
            }
        }
        let [prompt, cached] = std::mem::take(&mut unwritten.tokens);
        let responses = std::mem::take(&mut unwritten.responses);
        self.add(h, Counter::UsagePromptTokens, prompt);
        self.add(h, Counter::UsageCachedTokens, cached);
        self.add(h, Counter::UsageResponses, responses);
    }
}

fn add_tokens(sum: &mut [i64; 2], tokens: [i64; 2]) {
    sum[0] += tokens[0];
    sum[1] += tokens[1];
}

/// The ids of endpoint `addr`'s stats, from `cache` once they have all been defined; else defined
/// now from their kinds and names (`names` gets the address as a stat segment).
fn per_endpoint<H: HostApi + ?Sized, const N: usize>(
    h: &H,
    ids: &mut HashMap<String, u32>,
    cache: &mut HashMap<String, [u32; N]>,
    addr: &str,
    names: impl FnOnce(&str) -> [(MetricKind, String); N],
) -> Option<[u32; N]> {
    if let Some(found) = cache.get(addr) {
        return Some(*found);
    }
    let mut resolved = [0; N];
    for (slot, (kind, name)) in resolved.iter_mut().zip(names(&usage::stat_segment(addr))) {
        *slot = define(h, ids, kind, &name)?;
    }
    cache.insert(addr.to_string(), resolved);
    Some(resolved)
}

/// The id of the stat `name`, from `ids` or defined now (and kept there).
fn define<H: HostApi + ?Sized>(
    h: &H,
    ids: &mut HashMap<String, u32>,
    kind: MetricKind,
    name: &str,
) -> Option<u32> {
    if let Some(id) = ids.get(name) {
        return Some(*id);
    }
    let id = h.define_metric(kind, name)?;
    ids.insert(name.to_string(), id);
    Some(id)
}

fn increment<H: HostApi + ?Sized>(h: &H, id: Option<u32>, delta: i64) {
    if let Some(id) = id {
        h.increment_metric(id, delta);
    }
}
