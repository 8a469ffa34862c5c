//! The integration tests, one module per subject, built as one test binary: each starts a real
//! Envoy with the built `.wasm` in front of real backends on 127.0.0.1 (or checks a file the
//! repository ships). One binary links the harness once, not once per subject.
#![cfg(not(target_arch = "wasm32"))]

mod common;

mod affinity_capacity;
mod client_header;
mod config_errors;
mod dashboard;
mod engine_dead_under_load;
mod engine_evictions;
mod engine_load;
mod engine_usage;
mod expect_continue;
mod fail_reload;
mod failover;
mod freshness;
mod gateways;
mod harness_smoke;
mod inflight_gauges;
mod istio_gateway;
mod istio_large_mesh;
mod layout;
mod load_balance;
mod manifests;
mod no_body_access;
mod outcome;
mod passthrough;
mod precise_end_to_end;
mod precise_gateways;
mod precise_mode;
mod precise_sglang;
mod prefix_affinity;
mod prompt_rendering;
mod readme_precise;
mod readme_results;
mod rendering_keys;
mod served_host;
mod server_errors;
mod stop_under_load;
mod suspect_mark;
mod template_conformance;
mod template_through_envoy;
mod traffic_share;
