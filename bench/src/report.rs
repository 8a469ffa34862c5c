//! The comparison's outputs: results.json (the contract), results.md (table) and ttft.svg (bars).

use crate::analyze::misses;
use crate::driver::{RunOutcome, Sample};
use crate::precise::IndexFreshness;
use crate::sim_process::FleetState;
use crate::stamp::Stamp;
use crate::stats::{max_over_min, percentile, ratio};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::fmt::Write as _;
use std::path::Path;

/// `results.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Results {
    /// The build measured and when ([`Stamp`]); absent in files written before stamping.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stamp: Option<Stamp>,
    pub workload: Value,
    pub fleet: Value,
    /// Worker threads of each Envoy the run started (`compare --envoy-workers`); each worker has
    /// its own kvroute VM.
    #[serde(default = "default_envoy_workers")]
    pub envoy_workers: u32,
    /// The workload's prefix hit rate with an unbounded cache and perfect routing (every prefix
    /// computed once, fleet-wide), counted as the simulator counts hits: no router can beat it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ceiling_hit_rate: Option<f64>,
    /// The hit rate with the fleet's KV capacity as one cache that evicts what is needed furthest
    /// in the future: no router can beat it on this fleet ([`crate::analyze::ceiling::Bounds`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity_bound_hit_rate: Option<f64>,
    /// The hit rate with the fleet's KV capacity as one LRU cache: a reference, not a bound.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fleet_lru_hit_rate: Option<f64>,
    pub results: Vec<RouterResult>,
    /// Every request each router's run sent, as the client saw it (written to samples.jsonl).
    #[serde(skip)]
    pub samples: Vec<(String, Vec<Sample>)>,
}

/// One router's line: measured, or skipped with the reason.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(untagged)]
pub enum RouterResult {
    Measured(Measured),
    Skipped { router: String, skipped: String },
}

/// Percentiles are `null` when no request succeeded; `share_max_over_min` is `null` when some
/// replica served no request at all (the ratio is unbounded).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Measured {
    pub router: String,
    pub requests: u64,
    pub errors: u64,
    pub ttft_ms: Ttft,
    pub e2e_ms: E2e,
    pub output_tok_s: f64,
    pub req_s: f64,
    pub prefix_hit_rate: f64,
    pub share_max_over_min: Option<f64>,
    /// kvroute only: the hit rate the engines reported in their responses' `usage`, as kvroute's
    /// Envoy stats (`kvroute.usage.cached_tokens` / `prompt_tokens`) counted it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine_reported_hit_rate: Option<f64>,
    /// Precise routers only: how fresh their index was through the run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index: Option<IndexFreshness>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Ttft {
    pub p50: Option<f64>,
    pub p90: Option<f64>,
    pub p99: Option<f64>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct E2e {
    pub p50: Option<f64>,
    pub p90: Option<f64>,
}

/// Summarises one run: client-side samples plus the fleet's counters before and after.
pub fn measure(
    router: &str,
    run: &RunOutcome,
    before: &FleetState,
    after: &FleetState,
) -> Measured {
    let hits: u64 = after
        .growth_since(before, |r| r.prefix_hits_tokens)
        .iter()
        .sum();
    let queries: u64 = after
        .growth_since(before, |r| r.prefix_queries_tokens)
        .iter()
        .sum();
    let per_replica = after.growth_since(before, |r| r.requests);
    measured(router, run, hits, queries, &per_replica)
}

/// Summarises one run from its samples and what the fleet counted in it: prompt tokens found
/// cached (`hits`) of those looked up (`queries`), and requests per replica.
pub fn measured(
    router: &str,
    run: &RunOutcome,
    hits: u64,
    queries: u64,
    per_replica: &[u64],
) -> Measured {
    let ok: Vec<_> = run.samples.iter().filter(|s| s.error.is_none()).collect();
    let ttft: Vec<f64> = ok.iter().filter_map(|s| s.ttft_ms).collect();
    let e2e: Vec<f64> = ok.iter().map(|s| s.e2e_ms).collect();
    let tokens: u64 = ok.iter().map(|s| s.output_tokens).sum();
    let wall = run.wall_s.max(1e-9);
    let round = |x: f64| (x * 100.0).round() / 100.0;
    let pct = |v: &[f64], q| percentile(v, q).map(round);
    Measured {
        router: router.to_string(),
        requests: run.samples.len() as u64,
        errors: (run.samples.len() - ok.len()) as u64,
        ttft_ms: Ttft {
            p50: pct(&ttft, 0.5),
            p90: pct(&ttft, 0.9),
            p99: pct(&ttft, 0.99),
        },
        e2e_ms: E2e {
            p50: pct(&e2e, 0.5),
            p90: pct(&e2e, 0.9),
        },
        output_tok_s: round(tokens as f64 / wall),
        req_s: round(ok.len() as f64 / wall),
        prefix_hit_rate: (ratio(hits, queries) * 1e4).round() / 1e4,
        share_max_over_min: max_over_min(per_replica).map(round),
        engine_reported_hit_rate: None,
        index: None,
    }
}

fn default_envoy_workers() -> u32 {
    crate::routers::ENVOY_WORKERS
}

impl Results {
    pub fn write_all(&self, dir: &Path) -> Result<(), String> {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let write = |name: &str, text: String| {
            let p = dir.join(name);
            std::fs::write(&p, text).map_err(|e| format!("{}: {e}", p.display()))
        };
        let json = serde_json::to_string_pretty(self).map_err(|e| e.to_string())?;
        write("results.json", json + "\n")?;
        write("results.md", self.markdown())?;
        write("samples.jsonl", self.samples_jsonl())?;
        write("ttft.svg", self.svg())
    }

    /// One JSON line per request: the router's name and its [`Sample`], for analyses the table
    /// does not make (per group, per replica, over time).
    fn samples_jsonl(&self) -> String {
        #[derive(Serialize)]
        struct Line<'a> {
            router: &'a str,
            #[serde(flatten)]
            sample: &'a Sample,
        }
        let mut out = String::new();
        for (router, samples) in &self.samples {
            for sample in samples {
                if let Ok(line) = serde_json::to_string(&Line { router, sample }) {
                    out.push_str(&line);
                    out.push('\n');
                }
            }
        }
        out
    }

    fn measured(&self) -> impl Iterator<Item = &Measured> {
        self.results.iter().filter_map(|r| match r {
            RouterResult::Measured(m) => Some(m),
            RouterResult::Skipped { .. } => None,
        })
    }

    /// The results as two markdown tables: absolute numbers, then ratios to round_robin.
    pub fn markdown(&self) -> String {
        let name = self.workload["name"].as_str().unwrap_or("workload");
        let mut s = format!("## {name}\n\n");
        if let Some(stamp) = &self.stamp {
            let _ = writeln!(
                s,
                "Build {}, run {} (kvroute-bench compare).\n",
                stamp.commit, stamp.date
            );
        }
        if self.envoy_workers != crate::routers::ENVOY_WORKERS {
            let _ = writeln!(s, "Each Envoy ran {} workers.\n", self.envoy_workers);
        }
        s += "| router | requests | errors | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | e2e p50 ms | e2e p90 ms | output tok/s | req/s | prefix hit rate | busiest/idlest |\n";
        s += "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
        for r in &self.results {
            match r {
                RouterResult::Measured(m) => {
                    let _ = writeln!(
                        s,
                        "| {} | {} | {} | {} | {} | {} | {} | {} | {:.1} | {:.2} | {:.1}% | {} |",
                        m.router,
                        m.requests,
                        m.errors,
                        ms(m.ttft_ms.p50),
                        ms(m.ttft_ms.p90),
                        ms(m.ttft_ms.p99),
                        ms(m.e2e_ms.p50),
                        ms(m.e2e_ms.p90),
                        m.output_tok_s,
                        m.req_s,
                        m.prefix_hit_rate * 100.0,
                        m.share_max_over_min
                            .map_or("inf".to_string(), |x| format!("{x:.2}")),
                    );
                }
                RouterResult::Skipped { router, skipped } => {
                    let _ = writeln!(
                        s,
                        "| {router} | skipped: {} |||||||||||",
                        skipped.replace('|', "/")
                    );
                }
            }
        }
        if let (Some(c), Some(b), Some(l)) = (
            self.ceiling_hit_rate,
            self.capacity_bound_hit_rate,
            self.fleet_lru_hit_rate,
        ) {
            let _ = writeln!(s, "\n{}", crate::analyze::ceiling::describe(c, b, l));
        }
        s += &self.freshness_markdown();
        s += &misses::table(&self.samples);
        let Some(rr) = self.measured().find(|m| m.router == "round_robin") else {
            return s;
        };
        s += "\nRatio to round_robin (TTFT and e2e: lower is better; throughput and hit rate: higher is better)\n\n";
        s += "| router | TTFT p50 | TTFT p90 | TTFT p99 | e2e p50 | output tok/s | prefix hit rate |\n";
        s += "|---|---:|---:|---:|---:|---:|---:|\n";
        for m in self.measured() {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} |",
                m.router,
                times(m.ttft_ms.p50, rr.ttft_ms.p50),
                times(m.ttft_ms.p90, rr.ttft_ms.p90),
                times(m.ttft_ms.p99, rr.ttft_ms.p99),
                times(m.e2e_ms.p50, rr.e2e_ms.p50),
                times(Some(m.output_tok_s), Some(rr.output_tok_s)),
                times(Some(m.prefix_hit_rate), Some(rr.prefix_hit_rate)),
            );
        }
        s
    }

    /// How fresh each precise router's index was, when a row has one.
    fn freshness_markdown(&self) -> String {
        let rows: Vec<(&str, &IndexFreshness)> = self
            .measured()
            .filter_map(|m| Some((m.router.as_str(), m.index.as_ref()?)))
            .collect();
        if rows.is_empty() {
            return String::new();
        }
        let mut s = "\nHow fresh precise mode's index was: the share of kvroute's polls of its \
            indexer answered and applied, and of the samples through the run (every 500 ms) in \
            which no indexer called an engine stale\n\n| router | polls answered | time fresh |\n|---|---:|---:|\n"
            .to_string();
        for (router, f) in rows {
            let _ = writeln!(
                s,
                "| {router} | {:.1}% | {:.1}% |",
                f.polls_answered * 100.0,
                f.fresh * 100.0
            );
        }
        s
    }

    /// Two horizontal bar charts side by side: TTFT p90 and prefix hit rate per router.
    pub fn svg(&self) -> String {
        let rows: Vec<&Measured> = self.measured().collect();
        let (label_w, bar_w, row_h, top) = (220.0, 300.0, 26.0, 50.0);
        let width = label_w + 2.0 * (bar_w + 90.0);
        let height = top + row_h * rows.len().max(1) as f64 + 20.0;
        let max_ttft = rows
            .iter()
            .filter_map(|m| m.ttft_ms.p90)
            .fold(0.0, f64::max)
            .max(1e-9);
        let mut s = format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" font-family=\"sans-serif\" font-size=\"13\">\n\
             <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
             <text x=\"{label_w}\" y=\"20\" font-weight=\"bold\">TTFT p90 (ms, lower is better)</text>\n\
             <text x=\"{}\" y=\"20\" font-weight=\"bold\">Prefix-cache hit rate (higher is better)</text>\n",
            label_w + bar_w + 90.0
        );
        for (i, m) in rows.iter().enumerate() {
            let y = top + row_h * i as f64;
            let ttft = m.ttft_ms.p90.unwrap_or(0.0);
            let w1 = bar_w * ttft / max_ttft;
            let x2 = label_w + bar_w + 90.0;
            let w2 = bar_w * m.prefix_hit_rate.clamp(0.0, 1.0);
            let _ = write!(
                s,
                "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{}</text>\n\
                 <rect x=\"{label_w}\" y=\"{}\" width=\"{w1:.1}\" height=\"{}\" fill=\"#d9822b\"/>\n\
                 <text x=\"{:.1}\" y=\"{}\">{}</text>\n\
                 <rect x=\"{x2}\" y=\"{}\" width=\"{w2:.1}\" height=\"{}\" fill=\"#2b7bd9\"/>\n\
                 <text x=\"{:.1}\" y=\"{}\">{:.1}%</text>\n",
                label_w - 8.0,
                y + 17.0,
                xml_escape(&m.router),
                y + 4.0,
                row_h - 8.0,
                label_w + w1 + 4.0,
                y + 17.0,
                ms(m.ttft_ms.p90),
                y + 4.0,
                row_h - 8.0,
                x2 + w2 + 4.0,
                y + 17.0,
                m.prefix_hit_rate * 100.0,
            );
        }
        if let Some(stamp) = &self.stamp {
            let _ = writeln!(
                s,
                "<text x=\"8\" y=\"{:.0}\" font-size=\"11\" fill=\"#666\">{} · build {} · {}</text>",
                height - 6.0,
                xml_escape(self.workload["name"].as_str().unwrap_or("workload")),
                xml_escape(&stamp.commit),
                xml_escape(&stamp.date),
            );
        }
        s += "</svg>\n";
        s
    }
}

/// README's results table: one column per workload of `dir` (`dir/<workload>/results.json`, in
/// the order of `workloads`), one row per router, each cell the prefix hit rate · TTFT p90, then
/// each workload's ceiling and the build and date its file was stamped with.
pub fn summary(dir: &Path, workloads: &[String]) -> Result<String, String> {
    let mut sets = Vec::new();
    for w in workloads {
        let path = dir.join(w).join("results.json");
        let text =
            std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let r: Results =
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        sets.push((w.as_str(), r));
    }
    let mut routers: Vec<&str> = Vec::new();
    for (_, r) in &sets {
        for m in r.measured() {
            if !routers.contains(&m.router.as_str()) {
                routers.push(&m.router);
            }
        }
    }
    let mut s = "| router |".to_string();
    for (w, _) in &sets {
        let _ = write!(s, " {w} |");
    }
    s += "\n|---|";
    s += &"---:|".repeat(sets.len());
    s += "\n";
    for router in routers {
        let _ = write!(s, "| {router} |");
        for (_, r) in &sets {
            match r.measured().find(|m| m.router == router) {
                Some(m) => {
                    let _ = write!(s, " {} |", cell(m));
                }
                None => s += " |",
            }
        }
        s += "\n";
    }
    s += "| ceiling |";
    for (_, r) in &sets {
        match r.ceiling_hit_rate {
            Some(c) => {
                let _ = write!(s, " {:.1}% |", c * 100.0);
            }
            None => s += " |",
        }
    }
    s += "\n| build, date |";
    for (_, r) in &sets {
        match &r.stamp {
            Some(st) => {
                let _ = write!(s, " {}, {} |", st.commit, st.date);
            }
            None => s += " unstamped |",
        }
    }
    s += "\n";
    Ok(s)
}

/// `text` with the lines between its `<!-- NAME` line and its `<!-- /NAME -->` line replaced by
/// `table`; `None` without both.
pub fn replace_block(text: &str, name: &str, table: &str) -> Option<String> {
    let open = text.find(&format!("<!-- {name}"))?;
    let body = open + text[open..].find('\n')? + 1;
    let close = body + text[body..].find(&format!("<!-- /{name} -->"))?;
    Some(format!("{}{table}{}", &text[..body], &text[close..]))
}

/// One router on one workload in [`summary`]: hit rate · TTFT p90.
pub fn cell(m: &Measured) -> String {
    format!(
        "{:.1}% · {} ms",
        m.prefix_hit_rate * 100.0,
        ms(m.ttft_ms.p90)
    )
}

fn ms(x: Option<f64>) -> String {
    x.map_or("-".into(), |v| format!("{v:.0}"))
}

fn times(x: Option<f64>, base: Option<f64>) -> String {
    match (x, base) {
        (Some(x), Some(b)) if b > 0.0 => format!("{:.2}x", x / b),
        _ => "-".into(),
    }
}

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim_process::ReplicaState;

    fn state(rows: &[(u64, u64, u64)]) -> FleetState {
        FleetState {
            replicas: rows
                .iter()
                .enumerate()
                .map(|(id, &(q, h, n))| ReplicaState {
                    id,
                    prefix_queries_tokens: q,
                    prefix_hits_tokens: h,
                    requests: n,
                    ..ReplicaState::default()
                })
                .collect(),
        }
    }

    fn sample(ttft: f64, e2e: f64) -> Sample {
        Sample {
            ttft_ms: Some(ttft),
            e2e_ms: e2e,
            output_tokens: 10,
            ..Sample::default()
        }
    }

    fn results() -> Results {
        let run = RunOutcome {
            samples: vec![
                sample(10.0, 100.0),
                sample(20.0, 200.0),
                Sample {
                    error: Some("x".into()),
                    ..Sample::default()
                },
            ],
            wall_s: 2.0,
        };
        let m = measure(
            "round_robin",
            &run,
            &state(&[(0, 0, 0), (0, 0, 0)]),
            &state(&[(100, 50, 3), (100, 30, 1)]),
        );
        Results {
            stamp: None,
            workload: serde_json::json!({"name": "t"}),
            fleet: serde_json::json!({"replicas": 2}),
            envoy_workers: 2,
            ceiling_hit_rate: None,
            capacity_bound_hit_rate: None,
            fleet_lru_hit_rate: None,
            samples: Vec::new(),
            results: vec![
                RouterResult::Measured(m),
                RouterResult::Skipped {
                    router: "smg".into(),
                    skipped: "not installed".into(),
                },
            ],
        }
    }

    #[test]
    fn measure_uses_fleet_counter_deltas_and_client_samples() {
        let r = results();
        let RouterResult::Measured(m) = &r.results[0] else {
            panic!("measured")
        };
        assert_eq!((m.requests, m.errors), (3, 1));
        assert_eq!(m.prefix_hit_rate, 0.4);
        assert_eq!(m.share_max_over_min, Some(3.0));
        assert_eq!(m.ttft_ms.p50, Some(15.0));
        assert_eq!(m.output_tok_s, 10.0);
        assert_eq!(m.req_s, 1.0);
    }

    #[test]
    fn results_json_has_the_contract_shape() {
        let v = serde_json::to_value(results()).unwrap();
        let keys = |v: &Value| {
            let mut k: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
            k.sort();
            k
        };
        assert_eq!(keys(&v), ["envoy_workers", "fleet", "results", "workload"]);
        let measured = &v["results"][0];
        assert_eq!(
            keys(measured),
            [
                "e2e_ms",
                "errors",
                "output_tok_s",
                "prefix_hit_rate",
                "req_s",
                "requests",
                "router",
                "share_max_over_min",
                "ttft_ms"
            ]
        );
        assert_eq!(keys(&measured["ttft_ms"]), ["p50", "p90", "p99"]);
        assert_eq!(keys(&measured["e2e_ms"]), ["p50", "p90"]);
        assert_eq!(
            v["results"][1],
            serde_json::json!({"router": "smg", "skipped": "not installed"})
        );
        // And it reads back.
        let back: Results = serde_json::from_value(v).unwrap();
        assert!(matches!(back.results[1], RouterResult::Skipped { .. }));
    }

    #[test]
    fn markdown_and_svg_name_every_router() {
        let r = results();
        let md = r.markdown();
        assert!(md.contains("| round_robin | 3 | 1 |"));
        assert!(md.contains("| smg | skipped: not installed"));
        assert!(md.contains("Ratio to round_robin"));
        assert!(r.svg().contains(">round_robin</text>"));
        assert!(
            !md.contains("What the workload allows"),
            "no bounds, no line"
        );
        assert!(!md.contains("workers"), "the usual workers go unsaid");
        assert!(
            !md.contains("uncached"),
            "no usage in the samples, no table"
        );
        let with_usage = Results {
            samples: vec![(
                "round_robin".into(),
                vec![Sample {
                    user: "u0-0-0".into(),
                    replica: Some(1),
                    prompt_tokens: Some(100),
                    cached_tokens: Some(25),
                    ..Sample::default()
                }],
            )],
            ..results()
        };
        assert!(with_usage
            .markdown()
            .contains("| round_robin | 75.0 (1) | 0.0 (0) | 0.0 (0) | 0.0 (0) | 0.0 (0) | 75.0 |"));
        let stamped = Results {
            stamp: Some(Stamp {
                commit: "abc1234".into(),
                date: "2026-11-27T09:00Z".into(),
            }),
            ..results()
        };
        assert!(stamped
            .markdown()
            .contains("Build abc1234, run 2026-11-27T09:00Z"));
        assert!(stamped.svg().contains("build abc1234 · 2026-11-27T09:00Z"));
        let back: Results =
            serde_json::from_str(&serde_json::to_string(&stamped).unwrap()).unwrap();
        assert_eq!(back.stamp, stamped.stamp);
        let eight = Results {
            envoy_workers: 8,
            ..results()
        };
        assert!(eight.markdown().contains("Each Envoy ran 8 workers."));
    }

    #[test]
    fn the_summary_has_a_column_per_workload_and_a_row_per_router() {
        let dir = std::env::temp_dir().join(format!("kvroute-summary-{}", std::process::id()));
        let mut a = results();
        a.ceiling_hit_rate = Some(0.8781);
        a.stamp = Some(Stamp {
            commit: "abc1234".into(),
            date: "2026-11-27T09:00Z".into(),
        });
        a.write_all(&dir.join("a")).unwrap();
        let mut b = results();
        if let RouterResult::Measured(m) = &mut b.results[0] {
            m.router = "kvroute".into();
        }
        b.write_all(&dir.join("b")).unwrap();
        let table = summary(&dir, &["a".into(), "b".into()]).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines[0], "| router | a | b |");
        assert_eq!(lines[2], "| round_robin | 40.0% · 19 ms | |");
        assert_eq!(lines[3], "| kvroute | | 40.0% · 19 ms |");
        assert_eq!(lines[4], "| ceiling | 87.8% | |");
        assert_eq!(
            lines[5],
            "| build, date | abc1234, 2026-11-27T09:00Z | unstamped |"
        );
        let readme = "# r\n<!-- results: x -->\nold\n<!-- /results -->\nafter\n";
        assert_eq!(
            replace_block(readme, "results", "| t |\n").as_deref(),
            Some("# r\n<!-- results: x -->\n| t |\n<!-- /results -->\nafter\n")
        );
        assert_eq!(replace_block("no block", "results", "| t |\n"), None);
        let two =
            "<!-- results -->\n| r |\n<!-- /results -->\n<!-- precise: y -->\n<!-- /precise -->\n";
        assert_eq!(
            replace_block(two, "precise", "| p |\n").as_deref(),
            Some("<!-- results -->\n| r |\n<!-- /results -->\n<!-- precise: y -->\n| p |\n<!-- /precise -->\n")
        );
    }

    #[test]
    fn markdown_gives_what_the_workload_allows() {
        let mut r = results();
        r.ceiling_hit_rate = Some(0.8588);
        r.capacity_bound_hit_rate = Some(0.8323);
        r.fleet_lru_hit_rate = Some(0.7234);
        let md = r.markdown();
        assert!(md.contains("85.9% with an unbounded cache"), "{md}");
        assert!(
            md.contains("83.2% with the fleet's KV blocks and the best eviction"),
            "{md}"
        );
        assert!(
            md.contains("72.3% with the fleet's KV blocks as one LRU cache"),
            "{md}"
        );
        let back: Results = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(back.capacity_bound_hit_rate, Some(0.8323));
    }
}
