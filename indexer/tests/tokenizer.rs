//! Loading a tokenizer.json: a byte-level BPE decodes every token to its exact bytes; anything
//! else is refused at start with the reason.

use crate::common;

use kvroute_indexer::token_bytes::TokenBytes;
use std::path::PathBuf;

/// A word-level-ish BPE without a byte-level pre-tokenizer, with `vocab` as its tokens.
fn plain_tokenizer(name: &str, vocab: &[&str]) -> PathBuf {
    let vocab: serde_json::Map<String, serde_json::Value> = std::iter::once("[UNK]")
        .chain(vocab.iter().copied())
        .enumerate()
        .map(|(i, t)| (t.to_owned(), i.into()))
        .collect();
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null,
        "model": {"type": "BPE", "dropout": null, "unk_token": "[UNK]",
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "vocab": vocab, "merges": []}
    });
    let path = std::env::temp_dir().join(format!(
        "kvroute-indexer-test-{}-{name}.json",
        std::process::id()
    ));
    std::fs::write(&path, json.to_string()).unwrap();
    path
}

#[test]
fn a_byte_level_bpe_decodes_its_own_encoding_byte_for_byte() {
    let path = common::tokenizer_file();
    let table = TokenBytes::load(&path).unwrap();
    assert!(table.len() > 1000, "{}", table.len());
    let tokenizer = tokenizers::Tokenizer::from_file(&path).unwrap();
    let text = "<|im_start|>system\nRègles: 漢字 🙂\t  end<|im_end|>\n";
    let ids = tokenizer.encode(text, false).unwrap();
    let mut bytes = Vec::new();
    table.decode(ids.get_ids(), &mut bytes).unwrap();
    assert_eq!(bytes, text.as_bytes());
    // A block can end inside a character: its bytes are still exact.
    let mut first = Vec::new();
    let cut = ids.get_ids().len() / 2;
    table.decode(&ids.get_ids()[..cut], &mut first).unwrap();
    assert!(text.as_bytes().starts_with(&first));
    assert!(table.decode(&[u32::MAX], &mut bytes).is_err());
}

#[test]
fn a_vocabulary_that_is_not_byte_level_is_refused_with_the_reason() {
    let err = TokenBytes::load(&plain_tokenizer("cjk", &["a", "b", "漢"])).unwrap_err();
    assert!(err.contains("not a byte-level BPE"), "{err}");
    assert!(err.contains('漢'), "{err}");
    let err = TokenBytes::load(&plain_tokenizer("ascii", &["a", "b", "c"])).unwrap_err();
    assert!(err.contains("does not give back the text"), "{err}");
    let err = TokenBytes::load(std::path::Path::new("/nonexistent/tokenizer.json")).unwrap_err();
    assert!(err.contains("/nonexistent/tokenizer.json"), "{err}");
}
