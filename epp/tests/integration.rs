//! kvroute-epp's tests, one module per subject, built as one test binary.

mod common;

mod cross_host;
mod pool_watch;
mod precise;
mod process;
mod stream;
mod three_pickers;
mod through_envoy;
