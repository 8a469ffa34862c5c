//! Prompt text → chained chunk keys: key i hashes chunk i together with key i-1, so it stands for
//! the whole prefix up to and including chunk i, and equal keys mean equal prefixes.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// The chained keys of one prompt, namespaced by model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixKeys {
    /// Hash of the model name: seeds the chain and keys requests without prompt text.
    pub model: u64,
    /// One key per chunk (the last chunk may be partial), at most `max_chunks`.
    pub keys: Vec<u64>,
}

impl PrefixKeys {
    /// Splits `text` into `chunk_size`-byte chunks (the last may be shorter) and chains their hashes.
    pub fn new(model: &str, text: &str, chunk_size: usize, max_chunks: usize) -> PrefixKeys {
        let model = xxh3_64(model.as_bytes());
        let mut keys = Vec::with_capacity(text.len().div_ceil(chunk_size.max(1)).min(max_chunks));
        let mut previous = model;
        for chunk in text.as_bytes().chunks(chunk_size.max(1)).take(max_chunks) {
            previous = xxh3_64_with_seed(chunk, previous);
            keys.push(previous);
        }
        PrefixKeys { model, keys }
    }

    /// The key that places a new prefix: its first chunk (what requests of a group share first),
    /// or the model for an empty prompt.
    pub fn placement_key(&self) -> u64 {
        self.keys.first().copied().unwrap_or(self.model)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_prefixes_give_equal_leading_keys_and_then_diverge() {
        let shared = "s".repeat(100);
        let a = PrefixKeys::new("m", &format!("{shared}aaaa"), 16, 64);
        let b = PrefixKeys::new("m", &format!("{shared}bbbb"), 16, 64);
        assert_eq!(a.keys.len(), 7);
        assert_eq!(a.keys[..6], b.keys[..6]);
        assert_ne!(a.keys[6], b.keys[6]);
    }

    #[test]
    fn a_key_depends_on_every_chunk_before_it() {
        let a = PrefixKeys::new("m", "xxxxyyyy", 4, 8);
        let b = PrefixKeys::new("m", "zzzzyyyy", 4, 8);
        assert_ne!(
            a.keys[1], b.keys[1],
            "same second chunk, different first chunk"
        );
    }

    #[test]
    fn the_model_namespaces_keys() {
        let a = PrefixKeys::new("m1", "same text", 4, 8);
        let b = PrefixKeys::new("m2", "same text", 4, 8);
        assert!(a.keys.iter().zip(&b.keys).all(|(x, y)| x != y));
    }

    #[test]
    fn keys_stop_at_max_chunks_and_empty_text_places_by_model() {
        assert_eq!(PrefixKeys::new("m", &"x".repeat(1000), 10, 8).keys.len(), 8);
        let empty = PrefixKeys::new("m", "", 10, 8);
        assert!(empty.keys.is_empty());
        assert_eq!(empty.placement_key(), empty.model);
    }

    #[test]
    fn keys_are_the_same_on_every_platform() {
        // Pinned values: a wasm32 build must agree with a native one, or two Envoys on different
        // hosts (and this test under wasm) would disagree on placement.
        let k = PrefixKeys::new("m", "hello world", 4, 8);
        assert_eq!(k.keys.len(), 3);
        assert_eq!(k.model, xxh3_64(b"m"));
        assert_eq!(k.keys[0], xxh3_64_with_seed(b"hell", xxh3_64(b"m")));
        assert_eq!(k.model, 0xf090_4807_418c_57fc_u64, "{:#x}", k.model);
    }
}
