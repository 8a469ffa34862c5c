//! Token ids to the exact bytes they stand for, from a byte-level BPE `tokenizer.json`.
//!
//! A byte-level vocabulary spells each byte as one printable character (GPT-2's byte↔unicode
//! map: printable Latin-1 bytes as themselves, the other 68 bytes as U+0100 onwards), so a
//! token's bytes are its vocabulary string mapped back byte by byte. Added tokens (`<|im_start|>`
//! and the like) stand for their content. Decoding to bytes rather than text keeps a block that
//! ends inside a multi-byte character exact.

use std::path::Path;
use tokenizers::Tokenizer;

/// Text the start-up check encodes and decodes back: ASCII, accents, CJK, an emoji, newlines
/// and runs of spaces.
const SELF_CHECK: &str = "Hello, world! Grüße aus Köln — naïve café.\n\n    indented code();\n\
    漢字とかな、한국어 텍스트, emoji 🙂👍🏽 and tabs\tend.";

/// Every token id's bytes, in one flat buffer.
#[derive(Debug, Clone)]
pub struct TokenBytes {
    /// `bytes[offsets[id]..offsets[id + 1]]` is token `id`.
    offsets: Vec<u32>,
    bytes: Vec<u8>,
}

/// GPT-2's map from a vocabulary character back to its byte (`None`: not byte-level).
fn unicode_to_byte(c: char) -> Option<u8> {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
    let c = c as u32;
    if c < 256 && printable(c) {
        return Some(c as u8);
    }
    // The other bytes, in order, are U+0100, U+0101, ...
    let n = c.checked_sub(256)?;
    (0u32..256)
        .filter(|b| !printable(*b))
        .nth(n as usize)
        .map(|b| b as u8)
}

impl TokenBytes {
    /// Loads `path` and checks it round-trips text through bytes; a tokenizer that is not
    /// byte-level is refused, with the reason.
    pub fn load(path: &Path) -> Result<TokenBytes, String> {
        let tokenizer =
            Tokenizer::from_file(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let table = TokenBytes::from_tokenizer(&tokenizer)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        table
            .self_check(&tokenizer)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(table)
    }

    /// The table of a loaded tokenizer (no round-trip check).
    pub fn from_tokenizer(tokenizer: &Tokenizer) -> Result<TokenBytes, String> {
        let added = tokenizer.get_added_tokens_decoder();
        let size = tokenizer.get_vocab_size(true) as u32;
        let top = added
            .keys()
            .copied()
            .max()
            .map_or(size, |m| size.max(m + 1));
        let mut offsets = Vec::with_capacity(top as usize + 1);
        let mut bytes = Vec::new();
        offsets.push(0);
        for id in 0..top {
            if let Some(token) = added.get(&id) {
                bytes.extend_from_slice(token.content.as_bytes());
            } else if let Some(token) = tokenizer.id_to_token(id) {
                for c in token.chars() {
                    let Some(b) = unicode_to_byte(c) else {
                        return Err(format!(
                            "not a byte-level BPE: token {id} {token:?} has the character \
                             {c:?}, which stands for no byte"
                        ));
                    };
                    bytes.push(b);
                }
            }
            offsets.push(bytes.len() as u32);
        }
        Ok(TokenBytes { offsets, bytes })
    }

    /// A table of the given token spellings (token `i` is `pieces[i]`).
    pub fn from_pieces<P: AsRef<[u8]>>(pieces: &[P]) -> TokenBytes {
        let mut offsets = vec![0];
        let mut bytes = Vec::new();
        for p in pieces {
            bytes.extend_from_slice(p.as_ref());
            offsets.push(bytes.len() as u32);
        }
        TokenBytes { offsets, bytes }
    }

    /// Encodes sample text with multi-byte characters and decodes the ids back to bytes.
    pub fn self_check(&self, tokenizer: &Tokenizer) -> Result<(), String> {
        let encoding = tokenizer
            .encode(SELF_CHECK, false)
            .map_err(|e| format!("cannot encode the self-check text: {e}"))?;
        let mut out = Vec::new();
        self.decode(encoding.get_ids(), &mut out)?;
        if out != SELF_CHECK.as_bytes() {
            return Err(format!(
                "decoding tokens to bytes does not give back the text (got {:?}): \
                 not a byte-level BPE, or it normalizes text",
                String::from_utf8_lossy(&out)
            ));
        }
        Ok(())
    }

    /// Appends the bytes of `ids` to `out`; an id outside the vocabulary is an error.
    #[inline]
    pub fn decode(&self, ids: &[u32], out: &mut Vec<u8>) -> Result<(), String> {
        for &id in ids {
            let i = id as usize;
            match (self.offsets.get(i), self.offsets.get(i + 1)) {
                (Some(&a), Some(&b)) => out.extend_from_slice(&self.bytes[a as usize..b as usize]),
                _ => return Err(format!("token id {id} is outside the vocabulary")),
            }
        }
        Ok(())
    }

    /// Token ids in the table.
    pub fn len(&self) -> usize {
        self.offsets.len() - 1
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Heap bytes the table takes.
    pub fn memory(&self) -> usize {
        self.offsets.capacity() * 4 + self.bytes.capacity()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_byte_map_is_gpt2s() {
        assert_eq!(unicode_to_byte('A'), Some(b'A'));
        assert_eq!(unicode_to_byte('Ġ'), Some(b' '));
        assert_eq!(unicode_to_byte('Ċ'), Some(b'\n'));
        assert_eq!(unicode_to_byte('\u{100}'), Some(0));
        assert_eq!(unicode_to_byte('ÿ'), Some(0xff));
        assert_eq!(unicode_to_byte('▁'), None);
        let all: std::collections::BTreeSet<u8> = (0..=0x200u32)
            .filter_map(char::from_u32)
            .filter_map(unicode_to_byte)
            .collect();
        assert_eq!(all.len(), 256, "every byte has exactly one character");
    }
}
