//! The train example (`examples/train.rs`), driven through its own modules on the CPU with a tiny
//! model (hidden 32, 2 layers, 2 heads × 32, state 16, the shipped 8,192-token tokenizer) and a
//! few KB of text: the loss falls, the checkpoint loads and scores the held-out text as the run
//! said, a resumed run ends bit for bit where an uninterrupted one does, every bad input is an
//! error naming it before anything is written, and a non-finite loss stops the run with the last
//! checkpoint intact. Also: the AdamW matches candle-nn's, the schedule and the clipping.
//!
//! `cargo test --release --test train_cli`

#[path = "../examples/train/adamw.rs"]
mod adamw;
#[path = "../examples/train/checkpoint.rs"]
mod checkpoint;
#[path = "../examples/train/cli.rs"]
mod cli;
#[path = "../examples/train/curve.rs"]
mod curve;
#[path = "../examples/train/data.rs"]
mod data;
#[path = "../examples/train/parallel.rs"]
mod parallel;
#[path = "../examples/train/run.rs"]
mod run;
#[path = "../examples/train/schedule.rs"]
mod schedule;

#[path = "train_common/mod.rs"]
mod common;

use std::collections::HashMap;
use std::path::Path;

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var, D};
use candle_nn::{Optimizer, ParamsAdamW};
use clap::Parser;
use mamba2::model::{load_tokenizer, Model};

use common::{args, resume, rows, scratch, write_config, write_corpus};

/// The tensors of a safetensors file as raw f32 bits.
fn bits(file: &Path) -> HashMap<String, Vec<u32>> {
    candle_core::safetensors::load(file, &Device::Cpu)
        .expect("safetensors")
        .into_iter()
        .map(|(k, t)| {
            let v = t
                .flatten_all()
                .and_then(|t| t.to_vec1::<f32>())
                .expect("f32");
            (k, v.iter().map(|x| x.to_bits()).collect())
        })
        .collect()
}

/// The mean held-out loss of the model in `dir` on `text`: non-overlapping windows of `window`
/// tokens, each from an empty state (the `perplexity` example's definition), one at a time.
fn heldout_loss(dir: &Path, text: &str, window: usize) -> Result<f64> {
    let model = Model::load(dir, DType::F32, &Device::Cpu)?;
    let tokenizer = load_tokenizer(dir.join("tokenizer.json"))?;
    let ids = tokenizer
        .encode(text, true)
        .map_err(anyhow::Error::msg)?
        .get_ids()
        .to_vec();
    let (mut nll, mut count) = (0f64, 0usize);
    for w in ids.chunks(window).filter(|w| w.len() >= 2) {
        let ids = Tensor::new(w, &Device::Cpu)?.unsqueeze(0)?;
        let logits = model.forward(&ids.narrow(1, 0, w.len() - 1)?, &mut model.new_cache(1)?)?;
        let logp = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
        let picked = logp.gather(
            &ids.narrow(1, 1, w.len() - 1)?.unsqueeze(2)?.contiguous()?,
            2,
        )?;
        nll -= picked.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?;
        count += w.len() - 1;
    }
    Ok(nll / count as f64)
}

#[test]
fn loss_falls_and_the_checkpoint_loads_and_scores_as_reported() -> Result<()> {
    let dir = scratch("falls");
    let (data, config, out) = (
        write_corpus(&dir, 5),
        write_config(&dir, "tiny.json", 32, 2),
        dir.join("out"),
    );
    let run = args(
        &data,
        &config,
        &out,
        &[
            "--steps",
            "20",
            "--lr",
            "3e-3",
            "--eval-every",
            "5",
            "--heldout-books",
            "1",
        ],
    );
    let outcome = run::train(&run)?;
    eprintln!("tiny model: {:.0} tokens/s", outcome.tokens_per_s);
    assert_eq!((outcome.step, outcome.out.as_path()), (20, out.as_path()));
    assert_eq!(outcome.peak_gpu_bytes, None, "no GPU memory on the CPU");

    let log = rows(&out);
    assert_eq!(log.len(), 21, "an evaluation row, then one row per step");
    let train: Vec<f64> = log.iter().filter_map(|r| r.train_loss).collect();
    let heldout: Vec<f64> = log.iter().filter_map(|r| r.heldout_loss).collect();
    eprintln!("train loss {train:.3?}\nheld-out loss {heldout:.3?}");
    assert!(
        train[19] < train[0] - 1.0,
        "the train loss did not fall: {train:?}"
    );
    assert!(
        heldout[4] < heldout[0] - 0.8,
        "the held-out loss did not fall: {heldout:?}"
    );
    assert_eq!(Some(train[19]), Some(outcome.train_loss));
    assert!(std::fs::read_to_string(out.join(checkpoint::PLOT))?.starts_with("<svg"));

    // The checkpoint is a model directory: the held-out book scored with the loaded model gives
    // the run's last held-out loss.
    let text = std::fs::read_to_string(&data)?;
    let book = text.rsplit(data::EOT).next().unwrap_or_default();
    let loaded = heldout_loss(&out, book, 32)?;
    let reported = outcome.heldout_loss.unwrap_or(f64::NAN);
    assert!(
        (loaded - reported).abs() < 1e-6 * reported,
        "loaded {loaded} vs reported {reported}"
    );
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn max_shard_mib_splits_the_saved_weights_into_shards_that_load() -> Result<()> {
    let dir = scratch("shards");
    let (data, config, out) = (
        write_corpus(&dir, 3),
        write_config(&dir, "small.json", 64, 4),
        dir.join("out"),
    );
    let extra = [
        "--steps",
        "1",
        "--eval-every",
        "0",
        "--heldout-books",
        "1",
        "--max-shard-mib",
        "1",
    ];
    let outcome = run::train(&args(&data, &config, &out, &extra))?;
    let mut shards: Vec<String> = std::fs::read_dir(&out)?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(".safetensors") && n != checkpoint::MOMENTS)
        .collect();
    shards.sort();
    let n = shards.len();
    assert!(
        n >= 2,
        "2 MiB of embedding and the layers in 1 MiB shards: {shards:?}"
    );
    let want: Vec<String> = (1..=n)
        .map(|i| format!("model-{i:05}-of-{n:05}.safetensors"))
        .collect();
    assert_eq!(shards, want);
    assert!(out.join("model.safetensors.index.json").is_file());
    for name in &shards {
        let tensors = candle_core::safetensors::load(out.join(name), &Device::Cpu)?;
        let data: usize = tensors.values().map(|t| t.elem_count() * 4).sum();
        assert!(
            tensors.len() == 1 || data <= 1 << 20,
            "{name}: {} tensors, {data} bytes",
            tensors.len()
        );
    }
    let text = std::fs::read_to_string(&data)?;
    let book = text.rsplit(data::EOT).next().unwrap_or_default();
    let loaded = heldout_loss(&out, book, 32)?;
    let reported = outcome.heldout_loss.unwrap_or(f64::NAN);
    assert!(
        (loaded - reported).abs() < 1e-6 * reported,
        "loaded {loaded} vs reported {reported}"
    );
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn a_resumed_run_ends_bit_for_bit_where_an_uninterrupted_one_does() -> Result<()> {
    let dir = scratch("resume");
    let (data, config) = (
        write_corpus(&dir, 1),
        write_config(&dir, "tiny.json", 32, 2),
    );
    let common = [
        "--steps",
        "20",
        "--lr",
        "3e-3",
        "--grad-accum",
        "2",
        "--eval-every",
        "7",
        "--seed",
        "3",
    ];
    let (split, whole) = (dir.join("split"), dir.join("whole"));

    let first = [&common[..], &["--stop-after", "10", "--save-every", "4"]].concat();
    assert_eq!(run::train(&args(&data, &config, &split, &first))?.step, 10);
    assert_eq!(checkpoint::read_state(&split)?.step, 10);
    assert_eq!(run::train(&resume(&split, &[]))?.step, 20);
    assert_eq!(run::train(&args(&data, &config, &whole, &common))?.step, 20);

    for file in ["model.safetensors", checkpoint::MOMENTS] {
        assert!(
            bits(&split.join(file)) == bits(&whole.join(file)),
            "{file} differs"
        );
    }
    let (a, b) = (
        checkpoint::read_state(&split)?,
        checkpoint::read_state(&whole)?,
    );
    assert_eq!((a.step, a.tokens, a.sampler), (b.step, b.tokens, b.sampler));
    // The logs agree but for the timings and the evaluation where the first part stopped.
    let (a, b) = (rows(&split), rows(&whole));
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(
            (x.step, x.tokens, x.lr, x.train_loss, x.grad_norm),
            (y.step, y.tokens, y.lr, y.train_loss, y.grad_norm)
        );
        if y.heldout_loss.is_some() {
            assert_eq!(
                (x.heldout_loss, x.heldout_ppl),
                (y.heldout_loss, y.heldout_ppl),
                "step {}",
                x.step
            );
        }
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn bad_input_is_an_error_naming_it_before_anything_is_written() -> Result<()> {
    let dir = scratch("bad");
    let (data, config, out) = (
        write_corpus(&dir, 1),
        write_config(&dir, "tiny.json", 32, 2),
        dir.join("out"),
    );
    let (empty, short) = (dir.join("empty.txt"), dir.join("short.txt"));
    std::fs::write(&empty, "")?;
    std::fs::write(&short, "Only a few words here.")?;
    let in_a_file = data.join("out");
    let cases: Vec<(cli::Args, &str)> = vec![
        (
            args(&dir.join("missing.txt"), &config, &out, &[]),
            "missing.txt: cannot read it",
        ),
        (args(&empty, &config, &out, &[]), "empty.txt is empty"),
        (
            args(&short, &config, &out, &[]),
            "shorter than one training sequence (--seq-len 32",
        ),
        (args(&data, &config, &in_a_file, &[]), "cannot be created"),
        (
            args(&data, &config, &data, &[]),
            "is a file, not a directory",
        ),
        (
            args(&data, &config, &dir, &["--overwrite"]),
            "not a checkpoint of the train example",
        ),
        (
            args(&data, &config, &out, &["--batch-size", "0"]),
            "--batch-size must be at least 1",
        ),
        (
            args(&data, &config, &out, &["--seq-len", "1"]),
            "--seq-len must be at least 2",
        ),
        (
            args(&data, &config, &out, &["--grad-accum", "0"]),
            "--grad-accum must be at least 1",
        ),
        (
            args(&data, &config, &out, &["--steps", "0"]),
            "--steps must be at least 1",
        ),
        (
            args(&data, &config, &out, &["--lr", "0"]),
            "--lr must be a finite number > 0, got 0",
        ),
        (
            args(&data, &config, &out, &["--lr", "-0.001"]),
            "--lr must be a finite number > 0",
        ),
        (
            args(&data, &config, &out, &["--lr", "NaN"]),
            "--lr must be a finite number > 0, got NaN",
        ),
        (
            args(&data, &config, &out, &["--lr", "inf"]),
            "--lr must be a finite number > 0, got inf",
        ),
        (
            args(&data, &config, &out, &["--steps", "5", "--warmup", "6"]),
            "--warmup 6 is longer",
        ),
        (
            args(&data, &config, &out, &["--clip", "-1"]),
            "--clip must be",
        ),
        (
            args(&data, &config, &out, &["--weight-decay", "inf"]),
            "--weight-decay must be",
        ),
        (
            args(&data, &config, &out, &["--final-lr-frac", "1.5"]),
            "--final-lr-frac must be",
        ),
        (
            args(&data, &config, &out, &["--heldout-fraction", "1"]),
            "--heldout-fraction must be",
        ),
        (
            args(&data, &config, &out, &["--heldout-books", "2"]),
            "leaves none to train on",
        ),
        (
            args(&data, &config, &out, &["--dtype", "f16"]),
            "--dtype must be f32 or bf16",
        ),
        (
            args(&data, &config, &out, &["--device", "tpu"]),
            "--device must be",
        ),
        (
            args(&data, &config, &out, &["--cooldown-frac", "0.5"]),
            "--cooldown-frac applies to --schedule wsd only",
        ),
        (
            args(
                &data,
                &config,
                &out,
                &["--schedule", "wsd", "--cooldown-frac", "1.5"],
            ),
            "--cooldown-frac must be in [0, 1], got 1.5",
        ),
        (
            args(&data, &config, &out, &["--minutes", "0"]),
            "--minutes must be a finite number > 0, got 0",
        ),
        (
            args(&data, &config, &out, &["--minutes", "NaN"]),
            "--minutes must be a finite number > 0, got NaN",
        ),
        (
            args(
                &data,
                &config,
                &out,
                &["--minutes", "1", "--reserve-s", "-1"],
            ),
            "--reserve-s must be a finite number >= 0, got -1",
        ),
        (
            args(
                &data,
                &config,
                &out,
                &["--minutes", "0.5", "--reserve-s", "30"],
            ),
            "--minutes 0.5 leaves no training time",
        ),
    ];
    for (bad, expected) in cases {
        let err = format!("{:#}", run::train(&bad).expect_err(expected));
        assert!(err.contains(expected), "expected {expected:?} in: {err}");
    }
    assert!(
        !out.join("model.safetensors").exists(),
        "an error left a checkpoint behind"
    );
    let no_budget = [
        "train",
        "--config",
        "c",
        "--data",
        "d",
        "--out",
        "o",
        "--reserve-s",
        "5",
    ];
    let err = cli::Args::try_parse_from(no_budget).expect_err("--reserve-s without --minutes");
    assert!(err.to_string().contains("--minutes"), "{err}");
    let bad_schedule = [
        "train",
        "--config",
        "c",
        "--data",
        "d",
        "--out",
        "o",
        "--schedule",
        "step",
    ];
    let err = cli::Args::try_parse_from(bad_schedule).expect_err("--schedule step");
    assert!(
        err.to_string().contains("cosine") && err.to_string().contains("wsd"),
        "{err}"
    );

    // A checkpoint, then what cannot continue it.
    run::train(&args(&data, &config, &out, &["--steps", "3"]))?;
    let other_config = write_config(&dir, "other.json", 64, 4);
    let other = dir.join("other");
    run::train(&args(&data, &other_config, &other, &["--steps", "1"]))?;
    let corpus_b = write_corpus(&scratch("bad-b"), 2);
    let cases: Vec<(cli::Args, &str)> = vec![
        (
            args(&data, &config, &out, &["--steps", "3"]),
            "already holds a checkpoint",
        ),
        (resume(&out, &[]), "already at step 3"),
        (
            resume(
                &out,
                &[
                    "--steps",
                    "6",
                    "--config",
                    &other_config.display().to_string(),
                ],
            ),
            "hidden_size 32 in the checkpoint, 64 in --config",
        ),
        (
            resume(&out, &["--steps", "6", "--lr", "0.5"]),
            "--lr 0.5 differs from the checkpoint's",
        ),
        (
            resume(&out, &["--steps", "6", "--seq-len", "16"]),
            "--seq-len 16 differs",
        ),
        (
            resume(
                &out,
                &["--steps", "6", "--data", &corpus_b.display().to_string()],
            ),
            "needs the same text",
        ),
        (
            resume(
                Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/weights")),
                &[],
            ),
            "is not a checkpoint of the train example",
        ),
        (resume(&dir.join("nowhere"), &[]), "does not exist"),
    ];
    for (bad, expected) in cases {
        let err = format!("{:#}", run::train(&bad).expect_err(expected));
        assert!(err.contains(expected), "expected {expected:?} in: {err}");
    }
    // Moments of another model beside these weights.
    std::fs::copy(
        other.join(checkpoint::MOMENTS),
        out.join(checkpoint::MOMENTS),
    )?;
    let err = format!(
        "{:#}",
        run::train(&resume(&out, &["--steps", "6"])).expect_err("moments")
    );
    assert!(err.contains("belongs to another model"), "{err}");
    assert_eq!(
        checkpoint::read_state(&out)?.step,
        3,
        "a refused resume changed the checkpoint"
    );
    std::fs::remove_dir_all(&dir)?;
    std::fs::remove_dir_all(corpus_b.parent().unwrap_or(&dir))?;
    Ok(())
}

/// The step named at the start of a run's error ("step N: ...").
fn failed_step(err: &str) -> usize {
    err.strip_prefix("step ")
        .and_then(|rest| rest.split(':').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("the error does not start with the step: {err}"))
}

/// Whether every weight of the checkpoint in `dir` is finite.
fn finite_weights(dir: &Path) -> bool {
    bits(&dir.join("model.safetensors"))
        .values()
        .all(|v| v.iter().all(|b| f32::from_bits(*b).is_finite()))
}

#[test]
fn a_non_finite_loss_stops_at_its_step_and_keeps_the_last_checkpoint() -> Result<()> {
    let dir = scratch("nan");
    let (data, config, out) = (
        write_corpus(&dir, 1),
        write_config(&dir, "tiny.json", 32, 2),
        dir.join("out"),
    );
    run::train(&args(&data, &config, &out, &["--steps", "3"]))?;
    let before = std::fs::read(out.join("model.safetensors"))?;

    // A diverging run over that checkpoint fails before its first save: the checkpoint stays.
    let diverging = ["--steps", "10", "--lr", "1e30", "--overwrite"];
    let err = format!(
        "{:#}",
        run::train(&args(&data, &config, &out, &diverging)).expect_err("lr 1e30")
    );
    eprintln!("{err}");
    assert!(
        failed_step(&err) >= 2,
        "the first step from fresh weights is finite: {err}"
    );
    assert!(
        err.contains("without saving") && err.contains("as it was"),
        "{err}"
    );
    assert_eq!(std::fs::read(out.join("model.safetensors"))?, before);
    assert_eq!(checkpoint::read_state(&out)?.step, 3);
    let model = Model::load(&out, DType::F32, &Device::Cpu)?;
    let logits = model.forward(
        &Tensor::new(&[[5u32, 17, 260]], &Device::Cpu)?,
        &mut model.new_cache(1)?,
    )?;
    assert!(logits.sum_all()?.to_scalar::<f32>()?.is_finite());

    // Saving every step: the checkpoint of the step before the failure, finite and loadable.
    let every = dir.join("every");
    let err = format!(
        "{:#}",
        run::train(&args(
            &data,
            &config,
            &every,
            &["--steps", "10", "--lr", "1e30", "--save-every", "1"]
        ))
        .expect_err("lr 1e30")
    );
    let step = failed_step(&err);
    assert!(
        err.contains(&format!("keeps the checkpoint of step {}", step - 1)),
        "{err}"
    );
    assert_eq!(checkpoint::read_state(&every)?.step, step - 1);
    Model::load(&every, DType::F32, &Device::Cpu)?;
    assert!(finite_weights(&every), "non-finite weights were saved");
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn adamw_matches_candle_nn_bit_for_bit() -> Result<()> {
    let dev = Device::Cpu;
    let make = |seed: f64| -> Result<Var> {
        let t = Tensor::arange(0f32, 24f32, &dev)?.reshape((4, 6))?;
        Ok(Var::from_tensor(&((t * seed)?.sin()? * 0.5)?)?)
    };
    let (ours_w, theirs_w) = (make(1.3)?, make(1.3)?);
    let params = ParamsAdamW {
        lr: 0.01,
        beta1: adamw::BETA1,
        beta2: adamw::BETA2,
        eps: adamw::EPS,
        weight_decay: 0.1,
    };
    let mut ours = adamw::AdamW::new(
        vec![("w".into(), ours_w.clone())],
        params.clone(),
        |_, _| true,
    )?;
    let mut theirs = candle_nn::AdamW::new(vec![theirs_w.clone()], params)?;
    for step in 0..5 {
        let c = Tensor::arange(0f32, 24f32, &dev)?
            .reshape((4, 6))?
            .affine(0.7, step as f64)?
            .cos()?;
        let loss = |w: &Var| w.as_tensor().mul(&c)?.sqr()?.sum_all();
        let g_ours = loss(&ours_w)?.backward()?;
        let g = g_ours.get(ours_w.as_tensor()).cloned().expect("a gradient");
        ours.clip_and_step(vec![g], 0.0)?;
        theirs.step(&loss(&theirs_w)?.backward()?)?;
        let (a, b) = (
            ours_w.flatten_all()?.to_vec1::<f32>()?,
            theirs_w.flatten_all()?.to_vec1::<f32>()?,
        );
        assert!(
            a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "step {step}: {a:?} vs {b:?}"
        );
    }
    Ok(())
}

#[test]
fn schedule_warms_up_then_decays_to_the_floor_and_clipping_bounds_the_norm() -> Result<()> {
    let mut s = cli::settings(
        &cli::Args::try_parse_from(["train", "--config", "c", "--data", "d", "--out", "o"])?,
        None,
    )?;
    (s.steps, s.warmup, s.lr, s.final_lr_frac) = (100, 10, 1e-3, 0.1);
    assert!((schedule::lr_at(&s, 0) - 1e-4).abs() < 1e-15);
    assert!((schedule::lr_at(&s, 9) - 1e-3).abs() < 1e-15);
    assert!((schedule::lr_at(&s, 10) - 1e-3).abs() < 1e-15);
    assert!(
        (schedule::lr_at(&s, 99) - 1e-4).abs() < 1e-15,
        "the last step is at the floor"
    );
    let mid = schedule::lr_at(&s, 10 + 89 / 2);
    assert!(mid > 5e-4 && mid < 6e-4, "halfway down the cosine: {mid}");

    let g = vec![
        Tensor::new(&[3f32, 0.0], &Device::Cpu)?,
        Tensor::new(&[4f32], &Device::Cpu)?,
    ];
    let (norm, clipped) = adamw::clip_global_norm(g.clone(), 1.0)?;
    assert!((norm - 5.0).abs() < 1e-9);
    let (after, _) = adamw::clip_global_norm(clipped, 0.0)?;
    assert!((after - 1.0).abs() < 1e-5, "clipped to norm {after}");
    let (_, kept) = adamw::clip_global_norm(g, 10.0)?;
    assert_eq!(
        kept[1].to_vec1::<f32>()?,
        [4.0],
        "a norm below the bound is left alone"
    );
    Ok(())
}

#[test]
fn wsd_holds_the_rate_then_decays_linearly_to_the_floor_at_the_last_step() -> Result<()> {
    let mut s = cli::settings(
        &cli::Args::try_parse_from([
            "train",
            "--config",
            "c",
            "--data",
            "d",
            "--out",
            "o",
            "--schedule",
            "wsd",
        ])?,
        None,
    )?;
    (s.steps, s.warmup, s.lr, s.final_lr_frac) = (100, 10, 1e-3, 0.1);
    assert_eq!(s.cooldown_frac, 0.3, "the default of tools/train.py");
    assert!((schedule::lr_at(&s, 0) - 1e-4).abs() < 1e-15);
    assert_eq!(schedule::cooldown_start(&s), 70);
    for step in [10, 40, 69] {
        assert_eq!(schedule::lr_at(&s, step), 1e-3, "stable at step {step}");
    }
    let rates: Vec<f64> = (70..100).map(|t| schedule::lr_at(&s, t)).collect();
    assert!(rates.windows(2).all(|w| w[1] < w[0]), "{rates:?}");
    let steps: Vec<f64> = rates.windows(2).map(|w| w[0] - w[1]).collect();
    assert!(
        steps.iter().all(|d| (d - steps[0]).abs() < 1e-15),
        "a straight line: {steps:?}"
    );
    assert!(
        (rates[29] - 1e-4).abs() < 1e-15,
        "the last step is at the floor"
    );
    Ok(())
}

#[test]
fn a_budget_plans_the_run_from_the_step_time_and_fixes_a_wsd_plan_in_its_decay() -> Result<()> {
    let mut s = cli::settings(
        &cli::Args::try_parse_from([
            "train",
            "--config",
            "c",
            "--data",
            "d",
            "--out",
            "o",
            "--schedule",
            "wsd",
            "--minutes",
            "1",
            "--reserve-s",
            "0",
        ])?,
        None,
    )?;
    assert_eq!(
        (s.steps, s.warmup),
        (usize::MAX, 100),
        "no plan before timing"
    );
    let start = std::time::Instant::now();
    let mut budget = schedule::Budget::new(start, 1.0, 0.0, s.steps, true);
    let at = |secs: u64| start + std::time::Duration::from_secs(secs);
    // One second per step: timed from the 3rd, planned at step 10 with 50 s left.
    let mut plans = Vec::new();
    for done in 1..=59 {
        if let Some(plan) = budget.after_step(&mut s, done, at(done as u64)) {
            plans.push((done, s.steps, plan));
        }
        assert!(!budget.expired(at(done as u64)));
    }
    assert!(budget.expired(at(60)));
    eprintln!("{plans:#?}");
    assert_eq!((plans[0].0, plans[0].1), (10, 59), "10 + 98 % of 50 steps");
    assert_eq!(s.warmup, 5, "the first plan caps the warm-up at a tenth");
    assert!(plans[0].2.contains("1000.0 ms per step"), "{}", plans[0].2);
    // The decay starts at 70 % of 59 = step 41: the plan of step 50 is the last one.
    let last = plans.last().map(|p| p.0);
    assert_eq!(last, Some(50), "{plans:?}");
    assert!(plans.iter().all(|p| p.1 == 59), "{plans:?}");
    Ok(())
}

#[test]
fn a_timed_run_stops_on_time_with_a_complete_checkpoint() -> Result<()> {
    let dir = scratch("timed");
    let (data, config, out) = (
        write_corpus(&dir, 5),
        write_config(&dir, "tiny.json", 32, 2),
        dir.join("out"),
    );
    let started = std::time::Instant::now();
    let timed = [
        "--minutes",
        "0.05",
        "--reserve-s",
        "0",
        "--schedule",
        "wsd",
        "--eval-every",
        "0",
        "--save-every",
        "0",
        "--heldout-books",
        "1",
    ];
    let outcome = run::train(&args(&data, &config, &out, &timed))?;
    let took = started.elapsed().as_secs_f64();
    let state = checkpoint::read_state(&out)?;
    eprintln!("{} steps in {took:.1} s", outcome.step);
    assert!(
        outcome.step >= 1 && took < 30.0,
        "{} steps in {took} s",
        outcome.step
    );
    assert_eq!(
        (state.step, state.settings.steps),
        (outcome.step, outcome.step),
        "a timed run's checkpoint records its steps as the run's length"
    );
    assert_eq!(rows(&out).len(), outcome.step + 1);
    let err = format!(
        "{:#}",
        run::train(&resume(&out, &[])).expect_err("complete")
    );
    assert!(err.contains("already at step"), "{err}");
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

/// The fused AdamW of CUDA against the CPU's: the same bits when clipping leaves the gradients
/// alone, the same numbers to rounding when it scales them; a non-finite norm skips the update
/// and an overflowing one is flagged. Weights of 1 to 20,000 elements cross the kernels' chunks.
#[cfg(feature = "cuda")]
#[test]
fn the_fused_cuda_adamw_matches_the_cpu_update() -> Result<()> {
    let cuda = Device::new_cuda(0)?;
    let sizes = [1usize, 300, 8191, 8192, 8193, 20_000];
    let values = |n: usize, seed: f64| -> Result<Tensor> {
        Ok((Tensor::arange(0f32, n as f32, &Device::Cpu)?
            .affine(0.37, seed)?
            .sin()?
            * 0.5)?)
    };
    let params = ParamsAdamW {
        lr: 0.01,
        beta1: adamw::BETA1,
        beta2: adamw::BETA2,
        eps: adamw::EPS,
        weight_decay: 0.1,
    };
    let optimizer = |dev: &Device| -> Result<(adamw::AdamW, Vec<Var>)> {
        let vars = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| Ok(Var::from_tensor(&values(n, i as f64)?.to_device(dev)?)?))
            .collect::<Result<Vec<_>>>()?;
        let named = vars
            .iter()
            .enumerate()
            .map(|(i, v)| (format!("w{i}"), v.clone()))
            .collect();
        let opt = adamw::AdamW::new(named, params.clone(), |name, _| name != "w0")?;
        Ok((opt, vars))
    };
    let weights = |vars: &[Var]| -> Result<Vec<Vec<f32>>> {
        vars.iter()
            .map(|v| Ok(v.as_tensor().to_device(&Device::Cpu)?.to_vec1::<f32>()?))
            .collect()
    };
    for clip in [0.0, 1e-2, 1e4] {
        let (mut cpu, cpu_vars) = optimizer(&Device::Cpu)?;
        let (mut gpu, gpu_vars) = optimizer(&cuda)?;
        for step in 0..3 {
            let grads = sizes
                .iter()
                .map(|&n| values(n, 10.0 + step as f64))
                .collect::<Result<Vec<_>>>()?;
            let on_gpu = grads
                .iter()
                .map(|g| Ok(g.to_device(&cuda)?))
                .collect::<Result<Vec<_>>>()?;
            let zero = |dev: &Device| Tensor::new(&[0f32], dev);
            let a = cpu.clip_and_step(grads, clip)?.read(&zero(&Device::Cpu)?)?;
            let b = gpu.clip_and_step(on_gpu, clip)?.read(&zero(&cuda)?)?;
            assert!(
                b.finite && (a.norm - b.norm).abs() < 1e-5 * a.norm,
                "{} vs {}",
                a.norm,
                b.norm
            );
            let (x, y) = (weights(&cpu_vars)?, weights(&gpu_vars)?);
            let scaled = clip > 0.0 && a.norm > clip;
            for (i, (x, y)) in x.iter().zip(&y).enumerate() {
                if scaled {
                    let worst = x
                        .iter()
                        .zip(y)
                        .map(|(p, q)| (p - q).abs())
                        .fold(0f32, f32::max);
                    assert!(
                        worst <= 1e-6,
                        "clip {clip}, step {step}, weight {i}: off by {worst}"
                    );
                } else {
                    assert!(
                        x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()),
                        "clip {clip}, step {step}, weight {i}: the bits differ"
                    );
                }
            }
        }
    }
    // A NaN gradient: no update. A rate beyond f32's range: infinite weights, flagged.
    let (mut gpu, gpu_vars) = optimizer(&cuda)?;
    let before = weights(&gpu_vars)?;
    let mut grads = sizes
        .iter()
        .map(|&n| Ok(values(n, 3.0)?.to_device(&cuda)?))
        .collect::<Result<Vec<_>>>()?;
    grads[2] = (grads[2].clone() * f64::NAN)?;
    let read = gpu
        .clip_and_step(grads, 1.0)?
        .read(&Tensor::new(&[0f32], &cuda)?)?;
    assert!(read.norm.is_nan() && read.finite);
    assert_eq!(
        weights(&gpu_vars)?,
        before,
        "a NaN norm updated the weights"
    );
    gpu.set_lr(1e39);
    let grads = sizes
        .iter()
        .map(|&n| Ok(values(n, 4.0)?.to_device(&cuda)?))
        .collect::<Result<Vec<_>>>()?;
    let read = gpu
        .clip_and_step(grads, 0.0)?
        .read(&Tensor::new(&[0f32], &cuda)?)?;
    assert!(
        read.norm.is_finite() && !read.finite,
        "the overflow was not flagged"
    );
    Ok(())
}
