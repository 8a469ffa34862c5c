//! kvroute-epp behind a real Envoy (`envoy/kvroute-epp.yaml`) in front of real backends, all on
//! 127.0.0.1: the pick honoured, the subset hint honoured, the fallback address used when the
//! pick refuses, Envoy's failure mode when the picker is down, and a body the core cannot read
//! left to Envoy's balancer as the filter leaves it.

use crate::common;

use kvroute::gateway::stat_names::{self, Counter};
use kvroute::router::Fallback;
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;

use common::{
    chat, fleet, post, start_envoy, start_epp, wait_for_stat, wait_ready, wait_until, Shape,
};
use kvroute_harness::backend::{self, Backend};

const CONFIG: &str = kvroute_epp::settings::DEFAULT_CONFIG;
const HEADER: &str = "x-gateway-destination-endpoint";

fn addrs(backends: &[Backend]) -> Vec<SocketAddr> {
    backends.iter().map(Backend::addr).collect()
}

/// The routing header's value on the request a backend received last.
fn routed_as(backend: &Backend) -> Option<String> {
    let last = backend.requests().pop()?;
    last.header_values(HEADER).first().map(|v| v.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_of_one_prefix_go_to_the_backend_the_picker_names() {
    let (backends, epp, envoy) = fleet(4, false, Shape::default()).await;
    let mut homes: BTreeMap<usize, BTreeSet<usize>> = BTreeMap::new();
    for round in 0..3 {
        for group in 0..8 {
            let reply = post(
                &envoy,
                chat(&format!("group {group} "), &format!("q{round}")),
            )
            .await;
            assert_eq!(reply.status, 200, "{}", reply.body);
            let served = reply.backend.expect("x-backend");
            homes.entry(group).or_default().insert(served);
            let named = routed_as(&backends[served]).expect("the routing header reached it");
            let first = named.split(',').next().unwrap_or_default();
            assert_eq!(
                first,
                backends[served].addr().to_string(),
                "served elsewhere than picked"
            );
            assert_eq!(
                named.split(',').count(),
                2,
                "the pick and one fallback: {named}"
            );
        }
    }
    for (group, served) in &homes {
        assert_eq!(served.len(), 1, "group {group} went to {served:?}");
    }
    let used: BTreeSet<_> = homes.values().flatten().collect();
    assert!(used.len() > 1, "8 groups all on one backend: {used:?}");
    let routed = || epp.stats.total(stat_names::ROUTED_PREFIX);
    wait_until("requests counted routed", routed, |n| n == 24).await;
    // The engines' own /metrics, polled at each endpoint's address.
    wait_for_stat(&epp, Counter::EnginePollOk.name(), |n| n >= 4).await;
    assert_eq!(epp.stats.value(Counter::EnginePollFailed.name()), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_single_address_mode_names_only_the_pick() {
    let (backends, _epp, envoy) = fleet(2, true, Shape::default()).await;
    let reply = post(&envoy, chat("single ", "q")).await;
    assert_eq!(reply.status, 200);
    let named = routed_as(&backends[reply.backend.unwrap()]).unwrap();
    assert!(!named.contains(','), "{named}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_subset_hint_keeps_every_pick_within_it() {
    let backends = Backend::start_many(4).await.unwrap();
    let subset = vec![
        backends[1].addr().to_string(),
        backends[3].addr().to_string(),
    ];
    let epp = start_epp(&addrs(&backends), CONFIG, false).await;
    wait_ready(&epp).await;
    let shape = Shape {
        subset: Some(subset.clone()),
        ..Shape::default()
    };
    let envoy = start_envoy(&backends, epp.addr, shape).await;
    for group in 0..12 {
        let reply = post(&envoy, chat(&format!("subset {group} "), "q")).await;
        assert_eq!(reply.status, 200, "{}", reply.body);
        let served = reply.backend.unwrap();
        assert!(
            [1, 3].contains(&served),
            "group {group} went to backend {served}"
        );
        let named = routed_as(&backends[served]).unwrap();
        assert!(
            named.split(',').all(|a| subset.iter().any(|s| s == a)),
            "{named}"
        );
    }
    assert_eq!(backends[0].received() + backends[2].received(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subset_with_nothing_eligible_is_answered_503() {
    // An address outside the pool: nothing in the subset is eligible.
    let shape = Shape {
        subset: Some(vec!["127.0.0.1:1".into()]),
        ..Shape::default()
    };
    let (backends, epp, envoy) = fleet(2, false, shape).await;
    let reply = post(&envoy, chat("none eligible ", "q")).await;
    assert_eq!(reply.status, 503, "{}", reply.body);
    assert!(reply.body.contains("subset"), "{}", reply.body);
    assert_eq!(backends[0].received() + backends[1].received(), 0);
    wait_for_stat(
        &epp,
        &stat_names::fallback(Fallback::NoHealthyEndpoint),
        |n| n == 1,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pick_that_refuses_is_retried_on_its_fallback_and_the_picker_learns_it() {
    let (backends, epp, envoy) = fleet(2, false, Shape::default()).await;
    let dead = backends[0].addr().to_string();
    backends[0].kill().await;
    // Each new prefix is placed on one of the two: the first placed on the dead one is served by
    // its fallback, and the picker (told who served) avoids the dead one from then on.
    let mut rescued = 0;
    for group in 0..16 {
        let reply = post(&envoy, chat(&format!("refused {group} "), "q")).await;
        assert_eq!(reply.status, 200, "{}", reply.body);
        assert_eq!(reply.backend, Some(1));
        let named = routed_as(&backends[1]).unwrap();
        if named.starts_with(&dead) {
            assert_eq!(named, format!("{dead},{}", backends[1].addr()));
            rescued += 1;
        }
    }
    assert!(
        rescued >= 1,
        "no request was placed on the dead backend first"
    );
    wait_for_stat(&epp, Counter::SuspectMarked.name(), |n| n >= 1).await;
    wait_for_stat(&epp, Counter::ServedElsewhere.name(), |n| n >= 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_picker_down_fail_open_goes_by_round_robin_and_fail_closed_answers_503() {
    let backends = Backend::start_many(2).await.unwrap();
    // A port nothing listens on.
    let down = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let open = start_envoy(
        &backends,
        down,
        Shape {
            fail_open: true,
            ..Shape::default()
        },
    )
    .await;
    for i in 0..6 {
        let reply = post(&open, chat("down ", &format!("q{i}"))).await;
        assert_eq!(reply.status, 200, "{}", reply.body);
    }
    assert!(
        backends[0].received() > 0 && backends[1].received() > 0,
        "round robin spreads one prefix: {} and {}",
        backends[0].received(),
        backends[1].received()
    );
    assert!(
        backends.iter().all(|b| routed_as(b).is_none()),
        "nothing named a backend"
    );
    drop(open);
    let closed = start_envoy(&backends, down, Shape::default()).await;
    let before = backends[0].received() + backends[1].received();
    let reply = post(&closed, chat("down ", "q")).await;
    assert_eq!(reply.status, 503, "{}", reply.body);
    assert_eq!(backends[0].received() + backends[1].received(), before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_the_core_cannot_read_goes_on_unchanged_to_envoys_balancer() {
    let (backends, epp, envoy) = fleet(2, false, Shape::default()).await;
    let body = b"this is not json".to_vec();
    let reply = post(&envoy, body.clone()).await;
    assert_eq!(reply.status, 200);
    let served = reply.backend.unwrap();
    assert_eq!(reply.body, backend::json_response(served, true));
    let got = backends[served].requests().pop().unwrap();
    assert!(got.body == body, "body bytes changed on the way");
    assert!(
        got.header_values(HEADER).is_empty(),
        "a bad body was routed"
    );
    wait_for_stat(&epp, &stat_names::fallback(Fallback::BadJson), |n| n == 1).await;
}
