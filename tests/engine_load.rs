//! An engine that reports a queue in its own `/metrics` (traffic from other gateways, which this
//! Envoy cannot see) is full: the groups homed on it go to their next replica until it drains,
//! then come back, and no other group moves.

use crate::common;

use common::{
    chat_body, debug_config, served_by, system_prompt, wait_for_fresh_poll, warm_up, Fleet,
};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Where each group goes now, one request each, with kvroute's decision.
async fn placements(
    fleet: &Fleet,
    groups: &[usize],
    tag: &str,
) -> BTreeMap<usize, (usize, String)> {
    let mut out = BTreeMap::new();
    for &g in groups {
        let reply = fleet.chat(&chat_body(&system_prompt(g), tag, false)).await;
        let decision = reply.decision.clone().unwrap_or_default();
        out.insert(g, (served_by(fleet, &reply), decision));
    }
    out
}

/// Places every group, one request each, until `done` holds for the placements (every worker's
/// view changed), at most 20 s; returns the last placements. One request of each group per round
/// keeps them equally popular, so their balanced homes stay as they were.
async fn placements_until(
    fleet: &Fleet,
    groups: &[usize],
    done: impl Fn(&BTreeMap<usize, (usize, String)>) -> bool,
) -> BTreeMap<usize, (usize, String)> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let now = placements(fleet, groups, "poll").await;
        if done(&now) {
            wait_for_fresh_poll(fleet).await;
            return placements(fleet, groups, "settled").await;
        }
        assert!(
            Instant::now() < deadline,
            "not settled within 20 s: {now:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queueing_engine_sheds_its_groups_until_it_drains() {
    let mut config = debug_config();
    config["engine_metrics_cluster"] = "inference_pool".into();
    let fleet = Fleet::kvroute(4, config, |_| {}).await;

    let groups: Vec<usize> = (0..32).collect();
    warm_up(&fleet, groups.iter().copied()).await;
    let before = placements(&fleet, &groups, "calm").await;
    let on_zero: Vec<usize> = before
        .iter()
        .filter(|(_, (b, _))| *b == 0)
        .map(|(g, _)| *g)
        .collect();
    assert!(
        !on_zero.is_empty(),
        "no group homed on backend 0: {before:?}"
    );

    fleet.backends[0].set_engine_waiting(500);
    let queued = placements_until(&fleet, &groups, |p| p.values().all(|(b, _)| *b != 0)).await;
    for (g, (b, d)) in &queued {
        if on_zero.contains(g) {
            assert_ne!(*b, 0, "group {g} went to the queueing engine");
            assert_eq!(d, "spread");
        } else {
            assert_eq!((*b, d.as_str()), (before[g].0, "home"), "group {g} moved");
        }
    }

    fleet.backends[0].set_engine_waiting(0);
    let after = placements_until(&fleet, &groups, |p| on_zero.iter().all(|g| p[g].0 == 0)).await;
    for (g, (b, d)) in &after {
        assert_eq!(
            (*b, d.as_str()),
            (before[g].0, "home"),
            "group {g} did not return"
        );
    }
}
