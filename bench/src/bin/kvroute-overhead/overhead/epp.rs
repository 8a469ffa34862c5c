//! The `kvroute-epp` row of `overhead`: plain Envoy from the shipped `envoy/kvroute-epp.yaml`
//! asking a kvroute-epp process over ext_proc, with the plugin config the `kvroute` row's filter
//! gets and as many gateways as that filter has VMs. Its latency is measured over plain Envoy as
//! the filter's is; its CPU is the Envoy's and the picker's together, the picker's part beside.

use std::net::SocketAddr;

use kvroute_harness::EnvoyOptions;
use serde_json::Value;

use super::Row;
use kvroute_bench::epp::{self, Gateway, Picker};
use kvroute_bench::kvroute_stats;

/// The config's name, in table order after the precise ones.
pub(crate) const CONFIG: &str = "kvroute-epp";

/// The Envoy and its picker over the backends `addrs`, `plugin_config` laid over the shipped
/// plugin config; the Envoy with the worker threads the other configs' have.
pub(crate) async fn start(addrs: &[SocketAddr], plugin_config: &Value) -> Result<Gateway, String> {
    let config = epp::plugin_config(plugin_config)?;
    let workers = EnvoyOptions::default().concurrency;
    Gateway::start(addrs, workers, &config).await
}

/// Prints what the picker decided during the run; an error when it routed nothing, since its row
/// would then measure Envoy's own balancer.
pub(crate) async fn print_decisions(name: &str, picker: &Picker) -> Result<(), String> {
    let stats = picker.stats().await?;
    let decided = kvroute_stats::prometheus(kvroute_stats::routed());
    let fell_back = kvroute_stats::prometheus(kvroute_stats::fallback());
    let mut decisions: Vec<(String, u64)> = stats
        .into_iter()
        .filter(|(n, v)| *v > 0 && (n.starts_with(&decided) || n.starts_with(&fell_back)))
        .collect();
    decisions.sort();
    println!("{name} decisions during the run: {decisions:?}");
    let routed: u64 = decisions
        .iter()
        .filter(|(n, _)| n.starts_with(&decided))
        .map(|(_, v)| v)
        .sum();
    match routed {
        0 => Err(format!(
            "{name}: the picker routed no request: its row measures nothing of it"
        )),
        _ => Ok(()),
    }
}

/// The picker's cost per prompt size, beside the filter's: CPU per request over plain Envoy's
/// (of it, the picker process's own), and its added latency against smg's hop.
pub(crate) fn ratio_line(rows: &[Row], size: usize) -> Option<String> {
    let get = |config: &str| {
        rows.iter()
            .find(|r| r.config == config && r.prompt_bytes == size)
    };
    let row = get(CONFIG)?;
    let cpu = |config: &str| get(config)?.cpu_us_per_request;
    let mut line = format!("{} KB: {CONFIG}", size / 1024);
    if let (Some(all), Some(plain)) = (row.cpu_us_per_request, cpu("plain")) {
        line += &format!(" CPU/request − plain's = {:+.0} µs", all - plain);
        if let Some(picker) = row.picker_cpu_us_per_request {
            line += &format!(
                " (the picker {picker:.0} µs, its Envoy {:+.0} µs)",
                all - picker - plain
            );
        }
        if let Some(filter) = cpu("kvroute") {
            line += &format!(", kvroute's {:+.0} µs", filter - plain);
        }
        line += ";";
    }
    let smg = get("smg");
    let ratio = |ours: Option<f64>, theirs: Option<f64>| {
        ours.zip(theirs)
            .map_or("?".to_string(), |(a, b)| format!("{:.2}", a / b))
    };
    line += &format!(
        " added p50 / smg's hop = {}, added p99 / smg's p99 = {}",
        ratio(row.added_p50_us, smg.and_then(|s| s.added_p50_us)),
        ratio(row.added_p99_us, smg.and_then(|s| s.added_p99_us)),
    );
    Some(line)
}
