//! One worker: a thread that owns a [`Gateway`], as each Envoy worker owns its filter VM. It takes
//! its streams' events and its poll's answers from one inbox, in order, and ticks between them;
//! the workers share the store and the stats, as Envoy's worker VMs share shared data and stats.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

use kvroute::config::Config;
use kvroute::gateway::{Body, Exchange, Gateway, RequestHeaders, StreamApi};
use kvroute::router::Fallback;
use tokio::sync::oneshot;

use crate::host::{NativeHost, Shared};

/// What a worker is asked to do: a stream's step (each answered on its `reply`), or an answer to
/// one of its calls.
pub enum Event {
    RequestHeaders {
        stream: u64,
        headers: Vec<(String, Vec<u8>)>,
        end_of_stream: bool,
        reply: oneshot::Sender<RequestHeaders>,
    },
    /// A request body chunk; the body so far is `size` bytes, and `body` holds it all at its end.
    RequestBody {
        stream: u64,
        size: usize,
        end: bool,
        body: Vec<u8>,
        /// The subset of endpoints the request may go to, when the proxy named one.
        subset: Option<Vec<String>>,
        reply: oneshot::Sender<Routing>,
    },
    /// The response's headers: the debug header's value comes back when configured.
    ResponseHeaders {
        stream: u64,
        response: Response,
        end: bool,
        reply: oneshot::Sender<Option<String>>,
    },
    /// A response body chunk of `size` bytes, of which `tail` is the end.
    ResponseBody {
        stream: u64,
        size: usize,
        tail: Vec<u8>,
        end: bool,
    },
    /// The stream is over, however it ended.
    End {
        stream: u64,
    },
    /// The answer to the worker's call `token`.
    Answer {
        token: u32,
        status: Option<u16>,
        body: Option<Vec<u8>>,
    },
    Stop,
}

/// What became of a request body chunk.
#[derive(Debug, PartialEq, Eq)]
pub struct Routing {
    pub body: Body,
    /// The routing header's value (the pick, then its fallbacks) once routed.
    pub value: Option<String>,
    /// Why the request is left to the proxy's balancer, when it is.
    pub fallback: Option<Fallback>,
}

/// What the proxy says of a response.
#[derive(Debug, Default, Clone)]
pub struct Response {
    /// The endpoint that served it.
    pub served: Option<String>,
    pub status: Option<u16>,
    /// Envoy's response flags, when sent.
    pub flags: u64,
}

/// One stream as the gateway reads it: what the proxy has said of it so far.
#[derive(Default)]
struct View {
    cluster: Option<String>,
    headers: Vec<(String, String)>,
    response: Response,
    tail: Vec<u8>,
}

impl StreamApi for View {
    fn route_cluster(&self) -> Option<String> {
        self.cluster.clone()
    }

    fn request_header(&self, name: &str) -> Option<String> {
        let found = self
            .headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name));
        found.map(|(_, v)| v.clone())
    }

    fn upstream_address(&self) -> Option<String> {
        self.response.served.clone()
    }

    fn response_status(&self) -> Option<u16> {
        self.response.status
    }

    fn response_flags(&self) -> u64 {
        self.response.flags
    }

    fn response_body_end(&self, _size: usize, len: usize) -> Option<Vec<u8>> {
        Some(self.tail[self.tail.len().saturating_sub(len)..].to_vec())
    }
}

struct Open {
    exchange: Exchange,
    view: View,
}

/// A worker's state, driven one event at a time (by its thread, or directly by a test).
pub struct Worker {
    gateway: Gateway<NativeHost>,
    /// The cluster every request of this process is routed in: the pool's.
    cluster: Option<String>,
    streams: HashMap<u64, Open>,
    /// The current tick period (0 before the first tick).
    tick_ms: u64,
}

impl Worker {
    pub fn new(config: Config, host: NativeHost, cluster: Option<String>) -> Worker {
        Worker {
            gateway: Gateway::new(config, host),
            cluster,
            streams: HashMap::new(),
            tick_ms: 0,
        }
    }

    /// The gateway's periodic work; returns when it wants the next.
    pub fn tick(&mut self) -> Duration {
        self.gateway.tick(self.tick_ms);
        self.tick_ms = self.gateway.tick_period().max(1);
        Duration::from_millis(self.tick_ms)
    }

    /// Handles one event; `false` on [`Event::Stop`].
    pub fn handle(&mut self, event: Event) -> bool {
        let gw = &mut self.gateway;
        match event {
            Event::RequestHeaders {
                stream,
                headers,
                end_of_stream,
                reply,
            } => {
                let mut open = Open {
                    exchange: Exchange::default(),
                    view: View {
                        cluster: self.cluster.clone(),
                        headers: headers
                            .iter()
                            .map(|(n, v)| (n.clone(), String::from_utf8_lossy(v).into_owned()))
                            .collect(),
                        ..View::default()
                    },
                };
                let verdict = gw.on_request_headers(&mut open.exchange, &headers, end_of_stream);
                self.streams.insert(stream, open);
                let _ = reply.send(verdict);
            }
            Event::RequestBody {
                stream,
                size,
                end,
                body,
                subset,
                reply,
            } => {
                let routing = match self.streams.get_mut(&stream) {
                    Some(open) => route(gw, open, size, end, &body, subset),
                    None => Routing {
                        body: Body::Continue,
                        value: None,
                        fallback: None,
                    },
                };
                let _ = reply.send(routing);
            }
            Event::ResponseHeaders {
                stream,
                response,
                end,
                reply,
            } => {
                let debug = self.streams.get_mut(&stream).and_then(|open| {
                    open.view.response = response;
                    gw.on_response_headers(&mut open.exchange, end, &open.view)
                        .map(str::to_string)
                });
                let _ = reply.send(debug);
            }
            Event::ResponseBody {
                stream,
                size,
                tail,
                end,
            } => {
                if let Some(open) = self.streams.get_mut(&stream) {
                    open.view.tail = tail;
                    gw.on_response_body(&mut open.exchange, size, end, &open.view);
                }
            }
            Event::End { stream } => {
                if let Some(mut open) = self.streams.remove(&stream) {
                    gw.on_end(&mut open.exchange, &open.view);
                }
            }
            Event::Answer {
                token,
                status,
                body,
            } => gw.on_poll_answer(token, status, body),
            Event::Stop => return false,
        }
        true
    }
}

/// A request body chunk through the gateway: routed once the body is complete.
fn route(
    gw: &mut Gateway<NativeHost>,
    open: &mut Open,
    size: usize,
    end: bool,
    body: &[u8],
    subset: Option<Vec<String>>,
) -> Routing {
    let verdict = gw.on_request_body(&mut open.exchange, size, end);
    let value = match verdict {
        Body::Route => {
            if let Some(subset) = subset {
                open.exchange.restrict_to(subset);
            }
            gw.route(&mut open.exchange, body, &open.view)
        }
        Body::Continue | Body::Wait => None,
    };
    Routing {
        body: verdict,
        value,
        fallback: open.exchange.fallback(),
    }
}

/// The process's workers: each stream is handed to one, in turn, for its whole life.
pub struct Workers {
    inboxes: Vec<Sender<Event>>,
    next: AtomicUsize,
}

impl Workers {
    /// Starts `n` worker threads, each with its own gateway for `config` over `shared`.
    pub fn start(
        n: usize,
        config: &Config,
        shared: &Shared,
        cluster: Option<String>,
    ) -> std::io::Result<Workers> {
        let mut inboxes = Vec::with_capacity(n);
        for i in 0..n.max(1) {
            let (inbox, events) = mpsc::channel();
            let host = NativeHost::new(shared.clone(), inbox.clone());
            let (config, cluster) = (config.clone(), cluster.clone());
            // Built in its thread: the gateway's policy is not `Send`, and needs not be.
            std::thread::Builder::new()
                .name(format!("kvroute-worker-{i}"))
                .spawn(move || run(Worker::new(config, host, cluster), events))?;
            inboxes.push(inbox);
        }
        Ok(Workers {
            inboxes,
            next: AtomicUsize::new(0),
        })
    }

    /// The inbox of the worker the next stream goes to.
    pub fn next(&self) -> Sender<Event> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.inboxes.len();
        self.inboxes[i].clone()
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        for inbox in &self.inboxes {
            let _ = inbox.send(Event::Stop);
        }
    }
}

/// A worker thread: ticks when due, handles events in between.
fn run(mut worker: Worker, events: Receiver<Event>) {
    let mut next_tick = Instant::now();
    loop {
        if Instant::now() >= next_tick {
            next_tick = Instant::now() + worker.tick();
        }
        match events.recv_timeout(next_tick.saturating_duration_since(Instant::now())) {
            Ok(event) => {
                if !worker.handle(event) {
                    return;
                }
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return,
        }
    }
}
