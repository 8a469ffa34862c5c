//! kvroute-indexer: turns the engines' KV-cache events into kvroute's prefix keys and serves,
//! over HTTP, which engine holds which key.
//!
//! The binary (`src/main.rs`) parses the command line and calls [`start`]; tests start the
//! same thing in-process.

pub mod api;
pub mod chains;
pub mod config;
pub mod content_hash;
pub mod dialect;
pub mod discovery;
pub mod holders;
pub mod index;
pub mod metrics;
pub mod state;
pub mod subscriber;
pub mod token_bytes;
pub mod wire;

use config::Config;
use index::Index;
use state::Shared;
use std::net::SocketAddr;
use std::sync::Arc;
use token_bytes::TokenBytes;

/// A started indexer.
pub struct Running {
    /// Where the HTTP API listens.
    pub addr: SocketAddr,
    pub shared: Arc<Shared>,
}

/// Loads the tokenizer, subscribes to every engine and serves the API (on the current tokio
/// runtime).
pub async fn start(config: Config) -> Result<Running, String> {
    if config.chunk_size == 0 {
        return Err("--chunk-size must be at least 1".into());
    }
    let tokens = TokenBytes::load(&config.tokenizer)?;
    let staleness = config.staleness()?;
    let index = Index::new(config.chunk_size, config.feed_capacity);
    let shared = Arc::new(Shared::new(index, tokens, staleness));
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", config.listen))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    for engine in &config.engines {
        for (events, replay) in engine.ranks()? {
            let source = subscriber::Source {
                endpoint: &engine.endpoint,
                model: engine.model.as_deref().unwrap_or(&config.model),
                url: &events,
                replay: replay.as_deref(),
                dialect: engine.kind.unwrap_or(config.engine_kind),
            };
            subscriber::spawn(&shared, source, &config.topic);
        }
    }
    if let Some(admin) = &config.envoy_admin {
        tokio::spawn(discovery::run(
            shared.clone(),
            config.clone(),
            admin.clone(),
        ));
    }
    tokio::spawn(api::serve(listener, shared.clone()));
    Ok(Running { addr, shared })
}
