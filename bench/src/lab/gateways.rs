//! kvroute in the lab: N gateways (each an Envoy with W workers, each worker a real
//! [`Gateway`] over the gateway's one shared-data store), and the part Envoy plays around them:
//! the headers a request arrives with, the override header's first address or round robin, the
//! response's headers and usage, and the answers to the workers' polls.

use super::fleet::Fleet;
use super::host::{Call, LabHost, LabStream};
use super::index::LabIndex;
use kvroute::gateway::{Body, Exchange, Gateway};
use kvroute::store::MemoryStore;
use serde_json::{json, Value};
use std::cell::Cell;
use std::rc::Rc;
use std::time::Duration;

/// Where the lab's clock starts, in the gateways' milliseconds (any fixed Unix time).
const EPOCH_MS: u64 = 1_790_000_000_000;
/// The route's cluster: the engines behind override_host.
const POOL: &str = "inference_pool";

/// One gateway: its workers, their clock, and what its Envoy counts per replica.
pub struct LabGateway {
    pub workers: Vec<Gateway<LabHost>>,
    now: Rc<Cell<u64>>,
    /// Requests this Envoy has open at each replica (its admin's `rq_active`).
    pub active: Vec<u64>,
    /// Envoy's round robin for requests kvroute leaves to it.
    rr: usize,
    /// The worker the next request's connection lands on.
    next_worker: usize,
}

/// A request kvroute has in hand: its worker, exchange and stream.
pub struct Held {
    pub worker: usize,
    pub exchange: Exchange,
    pub stream: LabStream,
    /// The debug header's value: kvroute's decision.
    pub decision: Option<String>,
}

impl LabGateway {
    /// A gateway of `workers` workers configured by `config` (the plugin configuration's JSON).
    pub fn new(config: &str, workers: usize, replicas: usize) -> Result<LabGateway, String> {
        let store = Rc::new(MemoryStore::new());
        let now = Rc::new(Cell::new(EPOCH_MS));
        let header = kvroute::config::Config::parse(config.as_bytes())
            .map_err(|e| e.to_string())?
            .header;
        let workers = (0..workers)
            .map(|_| {
                let host = LabHost::new(store.clone(), now.clone(), &header);
                Gateway::configure(config.as_bytes(), host)
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(LabGateway {
            workers,
            now,
            active: vec![0; replicas],
            rr: 0,
            next_worker: 0,
        })
    }

    /// Sets the gateway's clock to the lab's `now`.
    pub fn set_clock(&self, now: Duration) {
        self.now.set(EPOCH_MS + now.as_millis() as u64);
    }

    /// Routes a request arriving now: the replica Envoy sends it to, and what kvroute holds of it.
    pub fn route(
        &mut self,
        path: &str,
        raw: &[u8],
        session: Option<&str>,
        id: u64,
        fleet: &Fleet,
    ) -> (usize, Held) {
        let w = self.next_worker;
        self.next_worker = (w + 1) % self.workers.len();
        let mut headers = vec![
            (":method".to_owned(), "POST".to_owned()),
            (":path".to_owned(), path.to_owned()),
            ("content-type".to_owned(), "application/json".to_owned()),
            ("content-length".to_owned(), raw.len().to_string()),
            ("x-request-id".to_owned(), format!("lab-{id}")),
        ];
        if let Some(user) = session {
            headers.push((crate::workload::SESSION_HEADER.to_owned(), user.to_owned()));
        }
        let stream = LabStream {
            cluster: Some(POOL.to_owned()),
            headers: headers.clone(),
            ..LabStream::default()
        };
        let gw = &mut self.workers[w];
        let mut ex = Exchange::default();
        let verdict = gw.on_request_headers(&mut ex, &headers, false);
        let mut value = None;
        if verdict.buffer && gw.on_request_body(&mut ex, raw.len(), true) == Body::Route {
            value = gw.route(&mut ex, raw, &stream);
        }
        let chosen = value
            .as_deref()
            .and_then(|v| v.split(',').next())
            .and_then(|addr| fleet.index_of(addr.trim()));
        let target = chosen.unwrap_or_else(|| {
            self.rr = (self.rr + 1) % fleet.addrs.len();
            self.rr
        });
        let held = Held {
            worker: w,
            exchange: ex,
            stream,
            decision: None,
        };
        (target, held)
    }

    /// The response's headers came from replica `addr` with `status`.
    pub fn answered(&mut self, held: &mut Held, addr: &str, status: u16) {
        held.stream.upstream = Some(addr.to_owned());
        held.stream.status = Some(status);
        let gw = &mut self.workers[held.worker];
        let decision = gw.on_response_headers(&mut held.exchange, false, &held.stream);
        held.decision = decision.map(str::to_owned);
    }

    /// The response's first chunk `first` came: the first token, its prefill done.
    pub fn first_token(&mut self, held: &mut Held, first: Vec<u8>) {
        held.stream.body = first;
        let gw = &mut self.workers[held.worker];
        let size = held.stream.body.len();
        gw.on_response_body(&mut held.exchange, size, false, &held.stream);
    }

    /// The response ended with its last chunk `last` (the usage chunk and `[DONE]`, or an error).
    pub fn ended(&mut self, held: &mut Held, last: Vec<u8>) {
        held.stream.body = last;
        let gw = &mut self.workers[held.worker];
        let size = held.stream.body.len();
        gw.on_response_body(&mut held.exchange, size, true, &held.stream);
        gw.on_end(&mut held.exchange, &held.stream);
    }
}

/// The answer to a worker's poll call, as Envoy's admin, an engine or the indexer gives it now.
pub fn answer(
    call: &Call,
    gateway: &LabGateway,
    fleet: &Fleet,
    index: Option<&mut LabIndex>,
    now: Duration,
) -> (u16, Vec<u8>) {
    if call.path.starts_with("/clusters") {
        return (200, clusters(gateway, fleet).into_bytes());
    }
    if let Some(r) = call.routed_to.as_deref().and_then(|a| fleet.index_of(a)) {
        let snapshot = fleet.cores[r].snapshot();
        let text = kvroute_sim::metrics::render(&fleet.spec, &snapshot);
        return (200, text.into_bytes());
    }
    match index {
        Some(index) if call.cluster != POOL => index.answer(now, &call.path),
        _ => (404, Vec::new()),
    }
}

/// Envoy's admin `/clusters?format=json`, as much of it as kvroute reads: the pool's hosts with
/// their `rq_active` at this Envoy.
fn clusters(gateway: &LabGateway, fleet: &Fleet) -> String {
    let hosts: Vec<Value> = fleet
        .addrs
        .iter()
        .enumerate()
        .map(|(i, addr)| {
            let (ip, port) = addr.rsplit_once(':').unwrap_or((addr, "0"));
            json!({
                "address": {"socket_address": {"address": ip, "port_value": port.parse::<u64>().unwrap_or(0)}},
                "stats": [{"name": "rq_active", "value": gateway.active[i].to_string()}],
                "health_status": {"eds_health_status": "HEALTHY"},
            })
        })
        .collect();
    json!({"cluster_statuses": [{"name": POOL, "host_statuses": hosts}]}).to_string()
}
