//! The NCCL path of the train example on one GPU (world size 1), for a machine with a GPU and
//! NCCL's `libnccl.so.2` on `LD_LIBRARY_PATH` (README, "Training on several GPUs"):
//!
//! - the bucketed all-reduce of a single rank gives the gradients back bit for bit, and rank 0's
//!   numbers and the weights' agreement check go through NCCL;
//! - `--all-reduce nccl` at `--gpus 1` trains the tiny model in bf16 as the run without NCCL
//!   does. At world size 1 the all-reduce sums one rank (a copy) and the buckets are copies, so
//!   the same f32 gradients reach the same optimizer: the losses are the same bits unless the
//!   GPU kernels themselves differ from run to run (atomic additions in a backward), and a
//!   second run without NCCL measures that noise. The bound: equal bits when the repeat is
//!   bit-equal; else within 4× the repeat's largest difference plus 1e-3 nats (bf16 noise
//!   amplified over 20 steps stays below a percent of the loss's fall).
//!
//! `cargo test --release --features cuda,nccl --test train_nccl -- --test-threads 1`
#![cfg(feature = "nccl")]

#[path = "../examples/train/adamw.rs"]
mod adamw;
#[path = "../examples/train/checkpoint.rs"]
mod checkpoint;
#[path = "../examples/train/cli.rs"]
mod cli;
#[path = "train_common/mod.rs"]
mod common;
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

use anyhow::Result;
use candle_core::{Device, Tensor, Var};

use common::{args, rows, scratch, write_config, write_corpus};
use parallel::{nccl, Collective};

#[test]
fn one_rank_bucketed_all_reduce_is_the_identity() -> Result<()> {
    nccl::disable_nvls();
    let device = Device::new_cuda(0)?;
    let comm = nccl::Nccl::connect(nccl::unique_id()?, 0, 1, &device)?;
    assert_eq!((comm.rank(), comm.world()), (0, 1));
    let sizes = [1usize, 300, 8192, 5, 70_000, 3];
    let grads = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let t = Tensor::arange(0f32, n as f32, &Device::Cpu)?.affine(0.37, i as f64)?;
            Ok(t.sin()?.to_device(&device)?)
        })
        .collect::<Result<Vec<_>>>()?;
    // Buckets of 8,192 elements: several weights in one, a larger one alone.
    let reduced = parallel::average_grads(&comm, grads.clone(), 8192)?;
    for (i, (a, b)) in grads.iter().zip(&reduced).enumerate() {
        let (a, b) = (a.to_vec1::<f32>()?, b.to_vec1::<f32>()?);
        assert!(
            a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "gradient {i} changed"
        );
    }
    let values = [u64::MAX, 1 << 40, 12_345];
    assert_eq!(parallel::from_rank0(&comm, &values, &device)?, values);
    let f64s = Tensor::new(&[1.5f64, -2.25, 1e300], &device)?;
    assert_eq!(comm.sum(&f64s)?.to_vec1::<f64>()?, [1.5, -2.25, 1e300]);
    let vars = vec![("w".to_string(), Var::from_tensor(&grads[1])?)];
    parallel::check_weights_agree(&comm, &vars, 1)?;
    Ok(())
}

#[test]
fn nccl_at_world_size_1_trains_as_the_run_without_it() -> Result<()> {
    let dir = scratch("nccl-1gpu");
    let (data, config) = (
        write_corpus(&dir, 5),
        write_config(&dir, "tiny.json", 32, 2),
    );
    let common = [
        "--device",
        "cuda",
        "--dtype",
        "bf16",
        "--steps",
        "20",
        "--batch-size",
        "8",
        "--seq-len",
        "64",
        "--lr",
        "3e-3",
        "--grad-accum",
        "2",
        "--eval-every",
        "10",
        "--heldout-books",
        "1",
        "--seed",
        "11",
    ];
    let run = |name: &str, extra: &[&str]| -> Result<Vec<f64>> {
        let out = dir.join(name);
        let flags = [&common[..], extra].concat();
        let outcome = run::train(&args(&data, &config, &out, &flags))?;
        eprintln!(
            "{name}: step {}, loss {:.4}, held-out {:?}, {:.0} tokens/s, peak GPU bytes {:?}",
            outcome.step,
            outcome.train_loss,
            outcome.heldout_loss,
            outcome.tokens_per_s,
            outcome.peak_gpu_bytes
        );
        assert_eq!(outcome.out, out);
        Ok(rows(&out).iter().filter_map(|r| r.train_loss).collect())
    };
    let plain = run("plain", &[])?;
    let nccl = run("nccl", &["--all-reduce", "nccl", "--bucket-mib", "1"])?;
    let again = run("again", &[])?;
    let worst = |a: &[f64], b: &[f64]| {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f64, f64::max)
    };
    let (diff, noise) = (worst(&plain, &nccl), worst(&plain, &again));
    eprintln!("losses without NCCL {plain:.5?}\nwith NCCL {nccl:.5?}");
    eprintln!("largest difference: NCCL {diff:e}, repeat without NCCL {noise:e}");
    assert_eq!((plain.len(), nccl.len()), (20, 20));
    assert!(plain[19] < plain[0] - 0.5, "the loss fell: {plain:?}");
    if noise == 0.0 {
        assert_eq!(plain, nccl, "deterministic kernels: the same bits");
    } else {
        assert!(diff <= 4.0 * noise + 1e-3, "NCCL {diff} vs noise {noise}");
    }
    let (a, b) = (
        checkpoint::read_state(&dir.join("plain"))?,
        checkpoint::read_state(&dir.join("nccl"))?,
    );
    assert_eq!((a.sampler, a.tokens), (b.sampler, b.tokens));

    // More GPUs than the driver has is an error before anything is written.
    let count = nccl::device_count()?;
    let more = (count + 1).to_string();
    let out = dir.join("more");
    let flags = ["--device", "cuda", "--gpus", &more, "--batch-size", &more];
    let err = format!(
        "{:#}",
        run::train(&args(&data, &config, &out, &flags)).expect_err("too many GPUs")
    );
    assert!(err.contains(&format!("the driver sees {count}")), "{err}");
    assert!(!out.exists());
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
