//! The fleet's request volume, from the engines' finished-requests counters: which share of the
//! traffic this gateway sees, and so how many requests of a group it must see to count it.

use hashbrown::HashMap;

use super::table::{decay, Seen};

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
