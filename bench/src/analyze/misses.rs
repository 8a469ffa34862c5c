//! Where a run's uncached prompt tokens were: in a group's first request (nobody could have had
//! them), in a request on another replica than its group's or its conversation's last one (the
//! group moved, or its conversations split), or on the same replica (evicted there since).

use std::collections::HashMap;
use std::fmt::Write as _;

use super::{group_of, in_send_order};
use crate::driver::Sample;

/// The kinds of request, in table order.
pub const KINDS: [&str; 5] = [
    "group's first request",
    "group on another replica",
    "group on its last replica",
    "later turn on another replica",
    "later turn on its last replica",
];

/// Requests of one kind and the prompt tokens they found uncached.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Tally {
    pub requests: u64,
    pub uncached_tokens: u64,
}

/// A run's requests by kind ([`KINDS`]), with the prompt tokens of them all.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Misses {
    pub prompt_tokens: u64,
    pub by_kind: [Tally; KINDS.len()],
}

/// Sorts `samples`' answered requests (those with a replica and usage) by kind, in the order
/// they were sent. `None` when none has usage.
pub fn misses(samples: &[Sample]) -> Option<Misses> {
    let sent: Vec<(&Sample, usize, u64, u64)> = in_send_order(samples)
        .into_iter()
        .filter_map(|s| Some((s, s.replica?, s.prompt_tokens?, s.cached_tokens?)))
        .collect();
    if sent.is_empty() {
        return None;
    }
    let mut out = Misses::default();
    let mut group_at: HashMap<&str, usize> = HashMap::new();
    let mut conversation_at: HashMap<&str, usize> = HashMap::new();
    for (s, replica, prompt, cached) in sent {
        let group = group_of(&s.user);
        let kind = match (conversation_at.get(s.user.as_str()), group_at.get(group)) {
            (Some(&last), _) if last == replica => 4,
            (Some(_), _) => 3,
            (None, None) => 0,
            (None, Some(&last)) if last == replica => 2,
            (None, Some(_)) => 1,
        };
        let t = &mut out.by_kind[kind];
        t.requests += 1;
        t.uncached_tokens += prompt.saturating_sub(cached);
        out.prompt_tokens += prompt;
        group_at.insert(group, replica);
        conversation_at.insert(&s.user, replica);
    }
    Some(out)
}

/// The table of where each router's uncached prompt tokens were (a line of results.md), for the
/// routers whose requests reported usage; empty when none did.
pub fn table(runs: &[(String, Vec<Sample>)]) -> String {
    let rows: Vec<(&str, Misses)> = runs
        .iter()
        .filter_map(|(router, samples)| Some((router.as_str(), misses(samples)?)))
        .collect();
    if rows.is_empty() {
        return String::new();
    }
    let mut s = "\nWhere the uncached prompt tokens were, in points of each router's prompt \
        tokens (requests): a group's first request, a conversation's first request on another \
        replica than its group's last one or on the same, a later turn on another replica than \
        its conversation's last one or on the same\n\n| router |"
        .to_string();
    for kind in KINDS {
        let _ = write!(s, " {kind} |");
    }
    s += " all |\n|---|";
    s += &"---:|".repeat(KINDS.len() + 1);
    s += "\n";
    for (router, m) in rows {
        let _ = write!(s, "| {router} |");
        for kind in 0..KINDS.len() {
            let _ = write!(s, " {} |", m.cell(kind));
        }
        let _ = writeln!(s, " {} |", m.all());
    }
    s
}

impl Misses {
    /// A kind's uncached tokens, in points of the run's prompt tokens (its share of the hit rate
    /// lost), and its requests: `2.1 (21)`.
    pub fn cell(&self, kind: usize) -> String {
        let t = self.by_kind[kind];
        format!("{:.1} ({})", self.points(t.uncached_tokens), t.requests)
    }

    /// Every kind's uncached tokens, in points of the run's prompt tokens: 100 − the hit rate the
    /// requests' usage reported.
    pub fn all(&self) -> String {
        let uncached = self.by_kind.iter().map(|t| t.uncached_tokens).sum();
        format!("{:.1}", self.points(uncached))
    }

    fn points(&self, tokens: u64) -> f64 {
        100.0 * tokens as f64 / self.prompt_tokens.max(1) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(user: &str, sent_ms: f64, replica: usize, prompt: u64, cached: u64) -> Sample {
        Sample {
            user: user.into(),
            sent_ms,
            error: None,
            ttft_ms: Some(10.0),
            e2e_ms: 20.0,
            output_tokens: 8,
            replica: Some(replica),
            decision: None,
            gateway: None,
            prompt_tokens: Some(prompt),
            cached_tokens: Some(cached),
        }
    }

    #[test]
    fn each_request_is_counted_by_where_its_group_and_conversation_were_last() {
        let samples = vec![
            // Out of order: they are sorted by send time.
            sample("u1-0-1", 30.0, 1, 100, 0), // group 1 moved from 0 to 1
            sample("u1-0-0", 10.0, 0, 100, 0), // group 1's first request
            sample("u1-1-0", 20.0, 0, 100, 80), // group 1 stays on 0
            sample("u1-1-0", 40.0, 0, 200, 180), // its later turn, where the first was
            sample("u1-0-1", 50.0, 2, 200, 20), // a later turn elsewhere
            sample("u2-t1-0-0", 60.0, 3, 100, 0), // another group (a tenant of group 2)
        ];
        let m = misses(&samples).unwrap();
        assert_eq!(m.prompt_tokens, 800);
        let requests: Vec<u64> = m.by_kind.iter().map(|t| t.requests).collect();
        assert_eq!(requests, [2, 1, 1, 1, 1]);
        let uncached: Vec<u64> = m.by_kind.iter().map(|t| t.uncached_tokens).collect();
        assert_eq!(uncached, [200, 100, 20, 180, 20]);
        assert_eq!(m.cell(3), "22.5 (1)");
        assert_eq!(m.all(), "65.0");
    }

    #[test]
    fn a_run_without_usage_has_no_table() {
        let mut s = sample("u1-0-0", 1.0, 0, 10, 0);
        s.cached_tokens = None;
        assert_eq!(misses(&[s]), None);
    }
}
