//! Incremental detokenisation for streaming that never cuts a character in two.
//!
//! A byte-level tokenizer can end a token in the middle of a multi-byte UTF-8 character, and
//! decoding such a prefix yields U+FFFD. After each token the stream decodes a window of tokens
//! `[prefix, read)` and `[prefix, end)` (the window starts one emitted piece back, so decoders that
//! treat the first token specially, such as SentencePiece's leading space, see context) and emits
//! the new text only once it does not end in U+FFFD; until then the token is held back. A stream
//! can start after context tokens (the prompt): they are decoded with the first new tokens, for
//! that context, but never emitted.

use candle_core::Result;
use tokenizers::Tokenizer;

/// Context tokens decoded in front of the first new token.
const CONTEXT_TOKENS: usize = 5;

/// The text of a growing token sequence, handed out piece by piece.
pub struct TextStream<'a> {
    tokenizer: &'a Tokenizer,
    tokens: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
}

impl<'a> TextStream<'a> {
    pub fn new(tokenizer: &'a Tokenizer) -> Self {
        Self::with_context(tokenizer, &[])
    }

    /// A stream whose text continues after `context` (e.g. the prompt), which is not emitted.
    pub fn with_context(tokenizer: &'a Tokenizer, context: &[u32]) -> Self {
        Self {
            tokenizer,
            tokens: context.to_vec(),
            prefix_offset: context.len().saturating_sub(CONTEXT_TOKENS),
            read_offset: context.len(),
        }
    }

    fn decode(&self, tokens: &[u32]) -> Result<String> {
        self.tokenizer
            .decode(tokens, true)
            .map_err(|e| candle_core::Error::msg(format!("cannot decode tokens {tokens:?}: {e}")))
    }

    /// The length of the window's text that is already out: the decoded `[prefix, read)` tokens,
    /// less a trailing U+FFFD (a context that ends inside a character: the character comes out
    /// whole with the tokens that complete it).
    fn emitted_len(&self) -> Result<usize> {
        let prefix = self.decode(&self.tokens[self.prefix_offset..self.read_offset])?;
        Ok(prefix.trim_end_matches('\u{FFFD}').len())
    }

    /// Appends `token` and returns the text that became complete (often empty).
    pub fn push(&mut self, token: u32) -> Result<String> {
        self.tokens.push(token);
        let full = self.decode(&self.tokens[self.prefix_offset..])?;
        match full.get(self.emitted_len()?..) {
            Some(new) if !new.is_empty() && !full.ends_with('\u{FFFD}') => {
                let new = new.to_string();
                self.prefix_offset = self.read_offset;
                self.read_offset = self.tokens.len();
                Ok(new)
            }
            _ => Ok(String::new()),
        }
    }

    /// The text held back so far (an incomplete character decodes as U+FFFD); the stream is then
    /// drained.
    pub fn flush(&mut self) -> Result<String> {
        let full = self.decode(&self.tokens[self.prefix_offset..])?;
        let new = full
            .get(self.emitted_len()?..)
            .unwrap_or_default()
            .to_string();
        self.prefix_offset = self.tokens.len();
        self.read_offset = self.tokens.len();
        Ok(new)
    }

    /// The context and every token pushed so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
}
