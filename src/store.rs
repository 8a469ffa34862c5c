//! The shared key-value store kvroute keeps its state in: Envoy shared data, or a map in tests.
//!
//! Envoy's shared data is visible to every worker VM with the same `vm_id`, offers compare-and-swap
//! through a version number (`cas`), and never deletes a key. Everything kvroute writes is
//! therefore a whole value replaced atomically, under a key space bounded by construction.

use std::cell::{Cell, RefCell};

use hashbrown::HashMap;

/// Why a write did not happen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreError {
    /// Someone else wrote the key since we read it; read again and retry.
    CasMismatch,
    /// The host refused the write for another reason.
    Failed,
}

/// A versioned key-value store with compare-and-swap writes.
pub trait SharedStore {
    /// The value and its version, or `(None, None)` when the key was never written.
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>);
    /// Writes `value` if the key's version is still `cas` (`None`: unconditionally).
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError>;
}

/// Prefixes `body` with its format `version`. Every value kvroute writes starts with one, so a
/// kvroute of another format sharing the `vm_id` (during an upgrade) ignores it instead of
/// misreading it.
pub fn versioned(version: u8, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(1 + body.len());
    out.push(version);
    out.extend_from_slice(body);
    out
}

/// The body of a value [`versioned`] with `version`; `None` for any other version.
pub fn unversioned(version: u8, value: &[u8]) -> Option<&[u8]> {
    match value.split_first() {
        Some((&v, body)) if v == version => Some(body),
        _ => None,
    }
}

/// How many times a read-modify-write is retried after losing a race before giving up.
pub const CAS_RETRIES: usize = 16;

/// Read-modify-write of one key under CAS. `update` gets the current value (if any) and returns
/// the new value, or `None` to leave the key as it is. Returns whether the key was newly created
/// and whether the write happened (false after `CAS_RETRIES` lost races, or when `update` declined).
pub fn update<S: SharedStore + ?Sized>(
    store: &S,
    key: &str,
    mut update: impl FnMut(Option<&[u8]>) -> Option<Vec<u8>>,
) -> Update {
    for _ in 0..CAS_RETRIES {
        let (current, cas) = store.get(key);
        let Some(next) = update(current.as_deref()) else {
            return Update::Declined;
        };
        match store.set(key, &next, cas) {
            Ok(()) if current.is_none() => return Update::Created,
            Ok(()) => return Update::Written,
            Err(StoreError::CasMismatch) => continue,
            Err(StoreError::Failed) => return Update::Failed,
        }
    }
    Update::Failed
}

/// The result of [`update`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Update {
    Created,
    Written,
    Declined,
    Failed,
}

/// An in-memory [`SharedStore`] with Envoy's semantics, for tests and native tools.
#[derive(Default)]
pub struct MemoryStore {
    map: RefCell<HashMap<String, (Vec<u8>, u32)>>,
    calls: Cell<u64>,
}

impl MemoryStore {
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of keys ever written.
    pub fn len(&self) -> usize {
        self.map.borrow().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Gets and sets so far: what each would cost in Envoy is a host call under a host-wide lock.
    pub fn calls(&self) -> u64 {
        self.calls.get()
    }
}

impl SharedStore for MemoryStore {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        self.calls.set(self.calls.get() + 1);
        match self.map.borrow().get(key) {
            Some((value, cas)) => (Some(value.clone()), Some(*cas)),
            None => (None, None),
        }
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        self.calls.set(self.calls.get() + 1);
        let mut map = self.map.borrow_mut();
        match map.get_mut(key) {
            // Like Envoy: a version of 0 (or none) writes unconditionally.
            Some((_, current)) if cas.is_some_and(|c| c != 0 && c != *current) => {
                Err(StoreError::CasMismatch)
            }
            Some(entry) => {
                entry.0 = value.to_vec();
                entry.1 = entry.1.wrapping_add(1).max(1);
                Ok(())
            }
            None => {
                map.insert(key.to_string(), (value.to_vec(), 1));
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_cas_is_refused_and_fresh_cas_is_accepted() {
        let store = MemoryStore::new();
        store.set("k", b"a", None).unwrap();
        let (_, cas) = store.get("k");
        store.set("k", b"b", cas).unwrap();
        assert_eq!(store.set("k", b"c", cas), Err(StoreError::CasMismatch));
        assert_eq!(store.get("k").0.as_deref(), Some(&b"b"[..]));
    }

    #[test]
    fn a_value_of_another_version_reads_as_nothing() {
        let v = versioned(3, b"body");
        assert_eq!(unversioned(3, &v), Some(&b"body"[..]));
        assert_eq!(unversioned(4, &v), None);
        assert_eq!(unversioned(3, b""), None);
        assert_eq!(
            unversioned(b'{', br#"{"old":"json"}"#),
            Some(&br#""old":"json"}"#[..])
        );
    }

    #[test]
    fn update_reports_creation_then_writes() {
        let store = MemoryStore::new();
        assert_eq!(update(&store, "k", |_| Some(vec![1])), Update::Created);
        assert_eq!(
            update(&store, "k", |v| v.map(|v| vec![v[0] + 1])),
            Update::Written
        );
        assert_eq!(store.get("k").0, Some(vec![2]));
        assert_eq!(update(&store, "k", |_| None), Update::Declined);
    }
}
