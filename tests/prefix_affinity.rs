//! Requests sharing a long prompt prefix land on one backend, and a gateway that has seen the
//! groups spreads them evenly: four groups on four backends, one each.

use crate::common;

use common::{chat_body, debug_config, served_by, system_prompt, warm_up, Fleet};
use std::collections::{HashMap, HashSet};

const GROUPS: usize = 4;
const PER_GROUP: usize = 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_prefix_group_sticks_to_one_backend_and_the_groups_spread_over_all() {
    let fleet = Fleet::kvroute(4, debug_config(), |o| o.concurrency = 2).await;
    warm_up(&fleet, 0..GROUPS).await;
    let mut served: HashMap<usize, Vec<usize>> = HashMap::new();
    for i in 0..PER_GROUP {
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
        let distinct: HashSet<_> = backends.iter().collect();
        assert_eq!(distinct.len(), 1, "group {g} is spread over {backends:?}");
        homes.insert(backends[0]);
    }
    assert_eq!(
        homes.len(),
        GROUPS,
        "{GROUPS} groups on 4 backends share some: {served:?}"
    );
}
