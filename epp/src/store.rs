//! The process's shared data: the filter's in-memory store behind a lock, so every worker thread
//! reads and writes one namespace with the same compare-and-swap semantics Envoy's shared data has.

use std::sync::Mutex;

use kvroute::store::{MemoryStore, SharedStore, StoreError};

/// A [`SharedStore`] every worker of the process shares. Each get or set takes the lock once, as
/// each shared-data call in Envoy does; the versioning is [`MemoryStore`]'s, unchanged.
#[derive(Default)]
pub struct SyncStore {
    inner: Mutex<MemoryStore>,
}

impl SyncStore {
    pub fn new() -> SyncStore {
        SyncStore::default()
    }

    fn with<T>(&self, f: impl FnOnce(&MemoryStore) -> T) -> T {
        // A worker that panicked holding the lock left no half-written value (a set replaces a
        // value whole): the store is still good to use.
        let guard = self
            .inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        f(&guard)
    }
}

impl SharedStore for SyncStore {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        self.with(|store| store.get(key))
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        self.with(|store| store.set(key, value, cas))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute::store::{update, Update};
    use std::sync::Arc;

    #[test]
    fn answers_every_call_as_the_filters_store_does() {
        let ours = SyncStore::new();
        let filters = MemoryStore::new();
        let stores: [&dyn SharedStore; 2] = [&ours, &filters];
        let answers: Vec<_> = stores
            .iter()
            .map(|s| {
                let first = s.set("k", b"a", None);
                let (_, cas) = s.get("k");
                let fresh = s.set("k", b"b", cas);
                let stale = s.set("k", b"c", cas);
                let zero = s.set("k", b"d", Some(0));
                (first, cas, fresh, stale, zero, s.get("k"), s.get("never"))
            })
            .collect();
        assert_eq!(answers[0], answers[1]);
        assert_eq!(answers[0].3, Err(StoreError::CasMismatch));
    }

    #[test]
    fn concurrent_read_modify_writes_lose_no_increment() {
        let store = Arc::new(SyncStore::new());
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let store = store.clone();
                std::thread::spawn(move || {
                    let mut written = 0;
                    for _ in 0..500 {
                        let step = update(&*store, "n", |v| {
                            let n = v.map_or(0, |v| u32::from_le_bytes(v.try_into().unwrap()));
                            Some((n + 1).to_le_bytes().to_vec())
                        });
                        written += u32::from(matches!(step, Update::Created | Update::Written));
                    }
                    written
                })
            })
            .collect();
        let written: u32 = threads.into_iter().map(|t| t.join().unwrap()).sum();
        let (value, _) = store.get("n");
        let n = u32::from_le_bytes(value.unwrap().try_into().unwrap());
        assert_eq!(
            n, written,
            "every write that reported success is counted once"
        );
        assert!(written > 0);
    }
}
