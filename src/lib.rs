//! kvroute: KV-cache-aware routing for LLM inference fleets, as a proxy-wasm filter for Envoy.
//!
//! The routing core is plain Rust that knows nothing about the host and is tested natively:
//! [`request`] parses the OpenAI body, [`prefix`] hashes its prompt into chained chunk keys,
//! [`affinity`] remembers which endpoints hold which prefixes, [`endpoints`], [`engine`] and
//! [`counters`] say which endpoints exist and how loaded they are, [`policy`] picks one, and [`router`] runs that
//! pipeline for one request. [`store`] is the one seam to the host: Envoy's shared data in the
//! filter, a map in tests. The proxy-wasm adapter (`wasm/`) only moves bytes between Envoy and
//! this core.

pub mod affinity;
pub mod body_access;
pub mod config;
pub mod counters;
pub mod endpoints;
pub mod engine;
pub mod eviction;
pub mod freshness;
pub mod groups;
pub mod homes;
pub mod leader;
pub mod policy;
pub mod prefix;
pub mod rendezvous;
pub mod request;
pub mod retention;
pub mod router;
pub mod store;
pub mod suspects;
pub mod template;
pub mod usage;

#[cfg(all(target_arch = "wasm32", feature = "filter", not(test)))]
mod wasm;
