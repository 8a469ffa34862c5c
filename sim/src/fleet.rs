//! Starting a fleet: one HTTP listener and one KV-event publisher (with its replay socket) per
//! replica, each replica vLLM or SGLang as the spec says, plus the control port, all on
//! 127.0.0.1.

use crate::api::{self, Api};
use crate::bpe::Vocab;
use crate::control;
use crate::engine::Replica;
use crate::http::serve;
use crate::kv_events::{self, Format};
use crate::spec::{EngineKind, FleetSpec};
use kvroute::template::Templates;
use serde_json::json;
use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

pub struct ReplicaHandle {
    pub replica: Arc<Replica>,
    pub addr: SocketAddr,
    pub kv_events_addr: SocketAddr,
    /// Its replay socket's address (none when the spec turns `kv_events_replay` off).
    pub kv_events_replay_addr: Option<SocketAddr>,
}

impl ReplicaHandle {
    /// The engine it plays.
    pub fn kind(&self) -> EngineKind {
        self.replica.spec.kind(self.replica.id)
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn kv_events_endpoint(&self) -> String {
        format!("tcp://{}", self.kv_events_addr)
    }

    /// Its replay socket as a ZMQ address, as vLLM's `replay_endpoint`.
    pub fn kv_events_replay_endpoint(&self) -> Option<String> {
        self.kv_events_replay_addr.map(|a| format!("tcp://{a}"))
    }
}

pub struct Fleet {
    pub spec: Arc<FleetSpec>,
    pub replicas: Vec<ReplicaHandle>,
    pub control_addr: SocketAddr,
}

/// The chat template of the file at `path` (a Jinja file or a `tokenizer_config.json`), compiled.
fn load_template(path: &str) -> Result<Templates, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
    let mut templates = Templates::default();
    templates
        .set_default(&kvroute::template::spec_of_file(&text))
        .map_err(|e| format!("{path}: {e}"))?;
    Ok(templates)
}

fn localhost(port: u16) -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, port))
}

impl Fleet {
    /// Starts every replica and the control server. `base_port` 0 picks free ports;
    /// otherwise replica i listens on `base_port + i`. KV-event and replay ports are always free
    /// ports.
    pub async fn start(spec: FleetSpec, base_port: u16, control_port: u16) -> io::Result<Fleet> {
        spec.validate()
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        let spec = Arc::new(spec);
        let vocab = match &spec.tokenizer {
            Some(path) => Vocab::load(std::path::Path::new(path))
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?,
            None => Vocab::Hash,
        };
        let template = match &spec.chat_template {
            Some(path) => Some(Arc::new(load_template(path).map_err(|e| {
                io::Error::new(io::ErrorKind::InvalidInput, format!("chat_template: {e}"))
            })?)),
            None => None,
        };
        let mut replicas = Vec::with_capacity(spec.replicas);
        for id in 0..spec.replicas {
            let port = if base_port == 0 {
                0
            } else {
                u16::try_from(usize::from(base_port) + id).map_err(|_| {
                    io::Error::new(
                        io::ErrorKind::InvalidInput,
                        "--base-port too high for this many replicas",
                    )
                })?
            };
            let listener = TcpListener::bind(localhost(port)).await?;
            let addr = listener.local_addr()?;
            let own = Arc::new(spec.replica(id));
            let format = match own.kind(id) {
                EngineKind::Sglang => Format::Sglang,
                EngineKind::Vllm => Format::from_name(&spec.kv_events_format),
            };
            let options = kv_events::Options {
                topic: spec.kv_events_topic.clone(),
                block_size: own.block_size,
                format,
                buffer_steps: spec.kv_events_buffer_steps,
            };
            let replay = spec.kv_events_replay.then(|| localhost(0));
            let publisher = kv_events::start_publisher(localhost(0), replay, options).await?;
            let events = Some(publisher.events);
            let mut replica = Replica::with_vocab(id, own, events, vocab.clone());
            replica.template = template.clone();
            let replica = Arc::new(replica);
            tokio::spawn(mute_while_stopped(&replica, publisher.muted));
            tokio::spawn(run_listener(Api::new(replica.clone()), listener, addr));
            replicas.push(ReplicaHandle {
                replica,
                addr,
                kv_events_addr: publisher.addr,
                kv_events_replay_addr: publisher.replay,
            });
        }
        let control_listener = TcpListener::bind(localhost(control_port)).await?;
        let control_addr = control_listener.local_addr()?;
        let fleet_view: Arc<Vec<Arc<Replica>>> =
            Arc::new(replicas.iter().map(|r| r.replica.clone()).collect());
        tokio::spawn(serve(
            control_listener,
            move |req| control::handle(fleet_view.clone(), req),
            std::future::pending(),
        ));
        Ok(Fleet {
            spec,
            replicas,
            control_addr,
        })
    }

    /// The single JSON line printed once everything listens. Written by hand so the keys
    /// come in the documented order (serde_json sorts object keys).
    pub fn announcement(&self) -> String {
        let replicas: Vec<String> = self
            .replicas
            .iter()
            .map(|r| {
                format!(
                    "{{\"id\":{},\"url\":{},\"kv_events\":{},\"kv_events_replay\":{},\
                     \"engine_kind\":{}}}",
                    r.replica.id,
                    json!(r.url()),
                    json!(r.kv_events_endpoint()),
                    json!(r.kv_events_replay_endpoint()),
                    json!(r.kind().name())
                )
            })
            .collect();
        format!(
            "{{\"replicas\":[{}],\"control\":{}}}",
            replicas.join(","),
            json!(format!("http://{}", self.control_addr))
        )
    }
}

/// Keeps `muted` (the replica's replay socket answering nothing) in step with its `stopped` knob:
/// a stopped replica is an engine that is down.
fn mute_while_stopped(
    replica: &Replica,
    muted: Arc<AtomicBool>,
) -> impl std::future::Future<Output = ()> {
    let mut stopped = replica.watch_stopped();
    async move {
        loop {
            muted.store(*stopped.borrow_and_update(), Ordering::Relaxed);
            if stopped.changed().await.is_err() {
                return;
            }
        }
    }
}

/// Serves a replica; while it is `stopped` the listener is closed (connections are refused)
/// and it is bound again on the same port when the replica is started again.
async fn run_listener(api: Arc<Api>, first: TcpListener, addr: SocketAddr) {
    let mut stopped = api.replica.watch_stopped();
    let mut listener = Some(first);
    loop {
        let Some(l) = listener.take() else { return };
        let handler_api = api.clone();
        let mut watch = stopped.clone();
        serve(
            l,
            move |req| api::handle(handler_api.clone(), req),
            async move {
                let _ = watch.wait_for(|s| *s).await;
            },
        )
        .await;
        if stopped.wait_for(|s| !*s).await.is_err() {
            return;
        }
        for _ in 0..100 {
            match TcpListener::bind(addr).await {
                Ok(l) => {
                    listener = Some(l);
                    break;
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
        if listener.is_none() {
            eprintln!(
                "kvroute-sim: replica {} could not listen on {addr} again",
                api.replica.id
            );
        }
    }
}
