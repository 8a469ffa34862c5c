//! How old kvroute's picture of the fleet is, by a clock that never jumps: each worker's elapsed
//! time, advanced on its ticks, and poll rounds counted in shared data instead of wall-clock
//! deadlines.
//!
//! proxy-wasm gives a filter only the wall clock (`get_current_time`), which NTP may step back or
//! forward. A [`MonoClock`] adds up the wall clock's steps between ticks but takes a step that is
//! negative or far longer than the tick period as one tick period: time only moves forward, and
//! at about the rate the timer fires. The poll lease is a round number in shared data: a worker
//! takes the next round when it has seen the current one unchanged for a poll interval of its own
//! clock, so no two workers' clocks are ever compared.

use crate::store::{self, SharedStore, Update};

/// Polls a host snapshot or an engine's load may miss before it is too old to route on.
pub const STALE_POLLS: u64 = 3;

/// The oldest a host snapshot may be, for a poll period of `interval_ms`.
pub fn max_age_ms(interval_ms: u64) -> u64 {
    STALE_POLLS * interval_ms.max(1) + interval_ms.max(1) / 2
}

/// A worker's monotonic milliseconds, advanced from the wall clock on each tick.
#[derive(Debug, Default, Clone)]
pub struct MonoClock {
    elapsed_ms: u64,
    last_wall_ms: Option<u64>,
}

impl MonoClock {
    /// Advances to wall time `wall_ms`, on a tick expected every `tick_ms`; returns the time.
    pub fn advance(&mut self, wall_ms: u64, tick_ms: u64) -> u64 {
        if let Some(last) = self.last_wall_ms {
            let step = wall_ms.wrapping_sub(last);
            // A step back, or one far beyond the period: the wall clock was set, not time passing.
            let plausible = wall_ms >= last && step <= 4 * tick_ms.max(1) + 1000;
            self.elapsed_ms += if plausible { step } else { tick_ms };
        }
        self.last_wall_ms = Some(wall_ms);
        self.elapsed_ms
    }

    pub fn now(&self) -> u64 {
        self.elapsed_ms
    }
}

/// How long something that changes on every successful poll has gone unchanged, on this worker's
/// clock (a snapshot's shared-data version, say).
#[derive(Debug, Default, Clone)]
pub struct Age<T: PartialEq> {
    seen: Option<(T, u64)>,
}

impl<T: PartialEq> Age<T> {
    /// Notes the current version at `now`; returns how long it has been the same.
    pub fn observe(&mut self, version: T, now: u64) -> u64 {
        match &self.seen {
            Some((v, since)) if *v == version => now.saturating_sub(*since),
            _ => {
                self.seen = Some((version, now));
                0
            }
        }
    }

    /// How long the last observed version has been unchanged (`None`: never observed).
    pub fn age(&self, now: u64) -> Option<u64> {
        self.seen
            .as_ref()
            .map(|(_, since)| now.saturating_sub(*since))
    }
}

/// This worker's view of the shared poll round.
#[derive(Debug, Default, Clone)]
pub struct RoundLease {
    round: Age<u64>,
}

impl RoundLease {
    /// Whether this worker polls now: the round in `key` has stayed the same for `interval_ms` of
    /// this worker's clock (or there is none yet), and this worker moved it on first.
    pub fn take<S: SharedStore + ?Sized>(
        &mut self,
        store: &S,
        key: &str,
        now: u64,
        interval_ms: u64,
    ) -> bool {
        let current = read_round(store.get(key).0.as_deref());
        let unchanged = self.round.observe(current, now);
        let due = current == 0 || unchanged >= interval_ms * 9 / 10;
        if !due {
            return false;
        }
        let outcome = store::update(store, key, |value| {
            (read_round(value) == current)
                .then(|| store::versioned(ROUND_VERSION, &(current + 1).to_le_bytes()))
        });
        let taken = matches!(outcome, Update::Created | Update::Written);
        if taken {
            self.round.observe(current + 1, now);
        }
        taken
    }
}

/// Format of the round's value (a version byte, then the round): another version reads as none.
const ROUND_VERSION: u8 = 1;

fn read_round(value: Option<&[u8]>) -> u64 {
    value
        .and_then(|v| store::unversioned(ROUND_VERSION, v))
        .and_then(|v| v.try_into().ok())
        .map_or(0, u64::from_le_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;

    #[test]
    fn the_clock_never_goes_back_nor_leaps() {
        let mut c = MonoClock::default();
        assert_eq!(c.advance(1_000_000, 250), 0);
        assert_eq!(c.advance(1_000_250, 250), 250);
        assert_eq!(c.advance(900_000, 250), 500, "set back: one tick");
        assert_eq!(c.advance(900_300, 250), 800);
        assert_eq!(c.advance(5_000_000, 250), 1050, "set forward: one tick");
        assert_eq!(c.now(), 1050);
    }

    #[test]
    fn one_worker_per_interval_takes_the_lease() {
        let store = MemoryStore::new();
        let (mut a, mut b) = (RoundLease::default(), RoundLease::default());
        assert!(a.take(&store, "k", 0, 1000), "first round");
        assert!(!b.take(&store, "k", 5, 1000), "b just saw round 1");
        assert!(!a.take(&store, "k", 500, 1000));
        assert!(!b.take(&store, "k", 600, 1000));
        // b's clock is ahead of a's: only elapsed time on each worker's own clock matters.
        assert!(b.take(&store, "k", 905, 1000));
        assert!(!a.take(&store, "k", 950, 1000), "a sees round 2 now");
        assert!(a.take(&store, "k", 1850, 1000));
    }

    #[test]
    fn an_age_resets_when_the_version_changes() {
        let mut age = Age::default();
        assert_eq!(age.age(10), None);
        assert_eq!(age.observe(Some(1u32), 100), 0);
        assert_eq!(age.observe(Some(1), 400), 300);
        assert_eq!(age.age(1000), Some(900));
        assert_eq!(age.observe(Some(2), 1000), 0);
        assert!(max_age_ms(1000) > 3000);
    }
}
