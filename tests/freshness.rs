//! kvroute never routes on a picture of the fleet that has stopped updating: when Envoy's admin
//! stops answering its poll, requests go to Envoy's own load balancer (`fallback.stale_hosts`)
//! until it answers again; an engine whose `/metrics` stops answering is avoided
//! (`engine_poll.stale`), and with every engine silent requests fall back
//! (`fallback.stale_engine_loads`). No request is lost or hangs meanwhile, and kvroute routes
//! again once the answers are back.

use crate::common;

use common::{
    ask, client_per_request, debug_config, kv_stat, served_by, wait_for_fresh_poll, warm_up, Fleet,
    Reply,
};
use kvroute::gateway::stat_names::{self, Counter};
use kvroute::router::Fallback;
use kvroute_harness::gate::{Gate, GateMode};
use kvroute_harness::Lb;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// How long any one condition may take to come about on a loaded machine.
const BOUND: Duration = Duration::from_secs(30);

/// Sends questions (spread over Envoy's workers: a new connection each) until `done` holds for
/// a reply, at most [`BOUND`]; every reply must be a 200. Returns the replies sent.
async fn ask_until(fleet: &Fleet, what: &str, done: impl Fn(&Reply) -> bool) -> Vec<Reply> {
    let client = client_per_request();
    let deadline = Instant::now() + BOUND;
    let mut replies = Vec::new();
    for i in 0.. {
        let reply = fleet.chat_via(&client, &ask(i % 8, i)).await;
        served_by(fleet, &reply);
        let hit = done(&reply);
        replies.push(reply);
        if hit {
            return replies;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not within {BOUND:?}; last decisions {:?}\n{}",
            decisions(&replies),
            fleet.envoy.log_tail()
        );
    }
    unreachable!()
}

/// The last few replies' decisions, for failure messages.
fn decisions(replies: &[Reply]) -> Vec<String> {
    replies[replies.len().saturating_sub(8)..]
        .iter()
        .map(|r| r.decision.clone().unwrap_or_default())
        .collect()
}

fn is_fallback(reply: &Reply, reason: &str) -> bool {
    reply.decision.as_deref() == Some(&format!("fallback:{reason}"))
}

/// Once kvroute routes again, and every worker has seen two more polls: the next questions, to
/// every worker, are all routed by kvroute.
async fn assert_routing_again(fleet: &Fleet, what: &str) {
    ask_until(fleet, what, |r| {
        !r.decision.as_deref().unwrap_or("").starts_with("fallback:")
    })
    .await;
    wait_for_fresh_poll(fleet).await;
    let client = client_per_request();
    for i in 0..8 {
        let reply = fleet.chat_via(&client, &ask(i, 100 + i)).await;
        served_by(fleet, &reply);
        let decision = reply.decision.unwrap_or_default();
        assert!(!decision.starts_with("fallback:"), "{what}: {decision}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_admin_leaves_requests_to_envoy_until_it_answers_again() {
    let gate = Gate::start(GateMode::Open).await.expect("gate starts");
    let fleet = Fleet::start(
        3,
        Lb::Kvroute {
            plugin_config: debug_config(),
        },
        |o| {
            o.admin_target = Some(gate.addr());
        },
    )
    .await;
    gate.set_target(fleet.envoy.admin_addr());
    fleet.wait_endpoints_known(3).await;
    assert_routing_again(&fleet, "routing at start").await;
    assert_eq!(
        kv_stat(&fleet, &stat_names::fallback(Fallback::StaleHosts)).await,
        0
    );

    // Answering 503, then not answering at all (each poll times out).
    for mode in [GateMode::Failing, GateMode::Jammed] {
        let failed = kv_stat(&fleet, Counter::StatsPollFailed.name()).await;
        let stale = kv_stat(&fleet, &stat_names::fallback(Fallback::StaleHosts)).await;
        gate.set_mode(mode);
        let what = format!("{mode:?} admin");
        let replies = ask_until(&fleet, &what, |r| is_fallback(r, "stale_hosts")).await;
        assert!(
            kv_stat(&fleet, Counter::StatsPollFailed.name()).await > failed,
            "{what}: the poll failed"
        );
        let counted = kv_stat(&fleet, &stat_names::fallback(Fallback::StaleHosts)).await;
        let seen = replies
            .iter()
            .filter(|r| is_fallback(r, "stale_hosts"))
            .count();
        assert!(counted >= stale + seen as u64, "{what}: {counted} counted");

        gate.set_mode(GateMode::Open);
        assert_routing_again(&fleet, &format!("{what} answering again")).await;
    }
}

/// Where each group's next question goes, by backend index.
async fn homes(fleet: &Fleet, groups: &[usize], turn: usize) -> BTreeMap<usize, usize> {
    let mut out = BTreeMap::new();
    for &g in groups {
        out.insert(g, served_by(fleet, &fleet.chat(&ask(g, turn)).await));
    }
    out
}

/// Asks every group one question per round until `done` holds for where they went, at most
/// [`BOUND`]; then, after two more polls, once more: that placement is returned.
async fn homes_until(
    fleet: &Fleet,
    groups: &[usize],
    what: &str,
    done: impl Fn(&BTreeMap<usize, usize>) -> bool,
) -> BTreeMap<usize, usize> {
    let deadline = Instant::now() + BOUND;
    for turn in 1000.. {
        let now = homes(fleet, groups, turn).await;
        if done(&now) {
            wait_for_fresh_poll(fleet).await;
            return homes(fleet, groups, turn + 1_000_000).await;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not within {BOUND:?}: {now:?}"
        );
    }
    unreachable!()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_stops_reporting_is_avoided_and_all_silent_fall_back() {
    let mut config = debug_config();
    config["engine_metrics_cluster"] = "inference_pool".into();
    let fleet = Fleet::kvroute(3, config, |_| {}).await;
    let groups: Vec<usize> = (0..12).collect();
    warm_up(&fleet, groups.iter().copied()).await;
    let before = homes(&fleet, &groups, 1).await;
    assert!(
        before.values().any(|&b| b == 0),
        "no group on 0: {before:?}"
    );
    assert_eq!(kv_stat(&fleet, Counter::EnginePollStale.name()).await, 0);

    // Backend 0 serves requests and passes health checks, but its load is no longer known.
    fleet.backends[0].set_metrics_missing(true);
    let stale = fleet
        .envoy
        .wait_for_stat(Counter::EnginePollStale.name(), |v| v > 0, BOUND);
    stale.await.unwrap_or_else(|e| panic!("{e}"));
    let avoided = homes_until(&fleet, &groups, "backend 0 avoided", |h| {
        h.values().all(|&b| b != 0)
    })
    .await;
    for (g, b) in &avoided {
        assert_ne!(*b, 0, "group {g} went to the engine that stopped reporting");
        if before[g] != 0 {
            assert_eq!(*b, before[g], "group {g} moved though its home reports");
        }
    }
    let health = fleet.envoy.pool_health().await.unwrap();
    assert!(
        health.values().all(|h| *h),
        "avoided by kvroute, not ejected: {health:?}"
    );

    // No engine reports: no load to weigh, so Envoy's own balancer takes the requests.
    for b in &fleet.backends {
        b.set_metrics_missing(true);
    }
    let fell_back = kv_stat(&fleet, &stat_names::fallback(Fallback::StaleEngineLoads)).await;
    ask_until(&fleet, "every engine silent", |r| {
        is_fallback(r, "stale_engine_loads")
    })
    .await;
    assert!(kv_stat(&fleet, &stat_names::fallback(Fallback::StaleEngineLoads)).await > fell_back);

    for b in &fleet.backends {
        b.set_metrics_missing(false);
    }
    // Routed again, and backend 0 takes groups again (not necessarily the same ones: while it
    // was avoided its groups settled elsewhere).
    assert_routing_again(&fleet, "reporting again").await;
    homes_until(&fleet, &groups, "backend 0 used again", |h| {
        h.values().any(|&b| b == 0)
    })
    .await;
}
