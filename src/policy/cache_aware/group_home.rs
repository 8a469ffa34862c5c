//! The group's home: where the balanced assignment of the groups this gateway has seen
//! ([`placement`](crate::placement)) puts a request's group, or its conversation where the group
//! is split; its first rendezvous choice while the gateway warms up or before it counts the
//! group. Kept up to date on the worker's tick, by the leading worker's weights
//! ([`leader`](crate::placement::leader)).

use std::hash::{BuildHasher, RandomState};

use crate::placement::homes::Homes;
use crate::placement::leader::{self, Published};
use crate::placement::{self, FleetVolume, Tally};
use crate::policy::Candidate;
use crate::prefix::PrefixKeys;
use crate::store::SharedStore;

/// This worker's copy of the groups table, the weights it places by and the homes computed from
/// them.
pub struct GroupHomes {
    warmup_ms: u64,
    view: View,
}

#[derive(Default)]
struct View {
    /// When this worker's first tick ran.
    born_ms: Option<u64>,
    /// From when the gateway places groups by the assignment: the end of its first leader's
    /// warm-up; unknown before this worker's first tick.
    warm_ms: Option<u64>,
    /// This worker's token, which marks what it publishes as the leader.
    token: u64,
    /// This worker's copy of the groups table and the requests it counted.
    tally: Tally,
    /// The groups that take a place, with their weights, sorted; whether their assignment is
    /// computed for the current weights, and the homes requests go to ([`Homes`]).
    weights: Vec<(u64, u32)>,
    assigned: bool,
    /// When the weights last changed: the assignment holds from then, or from the end of the
    /// warm-up, whichever is later.
    weights_ms: u64,
    homes: Homes,
    /// The engines' finished requests lately: this gateway's share of the traffic.
    fleet: FleetVolume,
}

impl View {
    /// Takes in the balanced assignment of the current weights over endpoints `ids`.
    fn assign(&mut self, ids: &[u32]) {
        let shares = placement::shares(&self.weights, ids);
        let since = self.weights_ms.max(self.warm_ms.unwrap_or(0));
        self.homes.update(ids, &shares, since);
        self.assigned = true;
    }
}

impl GroupHomes {
    /// Homes placed by the assignment from `warmup_ms` after the gateway's first tick, moved
    /// once the assignment has kept them for `hold_ms`.
    pub fn new(warmup_ms: u64, hold_ms: u64) -> GroupHomes {
        GroupHomes {
            warmup_ms,
            view: View {
                homes: Homes::new(hold_ms),
                token: RandomState::new().hash_one(0u8),
                ..View::default()
            },
        }
    }

    /// The home among `candidates` of the request's group, or of its conversation where the
    /// group spans several: its place in the balanced assignment once this gateway has warmed up
    /// and counts the group, else its first rendezvous choice (`order`'s first).
    pub fn home(
        &mut self,
        candidates: &[Candidate],
        keys: &PrefixKeys,
        order: &[usize],
        now_ms: u64,
    ) -> usize {
        let group = keys.group;
        let first = order.first().copied().unwrap_or(0);
        let view = &mut self.view;
        let warm = view.warm_ms.is_some_and(|warm| now_ms >= warm);
        if !warm
            || view
                .weights
                .binary_search_by_key(&group, |&(g, _)| g)
                .is_err()
        {
            return first;
        }
        let ids = || candidates.iter().map(|c| c.id);
        if !view.assigned || !view.homes.is_for(ids()) {
            view.assign(&ids().collect::<Vec<u32>>());
        }
        let home = view.homes.home(group, keys.conversation, now_ms);
        home.and_then(|id| candidates.iter().position(|c| c.id == id))
            .unwrap_or(first)
    }

    /// Counts one request of `group`.
    pub fn count(&mut self, store: &dyn SharedStore, group: u64, now_ms: u64) {
        self.view.tally.count(store, group, now_ms);
    }

    /// Counts this worker's requests into the groups table; then, if this worker leads
    /// ([`leader`]), weighs the groups and publishes the weights, else adopts the leader's.
    /// `completed` holds each engine's finished-requests counter. Returns how many groups the
    /// assignment places (0 while warming up).
    pub fn tick(
        &mut self,
        store: &dyn SharedStore,
        now_ms: u64,
        completed: &[(&str, f64)],
    ) -> usize {
        let warmup_ms = self.warmup_ms;
        let view = &mut self.view;
        let born = *view.born_ms.get_or_insert(now_ms);
        view.tally.sync(store, now_ms);
        view.fleet.observe(completed.iter().copied(), now_ms);
        let (published, cas) = leader::read(store);
        let next = if Published::led_by(published.as_ref(), view.token, now_ms) {
            let seen = view.tally.seen();
            let min_requests = view
                .fleet
                .min_requests(placement::own_volume(&seen, now_ms));
            let weighted =
                placement::weighted(&seen, now_ms, min_requests, now_ms.saturating_sub(born));
            // From the weights the gateway places by (this worker's copy of the last published
            // ones, when it takes over), so a new leader moves no group.
            let weights = placement::steady(&view.weights, weighted);
            let weights_ms = if weights == view.weights {
                view.weights_ms
            } else {
                now_ms
            };
            let next = Published {
                author: view.token,
                written_ms: now_ms,
                warm_ms: published.as_ref().map_or(born + warmup_ms, |p| p.warm_ms),
                weights_ms,
                weights,
            };
            if Published::stale(published.as_ref(), &next) {
                leader::write(store, &next, cas);
            }
            next
        } else {
            published.unwrap_or_default()
        };
        if next.weights != view.weights || next.weights_ms != view.weights_ms {
            view.weights = next.weights;
            view.weights_ms = next.weights_ms;
            view.assigned = false;
        }
        view.warm_ms = Some(next.warm_ms);
        // Every worker takes in each published assignment on its tick, not only when a request
        // of a group it counts comes by: its held homes then follow the published weights alone
        // ([`Homes::update`]), and the gateway's workers agree on them.
        if !view.assigned && now_ms >= next.warm_ms && !view.homes.endpoints().is_empty() {
            let ids = view.homes.endpoints().to_vec();
            view.assign(&ids);
        }
        if now_ms >= next.warm_ms {
            view.weights.len()
        } else {
            0
        }
    }
}
