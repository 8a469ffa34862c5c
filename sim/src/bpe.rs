//! A real byte-level BPE tokenizer for the simulator, trained from the repository's own text,
//! and the choice between it and the hash tokenizer.
//!
//! `kvroute-sim tokenizer --out FILE` writes a `tokenizer.json` in the Hugging Face format (GPT-2
//! style byte-level pre-tokenizer and decoder, Qwen's ChatML special tokens), trained the same
//! way every time over the same text, so the simulator's prompts go through the same kind of
//! tokenizer, and the same decode path in a KV-event consumer, as a real engine's.

use crate::tokenizer::{self, synthetic_output_from, OUTPUT_WORDS};
use std::path::Path;
use std::sync::Arc;
use tokenizers::models::bpe::{BpeTrainer, BPE};
use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer, TokenizerImpl};

/// Largest vocabulary the trainer may reach (special tokens included; the corpus gives fewer).
pub const VOCAB_SIZE: usize = 4096;

/// Special tokens, in id order after the vocabulary (ChatML's and the vision markers).
pub const SPECIAL_TOKENS: [&str; 5] = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
];

/// The text the tokenizer is trained on: the repository's own documentation and code.
const CORPUS: [&str; 8] = [
    include_str!("../../README.md"),
    include_str!("../README.md"),
    include_str!("../../src/prefix.rs"),
    include_str!("../../src/request.rs"),
    include_str!("chat_template.rs"),
    include_str!("tokenizer.rs"),
    include_str!("prefix_cache.rs"),
    include_str!("kv_events.rs"),
];

/// Trains the tokenizer (deterministic: the same corpus gives the same file).
pub fn train() -> Result<Tokenizer, String> {
    let specials: Vec<AddedToken> = SPECIAL_TOKENS
        .iter()
        .map(|t| AddedToken::from(*t, true))
        .collect();
    let mut trainer = BpeTrainer::builder()
        .vocab_size(VOCAB_SIZE)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(specials.clone())
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    let mut tk: TokenizerImpl<BPE, NormalizerWrapper, ByteLevel, ByteLevel, ByteLevel> =
        TokenizerImpl::new(BPE::default());
    tk.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)))
        .with_post_processor(Some(ByteLevel::new(false, true, true)))
        .with_decoder(Some(ByteLevel::default()));
    let lines = CORPUS.iter().flat_map(|text| text.split_inclusive('\n'));
    tk.train(&mut trainer, lines).map_err(|e| e.to_string())?;
    tk.add_special_tokens(&specials);
    Ok(Tokenizer::from(tk))
}

/// Writes the trained tokenizer to `path`.
pub fn write(path: &Path) -> Result<(), String> {
    let json = train()?.to_string(false).map_err(|e| e.to_string())?;
    std::fs::write(path, json).map_err(|e| format!("{}: {e}", path.display()))
}

/// How the simulator turns text into token ids.
#[derive(Clone)]
pub enum Vocab {
    /// The download-free hash tokenizer (`tokenizer.rs`).
    Hash,
    /// A `tokenizer.json`, with the output words that are one token each in it.
    File {
        tokenizer: Arc<Tokenizer>,
        words: Arc<Vec<(String, u32)>>,
    },
}

impl std::fmt::Debug for Vocab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Vocab::Hash => f.write_str("Vocab::Hash"),
            Vocab::File { words, .. } => write!(f, "Vocab::File({} words)", words.len()),
        }
    }
}

impl Vocab {
    /// Loads `tokenizer.json`; it must spell enough of the simulator's output words as one
    /// token each (with and without a leading space) for outputs of an exact token count.
    pub fn load(path: &Path) -> Result<Vocab, String> {
        let tokenizer =
            Tokenizer::from_file(path).map_err(|e| format!("{}: {e}", path.display()))?;
        Vocab::from_tokenizer(tokenizer).map_err(|e| format!("{}: {e}", path.display()))
    }

    pub fn from_tokenizer(tokenizer: Tokenizer) -> Result<Vocab, String> {
        let one = |text: &str| match tokenizer.encode(text, false) {
            Ok(e) if e.get_ids().len() == 1 => Some(e.get_ids()[0]),
            _ => None,
        };
        let words: Vec<(String, u32)> = OUTPUT_WORDS
            .iter()
            .filter(|w| one(w).is_some())
            .filter_map(|w| one(&format!(" {w}")).map(|id| (w.to_string(), id)))
            .collect();
        if words.len() < 4 {
            return Err("too few of the output words are single tokens in this vocabulary".into());
        }
        Ok(Vocab::File {
            tokenizer: Arc::new(tokenizer),
            words: Arc::new(words),
        })
    }

    pub fn tokenize(&self, text: &str) -> Vec<u32> {
        match self {
            Vocab::Hash => tokenizer::tokenize(text),
            Vocab::File { tokenizer, .. } => tokenizer
                .encode(text, false)
                .map(|e| e.get_ids().to_vec())
                .unwrap_or_default(),
        }
    }

    /// `n` tokens of deterministic output seeded by `seed`: the text pieces and their ids (one
    /// id per piece; their text tokenizes back to the same ids).
    pub fn output(&self, seed: u64, n: usize) -> (Vec<String>, Vec<u32>) {
        match self {
            Vocab::Hash => {
                let pieces = synthetic_output_from(&OUTPUT_WORDS, seed, n);
                let ids = pieces.iter().map(|p| tokenizer::piece_id(p)).collect();
                (pieces, ids)
            }
            Vocab::File { tokenizer, words } => {
                let list: Vec<&str> = words.iter().map(|(w, _)| w.as_str()).collect();
                let pieces = synthetic_output_from(&list, seed, n);
                let ids = pieces
                    .iter()
                    .map(|p| match tokenizer.encode(p.as_str(), false) {
                        Ok(e) => e.get_ids().first().copied().unwrap_or(0),
                        Err(_) => 0,
                    })
                    .collect();
                (pieces, ids)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn training_is_deterministic_and_byte_level() {
        let (a, b) = (train().unwrap(), train().unwrap());
        assert_eq!(a.to_string(false).unwrap(), b.to_string(false).unwrap());
        let vocab = Vocab::from_tokenizer(a).unwrap();
        let text = "<|im_start|>user\nGrüße, 漢字 🙂<|im_end|>\n";
        let ids = vocab.tokenize(text);
        assert!(ids.len() < text.len(), "merges happened");
        let Vocab::File { tokenizer, .. } = &vocab else {
            unreachable!()
        };
        assert_eq!(tokenizer.decode(&ids, false).unwrap(), text);
        let im_start = tokenizer.token_to_id("<|im_start|>").unwrap();
        assert_eq!(ids[0], im_start, "special tokens are single tokens");
    }

    #[test]
    fn output_is_one_token_per_piece_and_retokenizes_alike() {
        let vocab = Vocab::from_tokenizer(train().unwrap()).unwrap();
        let (pieces, ids) = vocab.output(7, 40);
        assert_eq!((pieces.len(), ids.len()), (40, 40));
        assert_eq!(vocab.tokenize(&pieces.concat()), ids);
    }
}
