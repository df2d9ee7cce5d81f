//! One invocation of the train example: settings, output directory, model, tokenizer and data
//! checked in that order before the first step; then the steps (micro-batches with gradient
//! accumulation, clipping, AdamW), held-out evaluations and checkpoints.
//!
//! A step whose loss, gradient norm or updated weights are not finite stops the run with an error
//! naming the step, before anything of that step is saved: `--out` keeps its last checkpoint.
//!
//! On a GPU a step waits for the device once, at its end: the micro-batches' ids go up from the
//! host (checked there), the losses stay on the device, the optimizer reads nothing back, and
//! the losses, the gradient norm and the weights' finiteness come back in one copy.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use candle_core::{Device, Tensor};
use candle_nn::{ParamsAdamW, VarBuilder};
use indicatif::{ProgressBar, ProgressStyle};
use mamba2::model::{byte_tokenizer, Config, Model, Tokenizer, TrainableModel, BYTE_VOCAB};

use crate::adamw::{AdamW, BETA1, BETA2, EPS};
use crate::checkpoint::{self, Checkpoint, DataRecord, TrainerState};
use crate::cli::{self, Args, Settings};
use crate::curve::Row;
use crate::data::{self, Sampler};
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
/// vocabulary has room for it.
fn tokenizer_json(file: Option<PathBuf>, config: &Config, missing: &str) -> Result<Vec<u8>> {
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
    eprintln!(
        "{missing}: training on raw bytes with the byte-level stand-in tokenizer (token id = byte \
         value), saved as the checkpoint's tokenizer.json; pass --tokenizer FILE to use another"
    );
    Ok(byte_tokenizer()?
        .to_string(false)
        .map_err(|e| anyhow!("byte tokenizer: {e}"))?
        .into_bytes())
}

fn start(
    args: &Args,
    saved: Option<&TrainerState>,
    settings: &Settings,
    device: &candle_core::Device,
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
            let json =
                tokenizer_json(args.tokenizer.clone().or(own), trainable.config(), &missing)?;
            (trainable, json)
        }
        (None, Some(file)) => {
            let config = Config::from_file(file)?;
            let trainable = TrainableModel::init(&config, settings.seed, dtype, device)?;
            let json = tokenizer_json(
                args.tokenizer.clone(),
                &config,
                "--config without --tokenizer",
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

/// Runs the training that `args` describe (see the module doc).
pub fn train(args: &Args) -> Result<Outcome> {
    let started = Instant::now();
    let saved = args
        .resume
        .as_deref()
        .map(checkpoint::read_state)
        .transpose()?;
    let mut settings = cli::settings(args, saved.as_ref().map(|s| &s.settings))?;
    let first = saved.as_ref().map_or(0, |s| s.step);
    let last_step = |s: &Settings| args.stop_after.map_or(s.steps, |a| a.min(s.steps));
    let end = last_step(&settings);
    if end <= first {
        bail!("the run is already at step {first}: nothing to do up to step {end} (raise --steps)")
    }
    let device = cli::device(&args.device)?;
    let Some(out) = args.out.clone().or_else(|| args.resume.clone()) else {
        bail!("pass --out DIR")
    };
    checkpoint::prepare_out(&out, args.resume.as_deref(), args.overwrite)?;
    let Some(data_path) = args
        .data
        .clone()
        .or_else(|| saved.as_ref().map(|s| s.data.path.clone()))
    else {
        bail!("pass --data FILE")
    };
    let text = data::read_text(&data_path)?;

    let start = start(args, saved.as_ref(), &settings, &device)?;
    let trainable = start.trainable;
    let config = trainable.config().clone();
    let tokenizer =
        Tokenizer::from_bytes(&start.tokenizer_json).map_err(|e| anyhow!("tokenizer: {e}"))?;
    let corpus = data::tokenize(
        &data_path,
        &text,
        &tokenizer,
        settings.heldout,
        settings.seq_len,
        config.vocab_size,
    )?;
    drop(text);
    settings.heldout = Some(corpus.split);
    if let Some(s) = saved
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
    if let Some(moments) = start.moments {
        optimizer
            .load_state(moments, first)
            .with_context(|| format!("resuming {}", out.display()))?;
    }
    let mut budget = args
        .minutes
        .map(|minutes| Budget::new(started, minutes, args.reserve_s, settings.steps, first == 0));
    let mut sampler = Sampler::new(saved.as_ref().map_or(settings.seed, |s| s.sampler));
    let mut tokens = saved.as_ref().map_or(0, |s| s.tokens);
    let mut rows = start.rows;
    let (batch, len, accum) = (settings.batch_size, settings.seq_len, settings.grad_accum);
    let millions = trainable.parameter_count() as f64 / 1e6;
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
    eprintln!(
        "model: {millions:.2}M parameters ({} layers × {}, vocabulary {}), {} on {:?}; data: {} \
         training / {} held-out tokens ({}); {batch} × {accum} × {len} = {} tokens per step; \
         {length}",
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

    // A timed run shows the step count alone until it has a plan.
    let bar = ProgressBar::new(end as u64);
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
        if corpus.heldout.is_empty() {
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

    let mut last_saved = saved.as_ref().map(|s| s.step);
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
            let loss = model.loss_from_host(&sampler.batch(&corpus.train, batch, len), batch)?;
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
        let stats = optimizer.clip_and_step(sums.into_iter().flatten().collect(), settings.clip)?;
        let read = stats.read(&losses)?;
        if let Some((micro, value)) = read.losses.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            let why = format!(
                "the training loss is {value} (micro-batch {} of {accum}, lr {lr:.3e})",
                micro + 1
            );
            return Err(stopped(done, why, &out, last_saved));
        }
        if !read.norm.is_finite() {
            let why = format!("the gradient norm is {} (lr {lr:.3e})", read.norm);
            return Err(stopped(done, why, &out, last_saved));
        }
        if !read.finite {
            let why = format!("the update (lr {lr:.3e}) made weights non-finite");
            return Err(stopped(done, why, &out, last_saved));
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
        let mut last = done >= last_step(&settings);
        if let Some(budget) = budget.as_mut() {
            if let Some(plan) = budget.after_step(&mut settings, done, now) {
                bar.suspend(|| eprintln!("step {done}: {plan}"));
                bar.set_style(planned_style.clone());
            }
            bar.set_length(last_step(&settings) as u64);
            last = done >= last_step(&settings);
            if budget.expired(now) {
                // The time is up: the run ends here.
                (settings.steps, last) = (done, true);
            }
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
            let state = TrainerState::new(
                done,
                tokens,
                sampler.state(),
                settings.clone(),
                record.clone(),
            );
            let title =
                format!("Mamba-2, {millions:.2}M parameters: step {done}, {tokens} tokens{ppl}");
            let c = Checkpoint {
                trainable: &trainable,
                optimizer: &optimizer,
                state: &state,
                tokenizer_json: &start.tokenizer_json,
                rows: &rows,
                title: &title,
                shard_bytes: (args.max_shard_mib as usize) << 20,
            };
            checkpoint::save(&out, &c).with_context(|| {
                format!("step {done}: saving the checkpoint to {}", out.display())
            })?;
            last_saved = Some(done);
        }
        if last {
            break (done, train_loss);
        }
        step = done;
    };
    bar.finish();
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
            started.elapsed().as_secs_f64()
        );
    }
    Ok(Outcome {
        out,
        step: done,
        train_loss,
        heldout_loss: heldout,
        tokens_per_s: step_tokens as f64 / step_secs.max(1e-9),
        peak_gpu_bytes: peak_gpu_bytes(&device)?,
    })
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
