//! The bench's tests, one module per subject, built as one test binary.

mod common;
mod compare_e2e;
mod lab;
mod precise_routers;
