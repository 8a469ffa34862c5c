//! Homes that hold still: a group moves to the home the balanced assignment gives it only once
//! the assignment has kept giving it that home for a while.
//!
//! The balanced assignment ([`shares`](super::shares)) is recomputed whenever a group is counted or
//! dropped or a weight changes, and each time it may send a few groups elsewhere and, at the next
//! recompute, back again (on a skewed fleet, whose long tail's groups are counted one by one, the
//! same few groups can sway between two endpoints every few seconds), and every move costs a
//! prefill of the group's prompt where it lands. Here a group keeps its home until the assignment has
//! agreed on another for `hold_ms`; a sway shorter than that moves nothing. The held homes depend
//! on this gateway's recent assignments only (not on which requests came by), so its workers,
//! and gateways that compute the same assignments, agree, and a restarted gateway, which holds
//! nothing, takes the assignment as it is: it differs from the others for `hold_ms` at most after
//! a change.

use hashbrown::HashMap;

use super::{home_of, Shares};
use crate::rendezvous;

/// A group's homes with their shares ([`Shares`]).
type Parts = Vec<(u32, u64)>;

/// The homes requests of each group go to: the balanced assignment's, once it has kept giving them
/// for `hold_ms`.
#[derive(Debug, Default, Clone)]
pub struct Homes {
    hold_ms: u64,
    /// The endpoints the homes are for: another endpoint set starts afresh.
    ids: Vec<u32>,
    /// Each group's homes as requests are sent now.
    used: HashMap<u64, Parts>,
    /// A different home the assignment gives a group, and since when.
    pending: HashMap<u64, (Parts, u64)>,
}

impl Homes {
    pub fn new(hold_ms: u64) -> Self {
        Homes {
            hold_ms,
            ..Homes::default()
        }
    }

    /// Whether the homes are for endpoints `ids`.
    pub fn is_for(&self, ids: impl IntoIterator<Item = u32>) -> bool {
        self.ids.iter().copied().eq(ids)
    }

    /// The endpoints the homes are for (none before the first assignment).
    pub fn endpoints(&self) -> &[u32] {
        &self.ids
    }

    /// Takes in the assignment `computed` for endpoints `ids`, in force since `since_ms`: a group
    /// new to it starts from its first rendezvous choice (where it went until it was counted), and
    /// every group takes its home once that has held ([`Homes::home`]); groups no longer in it are
    /// forgotten. Where the endpoints changed since the last one (a host left or came back), every
    /// group takes it as it is.
    pub fn update(&mut self, ids: &[u32], computed: &Shares, since_ms: u64) {
        if !self.is_for(ids.iter().copied()) {
            // Another endpoint set (a host left or came back): what was held was for the old one.
            let fresh = self.ids.is_empty();
            self.ids = ids.to_vec();
            self.pending.clear();
            if !fresh {
                self.used = computed.clone();
                return;
            }
        }
        // Homes that have held by now move first, as a request would have moved them
        // ([`Homes::home`]): where a group goes next does not depend on whether one of its
        // requests came by this worker meanwhile, so workers that take in the same assignments
        // hold the same homes.
        self.take_held(since_ms);
        self.used.retain(|g, _| computed.contains_key(g));
        self.pending.retain(|g, _| computed.contains_key(g));
        for (&group, parts) in computed {
            match self.used.get(&group) {
                // Until now the group went to its first rendezvous choice (it was not counted,
                // or this gateway was warming up): that is where its prefix is.
                None => {
                    let first = rendezvous::order(group, ids).first().map(|&i| ids[i]);
                    let total = parts.iter().map(|p| p.1).sum();
                    let was = first.map_or_else(|| parts.clone(), |e| vec![(e, total)]);
                    if was != *parts {
                        self.pending.insert(group, (parts.clone(), since_ms));
                    }
                    self.used.insert(group, was);
                }
                Some(used) if used == parts => {
                    self.pending.remove(&group);
                }
                Some(_) => {
                    if self.pending.get(&group).is_none_or(|(p, _)| p != parts) {
                        self.pending.insert(group, (parts.clone(), since_ms));
                    }
                }
            }
        }
    }

    /// The home of `group`'s `conversation` at `now_ms` ([`home_of`]), after it takes the
    /// home the assignment has kept giving it for `hold_ms`.
    pub fn home(&mut self, group: u64, conversation: u64, now_ms: u64) -> Option<u32> {
        if self.has_held(group, now_ms) {
            self.take(group);
        }
        home_of(self.used.get(&group)?, conversation)
    }

    /// Whether `group`'s pending home has held at `now_ms`.
    fn has_held(&self, group: u64, now_ms: u64) -> bool {
        self.pending
            .get(&group)
            .is_some_and(|(_, since)| now_ms.saturating_sub(*since) >= self.hold_ms)
    }

    /// Every group whose pending home has held at `now_ms` takes it.
    fn take_held(&mut self, now_ms: u64) {
        let held: Vec<u64> = self
            .pending
            .keys()
            .copied()
            .filter(|&g| self.has_held(g, now_ms))
            .collect();
        for group in held {
            self.take(group);
        }
    }

    /// `group` takes its pending home.
    fn take(&mut self, group: u64) {
        if let Some((parts, _)) = self.pending.remove(&group) {
            self.used.insert(group, parts);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const IDS: [u32; 2] = [1, 2];

    fn shares(homes: &[(u64, u32)]) -> Shares {
        homes.iter().map(|&(g, e)| (g, vec![(e, 16)])).collect()
    }

    /// `group`'s first rendezvous choice among [`IDS`], and the other one.
    fn first_and_other(group: u64) -> (u32, u32) {
        let order = rendezvous::order(group, &IDS);
        (IDS[order[0]], IDS[order[1]])
    }

    #[test]
    fn a_group_leaves_its_first_choice_for_its_home_once_that_held() {
        let mut h = Homes::new(2000);
        let (first, other) = first_and_other(7);
        h.update(&IDS, &shares(&[(7, other)]), 0);
        assert_eq!(
            h.home(7, 0, 0),
            Some(first),
            "where it went before it was counted"
        );
        assert_eq!(h.home(7, 0, 1999), Some(first));
        assert_eq!(h.home(7, 0, 2000), Some(other), "the home held 2 s");
        let (first, _) = first_and_other(8);
        h.update(&IDS, &shares(&[(7, other), (8, first)]), 2500);
        assert_eq!(
            h.home(8, 0, 2500),
            Some(first),
            "its home is its first choice"
        );
    }

    #[test]
    fn a_sway_shorter_than_the_hold_moves_nothing() {
        let mut h = Homes::new(2000);
        let (first, other) = first_and_other(7);
        h.update(&IDS, &shares(&[(7, first)]), 0);
        h.update(&IDS, &shares(&[(7, other)]), 1000);
        h.update(&IDS, &shares(&[(7, first)]), 2000);
        assert_eq!(h.home(7, 0, 3500), Some(first));
        // Away again: the hold starts over.
        h.update(&IDS, &shares(&[(7, other)]), 4000);
        assert_eq!(h.home(7, 0, 5000), Some(first));
        assert_eq!(h.home(7, 0, 6000), Some(other));
    }

    #[test]
    fn a_held_home_does_not_depend_on_whether_a_request_came_by() {
        // Two workers take in the same assignments; only one of them routes a request of group
        // 7 in between. Where the group goes afterwards is the same at both.
        let (first, other) = first_and_other(7);
        let (mut seen, mut unseen) = (Homes::new(2000), Homes::new(2000));
        for h in [&mut seen, &mut unseen] {
            h.update(&IDS, &shares(&[(7, first)]), 0);
            h.update(&IDS, &shares(&[(7, other)]), 1000);
        }
        assert_eq!(seen.home(7, 0, 3500), Some(other), "held 2 s: moved");
        // The assignment sends it back: it goes back once that has held too, at both.
        for h in [&mut seen, &mut unseen] {
            h.update(&IDS, &shares(&[(7, first)]), 4000);
        }
        for h in [&mut seen, &mut unseen] {
            assert_eq!(h.home(7, 0, 4500), Some(other));
            assert_eq!(h.home(7, 0, 6000), Some(first));
        }
    }

    #[test]
    fn without_a_hold_the_assignment_is_taken_as_it_is() {
        let mut h = Homes::new(0);
        let (first, other) = first_and_other(7);
        for (home, at) in [(other, 0), (first, 10)] {
            h.update(&IDS, &shares(&[(7, home)]), at);
            assert_eq!(h.home(7, 0, at), Some(home));
        }
    }

    #[test]
    fn on_another_endpoint_set_every_group_takes_its_home_at_once() {
        let mut h = Homes::new(2000);
        let (first, other) = first_and_other(7);
        h.update(&IDS, &shares(&[(7, first)]), 0);
        let three = [1, 2, 3];
        h.update(&three, &shares(&[(7, other), (8, 3)]), 500);
        assert!(h.is_for(three) && !h.is_for(IDS));
        assert_eq!(h.home(7, 0, 500), Some(other));
        assert_eq!(h.home(8, 0, 500), Some(3));
    }

    #[test]
    fn a_group_dropped_from_the_assignment_is_forgotten() {
        let mut h = Homes::new(2000);
        let (first, other) = first_and_other(7);
        h.update(&IDS, &shares(&[(7, first)]), 0);
        h.update(&IDS, &shares(&[(8, 2)]), 100);
        assert_eq!(h.home(7, 0, 100), None);
        h.update(&IDS, &shares(&[(7, other), (8, 2)]), 200);
        assert_eq!(h.home(7, 0, 200), Some(first), "back as a new group");
    }
}
