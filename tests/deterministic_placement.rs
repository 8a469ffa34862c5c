#![cfg(not(target_arch = "wasm32"))]
//! Two Envoys with the same config and no shared state place the same new prefixes on the same
//! backends, so a fleet of proxies agrees without coordinating.

mod common;

use common::{chat_body, debug_config, served_by, system_prompt, Fleet};
use kvroute_harness::backend::Backend;
use kvroute_harness::{Envoy, EnvoyOptions, Lb};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_independent_envoys_place_new_prefixes_on_the_same_backends() {
    let backends = Backend::start_many(4).await.unwrap();
    let start = || {
        Envoy::start(EnvoyOptions {
            backends: backends.iter().map(Backend::addr).collect(),
            lb: Lb::Kvroute {
                plugin_config: debug_config(),
            },
            ..EnvoyOptions::default()
        })
    };
    let a = start().await.unwrap_or_else(|e| panic!("{e}"));
    let b = start().await.unwrap_or_else(|e| panic!("{e}"));
    let a = Fleet {
        backends,
        envoy: a,
        client: common::client(),
    };
    a.wait_endpoints_known(4).await;
    let b = Fleet {
        backends: Vec::new(),
        envoy: b,
        client: common::client(),
    };
    b.wait_endpoints_known(4).await;

    let mut placements = Vec::new();
    for p in 0..16 {
        let body = chat_body(
            &format!("{} variant {p}", system_prompt(100 + p)),
            "hello",
            false,
        );
        let on_a = a.chat(&body).await;
        let on_b = b.chat(&body).await;
        assert_eq!(on_a.decision.as_deref(), Some("new_prefix"), "{on_a:?}");
        assert_eq!(on_b.decision.as_deref(), Some("new_prefix"), "{on_b:?}");
        placements.push((served_by(&a, &on_a), served_by(&a, &on_b)));
    }
    let disagree: Vec<_> = placements.iter().filter(|(x, y)| x != y).collect();
    assert!(
        disagree.is_empty(),
        "envoys disagree on {disagree:?} of {placements:?}"
    );
    let used: std::collections::HashSet<_> = placements.iter().map(|(x, _)| x).collect();
    assert!(
        used.len() > 1,
        "16 new prefixes all on one backend: {placements:?}"
    );
}
