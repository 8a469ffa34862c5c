//! kvroute-epp: kvroute as a Gateway API Inference Extension endpoint picker. Envoy (or any
//! gateway that speaks the protocol) asks it over ext_proc where each request goes; the answer
//! comes from the same routing core as the filter's, [`kvroute::gateway::Gateway`], here with a
//! native host: one gateway per worker thread (`worker`), sharing a thread-safe store (`store`)
//! and the process's stats (`stats`), its polls sent natively (`host`, `upstreams`). `extproc`
//! translates one ext_proc stream into the gateway's calls, `service` serves it with gRPC health,
//! `settings` reads the command line and the filter's config, `metrics_http` serves `/metrics`,
//! `pool_watch` keeps the pool an InferencePool's pods.

pub mod extproc;
pub mod host;
pub mod metrics_http;
pub mod pool_watch;
pub mod service;
pub mod settings;
pub mod stats;
pub mod store;
pub mod upstreams;
pub mod worker;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
use kvroute::shared_keys;
use kvroute::store::SharedStore;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::transport::server::TcpIncoming;
use tonic_health::ServingStatus;

use host::Shared;
use service::{Picker, LIVENESS, READINESS};
use settings::Settings;
use stats::Stats;
use store::SyncStore;
use upstreams::Pool;
use worker::Workers;

/// A running picker; stops when dropped.
pub struct Running {
    /// Where the gRPC server listens.
    pub addr: SocketAddr,
    /// Where `/metrics` is served, when asked for.
    pub metrics_addr: Option<SocketAddr>,
    pub stats: Arc<Stats>,
    pub store: Arc<SyncStore>,
    /// The endpoints it picks from, when given as a list or an InferencePool.
    pub pool: Option<Arc<Pool>>,
    stop: Option<oneshot::Sender<()>>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// Starts the picker on the current tokio runtime: its workers, the gRPC server (ext_proc and
/// health) and, when asked, `/metrics`.
pub async fn start(settings: Settings) -> Result<Running, String> {
    let Settings {
        args,
        config,
        upstreams,
        pool,
        inference_pool,
        index,
        options,
    } = settings;
    let store = Arc::new(SyncStore::new());
    let stats = Arc::new(Stats::default());
    let shared = Shared {
        store: store.clone(),
        stats: stats.clone(),
        clock: host::system_clock(),
        upstreams: Arc::new(upstreams),
        runtime: tokio::runtime::Handle::current(),
    };
    let n = args
        .workers
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let cluster = Some(args.pool.clone());
    let workers = Workers::start(n, &config, &shared, cluster)
        .map_err(|e| format!("cannot start the workers: {e}"))?;
    let picker = Picker::new(Arc::new(workers), options);

    let listener = TcpListener::bind(args.listen)
        .await
        .map_err(|e| format!("cannot listen on --listen {}: {e}", args.listen))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let mut tasks = Vec::new();
    if let Some((index, events)) = &index {
        kvroute_indexer::subscribe(index, events)?;
    }
    if let (Some(source), Some(pool)) = (inference_pool, &pool) {
        let api = match source.api.clone() {
            Some(api) => api,
            None => kube::Config::infer()
                .await
                .map_err(|e| format!("--inference-pool: no Kubernetes API to ask: {e}"))?,
        };
        let client = kube::Client::try_from(api)
            .map_err(|e| format!("--inference-pool: the Kubernetes API client: {e}"))?;
        tasks.push(tokio::spawn(pool_watch::run(client, source, pool.clone())));
    }
    let metrics_addr = match args.metrics {
        Some(at) => {
            let listener = TcpListener::bind(at)
                .await
                .map_err(|e| format!("cannot listen on --metrics {at}: {e}"))?;
            let local = listener.local_addr().map_err(|e| e.to_string())?;
            let index = index.as_ref().map(|(index, _)| index.clone());
            tasks.push(tokio::spawn(metrics_http::serve(
                listener,
                stats.clone(),
                index,
            )));
            Some(local)
        }
        None => None,
    };

    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_service_status(LIVENESS, ServingStatus::Serving)
        .await;
    health
        .set_service_status(READINESS, ServingStatus::NotServing)
        .await;
    health
        .set_not_serving::<ExternalProcessorServer<Picker>>()
        .await;
    // Ready once the gateway knows its endpoints: a static list at once, else the first poll
    // (with an InferencePool, the first after its pods are listed: a pool not yet listed
    // answers no poll, `Upstreams::knows`).
    let static_endpoints = !config.endpoints.is_empty();
    let ready_store = store.clone();
    tasks.push(tokio::spawn(async move {
        while !static_endpoints && ready_store.get(shared_keys::HOSTS).1.is_none() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        health
            .set_service_status(READINESS, ServingStatus::Serving)
            .await;
        health
            .set_serving::<ExternalProcessorServer<Picker>>()
            .await;
    }));

    let (stop, stopped) = oneshot::channel::<()>();
    // Each answer is a few small HTTP/2 frames: with Nagle's algorithm on (tonic sets
    // TCP_NODELAY only on the listeners it binds itself), a frame written while the previous one
    // is unacknowledged waits for the gateway's delayed ACK, some 40 ms per request.
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    let server = tonic::transport::Server::builder()
        .add_service(health_service)
        .add_service(ExternalProcessorServer::new(picker))
        .serve_with_incoming_shutdown(incoming, async {
            let _ = stopped.await;
        });
    tasks.push(tokio::spawn(async move {
        if let Err(e) = server.await {
            log::error!("the gRPC server stopped: {e}");
        }
    }));
    Ok(Running {
        addr,
        metrics_addr,
        stats,
        store,
        pool,
        stop: Some(stop),
        tasks,
    })
}
