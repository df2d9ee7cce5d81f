//! Perplexity of a Mamba-2 model over a text file.
//!
//! ```sh
//! cargo run --release --example perplexity -- --file heldout.txt [--window 1024] [--weights DIR]
//! ```
//!
//! The file is encoded as one token stream (`tokenizer.encode(text)`, as Python `tokenizers`
//! does by default) and cut into consecutive non-overlapping windows of `--window` tokens; the
//! last, partial window counts when it has at least 2 tokens. Each window runs from an empty state
//! and its tokens 1..len−1 are predicted from the earlier tokens of that window only:
//!
//! ```text
//! ppl = exp(Σ_windows Σ_{t=1}^{len−1} −log p(x_t | x_0..x_{t−1}) / Σ_windows (len − 1))
//! ```
//!
//! the definition `tools/train.py` reports. Full windows run `--batch` at a time.

mod common;

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::Tensor;
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};

#[derive(Parser, Debug)]
#[command(about = "Perplexity of a Mamba-2 model over a text file")]
struct Args {
    /// The text file to score
    #[arg(long)]
    file: PathBuf,
    /// Tokens per window
    #[arg(long, default_value_t = 1024)]
    window: usize,
    /// Windows per forward pass
    #[arg(long, default_value_t = 1)]
    batch: usize,
    #[command(flatten)]
    model: common::ModelArgs,
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.window < 2 || args.batch == 0 {
        bail!("--window must be >= 2 and --batch >= 1")
    }
    let loaded = args.model.load()?;
    let Some(tokenizer) = loaded.tokenizer else {
        bail!(
            "{} has no tokenizer.json: pass --tokenizer FILE",
            loaded.dir.display()
        )
    };
    let model = &loaded.model;
    let text = std::fs::read_to_string(&args.file)
        .with_context(|| format!("reading {}", args.file.display()))?;
    let ids = tokenizer
        .encode(text.as_str(), true)
        .map_err(|e| anyhow::anyhow!("cannot encode {}: {e}", args.file.display()))?
        .get_ids()
        .to_vec();
    let vocab = model.config().vocab_size;
    // The model checks every window too; this check names the token's place in the file.
    if let Some((at, bad)) = ids.iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
        bail!(
            "the tokenizer produced token id {bad} at token {at} of {}, outside the model's \
             vocabulary ({vocab} tokens): the tokenizer does not belong to this model",
            args.file.display()
        )
    }
    let windows: Vec<&[u32]> = ids.chunks(args.window).filter(|w| w.len() >= 2).collect();
    let predicted: usize = windows.iter().map(|w| w.len() - 1).sum();
    if predicted == 0 {
        bail!("{} has fewer than 2 tokens", args.file.display())
    }
    eprintln!(
        "{}: {} tokens, {} windows of up to {} tokens, {predicted} predicted tokens",
        args.file.display(),
        ids.len(),
        windows.len(),
        args.window
    );

    let bar = ProgressBar::new(predicted as u64);
    bar.set_style(ProgressStyle::with_template(
        "{bar:40} {pos}/{len} tokens [{elapsed_precise}<{eta_precise}, {per_sec}] {msg}",
    )?);
    let start = Instant::now();
    let (mut nll, mut done) = (0f64, 0usize);
    let mut rest = windows.as_slice();
    while let Some(first) = rest.first() {
        // Windows of equal length run together (all but the last are full).
        let n = rest
            .iter()
            .take(args.batch)
            .take_while(|w| w.len() == first.len())
            .count();
        let flat: Vec<u32> = rest[..n].concat();
        let batch = Tensor::from_vec(flat, (n, first.len()), model.device())?;
        nll += model.nll_sum(&batch)?;
        done += n * (first.len() - 1);
        bar.set_position(done as u64);
        bar.set_message(format!("ppl {:.4}", (nll / done as f64).exp()));
        rest = &rest[n..];
    }
    bar.finish();
    let secs = start.elapsed().as_secs_f64();
    println!(
        "perplexity {:.4} over {predicted} predicted tokens ({} windows of {} tokens; {:.1} tokens/s)",
        (nll / predicted as f64).exp(),
        windows.len(),
        args.window,
        predicted as f64 / secs
    );
    Ok(())
}
