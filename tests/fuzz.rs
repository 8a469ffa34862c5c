#![cfg(not(target_arch = "wasm32"))]
//! Property tests (proptest, stable Rust) over everything a client or another VM can hand the
//! filter: request bodies and headers, prompt text, the plugin config, and shared-data values.
//! Whatever the input, nothing panics, and a routed request only ever names configured healthy
//! hosts, so no body, header or corrupted shared value lets a client pick the upstream.
//!
//! `KVROUTE_FUZZ_CASES` sets the cases per property (CI's `make test` runs a short pass);
//! `make fuzz` runs over ten million in all and prints the count.

use std::sync::atomic::{AtomicU64, Ordering};

use kvroute::config::{Config, PolicyKind};
use kvroute::holders::affinity::AffinityMap;
use kvroute::holders::Holders;
use kvroute::hosts::{self, Host};
use kvroute::prefill::PrefillModel;
use kvroute::prefix::{PrefixKeys, Shape};
use kvroute::request::{self, Api};
use kvroute::router::{self, RequestInfo, Router};
use kvroute::store::{MemoryStore, SharedStore};
use kvroute::suspects::Suspects;
use kvroute::{body_access, engine_load, eviction, in_flight, placement, shared_keys};
use proptest::prelude::*;
use proptest::test_runner::{Config as RunnerConfig, TestCaseError, TestRunner};

/// Cases per property unless `KVROUTE_FUZZ_CASES` says otherwise: a short pass for CI.
const DEFAULT_CASES: u32 = 1000;

static TOTAL: AtomicU64 = AtomicU64::new(0);

fn cases() -> u32 {
    std::env::var("KVROUTE_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_CASES)
}

/// Runs `test` over `cases()` values of `strategy` and prints the count.
fn check<S: Strategy>(name: &str, strategy: S, test: impl Fn(S::Value) -> Result<(), TestCaseError>)
where
    S::Value: std::fmt::Debug,
{
    let cases = cases();
    let mut runner = TestRunner::new(RunnerConfig {
        cases,
        failure_persistence: None,
        ..RunnerConfig::default()
    });
    let start = std::time::Instant::now();
    let result = runner.run(&strategy, test);
    let total = TOTAL.fetch_add(u64::from(cases), Ordering::Relaxed) + u64::from(cases);
    println!(
        "fuzz {name}: {cases} cases in {:.1} s (this run so far: {total})",
        start.elapsed().as_secs_f64()
    );
    if let Err(e) = result {
        panic!("{name}: {e}");
    }
}

const HOSTS: [&str; 4] = [
    "10.0.0.1:8000",
    "10.0.0.2:8000",
    "10.0.0.3:8000",
    "[fd00::4]:8000",
];

/// Text with the characters that matter to the parser and the separators: quotes, escapes,
/// control and multi-byte characters, the record separators kvroute uses.
fn text() -> impl Strategy<Value = String> {
    prop::collection::vec(
        prop_oneof![
            4 => any::<char>(),
            2 => prop::sample::select(vec!['"', '\\', '\u{1e}', '\u{1f}', '\n', 'é', '😀', ':', ',']),
            4 => prop::char::range('a', 'z'),
        ],
        0..96,
    )
    .prop_map(|cs| cs.into_iter().collect())
}

/// A JSON value of a few levels, for fields of any type.
fn json_value() -> impl Strategy<Value = serde_json::Value> {
    use serde_json::Value;
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<f64>()
            .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        text().prop_map(Value::String),
        prop::sample::select(HOSTS.to_vec()).prop_map(|h| Value::String(h.into())),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..5).prop_map(serde_json::Value::Array),
            prop::collection::btree_map(
                prop::sample::select(vec![
                    "role",
                    "content",
                    "type",
                    "text",
                    "image_url",
                    "url",
                    "name",
                    "tool_calls",
                    "model",
                    "messages",
                    "prompt",
                    "tools",
                    "x",
                ])
                .prop_map(String::from),
                inner,
                0..5
            )
            .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
        ]
    })
}

/// Chat and completion bodies shaped like OpenAI's, with any values in any field.
fn body() -> impl Strategy<Value = Vec<u8>> {
    let message = (
        prop::sample::select(vec!["system", "developer", "user", "assistant", "tool", ""]),
        prop_oneof![text().prop_map(serde_json::Value::String), json_value()],
    )
        .prop_map(|(role, content)| serde_json::json!({"role": role, "content": content}));
    prop_oneof![
        // Well-formed chats of any content.
        (
            text(),
            prop::collection::vec(message, 0..6),
            prop::option::of(json_value())
        )
            .prop_map(|(model, messages, tools)| {
                let mut b = serde_json::json!({"model": model, "messages": messages});
                if let Some(tools) = tools {
                    b["tools"] = tools;
                }
                b.to_string().into_bytes()
            }),
        // Completions, a string or a list prompt.
        (text(), json_value()).prop_map(|(model, prompt)| {
            serde_json::json!({"model": model, "prompt": prompt})
                .to_string()
                .into_bytes()
        }),
        // Any JSON at all.
        json_value().prop_map(|v| v.to_string().into_bytes()),
        // Any bytes at all, and valid bodies cut short or flipped.
        prop::collection::vec(any::<u8>(), 0..256),
        (json_value(), any::<usize>(), any::<u8>()).prop_map(|(v, at, b)| {
            let mut bytes = serde_json::json!({"model": "m", "messages": [v]})
                .to_string()
                .into_bytes();
            let at = at % bytes.len();
            bytes[at] = b;
            bytes.truncate(at + 1 + (b as usize % 8));
            bytes
        }),
    ]
}

#[test]
fn request_parsing_never_panics_and_the_head_is_within_the_text() {
    check(
        "request parsing",
        (body(), any::<bool>()),
        |(body, chat)| {
            let api = if chat { Api::Chat } else { Api::Completions };
            if let Ok(p) = request::parse(api, &body) {
                prop_assert!(p.head <= p.text.len());
                prop_assert!(!p.model.is_empty());
            }
            Ok(())
        },
    );
}

#[test]
fn prefix_keys_never_panic_and_equal_prefixes_share_keys() {
    let shape = (1usize..64, 1usize..32, 0usize..128).prop_map(|(c, m, g)| Shape {
        chunk_size: c,
        max_chunks: m,
        group_bytes: g,
    });
    check(
        "prefix keys",
        (text(), text(), text(), any::<usize>(), any::<bool>(), shape),
        |(model, common, rest, head, history, shape)| {
            let a = PrefixKeys::new(&model, &format!("{common}{rest}"), head, history, shape);
            let b = PrefixKeys::new(&model, &format!("{common}#{rest}"), head, history, shape);
            prop_assert!(a.keys.len() <= shape.max_chunks);
            prop_assert!(a.tail_from <= a.keys.len());
            let shared = (common.len() / shape.chunk_size)
                .min(a.keys.len())
                .min(b.keys.len());
            prop_assert_eq!(&a.keys[..shared], &b.keys[..shared]);
            Ok(())
        },
    );
}

#[test]
fn any_plugin_config_parses_or_says_which_field_is_wrong() {
    let field = prop::sample::select(vec![
        "policy",
        "header",
        "session_header",
        "chunk_size",
        "max_chunks",
        "group_bytes",
        "cache_threshold",
        "balance_abs_threshold",
        "balance_rel_threshold",
        "admin_cluster",
        "engine_metrics_cluster",
        "engine_metrics_path",
        "stats_interval_ms",
        "endpoints",
        "max_body_bytes",
        "affinity_capacity",
        "debug_header",
        "fallback_endpoints",
        "unsafe_trap_path_for_tests",
        "eviction_grace_ms",
        "index_cluster",
        "index_path",
        "engine_index_capacity",
        "tools_position",
        "clusters",
        "nonsense",
    ]);
    let object = prop::collection::btree_map(field.prop_map(String::from), json_value(), 0..6)
        .prop_map(|m| {
            serde_json::Value::Object(m.into_iter().collect())
                .to_string()
                .into_bytes()
        });
    check(
        "config",
        prop_oneof![object, prop::collection::vec(any::<u8>(), 0..128)],
        |bytes| {
            match Config::parse(&bytes) {
                Ok(c) => {
                    prop_assert!(c.chunk_size >= 16 && c.max_chunks >= 1);
                    prop_assert_ne!(c.header, c.session_header);
                }
                Err(e) => prop_assert!(!e.field.is_empty()),
            }
            Ok(())
        },
    );
}

/// Shared data as another (older, newer, or broken) VM may have left it: any bytes under every
/// key the request path and the tick read.
fn corrupted_store() -> impl Strategy<Value = Vec<(String, Vec<u8>)>> {
    let key = prop_oneof![
        Just(shared_keys::LOAD.to_string()),
        Just(shared_keys::TICKET.to_string()),
        Just(shared_keys::EVICTIONS.to_string()),
        (0..16usize).prop_map(shared_keys::groups_shard),
        (0..8u64).prop_map(shared_keys::affinity_slot),
    ];
    let value = prop_oneof![
        prop::collection::vec(any::<u8>(), 0..64),
        // A plausible version byte followed by junk, which a decoder must bound-check.
        (0u8..4, prop::collection::vec(any::<u8>(), 0..96)).prop_map(|(v, mut rest)| {
            rest.insert(0, v);
            rest
        }),
    ];
    prop::collection::vec((key, value), 0..8)
}

#[test]
fn a_routed_request_names_only_configured_healthy_hosts_whatever_it_sends() {
    let policy = prop::sample::select(vec![
        PolicyKind::CacheAware,
        PolicyKind::PrefixHash,
        PolicyKind::LeastRequest,
        PolicyKind::RoundRobin,
        PolicyKind::Session,
    ]);
    let healthy = prop::collection::vec(any::<bool>(), HOSTS.len());
    let router = |policy| {
        Router::new(Config {
            policy,
            affinity_capacity: 8,
            chunk_size: 16,
            fallback_endpoints: 2,
            ..Config::default()
        })
    };
    check(
        "routing",
        (
            policy,
            body(),
            prop::option::of(text()),
            prop::option::of(text()),
            healthy,
            corrupted_store(),
            0u64..5000,
        ),
        |(policy, body, session, request_id, healthy, corrupted, now)| {
            let store = MemoryStore::new();
            for (key, value) in &corrupted {
                let _ = store.set(key, value, None);
            }
            let hosts: Vec<Host> = HOSTS
                .iter()
                .zip(&healthy)
                .map(|(addr, &ok)| Host {
                    healthy: ok,
                    ..Host::fixed(addr)
                })
                .collect();
            let mut router = router(policy);
            let prefill = PrefillModel::new(router.config.prefill_bytes_per_ms);
            let mut inflight = in_flight::Local::default();
            let req = RequestInfo {
                api: Api::Chat,
                body: &body,
                session: session.as_deref(),
                request_id: request_id.as_deref(),
            };
            router.tick(&store, now, &[]);
            // Twice: the second request finds what the first one wrote beside the corrupted values.
            for _ in 0..2 {
                let view = inflight.view();
                let routing = router.route_with(&store, &view, &prefill, &hosts, &req, now);
                if let Ok(routed) = routing.result {
                    inflight.add(routed.endpoint_id, 1);
                    prop_assert!(!routed.endpoints.is_empty());
                    for e in &routed.endpoints {
                        let known = hosts.iter().any(|h| h.healthy && &h.addr == e);
                        prop_assert!(known, "{e} is not a configured healthy host");
                    }
                    let mut distinct = routed.endpoints.clone();
                    distinct.sort();
                    distinct.dedup();
                    prop_assert_eq!(distinct.len(), routed.endpoints.len());
                }
                inflight.flush(&store);
            }
            Ok(())
        },
    );
}

#[test]
fn shared_data_and_admin_decoders_never_panic() {
    check(
        "decoders",
        (prop::collection::vec(any::<u8>(), 0..192), any::<u64>()),
        |(bytes, key)| {
            let store = MemoryStore::new();
            let map = AffinityMap::new(&store, 4);
            let _ = store.set(&map.slot_key(key), &bytes, None);
            let _ = map.get(key);
            let _ = map.longest_match(&[key, key ^ 1, key], 0);
            map.record(&[key], 1, 2);
            let _ = store.set(shared_keys::LOAD, &bytes, None);
            let _ = in_flight::read(&store);
            let mut inflight = in_flight::Local::default();
            inflight.add(3, -1);
            inflight.flush(&store);
            for shard in 0..placement::SHARDS {
                let _ = store.set(&shared_keys::groups_shard(shard), &bytes, None);
            }
            let _ = placement::read(&store);
            let _ = store.set(shared_keys::EVICTIONS, &bytes, None);
            let _ = eviction::read(&store);
            eviction::raise(&store, 1, key);
            let _ = Suspects::decode(&bytes);
            let _ = hosts::decode_snapshot(&bytes);
            let _ = hosts::parse_admin_clusters(&bytes, hosts::PolledClusters::ALL);
            let only = ["inference_pool".to_string()];
            let _ = hosts::parse_admin_clusters(&bytes, hosts::PolledClusters::new(&only, None));
            let _ = engine_load::parse(&bytes);
            let _ = engine_load::parse_loads(&bytes);
            let _ = body_access::body_received(&bytes, key);
            Ok(())
        },
    );
}

#[test]
fn header_checks_never_panic() {
    check("headers", (text(), text()), |(method, path)| {
        let _ = router::routable(&method, &path);
        let _ = Api::from_path(&path);
        Ok(())
    });
}

/// Header maps as Envoy hands them over: the names kvroute reads, the routing header in any case,
/// other names, and values of any bytes (HTTP allows 0x80-0xFF). Reading them never panics, and a
/// routing header the client sent, however spelled, is always seen (so it is always removed).
#[test]
fn header_maps_of_any_bytes_are_read_and_the_routing_header_always_seen() {
    let name = prop_oneof![
        prop::sample::select(vec![
            ":method",
            ":path",
            "content-length",
            "x-gateway-destination-endpoint",
            "X-Gateway-Destination-Endpoint",
            "x-session-id",
        ])
        .prop_map(str::to_string),
        "[a-zA-Z-]{1,12}",
    ];
    let value = prop::collection::vec(any::<u8>(), 0..40);
    let map = prop::collection::vec((name, value), 0..12);
    check("header maps", map, |headers| {
        let fields = router::HeaderFields::read(&headers, "x-gateway-destination-endpoint");
        let sent = headers
            .iter()
            .any(|(n, _)| n.eq_ignore_ascii_case("x-gateway-destination-endpoint"));
        prop_assert_eq!(fields.routing_header, sent);
        let _ = router::routable(fields.method, fields.path);
        Ok(())
    });
}
