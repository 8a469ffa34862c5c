//! kvroute-sim: a simulated fleet of vLLM (or SGLang) replicas (OpenAI API, prefix cache, time
//! model, KV events).
//!
//! The binary (`src/main.rs`) only parses flags and starts a [`fleet::Fleet`]; everything
//! else lives here so integration tests can start replicas in-process.

// Handlers return ready-made error responses (`Result<_, Response>`) by design.
#![allow(clippy::result_large_err)]

pub mod api;
pub mod bpe;
pub mod chat_template;
pub mod cli;
pub mod control;
pub mod engine;
pub mod fleet;
pub mod http;
pub mod kv_events;
pub mod metrics;
pub mod prefix_cache;
pub mod request;
pub mod sglang_events;
pub mod sglang_metrics;
pub mod spec;
pub mod sse;
pub mod time_model;
pub mod tokenizer;
