//! A bad plugin configuration stops Envoy at load, with a log line that names the field.

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

#[tokio::test]
async fn a_valid_configuration_starts() {
    let envoy = start_with(json!({ "chunk_size": 64, "policy": "prefix_hash" })).await;
    assert!(
        envoy.is_ok(),
        "{}",
        envoy.err().map(|e| e.to_string()).unwrap_or_default()
    );
}
