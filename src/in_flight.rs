//! kvroute's own requests in flight per endpoint, and the prefill work they still queue there,
//! shared by all workers in one shared-data value. Current between polls, where the engines'
//! reports and Envoy's `rq_active` are up to one poll interval old. Entries with nothing in flight
//! are dropped, so the value stays as small as the set of busy endpoints.
//!
//! A worker counts its own requests in a [`Local`] (no host call on the request path) and writes
//! them to the shared value once per tick with one compare-and-swap, reading back what every worker
//! wrote: it sees its own requests at once and the other workers' a tick late. Counting each
//! request in the shared value would cost four shared-data calls per request (a read and a
//! compare-and-swap as it is routed, again as it ends), each swap racing every other worker's
//! requests for the one key.

use crate::shared_keys;
use crate::store::{self, SharedStore, Update};

/// Format of the value; another version (an older kvroute in the same VM) reads as empty.
const VERSION: u8 = 3;
const ENTRY_LEN: usize = 12;

/// One endpoint's count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    pub id: u32,
    pub inflight: u32,
    /// Prompt bytes kvroute's requests there have yet to prefill: the uncached part of each
    /// request not yet at its first response byte ([`prefill`](crate::prefill)).
    pub prefill: u32,
}

/// A change to one endpoint's counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Delta {
    pub id: u32,
    pub inflight: i64,
    pub prefill: i64,
}

/// Every endpoint's counts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Table {
    pub counts: Vec<Counts>,
}

impl Table {
    /// Endpoint `id`'s in-flight count (zero when it has none).
    pub fn inflight(&self, id: u32) -> u32 {
        self.counts
            .iter()
            .find(|c| c.id == id)
            .map_or(0, |c| c.inflight)
    }

    /// Endpoint `id`'s queued prefill bytes (zero when it has none).
    pub fn prefill(&self, id: u32) -> u32 {
        self.counts
            .iter()
            .find(|c| c.id == id)
            .map_or(0, |c| c.prefill)
    }
}

/// Every endpoint's current counts.
pub fn read<S: SharedStore + ?Sized>(store: &S) -> Table {
    let (value, _) = store.get(shared_keys::LOAD);
    let counts = value.as_deref().map(decode).unwrap_or_default();
    Table { counts }
}

/// Adds each endpoint's deltas with one compare-and-swap (counts never going below zero). Returns
/// the table as written, or `None` if the update lost too many races.
pub fn add_all<S: SharedStore + ?Sized>(store: &S, deltas: &[Delta]) -> Option<Table> {
    let mut result = None;
    let outcome = store::update(store, shared_keys::LOAD, |current| {
        let mut counts = current.map(decode).unwrap_or_default();
        for d in deltas {
            apply(&mut counts, d);
        }
        let value = encode(&counts);
        result = Some(Table { counts });
        Some(value)
    });
    match outcome {
        Update::Created | Update::Written | Update::Declined => result,
        Update::Failed => None,
    }
}

/// One worker's view of the counts: the shared table as last read, plus its own requests since
/// (started and ended), which it writes at the next [`Local::flush`].
#[derive(Debug, Default)]
pub struct Local {
    table: Table,
    deltas: Vec<Delta>,
}

impl Local {
    /// Endpoint `id`'s count: the shared one as last read with this worker's requests since.
    pub fn inflight(&self, id: u32) -> u32 {
        let delta = self.delta(id).map_or(0, |d| d.inflight);
        plus(self.table.inflight(id), delta)
    }

    /// Endpoint `id`'s queued prefill bytes: the shared one as last read with this worker's
    /// changes since.
    pub fn prefill(&self, id: u32) -> u32 {
        let delta = self.delta(id).map_or(0, |d| d.prefill);
        plus(self.table.prefill(id), delta)
    }

    /// Every endpoint's counts as [`Local::inflight`] gives them.
    pub fn view(&self) -> Table {
        let mut counts = self.table.counts.clone();
        for d in &self.deltas {
            apply(&mut counts, d);
        }
        Table { counts }
    }

    /// Counts a request more (`delta` 1) or fewer (-1) at endpoint `id`. Returns its count now,
    /// which, as in the shared table, never goes below zero: an end whose start a correction
    /// already removed takes nothing from the next request.
    pub fn add(&mut self, id: u32, delta: i64) -> u32 {
        let floor = -i64::from(self.table.inflight(id));
        let d = self.delta_mut(id);
        d.inflight = (d.inflight + delta).max(floor);
        self.inflight(id)
    }

    /// Adds `bytes` (negative: removes them) to endpoint `id`'s queued prefill, never below zero.
    pub fn add_prefill(&mut self, id: u32, bytes: i64) {
        let floor = -i64::from(self.table.prefill(id));
        let d = self.delta_mut(id);
        d.prefill = (d.prefill + bytes).max(floor);
    }

    fn delta(&self, id: u32) -> Option<&Delta> {
        self.deltas.iter().find(|d| d.id == id)
    }

    fn delta_mut(&mut self, id: u32) -> &mut Delta {
        let at = match self.deltas.iter().position(|d| d.id == id) {
            Some(at) => at,
            None => {
                self.deltas.push(Delta {
                    id,
                    inflight: 0,
                    prefill: 0,
                });
                self.deltas.len() - 1
            }
        };
        &mut self.deltas[at]
    }

    /// Writes this worker's requests since the last flush to the shared table and reads what every
    /// worker wrote (one call when there is nothing to write). What cannot be written now stays
    /// for the next flush.
    pub fn flush<S: SharedStore + ?Sized>(&mut self, store: &S) {
        self.deltas.retain(|d| d.inflight != 0 || d.prefill != 0);
        let table = if self.deltas.is_empty() {
            Some(read(store))
        } else {
            add_all(store, &self.deltas)
        };
        if let Some(table) = table {
            self.deltas.clear();
            self.table = table;
        }
    }
}

/// Corrects the counts against what Envoy itself has in flight to each endpoint (`caps`:
/// endpoint id → Envoy's `rq_active`). kvroute's count can only drift upward (a stream whose end
/// it never saw, as across a VM reload), so a count above Envoy's is lowered to it, and its queued
/// prefill in proportion. Endpoints not in `caps` are left alone. Returns how many requests were
/// removed in all.
pub fn correct<S: SharedStore + ?Sized>(store: &S, caps: &[(u32, u64)]) -> u64 {
    let mut removed = 0;
    store::update(store, shared_keys::LOAD, |current| {
        removed = 0;
        let mut counts = current.map(decode)?;
        for c in counts.iter_mut() {
            if let Some(&(_, cap)) = caps.iter().find(|(id, _)| *id == c.id) {
                let cap = u32::try_from(cap).unwrap_or(u32::MAX);
                if c.inflight > cap {
                    removed += u64::from(c.inflight - cap);
                    c.prefill =
                        (u64::from(c.prefill) * u64::from(cap) / u64::from(c.inflight)) as u32;
                    c.inflight = cap;
                }
            }
        }
        if removed == 0 {
            return None;
        }
        counts.retain(|c| c.inflight > 0);
        Some(encode(&counts))
    });
    removed
}

/// Applies `d`. An endpoint with nothing in flight has nothing queued: its entry goes, so prefill
/// whose request's end was never seen leaves with the correction of its count.
fn apply(counts: &mut Vec<Counts>, d: &Delta) {
    let pos = match counts.iter().position(|c| c.id == d.id) {
        Some(p) => p,
        None => {
            counts.push(Counts {
                id: d.id,
                inflight: 0,
                prefill: 0,
            });
            counts.len() - 1
        }
    };
    // Saturating: a decrement whose increment was lost to a startup race heals instead of
    // leaving a negative (and forever wrong) count.
    let c = &mut counts[pos];
    c.inflight = plus(c.inflight, d.inflight);
    c.prefill = plus(c.prefill, d.prefill);
    counts.retain(|c| c.inflight > 0);
}

/// `count` moved by `delta`, within 0..=u32::MAX.
fn plus(count: u32, delta: i64) -> u32 {
    (i64::from(count) + delta).clamp(0, i64::from(u32::MAX)) as u32
}

fn encode(counts: &[Counts]) -> Vec<u8> {
    let mut out = Vec::with_capacity(1 + counts.len() * ENTRY_LEN);
    out.push(VERSION);
    for c in counts {
        out.extend_from_slice(&c.id.to_le_bytes());
        out.extend_from_slice(&c.inflight.to_le_bytes());
        out.extend_from_slice(&c.prefill.to_le_bytes());
    }
    out
}

/// Decodes the value; another version or a torn value reads as no counts.
fn decode(bytes: &[u8]) -> Vec<Counts> {
    let Some((&VERSION, body)) = bytes.split_first() else {
        return Vec::new();
    };
    let word = |b: &[u8], i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    body.chunks_exact(ENTRY_LEN)
        .map(|b| Counts {
            id: word(b, 0),
            inflight: word(b, 4),
            prefill: word(b, 8),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;

    /// Adds `delta` to endpoint `id`'s count in the shared value at once, as a flush does.
    fn add(store: &MemoryStore, id: u32, delta: i64) -> Option<u32> {
        let d = Delta {
            id,
            inflight: delta,
            prefill: 0,
        };
        add_all(store, &[d]).map(|t| t.inflight(id))
    }

    #[test]
    fn in_flight_counts_go_up_and_back_to_zero() {
        let store = MemoryStore::new();
        assert_eq!(add(&store, 1, 1), Some(1));
        assert_eq!(add(&store, 1, 1), Some(2));
        add(&store, 2, 1);
        assert_eq!(
            read(&store).counts,
            vec![
                Counts {
                    id: 1,
                    inflight: 2,
                    prefill: 0
                },
                Counts {
                    id: 2,
                    inflight: 1,
                    prefill: 0
                }
            ]
        );
        add(&store, 1, -1);
        add(&store, 1, -1);
        add(&store, 2, -1);
        assert!(
            read(&store).counts.is_empty(),
            "entries at zero are dropped"
        );
    }

    #[test]
    fn an_in_flight_count_never_goes_below_zero() {
        let store = MemoryStore::new();
        assert_eq!(add(&store, 1, -1), Some(0));
        assert_eq!(add(&store, 1, 1), Some(1));
        assert_eq!(read(&store).inflight(1), 1);
        assert_eq!(read(&store).inflight(7), 0);
    }

    #[test]
    fn counts_above_envoys_are_lowered_to_it_and_others_kept() {
        let store = MemoryStore::new();
        for _ in 0..5 {
            add(&store, 1, 1);
        }
        add(&store, 2, 1);
        add(&store, 3, 1);
        // Endpoint 1 lost 3 streams' ends; 2 has more at Envoy (other traffic); 3 unknown.
        assert_eq!(correct(&store, &[(1, 2), (2, 4)]), 3);
        let t = read(&store);
        assert_eq!((t.inflight(1), t.inflight(2), t.inflight(3)), (2, 1, 1));
        assert_eq!(correct(&store, &[(1, 0)]), 2);
        assert_eq!(read(&store).inflight(1), 0);
        assert_eq!(correct(&MemoryStore::new(), &[(1, 0)]), 0);
    }

    #[test]
    fn large_counts_survive_encoding_and_other_versions_read_as_empty() {
        let counts = vec![Counts {
            id: u32::MAX,
            inflight: u32::MAX - 1,
            prefill: u32::MAX - 2,
        }];
        assert_eq!(decode(&encode(&counts)), counts);
        let mut old = encode(&counts);
        old[0] = 1;
        assert!(decode(&old).is_empty());
        assert!(decode(&[]).is_empty());
    }

    #[test]
    fn a_worker_sees_its_own_requests_at_once_and_the_others_after_a_flush() {
        let store = MemoryStore::new();
        let (mut a, mut b) = (Local::default(), Local::default());
        assert_eq!(a.add(1, 1), 1);
        assert_eq!(a.add(1, 1), 2);
        assert_eq!(b.add(1, 1), 1, "a has not flushed");
        let calls = store.calls();
        assert_eq!(a.inflight(1), 2);
        assert_eq!(store.calls(), calls, "no host call on the request path");
        a.flush(&store);
        assert_eq!(a.inflight(1), 2, "a saw its own already");
        b.flush(&store);
        assert_eq!(b.inflight(1), 3);
        a.flush(&store);
        assert_eq!(a.inflight(1), 3, "b's request");
        // Requests end on either worker.
        a.add(1, -1);
        a.add(1, -1);
        b.add(1, -1);
        a.flush(&store);
        b.flush(&store);
        a.flush(&store);
        assert_eq!((a.inflight(1), b.inflight(1)), (0, 0));
        assert!(
            read(&store).counts.is_empty(),
            "entries at zero are dropped"
        );
    }

    #[test]
    fn a_flush_writes_every_endpoint_at_once_and_never_below_zero() {
        let store = MemoryStore::new();
        let mut a = Local::default();
        a.add(1, 1);
        a.add(2, 1);
        a.add(3, -1);
        assert_eq!(a.view().counts.len(), 2, "{:?}", a.view());
        let calls = store.calls();
        a.flush(&store);
        assert_eq!(store.calls() - calls, 2, "one read, one write");
        let t = read(&store);
        assert_eq!((t.inflight(1), t.inflight(2), t.inflight(3)), (1, 1, 0));
        // A correction lowered a count meanwhile: the worker's own end never takes it below zero,
        // nor the next request's count with it.
        correct(&store, &[(1, 0)]);
        a.flush(&store);
        assert_eq!(a.add(1, -1), 0);
        assert_eq!(a.add(1, 1), 1, "the next request counts");
        a.flush(&store);
        assert_eq!(read(&store).inflight(1), 1);
        assert_eq!(a.inflight(1), 1);
    }

    #[test]
    fn queued_prefill_is_shared_like_the_counts_and_leaves_with_them() {
        let store = MemoryStore::new();
        let (mut a, mut b) = (Local::default(), Local::default());
        a.add(1, 1);
        a.add_prefill(1, 4_000);
        b.add(1, 1);
        b.add_prefill(1, 1_000);
        a.flush(&store);
        b.flush(&store);
        assert_eq!(b.view().prefill(1), 5_000, "both workers' work");
        b.add_prefill(1, -1_000);
        b.add_prefill(1, -9_000);
        b.flush(&store);
        assert_eq!(read(&store).prefill(1), 0, "never below zero");
        a.add_prefill(1, 2_000);
        a.flush(&store);
        // Envoy has half the requests kvroute counts: half the work goes with the others.
        correct(&store, &[(1, 1)]);
        assert_eq!(read(&store).prefill(1), 1_000);
        correct(&store, &[(1, 0)]);
        assert!(
            read(&store).counts.is_empty(),
            "nothing in flight, nothing queued"
        );
    }
}
