#![cfg(not(target_arch = "wasm32"))]
//! Requests sharing a long prompt prefix land on one backend, and different prefixes spread out.

mod common;

use common::{chat_body, debug_config, served_by, system_prompt, Fleet};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

const GROUPS: usize = 4;
const PER_GROUP: usize = 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_prefix_group_sticks_to_one_backend_and_groups_use_three_or_more_backends() {
    let fleet = Arc::new(Fleet::kvroute(4, debug_config(), |o| o.concurrency = 2).await);
    // First requests go out together while backends are slow, so each new prefix sees the others'
    // load and is placed on a different backend.
    for b in &fleet.backends {
        b.set_delay(Duration::from_millis(200));
    }
    let firsts: Vec<_> = (0..GROUPS)
        .map(|g| {
            let fleet = fleet.clone();
            tokio::spawn(async move {
                fleet
                    .chat(&chat_body(&system_prompt(g), "first question", false))
                    .await
            })
        })
        .collect();
    let mut served: HashMap<usize, Vec<usize>> = HashMap::new();
    for (g, first) in firsts.into_iter().enumerate() {
        let reply = first.await.unwrap();
        served.entry(g).or_default().push(served_by(&fleet, &reply));
    }
    for b in &fleet.backends {
        b.set_delay(Duration::ZERO);
    }
    for i in 1..PER_GROUP {
        // Rotate the order each round so no cyclic policy can line up with the groups by chance.
        for g in (0..GROUPS).map(|k| (k + i) % GROUPS) {
            let reply = fleet
                .chat(&chat_body(
                    &system_prompt(g),
                    &format!("question {i} about topic {g}"),
                    false,
                ))
                .await;
            served.entry(g).or_default().push(served_by(&fleet, &reply));
        }
    }
    let mut homes = HashSet::new();
    for (g, backends) in &served {
        let mut counts: HashMap<usize, usize> = HashMap::new();
        for b in backends {
            *counts.entry(*b).or_default() += 1;
        }
        let (home, hits) = counts
            .iter()
            .max_by_key(|(_, n)| **n)
            .map(|(b, n)| (*b, *n))
            .unwrap();
        assert!(
            hits * 100 >= PER_GROUP * 95,
            "group {g} is spread over {counts:?}"
        );
        homes.insert(home);
    }
    assert!(
        homes.len() >= 3,
        "groups share too few backends: {served:?}"
    );
}
