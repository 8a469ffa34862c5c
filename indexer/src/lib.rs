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

use config::{Config, EngineSpec, Events};
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
    let shared = index(&config.events, config.chunk_size)?;
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", config.listen))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    subscribe(&shared, &config.events)?;
    if let Some(admin) = &config.discovery.envoy_admin {
        tokio::spawn(discovery::run(
            shared.clone(),
            config.events.clone(),
            config.discovery.clone(),
            admin.clone(),
        ));
    }
    tokio::spawn(api::serve(listener, shared.clone()));
    Ok(Running { addr, shared })
}

/// An empty index of `chunk_size`-byte keys with the tokenizer `events` names loaded: what
/// [`subscribe`] fills and [`api::get`] answers from.
pub fn index(events: &Events, chunk_size: usize) -> Result<Arc<Shared>, String> {
    if chunk_size == 0 {
        return Err("--chunk-size must be at least 1".into());
    }
    let tokens = TokenBytes::load(&events.tokenizer)?;
    let staleness = events.staleness()?;
    let index = Index::new(chunk_size, events.feed_capacity);
    Ok(Arc::new(Shared::new(index, tokens, staleness)))
}

/// Subscribes `shared` to every rank of every engine `events` lists (on the current tokio
/// runtime, for as long as it runs).
pub fn subscribe(shared: &Arc<Shared>, events: &Events) -> Result<(), String> {
    events
        .engines
        .iter()
        .try_for_each(|engine| subscribe_engine(shared, events, engine))
}

/// Subscribes `shared` to every rank of `engine`, keyed for its model (else `events`'s) in its
/// dialect (else `events`'s).
pub fn subscribe_engine(
    shared: &Arc<Shared>,
    events: &Events,
    engine: &EngineSpec,
) -> Result<(), String> {
    for (url, replay) in engine.ranks()? {
        log::info!("{}: events at {url}", engine.endpoint);
        let source = subscriber::Source {
            endpoint: &engine.endpoint,
            model: engine.model.as_deref().unwrap_or(&events.model),
            url: &url,
            replay: replay.as_deref(),
            dialect: engine.kind.unwrap_or(events.engine_kind),
        };
        subscriber::spawn(shared, source, &events.topic);
    }
    Ok(())
}
