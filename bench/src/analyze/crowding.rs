//! Where each router's cold prefills came from: requests whose replica had under a quarter of the
//! prompt cached, split into a group's first request on that replica and a group served there
//! before (the replica evicted it); and how many requests after 25 s went to a replica crowded
//! with more than an even share of the groups sent more than once in the 8 s before (under cache
//! pressure, more groups than its cache has room for).

use super::group_of;
use crate::driver::Sample;
use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::hash::Hash;

/// How far back a replica's groups count.
pub const WINDOW_MS: f64 = 8_000.0;
/// From when requests are counted as crowded or not.
pub const LATE_MS: f64 = 25_000.0;

/// One router's requests by where their cold prefills came from and whether they were crowded.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Crowding {
    pub requests: usize,
    pub first_on_replica: usize,
    pub evicted: usize,
    pub late: usize,
    pub crowded: usize,
}

/// The groups each replica served over the last `window_ms`: a replica that served more than an
/// even share of the groups sent more than once (`recurring` of them over `replicas`) holds,
/// under cache pressure, more prompts than its cache has room for.
pub struct Window<G> {
    window_ms: f64,
    even: usize,
    lately: HashMap<u64, HashMap<G, f64>>,
}

impl<G: Hash + Eq> Window<G> {
    pub fn new(window_ms: f64, recurring: usize, replicas: usize) -> Self {
        Window {
            window_ms,
            even: recurring.div_ceil(replicas.max(1)),
            lately: HashMap::new(),
        }
    }

    /// Notes that `replica` served `group` (`None`: a prompt sent once) at `at_ms`, in send
    /// order, and says whether the replica is crowded now.
    pub fn served(&mut self, replica: u64, group: Option<G>, at_ms: f64) -> bool {
        let recent = self.lately.entry(replica).or_default();
        if let Some(group) = group {
            recent.insert(group, at_ms);
        }
        recent.retain(|_, at| at_ms - *at < self.window_ms);
        recent.len() > self.even
    }
}

/// `samples`' requests that say which replica served them and how long their prompt was, by
/// where their cold prefills came from.
pub fn crowding(samples: &[Sample]) -> Crowding {
    let mut served_by: Vec<(&Sample, usize, u64)> = samples
        .iter()
        .filter_map(|s| Some((s, s.replica?, s.prompt_tokens?)))
        .collect();
    served_by.sort_by(|a, b| a.0.sent_ms.total_cmp(&b.0.sent_ms));
    // Groups sent more than once (a unique prompt takes no room in a cache for long).
    let mut sent: HashMap<&str, usize> = HashMap::new();
    for (s, _, _) in &served_by {
        *sent.entry(group_of(&s.user)).or_default() += 1;
    }
    let recurring = |g: &str| sent.get(g).is_some_and(|&n| n > 1);
    let replicas: HashSet<usize> = served_by.iter().map(|&(_, r, _)| r).collect();
    let groups = sent.keys().filter(|g| recurring(g)).count();
    let mut window = Window::new(WINDOW_MS, groups, replicas.len());
    let mut served: HashSet<(&str, usize)> = HashSet::new();
    let mut c = Crowding {
        requests: served_by.len(),
        ..Crowding::default()
    };
    for &(s, replica, prompt) in &served_by {
        let group = group_of(&s.user);
        if s.cached_tokens.unwrap_or(0) * 4 < prompt {
            match served.contains(&(group, replica)) {
                true => c.evicted += 1,
                false => c.first_on_replica += 1,
            }
        }
        served.insert((group, replica));
        let recurring_group = Some(group).filter(|g| recurring(g));
        let crowded = window.served(replica as u64, recurring_group, s.sent_ms);
        if s.sent_ms >= LATE_MS {
            c.late += 1;
            c.crowded += usize::from(crowded);
        }
    }
    c
}

/// The table of every router of a run.
pub fn table(runs: &[(String, Vec<Sample>)]) -> String {
    let mut s =
        "| router | requests | cold: first on its replica | cold: evicted | after 25 s | to a \
                 crowded replica |\n|---|---:|---:|---:|---:|---:|\n"
            .to_string();
    for (router, samples) in runs {
        let c = crowding(samples);
        let _ = writeln!(
            s,
            "| {router} | {} | {} | {} | {} | {} |",
            c.requests, c.first_on_replica, c.evicted, c.late, c.crowded
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::served as sample;

    #[test]
    fn a_cold_request_is_first_on_its_replica_or_evicted_there() {
        let samples = vec![
            sample("u1-0-0", 0.0, 0, 0),      // cold, first of u1 on 0
            sample("u1-1-0", 1_000.0, 0, 90), // warm
            sample("u1-2-0", 2_000.0, 0, 10), // cold again on 0: evicted
            sample("u1-3-0", 3_000.0, 1, 0),  // cold, first of u1 on 1
            Sample {
                replica: None,
                ..sample("u2-0-0", 4_000.0, 0, 0) // no replica: not counted
            },
        ];
        let c = crowding(&samples);
        assert_eq!(
            c,
            Crowding {
                requests: 4,
                first_on_replica: 2,
                evicted: 1,
                late: 0,
                crowded: 0
            }
        );
    }

    #[test]
    fn a_replica_serving_more_than_its_share_of_the_groups_is_crowded() {
        // Four recurring groups on two replicas: an even share is two. Replica 0 serves three of
        // them within the window after 25 s, replica 1 one.
        let mut samples = Vec::new();
        for (i, g) in ["u1", "u2", "u3", "u4"].iter().enumerate() {
            samples.push(sample(&format!("{g}-0-0"), i as f64, 1, 0));
        }
        for (i, g) in ["u1", "u2", "u3"].iter().enumerate() {
            samples.push(sample(&format!("{g}-1-0"), 30_000.0 + i as f64, 0, 0));
        }
        let c = crowding(&samples);
        assert_eq!((c.late, c.crowded), (3, 1), "{c:?}");
        let t = table(&[("kvroute".into(), samples)]);
        assert!(t.ends_with("| kvroute | 7 | 7 | 0 | 3 | 1 |\n"), "{t}");
    }
}
