//! The CUDA backwards of `causal_conv1d`, `gated_rms_norm`, `add_rms_norm`, `cross_entropy`,
//! `linear_cross_entropy` and `embedding` against their CPU backwards on the same random inputs (run on a GPU machine:
//! `cargo test --release --features cuda --test grad_cuda`; the `conv_`, `norm_`, `loss_` and
//! `embedding_` prefixes pick a group). Every tracked input is
//! a `Var` and `loss = Σ out·W` for fixed random W; each gradient's max error relative to the CPU
//! gradient's max magnitude is at most 1e-4 in f32 and 2e-2 in f16 and bf16. Fresh CUDA buffers
//! are poisoned with NaN before every kernel (`set_poison`), so an element a kernel fails to write
//! fails the test.
#![cfg(feature = "cuda")]

mod common;

use candle_core::{DType, Device, Result, Tensor};
use common::grad::backward_grads;
use common::{rel_err, Rng};
use mamba2::kernels as k;

const DTYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

fn gpu() -> Device {
    k::set_poison(true);
    Device::new_cuda(0).expect("a CUDA device")
}

fn tolerance(dtype: DType) -> f64 {
    if dtype == DType::F32 {
        1e-4
    } else {
        2e-2
    }
}

/// `Σ out·w` in f32.
fn weighted(out: &Tensor, w: &Tensor) -> Result<Tensor> {
    out.to_dtype(DType::F32)?.mul(w)?.sum_all()
}

/// A loss of the tracked inputs (first) and the constant ones (second).
type Loss<'a> = &'a dyn Fn(&[Tensor], &[Tensor]) -> Result<Tensor>;

/// The gradients of every tracked input of `loss` on the GPU, against the same on the CPU: on
/// the GPU, of the input's shape and dtype, within `tol`. Returns the GPU gradients.
fn compare(
    name: &str,
    tol: f64,
    vars: &[Tensor],
    consts: &[Tensor],
    loss: Loss,
) -> Result<Vec<Tensor>> {
    let dev = gpu();
    let on_gpu =
        |ts: &[Tensor]| -> Result<Vec<Tensor>> { ts.iter().map(|t| t.to_device(&dev)).collect() };
    let (gpu_vars, gpu_consts) = (on_gpu(vars)?, on_gpu(consts)?);
    let want = backward_grads(vars, &|v| loss(v, consts))?;
    let got = backward_grads(&gpu_vars, &|v| loss(v, &gpu_consts))?;
    for (i, ((g, w), v)) in got.iter().zip(&want).zip(vars).enumerate() {
        assert!(
            g.device().is_cuda(),
            "{name}: gradient {i} is not on the GPU"
        );
        assert_eq!(g.dims(), v.dims(), "{name}: gradient {i} shape");
        assert_eq!(g.dtype(), v.dtype(), "{name}: gradient {i} dtype");
        let e = rel_err(&g.to_device(&Device::Cpu)?, w)?;
        assert!(e <= tol, "{name}: gradient {i} rel err {e:e} > {tol:e}");
    }
    Ok(got)
}

/// A conv problem: x is `[B,L,D]`, or its channels `off..off+D` of a `[B,L,wide]` tensor
/// (`slice`); the output is cut into `split` pieces when given, and only x tracks gradients when
/// `x_only`.
#[derive(Clone, Copy, Debug)]
struct ConvCase {
    batch: usize,
    seqlen: usize,
    dim: usize,
    width: usize,
    bias: bool,
    state: bool,
    silu: bool,
    slice: Option<(usize, usize)>,
    split: Option<[usize; 3]>,
    x_only: bool,
}

impl ConvCase {
    fn new(batch: usize, seqlen: usize, dim: usize, width: usize) -> Self {
        Self {
            batch,
            seqlen,
            dim,
            width,
            bias: true,
            state: true,
            silu: true,
            slice: None,
            split: None,
            x_only: false,
        }
    }
}

/// The conv's inputs in `dtype` on the CPU: the tracked ones `[x, weight, (bias)]` and the
/// constants `[loss weights, initial state]`.
fn conv_inputs(c: &ConvCase, dtype: DType, seed: u64) -> Result<(Vec<Tensor>, Vec<Tensor>)> {
    let cpu = Device::Cpu;
    let mut rng = Rng::new(seed);
    let (b, l, d, kw) = (c.batch, c.seqlen, c.dim, c.width);
    let x_width = c.slice.map_or(d, |(wide, _)| wide);
    let x = rng.tensor(&[b, l, x_width], 1.0, &cpu)?.to_dtype(dtype)?;
    let w = rng.tensor(&[d, kw], 0.5, &cpu)?.to_dtype(dtype)?;
    let bias = rng.tensor(&[d], 0.5, &cpu)?.to_dtype(dtype)?;
    let state = rng.tensor(&[b, d, kw], 1.0, &cpu)?.to_dtype(dtype)?;
    let lw = rng.tensor(&[b, l, d], 1.0, &cpu)?;
    let mut vars = vec![x];
    let mut consts = vec![lw, state];
    let params = if c.bias { vec![w, bias] } else { vec![w] };
    if c.x_only {
        consts.extend(params);
    } else {
        vars.extend(params);
    }
    Ok((vars, consts))
}

fn conv_loss(c: &ConvCase, vars: &[Tensor], consts: &[Tensor]) -> Result<Tensor> {
    let params = if c.x_only { &consts[2..] } else { &vars[1..] };
    let x = match c.slice {
        Some((_, off)) => vars[0].narrow(2, off, c.dim)?,
        None => vars[0].clone(),
    };
    let opts = k::ConvOptions {
        bias: params.get(1),
        silu: c.silu,
    };
    let state = c.state.then_some(&consts[1]);
    let y = match c.split {
        Some(split) => {
            let (pieces, _) = k::causal_conv1d_split(&x, &params[0], state, &opts, &split)?;
            Tensor::cat(&pieces, 2)?
        }
        None => k::causal_conv1d(&x, &params[0], state, &opts)?.0,
    };
    weighted(&y, &consts[0])
}

fn check_conv(cases: &[ConvCase], seed: u64) -> Result<()> {
    for (n, c) in cases.iter().enumerate() {
        for dtype in DTYPES {
            let (vars, consts) = conv_inputs(c, dtype, seed + n as u64)?;
            let name = format!("{c:?} {dtype:?}");
            compare(&name, tolerance(dtype), &vars, &consts, &|v, k| {
                conv_loss(c, v, k)
            })?;
        }
    }
    Ok(())
}

/// Mixer-like shapes: widths of 3 and 4 taps, more than one program of channels (D > 128) and of
/// tokens, x a row-strided slice, the output cut into pieces, without bias, state or SiLU, and
/// with only x tracked.
#[test]
fn conv_backward_matches_cpu() -> Result<()> {
    let base = ConvCase::new(2, 77, 96, 4);
    let cases = [
        base,
        ConvCase::new(2, 1000, 130, 4),
        ConvCase::new(3, 300, 64, 3),
        ConvCase {
            slice: Some((160, 40)),
            split: Some([64, 16, 16]),
            ..base
        },
        ConvCase {
            bias: false,
            state: false,
            silu: false,
            ..base
        },
        ConvCase {
            silu: false,
            ..ConvCase::new(1, 500, 40, 4)
        },
        ConvCase {
            x_only: true,
            ..base
        },
        // The shipped mixer's xBC inside in_proj's unpadded 1,676-wide row (8-byte loads), and a
        // slice at an odd offset (one channel a thread).
        ConvCase {
            slice: Some((1676, 768)),
            split: Some([768, 64, 64]),
            ..ConvCase::new(2, 40, 896, 4)
        },
        ConvCase {
            slice: Some((160, 41)),
            ..base
        },
    ];
    check_conv(&cases, 100)
}

/// `causal_conv1d_split_backward` on CUDA, dy as three pieces read in place, against the CPU,
/// with x a slice whose rows allow 16-byte, 8-byte and 2-byte loads.
#[test]
fn conv_split_backward_matches_cpu() -> Result<()> {
    let dev = gpu();
    for (n, (wide, off)) in [(1680usize, 768usize), (1676, 768), (1677, 769)]
        .into_iter()
        .enumerate()
    {
        let mut rng = Rng::new(500 + n as u64);
        let cpu = Device::Cpu;
        let (b, l, d) = (2, 70, 896);
        for dtype in DTYPES {
            let x = rng.tensor(&[b, l, wide], 1.0, &cpu)?.to_dtype(dtype)?;
            let w = rng.tensor(&[d, 4], 0.5, &cpu)?.to_dtype(dtype)?;
            let bias = rng.tensor(&[d], 0.5, &cpu)?.to_dtype(dtype)?;
            let dy = [768, 64, 64].map(|c| {
                rng.tensor(&[b, l, c], 1.0, &cpu)
                    .and_then(|t| t.to_dtype(dtype))
            });
            let dy = dy.into_iter().collect::<Result<Vec<_>>>()?;
            let run = |dev: &Device| -> Result<k::ConvGrads> {
                let bias = bias.to_device(dev)?;
                let opts = k::ConvOptions {
                    bias: Some(&bias),
                    silu: true,
                };
                let x = x.to_device(dev)?.narrow(2, off, d)?;
                let dy = dy
                    .iter()
                    .map(|t| t.to_device(dev))
                    .collect::<Result<Vec<_>>>()?;
                k::causal_conv1d_split_backward(&x, &w.to_device(dev)?, None, &opts, &dy)
            };
            let (want, got) = (run(&cpu)?, run(&dev)?);
            // The `_into` form: dx in columns 768.. of in_proj's gradient, padded and not.
            let buffer = Tensor::zeros((b, l, wide), dtype, &dev)?;
            let x_gpu = x.to_device(&dev)?.narrow(2, off, d)?;
            let dy_gpu = dy
                .iter()
                .map(|t| t.to_device(&dev))
                .collect::<Result<Vec<_>>>()?;
            let bias_gpu = bias.to_device(&dev)?;
            let opts = k::ConvOptions {
                bias: Some(&bias_gpu),
                silu: true,
            };
            let w_gpu = w.to_device(&dev)?;
            let into = (&buffer, off);
            k::causal_conv1d_split_backward_into(&x_gpu, &w_gpu, None, &opts, &dy_gpu, into)?;
            let placed = buffer.narrow(2, off, d)?.to_device(&cpu)?;
            let e = rel_err(&placed, &want.x)?;
            assert!(e <= tolerance(dtype), "row {wide} {dtype:?} dx into: {e:e}");
            let pairs = [
                ("dx", got.x, want.x),
                ("dweight", got.weight, want.weight),
                (
                    "dbias",
                    got.bias.expect("a bias gradient"),
                    want.bias.expect("a bias gradient"),
                ),
            ];
            for (name, g, w) in pairs {
                let e = rel_err(&g.to_device(&cpu)?, &w)?;
                let tol = tolerance(dtype);
                assert!(
                    e <= tol,
                    "row {wide} {dtype:?} {name}: rel err {e:e} > {tol:e}"
                );
            }
        }
    }
    Ok(())
}

/// One token, fewer tokens than taps, channel counts off multiples of 8, one tap, and widths past
/// the 4-tap window (5 to 8 taps) and past any window (11 taps), with sequences shorter and longer
/// than the taps.
#[test]
fn conv_backward_odd_shapes_match_cpu() -> Result<()> {
    let cases = [
        ConvCase::new(1, 1, 13, 4),
        ConvCase::new(3, 2, 13, 4),
        ConvCase::new(2, 9, 7, 1),
        ConvCase::new(2, 70, 21, 6),
        ConvCase::new(2, 3, 21, 8),
        ConvCase::new(1, 90, 10, 11),
        ConvCase::new(2, 5, 7, 11),
        ConvCase {
            bias: false,
            silu: false,
            ..ConvCase::new(2, 33, 9, 5)
        },
    ];
    check_conv(&cases, 200)
}

/// B = 1, L = 1,048,576, D = 64: thousands of programs of tokens, each with its row of dweight
/// and dbias sums; f32 against the CPU, every dtype finite.
#[test]
fn conv_backward_long_sequence_is_finite() -> Result<()> {
    let c = ConvCase::new(1, 1 << 20, 64, 4);
    for dtype in DTYPES {
        let (vars, consts) = conv_inputs(&c, dtype, 300)?;
        let loss = |v: &[Tensor], k: &[Tensor]| conv_loss(&c, v, k);
        let grads = if dtype == DType::F32 {
            compare("long conv f32", tolerance(dtype), &vars, &consts, &loss)?
        } else {
            let dev = gpu();
            let on_gpu = |ts: &[Tensor]| -> Result<Vec<Tensor>> {
                ts.iter().map(|t| t.to_device(&dev)).collect()
            };
            let gpu_consts = on_gpu(&consts)?;
            backward_grads(&on_gpu(&vars)?, &|v| loss(v, &gpu_consts))?
        };
        for (i, g) in grads.iter().enumerate() {
            let g = g.to_dtype(DType::F32)?;
            let bad = g
                .flatten_all()?
                .to_vec1::<f32>()?
                .iter()
                .filter(|v| !v.is_finite())
                .count();
            assert_eq!(
                bad, 0,
                "{dtype:?}: gradient {i} has {bad} values that are not finite"
            );
        }
    }
    Ok(())
}

/// A gated norm problem: `x, z [rows.., D]` with groups of `group`; z is channels
/// `off..off+D` of a wider tensor (`slice`) when given.
#[derive(Clone, Copy, Debug)]
struct GatedCase {
    rows: [usize; 2],
    dim: usize,
    group: usize,
    slice: Option<(usize, usize)>,
    x_only: bool,
}

impl GatedCase {
    fn new(rows: [usize; 2], dim: usize, group: usize) -> Self {
        Self {
            rows,
            dim,
            group,
            slice: None,
            x_only: false,
        }
    }
}

fn check_gated(cases: &[GatedCase], seed: u64) -> Result<()> {
    let cpu = Device::Cpu;
    for (n, c) in cases.iter().enumerate() {
        for dtype in DTYPES {
            let mut rng = Rng::new(seed + n as u64);
            let [r0, r1] = c.rows;
            let z_width = c.slice.map_or(c.dim, |(wide, _)| wide);
            let x = rng.tensor(&[r0, r1, c.dim], 1.0, &cpu)?.to_dtype(dtype)?;
            let z = rng.tensor(&[r0, r1, z_width], 1.5, &cpu)?.to_dtype(dtype)?;
            let w = rng.tensor(&[c.dim], 1.0, &cpu)?.to_dtype(dtype)?;
            let lw = rng.tensor(&[r0, r1, c.dim], 1.0, &cpu)?;
            let (vars, consts) = if c.x_only {
                (vec![x], vec![lw, z, w])
            } else {
                (vec![x, z, w], vec![lw])
            };
            let loss = |v: &[Tensor], k: &[Tensor]| -> Result<Tensor> {
                let (z, w) = if c.x_only {
                    (&k[1], &k[2])
                } else {
                    (&v[1], &v[2])
                };
                let z = match c.slice {
                    Some((_, off)) => z.narrow(2, off, c.dim)?,
                    None => z.clone(),
                };
                weighted(&k::gated_rms_norm(&v[0], &z, w, c.group, 1e-5)?, &k[0])
            };
            let name = format!("{c:?} {dtype:?}");
            compare(&name, tolerance(dtype), &vars, &consts, &loss)?;
        }
    }
    Ok(())
}

/// One group and several, group lengths off multiples of 8, a row-strided gate, many rows per
/// program, only x tracked.
#[test]
fn norm_gated_backward_matches_cpu() -> Result<()> {
    let cases = [
        GatedCase::new([2, 77], 96, 48),
        GatedCase::new([1, 1], 13, 13),
        GatedCase::new([3, 5], 39, 13),
        GatedCase::new([4, 64], 1536, 1536),
        GatedCase::new([8, 2500], 64, 32),
        GatedCase {
            slice: Some((300, 100)),
            ..GatedCase::new([2, 77], 96, 32)
        },
        GatedCase {
            x_only: true,
            ..GatedCase::new([2, 9], 40, 20)
        },
    ];
    check_gated(&cases, 400)
}

/// Groups of 8,192 values (the most a program of 1024 threads holds in registers) and longer
/// (8,200 values: the row is re-read).
#[test]
fn norm_gated_backward_long_groups_match_cpu() -> Result<()> {
    let cases = [
        GatedCase::new([1, 3], 8192, 8192),
        GatedCase::new([2, 3], 8200, 8200),
        GatedCase::new([1, 5], 16_400, 8200),
    ];
    check_gated(&cases, 500)
}

/// `add_rms_norm` with and without a residual, the residual in f32 and in the value dtype, short
/// and long rows (8,192 values in registers, re-read past them), one row and many.
#[test]
fn norm_add_backward_matches_cpu() -> Result<()> {
    let cpu = Device::Cpu;
    let shapes = [
        [1, 96],
        [3, 13],
        [20_000, 64],
        [4, 768],
        [3, 8192],
        [2, 8200],
    ];
    for (n, shape) in shapes.into_iter().enumerate() {
        for dtype in DTYPES {
            for (residual, fp32) in [(false, true), (true, true), (true, false)] {
                let mut rng = Rng::new(600 + n as u64);
                let x = rng.tensor(&shape, 1.0, &cpu)?.to_dtype(dtype)?;
                let rdt = if fp32 { DType::F32 } else { dtype };
                let res = rng.tensor(&shape, 1.0, &cpu)?.to_dtype(rdt)?;
                let w = rng.tensor(&shape[1..], 1.0, &cpu)?.to_dtype(dtype)?;
                let lw = rng.tensor(&shape, 1.0, &cpu)?;
                let lw_res = rng.tensor(&shape, 1.0, &cpu)?;
                let vars = if residual {
                    vec![x, w, res]
                } else {
                    vec![x, w]
                };
                let loss = |v: &[Tensor], k: &[Tensor]| -> Result<Tensor> {
                    let (y, r) = k::add_rms_norm(&v[0], v.get(2), &v[1], 1e-5, fp32)?;
                    weighted(&y, &k[0])?.add(&weighted(&r, &k[1])?)
                };
                let name =
                    format!("add_rms_norm {shape:?} {dtype:?} residual {residual} fp32 {fp32}");
                compare(&name, tolerance(dtype), &vars, &[lw, lw_res], &loss)?;
            }
        }
    }
    Ok(())
}

/// Rows × vocabulary of the loss cases: one whose rows move 16 bytes at a time, one whose
/// vocabulary (odd) makes them scalar, one of a single row.
/// `add_rms_norm_backward` along the residual stream on CUDA (one kernel: the carried gradient
/// plus d sum in f32 and rounded to dy's dtype, and d weight) against the CPU, with and without a
/// carried gradient, rows of 384 (values in registers) and of 5000 channels (re-read).
#[test]
fn norm_add_backward_along_the_residual_matches_cpu() -> Result<()> {
    let dev = gpu();
    for (n, &(rows, dim)) in [(300usize, 384usize), (7, 5000)].iter().enumerate() {
        let mut rng = Rng::new(700 + n as u64);
        let cpu = Device::Cpu;
        let sum = rng.tensor(&[rows, dim], 1.0, &cpu)?;
        let carried = rng.tensor(&[rows, dim], 1.0, &cpu)?;
        for dtype in DTYPES {
            let w = rng.tensor_in(&[dim], 0.5, 1.5, &cpu)?.to_dtype(dtype)?;
            let dy = rng.tensor(&[rows, dim], 1.0, &cpu)?.to_dtype(dtype)?;
            for with in [false, true] {
                let run = |d: &Device| -> Result<k::AddNormGrads> {
                    let c = carried.to_device(d)?;
                    let c = with.then_some(&c);
                    k::add_rms_norm_backward(
                        &sum.to_device(d)?,
                        &w.to_device(d)?,
                        1e-5,
                        &dy.to_device(d)?,
                        c,
                    )
                };
                let (want, got) = (run(&cpu)?, run(&dev)?);
                assert_eq!(got.x.dtype(), dtype);
                let tol = tolerance(dtype);
                for (name, g, w) in [
                    ("residual", &got.residual, &want.residual),
                    ("x", &got.x, &want.x),
                    ("weight", &got.weight, &want.weight),
                ] {
                    let e = rel_err(&g.to_device(&cpu)?, w)?;
                    assert!(
                        e <= tol,
                        "{rows}x{dim} {dtype:?} carried {with} {name}: {e:e}"
                    );
                }
            }
        }
    }
    Ok(())
}

/// `gated_rms_norm_backward_into` on CUDA: dz written into a slice of a wider buffer (in_proj's
/// gradient, 16- and 8-byte aligned rows) equals the CPU's dz.
#[test]
fn norm_gated_backward_into_a_wider_buffer_matches_cpu() -> Result<()> {
    let dev = gpu();
    let cpu = Device::Cpu;
    for (n, wide) in [1680usize, 1676].into_iter().enumerate() {
        let mut rng = Rng::new(800 + n as u64);
        let (rows, dim) = (200, 768);
        for dtype in DTYPES {
            let x = rng.tensor(&[rows, dim], 1.0, &cpu)?.to_dtype(dtype)?;
            let z = rng.tensor(&[rows, wide], 1.0, &cpu)?.to_dtype(dtype)?;
            let w = rng.tensor_in(&[dim], 0.5, 1.5, &cpu)?.to_dtype(dtype)?;
            let dy = rng.tensor(&[rows, dim], 1.0, &cpu)?.to_dtype(dtype)?;
            let zc = z.narrow(1, 0, dim)?;
            let (dx, dz, dw) = k::gated_rms_norm_backward(&x, &zc, &w, 64, 1e-5, &dy)?;
            let buffer = Tensor::zeros((rows, wide), dtype, &dev)?;
            let zg = z.to_device(&dev)?.narrow(1, 0, dim)?;
            let (gx, gw) = k::gated_rms_norm_backward_into(
                &x.to_device(&dev)?,
                &zg,
                &w.to_device(&dev)?,
                (64, 1e-5),
                &dy.to_device(&dev)?,
                (&buffer, 0),
            )?;
            let placed = buffer.narrow(1, 0, dim)?;
            let tol = tolerance(dtype);
            for (name, g, want) in [("dx", &gx, &dx), ("dz", &placed, &dz), ("dw", &gw, &dw)] {
                let e = rel_err(&g.to_device(&cpu)?, want)?;
                assert!(e <= tol, "{wide} {dtype:?} {name}: {e:e}");
            }
            let rest = buffer.narrow(1, dim, wide - dim)?.abs()?.max_all()?;
            assert_eq!(rest.to_dtype(DType::F32)?.to_scalar::<f32>()?, 0.0);
        }
    }
    Ok(())
}

const LOSS_CASES: [(usize, usize); 3] = [(300, 8192), (77, 1001), (1, 50)];

#[test]
fn loss_cross_entropy_and_its_backward_match_cpu() -> Result<()> {
    for (case, &(rows, vocab)) in LOSS_CASES.iter().enumerate() {
        let mut rng = Rng::new(40 + case as u64);
        let ids: Vec<u32> = (0..rows)
            .map(|_| (rng.next_u64() % vocab as u64) as u32)
            .collect();
        for dtype in DTYPES {
            let logits = rng
                .tensor(&[rows, vocab], 4.0, &Device::Cpu)?
                .to_dtype(dtype)?;
            for id_dtype in [DType::U32, DType::I64, DType::U8] {
                if id_dtype == DType::U8 && vocab > 256 {
                    continue;
                }
                let targets = Tensor::new(ids.as_slice(), &Device::Cpu)?.to_dtype(id_dtype)?;
                let name = format!("cross_entropy {rows}x{vocab} {dtype:?} ids {id_dtype:?}");
                let loss = |v: &[Tensor], c: &[Tensor]| k::cross_entropy(&v[0], &c[0]);
                let consts = [targets.clone()];
                compare(
                    &name,
                    tolerance(dtype),
                    std::slice::from_ref(&logits),
                    &consts,
                    &loss,
                )?;
                let want = loss(std::slice::from_ref(&logits), &consts)?.to_scalar::<f32>()?;
                let dev = gpu();
                let got = loss(&[logits.to_device(&dev)?], &[targets.to_device(&dev)?])?
                    .to_scalar::<f32>()?;
                let tol = if dtype == DType::F32 { 1e-5 } else { 1e-4 };
                assert!(
                    (got - want).abs() <= tol * want.abs().max(1.0),
                    "{name}: loss {got} on CUDA, {want} on the CPU"
                );
            }
        }
    }
    Ok(())
}

#[test]
fn loss_linear_cross_entropy_and_its_backward_match_cpu() -> Result<()> {
    // (rows, d, V): the recorded op on CUDA against the product and cross_entropy on the CPU,
    // the gradients of both the rows and the weight.
    for (case, &(rows, dim, vocab)) in [(300, 64, 1001), (5, 24, 8192)].iter().enumerate() {
        let mut rng = Rng::new(60 + case as u64);
        let ids: Vec<u32> = (0..rows)
            .map(|_| (rng.next_u64() % vocab as u64) as u32)
            .collect();
        let targets = Tensor::new(ids.as_slice(), &Device::Cpu)?;
        for dtype in DTYPES {
            let hidden = rng
                .tensor(&[rows, dim], 1.0, &Device::Cpu)?
                .to_dtype(dtype)?;
            let weight = rng
                .tensor(&[vocab, dim], 0.3, &Device::Cpu)?
                .to_dtype(dtype)?;
            let name = format!("linear_cross_entropy {rows}x{dim}x{vocab} {dtype:?}");
            let loss = |v: &[Tensor], c: &[Tensor]| k::linear_cross_entropy(&v[0], &v[1], &c[0]);
            let consts = [targets.clone()];
            let vars = [hidden, weight];
            compare(&name, tolerance(dtype), &vars, &consts, &loss)?;
            let want = loss(&vars, &consts)?.to_scalar::<f32>()?;
            let dev = gpu();
            let on_gpu = [vars[0].to_device(&dev)?, vars[1].to_device(&dev)?];
            let got = loss(&on_gpu, &[targets.to_device(&dev)?])?.to_scalar::<f32>()?;
            let tol = if dtype == DType::F32 { 1e-5 } else { 2e-3 };
            assert!(
                (got - want).abs() <= tol * want.abs().max(1.0),
                "{name}: loss {got} on CUDA, {want} on the CPU"
            );
        }
    }
    Ok(())
}

#[test]
fn loss_cross_entropy_of_a_target_outside_the_vocabulary_is_nan() -> Result<()> {
    let dev = gpu();
    let logits = Rng::new(7).tensor(&[4, 100], 1.0, &dev)?;
    for bad in [
        Tensor::new(&[1u32, 2, 100, 3], &dev)?,
        Tensor::new(&[1i64, -1, 2, 3], &dev)?,
    ] {
        let loss = k::cross_entropy(&logits, &bad)?.to_scalar::<f32>()?;
        assert!(loss.is_nan(), "target out of range: loss {loss}");
    }
    Ok(())
}

#[test]
fn embedding_backward_matches_cpu() -> Result<()> {
    // Ids that repeat within the batch (the scatter-add's atomics) and a row length that is no
    // multiple of the program's threads; a dozen ids per row, as the CPU's bf16 index_add rounds
    // after every add.
    for (case, &(vocab, dim, rows)) in [(50usize, 384usize, 600usize), (7, 3, 34)]
        .iter()
        .enumerate()
    {
        let mut rng = Rng::new(60 + case as u64);
        let ids: Vec<u32> = (0..rows)
            .map(|_| (rng.next_u64() % vocab as u64) as u32)
            .collect();
        for dtype in DTYPES {
            let weight = rng
                .tensor(&[vocab, dim], 1.0, &Device::Cpu)?
                .to_dtype(dtype)?;
            let w_out = rng.tensor(&[2, rows / 2, dim], 1.0, &Device::Cpu)?;
            let ids = Tensor::new(ids.as_slice(), &Device::Cpu)?.reshape((2, rows / 2))?;
            let name = format!("embedding {vocab}x{dim}, {rows} ids, {dtype:?}");
            let loss = |v: &[Tensor], c: &[Tensor]| weighted(&k::embedding(&v[0], &c[0])?, &c[1]);
            compare(&name, tolerance(dtype), &[weight], &[ids, w_out], &loss)?;
        }
    }
    Ok(())
}
