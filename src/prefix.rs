//! Prompt text → chained chunk keys: key i hashes chunk i together with key i-1, so it stands for
//! the whole prefix up to and including chunk i, and equal keys mean equal prefixes. The chain is
//! seeded by the model and, when the request has one, its cache salt: the engine shares no
//! cached block between salts, so neither do the keys.

use crate::request::Prompt;
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Bytes of a conversation's opening message that tell it apart: conversations that open alike
/// for this long (a long document, then different questions) share a home, and its cache.
pub const OPENER_BYTES: usize = 4096;

/// How a prompt is cut into keys (from the config).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Bytes per chunk.
    pub chunk_size: usize,
    /// Chunks hashed at most; longer prompts are keyed by their first part.
    pub max_chunks: usize,
    /// Bytes of the head that make the group key at most.
    pub group_bytes: usize,
}

/// The chained keys of one prompt, namespaced by model, and the key of its group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixKeys {
    /// Hash of the model name (and cache salt): seeds the chain and the group key.
    pub model: u64,
    /// One key per chunk (the last chunk may be partial), at most `max_chunks`.
    pub keys: Vec<u64>,
    /// Hash of the prompt's head, at most `group_bytes` of it: where the request's group lives.
    /// Every gateway computes it from the request alone, so all place a group alike.
    pub group: u64,
    /// Keys that cover only the head: a match deeper than this reaches into the request's
    /// earlier turns, which only the endpoints that served them hold (the chunk that crosses the
    /// head's end holds the start of the first turn, so a second turn finds a first one shorter
    /// than a chunk past it). All the keys when the request has no earlier turns (what follows
    /// its head is new).
    pub head_chunks: usize,
    /// The first key whose chunk reaches past the head: from here on the keys are the request's
    /// own (its question, its conversation), which its later turns look for.
    pub tail_from: usize,
    /// Which of its group's conversations the request belongs to: a hash of the message that
    /// opens it ([`PrefixKeys::opened_by`]), the same in all its turns; until then, of the
    /// request's whole prompt. Splits a group's traffic between its homes.
    pub conversation: u64,
}

impl PrefixKeys {
    /// Splits `text` into chunks (the last may be shorter) and chains their hashes; the group
    /// key hashes the first `head` bytes (capped at `group_bytes`). `history`: earlier turns
    /// follow the head.
    pub fn new(
        model: &str,
        text: &(impl AsRef<[u8]> + ?Sized),
        head: usize,
        history: bool,
        shape: Shape,
    ) -> PrefixKeys {
        Self::salted(None, model, text, head, history, shape)
    }

    /// The keys of a parsed request's prompt: its salt, model, text, head and history.
    pub fn of(prompt: &Prompt, shape: Shape) -> PrefixKeys {
        PrefixKeys::salted(
            prompt.salt.as_deref(),
            &prompt.model,
            &prompt.text,
            prompt.head,
            prompt.history,
            shape,
        )
    }

    /// [`PrefixKeys::new`] for a request with vLLM's `cache_salt`: the salt seeds the chain and
    /// the group, so tenants that send the same document share no key and are no one group
    /// (placing them together would only make one engine cache the document once per tenant).
    pub fn salted(
        salt: Option<&str>,
        model: &str,
        text: &(impl AsRef<[u8]> + ?Sized),
        head: usize,
        history: bool,
        shape: Shape,
    ) -> PrefixKeys {
        let text = text.as_ref();
        let model = seed(model, salt);
        let chunk_size = shape.chunk_size.max(1);
        let head = head.min(text.len());
        let mut keys = Vec::with_capacity(text.len().div_ceil(chunk_size).min(shape.max_chunks));
        let mut previous = model;
        for chunk in text.chunks(chunk_size).take(shape.max_chunks) {
            previous = chain(previous, chunk);
            keys.push(previous);
        }
        let group = group_key(model, &keys, text, head.min(shape.group_bytes), chunk_size);
        let tail_from = (head / chunk_size).min(keys.len());
        let head_chunks = match history {
            true => tail_from,
            false => keys.len(),
        };
        let conversation = keys.last().copied().unwrap_or(group);
        PrefixKeys {
            model,
            keys,
            group,
            head_chunks,
            tail_from,
            conversation,
        }
    }

    /// The conversation is the one `opener` (the first message after the head) starts, told
    /// apart by its first [`OPENER_BYTES`]; nothing after the head leaves it the whole prompt's.
    pub fn opened_by(mut self, opener: &(impl AsRef<[u8]> + ?Sized)) -> PrefixKeys {
        let opener = opener.as_ref();
        if !opener.is_empty() {
            let opener = &opener[..opener.len().min(OPENER_BYTES)];
            self.conversation = xxh3_64_with_seed(opener, self.group);
        }
        self
    }
}

/// What the chain of a prompt to `model` (with vLLM's `cache_salt`, if any) starts from: key -1.
/// Whoever computes keys from the same bytes (the engine index from decoded KV blocks) starts here.
pub fn seed(model: &str, salt: Option<&str>) -> u64 {
    let model = xxh3_64(model.as_bytes());
    salt.map_or(model, |s| xxh3_64_with_seed(s.as_bytes(), model))
}

/// The key after `previous` for the next chunk: the chunk hashed alone, then mixed with the key
/// before it. (Seeding a chunk's hash with the previous key instead costs xxh3 a secret derived
/// from the seed for each chunk longer than 240 bytes: a third of the hashing at 512-byte chunks.)
pub fn chain(previous: u64, chunk: &[u8]) -> u64 {
    xxh3_64_with_seed(&xxh3_64(chunk).to_le_bytes(), previous)
}

/// The group's key: the first `cut` bytes of `text`, hashed once. The chain already stands for
/// every whole chunk of them, so only the bytes after the last whole chunk are hashed, seeded by
/// its key (tagged, so a group key is never a chunk key).
fn group_key(model: u64, keys: &[u64], text: &[u8], cut: usize, chunk_size: usize) -> u64 {
    const GROUP: u64 = 0x6772_6f75_7020_6b65; // "group ke"
    let whole = (cut / chunk_size).min(keys.len());
    let seed = whole.checked_sub(1).map_or(model, |i| keys[i]);
    xxh3_64_with_seed(&text[whole * chunk_size..cut], seed ^ GROUP)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(chunk_size: usize, max_chunks: usize) -> Shape {
        Shape {
            chunk_size,
            max_chunks,
            group_bytes: 4096,
        }
    }

    #[test]
    fn equal_prefixes_give_equal_leading_keys_and_then_diverge() {
        let shared = "s".repeat(100);
        let a = PrefixKeys::new("m", &format!("{shared}aaaa"), 0, true, shape(16, 64));
        let b = PrefixKeys::new("m", &format!("{shared}bbbb"), 0, true, shape(16, 64));
        assert_eq!(a.keys.len(), 7);
        assert_eq!(a.keys[..6], b.keys[..6]);
        assert_ne!(a.keys[6], b.keys[6]);
    }

    #[test]
    fn a_key_depends_on_every_chunk_before_it() {
        let a = PrefixKeys::new("m", "xxxxyyyy", 0, true, shape(4, 8));
        let b = PrefixKeys::new("m", "zzzzyyyy", 0, true, shape(4, 8));
        assert_ne!(
            a.keys[1], b.keys[1],
            "same second chunk, different first chunk"
        );
    }

    #[test]
    fn a_conversation_is_its_opening_message_up_to_a_bound() {
        let keys =
            |text: &str| PrefixKeys::new("m", &format!("head{text}"), 4, true, shape(16, 64));
        let doc = "d".repeat(OPENER_BYTES);
        let (a, b) = (format!("{doc} question a"), format!("{doc} question b"));
        assert_eq!(
            keys(&a).opened_by(&a).conversation,
            keys(&b).opened_by(&b).conversation
        );
        assert_ne!(
            keys("x").opened_by("x").conversation,
            keys("y").opened_by("y").conversation
        );
        let (one, two) = (keys("same text"), keys("same text"));
        assert_eq!(one.conversation, two.conversation);
        assert_eq!(one.opened_by("").conversation, *two.keys.last().unwrap());
    }

    #[test]
    fn the_model_namespaces_keys() {
        let a = PrefixKeys::new("m1", "same text", 9, true, shape(4, 8));
        let b = PrefixKeys::new("m2", "same text", 9, true, shape(4, 8));
        assert!(a.keys.iter().zip(&b.keys).all(|(x, y)| x != y));
        assert_ne!(a.group, b.group);
    }

    #[test]
    fn the_cache_salt_seeds_the_chain() {
        let text = "a shared document ".repeat(20);
        let keys = |salt| PrefixKeys::salted(salt, "m", &text, 40, true, shape(16, 64));
        let (a, a2, b, none) = (
            keys(Some("a")),
            keys(Some("a")),
            keys(Some("b")),
            keys(None),
        );
        assert_eq!(a, a2, "one tenant's requests share their keys");
        assert!(a
            .keys
            .iter()
            .all(|k| !b.keys.contains(k) && !none.keys.contains(k)));
        assert_ne!(a.group, b.group);
        assert_eq!(none, PrefixKeys::new("m", &text, 40, true, shape(16, 64)));
        assert_eq!(a.keys[0], chain(a.model, b"a shared documen"));
    }

    #[test]
    fn keys_stop_at_max_chunks_and_empty_text_has_no_keys() {
        assert_eq!(
            PrefixKeys::new("m", &"x".repeat(1000), 0, true, shape(10, 8))
                .keys
                .len(),
            8
        );
        let empty = PrefixKeys::new("m", "", 4096, true, shape(10, 8));
        assert!(empty.keys.is_empty());
        assert_eq!(
            empty.group,
            PrefixKeys::new("m", "", 0, true, shape(10, 8)).group
        );
    }

    #[test]
    fn the_group_is_the_head_up_to_its_cap_whatever_follows() {
        let house = "house rules. ".repeat(80); // about 1 KB every group shares
        let doc = |d: usize| format!("{house}document {d}: {}", "text ".repeat(600));
        let (a, b) = (doc(1), doc(2));
        let group =
            |text: &str, head: usize| PrefixKeys::new("m", text, head, true, shape(512, 64));
        assert_ne!(
            group(&a, a.len()).group,
            group(&b, b.len()).group,
            "a 1 KB shared preamble does not make one group of different documents"
        );
        let question = |q: &str| format!("{a}{q}");
        assert_eq!(
            group(&question("why?"), a.len()).group,
            group(&question("how?"), a.len()).group,
            "what follows the head does not change the group"
        );
        assert_eq!(
            group(&a, 1000).group,
            group(&b, 1000).group,
            "capped within the shared part, they are one group"
        );
        let aligned = group(&a, 1024);
        assert!(
            !aligned.keys.contains(&aligned.group),
            "a head of whole chunks is keyed apart from its last chunk"
        );
        assert_ne!(aligned.group, group(&a, 1023).group);
    }

    #[test]
    fn keys_are_the_same_on_every_platform() {
        // Pinned values: a wasm32 build must agree with a native one, or two Envoys on different
        // hosts (and this test under wasm) would disagree on placement.
        let k = PrefixKeys::new("m", "hello world", 5, true, shape(4, 8));
        assert_eq!(k.keys.len(), 3);
        assert_eq!(k.model, xxh3_64(b"m"));
        let hell = xxh3_64(b"hell").to_le_bytes();
        assert_eq!(k.keys[0], xxh3_64_with_seed(&hell, k.model));
        assert_eq!(k.model, 0xf090_4807_418c_57fc_u64, "{:#x}", k.model);
        assert_eq!(k.keys[0], 0xe9aa_a40d_e158_13ea_u64, "{:#x}", k.keys[0]);
        assert_eq!(k.group, 0x1a32_f733_ac93_9e65_u64, "{:#x}", k.group);
        assert_eq!(
            k.head_chunks, 1,
            "the head's 5 bytes fill chunk 0 and cross into chunk 1"
        );
        assert_eq!(k.tail_from, 1, "chunk 1 reaches past the head");
        let single = PrefixKeys::new("m", "hello world", 5, false, shape(4, 8));
        assert_eq!(
            single.head_chunks, 3,
            "no earlier turns: no key reaches into history"
        );
    }
}
