//! A deterministic, download-free tokenizer: text pieces hashed to Qwen-sized token ids.
//!
//! It is not a real BPE. What matters to a prefix cache is that it is deterministic and
//! *prefix-stable*: tokenising `a + b` gives `tokenize(a) + tokenize(b)` whenever `a` ends at
//! a piece boundary (a newline, punctuation, or a special token), which is where chat
//! templates join messages. Pieces are roughly GPT-like: a word with its leading space,
//! capped at [`MAX_WORD_CHARS`] characters, one token per punctuation mark or newline, and
//! `<|...|>` special tokens. English text comes out at about 4-5 bytes per token.

use xxhash_rust::xxh3::xxh3_64;

/// Qwen2/3 vocabulary size; ordinary pieces hash below the special-token range.
pub const VOCAB_SIZE: u32 = 151_643;
pub const ENDOFTEXT: u32 = 151_643;
pub const IM_START: u32 = 151_644;
pub const IM_END: u32 = 151_645;

/// Longer alphanumeric runs are split into pieces of at most this many characters.
pub const MAX_WORD_CHARS: usize = 6;

/// The token id of one piece of text.
pub fn piece_id(piece: &str) -> u32 {
    match piece {
        "<|endoftext|>" => ENDOFTEXT,
        "<|im_start|>" => IM_START,
        "<|im_end|>" => IM_END,
        _ => (xxh3_64(piece.as_bytes()) % VOCAB_SIZE as u64) as u32,
    }
}

/// Splits text into pieces; `tokenize` maps each to an id.
pub fn pieces(text: &str) -> Vec<&str> {
    let mut out = Vec::with_capacity(text.len() / 4 + 1);
    let mut i = 0;
    while i < text.len() {
        let end = next_piece_end(text, i);
        out.push(&text[i..end]);
        i = end;
    }
    out
}

pub fn tokenize(text: &str) -> Vec<u32> {
    pieces(text).into_iter().map(piece_id).collect()
}

/// Byte offset where the piece starting at `start` ends.
fn next_piece_end(text: &str, start: usize) -> usize {
    let rest = &text[start..];
    if let Some(len) = special_token_len(rest) {
        return start + len;
    }
    let mut chars = rest.char_indices().peekable();
    let Some((_, first)) = chars.next() else {
        return text.len();
    };
    // A single space glues to the word that follows it, as in GPT-style tokenizers.
    let word_start = if first == ' ' {
        match chars.peek() {
            Some(&(_, c)) if c.is_alphanumeric() => {
                chars.next();
                true
            }
            _ => false,
        }
    } else {
        first.is_alphanumeric()
    };
    if word_start {
        let mut end = rest.len();
        for (taken, (idx, c)) in (1..).zip(chars) {
            if !c.is_alphanumeric() || taken == MAX_WORD_CHARS {
                end = idx;
                break;
            }
        }
        return start + end;
    }
    if first == ' ' || first == '\t' {
        // A run of blanks (indentation) is one piece, capped like words.
        let mut end = first.len_utf8();
        for (n, (idx, c)) in rest.char_indices().enumerate().skip(1) {
            if c != first || n == MAX_WORD_CHARS {
                end = idx;
                break;
            }
            end = idx + c.len_utf8();
        }
        return start + end;
    }
    start + first.len_utf8()
}

/// `<|name|>` with a short lowercase name is one special token.
fn special_token_len(s: &str) -> Option<usize> {
    let body = s.strip_prefix("<|")?;
    let close = body.find("|>")?;
    let name = &body[..close];
    let plausible = !name.is_empty()
        && name.len() <= 32
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b == b'_' || b.is_ascii_digit());
    plausible.then_some(close + 4)
}

/// A short word list for synthetic model output; each word is exactly one piece.
pub const OUTPUT_WORDS: [&str; 32] = [
    "the", "model", "cache", "token", "block", "router", "prefix", "reply", "data", "fleet",
    "fast", "value", "query", "state", "score", "queue", "load", "node", "time", "prompt",
    "result", "answer", "is", "a", "of", "and", "to", "in", "we", "it", "on", "for",
];

/// Deterministic "generated" text of exactly `n` tokens, seeded (like greedy decoding) by
/// the prompt. Returns the pieces; their ids are `piece_id(piece)` and their concatenation
/// tokenises back to the same ids, so a follow-up turn that quotes the answer hits the cache.
pub fn synthetic_output(seed: u64, n: usize) -> Vec<String> {
    synthetic_output_from(&OUTPUT_WORDS, seed, n)
}

/// [`synthetic_output`] drawing from `words`.
pub fn synthetic_output_from(words: &[&str], seed: u64, n: usize) -> Vec<String> {
    (0..n)
        .map(|i| {
            let h = xxh3_64(&[seed.to_le_bytes(), (i as u64).to_le_bytes()].concat());
            let word = words[(h % words.len() as u64) as usize];
            if i == 0 {
                word.to_string()
            } else {
                format!(" {word}")
            }
        })
        .collect()
}

/// A seed for `synthetic_output` derived from the prompt tokens.
pub fn seed_of(tokens: &[u32]) -> u64 {
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    xxh3_64(&bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenize_is_deterministic_and_splits_words_with_leading_space() {
        assert_eq!(pieces("Hello, world!"), vec!["Hello", ",", " world", "!"]);
        assert_eq!(tokenize("Hello, world!"), tokenize("Hello, world!"));
        assert_ne!(piece_id("Hello"), piece_id(" Hello"));
    }

    #[test]
    fn long_words_are_split_into_capped_pieces() {
        assert_eq!(pieces("abcdefghij"), vec!["abcdef", "ghij"]);
        assert_eq!(pieces(" abcdefghij"), vec![" abcdef", "ghij"]);
    }

    #[test]
    fn special_tokens_map_to_qwen_ids() {
        assert_eq!(
            tokenize("<|im_start|>user\nhi<|im_end|>"),
            vec![
                IM_START,
                piece_id("user"),
                piece_id("\n"),
                piece_id("hi"),
                IM_END
            ]
        );
        // Not a special token: uppercase or unterminated.
        assert_eq!(pieces("<|X|>").len(), 5);
        assert_eq!(pieces("<|im_start")[0], "<");
    }

    #[test]
    fn concatenation_at_piece_boundaries_keeps_token_prefixes() {
        let a = "<|im_start|>system\nYou are helpful.<|im_end|>\n";
        let b = "<|im_start|>user\nWhat is a KV cache?<|im_end|>\n";
        let mut ab = tokenize(a);
        ab.extend(tokenize(b));
        assert_eq!(tokenize(&format!("{a}{b}")), ab);
    }

    #[test]
    fn synthetic_output_retokenizes_to_one_token_per_piece() {
        let out = synthetic_output(42, 50);
        let text: String = out.concat();
        let ids: Vec<u32> = out.iter().map(|p| piece_id(p)).collect();
        assert_eq!(tokenize(&text), ids);
        assert_eq!(synthetic_output(42, 50), out);
        assert_ne!(synthetic_output(43, 50), out);
    }

    #[test]
    fn english_text_is_roughly_four_to_five_bytes_per_token() {
        let text = "The quick brown fox jumps over the lazy dog, and then it runs \
                    away into the forest where nobody can find it again. ";
        let ratio = text.len() as f64 / tokenize(text).len() as f64;
        assert!((3.0..6.0).contains(&ratio), "ratio {ratio}");
    }
}
