//! The shipped failure policy: a kvroute VM that traps is reloaded and routes again, instead of
//! being left disabled for good (what `FAIL_OPEN` does). The trap is made on purpose through the
//! test-only `unsafe_trap_path_for_tests` config field, which the shipped config never sets.

use crate::common;

use common::{
    ask, chat_body, debug_config, inflight_gauges, kv_stat, served_by, system_prompt,
    wait_for_fresh_poll, wait_for_polls, Fleet,
};
use kvroute::gateway::stat_names::{Counter, Gauge};
use kvroute::policy::cache_aware::HOLD_POLLS;
use std::sync::Arc;
use std::time::{Duration, Instant};

const TRAP: &str = "/kvroute-test/trap";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trapped_vm_is_reloaded_and_routes_again() {
    let mut config = debug_config();
    config["unsafe_trap_path_for_tests"] = TRAP.into();
    // One worker, so one VM: after the trap no other worker can answer for it.
    let fleet = Fleet::kvroute(2, config, |o| o.concurrency = 1).await;
    let before = fleet.chat(&ask(0, 0)).await;
    assert_eq!(before.status, 200);
    assert!(
        routed(&before),
        "routed by kvroute before the trap: {before:?}"
    );

    let trapped = trap(&fleet).await;
    // The request that trapped the VM is not served by the filter; what Envoy answers it with
    // (a local 5xx or a reset) is Envoy's business.
    if let Ok(reply) = &trapped {
        assert!(!reply.status().is_success(), "{:?}", reply.status());
    }

    // Envoy reloads the VM on a later request once the shipped backoff (from 0.1 s) allows; until
    // then it answers 503. Wait for a request the reloaded VM answers (its decision header).
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut i = 1;
    let answered = loop {
        let reply = fleet
            .client
            .post(format!("{}/v1/chat/completions", fleet.envoy.url()))
            .header("content-type", "application/json")
            .body(ask(0, i).to_string())
            .send()
            .await;
        i += 1;
        if let Ok(reply) = reply {
            let decided = reply.headers().contains_key("x-kvroute-decision");
            if reply.status().is_success() && decided {
                break true;
            }
        }
        if Instant::now() > deadline {
            break false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        answered,
        "kvroute never answered again after its VM trapped:\n{}",
        fleet.envoy.log_tail()
    );
    // The reloaded VM rediscovers the endpoints and routes on.
    fleet.wait_endpoints_known(2).await;
    let after = fleet.chat(&ask(1, 0)).await;
    assert_eq!(after.status, 200);
    assert!(routed(&after), "routed by the reloaded VM: {after:?}");
}

/// Whether kvroute routed `reply`'s request: a decision, not a fallback to Envoy's balancer.
fn routed(reply: &common::Reply) -> bool {
    reply
        .decision
        .as_deref()
        .is_some_and(|d| !d.starts_with("fallback"))
}

/// Streams in flight when a VM traps are never settled by it (shared data outlives the VM, the
/// reloaded VM never saw them): the counts it wrote to shared data are left behind, and the poll's
/// correction against Envoy's `rq_active` is what removes them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counts_a_trapped_vm_left_behind_are_corrected_against_rq_active() {
    let mut config = debug_config();
    config["unsafe_trap_path_for_tests"] = TRAP.into();
    let fleet = Arc::new(Fleet::kvroute(2, config, |o| o.concurrency = 1).await);
    fleet.wait_endpoints_known(2).await;
    for b in &fleet.backends {
        b.set_delay(Duration::from_secs(8));
    }
    let slow: Vec<_> = (0..4)
        .map(|i| {
            let fleet = fleet.clone();
            tokio::spawn(async move {
                let body = chat_body(&system_prompt(i), &format!("slow {i}"), false);
                fleet.chat(&body).await
            })
        })
        .collect();
    let counted = async {
        loop {
            if inflight_gauges(&fleet).await.values().sum::<u64>() == 4 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), counted)
        .await
        .expect("the four slow requests were never all counted in flight");
    // The worker writes its counts to shared data on its ticks, and polls on them after: two
    // polls on, the counts are there to be left behind.
    wait_for_fresh_poll(&fleet).await;
    assert!(
        fleet.backends.iter().map(|b| b.in_flight()).sum::<u64>() == 4,
        "the slow requests ended before the trap: the test proves nothing"
    );

    let _ = trap(&fleet).await;
    for request in slow {
        // What becomes of a stream whose filter VM died is Envoy's business; that it ends is ours.
        let _ = request.await;
    }
    for b in &fleet.backends {
        b.set_delay(Duration::ZERO);
    }
    // Requests reload the VM; once it polls again, Envoy has nothing in flight, and the counts the
    // dead VM left are lowered (three polls in a row must show them above `rq_active`).
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut i = 0;
    while kv_stat(&fleet, Counter::InflightCorrected.name()).await == 0 {
        let _ = fleet.chat(&ask(9, i)).await;
        i += 1;
        assert!(
            Instant::now() < deadline,
            "the counts the trapped VM left were never corrected: {:?}\n{}",
            inflight_gauges(&fleet).await,
            fleet.envoy.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let left: u64 = inflight_gauges(&fleet).await.values().sum();
    assert!(left < 4, "gauges still show all four: {left}");
}

/// Sends the request that traps the VM, and waits until Envoy has logged the trap.
async fn trap(fleet: &Fleet) -> Result<reqwest::Response, reqwest::Error> {
    let reply = fleet
        .client
        .post(format!("{}{TRAP}", fleet.envoy.url()))
        .body("{}")
        .send()
        .await;
    wait_for_log(fleet, "trapping on purpose").await;
    reply
}

/// Waits until Envoy's log shows `needle` (the trap's panic message).
async fn wait_for_log(fleet: &Fleet, needle: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !fleet.envoy.log().contains(needle) {
        assert!(
            Instant::now() < deadline,
            "no {needle:?} in Envoy's log:\n{}",
            fleet.envoy.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A VM that reloads in a running gateway sends each group where the gateway did: it adopts the
/// weights the gateway published (`src/leader.rs`) instead of warming up on each group's first
/// rendezvous choice, which moved every group the balanced assignment had placed elsewhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reloaded_vm_sends_each_group_where_the_gateway_did() {
    let mut config = debug_config();
    config["unsafe_trap_path_for_tests"] = TRAP.into();
    // One worker, so the VM that reloads is the one that answers next.
    let fleet = Fleet::kvroute(4, config, |o| o.concurrency = 1).await;
    let homes = || async {
        let mut homes = Vec::new();
        for g in 0..8 {
            homes.push(served_by(&fleet, &fleet.chat(&ask(g, 100)).await));
        }
        homes
    };
    for i in 0..2 {
        for g in 0..8 {
            served_by(&fleet, &fleet.chat(&ask(g, i)).await);
        }
    }
    // Past the warm-up (10 polls) every group is placed; its home holds 4 polls before it moves.
    let placed = fleet.envoy.wait_for_stat(
        Gauge::GroupsPlaced.name(),
        |v| v == 8,
        Duration::from_secs(30),
    );
    placed.await.unwrap_or_else(|e| panic!("{e}"));
    // Then until the homes stay put for longer than a home holds before a group moves there.
    let mut before = homes().await;
    loop {
        wait_for_polls(&fleet.envoy, HOLD_POLLS + 1).await;
        let now = homes().await;
        if now == before {
            break;
        }
        before = now;
    }

    let _ = trap(&fleet).await;
    // Requests reload the VM; once it has ticked (two polls on), it routes each group. A VM that
    // warmed up on its own would send them to their first rendezvous choices for 10 polls.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let reply = fleet
            .client
            .post(format!("{}/v1/chat/completions", fleet.envoy.url()))
            .header("content-type", "application/json")
            .body(ask(9, 0).to_string())
            .send()
            .await;
        // Until the VM is back, Envoy answers 503 (or resets): its business, not kvroute's.
        if reply.is_ok_and(|r| r.headers().contains_key("x-kvroute-decision")) {
            break;
        }
        assert!(Instant::now() < deadline, "{}", fleet.envoy.log_tail());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    wait_for_fresh_poll(&fleet).await;
    assert_eq!(homes().await, before, "the reloaded VM moved groups");
}
