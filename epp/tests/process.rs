//! kvroute-epp as a process and a server: a config error stops it at load naming the field, its
//! default config is the one the filter ships, and it answers gRPC health (liveness, readiness,
//! the ext_proc service) and serves its stats on `/metrics`.

use crate::common;

use std::process::Command;

use kvroute::config::Config;
use kvroute_epp::settings::DEFAULT_CONFIG;
use kvroute_harness::{bootstrap, paths};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

/// Runs the binary with a config file holding `json`; its exit code and standard error.
fn run_with_config(json: &str) -> (Option<i32>, String) {
    let file = std::env::temp_dir().join(format!("kvroute-epp-config-{}.json", std::process::id()));
    std::fs::write(&file, json).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_kvroute-epp"))
        .args([
            "--listen",
            "127.0.0.1:0",
            "--endpoints",
            "127.0.0.1:8001",
            "--config",
        ])
        .arg(&file)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&file);
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_bad_config_stops_it_at_load_naming_the_field() {
    for (json, field) in [
        (r#"{"chunk_size": 3}"#, "chunk_size"),
        (r#"{"policy": "fastest"}"#, "policy"),
        (r#"{"no_such_field": 1}"#, "no_such_field"),
    ] {
        let (code, stderr) = run_with_config(json);
        assert_eq!(code, Some(2), "{json}: {stderr}");
        assert!(
            stderr.contains(&format!("field `{field}`")),
            "{json}: {stderr}"
        );
    }
    let (code, stderr) = run_with_config(r#"{"admin_cluster": null, "index_cluster": "idx"}"#);
    assert_eq!(code, Some(2), "{stderr}");
}

#[test]
fn its_default_config_is_the_one_envoy_kvroute_yaml_gives_the_filter() {
    let shipped = std::fs::read_to_string(paths::shipped_bootstrap()).unwrap();
    let filters = bootstrap::shipped_plugin_config(&shipped).unwrap();
    assert_eq!(
        Config::parse(DEFAULT_CONFIG.as_bytes()).unwrap(),
        Config::parse(filters.as_bytes()).unwrap()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn it_answers_grpc_health_and_serves_its_stats() {
    let epp = common::start_epp(&["127.0.0.1:8001".parse().unwrap()], DEFAULT_CONFIG, false).await;
    common::wait_ready(&epp).await;
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", epp.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel);
    for service in [
        "liveness",
        "readiness",
        "envoy.service.ext_proc.v3.ExternalProcessor",
    ] {
        // Readiness follows the first poll's publication by one short wait.
        let mut status = ServingStatus::Unknown;
        for _ in 0..200 {
            let request = HealthCheckRequest {
                service: service.to_string(),
            };
            status = health.check(request).await.unwrap().into_inner().status();
            if status == ServingStatus::Serving {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        assert_eq!(status, ServingStatus::Serving, "{service}");
    }
    let metrics = reqwest::get(format!("http://{}/metrics", epp.metrics_addr.unwrap()))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("# TYPE kvroute_stats_poll_ok counter"),
        "{metrics}"
    );
    assert!(metrics.contains("kvroute_fallback_bad_json 0"), "{metrics}");
}
