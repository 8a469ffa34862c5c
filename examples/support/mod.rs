//! What the examples that read a bench run's `samples.jsonl` share: which group a request is of,
//! and which requests went to a replica crowded with more groups than its share.

use std::collections::HashMap;
use std::hash::Hash;

/// The group of a request by its bench user: `u<group>-<member>-<episode>` is of `u<group>`, a
/// unique prompt (`u-unique-<n>`) is a group of its own.
pub fn group_of(user: &str) -> &str {
    if user.starts_with("u-unique-") {
        user
    } else {
        user.split('-').next().unwrap_or_default()
    }
}

/// The groups each replica served over the last `window_ms`: a replica that served more than an
/// even share of the groups sent more than once (`recurring` of them over `replicas`) holds, under
/// cache pressure, more prompts than its cache has room for.
pub struct Crowding<G> {
    window_ms: f64,
    even: usize,
    lately: HashMap<u64, HashMap<G, f64>>,
}

impl<G: Hash + Eq> Crowding<G> {
    pub fn new(window_ms: f64, recurring: usize, replicas: usize) -> Self {
        Crowding {
            window_ms,
            even: recurring.div_ceil(replicas.max(1)),
            lately: HashMap::new(),
        }
    }

    /// Notes that `replica` served `group` (`None`: a prompt sent once) at `at_ms`, in send order,
    /// and says whether the replica is crowded now.
    pub fn served(&mut self, replica: u64, group: Option<G>, at_ms: f64) -> bool {
        let recent = self.lately.entry(replica).or_default();
        if let Some(group) = group {
            recent.insert(group, at_ms);
        }
        recent.retain(|_, at| at_ms - *at < self.window_ms);
        recent.len() > self.even
    }
}
