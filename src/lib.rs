//! kvroute: KV-cache-aware routing for LLM inference fleets, as a proxy-wasm filter for Envoy.
//!
//! The routing core is plain Rust that knows nothing about the host and is tested natively:
//! [`request`] parses the OpenAI body, [`prefix`] hashes its prompt into chained chunk keys,
//! [`holders`] says which endpoints hold which prefixes, [`hosts`], [`engine_load`] and
//! [`in_flight`] say which endpoints exist and how loaded they are, [`prefill`] what a request
//! waits there for its first token, [`policy`] picks one, and
//! [`router`] runs that pipeline for one request. [`gateway`] is a worker's whole routing core
//! behind one entry type (its tick, the poll's answers, each request from its headers to its
//! end) over a small host trait: Envoy's shared data, clock, stats and HTTP calls in the filter,
//! in-memory ones in tests. The proxy-wasm adapter (`wasm/`) only turns Envoy's callbacks into
//! the gateway's calls.

pub mod body_access;
pub mod config;
pub mod engine_load;
pub mod eviction;
pub mod freshness;
pub mod gateway;
pub mod holders;
pub mod hosts;
pub mod in_flight;
pub mod placement;
pub mod policy;
pub mod prefill;
pub mod prefix;
pub mod rendezvous;
pub mod request;
pub mod retention;
pub mod router;
pub mod shared_keys;
pub mod store;
pub mod suspects;
pub mod template;
pub mod usage;

#[cfg(all(target_arch = "wasm32", feature = "filter", not(test)))]
mod wasm;
