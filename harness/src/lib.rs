//! kvroute-harness: run a real Envoy (with or without kvroute) in front of real HTTP backends on 127.0.0.1.
//!
//! The integration tests and the benchmark both use it:
//!
//! ```no_run
//! # async fn demo() -> Result<(), kvroute_harness::HarnessError> {
//! use kvroute_harness::{backend::Backend, Envoy, EnvoyOptions, Lb};
//! let backends = Backend::start_many(4).await?;
//! let envoy = Envoy::start(EnvoyOptions {
//!     backends: backends.iter().map(Backend::addr).collect(),
//!     lb: Lb::Kvroute { plugin_config: serde_json::json!({ "debug_header": true }) },
//!     ..EnvoyOptions::default()
//! })
//! .await?;
//! let url = format!("{}/v1/chat/completions", envoy.url());
//! # let _ = url; Ok(()) }
//! ```
//!
//! Envoy is started from the shipped `envoy/kvroute.yaml`, patched (ports, endpoints, wasm path,
//! plugin config, load-balancing policy), so a passing test also proves the shipped config works;
//! [`epp::start`] starts one from the shipped `envoy/kvroute-epp.yaml`, asking kvroute-epp.

pub mod backend;
pub mod bootstrap;
pub mod cpu;
mod envoy;
pub mod epp;
mod error;
pub mod gate;
pub mod mesh;
pub mod paths;
pub mod precise;
pub mod vllm;

pub use envoy::{Envoy, EnvoyOptions, Lb};
pub use error::HarnessError;
