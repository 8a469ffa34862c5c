//! One request through the pipeline: parse → prefix keys → candidates → policy → count.
//!
//! Everything here is host-agnostic: the adapter hands in the body, the known hosts and the clock,
//! and gets back either the endpoints to write into the routing header or the reason it leaves the
//! request to Envoy's fallback policy.

use strum::{EnumCount, IntoStaticStr, VariantArray};
use xxhash_rust::xxh3::xxh3_64;

use crate::config::Config;
use crate::hosts::Host;
use crate::in_flight::Table;
use crate::policy::{self, Answer, Candidate, Decision, Input, Needs, Policy, Settled, Ticket};
use crate::prefill::{Expected, PrefillModel};
use crate::prefix::PrefixKeys;
use crate::request::{Api, ParseError, Prompt};
use crate::store::SharedStore;
use crate::template::Outcome;

/// Why a request is left to Envoy's fallback policy. Each is a counter
/// (`kvroute.fallback.<name>`) and a debug-header value (`fallback:<name>`); names are stable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, IntoStaticStr, VariantArray, EnumCount)]
#[strum(serialize_all = "snake_case")]
pub enum Fallback {
    Method,
    Path,
    EmptyBody,
    BodyTooLarge,
    BadJson,
    NoModel,
    NoPrompt,
    NoCluster,
    NoHealthyEndpoint,
    NoSession,
    /// Envoy never hands the body to the filter (`allow_on_headers_stop_iteration` missing):
    /// routed from headers alone.
    NoBodyAccess,
    /// The last host snapshot is older than its maximum age (the admin poll keeps failing).
    StaleHosts,
    /// No healthy endpoint's engine has answered its metrics poll lately.
    StaleEngineLoads,
}

impl Fallback {
    pub fn name(self) -> &'static str {
        self.into()
    }
}

impl From<ParseError> for Fallback {
    fn from(e: ParseError) -> Fallback {
        match e {
            ParseError::Empty => Fallback::EmptyBody,
            ParseError::BadJson => Fallback::BadJson,
            ParseError::NoModel => Fallback::NoModel,
            ParseError::NoPrompt => Fallback::NoPrompt,
        }
    }
}

/// What kvroute reads from a request's headers, given as Envoy hands them over: names (tokens,
/// which Envoy's codecs check) and values as bytes, since HTTP allows bytes 0x80-0xFF in values.
/// A method, path or length that is not text reads as absent.
#[derive(Debug, Default, PartialEq)]
pub struct HeaderFields<'a> {
    pub method: &'a str,
    pub path: &'a str,
    /// `content-length`, when the client declared one.
    pub content_length: Option<usize>,
    /// The client sent the routing header (`routing_header`, any case): it must be removed.
    pub routing_header: bool,
}

impl<'a> HeaderFields<'a> {
    pub fn read<V: AsRef<[u8]>>(
        headers: &'a [(String, V)],
        routing_header: &str,
    ) -> HeaderFields<'a> {
        let mut fields = HeaderFields::default();
        for (name, value) in headers {
            let text = || std::str::from_utf8(value.as_ref()).ok();
            match name.as_str() {
                ":method" => fields.method = text().unwrap_or_default(),
                ":path" => fields.path = text().unwrap_or_default(),
                "content-length" => {
                    fields.content_length = text().and_then(|v| v.trim().parse().ok())
                }
                n if n.eq_ignore_ascii_case(routing_header) => fields.routing_header = true,
                _ => {}
            }
        }
        fields
    }
}

/// The header-phase check: is this a request kvroute routes (and so buffers the body of)?
pub fn routable(method: &str, path: &str) -> Result<Api, Fallback> {
    if method != "POST" {
        return Err(Fallback::Method);
    }
    Api::from_path(path).ok_or(Fallback::Path)
}

/// A request as the router sees it once its body is complete.
pub struct RequestInfo<'a> {
    pub api: Api,
    pub body: &'a [u8],
    /// The value of the configured session header, if any.
    pub session: Option<&'a str>,
    /// Something unique to the request (Envoy's x-request-id), for least_request's tie-breaks.
    pub request_id: Option<&'a str>,
}

/// A routing decision.
#[derive(Debug)]
pub struct Routed {
    /// The chosen `ip:port` first, then fallbacks for retries.
    pub endpoints: Vec<String>,
    /// Id of the chosen endpoint: the caller counts the request in flight there
    /// ([`in_flight::Local`](crate::in_flight::Local)) until the stream ends.
    pub endpoint_id: u32,
    pub decision: Decision,
    /// Share of the request's chunks found in the affinity map (cache_aware only).
    pub match_fraction: Option<f64>,
    /// Affinity slots this request wrote for the first time.
    pub slots_created: usize,
    /// The request's prefix keys, and what the policy keeps of it: hand both to
    /// [`Router::answered`] with its answer.
    pub keys: Vec<u64>,
    pub ticket: Ticket,
    /// Whether the response will carry `usage` ([`Prompt::usage`](crate::request::Prompt)).
    pub usage: bool,
    /// Whether its first response byte comes with the first token
    /// ([`Prompt::streams`](crate::request::Prompt)).
    pub streams: bool,
    /// Its prefill at the chosen endpoint, as expected now.
    pub prefill: Expected,
}

/// What routing one request gave: where it goes or why it is left to Envoy, and what became of
/// its prompt under the chat templates (for the caller to count).
#[derive(Debug)]
pub struct Routing {
    pub result: Result<Routed, Fallback>,
    pub template: Option<Outcome>,
}

/// The configured pipeline: built once per VM, then used for every request.
pub struct Router {
    pub config: Config,
    policy: Box<dyn Policy>,
}

impl Router {
    pub fn new(config: Config) -> Router {
        let policy = policy::build(&config);
        Router { config, policy }
    }

    /// Routes one request whose body is complete, given the requests in flight (`inflight`, a
    /// worker's [`in_flight::Local`](crate::in_flight::Local) view), which the caller then counts
    /// the request in, and what the worker has learnt of the endpoints' prefill.
    pub fn route_with(
        &mut self,
        store: &dyn SharedStore,
        inflight: &Table,
        prefill: &PrefillModel,
        hosts: &[Host],
        req: &RequestInfo,
        now_ms: u64,
    ) -> Routing {
        let config = &self.config;
        if req.body.len() > config.max_body_bytes {
            return Routing {
                result: Err(Fallback::BodyTooLarge),
                template: None,
            };
        }
        let parsed = config
            .templates
            .parse(req.api, req.body, config.tools_position);
        let result = parsed.prompt.map_err(Fallback::from).and_then(|prompt| {
            let candidates = candidates(inflight, prefill, hosts);
            if candidates.is_empty() {
                return Err(Fallback::NoHealthyEndpoint);
            }
            if all_engines_stale(hosts) {
                return Err(Fallback::StaleEngineLoads);
            }
            self.route_among(store, &candidates, req, &prompt, now_ms)
        });
        Routing {
            result,
            template: parsed.outcome,
        }
    }

    /// The rest of [`route_with`](Self::route_with), once the request's prompt is rendered and
    /// its `candidates` known: the policy picks, and what the request expects there is noted.
    fn route_among(
        &mut self,
        store: &dyn SharedStore,
        candidates: &[Candidate],
        req: &RequestInfo,
        prompt: &Prompt,
        now_ms: u64,
    ) -> Result<Routed, Fallback> {
        let config = &self.config;
        let keys = PrefixKeys::of(prompt, config.shape())
            .opened_by(prompt.text.get(prompt.opener.clone()).unwrap_or_default());
        let input = Input {
            keys: &keys,
            session: req.session.map(|s| xxh3_64(s.as_bytes())),
            nonce: req.request_id.map_or(now_ms, |id| xxh3_64(id.as_bytes())),
            store,
            now_ms,
            prompt_bytes: prompt.text.len(),
            chunk_size: config.chunk_size,
        };
        let pick = self
            .policy
            .pick(candidates, &input)
            .ok_or(Fallback::NoSession)?;
        let chosen = &candidates[pick.index];
        let slots_created = self.policy.routed(candidates, &input, &pick);
        let uncached = prompt.text.len().saturating_sub(pick.held_bytes) as u64;
        let prefill = Expected {
            prompt: prompt.text.len() as u64,
            uncached,
            ahead: chosen.queued_prefill,
            ttft_ms: chosen.expected_ttft_ms(prompt.text.len(), pick.held_bytes),
        };
        Ok(Routed {
            endpoints: endpoint_list(
                candidates,
                pick.index,
                keys.group,
                config.fallback_endpoints,
            ),
            endpoint_id: chosen.id,
            decision: pick.decision,
            match_fraction: pick.match_fraction,
            slots_created,
            keys: keys.keys,
            ticket: pick.ticket,
            usage: prompt.usage,
            streams: prompt.streams,
            prefill,
        })
    }
}

impl Router {
    /// What the policy reads of a request beyond its body.
    pub fn needs(&self) -> Needs {
        self.policy.needs()
    }

    /// A request routed with `ticket` was answered: the policy settles what it learnt from
    /// routing it.
    pub fn answered(&self, store: &dyn SharedStore, ticket: Ticket, answer: &Answer) -> Settled {
        self.policy.answered(store, ticket, answer)
    }

    /// Periodic work (each worker's tick): the policy refreshes what it keeps from shared data and
    /// takes in the engines' finished-requests counters (address, count) from the last poll.
    /// Returns how many groups it now places by balance.
    pub fn tick(
        &mut self,
        store: &dyn SharedStore,
        now_ms: u64,
        completed: &[(&str, f64)],
    ) -> usize {
        self.policy.tick(store, now_ms, completed)
    }
}

/// Healthy hosts with their load, sorted by address so that every worker and every gateway lists
/// them alike. With engine metrics, the load is what the engine reported (every gateway's
/// traffic) plus kvroute's own requests since; without, the larger of kvroute's own count and
/// Envoy's `rq_active` (which also sees requests kvroute did not route). The prefill queued is
/// what the engine reports of its uncached prompt tokens waiting (SGLang's), plus kvroute's own
/// since; where it does not say, kvroute's own requests' not yet at their first byte or, where
/// more, the engine's waiting requests at the mean size of a request's uncached prompt (other
/// gateways' requests among them).
fn candidates<'h>(table: &Table, prefill: &PrefillModel, hosts: &'h [Host]) -> Vec<Candidate<'h>> {
    let bytes_per_token = prefill.bytes_per_token();
    let mut out: Vec<Candidate> = hosts
        .iter()
        .filter(|h| h.healthy)
        .map(|h| {
            let id = h.id();
            let own = table.inflight(id);
            let (load, queueing) = match &h.engine {
                Some(engine) => {
                    let estimate = engine.estimate(own);
                    (estimate, engine.queueing(estimate))
                }
                None => (u64::from(own).max(h.rq_active), false),
            };
            let fresh = h.engine.filter(|e| !e.stale());
            let own_prefill = table.prefill(id);
            let reported = fresh.and_then(|e| e.queued_prefill(own_prefill, bytes_per_token));
            let waiting = fresh.map_or(0, |e| e.waiting);
            let others = (waiting as f64 * prefill.mean_uncached()) as u64;
            Candidate {
                addr: &h.addr,
                id,
                load,
                queueing,
                retention_ms: h.engine.and_then(|e| e.churn?.retention_ms()),
                queued_prefill: reported.unwrap_or(u64::from(own_prefill).max(others)),
                prefill_rate: prefill.rate(id),
            }
        })
        .collect();
    out.sort_by(|a, b| a.addr.cmp(b.addr));
    out.dedup_by(|a, b| a.addr == b.addr);
    out
}

/// Every healthy host's engine load is known and too old: nothing to weigh load by.
fn all_engines_stale(hosts: &[Host]) -> bool {
    hosts
        .iter()
        .filter(|h| h.healthy)
        .all(|h| h.engine.is_some_and(|e| e.stale()))
}

/// The chosen endpoint, then up to `fallbacks` others in the request's rendezvous order: where
/// Envoy's retries go (override_host consumes one address per attempt).
fn endpoint_list(
    candidates: &[Candidate],
    chosen: usize,
    key: u64,
    fallbacks: usize,
) -> Vec<String> {
    let ids: Vec<u32> = candidates.iter().map(|c| c.id).collect();
    std::iter::once(chosen)
        .chain(
            crate::rendezvous::order(key, &ids)
                .into_iter()
                .filter(|&i| i != chosen)
                .take(fallbacks),
        )
        .map(|i| candidates[i].addr.to_string())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::PolicyKind;
    use crate::engine_load::{EngineLoad, Metrics, Own};
    use crate::in_flight::Local;
    use crate::policy::cache_aware::REFRESH_MS;
    use crate::store::MemoryStore;

    fn hosts(n: usize) -> Vec<Host> {
        (0..n)
            .map(|i| Host::fixed(&format!("127.0.0.1:{}", 8001 + i)))
            .collect()
    }

    #[test]
    fn the_header_fields_are_read_from_byte_values() {
        let h = |n: &str, v: &[u8]| (n.to_string(), v.to_vec());
        let headers = [
            h(":method", b"POST"),
            h(":path", b"/v1/chat/completions"),
            h("content-length", b" 42 "),
            h("x-note", b"caf\xe9 \xff"),
            h("X-Gateway-Destination-Endpoint", b"10.0.0.1:80\xff"),
        ];
        let fields = HeaderFields::read(&headers, "x-gateway-destination-endpoint");
        assert_eq!(
            fields,
            HeaderFields {
                method: "POST",
                path: "/v1/chat/completions",
                content_length: Some(42),
                routing_header: true,
            }
        );
        // A path or length that is not text reads as absent: not routable, no declared length.
        let odd = [h(":path", b"/v1/\xff"), h("content-length", b"4\xff")];
        let fields = HeaderFields::read(&odd, "x-gateway-destination-endpoint");
        assert_eq!(fields, HeaderFields::default());
        assert_eq!(routable(fields.method, fields.path), Err(Fallback::Method));
    }

    fn chat(system: &str, user: &str) -> String {
        format!(
            r#"{{"model":"m","messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"{user}"}}]}}"#
        )
    }

    fn router(policy: PolicyKind) -> Router {
        Router::new(Config {
            policy,
            ..Config::default()
        })
    }

    /// Routes `body` as a worker with nothing in flight.
    fn send(
        router: &mut Router,
        store: &MemoryStore,
        hosts: &[Host],
        body: &str,
    ) -> Result<Routed, Fallback> {
        send_at(router, store, &mut Local::default(), hosts, body, 1)
    }

    /// Routes `body` at `now` as a worker whose requests in flight are `inflight`, and counts it
    /// there, as the gateway does.
    fn send_at(
        router: &mut Router,
        store: &MemoryStore,
        inflight: &mut Local,
        hosts: &[Host],
        body: &str,
        now: u64,
    ) -> Result<Routed, Fallback> {
        let req = RequestInfo {
            api: Api::Chat,
            body: body.as_bytes(),
            session: None,
            request_id: None,
        };
        let prefill = PrefillModel::new(router.config.prefill_bytes_per_ms);
        let routing = router.route_with(store, &inflight.view(), &prefill, hosts, &req, now);
        let routed = routing.result?;
        inflight.add(routed.endpoint_id, 1);
        Ok(routed)
    }

    #[test]
    fn a_request_costs_a_handful_of_shared_data_calls_whatever_its_prefix() {
        let (mut r, store, hosts) = (router(PolicyKind::CacheAware), MemoryStore::new(), hosts(4));
        let long = "A long system prompt, about 24 KB of it. ".repeat(600);
        let mut inflight = Local::default();
        let mut at = |body: &str, now: u64| {
            let before = store.calls();
            let routed = send_at(&mut r, &store, &mut inflight, &hosts, body, now).unwrap();
            (store.calls() - before, routed)
        };
        let (new_group, _) = at(&chat(&long, "first question"), 1);
        assert!(new_group <= 6, "a new prefix: {new_group} calls");
        let (known, _) = at(&chat(&long, "second question"), 2);
        assert!(known <= 4, "a known group: {known} calls");
        // A conversation whose 24 KB of history was served a while ago (its record is stale).
        let history = "An earlier answer, long enough to span many chunks. ".repeat(480);
        let turn = |user: &str| {
            format!(
                r#"{{"model":"m","messages":[{{"role":"system","content":"s"}},{{"role":"user","content":"q1"}},{{"role":"assistant","content":"{history}"}},{{"role":"user","content":"{user}"}}]}}"#
            )
        };
        let (first, routed) = at(&turn("q2"), 10);
        assert!(
            first <= 118,
            "first sight of a 24 KB history: {first} calls"
        );
        let (stale, again) = at(&turn("q2, asked again"), 10 + 10 * REFRESH_MS);
        assert_eq!(again.decision, Decision::Affinity);
        assert_eq!(again.endpoints[0], routed.endpoints[0]);
        assert!(stale <= 14, "following a stale record: {stale} calls");
    }

    fn system(group: usize) -> String {
        format!("You are assistant {group}. ").repeat(100)
    }

    #[test]
    fn requests_of_one_group_go_to_its_home() {
        let (mut r, store, hosts) = (router(PolicyKind::CacheAware), MemoryStore::new(), hosts(4));
        let first = send(&mut r, &store, &hosts, &chat(&system(0), "question 0")).unwrap();
        assert_eq!(first.decision, Decision::Home);
        for i in 1..20 {
            let next = send(
                &mut r,
                &store,
                &hosts,
                &chat(&system(0), &format!("question {i}")),
            );
            let next = next.unwrap();
            assert_eq!(next.endpoints[0], first.endpoints[0]);
            assert_eq!(next.match_fraction, None, "a first turn looks nothing up");
        }
    }

    #[test]
    fn gateways_with_different_histories_place_every_group_alike() {
        let mut r = router(PolicyKind::CacheAware);
        let (a, b) = (MemoryStore::new(), MemoryStore::new());
        let hosts = hosts(4);
        // Gateway a has seen other traffic and has requests in flight; b is fresh.
        let mut in_flight_at_a = Local::default();
        for g in 100..120 {
            let body = chat(&system(g), "warm-up");
            send_at(&mut r, &a, &mut in_flight_at_a, &hosts, &body, 1).unwrap();
        }
        let mut homes = std::collections::HashSet::new();
        for g in 0..40 {
            let body = chat(&system(g), "hello");
            let on_a = send(&mut r, &a, &hosts, &body).unwrap();
            let on_b = send(&mut r, &b, &hosts, &body).unwrap();
            assert_eq!(on_a.endpoints[0], on_b.endpoints[0], "group {g}");
            homes.insert(on_a.endpoints[0].clone());
        }
        assert_eq!(homes.len(), 4, "groups spread over every endpoint");
    }

    #[test]
    fn documents_behind_a_short_common_preamble_are_different_groups() {
        let (mut r, store, hosts) = (router(PolicyKind::CacheAware), MemoryStore::new(), hosts(4));
        let house = "House rules: be brief, cite sources, never guess. ".repeat(20);
        assert!((900..1100).contains(&house.len()));
        let homes: std::collections::HashSet<String> = (0..24)
            .map(|d| {
                let doc = format!("{house}Document {d}: {}", format!("fact {d}. ").repeat(300));
                let routed = send(&mut r, &store, &hosts, &chat(&doc, "summarise")).unwrap();
                routed.endpoints[0].clone()
            })
            .collect();
        assert_eq!(homes.len(), 4, "24 documents all on {homes:?}");
    }

    #[test]
    fn a_workers_requests_in_flight_spill_a_hot_group_past_its_home() {
        let (mut r, store, hosts) = (router(PolicyKind::CacheAware), MemoryStore::new(), hosts(4));
        let mut inflight = Local::default();
        let mut send = |i: usize| {
            let body = chat(&system(0), &format!("q{i}"));
            send_at(&mut r, &store, &mut inflight, &hosts, &body, 1).unwrap()
        };
        let first = send(0);
        assert_eq!(first.decision, Decision::Home);
        let spilled = (1..20).map(send).find(|r| r.decision == Decision::Spread);
        let spilled = spilled.expect("a home with 19 requests in flight and its peers idle");
        assert_ne!(spilled.endpoints[0], first.endpoints[0]);
    }

    #[test]
    fn unroutable_requests_say_why() {
        let (mut r, store, hosts) = (router(PolicyKind::CacheAware), MemoryStore::new(), hosts(2));
        let why = |r: &mut Router, hosts: &[Host], body: &str| send(r, &store, hosts, body).err();
        assert_eq!(why(&mut r, &hosts, "nope"), Some(Fallback::BadJson));
        assert_eq!(
            why(&mut r, &[], &chat("a", "b")),
            Some(Fallback::NoHealthyEndpoint)
        );
        let mut small = Router::new(Config {
            max_body_bytes: 10,
            ..Config::default()
        });
        assert_eq!(
            why(&mut small, &hosts, &chat("a", "b")),
            Some(Fallback::BodyTooLarge)
        );
        assert_eq!(
            why(&mut router(PolicyKind::Session), &hosts, &chat("a", "b")),
            Some(Fallback::NoSession)
        );
        assert_eq!(
            routable("GET", "/v1/chat/completions"),
            Err(Fallback::Method)
        );
        assert_eq!(routable("POST", "/v1/embeddings"), Err(Fallback::Path));
    }

    #[test]
    fn unhealthy_hosts_are_never_chosen_nor_listed_as_fallback() {
        let (mut r, store) = (router(PolicyKind::CacheAware), MemoryStore::new());
        let mut hs = hosts(3);
        hs[0].healthy = false;
        hs[2].healthy = false;
        for i in 0..10 {
            let routed = send(&mut r, &store, &hs, &chat(&format!("p{i}"), "q")).unwrap();
            assert_eq!(routed.endpoints, vec!["127.0.0.1:8002".to_string()]);
        }
    }

    #[test]
    fn the_chosen_endpoint_comes_first_then_distinct_fallbacks() {
        let with_fallbacks = |n| {
            Router::new(Config {
                fallback_endpoints: n,
                ..Config::default()
            })
        };
        let (mut r, mut alone) = (with_fallbacks(2), with_fallbacks(0));
        let mut firsts = std::collections::HashSet::new();
        for g in 0..8 {
            let body = chat(&system(g), "q");
            let routed = send(&mut r, &MemoryStore::new(), &hosts(4), &body).unwrap();
            let chosen = send(&mut alone, &MemoryStore::new(), &hosts(4), &body).unwrap();
            assert_eq!(routed.endpoints.len(), 3);
            assert_eq!(chosen.endpoints.len(), 1);
            assert_eq!(
                routed.endpoints[0], chosen.endpoints[0],
                "the chosen endpoint first: {routed:?}"
            );
            assert_eq!(
                crate::rendezvous::endpoint_id(&routed.endpoints[0]),
                routed.endpoint_id
            );
            firsts.insert(routed.endpoints[0].clone());
            let unique: std::collections::HashSet<&String> = routed.endpoints.iter().collect();
            assert_eq!(unique.len(), 3);
        }
        assert!(firsts.len() > 1, "8 groups all chosen on {firsts:?}");
    }

    /// The group of `system(g)` whose home is host `want` among `hosts`.
    fn group_homed_on(r: &mut Router, hosts: &[Host], want: usize) -> usize {
        (0..)
            .find(|&g| {
                let routed = send(r, &MemoryStore::new(), hosts, &chat(&system(g), "q"));
                routed.unwrap().endpoints[0] == hosts[want].addr
            })
            .unwrap()
    }

    #[test]
    fn envoy_load_counts_even_for_requests_kvroute_did_not_route() {
        let (mut r, store) = (router(PolicyKind::CacheAware), MemoryStore::new());
        let mut hs = hosts(2);
        let g = group_homed_on(&mut r, &hs, 0);
        hs[0].rq_active = 50;
        let routed = send(&mut r, &store, &hs, &chat(&system(g), "q")).unwrap();
        assert_eq!(routed.endpoints[0], "127.0.0.1:8002");
        assert_eq!(routed.decision, Decision::Spread);
    }

    #[test]
    fn an_engine_that_queues_other_gateways_traffic_takes_no_group() {
        let (mut r, store) = (router(PolicyKind::CacheAware), MemoryStore::new());
        let mut hs = hosts(2);
        let report = |running, waiting| Metrics {
            running,
            waiting,
            ..Metrics::default()
        };
        hs[1].engine = Some(EngineLoad::observe(None, &report(16, 3), Own::default(), 0));
        hs[0].engine = Some(EngineLoad::observe(None, &report(2, 0), Own::default(), 0));
        for g in 0..10 {
            let routed = send(&mut r, &store, &hs, &chat(&system(g), "q")).unwrap();
            assert_eq!(routed.endpoints[0], "127.0.0.1:8001");
        }
    }

    #[test]
    fn the_prefill_queued_at_an_engine_is_what_it_reports_where_it_does() {
        let (mut r, store) = (router(PolicyKind::RoundRobin), MemoryStore::new());
        let mut hs = hosts(1);
        let reports = Metrics {
            waiting_uncached_tokens: Some(500),
            ..Metrics::default()
        };
        hs[0].engine = Some(EngineLoad::observe(None, &reports, Own::default(), 0));
        let routed = send(&mut r, &store, &hs, &chat("s", "q")).unwrap();
        let bytes = 500.0 * crate::prefill::BYTES_PER_TOKEN;
        assert_eq!(routed.prefill.ahead, bytes as u64);
        hs[0].engine = Some(EngineLoad::observe(
            None,
            &Metrics::default(),
            Own::default(),
            0,
        ));
        let routed = send(&mut r, &store, &hs, &chat("s", "q")).unwrap();
        assert_eq!(
            routed.prefill.ahead, 0,
            "nothing queued and the engine does not say"
        );
    }

    #[test]
    fn engines_that_stopped_answering_are_avoided_and_all_stale_falls_back() {
        let (mut r, store) = (router(PolicyKind::CacheAware), MemoryStore::new());
        let mut hs = hosts(2);
        let fresh = EngineLoad::observe(None, &Metrics::default(), Own::default(), 0);
        let mut stale = fresh;
        for _ in 0..crate::freshness::STALE_POLLS {
            stale = stale.missed_poll();
        }
        hs[0].engine = Some(stale);
        hs[1].engine = Some(fresh);
        for g in 0..10 {
            let routed = send(&mut r, &store, &hs, &chat(&system(g), "q")).unwrap();
            assert_eq!(routed.endpoints[0], "127.0.0.1:8002", "group {g}");
        }
        hs[1].engine = Some(stale);
        assert_eq!(
            send(&mut r, &store, &hs, &chat(&system(0), "q")).err(),
            Some(Fallback::StaleEngineLoads)
        );
    }

    #[test]
    fn round_robin_cycles_least_request_takes_the_idlest_and_prefix_hash_keeps_each_group() {
        let (store, hosts) = (MemoryStore::new(), hosts(3));
        let mut rr = router(PolicyKind::RoundRobin);
        let firsts: Vec<String> = (0..6)
            .map(|_| {
                send(&mut rr, &store, &hosts, &chat("s", "q"))
                    .unwrap()
                    .endpoints[0]
                    .clone()
            })
            .collect();
        assert_eq!(firsts[0..3], firsts[3..6]);
        assert_ne!(firsts[0], firsts[1]);
        let mut busy = hosts.clone();
        busy[0].rq_active = 5;
        busy[2].rq_active = 3;
        let least = send(
            &mut router(PolicyKind::LeastRequest),
            &store,
            &busy,
            &chat("s", "q"),
        );
        assert_eq!(least.unwrap().endpoints[0], hosts[1].addr, "the idle one");
        let mut hash = router(PolicyKind::PrefixHash);
        let homes: std::collections::HashSet<String> = (0..16)
            .map(|g| {
                let first = send(&mut hash, &store, &hosts, &chat(&system(g), "q")).unwrap();
                let again = send(&mut hash, &store, &hosts, &chat(&system(g), "other")).unwrap();
                assert_eq!(
                    first.endpoints[0], again.endpoints[0],
                    "group {g} keeps its host"
                );
                first.endpoints[0].clone()
            })
            .collect();
        assert!(homes.len() > 1, "16 groups all hashed to {homes:?}");
    }
}
