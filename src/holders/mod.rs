//! Who holds a request's prefixes: the affinity map (where this gateway saw each prefix served)
//! and the engine index (what the engines report holding), two fixed tables of chained chunk keys
//! in shared data that answer the one question, [`Holders::longest_match`].

pub mod affinity;
pub mod engine;
pub mod slots;

/// The longest prefix of a request's keys that some endpoints hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    /// Leading chunk keys held.
    pub depth: usize,
    /// Endpoint ids, first holder first.
    pub holders: Vec<u32>,
    /// When its deepest key was last used, where the table keeps it (the affinity map).
    pub stamp_ms: Option<u64>,
}

/// A table of which endpoints hold which prefix keys.
pub trait Holders {
    /// The deepest of `keys[from..]` some endpoint holds, as the number of leading keys it stands
    /// for (a chained key stands for the whole prefix up to it), and who holds it.
    fn longest_match(&self, keys: &[u64], from: usize) -> Option<Held>;
}
