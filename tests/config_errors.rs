//! A bad plugin configuration stops Envoy at load, with a log line that names the field; a good
//! one starts, and kvroute runs with it.

use crate::common;

use kvroute_harness::{backend::Backend, Envoy, EnvoyOptions, HarnessError, Lb};
use serde_json::json;

async fn start_with(plugin_config: serde_json::Value) -> Result<Envoy, HarnessError> {
    let backends = Backend::start_many(1).await.expect("backend");
    Envoy::start(EnvoyOptions {
        backends: backends.iter().map(Backend::addr).collect(),
        lb: Lb::Kvroute { plugin_config },
        concurrency: 1,
        ..EnvoyOptions::default()
    })
    .await
}

#[tokio::test]
async fn an_invalid_field_fails_the_plugin_at_load_naming_the_field() {
    for (config, field) in [
        (json!({ "chunk_size": 0 }), "chunk_size"),
        (json!({ "policy": "fastest" }), "policy"),
        (json!({ "cache_treshold": 0.5 }), "cache_treshold"),
    ] {
        match start_with(config.clone()).await {
            Ok(_) => panic!("Envoy started with {config}"),
            Err(HarnessError::Envoy { log_tail, .. }) => assert!(
                log_tail.contains(&format!("invalid kvroute config: field `{field}`")),
                "the log does not name `{field}`:\n{log_tail}"
            ),
            Err(other) => panic!("unexpected failure for {config}: {other}"),
        }
    }
}

/// Envoy starts, and kvroute with it, on the configuration given: it routes by the policy the
/// configuration names, not the shipped one's.
#[tokio::test]
async fn a_valid_configuration_starts() {
    let backends = Backend::start_many(1).await.expect("backend");
    let config = json!({ "chunk_size": 64, "policy": "prefix_hash", "debug_header": true,
                         "stats_interval_ms": 200 });
    let addrs = backends.iter().map(Backend::addr).collect();
    let envoy = common::kvroute_envoy_with(addrs, config, |o| o.concurrency = 1).await;
    // The worker re-reads the poller's snapshot on its own tick.
    common::wait_for_fresh_poll_of(&envoy).await;
    let body = common::chat_body(&common::system_prompt(0), "q", false);
    let (decision, _) = common::decided(&envoy, &body).await;
    assert_eq!(decision, "prefix_hash", "{}", envoy.log_tail());
}
