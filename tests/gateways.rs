//! Three gateways, each an Envoy with kvroute and nothing shared between them, act as one: once
//! they have seen the groups, each group has one home whichever gateway a request reaches and the
//! homes are balanced; a restarted gateway, once it has seen them again, uses the same homes; a
//! hot group spills along the same path at every gateway and comes back when its home drains.

use crate::common;

use common::{
    chat_body, debug_config, served_by, system_prompt, wait_for_fresh_poll, warm_up, Fleet,
};
use kvroute_harness::backend::Backend;
use kvroute_harness::{Envoy, EnvoyOptions, Lb};
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

const GATEWAYS: usize = 3;
const GROUPS: usize = 24;

/// Starts one gateway in front of `backends` and waits until it knows them all.
async fn gateway(backends: &[Backend]) -> Fleet {
    let fleet = bare_gateway(backends).await;
    warm_up(&fleet, 0..GROUPS).await;
    fleet
}

/// A gateway that has seen no group yet.
async fn bare_gateway(backends: &[Backend]) -> Fleet {
    let envoy = Envoy::start(EnvoyOptions {
        backends: backends.iter().map(Backend::addr).collect(),
        lb: Lb::Kvroute {
            plugin_config: debug_config(),
        },
        ..EnvoyOptions::default()
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let fleet = Fleet {
        backends: Vec::new(),
        envoy,
        client: common::client(),
    };
    fleet.wait_endpoints_known(backends.len()).await;
    fleet
}

/// Which gateway request `n` goes to: scattered, as a round-robin front or DNS would, and the
/// same in every run.
fn pick(n: usize) -> usize {
    (xxhash_rust::xxh3::xxh3_64(&n.to_le_bytes()) % GATEWAYS as u64) as usize
}

/// Sends `rounds` questions of every group, each to a scattered gateway, one at a time; records
/// which backends served each group.
async fn ask_all(gateways: &[Fleet], rounds: usize, tag: &str, served: &mut Served) {
    for round in 0..rounds {
        for group in 0..GROUPS {
            let n = served.values().map(BTreeSet::len).sum::<usize>() + round * GROUPS + group;
            let gw = &gateways[pick(n + tag.len())];
            let question = format!("{tag} question {round}");
            let reply = gw
                .chat(&chat_body(&system_prompt(group), &question, false))
                .await;
            served
                .entry(group)
                .or_default()
                .insert(served_by(gw, &reply));
        }
    }
}

type Served = BTreeMap<usize, BTreeSet<usize>>;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_gateways_give_each_group_one_home_even_after_one_restarts() {
    let backends = Backend::start_many(4).await.unwrap();
    let mut gateways = Vec::new();
    for _ in 0..GATEWAYS {
        gateways.push(gateway(&backends).await);
    }
    let mut served = Served::new();
    ask_all(&gateways, 3, "before", &mut served).await;

    // A gateway restarts: a new Envoy with empty shared data takes its place and sees the groups.
    gateways[1] = gateway(&backends).await;
    ask_all(&gateways, 3, "after", &mut served).await;

    let split: Vec<_> = served.iter().filter(|(_, b)| b.len() != 1).collect();
    assert!(
        split.len() * 20 <= GROUPS,
        "fewer than 95% of groups had one home: {split:?}"
    );
    let mut per_backend = BTreeMap::<usize, usize>::new();
    for backends in served.values().filter(|b| b.len() == 1) {
        backends
            .iter()
            .for_each(|b| *per_backend.entry(*b).or_default() += 1);
    }
    assert!(
        per_backend.len() == 4 && per_backend.values().all(|&n| n <= GROUPS.div_ceil(4)),
        "homes are not balanced: groups per backend {per_backend:?}"
    );
}

/// The one conversation of the hot group the test follows (a group that carries most of the
/// traffic may span several replicas, each taking its share of the conversations).
const QUESTION: &str = "are you there";

/// Sends the group's question to gateway `gw` until its decision is `want`, then waits for two
/// more polls there so every worker has the same view.
async fn until_decision(gw: &Fleet, group: usize, want: &str) -> usize {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let reply = gw
            .chat(&chat_body(&system_prompt(group), QUESTION, false))
            .await;
        if reply.decision.as_deref() == Some(want) {
            wait_for_fresh_poll(gw).await;
            return served_by(gw, &reply);
        }
        assert!(
            Instant::now() < deadline,
            "no `{want}` decision within 20 s: {reply:?}"
        );
    }
}

/// The question of `group` through `gw`: the backend that served it and kvroute's decision.
async fn ask(gw: &Fleet, group: usize) -> (usize, Option<String>) {
    let body = chat_body(&system_prompt(group), QUESTION, false);
    let reply = gw.chat(&body).await;
    (served_by(gw, &reply), reply.decision)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_group_spills_to_the_same_replica_at_every_gateway_and_comes_back() {
    let backends = Backend::start_many(4).await.unwrap();
    let mut gateways = Vec::new();
    let group = 7;
    for _ in 0..GATEWAYS {
        let gw = bare_gateway(&backends).await;
        warm_up(&gw, group..group + 1).await;
        gateways.push(gw);
    }
    let (home, decision) = ask(&gateways[0], group).await;
    assert_eq!(decision.as_deref(), Some("home"));

    // Its home's engine queues (traffic from elsewhere): every gateway spills the group to the
    // same next replica.
    backends[home].set_engine_waiting(50);
    let mut spills = BTreeSet::new();
    for gw in &gateways {
        spills.insert(until_decision(gw, group, "spread").await);
    }
    for gw in &gateways {
        let (b, d) = ask(gw, group).await;
        assert_eq!(d.as_deref(), Some("spread"));
        spills.insert(b);
    }
    assert_eq!(spills.len(), 1, "gateways spilled to {spills:?}");
    assert!(!spills.contains(&home));

    // Drained: every gateway sends it home again.
    backends[home].set_engine_waiting(0);
    for gw in &gateways {
        assert_eq!(until_decision(gw, group, "home").await, home);
    }
    for gw in &gateways {
        assert_eq!(ask(gw, group).await, (home, Some("home".into())));
    }
}
