//! Sequences packed along L on CUDA (run on a GPU machine: `cargo test --release --features cuda
//! --test packed_cuda`): `causal_conv1d_split_packed` gives each sequence what it gets alone bit
//! for bit, `ssd_packed` (one pipeline for all sequences) within f32 1e-5 and bf16 1e-2 of the
//! largest value, both the CPU's gradients (f32 within 1e-4 of each gradient's largest value, bf16
//! within 2e-2); `Model::prefill_packed` gives each prompt its own logits and states (f32 within
//! 1e-5 of the largest value, bf16 within 2e-2); NaN-poisoned outputs.
#![cfg(feature = "cuda")]

mod common;

use candle_core::{DType, Device, Result, Tensor, Var};
use common::fixture::{case_names, root};
use common::{rel_err, Rng};
use mamba2::kernels::{
    self as k, causal_conv1d_split, causal_conv1d_split_packed, ssd, ssd_packed, ConvOptions,
    SsdOptions,
};
use mamba2::model::Model;

fn gpu() -> Result<Device> {
    k::set_poison(true);
    Device::new_cuda(0)
}

fn offsets(lens: &[usize]) -> Vec<usize> {
    let mut cu = vec![0];
    for l in lens {
        cu.push(cu[cu.len() - 1] + l);
    }
    cu
}

fn same(a: &Tensor, b: &Tensor) -> Result<bool> {
    let f = |t: &Tensor| -> Result<Vec<f32>> { t.flatten_all()?.to_dtype(DType::F32)?.to_vec1() };
    Ok(f(a)? == f(b)?)
}

#[test]
fn packed_conv_gives_each_sequence_what_it_gets_alone() -> Result<()> {
    let dev = gpu()?;
    let lens = [1, 77, 3, 256, 130];
    let cu = offsets(&lens);
    let total = cu[lens.len()];
    for dtype in [DType::F32, DType::BF16] {
        let mut rng = Rng::new(1);
        let xbc = rng.tensor(&[1, total, 96], 1.0, &dev)?.to_dtype(dtype)?;
        let w = rng.tensor(&[96, 4], 1.0, &dev)?.to_dtype(dtype)?;
        let opts = ConvOptions {
            bias: None,
            silu: true,
        };
        let (ys, states) = causal_conv1d_split_packed(&xbc, &w, None, &opts, &[64, 16, 16], &cu)?;
        for (i, win) in cu.windows(2).enumerate() {
            let (start, len) = (win[0], win[1] - win[0]);
            let (y1, s1) =
                causal_conv1d_split(&xbc.narrow(1, start, len)?, &w, None, &opts, &[64, 16, 16])?;
            for (j, (y, y1)) in ys.iter().zip(&y1).enumerate() {
                assert!(
                    same(&y.narrow(1, start, len)?, y1)?,
                    "{dtype:?} conv sequence {i} piece {j}"
                );
            }
            assert!(
                same(&states.narrow(0, i, 1)?, &s1)?,
                "{dtype:?} conv sequence {i}: state"
            );
        }
    }
    Ok(())
}

/// Many sequences of any lengths run as one pipeline, in chunks counted from each sequence's
/// start, the state pass restarting at every sequence (bf16 on the tensor-core kernels, f32 on
/// the SIMT one): each sequence's y and final state as it gets them alone, within f32 1e-5 and
/// bf16 1e-2 of the largest value.
#[test]
fn packed_ssd_is_one_pipeline_with_each_sequences_result() -> Result<()> {
    let dev = gpu()?;
    let mut rng = Rng::new(7);
    // One-token sequences, exact chunks, chunks and a bit, several chunks.
    let mut lens = vec![1, 128, 129, 1, 384, 77, 256, 2];
    for _ in 0..40 {
        lens.push(1 + (rng.next_u64() % 600) as usize);
    }
    let cu = offsets(&lens);
    let total = cu[lens.len()];
    let (h, p, g, n) = (8, 64, 1, 128);
    for dtype in [DType::F32, DType::BF16] {
        let mut t =
            |shape: &[usize]| -> Result<Tensor> { rng.tensor(shape, 1.0, &dev)?.to_dtype(dtype) };
        let (x, b, c) = (
            t(&[1, total, h, p])?,
            t(&[1, total, g, n])?,
            t(&[1, total, g, n])?,
        );
        let dt = rng.tensor(&[1, total, h], 1.0, &dev)?.to_dtype(dtype)?;
        let a = (rng.tensor(&[h], 1.0, &dev)?.abs()? * -1.0)?;
        let init = rng.tensor(&[lens.len(), h, p, n], 1.0, &dev)?;
        let bound = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
        for with_init in [false, true] {
            let opts = SsdOptions {
                chunk_size: 128,
                initial_state: with_init.then_some(&init),
                ..Default::default()
            };
            let (y, states) = ssd_packed(&x, &dt, &a, &b, &c, &cu, &opts)?;
            for (i, w) in cu.windows(2).enumerate() {
                let piece = |v: &Tensor| v.narrow(1, w[0], w[1] - w[0]);
                let one_init = init.narrow(0, i, 1)?;
                let one = SsdOptions {
                    initial_state: with_init.then_some(&one_init),
                    ..opts
                };
                let (y1, s1) = ssd(
                    &piece(&x)?,
                    &piece(&dt)?,
                    &a,
                    &piece(&b)?,
                    &piece(&c)?,
                    &one,
                )?;
                let ey = rel_err(&piece(&y)?, &y1.to_dtype(DType::F64)?)?;
                let es = rel_err(&states.narrow(0, i, 1)?, &s1.to_dtype(DType::F64)?)?;
                assert!(
                    ey <= bound && es <= bound,
                    "{dtype:?} init {with_init} sequence {i}: y {ey:e}, state {es:e}"
                );
            }
        }
    }
    Ok(())
}

/// The gradients of every input of a loss on `ssd_packed`'s y and final states and on
/// `causal_conv1d_split_packed`'s outputs, on CUDA against the CPU's (the CPU on the same values,
/// rounded to the dtype, in f32): boundaries mid-chunk and a sequence of one token.
#[test]
fn packed_gradients_match_the_cpu() -> Result<()> {
    let dev = gpu()?;
    let lens = [1, 77, 3, 256, 130];
    let cu = offsets(&lens);
    let (total, seqs) = (cu[lens.len()], lens.len());
    let (h, p, g, n, width, split) = (8, 64, 1, 128, 96, [64, 16, 16]);
    for (dtype, tol) in [(DType::F32, 1e-4), (DType::BF16, 2e-2)] {
        let mut rng = Rng::new(11);
        let cpu = Device::Cpu;
        let mut t = |shape: &[usize], scale: f32| -> Result<Tensor> {
            rng.tensor(shape, scale, &cpu)?
                .to_dtype(dtype)?
                .to_dtype(DType::F32)
        };
        let values = [
            t(&[1, total, h, p], 1.0)?,
            t(&[1, total, h], 1.0)?,
            t(&[1, total, g, n], 1.0)?,
            t(&[1, total, g, n], 1.0)?,
            t(&[1, total, width], 1.0)?,
            t(&[width, 4], 0.5)?,
        ];
        let params = [t(&[h], 0.5)?, t(&[h], 1.0)?, t(&[seqs, h, p, n], 1.0)?];
        let weights = [
            t(&[1, total, h, p], 1.0)?,
            t(&[seqs, h, p, n], 1.0)?,
            t(&[1, total, width], 1.0)?,
        ];
        let grads = |on: &Device, dt: DType| -> Result<Vec<Tensor>> {
            let vars = values
                .iter()
                .map(|v| Var::from_tensor(&v.to_device(on)?.to_dtype(dt)?))
                .chain(params.iter().map(|v| Var::from_tensor(&v.to_device(on)?)))
                .collect::<Result<Vec<_>>>()?;
            let w = weights
                .iter()
                .map(|v| v.to_device(on))
                .collect::<Result<Vec<_>>>()?;
            let [x, dtv, b, c, xbc, conv_w, a_log, d, init] =
                [0, 1, 2, 3, 4, 5, 6, 7, 8].map(|i| vars[i].as_tensor());
            let opts = SsdOptions {
                chunk_size: 128,
                d: Some(d),
                initial_state: Some(init),
                ..Default::default()
            };
            let a = a_log.exp()?.neg()?;
            let (y, states) = ssd_packed(x, dtv, &a, b, c, &cu, &opts)?;
            let conv = ConvOptions {
                bias: None,
                silu: true,
            };
            let (ys, _) = causal_conv1d_split_packed(xbc, conv_w, None, &conv, &split, &cu)?;
            let f32 = |t: &Tensor| t.to_dtype(DType::F32);
            let mut loss =
                ((f32(&y)? * &w[0])?.sum_all()? + (f32(&states)? * &w[1])?.sum_all()?)?;
            let mut from = 0;
            for piece in &ys {
                let len = piece.dim(2)?;
                loss = (loss + (f32(piece)? * w[2].narrow(2, from, len)?)?.sum_all()?)?;
                from += len;
            }
            let store = loss.backward()?;
            vars.iter()
                .map(|v| {
                    store
                        .get(v.as_tensor())
                        .ok_or_else(|| candle_core::Error::msg("an input got no gradient"))?
                        .to_device(&cpu)?
                        .to_dtype(DType::F32)
                })
                .collect()
        };
        let names = [
            "x",
            "dt",
            "B",
            "C",
            "xBC",
            "conv weight",
            "A_log",
            "D",
            "initial state",
        ];
        let (got, want) = (grads(&dev, dtype)?, grads(&cpu, DType::F32)?);
        for ((name, got), want) in names.iter().zip(&got).zip(&want) {
            let e = rel_err(got, &want.to_dtype(DType::F64)?)?;
            assert!(
                e <= tol,
                "{dtype:?} {name}: CUDA gradient off by {e:e} of its scale"
            );
        }
    }
    Ok(())
}

#[test]
fn prefill_packed_matches_each_prompt_alone() -> Result<()> {
    let dev = gpu()?;
    for name in case_names() {
        for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 2e-2)] {
            let model = Model::load(root().join(&name), dtype, &dev)?;
            let vocab = model.config().vocab_size as u64;
            let mut rng = Rng::new(7);
            // Boundaries inside chunks, one-token prompts, prompts over a chunk; and only short ones.
            for lens in [[1usize, 5, 64, 200, 33], [3, 5, 7, 9, 2]] {
                let prompts: Vec<Vec<u32>> = lens
                    .iter()
                    .map(|&l| (0..l).map(|_| (rng.next_u64() % vocab) as u32).collect())
                    .collect();
                let refs: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
                let (logits, cache) = model.prefill_packed(&refs)?;
                let mut worst = 0f64;
                for (i, prompt) in prompts.iter().enumerate() {
                    let mut alone = model.new_cache(1)?;
                    let ids = Tensor::new(prompt.as_slice(), &dev)?.unsqueeze(0)?;
                    let want = model.prefill(&ids, &mut alone)?;
                    let cpu = |t: Tensor| t.to_device(&Device::Cpu)?.to_dtype(DType::F32);
                    worst = worst.max(rel_err(
                        &cpu(logits.narrow(0, i, 1)?)?,
                        &cpu(want)?.to_dtype(DType::F64)?,
                    )?);
                    for (got, want) in cache.layers().iter().zip(alone.layers()) {
                        let ssm = rel_err(
                            &cpu(got.ssm.narrow(0, i, 1)?)?,
                            &cpu(want.ssm.clone())?.to_dtype(DType::F64)?,
                        )?;
                        let conv = rel_err(
                            &cpu(got.conv.narrow(0, i, 1)?)?,
                            &cpu(want.conv.clone())?.to_dtype(DType::F64)?,
                        )?;
                        worst = worst.max(ssm).max(conv);
                    }
                }
                println!("{name} {dtype:?} {lens:?}: worst rel err {worst:e}");
                assert!(
                    worst <= tol,
                    "{name} {dtype:?} {lens:?}: worst rel err {worst:e}"
                );
            }
        }
    }
    Ok(())
}
