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
//! rate warms up linearly over `--warmup` steps, then follows `--schedule`: a cosine down to
//! `--final-lr-frac` of `--lr` (the default), or WSD as `tools/train.py` (constant, then a linear
//! decay to that floor over the last `--cooldown-frac` of the steps). The last books of the file
//! (or its last fraction) are held out, and their perplexity over non-overlapping windows of
//! `--seq-len` is reported every `--eval-every` steps.
//!
//! `--minutes M` gives the invocation a wall-clock budget, as `tools/train.py`'s: training stops
//! after the step that crosses M minutes less `--reserve-s` seconds from the start, which are
//! kept for the final evaluation and checkpoint, and the schedule runs over a step count planned
//! from the measured step time (`train/schedule.rs`). The shipped model, retrained on one GPU in
//! at most 6 minutes:
//!
//! ```sh
//! cargo run --release --features cuda --example train -- --device cuda --dtype bf16 \
//!     --data gutenberg-114.txt --config weights/config.json --tokenizer weights/tokenizer.json \
//!     --out runs/shipped --batch-size 64 --seq-len 1025 --lr 3e-3 --final-lr-frac 0.02 \
//!     --warmup 150 --schedule wsd --minutes 6 --eval-every 200 --save-every 0
//! ```
//!
//! `--gpus N` (a build with `--features cuda,nccl`) trains data-parallel on N GPUs, one rank per
//! GPU, each on its rows of every batch, the gradients averaged through NCCL
//! (`train/parallel.rs`); the same seed and batch give one GPU's loss curve up to rounding, and
//! a checkpoint continues with any number of GPUs:
//!
//! ```sh
//! cargo run --release --features cuda,nccl --example train -- --device cuda --gpus 2 \
//!     --dtype bf16 --data corpus.txt --config config.json --out runs/dp --batch-size 64
//! ```
//!
//! On CUDA the optimizer is fused kernels over all weights and a step waits for the device once,
//! to read its losses and gradient norm; the program ends with the peak GPU memory.
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
#[path = "train/parallel.rs"]
mod parallel;
#[path = "train/run.rs"]
mod run;
#[path = "train/schedule.rs"]
mod schedule;

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
    if let Some((used, held)) = outcome.peak_gpu_bytes {
        let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
        println!(
            "peak GPU memory: {:.2} GiB in use, {:.2} GiB held by the memory pool",
            gib(used),
            gib(held)
        );
    }
    Ok(())
}
