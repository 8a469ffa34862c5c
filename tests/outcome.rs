//! A routed request's outcome settles the affinity it recorded: a success keeps it, whether its
//! engine reported usage (a whole answer) or not (a stream that did not ask, whose status is read
//! at its end), and a failed answer withdraws it.

use crate::common;

use kvroute::gateway::stat_names::Counter;
use kvroute_sim::engine::Faults;
use kvroute_sim::spec::FleetSpec;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn successes_keep_their_affinity_and_a_failure_withdraws_it() {
    let spec = FleetSpec {
        replicas: 2,
        time_scale: 0.01,
        ..FleetSpec::default()
    };
    let (sim, envoy) = common::kvroute_over_sim(spec).await;
    let http = reqwest::Client::new();
    let url = format!("{}/v1/chat/completions", envoy.url());
    let body = |q, stream| common::sim_question(&sim.spec.model, q, 4, stream);
    let withdrawn = || async {
        envoy
            .stat(Counter::AffinityWithdrawn.name())
            .await
            .unwrap()
            .unwrap_or(0)
    };
    // Each of these records its question for its engine; none may withdraw it.
    let successes = 6;
    for q in 0..successes {
        let resp = http
            .post(&url)
            .json(&body(q, q % 2 == 0))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let text = resp.text().await.unwrap();
        assert_eq!(
            text.contains("\"usage\""),
            q % 2 == 1,
            "only the whole answers report usage"
        );
    }
    // Every success has settled once the whole answers' usage is counted (the last request is
    // one): each request's end, on the one connection's worker, came before the next was routed.
    envoy
        .wait_for_stat(
            Counter::UsageResponses.name(),
            |v| v == successes as u64 / 2,
            Duration::from_secs(10),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(withdrawn().await, 0, "a success withdrew its affinity");

    // Every answer now fails (500: Envoy retries it once, on the other replica, which fails too):
    // the request withdraws what it recorded, a key or two, not the successes' keys.
    for r in &sim.replicas {
        r.replica.set_faults(Faults {
            fail_rate: 1.0,
            ..r.replica.faults()
        });
    }
    let resp = http
        .post(&url)
        .json(&body(successes, true))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 500);
    resp.bytes().await.unwrap();
    envoy
        .wait_for_stat(
            Counter::AffinityWithdrawn.name(),
            |v| v >= 1,
            Duration::from_secs(10),
        )
        .await
        .unwrap_or_else(|e| panic!("a failed answer kept its affinity: {e}"));
    let after = withdrawn().await;
    assert!(
        after < successes as u64,
        "{after} keys withdrawn: more than the failed request recorded"
    );
}
