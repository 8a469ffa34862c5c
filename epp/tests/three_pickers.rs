//! Three pickers, each behind its own Envoy with nothing shared between them, act as one, as three
//! gateways with the filter do (tests/gateways.rs): once each has seen the groups, each group has
//! one home whichever picker a request reaches, and the homes are balanced.

use crate::common;

use kvroute::gateway::stat_names::{Counter, Gauge};
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::{chat, post, start_envoy, start_epp, wait_for_stat, wait_ready, Shape};
use kvroute_epp::Running;
use kvroute_harness::backend::Backend;
use kvroute_harness::Envoy;

const PICKERS: usize = 3;
const GROUPS: usize = 24;

/// Group `group`'s request of `round`.
fn ask(group: usize, round: &str) -> String {
    chat(&format!("group {group} "), round)
}

/// A picker with the shipped config over `backends` and an Envoy asking it, once the picker has
/// seen every group twice and placed them.
async fn gateway(backends: &[Backend]) -> (Running, Envoy) {
    let addrs: Vec<SocketAddr> = backends.iter().map(Backend::addr).collect();
    let epp = start_epp(&addrs, kvroute_epp::settings::DEFAULT_CONFIG, false).await;
    wait_ready(&epp).await;
    let envoy = start_envoy(backends, epp.addr, Shape::default()).await;
    for round in ["warm-up 0", "warm-up 1"] {
        for group in 0..GROUPS {
            assert_eq!(post(&envoy, ask(group, round)).await.status, 200);
        }
    }
    wait_for_stat(&epp, Gauge::GroupsPlaced.name(), |n| n >= GROUPS as i64).await;
    // One worker placed them; the other reads the groups table on its tick, once a `FLUSH_MS`.
    // Then the homes hold (`HOLD_POLLS`) before groups leave their first rendezvous choice for
    // them: six more polls.
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(kvroute::placement::FLUSH_MS) {
        fresh_poll(&epp).await;
    }
    for _ in 0..3 {
        fresh_poll(&epp).await;
    }
    (epp, envoy)
}

/// Waits for two more of the picker's polls of the pool.
async fn fresh_poll(epp: &Running) {
    let now = epp.stats.value(Counter::StatsPollOk.name());
    wait_for_stat(epp, Counter::StatsPollOk.name(), |n| n >= now + 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_pickers_give_each_group_one_home() {
    let backends = Backend::start_many(4).await.unwrap();
    let mut gateways = Vec::new();
    for _ in 0..PICKERS {
        gateways.push(gateway(&backends).await);
    }
    let mut served: BTreeMap<usize, BTreeSet<usize>> = BTreeMap::new();
    for round in 0..3 {
        for group in 0..GROUPS {
            // Scattered over the pickers, as a round-robin front or DNS would.
            let n = round * GROUPS + group;
            let (_, envoy) = &gateways[(n * 7 + round) % PICKERS];
            let reply = post(envoy, ask(group, &format!("question {round}"))).await;
            assert_eq!(reply.status, 200, "{}", reply.body);
            let backend = reply.backend.expect("x-backend");
            served.entry(group).or_default().insert(backend);
        }
    }
    let split: Vec<_> = served.iter().filter(|(_, b)| b.len() != 1).collect();
    assert!(
        split.len() * 20 <= GROUPS,
        "fewer than 95% of groups had one home: {split:?}"
    );
    let mut per_backend = BTreeMap::<usize, usize>::new();
    for homes in served.values().filter(|b| b.len() == 1) {
        homes
            .iter()
            .for_each(|b| *per_backend.entry(*b).or_default() += 1);
    }
    assert!(
        per_backend.len() == 4 && per_backend.values().all(|&n| n <= GROUPS.div_ceil(4)),
        "homes are not balanced: groups per backend {per_backend:?}"
    );
}
