//! One invocation of the train example: settings, output directory, model, tokenizer and data
//! checked in that order before the first step; then the steps (micro-batches with gradient
//! accumulation, clipping, AdamW), held-out evaluations and checkpoints.
//!
//! A step whose loss, gradient norm or updated weights are not finite stops the run with an error
//! naming the step, before anything of that step is saved: `--out` keeps its last checkpoint.
//!
//! With several ranks (`--gpus N`, or `--all-reduce nccl`) the model replicas are made here, one
//! per device, and each rank runs the steps on a thread of its own (`train_on`); rank 0
//! evaluates, logs and saves. See `parallel.rs` for what the ranks exchange.
//!
//! On a GPU a step waits for the device once, at its end: the micro-batches' ids go up from the
//! host (checked there), the losses stay on the device, the optimizer reads nothing back, and
//! the losses, the gradient norm and the weights' finiteness come back in one copy.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::{ParamsAdamW, VarBuilder};
use indicatif::{ProgressBar, ProgressStyle};
use mamba2::model::{byte_tokenizer, Config, Model, Tokenizer, TrainableModel, BYTE_VOCAB};

use crate::adamw::{AdamW, BETA1, BETA2, EPS};
use crate::checkpoint::{self, Checkpoint, DataRecord, TrainerState};
use crate::cli::{self, Args, Settings};
use crate::curve::Row;
use crate::data::{self, Sampler};
use crate::parallel::{self, Collective};
use crate::schedule::{lr_at, Budget};

/// How an invocation ended.
#[derive(Debug)]
pub struct Outcome {
    pub out: PathBuf,
    /// The last step done (= the step of the checkpoint in `out`).
    pub step: usize,
    /// The mean loss of the last step's micro-batches.
    pub train_loss: f64,
    /// The held-out loss of the last evaluation, if any.
    pub heldout_loss: Option<f64>,
    /// Training tokens per second of this invocation's steps (evaluations and saves excluded).
    pub tokens_per_s: f64,
    /// On CUDA: the most bytes in use at once in the device's memory pool (candle's
    /// allocations), and the most the pool held.
    pub peak_gpu_bytes: Option<(u64, u64)>,
}

/// The model, its tokenizer (the bytes of its tokenizer.json) and what a resumed run continues.
struct Start {
    trainable: TrainableModel,
    tokenizer_json: Vec<u8>,
    moments: Option<HashMap<String, Tensor>>,
    rows: Vec<Row>,
}

/// A tokenizer.json's bytes: `file`'s, or the byte-level stand-in's when there is none and the
/// vocabulary has room for it (saying so when `notes`).
fn tokenizer_json(
    file: Option<PathBuf>,
    config: &Config,
    missing: &str,
    notes: bool,
) -> Result<Vec<u8>> {
    if let Some(file) = file {
        let bytes = std::fs::read(&file)
            .with_context(|| format!("reading the tokenizer {}", file.display()))?;
        Tokenizer::from_bytes(&bytes)
            .map_err(|e| anyhow!("the tokenizer {}: {e}", file.display()))?;
        return Ok(bytes);
    }
    if config.vocab_size < BYTE_VOCAB {
        bail!(
            "{missing}: pass --tokenizer FILE (the model's {} tokens are too few for the \
             byte-level stand-in)",
            config.vocab_size
        )
    }
    if notes {
        eprintln!(
            "{missing}: training on raw bytes with the byte-level stand-in tokenizer (token id = \
             byte value), saved as the checkpoint's tokenizer.json; pass --tokenizer FILE to use \
             another"
        );
    }
    Ok(byte_tokenizer()?
        .to_string(false)
        .map_err(|e| anyhow!("byte tokenizer: {e}"))?
        .into_bytes())
}

/// The model on `device` and what a resumed run continues; `notes`: print what was chosen for
/// the user (once per run, not once per replica).
fn start(
    args: &Args,
    saved: Option<&TrainerState>,
    settings: &Settings,
    device: &Device,
    notes: bool,
) -> Result<Start> {
    let dtype = settings.dtype()?;
    if let (Some(dir), Some(state)) = (&args.resume, saved) {
        let r = checkpoint::load(dir, state, device)?;
        if let Some(file) = &args.config {
            let config = Config::from_file(file)?;
            checkpoint::same_config(
                r.trainable.config(),
                &config,
                &format!("--config {}", file.display()),
            )?;
        }
        return Ok(Start {
            trainable: r.trainable,
            tokenizer_json: r.tokenizer_json,
            moments: Some(r.moments),
            rows: r.rows,
        });
    }
    let (trainable, tokenizer) = match (&args.weights, &args.config) {
        (Some(dir), _) => {
            let trainable = TrainableModel::load(dir, dtype, device)
                .with_context(|| format!("loading --weights {}", dir.display()))?;
            let own = Some(dir.join("tokenizer.json")).filter(|f| f.is_file());
            let missing = format!("--weights {} has no tokenizer.json", dir.display());
            let json = tokenizer_json(
                args.tokenizer.clone().or(own),
                trainable.config(),
                &missing,
                notes,
            )?;
            (trainable, json)
        }
        (None, Some(file)) => {
            let config = Config::from_file(file)?;
            let trainable = TrainableModel::init(&config, settings.seed, dtype, device)?;
            let json = tokenizer_json(
                args.tokenizer.clone(),
                &config,
                "--config without --tokenizer",
                notes,
            )?;
            (trainable, json)
        }
        (None, None) => {
            bail!("pass --weights DIR (fine-tune), --config FILE (new model) or --resume DIR")
        }
    };
    Ok(Start {
        trainable,
        tokenizer_json: tokenizer,
        moments: None,
        rows: Vec::new(),
    })
}

/// The mean held-out loss: non-overlapping windows of `window` tokens (the last one kept with 2
/// tokens or more), each from an empty state, `batch` at a time — the `perplexity` example's
/// definition. The model is built on detached weights in the run's compute dtype (bf16 when the
/// run computes in bf16), so no gradient graph is recorded; each batch's ids go up from the host
/// and its sum is the one value read back.
fn evaluate(
    trainable: &TrainableModel,
    heldout: &[u32],
    window: usize,
    batch: usize,
) -> Result<f64> {
    let weights: HashMap<String, Tensor> = trainable
        .vars()
        .into_iter()
        .map(|(name, v)| (name, v.as_tensor().detach()))
        .collect();
    let vb = VarBuilder::from_tensors(weights, trainable.dtype(), trainable.device());
    let model = Model::new(trainable.config(), vb)?;
    let windows: Vec<&[u32]> = heldout.chunks(window).filter(|w| w.len() >= 2).collect();
    let (mut nll, mut count) = (0f64, 0usize);
    let mut rest = windows.as_slice();
    while let Some(first) = rest.first() {
        // Windows of equal length run together (all but the last are full).
        let n = rest
            .iter()
            .take(batch)
            .take_while(|w| w.len() == first.len())
            .count();
        nll += model.nll_sum_from_host(&rest[..n].concat(), n)?;
        count += n * (first.len() - 1);
        rest = &rest[n..];
    }
    Ok(nll / count.max(1) as f64)
}

/// The error that stops a run at `step`, saying what `out` holds.
fn stopped(step: usize, why: String, out: &Path, saved: Option<usize>) -> anyhow::Error {
    let kept = match saved {
        Some(s) => format!("{} keeps the checkpoint of step {s}", out.display()),
        None => format!(
            "nothing of this run was saved; {} is as it was",
            out.display()
        ),
    };
    anyhow!("step {step}: {why}; training stopped without saving these weights ({kept})")
}

/// Runs the training that `args` describe (see the module doc): one rank on `--device`, or one
/// rank per GPU with `--gpus N` / `--all-reduce nccl`.
pub fn train(args: &Args) -> Result<Outcome> {
    let plan = Plan::new(args)?;
    let ranks = cli::ranks(args, plan.settings.batch_size)?;
    if !ranks.nccl {
        let [device] = <[Device; 1]>::try_from(ranks.devices)
            .map_err(|d| anyhow!("{} devices for one rank", d.len()))?;
        return train_on(plan, vec![device], None);
    }
    nccl_ranks(plan, ranks.devices)
}

/// The NCCL run over `devices`: NVLink multicast off, one communicator id shared by the ranks.
#[cfg(feature = "nccl")]
fn nccl_ranks(plan: Plan, devices: Vec<Device>) -> Result<Outcome> {
    use crate::parallel::nccl;
    nccl::disable_nvls();
    let id = nccl::unique_id()?;
    let world = devices.len();
    let connect: Connect = Arc::new(move |rank, device| {
        Ok(Box::new(nccl::Nccl::connect(id, rank, world, device)?) as Box<dyn Collective>)
    });
    train_on(plan, devices, Some(connect))
}

#[cfg(not(feature = "nccl"))]
fn nccl_ranks(_: Plan, _: Vec<Device>) -> Result<Outcome> {
    bail!("this build has no NCCL (build with --features cuda,nccl)")
}

/// Makes rank `r`'s [`Collective`] on its device, on the rank's own thread (NCCL's joining
/// waits there for every rank).
pub type Connect = Arc<dyn Fn(usize, &Device) -> Result<Box<dyn Collective>> + Send + Sync>;

/// What an invocation settled before touching a device: its settings and where it stands.
pub struct Plan {
    args: Args,
    started: Instant,
    saved: Option<TrainerState>,
    settings: Settings,
    first: usize,
}

impl Plan {
    /// The checked settings of `args` (a resumed run's saved ones) and the first step.
    pub fn new(args: &Args) -> Result<Self> {
        let started = Instant::now();
        let saved = args
            .resume
            .as_deref()
            .map(checkpoint::read_state)
            .transpose()?;
        let settings = cli::settings(args, saved.as_ref().map(|s| &s.settings))?;
        let first = saved.as_ref().map_or(0, |s| s.step);
        let end = last_step(args, &settings);
        if end <= first {
            bail!(
                "the run is already at step {first}: nothing to do up to step {end} (raise --steps)"
            )
        }
        Ok(Self {
            args: args.clone(),
            started,
            saved,
            settings,
            first,
        })
    }
}

/// The last step of this invocation: `--stop-after` or the run's end.
fn last_step(args: &Args, s: &Settings) -> usize {
    args.stop_after.map_or(s.steps, |a| a.min(s.steps))
}

/// What every rank reads: the plan, the output directory and the data.
struct Shared {
    plan: Plan,
    out: PathBuf,
    corpus: data::Corpus,
    record: DataRecord,
    world: usize,
    /// Elements per all-reduce bucket.
    bucket: usize,
}

/// How long the ranks left running after one failed get to end on their own.
const GRACE: Duration = Duration::from_secs(10);

/// Trains with one rank per device of `devices` (rank r on `devices[r]`), their gradients
/// averaged through the collectives `connect` makes; `None`: one rank, no communicator, on
/// this thread. The output directory, the data and the model replicas are made here, in that
/// order, before any step.
///
/// The ranks run on threads of this process, not in processes of their own: they share the
/// tokenized data and the checkpoint logic without a launcher or a way to pass NCCL's id, and
/// an error reaches the caller as an error. The cost: the CUDA driver serialises some of its
/// calls across a process's threads, which may slow kernel launches with many GPUs (the 2-GPU
/// scaling measurement tells). When a rank fails, the others may be waiting for it inside a
/// collective, which NCCL never times out: the error of the lowest rank among those that fail
/// within [`GRACE`] of the first is returned then, and ranks still blocked are left behind —
/// the example's `main` then ends the process, which frees their GPUs.
pub fn train_on(plan: Plan, devices: Vec<Device>, connect: Option<Connect>) -> Result<Outcome> {
    let args = &plan.args;
    let world = devices.len();
    if world == 0 || (world > 1 && connect.is_none()) {
        bail!("{world} ranks without a communicator")
    }
    if plan.settings.batch_size % world != 0 {
        bail!(
            "--batch-size {} does not split over {world} ranks: pass a multiple of {world}",
            plan.settings.batch_size
        )
    }
    let Some(out) = args.out.clone().or_else(|| args.resume.clone()) else {
        bail!("pass --out DIR")
    };
    checkpoint::prepare_out(&out, args.resume.as_deref(), args.overwrite)?;
    let Some(data_path) = args
        .data
        .clone()
        .or_else(|| plan.saved.as_ref().map(|s| s.data.path.clone()))
    else {
        bail!("pass --data FILE")
    };
    let text = data::read_text(&data_path)?;

    let mut replicas = Vec::with_capacity(world);
    for (rank, device) in devices.iter().enumerate() {
        let s = start(args, plan.saved.as_ref(), &plan.settings, device, rank == 0);
        // One rank's errors read as before; with several, they name the rank.
        replicas.push(match world {
            1 => s?,
            _ => s.with_context(|| context(rank, device))?,
        });
    }
    let config = replicas[0].trainable.config().clone();
    let tokenizer = Tokenizer::from_bytes(&replicas[0].tokenizer_json)
        .map_err(|e| anyhow!("tokenizer: {e}"))?;
    let corpus = data::tokenize(
        &data_path,
        &text,
        &tokenizer,
        plan.settings.heldout,
        plan.settings.seq_len,
        config.vocab_size,
    )?;
    drop(text);
    if let Some(s) = plan
        .saved
        .as_ref()
        .filter(|s| s.data.fingerprint != corpus.fingerprint)
    {
        bail!(
            "--data {} gives {} training and {} held-out tokens (fingerprint {}), but the checkpoint \
             was trained on {} and {} (fingerprint {}) from {}: a resumed run needs the same text",
            data_path.display(),
            corpus.train.len(),
            corpus.heldout.len(),
            corpus.fingerprint,
            s.data.train_tokens,
            s.data.heldout_tokens,
            s.data.fingerprint,
            s.data.path.display()
        )
    }
    let record = DataRecord {
        path: data_path.clone(),
        train_tokens: corpus.train.len(),
        heldout_tokens: corpus.heldout.len(),
        fingerprint: corpus.fingerprint.clone(),
    };
    let bucket = (args.bucket_mib as usize) << 20 >> 2;
    let mut plan = plan;
    plan.settings.heldout = Some(corpus.split);
    let shared = Arc::new(Shared {
        plan,
        out,
        corpus,
        record,
        world,
        bucket,
    });
    let Some(connect) = connect else {
        let replica = replicas.pop().map(|s| (devices[0].clone(), s));
        let Some((device, s)) = replica else {
            bail!("no model replica")
        };
        let outcome = run_rank(&shared, &device, s, None)?;
        return outcome.ok_or_else(|| anyhow!("rank 0 ended without an outcome"));
    };

    // A replica moves to its rank's thread: its device has finished what this thread queued.
    for device in &devices {
        device.synchronize()?;
    }
    let (done, results) = mpsc::channel();
    for (rank, (device, s)) in devices.into_iter().zip(replicas).enumerate() {
        let (shared, connect, done) = (shared.clone(), connect.clone(), done.clone());
        std::thread::Builder::new()
            .name(format!("rank {rank}"))
            .spawn(move || {
                let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
                    let comm = connect(rank, &device)?;
                    run_rank(&shared, &device, s, Some(comm.as_ref()))
                }))
                .unwrap_or_else(|panic| {
                    let why = panic
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_default();
                    Err(anyhow!("panicked: {why}"))
                })
                .with_context(|| context(rank, &device));
                // The receiver may have returned already (another rank failed).
                let _ = done.send((rank, result));
            })?;
    }
    drop(done);
    collect(results, world)
}

/// What rank `rank`'s errors say first.
fn context(rank: usize, device: &Device) -> String {
    format!("rank {rank} on {:?}", device.location())
}

/// Rank 0's outcome once every rank has ended well; else the error of the lowest rank among
/// those that failed within [`GRACE`] of the first failure.
fn collect(
    results: mpsc::Receiver<(usize, Result<Option<Outcome>>)>,
    world: usize,
) -> Result<Outcome> {
    let mut outcome = None;
    let mut errors: Vec<(usize, anyhow::Error)> = Vec::new();
    let mut deadline = None;
    for _ in 0..world {
        let next = match deadline {
            None => results
                .recv()
                .map_err(|_| mpsc::RecvTimeoutError::Disconnected),
            Some(at) => results.recv_timeout(at - Instant::now().min(at)),
        };
        match next {
            Ok((_, Ok(o))) => outcome = outcome.or(o),
            Ok((rank, Err(e))) => {
                errors.push((rank, e));
                deadline.get_or_insert(Instant::now() + GRACE);
            }
            Err(_) => break,
        }
    }
    if let Some((_, first)) = errors.into_iter().min_by_key(|(rank, _)| *rank) {
        return Err(first);
    }
    outcome.ok_or_else(|| anyhow!("the ranks ended without rank 0's outcome"))
}

/// One rank's training: the steps from `s`'s state on `device`, with the gradients and losses
/// averaged through `comm` when there is one. Rank 0 alone evaluates the held-out text, shows
/// the progress, keeps the log and writes the checkpoints, and returns the outcome.
fn run_rank(
    shared: &Shared,
    device: &Device,
    s: Start,
    comm: Option<&dyn Collective>,
) -> Result<Option<Outcome>> {
    let Shared {
        plan,
        out,
        corpus,
        record,
        world,
        bucket,
    } = shared;
    let (args, saved, first) = (&plan.args, plan.saved.as_ref(), plan.first);
    let mut settings = plan.settings.clone();
    let rank = comm.map_or(0, |c| c.rank());
    let lead = rank == 0;
    let end = last_step(args, &settings);
    let trainable = s.trainable;
    let config = trainable.config().clone();
    let vars = trainable.vars();
    let params = ParamsAdamW {
        lr: settings.lr,
        beta1: BETA1,
        beta2: BETA2,
        eps: EPS,
        weight_decay: settings.weight_decay,
    };
    // Matrices decay; biases, norms, A_log, D and dt_bias do not (as tools/train.py).
    let mut optimizer = AdamW::new(vars.clone(), params, |_, v| v.rank() >= 2)?;
    if let Some(moments) = s.moments {
        optimizer
            .load_state(moments, first)
            .with_context(|| format!("resuming {}", out.display()))?;
    }
    // Rank 0 plans a timed run; the others follow its plan.
    let mut budget = args.minutes.filter(|_| lead).map(|minutes| {
        Budget::new(
            plan.started,
            minutes,
            args.reserve_s,
            settings.steps,
            first == 0,
        )
    });
    let timed = args.minutes.is_some();
    let mut sampler = Sampler::new(saved.map_or(settings.seed, |s| s.sampler));
    let mut tokens = saved.map_or(0, |s| s.tokens);
    let mut rows = s.rows;
    let (batch, len, accum) = (settings.batch_size, settings.seq_len, settings.grad_accum);
    let local = batch / world;
    let millions = trainable.parameter_count() as f64 / 1e6;
    if lead {
        let length = match args.minutes {
            Some(m) => format!(
                "from step {} for {m} minutes ({} s kept for the end), {} schedule",
                first + 1,
                args.reserve_s,
                settings.schedule
            ),
            None => format!(
                "steps {}..{end} of {}, {} schedule",
                first + 1,
                settings.steps,
                settings.schedule
            ),
        };
        let ranks = match comm {
            Some(c) => format!(
                "; {} rank(s) of {local} sequences each, gradients averaged in buckets of {} MiB",
                c.world(),
                args.bucket_mib
            ),
            None => String::new(),
        };
        eprintln!(
            "model: {millions:.2}M parameters ({} layers × {}, vocabulary {}), {} on {:?}; data: {} \
             training / {} held-out tokens ({}); {batch} × {accum} × {len} = {} tokens per step; \
             {length}{ranks}",
            config.n_layer,
            config.d_model,
            config.vocab_size,
            settings.dtype,
            device,
            corpus.train.len(),
            corpus.heldout.len(),
            corpus.split,
            settings.tokens_per_step(),
        );
    }

    // A timed run shows the step count alone until it has a plan; ranks other than 0 show none.
    let bar = if lead {
        ProgressBar::new(end as u64)
    } else {
        ProgressBar::hidden()
    };
    let planned_style = ProgressStyle::with_template(
        "{bar:30} {pos}/{len} steps [{elapsed_precise}<{eta_precise}] {msg}",
    )?;
    bar.set_style(match budget {
        Some(_) => ProgressStyle::with_template("{pos} steps [{elapsed_precise}] {msg}")?,
        None => planned_style.clone(),
    });
    bar.set_position(first as u64);
    bar.reset_eta();
    let eval = |step: usize, row: &mut Row| -> Result<Option<f64>> {
        if corpus.heldout.is_empty() || !lead {
            return Ok(None);
        }
        let loss = evaluate(&trainable, &corpus.heldout, len, batch)?;
        (row.heldout_loss, row.heldout_ppl) = (Some(loss), Some(loss.exp()));
        bar.suspend(|| {
            eprintln!(
                "step {step}: held-out loss {loss:.4}, perplexity {:.2}",
                loss.exp()
            )
        });
        Ok(Some(loss))
    };
    let mut heldout = rows.iter().rev().find_map(|r| r.heldout_loss);
    if saved.is_none() {
        let mut row = Row::default();
        heldout = eval(0, &mut row)?;
        rows.push(row);
    }

    let mut last_saved = saved.map(|s| s.step);
    let (mut step_secs, mut step_tokens) = (0f64, 0u64);
    let mut step = first;
    let (done, train_loss) = loop {
        let done = step + 1;
        let lr = lr_at(&settings, step);
        optimizer.set_lr(lr);
        let t0 = Instant::now();
        let model = trainable.model()?;
        let mut sums: Vec<Option<Tensor>> = vec![None; vars.len()];
        let mut losses = Vec::with_capacity(accum);
        for _ in 0..accum {
            // Every rank draws the global micro-batch and trains on its rows of it.
            let ids = sampler.batch(&corpus.train, batch, len);
            let mine = data::shard(&ids, batch, len, rank, *world)?;
            let loss = model.loss_from_host(mine, local)?;
            // The step's gradient is that of the mean loss over its micro-batches.
            let mut grads = if accum == 1 {
                loss.backward()?
            } else {
                (&loss / accum as f64)?.backward()?
            };
            losses.push(loss);
            for (sum, (_, var)) in sums.iter_mut().zip(&vars) {
                if let Some(g) = grads.remove(var.as_tensor()) {
                    *sum = Some(match sum.take() {
                        Some(s) => (s + g)?,
                        None => g,
                    });
                }
            }
        }
        let missing: Vec<&str> = vars
            .iter()
            .zip(&sums)
            .filter(|(_, g)| g.is_none())
            .map(|((n, _), _)| n.as_str())
            .collect();
        if let Some(name) = missing.first() {
            bail!(
                "the backward pass gave no gradient for {} weight(s), e.g. {name}",
                missing.len()
            )
        }
        let grads: Vec<Tensor> = sums.into_iter().flatten().collect();
        let losses = Tensor::stack(&losses, 0)?.to_dtype(DType::F32)?;
        let (grads, losses) = match comm {
            Some(c) => (
                parallel::average_grads(c, grads, *bucket)?,
                parallel::mean(c, &losses)?,
            ),
            None => (grads, losses),
        };
        let stats = optimizer.clip_and_step(grads, settings.clip)?;
        let read = stats.read(&losses)?;
        if let Some((micro, value)) = read.losses.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            let why = format!(
                "the training loss is {value} (micro-batch {} of {accum}, lr {lr:.3e})",
                micro + 1
            );
            return Err(stopped(done, why, out, last_saved));
        }
        if !read.norm.is_finite() {
            let why = format!("the gradient norm is {} (lr {lr:.3e})", read.norm);
            return Err(stopped(done, why, out, last_saved));
        }
        if !read.finite {
            let why = format!("the update (lr {lr:.3e}) made weights non-finite");
            return Err(stopped(done, why, out, last_saved));
        }
        let now = Instant::now();
        let secs = now.duration_since(t0).as_secs_f64();
        (step_secs, step_tokens) = (
            step_secs + secs,
            step_tokens + settings.tokens_per_step() as u64,
        );
        tokens += settings.tokens_per_step() as u64;
        let train_loss = read.losses.iter().map(|&v| f64::from(v)).sum::<f64>() / accum as f64;
        let tps = settings.tokens_per_step() as f64 / secs;
        let mut last = done >= last_step(args, &settings);
        if let Some(budget) = budget.as_mut() {
            if let Some(plan) = budget.after_step(&mut settings, done, now) {
                bar.suspend(|| eprintln!("step {done}: {plan}"));
                bar.set_style(planned_style.clone());
            }
            bar.set_length(last_step(args, &settings) as u64);
            last = done >= last_step(args, &settings);
            if budget.expired(now) {
                // The time is up: the run ends here.
                (settings.steps, last) = (done, true);
            }
        }
        if let Some(c) = comm.filter(|_| timed) {
            // Rank 0's clock decides: every rank takes its plan and ends at the same step.
            let mine = [
                settings.steps as u64,
                settings.warmup as u64,
                u64::from(last),
            ];
            let agreed = parallel::from_rank0(c, &mine, device)?;
            settings.steps = usize::try_from(agreed[0]).unwrap_or(usize::MAX);
            settings.warmup = usize::try_from(agreed[1]).unwrap_or(usize::MAX);
            last = agreed[2] != 0;
        }
        let mut row = Row {
            step: done,
            tokens,
            lr: Some(lr),
            train_loss: Some(train_loss),
            grad_norm: Some(read.norm),
            tokens_per_s: Some(tps),
            ..Row::default()
        };
        if last || (settings.eval_every > 0 && done % settings.eval_every == 0) {
            heldout = eval(done, &mut row)?.or(heldout);
        }
        rows.push(row);
        let ppl = heldout.map_or(String::new(), |h| format!(", held-out ppl {:.2}", h.exp()));
        bar.set_message(format!(
            "loss {train_loss:.4}, lr {lr:.2e}, {tps:.0} tok/s{ppl}"
        ));
        bar.set_position(done as u64);
        if last || (settings.save_every > 0 && done % settings.save_every == 0) {
            if let Some(c) = comm {
                parallel::check_weights_agree(c, &vars, done)?;
            }
            if lead {
                let state = TrainerState::new(
                    done,
                    tokens,
                    sampler.state(),
                    settings.clone(),
                    record.clone(),
                    *world,
                );
                let title = format!(
                    "Mamba-2, {millions:.2}M parameters: step {done}, {tokens} tokens{ppl}"
                );
                let c = Checkpoint {
                    trainable: &trainable,
                    optimizer: &optimizer,
                    state: &state,
                    tokenizer_json: &s.tokenizer_json,
                    rows: &rows,
                    title: &title,
                    shard_bytes: (args.max_shard_mib as usize) << 20,
                };
                checkpoint::save(out, &c).with_context(|| {
                    format!("step {done}: saving the checkpoint to {}", out.display())
                })?;
            }
            last_saved = Some(done);
        }
        if last {
            break (done, train_loss);
        }
        step = done;
    };
    bar.finish();
    if !lead {
        return Ok(None);
    }
    if done < settings.steps {
        let of = match settings.steps {
            usize::MAX => String::new(),
            n => format!(" of {n}"),
        };
        eprintln!(
            "stopped after step {done}{of} (--stop-after): continue with --resume {}",
            out.display()
        );
    } else if budget.is_some() {
        eprintln!(
            "the --minutes budget ended the run at step {done}, {:.0} s after the start",
            plan.started.elapsed().as_secs_f64()
        );
    }
    Ok(Some(Outcome {
        out: out.clone(),
        step: done,
        train_loss,
        heldout_loss: heldout,
        tokens_per_s: step_tokens as f64 / step_secs.max(1e-9),
        peak_gpu_bytes: peak_gpu_bytes(device)?,
    }))
}

/// The high-water marks of `device`'s default memory pool, which candle's stream-ordered
/// allocations come from: bytes in use, and bytes the pool held. `None` off CUDA or without
/// memory pools.
#[cfg(feature = "cuda")]
fn peak_gpu_bytes(device: &Device) -> Result<Option<(u64, u64)>> {
    use candle_core::cuda_backend::cudarc::driver::sys::{self, CUmemPool_attribute};
    use candle_core::cuda_backend::WrapErr;
    let Device::Cuda(dev) = device else {
        return Ok(None);
    };
    let stream = dev.cuda_stream();
    let ctx = stream.context();
    if !ctx.has_async_alloc() {
        return Ok(None);
    }
    let mut pool = std::ptr::null_mut();
    // SAFETY: `pool` receives the device's default pool handle, which lives as long as the
    // device; each attribute is a u64, as the driver API defines these two.
    unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device())
            .result()
            .w()?;
        let high = |attribute| -> Result<u64> {
            let mut value = 0u64;
            sys::cuMemPoolGetAttribute(pool, attribute, (&mut value as *mut u64).cast())
                .result()
                .w()?;
            Ok(value)
        };
        Ok(Some((
            high(CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
            high(CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?,
        )))
    }
}

#[cfg(not(feature = "cuda"))]
fn peak_gpu_bytes(_: &Device) -> Result<Option<(u64, u64)>> {
    Ok(None)
}
