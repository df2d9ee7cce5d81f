//! The flags of `cargo run --release --example train -- …` and the training settings they give:
//! defaults for a new run, the saved settings for a resumed one, every number checked before
//! anything is read or written.

use std::fmt;
use std::path::PathBuf;

use anyhow::{bail, Result};
use candle_core::{DType, Device};
use clap::Parser;
use serde::{Deserialize, Serialize};

#[derive(Parser, Debug, Clone)]
#[command(about = "Train or fine-tune a Mamba-2 language model on a text file")]
pub struct Args {
    /// The training text (UTF-8). Books separated by <|endoftext|> hold out the last books
    /// [default on --resume: the checkpoint's file]
    #[arg(long, required_unless_present = "resume")]
    pub data: Option<PathBuf>,
    /// Fine-tune this model directory (config.json + weights; its tokenizer.json is used)
    #[arg(long, conflicts_with_all = ["config", "resume"], required_unless_present_any = ["config", "resume"])]
    pub weights: Option<PathBuf>,
    /// Train a new model of this config.json (seeded initialisation); with --resume, a check that
    /// the checkpoint is this model
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// The tokenizer.json [default: the model directory's; with --config, the byte-level stand-in]
    #[arg(long, conflicts_with = "resume")]
    pub tokenizer: Option<PathBuf>,
    /// The checkpoint directory, rewritten atomically at every save [default on --resume: the
    /// resumed directory]
    #[arg(long, required_unless_present = "resume")]
    pub out: Option<PathBuf>,
    /// Replace the checkpoint of an earlier run in --out (at the first save, not before)
    #[arg(long)]
    pub overwrite: bool,
    /// Continue the run whose checkpoint is in this directory (weights, optimizer, step, RNG, log)
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Optimizer steps of the whole run (a resumed run may change it: the schedule follows);
    /// with --minutes, the most steps the plan may take [default: 1000; with --minutes, no cap]
    #[arg(long, allow_negative_numbers = true)]
    pub steps: Option<usize>,
    /// Wall-clock budget of this invocation in minutes, from its start to the last file written:
    /// training stops after the step that crosses minutes·60 − --reserve-s seconds, then the
    /// final evaluation and checkpoint run; the schedule follows the step count planned from the
    /// measured step time
    #[arg(long, allow_negative_numbers = true)]
    pub minutes: Option<f64>,
    /// Seconds of the --minutes budget kept for the final evaluation and checkpoint
    #[arg(
        long,
        allow_negative_numbers = true,
        default_value_t = 30.0,
        requires = "minutes"
    )]
    pub reserve_s: f64,
    /// Sequences per forward pass [default: 8]
    #[arg(long, allow_negative_numbers = true)]
    pub batch_size: Option<usize>,
    /// Tokens per training sequence and per held-out window [default: 256]
    #[arg(long, allow_negative_numbers = true)]
    pub seq_len: Option<usize>,
    /// Forward passes per optimizer step (a step sees batch-size × grad-accum sequences)
    /// [default: 1]
    #[arg(long, allow_negative_numbers = true)]
    pub grad_accum: Option<usize>,
    /// Peak learning rate [default: 1e-3 with --config, 1e-4 fine-tuning --weights]
    #[arg(long, allow_negative_numbers = true)]
    pub lr: Option<f64>,
    /// Steps of linear warm-up (with --minutes, at most a tenth of the planned steps)
    /// [default: min(100, steps / 10)]
    #[arg(long, allow_negative_numbers = true)]
    pub warmup: Option<usize>,
    /// After the warm-up: cosine (decay over the rest of the run) or wsd (constant, then a linear
    /// decay over the last --cooldown-frac of the steps, as tools/train.py) [default: cosine]
    #[arg(long)]
    pub schedule: Option<Schedule>,
    /// With --schedule wsd: the last fraction of the steps over which the rate decays
    /// [default: 0.3]
    #[arg(long, allow_negative_numbers = true)]
    pub cooldown_frac: Option<f64>,
    /// The decay ends at this fraction of --lr at the last step [default: 0.1]
    #[arg(long, allow_negative_numbers = true)]
    pub final_lr_frac: Option<f64>,
    /// Clip the gradients' global norm to this; 0 turns clipping off [default: 1.0]
    #[arg(long, allow_negative_numbers = true)]
    pub clip: Option<f64>,
    /// AdamW's decoupled weight decay, on matrices only [default: 0.1]
    #[arg(long, allow_negative_numbers = true)]
    pub weight_decay: Option<f64>,
    /// Seeds the initial weights (--config) and the batches [default: 0]
    #[arg(long)]
    pub seed: Option<u64>,
    /// Held-out perplexity every N steps (and at the start and end); 0: start and end only
    /// [default: 100]
    #[arg(long, allow_negative_numbers = true)]
    pub eval_every: Option<usize>,
    /// Checkpoint every N steps (and at the end); 0: at the end only [default: 500]
    #[arg(long, allow_negative_numbers = true)]
    pub save_every: Option<usize>,
    /// Hold out the last fraction of the text (0: none, no evaluation) [default: the last 3
    /// books when the file has more than 3, else 0.05]
    #[arg(long, allow_negative_numbers = true, conflicts_with = "heldout_books")]
    pub heldout_fraction: Option<f64>,
    /// Hold out the last N books (parts separated by <|endoftext|>)
    #[arg(long, allow_negative_numbers = true)]
    pub heldout_books: Option<usize>,
    /// Compute dtype, f32 or bf16 (the master weights and the optimizer stay f32) [default: f32]
    #[arg(long)]
    pub dtype: Option<String>,
    /// cpu, cuda or cuda:N
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Stop after this step with a checkpoint, as an interrupted run would (resume later)
    #[arg(long, allow_negative_numbers = true)]
    pub stop_after: Option<usize>,
    /// Data-parallel over this many GPUs, one rank (a thread) per GPU: CUDA devices K..K+N−1
    /// of --device cuda:K (cuda: 0..N−1); each GPU takes --batch-size / N rows of every
    /// micro-batch, and the gradients are averaged through NCCL (needs --features cuda,nccl)
    #[arg(long, default_value_t = 1)]
    pub gpus: usize,
    /// How the ranks' gradients are averaged: nccl, or none (one GPU, no communicator)
    /// [default: none with --gpus 1, nccl with more]; --gpus 1 --all-reduce nccl runs the
    /// NCCL path on one GPU
    #[arg(long)]
    pub all_reduce: Option<AllReduce>,
    /// MiB of f32 gradients per all-reduce (consecutive weights flattened into one buffer)
    #[arg(long, default_value_t = crate::parallel::BUCKET_MIB, value_parser = clap::value_parser!(u64).range(1..=1 << 14))]
    pub bucket_mib: u64,
    /// Split the saved weights into safetensors shards of at most this many MiB of tensor data
    /// each (a larger tensor alone in its shard), with `model.safetensors.index.json`, for
    /// repositories that cap file sizes
    #[arg(long, default_value_t = 2048, value_parser = clap::value_parser!(u64).range(1..=1 << 20))]
    pub max_shard_mib: u64,
}

/// The learning rate after the warm-up.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Schedule {
    /// A cosine from --lr down to --final-lr-frac · --lr at the last step.
    #[default]
    Cosine,
    /// Warm-up, stable, decay: --lr until the last --cooldown-frac of the steps, then a straight
    /// line down to --final-lr-frac · --lr at the last step.
    Wsd,
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(match self {
            Schedule::Cosine => "cosine",
            Schedule::Wsd => "wsd",
        })
    }
}

/// How the gradients of the ranks are combined.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum AllReduce {
    /// One rank, no communicator: the gradients are used as they are.
    None,
    /// NCCL's all-reduce, in buckets, averaged over the ranks.
    Nccl,
}

/// The decay fraction of a WSD schedule unless given (`tools/train.py`'s).
pub const COOLDOWN_FRAC: f64 = 0.3;

fn default_cooldown_frac() -> f64 {
    COOLDOWN_FRAC
}

/// Which part of the text is held out for the perplexity.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Heldout {
    /// The last N parts of the text split at `<|endoftext|>`.
    Books(usize),
    /// The last fraction of the text's bytes, from the start of a line (0: nothing).
    Fraction(f64),
}

impl fmt::Display for Heldout {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match self {
            Heldout::Books(n) => write!(f, "--heldout-books {n}"),
            Heldout::Fraction(x) => write!(f, "--heldout-fraction {x}"),
        }
    }
}

/// What a run computes; saved in the checkpoint so that a resumed run continues the same run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Settings {
    pub steps: usize,
    pub batch_size: usize,
    pub seq_len: usize,
    pub grad_accum: usize,
    pub lr: f64,
    pub warmup: usize,
    /// Checkpoints written before schedules could be chosen are cosine runs.
    #[serde(default)]
    pub schedule: Schedule,
    #[serde(default = "default_cooldown_frac")]
    pub cooldown_frac: f64,
    pub final_lr_frac: f64,
    pub clip: f64,
    pub weight_decay: f64,
    pub seed: u64,
    /// `None` until the text is read (the default depends on it).
    pub heldout: Option<Heldout>,
    pub dtype: String,
    pub eval_every: usize,
    pub save_every: usize,
}

impl Settings {
    /// Tokens of one optimizer step.
    pub fn tokens_per_step(&self) -> usize {
        self.batch_size * self.grad_accum * self.seq_len
    }

    pub fn dtype(&self) -> Result<DType> {
        Ok(match self.dtype.as_str() {
            "f32" => DType::F32,
            "bf16" => DType::BF16,
            s => bail!("--dtype must be f32 or bf16, got {s:?}"),
        })
    }
}

/// A flag of a resumed run: the saved value, or the given one when it is the same.
fn keep<T: PartialEq + fmt::Debug>(flag: &str, given: Option<T>, saved: T) -> Result<T> {
    match given {
        Some(v) if v != saved => bail!(
            "{flag} {v:?} differs from the checkpoint's {saved:?}: a resumed run keeps the settings \
             it started with (only --steps, --eval-every and --save-every may change)"
        ),
        _ => Ok(saved),
    }
}

/// The settings of this run: `saved` (a resumed run's) with the flags that may change, or the
/// flags over the defaults; checked.
pub fn settings(args: &Args, saved: Option<&Settings>) -> Result<Settings> {
    let heldout = match (args.heldout_books, args.heldout_fraction) {
        (Some(n), _) => Some(Heldout::Books(n)),
        (None, Some(f)) => Some(Heldout::Fraction(f)),
        (None, None) => None,
    };
    let s = match saved {
        Some(old) => Settings {
            steps: args.steps.unwrap_or(old.steps),
            batch_size: keep("--batch-size", args.batch_size, old.batch_size)?,
            seq_len: keep("--seq-len", args.seq_len, old.seq_len)?,
            grad_accum: keep("--grad-accum", args.grad_accum, old.grad_accum)?,
            lr: keep("--lr", args.lr, old.lr)?,
            warmup: keep("--warmup", args.warmup, old.warmup)?,
            schedule: keep("--schedule", args.schedule, old.schedule)?,
            cooldown_frac: keep("--cooldown-frac", args.cooldown_frac, old.cooldown_frac)?,
            final_lr_frac: keep("--final-lr-frac", args.final_lr_frac, old.final_lr_frac)?,
            clip: keep("--clip", args.clip, old.clip)?,
            weight_decay: keep("--weight-decay", args.weight_decay, old.weight_decay)?,
            seed: keep("--seed", args.seed, old.seed)?,
            heldout: match (heldout, old.heldout) {
                (Some(h), Some(o)) if h != o => {
                    bail!("{h} differs from the checkpoint's {o}: a resumed run keeps its held-out split")
                }
                _ => old.heldout,
            },
            dtype: keep("--dtype", args.dtype.clone(), old.dtype.clone())?,
            eval_every: args.eval_every.unwrap_or(old.eval_every),
            save_every: args.save_every.unwrap_or(old.save_every),
        },
        None => {
            // A timed run plans its steps; --steps only caps the plan.
            let steps = args.steps.unwrap_or(match args.minutes {
                Some(_) => usize::MAX,
                None => 1000,
            });
            Settings {
                steps,
                batch_size: args.batch_size.unwrap_or(8),
                seq_len: args.seq_len.unwrap_or(256),
                grad_accum: args.grad_accum.unwrap_or(1),
                // A new model learns fast from random weights; a trained one is only nudged.
                lr: args
                    .lr
                    .unwrap_or(if args.weights.is_some() { 1e-4 } else { 1e-3 }),
                warmup: args.warmup.unwrap_or((steps / 10).min(100)),
                schedule: args.schedule.unwrap_or_default(),
                cooldown_frac: args.cooldown_frac.unwrap_or(COOLDOWN_FRAC),
                final_lr_frac: args.final_lr_frac.unwrap_or(0.1),
                clip: args.clip.unwrap_or(1.0),
                weight_decay: args.weight_decay.unwrap_or(0.1),
                seed: args.seed.unwrap_or(0),
                heldout,
                dtype: args.dtype.clone().unwrap_or_else(|| "f32".into()),
                eval_every: args.eval_every.unwrap_or(100),
                save_every: args.save_every.unwrap_or(500),
            }
        }
    };
    check(&s, args)?;
    Ok(s)
}

/// Every number in range: an error naming the flag and its value otherwise.
fn check(s: &Settings, args: &Args) -> Result<()> {
    let positive = |flag: &str, v: usize| -> Result<()> {
        if v == 0 {
            bail!("{flag} must be at least 1, got 0")
        }
        Ok(())
    };
    positive("--steps", s.steps)?;
    positive("--batch-size", s.batch_size)?;
    positive("--grad-accum", s.grad_accum)?;
    if s.seq_len < 2 {
        bail!(
            "--seq-len must be at least 2 (a sequence predicts its tokens 1..L−1), got {}",
            s.seq_len
        )
    }
    if !(s.lr.is_finite() && s.lr > 0.0) {
        bail!("--lr must be a finite number > 0, got {}", s.lr)
    }
    if s.warmup > s.steps {
        bail!(
            "--warmup {} is longer than the run (--steps {})",
            s.warmup,
            s.steps
        )
    }
    if !(0.0..=1.0).contains(&s.final_lr_frac) {
        bail!("--final-lr-frac must be in [0, 1], got {}", s.final_lr_frac)
    }
    if !(0.0..=1.0).contains(&s.cooldown_frac) {
        bail!("--cooldown-frac must be in [0, 1], got {}", s.cooldown_frac)
    }
    if args.cooldown_frac.is_some() && s.schedule != Schedule::Wsd {
        bail!(
            "--cooldown-frac applies to --schedule wsd only (this run's schedule is {})",
            s.schedule
        )
    }
    if let Some(m) = args.minutes {
        if !(m.is_finite() && m > 0.0) {
            bail!("--minutes must be a finite number > 0, got {m}")
        }
        if !(args.reserve_s.is_finite() && args.reserve_s >= 0.0) {
            bail!(
                "--reserve-s must be a finite number >= 0, got {}",
                args.reserve_s
            )
        }
        if m * 60.0 <= args.reserve_s {
            bail!(
                "--minutes {m} leaves no training time: its {} s are within --reserve-s {}",
                m * 60.0,
                args.reserve_s
            )
        }
    }
    if !(s.clip.is_finite() && s.clip >= 0.0) {
        bail!(
            "--clip must be a finite number >= 0 (0 turns clipping off), got {}",
            s.clip
        )
    }
    if !(s.weight_decay.is_finite() && s.weight_decay >= 0.0) {
        bail!(
            "--weight-decay must be a finite number >= 0, got {}",
            s.weight_decay
        )
    }
    match s.heldout {
        Some(Heldout::Books(0)) => bail!("--heldout-books must be at least 1, got 0"),
        Some(Heldout::Fraction(f)) if !(0.0..1.0).contains(&f) => {
            bail!("--heldout-fraction must be in [0, 1) (0: no held-out text), got {f}")
        }
        _ => {}
    }
    s.dtype()?;
    if args.stop_after == Some(0) {
        bail!("--stop-after must be at least 1, got 0")
    }
    Ok(())
}

pub fn device(spec: &str) -> Result<Device> {
    Ok(match spec {
        "cpu" => Device::Cpu,
        "cuda" => Device::new_cuda(0)?,
        s => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(n)) => Device::new_cuda(n)?,
            _ => bail!("--device must be cpu, cuda or cuda:N, got {s:?}"),
        },
    })
}

/// The ranks of a run: the device of each (rank r on `devices[r]`), and whether they average
/// their gradients through NCCL (otherwise there is one rank).
pub struct Ranks {
    pub devices: Vec<Device>,
    pub nccl: bool,
}

/// The ranks that `--device`, `--gpus` and `--all-reduce` give for micro-batches of
/// `batch_size` rows; an error, before anything is read or written, when they do not fit
/// together, the build lacks NCCL, or the GPUs are not there.
pub fn ranks(args: &Args, batch_size: usize) -> Result<Ranks> {
    let n = args.gpus;
    if n == 0 {
        bail!("--gpus must be at least 1, got 0")
    }
    let nccl = match args.all_reduce {
        Some(AllReduce::Nccl) => true,
        Some(AllReduce::None) if n > 1 => bail!(
            "--all-reduce none leaves the ranks' gradients apart: --gpus {n} needs --all-reduce \
             nccl (the default with more than one GPU)"
        ),
        Some(AllReduce::None) => false,
        None => n > 1,
    };
    if !nccl {
        return Ok(Ranks {
            devices: vec![device(&args.device)?],
            nccl,
        });
    }
    let base = match args.device.as_str() {
        "cuda" => 0,
        s => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(k)) => k,
            _ => bail!(
                "{} trains one rank per CUDA device, not on --device {s}: pass --device cuda \
                 (GPUs 0 to {}) or cuda:K (GPUs K to K+{})",
                if n > 1 {
                    format!("--gpus {n}")
                } else {
                    "--all-reduce nccl".to_string()
                },
                n - 1,
                n - 1
            ),
        },
    };
    if batch_size % n != 0 {
        bail!(
            "--batch-size {batch_size} does not split over --gpus {n}: each GPU takes \
             batch-size / gpus rows of every micro-batch, so pass a multiple of {n}"
        )
    }
    nccl_devices(base, n).map(|devices| Ranks {
        devices,
        nccl: true,
    })
}

/// CUDA devices `base..base + n`, after checking that the driver has them.
#[cfg(feature = "nccl")]
fn nccl_devices(base: usize, n: usize) -> Result<Vec<Device>> {
    let count = crate::parallel::nccl::device_count()?;
    if base + n > count {
        bail!(
            "--gpus {n} from cuda:{base} needs CUDA devices {base}..{}, but the driver sees {count}",
            base + n - 1
        )
    }
    Ok((base..base + n)
        .map(Device::new_cuda)
        .collect::<candle_core::Result<_>>()?)
}

#[cfg(not(feature = "nccl"))]
fn nccl_devices(_: usize, n: usize) -> Result<Vec<Device>> {
    bail!(
        "--gpus {n} / --all-reduce nccl needs NCCL, which this build lacks: build with \
         `cargo build --release --features cuda,nccl --example train` (README, \"Training on \
         several GPUs\")"
    )
}
