//! The one error type of the harness: every failure says what to do about it.

use std::fmt;

/// Why the harness could not start or talk to Envoy or a backend.
#[derive(Debug)]
pub enum HarnessError {
    /// A binary or file the harness needs is missing; the message says how to get it.
    Missing(String),
    /// The shipped bootstrap no longer has the shape the harness patches.
    Config(String),
    /// Envoy exited or did not become ready in time; carries the tail of its log.
    Envoy { what: String, log_tail: String },
    /// Plain I/O failure (temp files, sockets, spawning).
    Io(std::io::Error),
    /// An admin request failed.
    Http(String),
    /// A real engine (vLLM) exited, or did not serve in time; carries the tail of its log.
    Engine { what: String, log_tail: String },
}

impl fmt::Display for HarnessError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HarnessError::Missing(m) => write!(f, "{m}"),
            HarnessError::Config(m) => write!(f, "bootstrap patching failed: {m}"),
            HarnessError::Envoy { what, log_tail } => {
                write!(f, "envoy: {what}\n--- envoy log tail ---\n{log_tail}")
            }
            HarnessError::Io(e) => write!(f, "i/o error: {e}"),
            HarnessError::Http(m) => write!(f, "admin request failed: {m}"),
            HarnessError::Engine { what, log_tail } => {
                write!(f, "engine: {what}\n--- engine log tail ---\n{log_tail}")
            }
        }
    }
}

impl std::error::Error for HarnessError {}

impl From<std::io::Error> for HarnessError {
    fn from(e: std::io::Error) -> Self {
        HarnessError::Io(e)
    }
}

impl From<reqwest::Error> for HarnessError {
    fn from(e: reqwest::Error) -> Self {
        HarnessError::Http(e.to_string())
    }
}
