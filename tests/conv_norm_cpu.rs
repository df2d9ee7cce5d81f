//! The CPU conv and norm ops (`causal_conv1d`, `causal_conv1d_step`, `gated_rms_norm`,
//! `add_rms_norm`) against straightforward f64 references written here, and their input checks.

mod common;

use candle_core::{DType, Device, IndexOp, Result, Tensor};
use common::{expect_err, rel_err, tolerance, Rng};
use mamba2::kernels::{
    add_rms_norm, causal_conv1d, causal_conv1d_step, gated_rms_norm, ConvOptions,
};

fn f64s(t: &Tensor) -> Result<Vec<f64>> {
    t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()
}

fn silu(v: f64) -> f64 {
    v / (1.0 + (-v).exp())
}

/// The conv by its definition: `u` = state then x, `y[t] = act(bias + Σ_k w[k]·u[t+k])`.
/// Returns `(y [B,L,D], new_state [B,D,K])` as f64 tensors.
fn conv_reference(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    state: Option<&Tensor>,
    silu_on: bool,
) -> Result<(Tensor, Tensor)> {
    let (b, l, d) = x.dims3()?;
    let k = w.dim(1)?;
    let (xv, wv) = (f64s(x)?, f64s(w)?);
    let bv = bias.map(f64s).transpose()?.unwrap_or(vec![0.0; d]);
    let sv = state.map(f64s).transpose()?.unwrap_or(vec![0.0; b * d * k]);
    let mut y = vec![0f64; b * l * d];
    let mut ns = vec![0f64; b * d * k];
    for bi in 0..b {
        for c in 0..d {
            // u: the K state entries, then the L inputs.
            let mut u: Vec<f64> = (0..k).map(|j| sv[(bi * d + c) * k + j]).collect();
            u.extend((0..l).map(|t| xv[(bi * l + t) * d + c]));
            for t in 0..l {
                let acc: f64 = (0..k).map(|j| wv[c * k + j] * u[t + 1 + j]).sum::<f64>() + bv[c];
                y[(bi * l + t) * d + c] = if silu_on { silu(acc) } else { acc };
            }
            for j in 0..k {
                ns[(bi * d + c) * k + j] = u[l + j];
            }
        }
    }
    let cpu = Device::Cpu;
    Ok((
        Tensor::from_vec(y, (b, l, d), &cpu)?,
        Tensor::from_vec(ns, (b, d, k), &cpu)?,
    ))
}

/// RMSNorm of every group of `gs` channels of `v` (rows of `w.len()` channels), times `w`.
fn norm_rows(v: &[f64], w: &[f64], gs: usize, eps: f64) -> Vec<f64> {
    let mut out = vec![0f64; v.len()];
    for (gi, (o, g)) in out.chunks_mut(gs).zip(v.chunks(gs)).enumerate() {
        let rstd = 1.0 / (g.iter().map(|a| a * a).sum::<f64>() / gs as f64 + eps).sqrt();
        let wg = &w[(gi * gs) % w.len()..][..gs];
        for ((o, a), wv) in o.iter_mut().zip(g).zip(wg) {
            *o = a * rstd * wv;
        }
    }
    out
}

struct ConvCase {
    batch: usize,
    seqlen: usize,
    dim: usize,
    width: usize,
    bias: bool,
    state: bool,
    silu: bool,
    dtype: DType,
}

fn check_conv(c: &ConvCase, seed: u64) -> Result<()> {
    let dev = Device::Cpu;
    let mut rng = Rng::new(seed);
    let v = |t: Tensor| t.to_dtype(c.dtype);
    let x = v(rng.tensor(&[c.batch, c.seqlen, c.dim], 1.0, &dev)?)?;
    let w = v(rng.tensor_in(&[c.dim, c.width], -0.5, 0.5, &dev)?)?;
    let bias = c
        .bias
        .then(|| rng.tensor(&[c.dim], 0.3, &dev))
        .transpose()?
        .map(v)
        .transpose()?;
    let state = c
        .state
        .then(|| rng.tensor(&[c.batch, c.dim, c.width], 1.0, &dev))
        .transpose()?
        .map(v)
        .transpose()?;
    let opts = ConvOptions {
        bias: bias.as_ref(),
        silu: c.silu,
    };
    let (want_y, want_s) = conv_reference(&x, &w, bias.as_ref(), state.as_ref(), c.silu)?;
    let (y, s) = causal_conv1d(&x, &w, state.as_ref(), &opts)?;
    assert_eq!((y.dtype(), s.dtype()), (c.dtype, c.dtype));
    let tol = tolerance(c.dtype);
    let ctx = format!(
        "B{} L{} D{} K{} bias {} state {} silu {} {:?}",
        c.batch, c.seqlen, c.dim, c.width, c.bias, c.state, c.silu, c.dtype
    );
    let e = rel_err(&y, &want_y)?;
    assert!(e <= tol, "causal_conv1d y rel err {e:e} for {ctx}");
    // The new state holds input values: exact.
    let e = rel_err(&s, &want_s)?;
    assert!(e == 0.0, "causal_conv1d state rel err {e:e} for {ctx}");

    // The same tokens one at a time through the step, from the same initial state.
    let st = match &state {
        Some(s) => s.copy()?,
        None => Tensor::zeros((c.batch, c.dim, c.width), c.dtype, &dev)?,
    };
    let mut ys = Vec::new();
    for t in 0..c.seqlen {
        ys.push(causal_conv1d_step(&st, &x.i((.., t))?, &w, &opts)?);
    }
    let e = rel_err(&Tensor::stack(&ys, 1)?, &want_y)?;
    assert!(e <= tol, "causal_conv1d_step y rel err {e:e} for {ctx}");
    let e = rel_err(&st, &want_s)?;
    assert!(e == 0.0, "causal_conv1d_step state rel err {e:e} for {ctx}");
    Ok(())
}

#[test]
fn causal_conv1d_matches_reference() -> Result<()> {
    let mut seed = 0;
    for width in [2, 3, 4] {
        for seqlen in [1, width - 1, width, 17] {
            for variant in 0..4 {
                let case = ConvCase {
                    batch: 1 + variant % 2,
                    seqlen,
                    dim: [5, 32][variant / 2],
                    width,
                    bias: variant % 2 == 0,
                    state: variant >= 1,
                    silu: variant != 3,
                    dtype: DType::F32,
                };
                check_conv(&case, seed)?;
                seed += 1;
            }
        }
    }
    Ok(())
}

#[test]
fn causal_conv1d_half_precision_matches_reference() -> Result<()> {
    for (i, dtype) in [DType::F16, DType::BF16].into_iter().enumerate() {
        for seqlen in [2, 33] {
            let case = ConvCase {
                batch: 2,
                seqlen,
                dim: 24,
                width: 4,
                bias: true,
                state: true,
                silu: true,
                dtype,
            };
            check_conv(&case, 100 + i as u64 * 10 + seqlen as u64)?;
        }
    }
    Ok(())
}

/// A sequence split in two gives the outputs and state of the whole, and a short prompt
/// (L < K) leaves its inputs zero-padded on the left of the state.
#[test]
fn causal_conv1d_continues_from_its_state() -> Result<()> {
    let dev = Device::Cpu;
    let mut rng = Rng::new(7);
    let x = rng.tensor(&[2, 20, 6], 1.0, &dev)?;
    let w = rng.tensor(&[6, 4], 0.5, &dev)?;
    let bias = rng.tensor(&[6], 0.3, &dev)?;
    let opts = ConvOptions {
        bias: Some(&bias),
        silu: true,
    };
    let (y, s) = causal_conv1d(&x, &w, None, &opts)?;
    for split in [1, 2, 3, 4, 13] {
        let (y1, s1) = causal_conv1d(&x.i((.., ..split))?, &w, None, &opts)?;
        let (y2, s2) = causal_conv1d(&x.i((.., split..))?, &w, Some(&s1), &opts)?;
        assert!(rel_err(&Tensor::cat(&[&y1, &y2], 1)?, &y)? <= 1e-6);
        assert_eq!(rel_err(&s2, &s)?, 0.0);
    }
    let (_, s2) = causal_conv1d(&x.i((.., ..2))?, &w, None, &opts)?;
    let want = Tensor::cat(
        &[
            &Tensor::zeros((2, 6, 2), DType::F32, &dev)?,
            &x.i((.., ..2))?.transpose(1, 2)?,
        ],
        2,
    )?;
    assert_eq!(rel_err(&s2, &want)?, 0.0);
    Ok(())
}

#[test]
fn gated_rms_norm_matches_reference() -> Result<()> {
    let dev = Device::Cpu;
    let mut seed = 200;
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for (shape, group_size) in [
            (vec![3, 64], 64),
            (vec![3, 64], 32),
            (vec![2, 5, 64], 16),
            (vec![1, 7, 48], 48),
            (vec![2, 1, 8], 2),
        ] {
            let mut rng = Rng::new(seed);
            seed += 1;
            let d = *shape.last().expect("rank >= 1");
            let x = rng.tensor(&shape, 1.0, &dev)?.to_dtype(dtype)?;
            let z = rng.tensor(&shape, 1.5, &dev)?.to_dtype(dtype)?;
            let w = rng.tensor_in(&[d], 0.7, 1.3, &dev)?.to_dtype(dtype)?;
            let eps = 1e-5;
            let gated: Vec<f64> = f64s(&x)?
                .iter()
                .zip(f64s(&z)?)
                .map(|(a, b)| a * silu(b))
                .collect();
            let want = norm_rows(&gated, &f64s(&w)?, group_size, eps);
            let want = Tensor::from_vec(want, shape.as_slice(), &dev)?;
            let y = gated_rms_norm(&x, &z, &w, group_size, eps)?;
            assert_eq!(y.dtype(), dtype);
            let e = rel_err(&y, &want)?;
            assert!(
                e <= tolerance(dtype),
                "gated_rms_norm rel err {e:e} for {shape:?} group {group_size} {dtype:?}"
            );
        }
    }
    Ok(())
}

#[test]
fn add_rms_norm_matches_reference() -> Result<()> {
    let dev = Device::Cpu;
    let mut seed = 300;
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for residual_in_fp32 in [true, false] {
            for with_residual in [true, false] {
                for shape in [vec![4, 32], vec![2, 3, 48]] {
                    let mut rng = Rng::new(seed);
                    seed += 1;
                    let d = *shape.last().expect("rank >= 1");
                    let x = rng.tensor(&shape, 1.0, &dev)?.to_dtype(dtype)?;
                    let rdtype = if residual_in_fp32 { DType::F32 } else { dtype };
                    let residual = with_residual
                        .then(|| rng.tensor(&shape, 2.0, &dev))
                        .transpose()?
                        .map(|r| r.to_dtype(rdtype))
                        .transpose()?;
                    let w = rng.tensor_in(&[d], 0.7, 1.3, &dev)?.to_dtype(dtype)?;
                    let mut sum = f64s(&x)?;
                    if let Some(r) = &residual {
                        sum.iter_mut().zip(f64s(r)?).for_each(|(s, r)| *s += r);
                    }
                    let want_y = norm_rows(&sum, &f64s(&w)?, d, 1e-5);
                    let want_y = Tensor::from_vec(want_y, shape.as_slice(), &dev)?;
                    let want_r = Tensor::from_vec(sum, shape.as_slice(), &dev)?;
                    let (y, r) = add_rms_norm(&x, residual.as_ref(), &w, 1e-5, residual_in_fp32)?;
                    let ctx = format!(
                        "{shape:?} {dtype:?} fp32 residual {residual_in_fp32} residual given {with_residual}"
                    );
                    assert_eq!(y.dtype(), dtype, "{ctx}");
                    assert_eq!(r.dtype(), rdtype, "{ctx}");
                    let e = rel_err(&y, &want_y)?;
                    assert!(
                        e <= tolerance(dtype),
                        "add_rms_norm y rel err {e:e} for {ctx}"
                    );
                    let e = rel_err(&r, &want_r)?;
                    assert!(
                        e <= tolerance(rdtype),
                        "add_rms_norm residual rel err {e:e} for {ctx}"
                    );
                }
            }
        }
    }
    Ok(())
}

#[test]
fn conv_inputs_are_checked() -> Result<()> {
    let dev = Device::Cpu;
    let x = Tensor::zeros((2, 5, 8), DType::F32, &dev)?;
    let w = Tensor::zeros((8, 4), DType::F32, &dev)?;
    let opts = ConvOptions::default();
    expect_err(
        causal_conv1d(&x.i((.., 0))?, &w, None, &opts),
        "causal_conv1d: x must have rank 3 [B, L, D], got shape [2, 8]",
    );
    expect_err(
        causal_conv1d(
            &x,
            &Tensor::zeros((8, 1, 4), DType::F32, &dev)?,
            None,
            &opts,
        ),
        "causal_conv1d: weight must have rank 2 [D, K]",
    );
    expect_err(
        causal_conv1d(&x, &Tensor::zeros((7, 4), DType::F32, &dev)?, None, &opts),
        "causal_conv1d: weight must have shape [D, K] with D = 8",
    );
    expect_err(
        causal_conv1d(&x, &w.to_dtype(DType::BF16)?, None, &opts),
        "causal_conv1d: weight must have the dtype of x (F32), got BF16",
    );
    let bias = Tensor::zeros(7, DType::F32, &dev)?;
    expect_err(
        causal_conv1d(
            &x,
            &w,
            None,
            &ConvOptions {
                bias: Some(&bias),
                silu: true,
            },
        ),
        "causal_conv1d: bias must have shape [D] = [8], got [7]",
    );
    let state = Tensor::zeros((2, 8, 3), DType::F32, &dev)?;
    expect_err(
        causal_conv1d(&x, &w, Some(&state), &opts),
        "causal_conv1d: initial_state must have shape [B, D, K] = [2, 8, 4], got [2, 8, 3]",
    );
    expect_err(
        causal_conv1d(&x.to_dtype(DType::U32)?, &w, None, &opts),
        "causal_conv1d: x must be f32, f16 or bf16, got U32",
    );
    expect_err(
        causal_conv1d(&x.i((.., ..0))?, &w, None, &opts),
        "causal_conv1d: x has an empty dimension",
    );
    let st = Tensor::zeros((2, 8, 4), DType::F32, &dev)?;
    expect_err(
        causal_conv1d_step(&st, &x, &w, &opts),
        "causal_conv1d_step: x must have rank 2 [B, D]",
    );
    expect_err(
        causal_conv1d_step(&st.to_dtype(DType::F16)?, &x.i((.., 0))?, &w, &opts),
        "causal_conv1d_step: state must have the dtype of x (F32), got F16",
    );
    let strided = Tensor::zeros((2, 4, 8), DType::F32, &dev)?.transpose(1, 2)?;
    expect_err(
        causal_conv1d_step(&strided, &x.i((.., 0))?, &w, &opts),
        "causal_conv1d_step: state must be contiguous to be updated in place",
    );
    expect_err(
        causal_conv1d_step(&st.i(0..1)?, &x.i((.., 0))?, &w, &opts),
        "causal_conv1d_step: state must have shape [B, D, K] = [2, 8, 4], got [1, 8, 4]",
    );
    Ok(())
}

#[test]
fn norm_inputs_are_checked() -> Result<()> {
    let dev = Device::Cpu;
    let x = Tensor::zeros((3, 8), DType::F32, &dev)?;
    let w = Tensor::ones(8, DType::F32, &dev)?;
    expect_err(
        gated_rms_norm(&x, &x, &w, 3, 1e-5),
        "gated_rms_norm: group_size (3) must divide the channel count D (8)",
    );
    expect_err(
        gated_rms_norm(&x, &x.i(0..2)?, &w, 8, 1e-5),
        "gated_rms_norm: z must have shape like x = [3, 8], got [2, 8]",
    );
    expect_err(
        gated_rms_norm(&x, &x.to_dtype(DType::BF16)?, &w, 8, 1e-5),
        "gated_rms_norm: z must have the dtype of x (F32), got BF16",
    );
    expect_err(
        gated_rms_norm(&x, &x, &w.i(0..4)?, 4, 1e-5),
        "gated_rms_norm: weight must have shape [D] = [8], got [4]",
    );
    expect_err(
        gated_rms_norm(&x, &x, &w, 8, f64::NAN),
        "gated_rms_norm: eps must be finite and in [0, 1]",
    );
    expect_err(
        gated_rms_norm(&x.i((.., ..0))?, &x.i((.., ..0))?, &w.i(..0)?, 8, 1e-5),
        "gated_rms_norm: x must have rank >= 1 [..., D] and no empty dimension",
    );
    expect_err(
        add_rms_norm(&x, Some(&x.to_dtype(DType::BF16)?), &w, 1e-5, true),
        "add_rms_norm: residual must be F32 (residual_in_fp32 = true, x is F32), got BF16",
    );
    let xb = x.to_dtype(DType::BF16)?;
    expect_err(
        add_rms_norm(&xb, Some(&x), &w.to_dtype(DType::BF16)?, 1e-5, false),
        "add_rms_norm: residual must be BF16 (residual_in_fp32 = false, x is BF16), got F32",
    );
    expect_err(
        add_rms_norm(&x, Some(&x.i(0..1)?), &w, 1e-5, true),
        "add_rms_norm: residual must have shape like x = [3, 8], got [1, 8]",
    );
    expect_err(
        add_rms_norm(&x, None, &w.to_dtype(DType::F16)?, 1e-5, true),
        "add_rms_norm: weight must have the dtype of x (F32), got F16",
    );
    Ok(())
}
