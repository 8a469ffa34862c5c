//! The gateway's stats in this process: one registry every worker shares, as Envoy's stats of one
//! name are one stat across its workers, read by tests and served as Prometheus text.

use std::fmt::Write;
use std::sync::Mutex;

use kvroute::gateway::MetricKind;

/// One stat: counters and gauges hold a value; a histogram the count and sum of what it recorded.
struct Stat {
    name: String,
    kind: MetricKind,
    value: i64,
    count: u64,
}

/// Every stat defined so far, by id (its index).
#[derive(Default)]
pub struct Stats {
    stats: Mutex<Vec<Stat>>,
}

impl Stats {
    fn with<T>(&self, f: impl FnOnce(&mut Vec<Stat>) -> T) -> T {
        let mut guard = self.stats.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut guard)
    }

    /// The id of stat `name`, defined now if new (its kind is the first definition's).
    pub fn define(&self, kind: MetricKind, name: &str) -> u32 {
        self.with(|stats| {
            if let Some(i) = stats.iter().position(|s| s.name == name) {
                return i as u32;
            }
            stats.push(Stat {
                name: name.to_string(),
                kind,
                value: 0,
                count: 0,
            });
            stats.len() as u32 - 1
        })
    }

    pub fn increment(&self, id: u32, delta: i64) {
        self.with(|stats| {
            if let Some(s) = stats.get_mut(id as usize) {
                s.value += delta;
            }
        })
    }

    /// Sets a gauge, or records one value of a histogram; whether `id` is a stat.
    pub fn record(&self, id: u32, value: u64) -> bool {
        self.with(|stats| match stats.get_mut(id as usize) {
            Some(s) if s.kind == MetricKind::Histogram => {
                s.value += value as i64;
                s.count += 1;
                true
            }
            Some(s) => {
                s.value = value as i64;
                true
            }
            None => false,
        })
    }

    /// A counter's or gauge's value, a histogram's sum; 0 for a stat never defined.
    pub fn value(&self, name: &str) -> i64 {
        self.with(|stats| stats.iter().find(|s| s.name == name).map_or(0, |s| s.value))
    }

    /// The sum of the values of every stat whose name starts with `prefix`.
    pub fn total(&self, prefix: &str) -> i64 {
        self.with(|stats| {
            let named = stats.iter().filter(|s| s.name.starts_with(prefix));
            named.map(|s| s.value).sum()
        })
    }

    /// Prometheus text exposition: each stat under its name with dots as underscores
    /// (`kvroute.routed.affinity` is `kvroute_routed_affinity`, as Envoy's `/stats/prometheus`
    /// names the filter's), histograms as summaries without quantiles.
    pub fn render(&self) -> String {
        let mut out = String::new();
        self.with(|stats| {
            for s in stats.iter() {
                let name = prometheus_name(&s.name);
                let _ = match s.kind {
                    MetricKind::Counter => {
                        writeln!(out, "# TYPE {name} counter\n{name} {}", s.value)
                    }
                    MetricKind::Gauge => writeln!(out, "# TYPE {name} gauge\n{name} {}", s.value),
                    MetricKind::Histogram => writeln!(
                        out,
                        "# TYPE {name} summary\n{name}_sum {}\n{name}_count {}",
                        s.value, s.count
                    ),
                };
            }
        });
        out
    }
}

/// `name` with every character Prometheus does not allow in a metric name as `_`.
fn prometheus_name(name: &str) -> String {
    name.chars()
        .map(|c| match c {
            'a'..='z' | 'A'..='Z' | '0'..='9' | '_' | ':' => c,
            _ => '_',
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use kvroute::gateway::stat_names;
    use kvroute::policy::Decision;

    use super::*;

    #[test]
    fn one_name_is_one_stat_whoever_defines_it() {
        let stats = Stats::default();
        let name = stat_names::routed(Decision::Affinity);
        let a = stats.define(MetricKind::Counter, &name);
        let b = stats.define(MetricKind::Counter, &name);
        assert_eq!(a, b);
        stats.increment(a, 2);
        stats.increment(b, 3);
        assert_eq!(stats.value(&name), 5);
        let text = stats.render();
        assert!(
            text.contains("# TYPE kvroute_routed_affinity counter\nkvroute_routed_affinity 5\n")
        );
    }

    #[test]
    fn gauges_are_set_and_histograms_summed() {
        let stats = Stats::default();
        // A segment with dots, which Prometheus names do not allow.
        let g = stats.define(MetricKind::Gauge, &stat_names::inflight("127.0.0.1_8001"));
        let h = stats.define(MetricKind::Histogram, stat_names::MATCH_PERCENT);
        assert!(stats.record(g, 7) && stats.record(g, 3));
        assert!(stats.record(h, 40) && stats.record(h, 60));
        assert!(!stats.record(99, 1));
        let text = stats.render();
        assert!(
            text.contains("kvroute_inflight_127_0_0_1_8001 3\n"),
            "{text}"
        );
        assert!(text.contains("kvroute_match_percent_sum 100\nkvroute_match_percent_count 2\n"));
    }
}
