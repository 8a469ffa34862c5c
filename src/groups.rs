//! The groups a gateway has seen lately, how busy each keeps the fleet, and their homes: a
//! balanced assignment of groups to endpoints that every gateway which has seen the same groups
//! computes alike.
//!
//! Rendezvous alone gives each group a home every gateway agrees on, but by chance: 24 groups on
//! 4 endpoints often put 9 on one and 3 on another, and under skewed traffic the hottest groups
//! may share one. Here each group weighs its popularity relative to the mean (in quarters of
//! the mean, with the band around the mean flattened: see [`weight`]; a weight that wanders by
//! one mean stays put: see [`steady`]) and each endpoint takes groups
//! up to ceil(total weight of the groups at least as busy as the mean / endpoints), rounded up to
//! whole mean groups (rarer ones take what room is left): groups propose to
//! endpoints in their rendezvous order, and an endpoint keeps the heaviest, then the groups that
//! rank it highest (deferred acceptance, in key order). Where whole groups cannot even the
//! endpoints out, groups split, their conversations divided between homes ([`shares`]). The
//! outcome depends only on the groups, their weights and the endpoints, not on the order requests
//! arrived in, so gateways that have seen the same traffic agree, and a restarted gateway agrees
//! again once it has seen it.
//!
//! The table is shared data: [`SHARDS`] values of up to [`PER_SHARD`] records (group key, last
//! seen, requests seen, halving every [`HALF_LIFE_MS`]), least recently seen evicted, so its size
//! is bounded whatever the traffic.

use std::collections::VecDeque;

use hashbrown::{HashMap, HashSet};

use crate::rendezvous;
use crate::store::{self, SharedStore, Update};

pub const SHARDS: usize = 16;
pub const PER_SHARD: usize = 64;
/// A group counts once more than one request of it was seen lately by the whole fleet (the count
/// decays, so two requests a moment apart make a little under 2): one-off prompts are no group.
/// A gateway that sees a share of the fleet's traffic needs that share of it ([`FleetVolume`]).
pub const MIN_REQUESTS: f32 = 1.5;
/// Decayed requests the engines must have finished before a gateway trusts its estimate of its
/// own share of their traffic.
pub const MIN_FLEET_VOLUME: f64 = 16.0;
/// The smallest traffic share a gateway assumes it has (at 1/8, a group counts from its first
/// request).
pub const MIN_SHARE: f64 = 0.125;
/// A group not seen for this long no longer takes a place.
pub const TTL_MS: u64 = 60_000;
/// Request counts halve over this time: popularity is recent popularity.
pub const HALF_LIFE_MS: u64 = 30_000;
/// How often a worker writes the requests it counted to the table.
pub const FLUSH_MS: u64 = 1_000;
/// The mean group's weight: weights are in quarters of it.
pub const MEAN_WEIGHT: u64 = 4;
/// The heaviest weight a group can have, in quarters of the mean group.
pub const MAX_WEIGHT: u32 = 256;
/// Counts whose variance is at most this many times their mean spread as equally popular groups'
/// do (a Poisson count's variance is its mean): chance may explain any one of them ([`weight`]).
/// Beyond it the groups are unequal (zipf-pressure's spread is over 30 times its mean), and a
/// group far below the mean is a rare one, though chance could explain it alone.
pub const EQUAL_SPREAD: f64 = 2.0;
/// Below this mean count per group a gateway takes every spread for chance: counts so small
/// (behind three gateways, zipf-pressure's stay under it for the whole run) tell the rare groups
/// of a skewed fleet apart so unreliably that weighing them by their counts made the gateways
/// disagree on 27% of requests instead of 10% (`placement_replay --gateways 3`).
pub const EQUAL_BELOW_MEAN: f64 = 6.0;
/// Requests per group this gateway sees, on average, after a group's only request before it
/// takes that group for a one-off ([`one_offs`]).
pub const ONE_OFF_REPEATS: f64 = 3.0;

const VERSION: u8 = 2;
const RECORD_LEN: usize = 20;

/// One group as the table remembers it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Seen {
    pub key: u64,
    pub last_ms: u64,
    /// Requests seen, decayed to `last_ms`.
    pub requests: f32,
}

impl Seen {
    /// Whether the group takes a place in the assignment at `now_ms`, once this gateway has seen
    /// `min_requests` of it.
    pub fn counts(&self, now_ms: u64, min_requests: f32) -> bool {
        self.requests >= min_requests && now_ms.saturating_sub(self.last_ms) < TTL_MS
    }

    /// Requests seen, decayed to `now_ms`.
    pub fn requests_at(&self, now_ms: u64) -> f64 {
        f64::from(self.requests) * decay(now_ms.saturating_sub(self.last_ms))
    }
}

/// What a count keeps of itself after `age_ms`: it halves every [`HALF_LIFE_MS`].
fn decay(age_ms: u64) -> f64 {
    0.5f64.powf(age_ms as f64 / HALF_LIFE_MS as f64)
}

fn shard_of(group: u64) -> usize {
    (group % SHARDS as u64) as usize
}

fn shard_key(shard: usize) -> String {
    format!("kvroute.groups.{shard}")
}

/// Adds `count` requests of each group at `now_ms`, one write per shard touched. Returns the
/// records as written.
pub fn record(store: &dyn SharedStore, counts: &[(u64, u32)], now_ms: u64) -> Vec<Seen> {
    let mut written = Vec::new();
    for shard in 0..SHARDS {
        let mine: Vec<(u64, u32)> = counts
            .iter()
            .copied()
            .filter(|(g, _)| shard_of(*g) == shard)
            .collect();
        if mine.is_empty() {
            continue;
        }
        let mut result = Vec::new();
        let outcome = store::update(store, &shard_key(shard), |current| {
            let mut records = current.map(decode).unwrap_or_default();
            result.clear();
            for &(group, count) in &mine {
                result.push(add(&mut records, group, count, now_ms));
            }
            Some(encode(&records))
        });
        if matches!(outcome, Update::Created | Update::Written) {
            written.extend(result);
        }
    }
    written
}

/// Adds `count` requests of `group` to a shard's records, evicting the least recently seen.
fn add(records: &mut Vec<Seen>, group: u64, count: u32, now_ms: u64) -> Seen {
    if let Some(r) = records.iter_mut().find(|r| r.key == group) {
        r.requests = (r.requests_at(now_ms) + f64::from(count)) as f32;
        r.last_ms = r.last_ms.max(now_ms);
        return *r;
    }
    let fresh = Seen {
        key: group,
        last_ms: now_ms,
        requests: count as f32,
    };
    if records.len() < PER_SHARD {
        records.push(fresh);
    } else if let Some(lru) = records.iter_mut().min_by_key(|r| r.last_ms) {
        *lru = fresh;
    }
    fresh
}

/// Every shard's records and version (to tell whether anything changed since the last read).
pub fn read(store: &dyn SharedStore) -> (Vec<Seen>, Vec<Option<u32>>) {
    let mut all = Vec::new();
    let mut versions = Vec::with_capacity(SHARDS);
    for shard in 0..SHARDS {
        let (value, version) = store.get(&shard_key(shard));
        all.extend(value.as_deref().map(decode).unwrap_or_default());
        versions.push(version);
    }
    (all, versions)
}

/// A worker's copy of the groups table, and the requests it counted since it last wrote them.
/// A group new to the worker goes into the table at once ([`Tally::count`]); the requests of known
/// ones are written once per [`FLUSH_MS`] ([`Tally::sync`]).
#[derive(Debug, Default)]
pub struct Tally {
    seen: HashMap<u64, Seen>,
    versions: Vec<Option<u32>>,
    /// Requests of known groups counted since they were last written to the table.
    pending: HashMap<u64, u32>,
    flushed_ms: u64,
    /// When the table was last read: right after writing this worker's counts, else once per
    /// [`FLUSH_MS`], the most often any worker writes to it (each read is a host call per shard,
    /// the most of an idle tick's work).
    read_ms: Option<u64>,
}

impl Tally {
    /// Counts one request of `group` at `now_ms`.
    pub fn count(&mut self, store: &dyn SharedStore, group: u64, now_ms: u64) {
        if self.seen.contains_key(&group) {
            *self.pending.entry(group).or_default() += 1;
        } else {
            for seen in record(store, &[(group, 1)], now_ms) {
                self.seen.insert(seen.key, seen);
            }
        }
    }

    /// Writes the counted requests to the table if a [`FLUSH_MS`] has passed since the last
    /// write, and reads the table back right after, or when a [`FLUSH_MS`] has passed since the
    /// last read: this worker's own counts count at once, the other workers' at the pace they
    /// write them.
    pub fn sync(&mut self, store: &dyn SharedStore, now_ms: u64) {
        let mut flushed = false;
        if now_ms.saturating_sub(self.flushed_ms) >= FLUSH_MS && !self.pending.is_empty() {
            let pending: Vec<(u64, u32)> = self.pending.drain().collect();
            record(store, &pending, now_ms);
            self.flushed_ms = now_ms;
            flushed = true;
        }
        let due = self
            .read_ms
            .is_none_or(|at| now_ms.saturating_sub(at) >= FLUSH_MS);
        if flushed || due {
            self.read_ms = Some(now_ms);
            let (records, versions) = read(store);
            if versions != self.versions {
                self.seen = records.into_iter().map(|r| (r.key, r)).collect();
                self.versions = versions;
            }
        }
    }

    /// The groups as this worker knows them.
    pub fn seen(&self) -> Vec<Seen> {
        self.seen.values().copied().collect()
    }
}

/// How many requests the whole fleet has finished lately (decayed like the group counts), from
/// the engines' own counters, so that a gateway knows which share of the traffic it sees: with
/// three gateways behind a round-robin balancer, each sees a third of every group's requests, and
/// would otherwise take three times as long as a lone gateway to count a group, each at its own
/// moment, and place the groups differently meanwhile.
#[derive(Debug, Default)]
pub struct FleetVolume {
    /// Each engine's finished-requests counter at the last observation, with the observation
    /// that last saw the engine (an engine the latest one did not list is forgotten).
    last: HashMap<String, (f64, u64)>,
    observations: u64,
    volume: f64,
    at_ms: Option<u64>,
}

impl FleetVolume {
    /// Takes in the engines' counters (address, requests finished since it started) at `now_ms`.
    /// An engine seen for the first time only sets its baseline; a counter that went down (the
    /// engine restarted) counts from zero.
    /// (Every worker does this on every tick: the counters are updated in place, not rebuilt.)
    pub fn observe<'a>(&mut self, totals: impl IntoIterator<Item = (&'a str, f64)>, now_ms: u64) {
        self.observations += 1;
        let this = self.observations;
        let mut added = 0.0;
        for (addr, total) in totals {
            match self.last.get_mut(addr) {
                Some((before, seen)) => {
                    added += if total >= *before {
                        total - *before
                    } else {
                        total
                    };
                    *before = total;
                    *seen = this;
                }
                None => {
                    self.last.insert(addr.to_string(), (total, this));
                }
            }
        }
        self.last.retain(|_, &mut (_, seen)| seen == this);
        let age = self.at_ms.map_or(0, |at| now_ms.saturating_sub(at));
        self.volume = self.volume * decay(age) + added;
        self.at_ms = Some(now_ms);
    }

    /// This gateway's share of the fleet's traffic, given the requests it saw lately (`own`,
    /// decayed alike): 1 until the engines have finished enough to tell, at least [`MIN_SHARE`].
    pub fn share(&self, own: f64) -> f64 {
        if self.volume < MIN_FLEET_VOLUME {
            return 1.0;
        }
        (own / self.volume).clamp(MIN_SHARE, 1.0)
    }

    /// How many requests of a group this gateway must see for it to count: [`MIN_REQUESTS`] of
    /// the fleet's, scaled by this gateway's share.
    pub fn min_requests(&self, own: f64) -> f32 {
        (f64::from(MIN_REQUESTS) * self.share(own)) as f32
    }
}

/// The requests this gateway saw lately, all groups together, decayed to `now_ms`.
pub fn own_volume(seen: &[Seen], now_ms: u64) -> f64 {
    seen.iter().map(|s| s.requests_at(now_ms)).sum()
}

/// The groups that take a place at `now_ms` (seen at least `min_requests` times), sorted by key,
/// each with its weight: its recent requests over the mean group's, in quarters of the mean (see
/// [`weight`]).
///
/// A prompt sent once (a one-off) is no group, but a gateway with a share of the traffic counts a
/// group from its first request, so it cannot tell a one-off from an average group it has seen
/// once so far; it drops such a group once it is more likely a one-off ([`one_offs`]).
/// `seeing_ms` is how long this gateway has been counting.
pub fn weighted(seen: &[Seen], now_ms: u64, min_requests: f32, seeing_ms: u64) -> Vec<(u64, u32)> {
    let mut counted: Vec<&Seen> = seen
        .iter()
        .filter(|s| s.counts(now_ms, min_requests))
        .collect();
    let dropped = one_offs(&counted, now_ms, seeing_ms);
    counted.retain(|s| !dropped.contains(&s.key));
    let counted: Vec<(u64, f64)> = counted
        .iter()
        .map(|s| (s.key, s.requests_at(now_ms)))
        .collect();
    let n = counted.len().max(1) as f64;
    let mean = counted.iter().map(|(_, r)| r).sum::<f64>() / n;
    let variance = counted.iter().map(|(_, r)| (r - mean).powi(2)).sum::<f64>() / n;
    let alike = mean < EQUAL_BELOW_MEAN || variance <= EQUAL_SPREAD * mean;
    let mut out: Vec<(u64, u32)> = counted
        .into_iter()
        .map(|(g, r)| (g, weight(r, mean, alike)))
        .collect();
    out.sort_unstable();
    out
}

/// The groups among `counted` seen only once that are taken for one-offs: each one this gateway
/// has since seen [`ONE_OFF_REPEATS`] requests per group without seeing it again (an average group
/// goes that long unseen one time in 20), and all of them where there are more of them than
/// groups as popular as the mean would leave seen once by chance (a fleet with many one-offs).
/// Counted as average groups, the bench's first request alone (one prompt before the run, at one
/// of three gateways) made that gateway place a phantom seventeenth group among sixteen, with
/// room for five on each endpoint, for its first 25 s.
fn one_offs(counted: &[&Seen], now_ms: u64, seeing_ms: u64) -> HashSet<u64> {
    let once = |s: &&&Seen| s.requests <= 1.0;
    let n = counted.len().max(1) as f64;
    let volume: f64 = counted.iter().map(|s| s.requests_at(now_ms)).sum();
    // Requests per ms lately: the decayed volume over the time it covers (a second at least).
    let window = (seeing_ms.max(FLUSH_MS) as f64).min(HALF_LIFE_MS as f64 / std::f64::consts::LN_2);
    let per_group = volume / window / n;
    let stale: HashSet<u64> = counted
        .iter()
        .filter(once)
        .filter(|s| per_group * now_ms.saturating_sub(s.last_ms) as f64 >= ONE_OFF_REPEATS)
        .map(|s| s.key)
        .collect();
    let more: Vec<f64> = counted
        .iter()
        .filter(|s| !once(s))
        .map(|s| s.requests_at(now_ms))
        .collect();
    let singles = counted.iter().filter(once).count() - stale.len();
    if more.is_empty() || singles == 0 {
        return stale;
    }
    let mean = more.iter().sum::<f64>() / more.len() as f64;
    let chance = (counted.len() - stale.len()) as f64 * (-mean).exp() * (1.0 + mean);
    if singles as f64 > chance + 2.0 * chance.sqrt() + 1.0 {
        counted.iter().filter(once).map(|s| s.key).collect()
    } else {
        stale
    }
}

/// The weights `next`, except that a group which weighed at least the mean in `previous` and
/// still does keeps its previous weight while it moved by one mean at most. A hot group's count
/// wanders around the boundary between two whole means as requests come and decay, and each step
/// across it changes the room its endpoint leaves to the others, moving the group that was
/// last in line there and back again (on zipf-pressure one group moved twelve times in 45 s);
/// a step of two means is a change in popularity, not noise. Both sides sorted by key.
pub fn steady(previous: &[(u64, u32)], mut next: Vec<(u64, u32)>) -> Vec<(u64, u32)> {
    let mean = MEAN_WEIGHT as u32;
    for (group, w) in next.iter_mut() {
        if let Ok(i) = previous.binary_search_by_key(group, |&(g, _)| g) {
            let before = previous[i].1;
            if before >= mean && *w >= mean && before.abs_diff(*w) <= mean {
                *w = before;
            }
        }
    }
    next
}

/// A group's recent requests `r`, against the mean group's, as a weight in quarters of the mean
/// group. A group weighs 4 (the mean) while it is within 0.5–2× the mean, or, while the counts
/// spread `alike` (as equally popular groups' do, or are too few to tell: [`EQUAL_SPREAD`],
/// [`EQUAL_BELOW_MEAN`]), within what chance alone moves a count by (3 standard deviations of a
/// Poisson count with the mean's expectation) and seen more than once lately (a count above 1: one
/// request never decays to more, and two seen a while ago may have decayed below [`MIN_REQUESTS`])
/// or at a mean so small that a mean group is often seen only once ([`once_is_chance`]): the
/// ordinary ups and downs of equally popular groups, which each gateway counts a little
/// differently, move nothing, and a gateway that has seen few requests, whose counts are all noise,
/// weighs every group alike. (A prompt seen once among groups of several requests each is no such
/// chance: a one-off one gateway saw stays a rare group there, instead of changing the room of
/// every endpoint at that gateway alone.) Beyond both a group weighs what it is worth (a group with
/// 9× the mean's traffic takes the room of nine, a rare one a quarter), so the endpoint that homes
/// a hot group takes few others, the rare groups of a skewed fleet are not taken for average ones
/// (on zipf-pressure, taking them so made the room 1.35× the traffic, and the hottest group's
/// endpoint took a 3-mean group beside it), and the traffic stays balanced. A hot group weighs
/// whole means: its count grows and decays a little between any two ticks, and each quarter it
/// gained or lost would change the room it leaves to the others on its endpoint, and so move one of
/// them, losing its prefix.
fn weight(r: f64, mean: f64, alike: bool) -> u32 {
    let mean = mean.max(f64::MIN_POSITIVE);
    let popularity = r / mean;
    let mean_weight = MEAN_WEIGHT as f64;
    let chance =
        alike && (r > 1.0 || once_is_chance(mean)) && (r - mean).abs() <= 3.0 * mean.sqrt();
    let w = if (0.5..2.0).contains(&popularity) || chance {
        mean_weight
    } else if popularity > 1.0 {
        mean_weight * popularity.round()
    } else {
        (mean_weight * popularity).round()
    };
    w.clamp(1.0, f64::from(MAX_WEIGHT)) as u32
}

/// Whether a group as popular as the mean would be seen at most once lately at least one time in
/// 20 (a Poisson count with the mean's expectation; true below a mean of about 4.7). A gateway
/// that sees a third of the traffic counts groups of a request every few seconds a few requests
/// each for its first 20 s: there, a group it has seen once is as likely an average group as a
/// rare one, and the other gateways, which saw two of it, weigh it the mean.
fn once_is_chance(mean: f64) -> bool {
    (-mean).exp() * (1.0 + mean) >= 0.05
}

/// Each group's home among `endpoints` (ids): groups (key, weight) fill endpoints up to
/// ceil(total weight of the groups of at least the mean's weight, plus the rarer ones' in whole
/// means, / endpoints) rounded up to whole mean groups, each as high in its rendezvous order as
/// that allows; an endpoint always keeps the group that ranks it highest, however heavy.
/// Independent of the order of `groups`.
pub fn assign(groups: &[(u64, u32)], endpoints: &[u32]) -> HashMap<u64, u32> {
    let mut homes = HashMap::new();
    if endpoints.is_empty() {
        return homes;
    }
    let mut groups = groups.to_vec();
    groups.sort_unstable();
    // The room is what the groups of at least the mean's weight need, plus the whole means the
    // rare ones add up to, in whole means: a rare group (a one-off prompt one gateway saw, a
    // group on its way in or out) ranks below every other and takes what room is left, so
    // whether a gateway counts it moves no other group, while the long tail of a skewed fleet
    // (a Zipf tail weighing a quarter to a half of the mean each) is room the others leave it,
    // which moves less as its groups step in and out of the band around the mean.
    // Whole means, so that a hot group's count moving by a few percent rarely changes it.
    // (Where no group weighs the mean, every group counts.)
    let weights = || groups.iter().map(|&(_, w)| u64::from(w));
    let rare = weights().filter(|&w| w < MEAN_WEIGHT).sum::<u64>();
    let total = match weights().filter(|&w| w >= MEAN_WEIGHT).sum::<u64>() {
        0 => weights().sum(),
        counted => counted + rare / MEAN_WEIGHT * MEAN_WEIGHT,
    };
    let capacity = total.div_ceil(endpoints.len() as u64).div_ceil(MEAN_WEIGHT) * MEAN_WEIGHT;
    let orders: Vec<Vec<usize>> = groups
        .iter()
        .map(|&(g, _)| rendezvous::order(g, endpoints))
        .collect();
    // How an endpoint ranks a group: heavier first (light ones are easier to place elsewhere),
    // then by the group's rendezvous weight for it, then by key.
    let rank = |g: usize, e: usize| {
        let (key, w) = groups[g];
        (w, rendezvous::weight(key, endpoints[e]), key)
    };
    let mut next = vec![0usize; groups.len()];
    let mut held: Vec<Vec<usize>> = vec![Vec::new(); endpoints.len()];
    let mut load = vec![0u64; endpoints.len()];
    let mut free: VecDeque<usize> = (0..groups.len()).collect();
    while let Some(g) = free.pop_front() {
        // Refused everywhere (the room it needed went to heavier or better-ranked groups): the
        // least-loaded endpoint, earliest in its order among equals, takes it.
        let e = match orders[g].get(next[g]) {
            Some(&e) => e,
            None => {
                let e = orders[g]
                    .iter()
                    .copied()
                    .enumerate()
                    .min_by_key(|&(rank, e)| (load[e], rank))
                    .map_or(0, |(_, e)| e);
                held[e].push(g);
                load[e] += u64::from(groups[g].1);
                continue;
            }
        };
        next[g] += 1;
        held[e].push(g);
        load[e] += u64::from(groups[g].1);
        held[e].sort_unstable_by_key(|&h| std::cmp::Reverse(rank(h, e)));
        // Refuse the lowest-ranked groups while over capacity, keeping the best one.
        while load[e] > capacity && held[e].len() > 1 {
            if let Some(worst) = held[e].pop() {
                load[e] -= u64::from(groups[worst].1);
                free.push_back(worst);
            }
        }
    }
    // Capacity bounds the busiest endpoint, not the idlest: 6 groups on 4 endpoints may settle
    // as 2, 2, 2, 0. The least-loaded endpoint takes the lowest-ranked group of the most-loaded
    // one while that evens them out (each move lowers the sum of squared loads, so it ends).
    loop {
        let lo = (0..endpoints.len())
            .min_by_key(|&e| (load[e], e))
            .unwrap_or(0);
        let hi = (0..endpoints.len())
            .filter(|&e| held[e].len() > 1)
            .max_by_key(|&e| (load[e], std::cmp::Reverse(e)));
        let Some(hi) = hi else { break };
        let Some(&g) = held[hi].last() else { break };
        let w = u64::from(groups[g].1);
        if load[lo] + w >= load[hi] {
            break;
        }
        held[hi].pop();
        load[hi] -= w;
        held[lo].push(g);
        load[lo] += w;
    }
    for (e, gs) in held.iter().enumerate() {
        for &g in gs {
            homes.insert(groups[g].0, endpoints[e]);
        }
    }
    homes
}

/// Each group's homes with their shares of its weight, largest first: a group spans several
/// endpoints only where that evens the fleet out ([`shares`]).
pub type Shares = HashMap<u64, Vec<(u32, u64)>>;

/// Shares are finer than weights: sixteenths of the mean group.
pub const SHARE_UNITS: u64 = 4;

/// [`assign`], evened out by splitting groups. Whole groups can leave endpoints uneven however
/// they are placed: 6 equal groups on 4 endpoints sit 2, 2, 1, 1, and a group with 9× the mean's
/// traffic outweighs its endpoint's share, and one lone group is all the traffic. While the
/// busiest endpoint carries more than a quarter of an even share over the idlest (and more than
/// one mean group, unless that is over a third of an even share), half the gap moves from its
/// largest part to the idlest; that group's conversations then split between the two by a hash
/// of their opening message, which every gateway computes alike. Only as many groups span
/// endpoints as evening out takes: groups that already even out stay whole. The gap of one mean
/// group that whole groups leave stays unsplit from three groups per endpoint on: 15 equal
/// groups on 4 endpoints sit 4, 4, 4, 3 (27% of an even share), which is what a gateway that
/// has not yet seen one of 16 groups computes; splitting there gave that gateway other homes for
/// 1.7 groups on average, where the others, which saw all 16, split nothing (behind three
/// gateways on grouped-pressure, 16 of 700 requests went to another replica than the last of
/// their group, against 10 now, in `placement_replay`).
pub fn shares(groups: &[(u64, u32)], endpoints: &[u32]) -> Shares {
    let homes = assign(groups, endpoints);
    let n = endpoints.len();
    let mut parts: Vec<Vec<(u64, u64)>> = vec![Vec::new(); n];
    let mut sorted = groups.to_vec();
    sorted.sort_unstable();
    for (g, w) in sorted {
        if let Some(e) = homes
            .get(&g)
            .and_then(|h| endpoints.iter().position(|e| e == h))
        {
            parts[e].push((g, u64::from(w) * SHARE_UNITS));
        }
    }
    let mut load: Vec<u64> = parts.iter().map(|p| p.iter().map(|x| x.1).sum()).collect();
    let even = load.iter().sum::<u64>() / n.max(1) as u64;
    let slack = (even / 4)
        .max((even / 3).min(MEAN_WEIGHT * SHARE_UNITS))
        .max(1);
    // Each move lowers the sum of squared loads; the bound only guards against a bug.
    for _ in 0..4 * n + groups.len() {
        let lo = (0..n).min_by_key(|&e| (load[e], e)).unwrap_or(0);
        let hi = (0..n)
            .max_by_key(|&e| (load[e], std::cmp::Reverse(e)))
            .unwrap_or(0);
        let gap = load[hi] - load[lo];
        if gap <= slack {
            break;
        }
        let Some(at) = (0..parts[hi].len())
            .max_by_key(|&i| (parts[hi][i].1, std::cmp::Reverse(parts[hi][i].0)))
        else {
            break;
        };
        let (g, share) = parts[hi][at];
        let moved = (gap / 2).min(share);
        if moved == share {
            parts[hi].remove(at);
        } else {
            parts[hi][at].1 -= moved;
        }
        match parts[lo].iter_mut().find(|p| p.0 == g) {
            Some(p) => p.1 += moved,
            None => parts[lo].push((g, moved)),
        }
        load[hi] -= moved;
        load[lo] += moved;
    }
    let mut out: Shares = HashMap::new();
    for (e, ps) in parts.iter().enumerate() {
        for &(g, share) in ps {
            out.entry(g).or_default().push((endpoints[e], share));
        }
    }
    // The home `assign` gave comes first among equal shares.
    for (g, parts) in out.iter_mut() {
        let home = homes.get(g).copied();
        parts.sort_unstable_by_key(|&(e, share)| (std::cmp::Reverse(share), Some(e) != home, e));
    }
    out
}

/// The home of a group's conversation among its `homes`: each takes the conversations whose
/// hash falls in its share.
pub fn home_of(homes: &[(u32, u64)], conversation: u64) -> Option<u32> {
    let total: u64 = homes.iter().map(|h| h.1).sum();
    let mut point = ((u128::from(conversation) * u128::from(total)) >> 64) as u64;
    for &(e, share) in homes {
        if point < share {
            return Some(e);
        }
        point -= share;
    }
    homes.first().map(|h| h.0)
}

fn encode(records: &[Seen]) -> Vec<u8> {
    let mut out = Vec::with_capacity(1 + records.len() * RECORD_LEN);
    out.push(VERSION);
    for r in records {
        out.extend_from_slice(&r.key.to_le_bytes());
        out.extend_from_slice(&r.last_ms.to_le_bytes());
        out.extend_from_slice(&r.requests.to_bits().to_le_bytes());
    }
    out
}

/// Decodes a shard; another version or a torn value reads as empty.
fn decode(bytes: &[u8]) -> Vec<Seen> {
    let Some((&VERSION, body)) = bytes.split_first() else {
        return Vec::new();
    };
    body.chunks_exact(RECORD_LEN)
        .take(PER_SHARD)
        .filter_map(|r| {
            Some(Seen {
                key: u64::from_le_bytes(r.get(0..8)?.try_into().ok()?),
                last_ms: u64::from_le_bytes(r.get(8..16)?.try_into().ok()?),
                requests: f32::from_bits(u32::from_le_bytes(r.get(16..20)?.try_into().ok()?)),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rendezvous::endpoint_id;
    use crate::store::MemoryStore;

    fn endpoints(n: usize) -> Vec<u32> {
        (0..n)
            .map(|i| endpoint_id(&format!("127.0.0.1:{}", 8001 + i)))
            .collect()
    }

    /// `n` groups of weight 1.
    fn groups(n: u64) -> Vec<(u64, u32)> {
        (0..n)
            .map(|g| (g.wrapping_mul(0x9e37_79b9_7f4a_7c15), 1))
            .collect()
    }

    /// Total weight homed on each endpoint.
    fn per_endpoint(homes: &HashMap<u64, u32>, groups: &[(u64, u32)], eps: &[u32]) -> Vec<u32> {
        eps.iter()
            .map(|e| {
                groups
                    .iter()
                    .filter(|(g, _)| homes[g] == *e)
                    .map(|(_, w)| w)
                    .sum()
            })
            .collect()
    }

    #[test]
    fn every_endpoint_gets_its_share_of_groups() {
        let eps = endpoints(4);
        for n in [4u64, 12, 24, 25, 100] {
            let gs = groups(n);
            let homes = assign(&gs, &eps);
            assert_eq!(homes.len(), n as usize);
            let loads = per_endpoint(&homes, &gs, &eps);
            let cap = (n as u32).div_ceil(4);
            assert!(loads.iter().all(|&c| c <= cap), "{n} groups: {loads:?}");
        }
    }

    #[test]
    fn no_endpoint_idles_while_another_holds_two_more_than_it() {
        // A few apps or documents on a few endpoints: capacity alone allows 2, 2, 2, 0.
        let eps = endpoints(4);
        for salt in 0..50u64 {
            for n in 5..12u64 {
                let gs: Vec<(u64, u32)> = (0..n)
                    .map(|g| ((g + salt * 100).wrapping_mul(0x9e37_79b9_7f4a_7c15), 1))
                    .collect();
                let loads = per_endpoint(&assign(&gs, &eps), &gs, &eps);
                let (lo, hi) = (loads.iter().min(), loads.iter().max());
                assert!(
                    hi.zip(lo).is_some_and(|(h, l)| h - l <= 1),
                    "{n} groups: {loads:?}"
                );
            }
        }
    }

    #[test]
    fn a_hot_group_takes_the_room_of_several() {
        let eps = endpoints(4);
        let mut gs = groups(24);
        gs[0].1 = 6; // as busy as six average groups
        let homes = assign(&gs, &eps);
        let loads = per_endpoint(&homes, &gs, &eps);
        assert!(loads.iter().all(|&l| l <= 8), "{loads:?}"); // total 29 → at most 8 each
        let with_hot = gs
            .iter()
            .filter(|(g, _)| homes[g] == homes[&gs[0].0])
            .count();
        assert!(
            with_hot <= 3,
            "the hot group's home also holds {} others",
            with_hot - 1
        );
    }

    /// The recent requests of 32 groups with Zipf(1.1) popularity, hottest first, as the bench's
    /// zipf-pressure workload sends them (the hottest has 28% of the traffic, more than a quarter
    /// of a 4-endpoint fleet), `total` requests in all.
    fn zipf_counts(total: f64) -> Vec<f32> {
        let share: Vec<f64> = (1..=32).map(|k| 1.0 / f64::from(k).powf(1.1)).collect();
        let sum: f64 = share.iter().sum();
        share.iter().map(|s| (total * s / sum) as f32).collect()
    }

    /// Groups with these recent request counts, last seen at 1000 ms; `salt` varies the keys.
    fn seen_of(counts: &[f32], salt: u64) -> Vec<Seen> {
        (0..counts.len())
            .map(|i| Seen {
                key: (i as u64 + 1 + salt * 100).wrapping_mul(0x9e37_79b9_7f4a_7c15),
                last_ms: 1000,
                requests: counts[i],
            })
            .collect()
    }

    /// zipf-pressure's 32 groups, 1000 requests in all; `salt` varies the keys.
    fn zipf_groups(salt: u64) -> Vec<Seen> {
        seen_of(&zipf_counts(1000.0), salt)
    }

    #[test]
    fn zipf_skewed_groups_leave_no_endpoint_with_twice_the_traffic_of_another() {
        let eps = endpoints(4);
        let seen = zipf_groups(0);
        let homes = assign(&weighted(&seen, 1000, MIN_REQUESTS, 0), &eps);
        let traffic: Vec<f64> = eps
            .iter()
            .map(|e| {
                seen.iter()
                    .filter(|s| homes[&s.key] == *e)
                    .map(|s| f64::from(s.requests))
                    .sum()
            })
            .collect();
        let (max, min) = traffic
            .iter()
            .fold((0.0f64, f64::MAX), |(hi, lo), &t| (hi.max(t), lo.min(t)));
        assert!(max / min <= 2.0, "traffic per endpoint {traffic:?}");
    }

    #[test]
    fn a_hot_groups_count_going_up_and_down_moves_no_other_group() {
        // One of the three hottest groups' count moves by a few percent between ticks, as
        // requests arrive and counts decay.
        let eps = endpoints(4);
        let mut compared = 0;
        for (salt, hot) in (0..60u64).zip([0usize, 1, 2].into_iter().cycle()) {
            let mut seen = zipf_groups(salt);
            let count = seen[hot].requests;
            let mut before: Option<(Vec<(u64, u32)>, Shares)> = None;
            for step in [
                -6.0f32, -4.0, -2.0, 0.0, 2.0, 4.0, 6.0, 4.0, 2.0, 0.0, -2.0, -4.0,
            ] {
                seen[hot].requests = count * (1.0 + step / 100.0);
                let weights = weighted(&seen, 1000, MIN_REQUESTS, 0);
                let homes = shares(&weights, &eps);
                // Where only the hot group's weight changed (the mean moves a little too, and a
                // group on the edge of the band may cross it: such steps are skipped), every
                // other group keeps its endpoints.
                let key = seen[hot].key;
                let others = |ws: &[(u64, u32)]| -> Vec<(u64, u32)> {
                    ws.iter().copied().filter(|&(g, _)| g != key).collect()
                };
                if let Some((was, before)) = before
                    .as_ref()
                    .filter(|(was, _)| others(was) == others(&weights))
                {
                    compared += 1;
                    for (g, _) in others(was) {
                        let at = |h: &Shares| h[&g].iter().map(|p| p.0).collect::<Vec<_>>();
                        assert_eq!(at(before), at(&homes), "salt {salt}, group {hot}, {step}%");
                    }
                }
                before = Some((weights, homes));
            }
        }
        assert!(
            compared >= 300,
            "only {compared} steps left the other weights alone"
        );
    }

    /// Three gateways each count 16 equally busy groups (`least` to `least + 4` requests each
    /// lately); one of them also saw `one_off` requests of a prompt nobody sent again. That
    /// gateway must still give the 16 groups the homes the other two give them.
    fn assert_a_one_off_moves_no_other_group(least: f32, one_off: f32) {
        let eps = endpoints(4);
        for salt in 0..50u64 {
            let seen: Vec<Seen> = (0..16u64)
                .map(|i| Seen {
                    key: (i + 1 + salt * 100).wrapping_mul(0x9e37_79b9_7f4a_7c15),
                    last_ms: 1000,
                    requests: least + (i % 5) as f32,
                })
                .collect();
            let mut with_one_off = seen.clone();
            with_one_off.push(Seen {
                key: (salt + 7).wrapping_mul(0xc2b2_ae3d_27d4_eb4f),
                last_ms: 1000,
                requests: one_off,
            });
            let min_requests = 0.5;
            let homes = shares(&weighted(&seen, 1000, min_requests, 0), &eps);
            let other = shares(&weighted(&with_one_off, 1000, min_requests, 0), &eps);
            for s in &seen {
                assert_eq!(homes[&s.key], other[&s.key], "salt {salt}");
            }
        }
    }

    #[test]
    fn a_one_off_group_that_one_gateway_saw_moves_no_other_group() {
        // About 15 requests per group lately, the one-off's single request decayed to 0.7.
        assert_a_one_off_moves_no_other_group(13.0, 0.7);
    }

    #[test]
    fn a_one_off_group_moves_no_other_group_while_the_counts_are_small() {
        // Behind three gateways early in a run: only 5 to 9 requests per group lately at each
        // gateway, so a single request lies within 3 standard deviations of the mean's count.
        // It is still a rare group, not an average one.
        assert_a_one_off_moves_no_other_group(5.0, 1.0);
    }

    /// 16 groups seen `requests` times each lately (last at `last_ms`), and `singles` prompts seen
    /// once each, at `single_ms`.
    fn with_singles(requests: f32, last_ms: u64, singles: u64, single_ms: u64) -> Vec<Seen> {
        let mut seen = seen_of(&[requests; 16], 0);
        for s in seen.iter_mut() {
            s.last_ms = last_ms;
        }
        seen.extend((0..singles).map(|i| Seen {
            key: (i + 7).wrapping_mul(0xc2b2_ae3d_27d4_eb4f),
            last_ms: single_ms,
            requests: 1.0,
        }));
        seen
    }

    #[test]
    fn a_prompt_seen_once_long_before_is_a_one_off_and_moves_no_group() {
        // The bench's first request, at one of three gateways, 20 s before: since, that gateway
        // saw about 7 requests of each group.
        let eps = endpoints(4);
        let (now, seeing) = (20_000, 20_000);
        let ping = with_singles(8.0, now, 1, 0);
        let weights = weighted(&ping, now, 0.5, seeing);
        assert_eq!(weights.len(), 16, "the one-off takes no place");
        let without = weighted(&with_singles(8.0, now, 0, 0), now, 0.5, seeing);
        assert_eq!(shares(&weights, &eps), shares(&without, &eps));
        // Seen a second ago, it may be an average group this gateway has seen once so far.
        let lately = with_singles(8.0, now, 1, now - 1000);
        assert_eq!(weighted(&lately, now, 0.5, seeing).len(), 17);
    }

    #[test]
    fn many_prompts_seen_once_are_one_offs_but_not_while_counts_are_small() {
        // Ten prompts seen once lately among groups of 8: far more than chance leaves seen once.
        let (now, seeing) = (20_000, 20_000);
        let many = with_singles(8.0, now, 10, now - 500);
        assert_eq!(weighted(&many, now, 0.5, seeing).len(), 16);
        // Early, with 2 requests per group, four groups seen once are what chance does.
        let early = with_singles(2.0, 3000, 4, 3000);
        assert_eq!(weighted(&early, 3000, 0.5, 3000).len(), 20);
    }

    #[test]
    fn a_group_one_gateway_has_not_seen_yet_moves_few_others() {
        // 16 equally busy groups on 4 endpoints, behind three gateways: early in a run each
        // gateway has yet to see one group or another (at 8 requests a second, a third of a
        // group's requests each, one went 20 s without seeing a group). Without it, 15 groups sit
        // 4, 4, 4, 3: a gap of one mean group, 27% of an even share, so no group splits
        // there, and that gateway keeps the others where the rest put them.
        let eps = endpoints(4);
        let (mut changed, mut drops) = (0, 0);
        for salt in 0..100u64 {
            let gs: Vec<(u64, u32)> = (0..16u64)
                .map(|g| ((g + 1 + salt * 100).wrapping_mul(0x9e37_79b9_7f4a_7c15), 4))
                .collect();
            let all = shares(&gs, &eps);
            for missing in 0..gs.len() {
                let mut seen = gs.clone();
                seen.remove(missing);
                let homes = shares(&seen, &eps);
                changed += seen.iter().filter(|(g, _)| homes[g] != all[g]).count();
                drops += 1;
            }
        }
        // A quarter of an even share as the slack split a group at every such gateway, and
        // moved 1.7 others per missing group.
        let per_drop = changed as f64 / drops as f64;
        assert!(
            per_drop < 1.0,
            "{per_drop:.2} other groups moved per missing group"
        );
    }

    /// zipf-pressure's groups at one gateway after 25 s: 13 requests per group lately.
    const ZIPF_AT_ONE_GATEWAY: f64 = 32.0 * 13.0;

    /// Each endpoint's requests, of the groups (or the shares of split groups) it homes, busiest
    /// over idlest, averaged over 100 key sets: `counts` gives each group's recent requests.
    fn mean_busiest_over_idlest(counts: &[f32]) -> f64 {
        let eps = endpoints(4);
        let mut sum = 0.0;
        for salt in 0..100u64 {
            let seen = seen_of(counts, salt);
            let homes = shares(&weighted(&seen, 1000, MIN_REQUESTS, 0), &eps);
            let mut load = vec![0.0; eps.len()];
            for s in &seen {
                let parts = &homes[&s.key];
                let total: u64 = parts.iter().map(|p| p.1).sum();
                for &(e, share) in parts {
                    if let Some(at) = eps.iter().position(|&x| x == e) {
                        load[at] += f64::from(s.requests) * share as f64 / total as f64;
                    }
                }
            }
            let max = load.iter().copied().fold(0.0, f64::max);
            let min = load.iter().copied().fold(f64::MAX, f64::min);
            sum += max / min;
        }
        sum / 100.0
    }

    #[test]
    fn on_zipf_counts_rare_groups_weigh_their_traffic_and_the_homes_stay_even() {
        // zipf-pressure at one gateway after 25 s. The hottest group has 28% of the requests;
        // half the groups have under half the mean's, which chance could explain one by one but
        // not all together.
        let zipf_ratio = mean_busiest_over_idlest(&zipf_counts(ZIPF_AT_ONE_GATEWAY));
        // 16 equally busy groups, 11 to 15 requests each: the band keeps them alike.
        let equal: Vec<f32> = (0..16).map(|i| 11.0 + (i % 5) as f32).collect();
        let equal_ratio = mean_busiest_over_idlest(&equal);
        // Rare groups weighed as the mean (the band applied whatever the spread) gave 1.97.
        assert!(zipf_ratio < 1.5, "zipf: busiest/idlest {zipf_ratio:.2}");
        assert!(equal_ratio < 1.2, "equal: busiest/idlest {equal_ratio:.2}");
    }

    #[test]
    fn a_zipf_tail_group_stepping_into_the_band_moves_few_others() {
        // zipf-pressure's groups; the 15th hottest (a little under half the mean's) gains a
        // request or two and steps from 2 quarters into the band (4).
        let counts = zipf_counts(ZIPF_AT_ONE_GATEWAY);
        let mut stepped = counts.clone();
        stepped[14] += 1.5;
        let eps = endpoints(4);
        let mut moved = 0;
        for salt in 0..100u64 {
            let (before, after) = (seen_of(&counts, salt), seen_of(&stepped, salt));
            let (wb, wa) = (
                weighted(&before, 1000, MIN_REQUESTS, 0),
                weighted(&after, 1000, MIN_REQUESTS, 0),
            );
            let (hb, ha) = (shares(&wb, &eps), shares(&wa, &eps));
            let stepper = before[14].key;
            moved += wb
                .iter()
                .filter(|&&(g, _)| g != stepper && hb[&g] != ha[&g])
                .count();
        }
        // With the room counting only groups of the mean's weight or more, the step moved 5.8
        // other groups per key set (577), 1.2 now.
        assert!(moved < 300, "{moved} other groups moved over 100 key sets");
    }

    #[test]
    fn a_hot_group_wandering_across_a_whole_mean_moves_no_other_group() {
        let eps = endpoints(4);
        // 24 groups of 20 requests lately and a hot one whose count wanders across 4.5 means
        // (100 requests weigh 4 means, 110 weigh 5), then grows to 6 means (140).
        let seen = |salt: u64, hot: f32| -> Vec<Seen> {
            (0..25u64)
                .map(|i| Seen {
                    key: (i + 1 + salt * 100).wrapping_mul(0x9e37_79b9_7f4a_7c15),
                    last_ms: 1000,
                    requests: if i == 0 { hot } else { 20.0 },
                })
                .collect()
        };
        let mut moved = 0;
        for salt in 0..50u64 {
            let mut counted = Vec::new();
            let mut first = None;
            for hot in [100.0, 110.0, 100.0, 110.0, 105.0] {
                counted = steady(&counted, weighted(&seen(salt, hot), 1000, MIN_REQUESTS, 0));
                let homes = shares(&counted, &eps);
                let before = first.get_or_insert_with(|| homes.clone());
                moved += usize::from(*before != homes);
            }
            let hot_key = seen(salt, 0.0)[0].key;
            let hot_weight = |c: &[(u64, u32)]| c.iter().find(|g| g.0 == hot_key).map(|g| g.1);
            assert_eq!(hot_weight(&counted), Some(16), "salt {salt}");
            counted = steady(
                &counted,
                weighted(&seen(salt, 140.0), 1000, MIN_REQUESTS, 0),
            );
            assert_eq!(
                hot_weight(&counted),
                Some(24),
                "salt {salt}: two means is a change"
            );
        }
        assert_eq!(moved, 0);
    }

    #[test]
    fn steady_keeps_a_weight_that_moved_by_one_mean_only() {
        let previous = [(1, 16), (2, 4), (3, 2), (4, 8)];
        let next = vec![(1, 20), (2, 8), (3, 4), (4, 16), (5, 4)];
        // One mean up, one mean up, rare to average, two means up, new.
        assert_eq!(
            steady(&previous, next),
            vec![(1, 16), (2, 4), (3, 4), (4, 16), (5, 4)]
        );
    }

    #[test]
    fn the_assignment_does_not_depend_on_the_order_groups_were_seen() {
        let eps = endpoints(4);
        let mut gs = groups(30);
        gs[3].1 = 5;
        let mut reversed = gs.clone();
        reversed.reverse();
        assert_eq!(assign(&gs, &eps), assign(&reversed, &eps));
    }

    #[test]
    fn most_groups_keep_their_first_rendezvous_choice() {
        let eps = endpoints(4);
        let gs = groups(24);
        let homes = assign(&gs, &eps);
        let first = gs
            .iter()
            .filter(|(g, _)| homes[g] == eps[rendezvous::order(*g, &eps)[0]])
            .count();
        assert!(first >= 12, "only {first} of 24 at their first choice");
    }

    #[test]
    fn a_group_that_joins_moves_few_others() {
        let eps = endpoints(4);
        let gs = groups(40);
        let before = assign(&gs[..39], &eps);
        let after = assign(&gs, &eps);
        let moved = gs[..39]
            .iter()
            .filter(|(g, _)| before[g] != after[g])
            .count();
        assert!(moved <= 6, "{moved} groups moved");
    }

    /// Total share homed on each endpoint.
    fn share_loads(shares: &Shares, eps: &[u32]) -> Vec<u64> {
        eps.iter()
            .map(|e| {
                shares
                    .values()
                    .flatten()
                    .filter(|(h, _)| h == e)
                    .map(|(_, s)| s)
                    .sum()
            })
            .collect()
    }

    #[test]
    fn six_equal_groups_on_four_endpoints_split_two_of_them_to_even_out() {
        let eps = endpoints(4);
        let gs: Vec<(u64, u32)> = groups(6).into_iter().map(|(g, _)| (g, 4)).collect();
        let shares = shares(&gs, &eps);
        assert_eq!(share_loads(&shares, &eps), vec![24, 24, 24, 24]);
        let split: Vec<_> = shares.values().filter(|h| h.len() > 1).collect();
        assert_eq!(split.len(), 2, "{shares:?}");
        for (g, w) in &gs {
            let total = shares[g].iter().map(|h| h.1).sum::<u64>();
            assert_eq!(total, u64::from(*w) * SHARE_UNITS);
        }
        // A whole group keeps the home `assign` gave it; a split one keeps most of it there.
        let homes = assign(&gs, &eps);
        assert!(
            gs.iter().all(|(g, _)| shares[g][0].0 == homes[g]),
            "{shares:?}"
        );
    }

    #[test]
    fn a_lone_group_spans_every_endpoint() {
        let eps = endpoints(4);
        let shares = shares(&groups(1), &eps);
        let homes = shares.values().next().unwrap();
        assert_eq!(homes.len(), 4, "{homes:?}");
        assert!(homes.iter().all(|h| h.1 == 1), "{homes:?}");
    }

    #[test]
    fn groups_that_already_even_out_stay_whole() {
        let eps = endpoints(4);
        let gs = groups(24);
        let shares = shares(&gs, &eps);
        assert!(shares.values().all(|h| h.len() == 1));
        let homes = assign(&gs, &eps);
        assert!(gs
            .iter()
            .all(|(g, _)| shares[g] == vec![(homes[g], SHARE_UNITS)]));
    }

    #[test]
    fn a_hot_group_spills_only_what_its_endpoint_cannot_carry() {
        let eps = endpoints(4);
        let mut gs = groups(12);
        gs[0].1 = 24; // 24 of 35: a little over two thirds of the fleet's traffic
        let shares = shares(&gs, &eps);
        let loads = share_loads(&shares, &eps);
        let (lo, hi) = (loads.iter().min().unwrap(), loads.iter().max().unwrap());
        assert!((hi - lo) * 4 <= *hi, "{loads:?}");
        assert!(shares[&gs[0].0].len() >= 3, "{:?}", shares[&gs[0].0]);
        assert_eq!(shares.values().filter(|h| h.len() > 1).count(), 1);
    }

    #[test]
    fn conversations_split_by_share_and_always_alike() {
        let homes = [(7, 3), (9, 1)];
        let mut count = HashMap::new();
        for c in 0..4000u64 {
            let conversation = c.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            let home = home_of(&homes, conversation).unwrap();
            assert_eq!(home_of(&homes, conversation), Some(home));
            *count.entry(home).or_insert(0) += 1;
        }
        assert!((2800..3200).contains(&count[&7]), "{count:?}");
        assert_eq!(home_of(&[(5, 2)], 12345), Some(5));
        assert_eq!(home_of(&[], 1), None);
    }

    #[test]
    fn weights_are_recent_requests_over_the_mean_and_one_offs_do_not_count() {
        let at = |key, requests| Seen {
            key,
            last_ms: 1000,
            requests,
        };
        let seen = [
            at(1, 100.0),
            at(2, 10.0),
            at(3, 10.0),
            at(5, 10.0),
            at(4, 1.0),
        ];
        // Mean 32.5: the first is 3.1× the mean, the others under a third of it.
        assert_eq!(
            weighted(&seen, 1000, MIN_REQUESTS, 0),
            vec![(1, 12), (2, 1), (3, 1), (5, 1)]
        );
        // Counts large enough that chance moves them little: the band alone decides.
        let w = [0.01, 0.2, 0.4, 0.5, 1.4, 1.99, 2.0, 3.0, 9.2, 1e9]
            .map(|p| weight(p * 1e6, 1e6, true));
        assert_eq!(w, [1, 1, 2, 4, 4, 4, 8, 12, 36, 256]);
        // A hot group weighs whole means: a few percent more or less is the same weight.
        let w = [8.6, 9.0, 9.4, 9.6].map(|p| weight(p * 1e6, 1e6, true));
        assert_eq!(w, [36, 36, 36, 40]);
        // Few requests seen: counts within chance of the mean weigh alike, however far apart.
        let w = [1.5, 2.0, 6.0, 11.0].map(|r| weight(r, 5.0, true));
        assert_eq!(w, [4, 4, 4, 4]);
        assert_eq!(weight(40.0, 5.0, true), 32, "far beyond chance");
        // Counts that spread beyond chance: a group at a quarter of the mean is a rare one.
        assert_eq!(weight(3.0, 13.0, true), 4);
        assert_eq!(weight(3.0, 13.0, false), 1);
        assert_eq!(weight(8.0, 13.0, false), 4, "within the band");
        // A group in a lull at this gateway (2 lately among groups of 10) is chance; a prompt
        // seen once among groups of 5 or more is not; among groups of 2-4 (a gateway with a
        // third of the traffic, early on), seeing an average group once is ordinary.
        assert_eq!(weight(2.0, 10.0, true), 4);
        assert_eq!(weight(1.0, 10.0, true), 1);
        assert_eq!(weight(1.0, 6.0, true), 1);
        assert_eq!(weight(1.0, 5.0, true), 1);
        assert_eq!(weight(1.0, 4.0, true), 4);
        assert_eq!(weight(1.0, 2.5, true), 4);
        assert!(once_is_chance(4.7) && !once_is_chance(4.8));
        // Two requests seen 20 s ago (1.26 now) are a group in a lull, not a one-off.
        assert_eq!(weight(2.0 * 0.5f64.powf(20.0 / 30.0), 7.0, true), 4);
        assert_eq!(weight(1.0, 7.0, true), 1);
        let later = 1000 + HALF_LIFE_MS;
        assert!((seen[0].requests_at(later) - 50.0).abs() < 1e-6);
        assert!(
            weighted(&seen, 1000 + TTL_MS, MIN_REQUESTS, 0).is_empty(),
            "all expired"
        );
    }

    #[test]
    fn a_gateway_with_a_third_of_the_traffic_counts_a_group_from_a_third_of_the_requests() {
        let mut fleet = FleetVolume::default();
        let engines = |n: f64| [("a:1", 100.0 + n), ("b:1", 50.0 + 2.0 * n)];
        // The first observation is a baseline: nothing is known of the share yet.
        fleet.observe(engines(0.0), 0);
        assert_eq!(fleet.share(10.0), 1.0);
        assert_eq!(fleet.min_requests(10.0), MIN_REQUESTS);
        // The engines finished 60 requests since; this gateway saw 20 of them.
        fleet.observe(engines(20.0), 1000);
        assert!((fleet.share(20.0) - 1.0 / 3.0).abs() < 0.02);
        assert!((fleet.min_requests(20.0) - 0.5).abs() < 0.02);
        let seen = [
            Seen {
                key: 1,
                last_ms: 1000,
                requests: 1.0,
            },
            Seen {
                key: 2,
                last_ms: 1000,
                requests: 2.0,
            },
        ];
        assert_eq!(weighted(&seen, 1000, MIN_REQUESTS, 0).len(), 1);
        assert_eq!(weighted(&seen, 1000, fleet.min_requests(20.0), 0).len(), 2);
        // A lone gateway, or one that sees more than the engines report, keeps the full bar; a
        // tiny share is bounded.
        assert_eq!(fleet.share(500.0), 1.0);
        assert_eq!(fleet.share(0.0), MIN_SHARE);
        // An engine that restarted counts from zero; one that left counts nothing more.
        fleet.observe([("a:1", 5.0)], 1000);
        assert!((fleet.share(65.0) - 1.0).abs() < 1e-9);
        // The volume decays like the group counts.
        fleet.observe([("a:1", 5.0)], 1000 + HALF_LIFE_MS);
        assert!((fleet.share(32.5) - 1.0).abs() < 1e-9);
        // An engine that left and came back starts from a new baseline.
        fleet.observe([("a:1", 5.0), ("b:1", 500.0)], 1000 + HALF_LIFE_MS);
        assert!((fleet.share(32.5) - 1.0).abs() < 1e-9);
    }

    #[test]
    fn the_table_counts_requests_and_stays_bounded() {
        let store = MemoryStore::new();
        assert_eq!(record(&store, &[(7, 1)], 10)[0].requests, 1.0);
        let seen = record(&store, &[(7, 3), (8, 1)], 20);
        assert_eq!(seen.len(), 2);
        assert!((seen.iter().find(|s| s.key == 7).unwrap().requests - 4.0).abs() < 1e-3);
        for g in 0..10_000u64 {
            record(
                &store,
                &[(g.wrapping_mul(0x9e37_79b9_7f4a_7c15), 1)],
                100 + g,
            );
        }
        let (all, versions) = read(&store);
        assert_eq!(all.len(), SHARDS * PER_SHARD);
        assert_eq!(versions.len(), SHARDS);
        assert_eq!(store.len(), SHARDS);
    }

    #[test]
    fn a_malformed_shard_reads_as_empty() {
        assert!(decode(b"\x09garbage").is_empty());
        assert!(decode(&[]).is_empty());
        let r = vec![Seen {
            key: u64::MAX,
            last_ms: 5,
            requests: 3.5,
        }];
        assert_eq!(decode(&encode(&r)), r);
    }
}
