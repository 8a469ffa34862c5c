//! The simulator's tests, one module per subject, built as one test binary.

mod common;

mod api;
mod control;
mod engine_drivers;
mod kv_events;
mod sglang;
mod sockets;
