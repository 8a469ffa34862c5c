//! The indexer's tests, one module per subject, built as one test binary.

mod common;

mod keys;
mod sglang;
mod sglang_conformance;
mod sim;
mod streams;
mod tokenizer;
mod wire;
