//! Precise mode's rows of `overhead`: `kvroute+template` (approximate mode keying the prompt as a
//! ChatML template renders it) and `kvroute-precise` (the same, also polling an indexer's change
//! feed with `index_cluster`), so `kvroute-precise − kvroute+template` is what the engine index
//! costs, the template's cost charged to neither.
//!
//! The overhead's backends publish no KV events, so the feed is the harness's [`FakeAdmin`]
//! answering what a kvroute-indexer would: first the whole index, in which one backend's engine
//! (group g's: backend g mod 4) holds every key its group's requests share (the rendered system
//! prompt's chunks, as the filter keys them), then, at every later poll, no change, as an indexer
//! answers while the engines store nothing new. Each request then takes the lookup path that
//! decides: the index's status, then its keys probed from the last back until the group's prefix
//! is found, whose holder then takes the request from the group's home. The run fails unless most of
//! `kvroute-precise`'s decisions were the engine index's (`kvroute.routed.engine`): otherwise its
//! row would not measure that path. What the feed's changes cost to apply is idle work (the
//! poll), not a request's, and is not measured here.

use std::net::SocketAddr;
use std::time::Duration;

use kvroute::config::Config;
use kvroute::gateway::stat_names::{self, Counter};
use kvroute::policy::Decision;
use kvroute::prefix::PrefixKeys;
use kvroute::request::Api;
use kvroute_bench::kvroute_stats;
use kvroute_harness::mesh::FakeAdmin;
use kvroute_harness::{Envoy, EnvoyOptions, Lb};
use serde::Serialize;
use serde_json::{json, Value};

use super::{bodies, Row, GROUPS, SIZES};

/// The two configs, in table order, after `kvroute-b`.
pub(crate) const CONFIGS: [&str; 2] = ["kvroute+template", "kvroute-precise"];

/// Plain chats rendered as ChatML (the simulator's rendering), set in both configs.
const CHATML: &str = "{% for message in messages %}<|im_start|>{{ message.role }}\n\
{{ message.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}\
<|im_start|>assistant\n{% endif %}";

/// The feed's epoch and the version of its one full answer.
const EPOCH: u64 = 1;
const VERSION: u64 = 1;
/// Least share of `kvroute-precise`'s decisions the engine index must have made.
const MIN_ENGINE_SHARE: f64 = 0.9;
/// How long Envoy may take to apply the feed's first answer.
const FIRST_POLL: Duration = Duration::from_secs(60);

/// The precise configs' Envoys and the feed they poll (kept for the run).
pub(crate) struct Started {
    pub envoys: Vec<(&'static str, Envoy)>,
    pub feed: Option<FakeAdmin>,
}

/// Starts the configs `wanted` keeps over the backends `addrs`, with `plugin_config` laid over
/// each one's own fields; `kvroute-precise` once it has applied the feed's whole index.
pub(crate) async fn start(
    addrs: &[SocketAddr],
    plugin_config: &Value,
    wanted: &dyn Fn(&str) -> bool,
) -> Result<Started, String> {
    let feed = match wanted(CONFIGS[1]) {
        true => {
            let config = plugin_config_of(CONFIGS[1], plugin_config)?;
            let feed = FakeAdmin::start(whole_index(addrs, &config)?)
                .await
                .map_err(|e| format!("{}: feed: {e}", CONFIGS[1]))?;
            Some(feed)
        }
        false => None,
    };
    let mut envoys = Vec::new();
    for name in CONFIGS.into_iter().filter(|n| wanted(n)) {
        let feed_here = feed.as_ref().filter(|_| name == CONFIGS[1]);
        let envoy = Envoy::start(EnvoyOptions {
            backends: addrs.to_vec(),
            lb: Lb::Kvroute {
                plugin_config: plugin_config_of(name, plugin_config)?,
            },
            indexer: feed_here.map(FakeAdmin::addr),
            ..EnvoyOptions::default()
        })
        .await
        .map_err(|e| format!("{name}: {e}"))?;
        if let Some(feed) = feed_here {
            envoy
                .wait_for_stat(Counter::IndexPollOk.name(), |n| n >= 1, FIRST_POLL)
                .await
                .map_err(|e| format!("{name}: the feed's first answer: {e}"))?;
            feed.answer(200, no_change(addrs));
        }
        envoys.push((name, envoy));
    }
    Ok(Started { envoys, feed })
}

/// `name`'s plugin config: `plugin_config` with the template, and for `kvroute-precise` the
/// indexer's cluster.
fn plugin_config_of(name: &str, plugin_config: &Value) -> Result<Value, String> {
    let mut config = plugin_config.clone();
    let fields = config
        .as_object_mut()
        .ok_or("--plugin-config: must be a JSON object")?;
    fields.insert("chat_template".into(), CHATML.into());
    if name == "kvroute-precise" {
        fields.insert(
            "index_cluster".into(),
            kvroute_harness::bootstrap::INDEXER_CLUSTER.into(),
        );
    }
    Ok(config)
}

/// The feed's whole index: group g's shared keys, at both prompt sizes, held by backend g mod n.
fn whole_index(addrs: &[SocketAddr], plugin_config: &Value) -> Result<String, String> {
    let config = Config::parse(plugin_config.to_string().as_bytes())
        .map_err(|e| format!("kvroute-precise: plugin config: {e}"))?;
    let mut changes = Vec::new();
    for size in SIZES {
        for (group, keys) in group_prefixes(&config, &bodies(size))?.iter().enumerate() {
            let at = group % addrs.len().max(1);
            changes.extend(keys.iter().map(|k| json!([at, 1, k])));
        }
    }
    Ok(answer(addrs, true, changes))
}

/// A later answer: nothing changed since the whole index.
fn no_change(addrs: &[SocketAddr]) -> String {
    answer(addrs, false, Vec::new())
}

fn answer(addrs: &[SocketAddr], full: bool, changes: Vec<Value>) -> String {
    let endpoints: Vec<String> = addrs.iter().map(SocketAddr::to_string).collect();
    json!({"epoch": EPOCH, "version": VERSION, "full": full, "endpoints": endpoints,
           "stale": [], "changes": changes})
    .to_string()
}

/// For each group, the keys all its bodies share (its system prompt's whole chunks), computed as
/// the filter computes them under `config` (template, chunk size).
fn group_prefixes(config: &Config, bodies: &[String]) -> Result<Vec<Vec<u64>>, String> {
    let mut shared: Vec<Option<Vec<u64>>> = vec![None; GROUPS];
    for (i, body) in bodies.iter().enumerate() {
        let prompt = config
            .templates
            .parse(Api::Chat, body.as_bytes(), config.tools_position)
            .prompt
            .map_err(|e| format!("body {i}: not parsed: {e:?}"))?;
        let keys = PrefixKeys::of(&prompt, config.shape()).keys;
        let group = &mut shared[i % GROUPS];
        *group = Some(match group.take() {
            None => keys,
            Some(so_far) => so_far
                .into_iter()
                .zip(keys)
                .take_while(|(a, b)| a == b)
                .map(|(a, _)| a)
                .collect(),
        });
    }
    Ok(shared.into_iter().map(Option::unwrap_or_default).collect())
}

/// What `kvroute-precise` decided during the run.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Decisions {
    /// Requests routed, and of them those the engine index decided.
    pub routed: u64,
    pub engine: u64,
    /// The index's nonzero `kvroute.index.*` counters.
    pub index: Vec<(String, u64)>,
}

/// Prints each kvroute config's decisions during the run (`envoys`: by name), and returns
/// `kvroute-precise`'s.
pub(crate) async fn print_decisions<'a>(
    envoys: impl Iterator<Item = (&'a str, &'a Envoy)>,
) -> Result<Option<Decisions>, String> {
    let mut precise = None;
    for (name, envoy) in envoys {
        let stats = |prefix: String| async move {
            let stats = envoy.stats(&prefix).await.map_err(|e| e.to_string())?;
            let mut stats: Vec<(String, u64)> = stats.into_iter().filter(|(_, v)| *v > 0).collect();
            stats.sort();
            Ok::<_, String>(stats)
        };
        let routed = stats(kvroute_stats::routed().to_string()).await?;
        if name != CONFIGS[1] {
            println!("{name} decisions during the run: {routed:?}");
            continue;
        }
        let d = Decisions {
            routed: routed.iter().map(|(_, v)| v).sum(),
            engine: routed
                .iter()
                .filter(|(k, _)| k.ends_with(&stat_names::routed(Decision::Engine)))
                .map(|(_, v)| v)
                .sum(),
            index: stats(kvroute_stats::index().to_string()).await?,
        };
        println!(
            "{name}: the engine index decided {} of {} requests; index stats {:?}",
            d.engine, d.routed, d.index
        );
        precise = Some(d);
    }
    Ok(precise)
}

/// An error when the engine index made too few of `kvroute-precise`'s decisions for its row to
/// measure the lookup that decides.
pub(crate) fn check(d: &Decisions) -> Result<(), String> {
    let share = d.engine as f64 / d.routed.max(1) as f64;
    if share < MIN_ENGINE_SHARE {
        return Err(format!(
            "kvroute-precise: the engine index decided {} of {} requests ({share:.2}, under \
             {MIN_ENGINE_SHARE}): its row does not measure precise mode; index stats {:?}",
            d.engine, d.routed, d.index
        ));
    }
    Ok(())
}

/// The line precise mode's cost target is stated in, per prompt size: `kvroute-precise`'s CPU per
/// request over `kvroute+template`'s.
pub(crate) fn ratio_line(rows: &[Row], size: usize) -> Option<String> {
    let cpu = |config: &str| {
        rows.iter()
            .find(|r| r.config == config && r.prompt_bytes == size)?
            .cpu_us_per_request
    };
    let (precise, template) = (cpu(CONFIGS[1]), cpu(CONFIGS[0]));
    let (p, t) = precise.zip(template)?;
    Some(format!(
        "{} KB: kvroute-precise − kvroute+template: CPU/request {:+.0} µs, ratio {:.3}",
        size / 1024,
        p - t,
        p / t
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_group_shares_a_prefix_deep_enough_for_an_engine_decision() {
        let config = plugin_config_of("kvroute-precise", &json!({})).unwrap();
        let config = Config::parse(config.to_string().as_bytes()).unwrap();
        for size in SIZES {
            let bodies = bodies(size);
            let prefixes = group_prefixes(&config, &bodies).unwrap();
            for (i, body) in bodies.iter().enumerate() {
                let prompt = config
                    .templates
                    .parse(Api::Chat, body.as_bytes(), config.tools_position)
                    .prompt
                    .unwrap();
                assert!(prompt.text.starts_with(b"<|im_start|>system\n"), "rendered");
                let all = PrefixKeys::new(
                    &prompt.model,
                    &prompt.text,
                    prompt.head,
                    false,
                    config.shape(),
                )
                .keys;
                let held = &prefixes[i % GROUPS];
                assert!(!held.is_empty() && all.starts_with(held));
                assert!(held.len() < all.len(), "the question is the request's own");
                assert!(
                    held.len() as f64 >= config.cache_threshold * all.len() as f64,
                    "{size} B, body {i}: {} of {} keys held",
                    held.len(),
                    all.len()
                );
            }
        }
    }
}
