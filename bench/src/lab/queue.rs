//! The lab's virtual clock: events ordered by time, and by the order they were scheduled at one
//! time, so a run is the same however often it is repeated.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Duration;

/// Events of type `E` waiting for their time.
pub struct Queue<E> {
    heap: BinaryHeap<Reverse<(Duration, u64)>>,
    /// Payloads by sequence number, taken as they come due.
    slots: std::collections::HashMap<u64, E>,
    seq: u64,
    now: Duration,
}

impl<E> Default for Queue<E> {
    fn default() -> Self {
        Queue {
            heap: BinaryHeap::new(),
            slots: std::collections::HashMap::new(),
            seq: 0,
            now: Duration::ZERO,
        }
    }
}

impl<E> Queue<E> {
    /// The time of the event last taken.
    pub fn now(&self) -> Duration {
        self.now
    }

    /// Schedules `event` at `at` (never before now: a past time means now).
    pub fn at(&mut self, at: Duration, event: E) {
        let at = at.max(self.now);
        self.heap.push(Reverse((at, self.seq)));
        self.slots.insert(self.seq, event);
        self.seq += 1;
    }

    /// The next event, the clock moved to its time; ties in the order they were scheduled.
    pub fn pop(&mut self) -> Option<(Duration, E)> {
        let Reverse((at, seq)) = self.heap.pop()?;
        self.now = at;
        let event = self.slots.remove(&seq)?;
        Some((at, event))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_come_in_time_order_and_ties_in_the_order_scheduled() {
        let mut q = Queue::default();
        let ms = Duration::from_millis;
        q.at(ms(5), "c");
        q.at(ms(1), "a");
        q.at(ms(5), "d");
        q.at(ms(1), "b");
        let order: Vec<_> = std::iter::from_fn(|| q.pop()).map(|(_, e)| e).collect();
        assert_eq!(order, ["a", "b", "c", "d"]);
        assert_eq!(q.now(), ms(5));
    }

    #[test]
    fn an_event_scheduled_in_the_past_comes_now() {
        let mut q = Queue::default();
        q.at(Duration::from_millis(10), 1);
        q.pop();
        q.at(Duration::from_millis(3), 2);
        assert_eq!(q.pop(), Some((Duration::from_millis(10), 2)));
    }
}
