//! Tokenizers: a `tokenizer.json` (HF `tokenizers`), or one of two built-in stand-ins for model
//! directories that ship none.
//!
//! - [`byte_tokenizer`]: exactly 256 tokens, id = byte value, no merges and no special tokens:
//!   UTF-8 text in, bytes out. It is GPT-2's byte-level scheme (each byte shown as a printable
//!   character) with an empty merge list, so it needs a model with at least 256 vocabulary rows
//!   and only makes sense for a model trained on raw bytes (or for smoke tests).
//! - [`id_tokenizer`]: token `i` is the word `"i"`, words split on whitespace; it turns a prompt
//!   given as ids (`"3 17 5"`) into those ids and prints generated ids as text.

use std::path::Path;

use candle_core::{bail, Result};
use serde_json::{json, Map, Value};
use tokenizers::Tokenizer;

/// The number of tokens of [`byte_tokenizer`].
pub const BYTE_VOCAB: usize = 256;

/// Reads a `tokenizer.json`.
pub fn load_tokenizer(path: impl AsRef<Path>) -> Result<Tokenizer> {
    let path = path.as_ref();
    Tokenizer::from_file(path).map_err(|e| {
        candle_core::Error::msg(format!("cannot load tokenizer {}: {e}", path.display()))
    })
}

/// GPT-2's printable character for byte `b`: printable Latin-1 bytes stand for themselves, the
/// others take the code points from U+0100 on, in byte order.
fn byte_char(b: u8) -> char {
    let printable = |c: u8| matches!(c, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    if printable(b) {
        char::from(b)
    } else {
        let n = (0..b).filter(|&c| !printable(c)).count() as u32;
        char::from_u32(256 + n).unwrap_or(char::REPLACEMENT_CHARACTER)
    }
}

fn build(spec: Value, what: &str) -> Result<Tokenizer> {
    spec.to_string()
        .parse()
        .map_err(|e| candle_core::Error::msg(format!("{what}: {e}")))
}

/// The byte-level stand-in tokenizer (see the module doc).
pub fn byte_tokenizer() -> Result<Tokenizer> {
    let vocab: Map<String, Value> = (0..=255u8)
        .map(|b| (byte_char(b).to_string(), json!(b)))
        .collect();
    let byte_level = json!({
        "type": "ByteLevel",
        "add_prefix_space": false,
        "trim_offsets": false,
        "use_regex": false
    });
    let spec = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": byte_level,
        "post_processor": null,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "vocab": vocab,
            "merges": []
        }
    });
    let tokenizer = build(spec, "byte tokenizer")?;
    if tokenizer.get_vocab_size(true) != BYTE_VOCAB {
        bail!(
            "byte tokenizer: expected {BYTE_VOCAB} tokens, built {}",
            tokenizer.get_vocab_size(true)
        )
    }
    Ok(tokenizer)
}

/// The id stand-in tokenizer of a `vocab_size`-token model (see the module doc).
pub fn id_tokenizer(vocab_size: usize) -> Result<Tokenizer> {
    if vocab_size == 0 {
        bail!("id tokenizer: vocab_size must be >= 1")
    }
    let vocab: Map<String, Value> = (0..vocab_size).map(|i| (i.to_string(), json!(i))).collect();
    let spec = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    });
    build(spec, "id tokenizer")
}
