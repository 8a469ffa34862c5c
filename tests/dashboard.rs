//! The Grafana dashboard (`deploy/grafana/kvroute.json`) asks only for metrics that exist: every
//! metric its queries name is one a real Envoy running the built filter exposes on
//! `/stats/prometheus` after routing requests to a simulated vLLM fleet, or one the simulator's
//! `/metrics` exposes (it mirrors vLLM's names), and every kvroute metric it names is one
//! `kvroute::gateway::stat_names` defines. A misspelled name in the dashboard fails here.

use crate::common;

use kvroute::gateway::stat_names::{self, Counter, Gauge};
use kvroute::policy::Decision;
use kvroute::router::Fallback;
use kvroute::template::Outcome;
use kvroute_sim::spec::FleetSpec;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::time::Duration;
use strum::VariantArray;

const DASHBOARD: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/grafana/kvroute.json");

/// A metric a query names: exactly, or as `{__name__=~"PREFIX.+"}` (kvroute's per-endpoint stats
/// carry the endpoint in the name, which the dashboard turns into a label).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum MetricRef {
    Name(String),
    Prefix(String),
}

impl MetricRef {
    fn found_in(&self, exposed: &BTreeSet<String>) -> bool {
        match self {
            MetricRef::Name(n) => exposed.contains(n),
            MetricRef::Prefix(p) => exposed
                .iter()
                .any(|n| n.len() > p.len() && n.starts_with(p)),
        }
    }
}

/// PromQL words followed by a list of labels, not metrics: `by (instance)`, `on (le)`.
const GROUPING: &[&str] = &[
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
];

/// PromQL words that are not metric names: aggregations (`sum by (x) (...)`) and operators.
const KEYWORDS: &[&str] = &[
    "sum",
    "min",
    "max",
    "avg",
    "count",
    "group",
    "stddev",
    "stdvar",
    "topk",
    "bottomk",
    "quantile",
    "count_values",
    "limitk",
    "limit_ratio",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "inf",
    "nan",
];

/// The metrics one PromQL expression reads. Skips strings, label matchers (but reads
/// `__name__`), ranges, numbers and durations, Grafana variables, functions and the label lists
/// of `by (...)` and friends. An expression it cannot read is an error, not a pass.
fn metric_refs(expr: &str) -> Result<Vec<MetricRef>, String> {
    let s: Vec<char> = expr.chars().collect();
    let mut refs = Vec::new();
    let mut i = 0;
    let ident_start = |c: char| c.is_ascii_alphabetic() || c == '_' || c == ':';
    let ident_char = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let close = |from: usize, open: char, shut: char| -> Result<usize, String> {
        let mut depth = 0;
        let mut quoted = false;
        for (j, &c) in s.iter().enumerate().skip(from) {
            match c {
                '"' => quoted = !quoted,
                _ if quoted => {}
                c if c == open => depth += 1,
                c if c == shut => {
                    depth -= 1;
                    if depth == 0 {
                        return Ok(j);
                    }
                }
                _ => {}
            }
        }
        Err(format!("unbalanced {open} in {expr:?}"))
    };
    while i < s.len() {
        let c = s[i];
        if c == '"' || c == '\'' {
            let end = s[i + 1..]
                .iter()
                .position(|&d| d == c)
                .ok_or_else(|| format!("unclosed string in {expr:?}"))?;
            i += end + 2;
        } else if c == '{' {
            let end = close(i, '{', '}')?;
            let matchers: String = s[i + 1..end].iter().collect();
            refs.extend(name_matchers(&matchers, expr)?);
            i = end + 1;
        } else if c == '[' {
            i = close(i, '[', ']')? + 1;
        } else if c == '$' {
            i += 1;
            if s.get(i) == Some(&'{') {
                i = close(i, '{', '}')? + 1;
            } else {
                while i < s.len() && ident_char(s[i]) {
                    i += 1;
                }
            }
        } else if c.is_ascii_digit() || c == '.' {
            while i < s.len() && (s[i].is_ascii_alphanumeric() || s[i] == '.' || s[i] == '_') {
                i += 1;
            }
        } else if ident_start(c) {
            let start = i;
            while i < s.len() && ident_char(s[i]) {
                i += 1;
            }
            let word: String = s[start..i].iter().collect();
            let mut next = i;
            while next < s.len() && s[next].is_whitespace() {
                next += 1;
            }
            let call = s.get(next) == Some(&'(');
            if GROUPING.contains(&word.as_str()) {
                if call {
                    i = close(next, '(', ')')? + 1;
                }
            } else if !call && !KEYWORDS.contains(&word.to_lowercase().as_str()) {
                refs.push(MetricRef::Name(word));
            }
        } else {
            i += 1;
        }
    }
    Ok(refs)
}

/// The `__name__` matchers among a selector's label matchers.
fn name_matchers(matchers: &str, expr: &str) -> Result<Vec<MetricRef>, String> {
    let mut refs = Vec::new();
    for m in matchers.split(',') {
        let m = m.trim();
        let Some(rest) = m.strip_prefix("__name__") else {
            continue;
        };
        let rest = rest.trim_start();
        let (regex, value) = if let Some(v) = rest.strip_prefix("=~") {
            (true, v)
        } else if let Some(v) = rest.strip_prefix('=') {
            (false, v)
        } else {
            return Err(format!("unsupported __name__ matcher {m:?} in {expr:?}"));
        };
        let value = value.trim().trim_matches('"');
        if !regex {
            refs.push(MetricRef::Name(value.to_string()));
            continue;
        }
        let prefix = value
            .strip_suffix(".+")
            .or_else(|| value.strip_suffix(".*"))
            .filter(|p| p.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'))
            .ok_or_else(|| {
                format!("__name__ regex {value:?} in {expr:?}: only a literal prefix then .+ is checked")
            })?;
        refs.push(MetricRef::Prefix(prefix.to_string()));
    }
    Ok(refs)
}

/// Every PromQL expression in a Grafana dashboard: panels' and nested rows' targets.
fn queries(dashboard: &Value) -> Vec<String> {
    fn walk(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::Object(map) => {
                for (k, v) in map {
                    match (k.as_str(), v) {
                        ("expr", Value::String(e)) => out.push(e.clone()),
                        _ => walk(v, out),
                    }
                }
            }
            Value::Array(items) => items.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(&dashboard["panels"], &mut out);
    out
}

/// What each query names that `exposed` lacks, as `metric (in: query)` lines.
fn missing(dashboard: &Value, exposed: &BTreeSet<String>) -> Result<Vec<String>, String> {
    let mut missing = Vec::new();
    for q in queries(dashboard) {
        let refs = metric_refs(&q)?;
        if refs.is_empty() {
            return Err(format!("a query naming no metric: {q:?}"));
        }
        for r in refs.iter().filter(|r| !r.found_in(exposed)) {
            missing.push(format!("{r:?} (in: {q})"));
        }
    }
    Ok(missing)
}

/// Metric names of a Prometheus text exposition.
fn exposed_names(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_string)
        .collect()
}

fn dashboard() -> Value {
    let text = std::fs::read_to_string(DASHBOARD).expect("deploy/grafana/kvroute.json");
    serde_json::from_str(&text).expect("the dashboard is JSON")
}

#[test]
fn the_query_reader_finds_metrics_and_skips_the_rest() {
    let refs = metric_refs(
        r#"sum by (instance) (rate(vllm:prefix_cache_hits_total{model_name=~"$model"}[$__rate_interval]))
           / clamp_min(sum by (instance) (rate(vllm:prefix_cache_queries_total[5m] offset 1h)), 1)"#,
    )
    .unwrap();
    assert_eq!(
        refs,
        vec![
            MetricRef::Name("vllm:prefix_cache_hits_total".into()),
            MetricRef::Name("vllm:prefix_cache_queries_total".into()),
        ]
    );
    let refs = metric_refs(
        r#"label_replace({__name__=~"kvroute_inflight_.+"}, "endpoint", "$1", "__name__", "kvroute_inflight_(.+)")"#,
    )
    .unwrap();
    assert_eq!(refs, vec![MetricRef::Prefix("kvroute_inflight_".into())]);
    assert!(
        metric_refs(r#"{__name__=~"a|b"}"#).is_err(),
        "a regex it cannot check"
    );
}

#[test]
fn a_misspelled_metric_fails_the_check() {
    let exposed: BTreeSet<String> = ["kvroute_routed_home", "vllm:num_requests_running"]
        .map(String::from)
        .into();
    let good = json!({"panels": [{"targets": [{"expr": "rate(kvroute_routed_home[1m])"}]},
                                  {"type": "row", "panels": [{"targets": [{"expr": "vllm:num_requests_running"}]}]}]});
    assert_eq!(missing(&good, &exposed).unwrap(), Vec::<String>::new());
    let typo = json!({"panels": [{"type": "row", "panels": [{"targets": [{"expr": "vllm:num_request_running"}]}]}]});
    let found = missing(&typo, &exposed).unwrap();
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].contains("vllm:num_request_running"), "{found:?}");
}

/// Every stat name `stat_names` defines as Envoy's `/stats/prometheus` names it (dots as `_`; a
/// histogram as its `_bucket`, `_sum` and `_count`), the per-endpoint ones for endpoint `seg`.
fn defined_prometheus_names(seg: &str) -> BTreeSet<String> {
    let mut names: Vec<String> = Counter::VARIANTS.iter().map(|c| c.name().into()).collect();
    names.extend(Gauge::VARIANTS.iter().map(|g| g.name().to_string()));
    names.extend(Decision::VARIANTS.iter().map(|&d| stat_names::routed(d)));
    names.extend(Fallback::VARIANTS.iter().map(|&f| stat_names::fallback(f)));
    names.extend(Outcome::VARIANTS.iter().map(|&o| stat_names::template(o)));
    names.extend(
        [Counter::UsagePromptTokens, Counter::UsageCachedTokens].map(|c| c.of_endpoint(seg)),
    );
    names.push(stat_names::inflight(seg));
    for histogram in [
        stat_names::MATCH_PERCENT.into(),
        stat_names::ttft_estimate(seg),
    ] {
        names.extend(["_bucket", "_sum", "_count"].map(|end| format!("{histogram}{end}")));
    }
    names.iter().map(|n| n.replace('.', "_")).collect()
}

/// Without an Envoy: every `kvroute_*` metric the dashboard names (exactly, or as a per-endpoint
/// or per-decision prefix) is one kvroute defines, so renaming a stat in `stat_names` without
/// the dashboard, or the other way round, fails here.
#[test]
fn every_kvroute_metric_the_dashboard_names_is_one_stat_names_defines() {
    let defined = defined_prometheus_names("127_0_0_1_8000");
    let mut checked = 0;
    let mut unknown = Vec::new();
    for q in queries(&dashboard()) {
        for r in metric_refs(&q).unwrap_or_else(|e| panic!("{e}")) {
            let (MetricRef::Name(n) | MetricRef::Prefix(n)) = &r;
            if !n.starts_with("kvroute_") {
                continue;
            }
            checked += 1;
            if !r.found_in(&defined) {
                unknown.push(format!("{r:?} (in: {q})"));
            }
        }
    }
    assert!(
        unknown.is_empty(),
        "the dashboard names kvroute metrics stat_names does not define:\n{}",
        unknown.join("\n")
    );
    assert!(
        checked >= 20,
        "only {checked} kvroute metrics in the dashboard"
    );
    // The check can fail: a name one letter off, and a prefix of nothing kvroute defines.
    let typo = MetricRef::Name("kvroute_served_elsewher".into());
    assert!(!typo.found_in(&defined));
    assert!(!MetricRef::Prefix("kvroute_routes_".into()).found_in(&defined));
}

/// Routes a few requests through a real Envoy with the built filter to a simulated fleet, scrapes
/// both, and checks every query of the shipped dashboard against what they expose; then checks
/// that the same dashboard with one name misspelled, in each query in turn, fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_query_names_a_metric_kvroute_or_vllm_exposes() {
    let dashboard = dashboard();
    let spec = FleetSpec {
        replicas: 2,
        time_scale: 0.01,
        ..FleetSpec::default()
    };
    let (sim, envoy) = common::kvroute_over_sim(spec).await;
    let http = reqwest::Client::new();
    let url = format!("{}/v1/chat/completions", envoy.url());
    for i in 0..6 {
        let mut body = common::sim_question(&sim.spec.model, i, 4, i % 2 == 0);
        body["stream_options"] = json!({"include_usage": true});
        let resp = http.post(&url).json(&body).send().await.expect("request");
        assert_eq!(resp.status(), 200);
        resp.bytes().await.expect("body");
    }
    envoy
        .wait_for_stat(
            Counter::UsageResponses.name(),
            |v| v == 6,
            Duration::from_secs(30),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let get = |url: String| {
        let http = http.clone();
        async move {
            http.get(&url)
                .send()
                .await
                .and_then(|r| r.error_for_status())
                .unwrap_or_else(|e| panic!("{url}: {e}"))
                .text()
                .await
                .unwrap_or_else(|e| panic!("{url}: {e}"))
        }
    };
    let mut exposed = exposed_names(&get(format!("{}/stats/prometheus", envoy.admin_url())).await);
    let kvroute: Vec<_> = exposed
        .iter()
        .filter(|n| n.starts_with("kvroute_"))
        .cloned()
        .collect();
    assert!(
        kvroute
            .iter()
            .any(|n| n.starts_with("kvroute_usage_cached_tokens_")),
        "per-endpoint usage stats exposed: {kvroute:?}"
    );
    let engine = sim.replicas[0].addr;
    exposed.extend(exposed_names(
        &get(format!("http://{engine}/metrics")).await,
    ));

    let missing_now = missing(&dashboard, &exposed).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        missing_now.is_empty(),
        "the dashboard names metrics nobody exposes:\n{}\nkvroute exposes: {kvroute:?}",
        missing_now.join("\n")
    );

    // The check can fail: each query with its first metric name misspelled is caught.
    let exprs = queries(&dashboard);
    assert!(exprs.len() >= 8, "a dashboard of {} queries", exprs.len());
    for expr in &exprs {
        let first = match &metric_refs(expr).unwrap()[0] {
            MetricRef::Name(n) | MetricRef::Prefix(n) => n.clone(),
        };
        let typo = expr.replacen(&first, &format!("{first}x"), 1);
        let one = json!({"panels": [{"targets": [{"expr": typo}]}]});
        assert!(
            !missing(&one, &exposed).unwrap().is_empty(),
            "a misspelled {first} went unnoticed in {expr}"
        );
    }
}
