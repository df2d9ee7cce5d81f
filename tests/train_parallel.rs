//! The data parallelism of the train example (`--gpus N`) on the CPU: the sharding of a batch
//! over the ranks, the gradient buckets and their exact flatten/unflatten, the flags' errors;
//! and whole runs of two ranks on CPU threads, whose collective is a host-side sum standing in
//! for NCCL (this test's [`Host`]; the example itself only ever uses NCCL's): they train as one
//! rank does, and a checkpoint written with one number of ranks continues with another.
//!
//! `cargo test --release --test train_parallel`

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

use std::path::Path;
use std::sync::{Arc, Barrier, Mutex};

use anyhow::{anyhow, Result};
use candle_core::{DType, Device, Shape, Tensor};
use clap::Parser;

use common::{args, resume, rows, scratch, write_config, write_corpus};
use parallel::Collective;

/// The sum over ranks on CPU threads: each rank leaves its values in its slot, and after a
/// barrier every rank adds the slots up in rank order (in f64, rounded once to the input's
/// dtype: for two f32 ranks, NCCL's f32 sum).
struct Host {
    rank: usize,
    world: usize,
    shared: Arc<(Barrier, Mutex<Vec<Vec<f64>>>)>,
}

impl Collective for Host {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn sum(&self, t: &Tensor) -> Result<Tensor> {
        let (barrier, slots) = &*self.shared;
        let mine = t.to_dtype(DType::F64)?.to_vec1::<f64>()?;
        let n = mine.len();
        slots.lock().map_err(|_| anyhow!("poisoned"))?[self.rank] = mine;
        barrier.wait();
        let total: Vec<f64> = {
            let slots = slots.lock().map_err(|_| anyhow!("poisoned"))?;
            (0..n).map(|i| slots.iter().map(|s| s[i]).sum()).collect()
        };
        // Nobody writes the next round's values before everyone has read this round's.
        barrier.wait();
        Ok(Tensor::from_vec(total, n, t.device())?.to_dtype(t.dtype())?)
    }
}

/// Makes the [`Host`] collectives of `world` ranks.
fn host(world: usize) -> run::Connect {
    let shared = Arc::new((Barrier::new(world), Mutex::new(vec![Vec::new(); world])));
    Arc::new(move |rank, _| {
        Ok(Box::new(Host {
            rank,
            world,
            shared: shared.clone(),
        }) as Box<dyn Collective>)
    })
}

/// Trains `a` with `world` ranks on CPU threads (1: no collective, as `--gpus 1`).
fn train_ranks(a: &cli::Args, world: usize) -> Result<run::Outcome> {
    let plan = run::Plan::new(a)?;
    let connect = (world > 1).then(|| host(world));
    run::train_on(plan, vec![Device::Cpu; world], connect)
}

#[test]
fn a_batch_splits_into_each_ranks_contiguous_rows() -> Result<()> {
    let (rows, len) = (4, 3);
    let ids: Vec<u32> = (0..(rows * len) as u32).collect();
    for world in [1, 2, 4] {
        let parts = (0..world)
            .map(|r| data::shard(&ids, rows, len, r, world))
            .collect::<Result<Vec<_>>>()?;
        assert_eq!(
            parts.concat(),
            ids,
            "world {world}: the parts are the batch"
        );
        assert!(parts.iter().all(|p| p.len() == rows / world * len));
    }
    assert_eq!(data::shard(&ids, rows, len, 1, 2)?, &ids[6..]);
    for (rank, world) in [(0, 3), (2, 2), (0, 0)] {
        let err = data::shard(&ids, rows, len, rank, world).expect_err("no equal split");
        assert!(err.to_string().contains("cannot split"), "{err}");
    }
    Ok(())
}

#[test]
fn buckets_cover_the_weights_in_order_within_the_cap() {
    assert_eq!(
        parallel::buckets(&[3, 4, 5, 100, 1, 1], 8),
        [0..2, 2..3, 3..4, 4..6]
    );
    assert!(parallel::buckets(&[], 8).is_empty());
    assert_eq!(
        parallel::buckets(&[9, 1], 8),
        [0..1, 1..2],
        "a large weight alone"
    );
    let mut state = 1u64;
    for cap in [1, 7, 64, 1000] {
        let sizes: Vec<usize> = (0..40)
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
                (state >> 40) as usize % 300 + 1
            })
            .collect();
        let buckets = parallel::buckets(&sizes, cap);
        let mut next = 0;
        for b in &buckets {
            assert_eq!(b.start, next, "contiguous and in order");
            assert!(b.end > b.start, "not empty");
            let total: usize = sizes[b.clone()].iter().sum();
            assert!(
                total <= cap || b.len() == 1,
                "cap {cap}: {b:?} holds {total}"
            );
            next = b.end;
        }
        assert_eq!(next, sizes.len(), "every weight in a bucket");
        for pair in buckets.windows(2) {
            let with_next: usize = sizes[pair[0].start..=pair[1].start].iter().sum();
            assert!(
                with_next > cap,
                "cap {cap}: {pair:?} could have been one bucket"
            );
        }
    }
}

#[test]
fn flatten_and_unflatten_round_trip_bit_for_bit() -> Result<()> {
    let dev = Device::Cpu;
    let shapes: Vec<Shape> = vec![(2, 3).into(), 5.into(), (1, 1, 4).into(), ().into()];
    let tensors = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let n = s.elem_count();
            let t = Tensor::arange(0f32, n as f32, &dev)?.affine(1.37, i as f64 - 0.5)?;
            Ok(t.sin()?.reshape(s)?)
        })
        .collect::<Result<Vec<_>>>()?;
    let flat = parallel::flatten(&tensors)?;
    assert_eq!(flat.dims(), [6 + 5 + 4 + 1]);
    let back = parallel::unflatten(&flat, &shapes)?;
    for (a, b) in tensors.iter().zip(&back) {
        assert_eq!(a.shape(), b.shape());
        let (a, b) = (
            a.flatten_all()?.to_vec1::<f32>()?,
            b.flatten_all()?.to_vec1::<f32>()?,
        );
        assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
    }
    let err = parallel::unflatten(&flat.narrow(0, 0, 15)?, &shapes).expect_err("short");
    assert!(err.to_string().contains("flat buffer"), "{err}");
    Ok(())
}

/// What a rank of the test below ends with: its averaged gradients and rank 0's numbers.
type Rank = (Vec<Vec<f32>>, Vec<u64>);

#[test]
fn two_ranks_average_their_gradients_in_buckets_and_agree_on_rank_0s_numbers() -> Result<()> {
    let connect = host(2);
    let results: Vec<Result<Rank>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|rank| {
                let connect = connect.clone();
                s.spawn(move || -> Result<Rank> {
                    let c = connect(rank, &Device::Cpu)?;
                    let grads = [3usize, 10, 2, 7]
                        .iter()
                        .map(|&n| {
                            let t = Tensor::arange(0f32, n as f32, &Device::Cpu)?;
                            Ok((t + 10.0 * rank as f64)?)
                        })
                        .collect::<Result<Vec<_>>>()?;
                    let averaged = parallel::average_grads(c.as_ref(), grads, 12)?;
                    let plan = [u64::MAX, 1 << 40, rank as u64 + 7];
                    let from0 = parallel::from_rank0(c.as_ref(), &plan, &Device::Cpu)?;
                    let values = averaged
                        .iter()
                        .map(|g| Ok(g.to_vec1::<f32>()?))
                        .collect::<Result<Vec<_>>>()?;
                    Ok((values, from0))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().map_err(|_| anyhow!("a rank panicked"))?)
            .collect()
    });
    for result in results {
        let (grads, from0) = result?;
        for (g, n) in grads.iter().zip([3usize, 10, 2, 7]) {
            let want: Vec<f32> = (0..n).map(|i| i as f32 + 5.0).collect();
            assert_eq!(g, &want, "the mean of the ranks' i and i + 10");
        }
        assert_eq!(from0, [u64::MAX, 1 << 40, 7], "rank 0's values, exactly");
    }
    Ok(())
}

#[test]
fn parallel_flags_that_cannot_run_are_errors_before_anything_is_written() -> Result<()> {
    let dir = scratch("ranks");
    let (data, config, out) = (
        write_corpus(&dir, 1),
        write_config(&dir, "tiny.json", 32, 2),
        dir.join("out"),
    );
    let mut cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--gpus", "0"], "--gpus must be at least 1, got 0"),
        (vec!["--gpus", "2"], "pass --device cuda"),
        (vec!["--gpus", "2", "--device", "cpu"], "pass --device cuda"),
        (
            vec!["--all-reduce", "nccl"],
            "one rank per CUDA device, not on --device cpu",
        ),
        (
            vec!["--gpus", "2", "--all-reduce", "none"],
            "--gpus 2 needs --all-reduce nccl",
        ),
        (
            vec!["--gpus", "2", "--device", "cuda", "--batch-size", "5"],
            "--batch-size 5 does not split over --gpus 2",
        ),
    ];
    if cfg!(not(feature = "nccl")) {
        cases.push((
            vec!["--gpus", "2", "--device", "cuda"],
            "--features cuda,nccl",
        ));
        cases.push((
            vec!["--all-reduce", "nccl", "--device", "cuda:1"],
            "--features cuda,nccl",
        ));
    }
    for (extra, expected) in cases {
        let err = format!(
            "{:#}",
            run::train(&args(&data, &config, &out, &extra)).expect_err(expected)
        );
        assert!(
            err.contains(expected),
            "{extra:?}: expected {expected:?} in: {err}"
        );
    }
    assert!(!out.exists(), "an error created --out");
    let zero = ["train", "--config", "c", "--data", "d", "--out", "o"];
    let err = cli::Args::try_parse_from([&zero[..], &["--bucket-mib", "0"]].concat())
        .expect_err("--bucket-mib 0");
    assert!(err.to_string().contains("--bucket-mib"), "{err}");
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

/// The train losses of a run's log, step by step.
fn losses(out: &Path) -> Vec<f64> {
    rows(out).iter().filter_map(|r| r.train_loss).collect()
}

/// The largest difference between two loss curves of the same length.
fn worst(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// Two ranks see the sequences one rank sees, so their losses differ by the rounding of a sum
/// in another order only: f32 on a tiny model over 10 steps stays far below this.
const SAME_RUN: f64 = 1e-4;

#[test]
fn two_ranks_train_as_one_and_checkpoints_continue_with_any_number_of_ranks() -> Result<()> {
    let dir = scratch("ranks-run");
    let (data, config) = (
        write_corpus(&dir, 3),
        write_config(&dir, "tiny.json", 32, 2),
    );
    let common = [
        "--steps",
        "10",
        "--lr",
        "3e-3",
        "--grad-accum",
        "2",
        "--eval-every",
        "5",
        "--heldout-books",
        "1",
        "--seed",
        "5",
    ];
    let run = |name: &str, world: usize, extra: &[&str]| -> Result<std::path::PathBuf> {
        let out = dir.join(name);
        let flags = [&common[..], extra].concat();
        let o = train_ranks(&args(&data, &config, &out, &flags), world)?;
        assert_eq!((o.out.as_path(), o.peak_gpu_bytes), (out.as_path(), None));
        assert_eq!(Some(o.train_loss), losses(&out).last().copied());
        assert!(o.heldout_loss.is_some() && o.tokens_per_s > 0.0);
        eprintln!("{name}: {world} rank(s), to step {}", o.step);
        Ok(out)
    };
    let one = run("one", 1, &[])?;
    let two = run("two", 2, &[])?;
    let (a, b) = (losses(&one), losses(&two));
    eprintln!(
        "1 rank {a:.5?}\n2 ranks {b:.5?}\nlargest difference {:e}",
        worst(&a, &b)
    );
    assert!(worst(&a, &b) < SAME_RUN, "2 ranks vs 1: {}", worst(&a, &b));
    assert!(a[9] < a[0] - 0.5, "the loss fell: {a:?}");
    let (s1, s2) = (checkpoint::read_state(&one)?, checkpoint::read_state(&two)?);
    assert_eq!(
        (s1.step, s1.tokens, s1.sampler),
        (s2.step, s2.tokens, s2.sampler),
        "the data position is the same"
    );
    assert_eq!((s1.world_size, s2.world_size), (1, 2));
    let heldout = |out: &Path| rows(out).iter().filter_map(|r| r.heldout_loss).count();
    assert_eq!(heldout(&two), 3, "rank 0 evaluates at steps 0, 5 and 10");

    // Stopped at step 5 with one number of ranks, continued with the other.
    for (name, first, then, whole) in [("1to2", 1, 2, &one), ("2to1", 2, 1, &two)] {
        let out = run(name, first, &["--stop-after", "5"])?;
        assert_eq!(checkpoint::read_state(&out)?.world_size, first);
        train_ranks(&resume(&out, &[]), then)?;
        let state = checkpoint::read_state(&out)?;
        assert_eq!(state.world_size, then);
        assert_eq!(
            (state.step, state.tokens, state.sampler),
            (s1.step, s1.tokens, s1.sampler),
            "{name}: the same data position as an uninterrupted run"
        );
        let c = losses(&out);
        assert_eq!(
            c[..5],
            losses(whole)[..5],
            "{name}: the first part is its run's"
        );
        assert!(worst(&c, &a) < SAME_RUN, "{name}: {}", worst(&c, &a));
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
