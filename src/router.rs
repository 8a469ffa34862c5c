//! One request through the pipeline: parse → prefix keys → candidates → policy → record.
//!
//! Everything here is host-agnostic: the adapter hands in the body, the known hosts and the clock,
//! and gets back either the endpoints to write into the routing header or the reason it leaves the
//! request to Envoy's fallback policy.

use xxhash_rust::xxh3::xxh3_64;

use crate::affinity::{AffinityMap, Match};
use crate::config::{Config, PolicyKind};
use crate::counters::{self, Counts};
use crate::endpoints::Host;
use crate::policy::{self, Candidate, Decision, Input, Pick, Thresholds};
use crate::prefix::PrefixKeys;
use crate::request::{self, Api};
use crate::store::{self, SharedStore};

/// A prefix record younger than this is not rewritten when a request follows it: it keeps hot
/// prefixes' writes to a handful per second instead of one per chunk per request.
pub const REFRESH_MS: u64 = 1000;

const TICKET_KEY: &str = "kvroute.ticket";

/// Why a request is left to Envoy's fallback policy. Each is a counter; names are stable.
pub type Reason = &'static str;

/// Every [`Reason`], so each counter exists (at zero) before it first moves.
pub const FALLBACK_REASONS: [Reason; 12] = [
    "method",
    "path",
    "empty_body",
    "body_too_large",
    "bad_utf8",
    "bad_json",
    "no_model",
    "no_prompt",
    "no_cluster",
    "no_healthy_endpoint",
    "no_session",
    "no_body_access",
];

/// The header-phase check: is this a request kvroute routes (and so buffers the body of)?
pub fn routable(method: &str, path: &str) -> Result<Api, Reason> {
    if method != "POST" {
        return Err("method");
    }
    Api::from_path(path).ok_or("path")
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
#[derive(Debug, Clone, PartialEq)]
pub struct Routed {
    /// The chosen `ip:port` first, then fallbacks for retries.
    pub endpoints: Vec<String>,
    /// Id of the chosen endpoint: pass it to [`finish`] when the stream ends.
    pub endpoint_id: u32,
    pub decision: Decision,
    /// Share of the request's chunks found in the affinity map (cache_aware only).
    pub match_fraction: Option<f64>,
    /// Affinity slots this request wrote for the first time.
    pub slots_created: usize,
    /// kvroute's in-flight count of the chosen endpoint, this request included.
    pub inflight: u32,
}

/// Routes one request whose body is complete. `hosts` are the hosts of the request's cluster.
pub fn route<S: SharedStore + ?Sized>(
    config: &Config,
    store: &S,
    hosts: &[Host],
    req: &RequestInfo,
    now_ms: u64,
) -> Result<Routed, Reason> {
    if req.body.len() > config.max_body_bytes {
        return Err("body_too_large");
    }
    let prompt = request::parse(req.api, req.body).map_err(|e| e.reason())?;
    let keys = PrefixKeys::new(
        &prompt.model,
        &prompt.text,
        config.chunk_size,
        config.max_chunks,
    );
    let affinity = AffinityMap::new(store, config.affinity_capacity);
    let matched = match config.policy {
        PolicyKind::CacheAware => affinity.longest_match(&keys.keys),
        _ => None,
    };
    let ticket = match config.policy {
        PolicyKind::RoundRobin => next_ticket(store),
        PolicyKind::LeastRequest => req.request_id.map_or(now_ms, |id| xxh3_64(id.as_bytes())),
        // Fallback addresses follow the prefix: the endpoints it would spread to next.
        _ => keys.placement_key(),
    };
    let input = Input {
        keys: &keys,
        matched: matched.as_ref(),
        cache_threshold: config.cache_threshold,
        thresholds: Thresholds {
            abs: config.balance_abs_threshold,
            rel: config.balance_rel_threshold,
        },
        session: req.session.map(|s| xxh3_64(s.as_bytes())),
        ticket,
    };
    let (candidates, pick, counted) = decide(config, store, hosts, &input)?;
    let chosen = &candidates[pick.index];
    let mut slots_created = 0;
    if config.policy == PolicyKind::CacheAware {
        let from = unchanged_prefix(matched.as_ref(), chosen.id, now_ms);
        slots_created = affinity.record(&keys.keys[from..], chosen.id, now_ms);
    }
    let match_fraction = (config.policy == PolicyKind::CacheAware).then(|| {
        let depth = matched.as_ref().map_or(0, |m| m.depth);
        depth as f64 / keys.keys.len().max(1) as f64
    });

    Ok(Routed {
        endpoints: endpoint_list(&candidates, pick.index, ticket, config.fallback_endpoints),
        endpoint_id: chosen.id,
        decision: pick.decision,
        match_fraction,
        slots_created,
        inflight: counted.inflight,
    })
}

/// How often a placement is decided again because another worker changed the counts meanwhile.
const DECIDE_ATTEMPTS: usize = 4;

/// Picks an endpoint and counts the request on it. A new prefix's placement and its count happen
/// as one step: if another worker counted in between (two new prefixes at once would otherwise
/// both see the same idle endpoint), the placement is decided again on the fresh counts.
fn decide<S: SharedStore + ?Sized>(
    config: &Config,
    store: &S,
    hosts: &[Host],
    input: &Input,
) -> Result<(Vec<Candidate>, Pick, Counts), Reason> {
    let mut attempt = 1;
    loop {
        let table = counters::read(store);
        let candidates = candidates(&table, hosts);
        if candidates.is_empty() {
            return Err("no_healthy_endpoint");
        }
        let pick = policy::pick(config.policy, &candidates, input).ok_or("no_session")?;
        let id = candidates[pick.index].id;
        let placed = u32::from(matches!(
            pick.decision,
            Decision::NewPrefix | Decision::Balance
        ));
        let counted = if placed > 0 && attempt < DECIDE_ATTEMPTS {
            match counters::add_unchanged(store, &table, id, 1, placed) {
                Some(c) => c,
                None => {
                    attempt += 1;
                    continue;
                }
            }
        } else {
            let none = Counts {
                id,
                inflight: 0,
                placed: 0,
            };
            counters::add(store, id, 1, placed).unwrap_or(none)
        };
        return Ok((candidates, pick, counted));
    }
}

/// Ends a routed request: its endpoint has one request fewer in flight. Returns the new count.
pub fn finish<S: SharedStore + ?Sized>(store: &S, endpoint_id: u32) -> Option<u32> {
    counters::add(store, endpoint_id, -1, 0).map(|c| c.inflight)
}

/// Healthy hosts with their load: the largest of kvroute's own in-flight count (current), Envoy's
/// `rq_active` (which also sees requests kvroute did not route) and the engine's own running +
/// waiting count (which also sees other proxies' requests). Sorted by address, so that every
/// worker and every proxy lists them alike.
fn candidates(table: &counters::Table, hosts: &[Host]) -> Vec<Candidate> {
    let mut out: Vec<Candidate> = hosts
        .iter()
        .filter(|h| h.healthy)
        .map(|h| {
            let id = h.id();
            let own = table.get(id);
            let (inflight, placed) = (u64::from(own.inflight), u64::from(own.placed));
            Candidate {
                addr: h.addr.clone(),
                id,
                load: inflight.max(h.rq_active).max(h.engine_load),
                placed,
            }
        })
        .collect();
    out.sort_by(|a, b| a.addr.cmp(&b.addr));
    out.dedup_by(|a, b| a.addr == b.addr);
    out
}

/// How many leading keys already record `endpoint` freshly, so need no rewrite.
fn unchanged_prefix(matched: Option<&Match>, endpoint: u32, now_ms: u64) -> usize {
    match matched {
        Some(m)
            if m.record.holders.contains(&endpoint)
                && now_ms.saturating_sub(m.record.stamp_ms) < REFRESH_MS =>
        {
            m.depth
        }
        _ => 0,
    }
}

fn next_ticket<S: SharedStore + ?Sized>(store: &S) -> u64 {
    let mut ticket = 0;
    store::update(store, TICKET_KEY, |current| {
        ticket = current
            .and_then(|v| v.try_into().ok())
            .map(u64::from_le_bytes)
            .unwrap_or(0)
            .wrapping_add(1);
        Some(ticket.to_le_bytes().to_vec())
    });
    ticket
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
        .map(|i| candidates[i].addr.clone())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;

    fn hosts(n: usize) -> Vec<Host> {
        (0..n)
            .map(|i| Host::fixed(&format!("127.0.0.1:{}", 8001 + i)))
            .collect()
    }

    fn chat(system: &str, user: &str) -> String {
        format!(
            r#"{{"model":"m","messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"{user}"}}]}}"#
        )
    }

    fn send(
        config: &Config,
        store: &MemoryStore,
        hosts: &[Host],
        body: &str,
    ) -> Result<Routed, Reason> {
        let req = RequestInfo {
            api: Api::Chat,
            body: body.as_bytes(),
            session: None,
            request_id: None,
        };
        route(config, store, hosts, &req, 1)
    }

    #[test]
    fn requests_of_one_prefix_group_follow_the_first_one() {
        let (config, store, hosts) = (Config::default(), MemoryStore::new(), hosts(4));
        let system = "You are a helpful assistant. ".repeat(100);
        let first = send(&config, &store, &hosts, &chat(&system, "question 0")).unwrap();
        assert_eq!(first.decision, Decision::NewPrefix);
        for i in 1..20 {
            let r = send(
                &config,
                &store,
                &hosts,
                &chat(&system, &format!("question {i}")),
            )
            .unwrap();
            assert_eq!(r.decision, Decision::Affinity);
            assert_eq!(r.endpoints[0], first.endpoints[0]);
            assert!(r.match_fraction.unwrap() > 0.8);
        }
    }

    #[test]
    fn consecutive_new_prefixes_spread_over_idle_endpoints() {
        let (config, store, hosts) = (Config::default(), MemoryStore::new(), hosts(4));
        let mut used = std::collections::HashSet::new();
        for g in 0..4 {
            let r = send(
                &config,
                &store,
                &hosts,
                &chat(&format!("group {g} ").repeat(200), "q"),
            )
            .unwrap();
            finish(&store, r.endpoint_id);
            used.insert(r.endpoints[0].clone());
        }
        assert_eq!(used.len(), 4);
    }

    #[test]
    fn in_flight_counts_steer_new_prefixes_and_return_to_zero() {
        let (config, store, hosts) = (Config::default(), MemoryStore::new(), hosts(4));
        let routed: Vec<Routed> = (0..4)
            .map(|g| {
                send(
                    &config,
                    &store,
                    &hosts,
                    &chat(&format!("group {g} ").repeat(200), "q"),
                )
                .unwrap()
            })
            .collect();
        let used: std::collections::HashSet<&String> =
            routed.iter().map(|r| &r.endpoints[0]).collect();
        assert_eq!(used.len(), 4, "each new prefix went to an idle endpoint");
        for r in &routed {
            assert_eq!(finish(&store, r.endpoint_id), Some(0));
        }
        assert!(counters::read(&store)
            .counts
            .iter()
            .all(|c| c.inflight == 0));
    }

    #[test]
    fn unroutable_requests_say_why() {
        let (config, store, hosts) = (Config::default(), MemoryStore::new(), hosts(2));
        assert_eq!(send(&config, &store, &hosts, "nope"), Err("bad_json"));
        assert_eq!(
            send(&config, &store, &[], &chat("a", "b")),
            Err("no_healthy_endpoint")
        );
        let small = Config {
            max_body_bytes: 10,
            ..Config::default()
        };
        assert_eq!(
            send(&small, &store, &hosts, &chat("a", "b")),
            Err("body_too_large")
        );
        let session = Config {
            policy: PolicyKind::Session,
            ..Config::default()
        };
        assert_eq!(
            send(&session, &store, &hosts, &chat("a", "b")),
            Err("no_session")
        );
        assert_eq!(routable("GET", "/v1/chat/completions"), Err("method"));
        assert_eq!(routable("POST", "/v1/embeddings"), Err("path"));
        assert!(
            counters::read(&store)
                .counts
                .iter()
                .all(|c| c.inflight == 0),
            "nothing counted for unrouted requests"
        );
    }

    #[test]
    fn every_parse_failure_has_a_listed_reason() {
        use crate::request::ParseError::*;
        for e in [Empty, BadUtf8, BadJson, NoModel, NoPrompt] {
            assert!(FALLBACK_REASONS.contains(&e.reason()), "{}", e.reason());
        }
    }

    #[test]
    fn unhealthy_hosts_are_never_chosen_nor_listed_as_fallback() {
        let (config, store) = (Config::default(), MemoryStore::new());
        let mut hs = hosts(3);
        hs[0].healthy = false;
        hs[2].healthy = false;
        for i in 0..10 {
            let r = send(&config, &store, &hs, &chat(&format!("p{i}"), "q")).unwrap();
            assert_eq!(r.endpoints, vec!["127.0.0.1:8002".to_string()]);
        }
    }

    #[test]
    fn the_chosen_endpoint_comes_first_then_distinct_fallbacks() {
        let (config, store, hosts) = (
            Config {
                fallback_endpoints: 2,
                ..Config::default()
            },
            MemoryStore::new(),
            hosts(4),
        );
        let r = send(&config, &store, &hosts, &chat("s", "q")).unwrap();
        assert_eq!(r.endpoints.len(), 3);
        let unique: std::collections::HashSet<&String> = r.endpoints.iter().collect();
        assert_eq!(unique.len(), 3);
    }

    #[test]
    fn envoy_load_counts_even_for_requests_kvroute_did_not_route() {
        let (config, store) = (Config::default(), MemoryStore::new());
        let mut hs = hosts(2);
        hs[0].rq_active = 5;
        let r = send(&config, &store, &hs, &chat("s", "q")).unwrap();
        assert_eq!(r.endpoints[0], "127.0.0.1:8002");
    }

    #[test]
    fn an_engine_busy_with_other_proxies_traffic_is_avoided() {
        let (config, store) = (Config::default(), MemoryStore::new());
        let mut hs = hosts(2);
        hs[1].engine_load = 100;
        for i in 0..5 {
            let r = send(&config, &store, &hs, &chat(&format!("p{i}"), "q")).unwrap();
            assert_eq!(r.endpoints[0], "127.0.0.1:8001");
            assert_eq!(r.decision, Decision::Balance);
        }
    }

    #[test]
    fn round_robin_cycles_and_other_baselines_route() {
        let store = MemoryStore::new();
        let hosts = hosts(3);
        let rr = Config {
            policy: PolicyKind::RoundRobin,
            ..Config::default()
        };
        let firsts: Vec<String> = (0..6)
            .map(|_| {
                send(&rr, &store, &hosts, &chat("s", "q"))
                    .unwrap()
                    .endpoints[0]
                    .clone()
            })
            .collect();
        assert_eq!(firsts[0..3], firsts[3..6]);
        assert_ne!(firsts[0], firsts[1]);
        for policy in [PolicyKind::LeastRequest, PolicyKind::PrefixHash] {
            let c = Config {
                policy,
                ..Config::default()
            };
            assert!(send(&c, &store, &hosts, &chat("s", "q")).is_ok());
        }
    }
}
