//! The training text: read, split into a training and a held-out part as `tools/train.py` does,
//! tokenized, checked against the model; and the seeded sampler of training windows.
//!
//! Split: with `--heldout-books N` (the default, N = 3, when the file has more than 3 books) the
//! text is cut at `<|endoftext|>` and the last N parts, joined by the separator, are held out;
//! the training stream is the first parts joined by it (the separator between the two sides is
//! dropped). With `--heldout-fraction F` the last F of the text's bytes are held out, from the
//! start of a line. The training part is encoded without special tokens (book by book, joined by
//! the separator's id, when the tokenizer has it as an added token: the same ids as encoding the
//! whole part, with bounded memory); the held-out part with `tokenizer.encode(text, true)`, as
//! the `perplexity` example encodes its file, so `perplexity --file HELDOUT --window L` on the
//! held-out text gives the number this program reports.

use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use mamba2::model::Tokenizer;

use crate::cli::Heldout;

/// The book separator of the shipped corpus and tokenizer.
pub const EOT: &str = "<|endoftext|>";

/// Books encoded per batch: enough to keep every core busy, few enough to bound the memory of
/// the encodings (each token carries its string and offsets until its ids are copied out).
const BOOKS_PER_BATCH: usize = 16;

/// The token streams of a text file.
pub struct Corpus {
    pub train: Vec<u32>,
    pub heldout: Vec<u32>,
    /// The split that was used (the default resolved).
    pub split: Heldout,
    /// FNV-1a of both streams: a resumed run must see the same tokens.
    pub fingerprint: String,
}

/// Reads `path` as UTF-8 text: an error naming the file if it is missing, empty or not text.
pub fn read_text(path: &Path) -> Result<String> {
    let meta = std::fs::metadata(path)
        .map_err(|e| anyhow!("--data {}: cannot read it: {e}", path.display()))?;
    if meta.is_dir() {
        bail!("--data {} is a directory, not a text file", path.display())
    }
    let bytes =
        std::fs::read(path).with_context(|| format!("reading --data {}", path.display()))?;
    if bytes.is_empty() {
        bail!("--data {} is empty", path.display())
    }
    String::from_utf8(bytes).map_err(|e| {
        anyhow!(
            "--data {} is not UTF-8 text (invalid byte at offset {})",
            path.display(),
            e.utf8_error().valid_up_to()
        )
    })
}

/// Splits and tokenizes `text` (from `path`) and checks that the training part holds a
/// sequence of `seq_len` tokens, the held-out part (unless none) a window of 2, and every id
/// `vocab`'s range.
pub fn tokenize(
    path: &Path,
    text: &str,
    tokenizer: &Tokenizer,
    split: Option<Heldout>,
    seq_len: usize,
    vocab: usize,
) -> Result<Corpus> {
    let books = text.matches(EOT).count() + 1;
    let split = split.unwrap_or(if books > 3 {
        Heldout::Books(3)
    } else {
        Heldout::Fraction(0.05)
    });
    let (train_text, heldout_text) = match split {
        Heldout::Books(n) => {
            if books <= n {
                bail!(
                    "--heldout-books {n}: --data {} has {books} book(s) separated by {EOT}, which \
                     leaves none to train on (use --heldout-fraction)",
                    path.display()
                )
            }
            // The separator before the first held-out book (there are books − 1 of them).
            let Some((cut, _)) = text.match_indices(EOT).nth(books - n - 1) else {
                bail!(
                    "--data {}: cannot find separator {} of {EOT}",
                    path.display(),
                    books - n
                )
            };
            (&text[..cut], &text[cut + EOT.len()..])
        }
        Heldout::Fraction(f) => {
            let mut at = ((text.len() as f64) * (1.0 - f)) as usize;
            while !text.is_char_boundary(at) {
                at += 1;
            }
            // The held-out text starts at a line (in a text of one line, at a character).
            let cut = match text[at..].find('\n') {
                Some(i) if f > 0.0 => at + i + 1,
                _ => at,
            };
            text.split_at(cut)
        }
    };
    let train = encode_train(tokenizer, train_text)?;
    let heldout = if heldout_text.is_empty() {
        Vec::new()
    } else {
        encode(tokenizer, heldout_text, true)?
    };
    for (ids, part) in [(&train, "training"), (&heldout, "held-out")] {
        if let Some((at, id)) = ids.iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
            bail!(
                "the tokenizer gives token id {id} (token {at} of the {part} part of {}), outside \
                 the model's vocabulary of {vocab}: the tokenizer does not belong to this model",
                path.display()
            )
        }
    }
    if train.len() < seq_len {
        bail!(
            "--data {}: its training part is {} tokens, shorter than one training sequence \
             (--seq-len {seq_len}; {} held out by {split})",
            path.display(),
            train.len(),
            heldout.len()
        )
    }
    let held_out_text = !matches!(split, Heldout::Fraction(f) if f == 0.0);
    if held_out_text && heldout.len() < 2 {
        bail!(
            "--data {}: its held-out part ({split}) is {} token(s), fewer than the 2 a perplexity \
             needs (hold out more, or pass --heldout-fraction 0 to train without one)",
            path.display(),
            heldout.len()
        )
    }
    let fingerprint = fingerprint(&train, &heldout);
    Ok(Corpus {
        train,
        heldout,
        split,
        fingerprint,
    })
}

fn encode(tokenizer: &Tokenizer, text: &str, special: bool) -> Result<Vec<u32>> {
    Ok(tokenizer
        .encode(text, special)
        .map_err(|e| anyhow!("cannot tokenize --data: {e}"))?
        .get_ids()
        .to_vec())
}

/// The training part's ids, without special tokens.
fn encode_train(tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    // Only an added token is cut out before pre-tokenization, which makes book-by-book encoding
    // give the ids of the whole text.
    let eot = tokenizer
        .get_added_tokens_decoder()
        .into_iter()
        .find(|(_, t)| t.content == EOT)
        .map(|(id, _)| id);
    let Some(eot) = eot.filter(|_| text.contains(EOT)) else {
        return encode(tokenizer, text, false);
    };
    let books: Vec<&str> = text.split(EOT).collect();
    let mut ids = Vec::new();
    for (i, batch) in books.chunks(BOOKS_PER_BATCH).enumerate() {
        let encodings = tokenizer
            .encode_batch(batch.to_vec(), false)
            .map_err(|e| anyhow!("cannot tokenize --data: {e}"))?;
        for (j, e) in encodings.iter().enumerate() {
            if i + j > 0 {
                ids.push(eot);
            }
            ids.extend_from_slice(e.get_ids());
        }
    }
    Ok(ids)
}

/// FNV-1a (64-bit) over the lengths and ids of both streams, in hex.
fn fingerprint(train: &[u32], heldout: &[u32]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let lens = [train.len() as u64, heldout.len() as u64];
    let words = lens
        .iter()
        .copied()
        .chain(train.iter().chain(heldout).map(|&t| u64::from(t)));
    for w in words {
        for b in w.to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    format!("{h:016x}")
}

/// Draws training windows from a token stream: SplitMix64, whose whole state is one `u64`
/// (saved in a checkpoint, so a resumed run draws the batches the uninterrupted run would).
pub struct Sampler {
    state: u64,
}

impl Sampler {
    pub fn new(state: u64) -> Self {
        Self { state }
    }

    pub fn state(&self) -> u64 {
        self.state
    }

    fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A uniform draw from `0..n` (n ≥ 1), without bias (Lemire's multiply-and-reject).
    fn below(&mut self, n: u64) -> u64 {
        let threshold = n.wrapping_neg() % n;
        loop {
            let m = u128::from(self.next_u64()) * u128::from(n);
            if (m as u64) >= threshold {
                return (m >> 64) as u64;
            }
        }
    }

    /// `batch` windows of `len` tokens at uniform starts in `tokens` (at least `len` long),
    /// row after row.
    pub fn batch(&mut self, tokens: &[u32], batch: usize, len: usize) -> Vec<u32> {
        let starts = (tokens.len() - len + 1) as u64;
        let mut ids = Vec::with_capacity(batch * len);
        for _ in 0..batch {
            let s = self.below(starts) as usize;
            ids.extend_from_slice(&tokens[s..s + len]);
        }
        ids
    }
}

/// Rank `rank`'s part of a global micro-batch `ids` of `rows` rows of `len` tokens, row after
/// row: its `rows / world` contiguous rows, rank 0 the first. The ranks' parts, in rank order,
/// are the whole batch, so N ranks train on the sequences one rank would; `rows` must be a
/// multiple of `world`.
pub fn shard(ids: &[u32], rows: usize, len: usize, rank: usize, world: usize) -> Result<&[u32]> {
    if world == 0 || rank >= world || rows % world != 0 || ids.len() != rows * len {
        bail!(
            "cannot split {} ids of {rows} rows × {len} into {world} equal parts for rank {rank}",
            ids.len()
        )
    }
    let per = rows / world * len;
    Ok(&ids[rank * per..(rank + 1) * per])
}
