//! Trains or fine-tunes a Mamba-2 language model on a text file.
//!
//! ```sh
//! # fine-tune the shipped model
//! cargo run --release --example train -- --data book.txt --weights weights --out runs/ft --steps 200
//! # a new model from a config
//! cargo run --release --example train -- --data corpus.txt --config config.json \
//!     --tokenizer weights/tokenizer.json --out runs/new --steps 2000 --lr 1e-3
//! # continue an interrupted run (same settings; --steps may be raised)
//! cargo run --release --example train -- --resume runs/new
//! # the result loads like any model directory
//! cargo run --release --example generate -- --weights runs/new --prompt "It was"
//! ```
//!
//! Each step draws `--batch-size` × `--grad-accum` windows of `--seq-len` tokens at uniform
//! random places in the training text (SplitMix64 seeded by `--seed`: the same seed gives the
//! same run) and takes one AdamW step (β 0.9/0.95, decoupled weight decay on matrices) on the
//! mean next-token cross-entropy, its gradient clipped to a global norm of `--clip`; the learning
//! rate warms up linearly over `--warmup` steps, then follows a cosine down to `--final-lr-frac`
//! of `--lr`. The last books of the file (or its last fraction) are held out, and their
//! perplexity over non-overlapping windows of `--seq-len` is reported every `--eval-every` steps.
//!
//! `--out` receives a checkpoint every `--save-every` steps and at the end, atomically: a model
//! directory in the HF layout with its `tokenizer.json` (`generate` and `perplexity` load it),
//! `train_log.csv` (step, tokens, lr, train loss, gradient norm, held-out loss and perplexity,
//! tokens/s), `loss.svg`, and the optimizer's moments, step and sampler state that `--resume`
//! continues from bit for bit. Bad input — a missing, empty or too short `--data`, an `--out`
//! that cannot be written, numbers out of range, a checkpoint of another model or run — is an
//! error before the first step; a step whose loss or update is not finite stops the run with an
//! error naming it, and `--out` keeps the last checkpoint.

#[path = "train/adamw.rs"]
mod adamw;
#[path = "train/checkpoint.rs"]
mod checkpoint;
#[path = "train/cli.rs"]
mod cli;
#[path = "train/curve.rs"]
mod curve;
#[path = "train/data.rs"]
mod data;
#[path = "train/run.rs"]
mod run;

use anyhow::Result;
use clap::Parser;

/// Makes glibc keep freed memory for reuse. By default it serves each large allocation from
/// fresh pages and unmaps them on free, so every step's tensors fault their pages in anew and
/// each unmap stalls the other threads; a step allocates the same sizes every time, so the heap
/// they stay in stops growing after the first step.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn reuse_freed_memory() {
    // SAFETY: mallopt only changes allocator parameters; called before any other thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_MAX, 0);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn reuse_freed_memory() {}

fn main() -> Result<()> {
    reuse_freed_memory();
    let outcome = run::train(&cli::Args::parse())?;
    let heldout = outcome.heldout_loss.map_or(String::new(), |h| {
        format!(", held-out loss {h:.4} (perplexity {:.2})", h.exp())
    });
    println!(
        "step {}: train loss {:.4}{heldout}; {:.0} tokens/s; checkpoint in {}",
        outcome.step,
        outcome.train_loss,
        outcome.tokens_per_s,
        outcome.out.display()
    );
    Ok(())
}
