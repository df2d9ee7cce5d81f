//! The CUDA backward of `ssd` and `ssd_xbc` against the CPU backward (run on a GPU machine:
//! `cargo test --release --features cuda --test grad_ssd_cuda`): every input's gradient from a
//! loss that reads y and the final state, in f32 (≤ 1e-4 of the largest gradient) and bf16
//! (≤ 2e-2, the CPU run on the same bf16-rounded inputs in f32), on lengths that are not
//! multiples of the chunk, L = 1, groups, D per head and per channel, z, the initial state and
//! the dt options; outputs poisoned with NaN before every kernel; a finite backward at
//! L = 1,048,576; and gradients for only the inputs that record them.
#![cfg(feature = "cuda")]

mod common;

use candle_core::{DType, Device, Result, Tensor, Var};
use common::Rng;
use mamba2::kernels::{
    self as k, ssd, ssd_backward, ssd_backward_saved, ssd_saving, ssd_xbc, DtOptions, SsdOptions,
};

fn gpu() -> Device {
    k::set_poison(true);
    Device::new_cuda(0).expect("a CUDA device")
}

#[derive(Clone, Copy, Debug)]
struct Case {
    batch: usize,
    seqlen: usize,
    nheads: usize,
    headdim: usize,
    ngroups: usize,
    dstate: usize,
    chunk: usize,
    /// 0: no D, 1: per head, 2: per channel.
    d: u8,
    z: bool,
    init: bool,
    softplus: bool,
    limit: (f32, f32),
    state_dtype: DType,
}

const BASE: Case = Case {
    batch: 2,
    seqlen: 150,
    nheads: 4,
    headdim: 64,
    ngroups: 2,
    dstate: 64,
    chunk: 64,
    d: 1,
    z: false,
    init: true,
    softplus: true,
    limit: (0.0, f32::INFINITY),
    state_dtype: DType::F32,
};

/// The inputs of a case as f32 host tensors, rounded to `dtype` where the op reads them in it.
struct Inputs {
    x: Tensor,
    dt: Tensor,
    a_log: Tensor,
    b: Tensor,
    c: Tensor,
    d: Option<Tensor>,
    z: Option<Tensor>,
    init: Option<Tensor>,
    bias: Tensor,
    wy: Tensor,
    ws: Tensor,
}

impl Inputs {
    fn new(k: &Case, seed: u64, dtype: DType) -> Result<Self> {
        let (dev, rng) = (&Device::Cpu, &mut Rng::new(seed));
        let (bs, l, h, p, g, n) = (k.batch, k.seqlen, k.nheads, k.headdim, k.ngroups, k.dstate);
        let round = |t: Tensor| t.to_dtype(dtype)?.to_dtype(DType::F32);
        let d_shape = if k.d == 1 { vec![h] } else { vec![h, p] };
        Ok(Self {
            x: round(rng.tensor(&[bs, l, h, p], 1.0, dev)?)?,
            dt: round(rng.tensor_in(&[bs, l, h], -2.5, 0.5, dev)?)?,
            a_log: rng.tensor_in(&[h], -1.0, 1.0, dev)?,
            b: round(rng.tensor(&[bs, l, g, n], 0.5, dev)?)?,
            c: round(rng.tensor(&[bs, l, g, n], 0.5, dev)?)?,
            d: (k.d > 0)
                .then(|| rng.tensor(&d_shape, 1.0, dev))
                .transpose()?,
            z: k.z
                .then(|| rng.tensor(&[bs, l, h, p], 1.0, dev).and_then(round))
                .transpose()?,
            init: k
                .init
                .then(|| rng.tensor(&[bs, h, p, n], 0.5, dev))
                .transpose()?,
            bias: rng.tensor_in(&[h], -0.5, 0.5, dev)?,
            wy: rng.tensor(&[bs, l, h, p], 1.0, dev)?,
            ws: rng.tensor(&[bs, h, p, n], 1.0, dev)?,
        })
    }
}

/// A case's inputs on the GPU in the values' dtype (a = −exp(a_log), bias, D and the initial
/// state f32), with y's and the final state's weights as gradients (`dy`, `ws`).
struct OnDevice {
    x: Tensor,
    dt: Tensor,
    a: Tensor,
    b: Tensor,
    c: Tensor,
    bias: Tensor,
    d: Tensor,
    init: Tensor,
    dy: Tensor,
    ws: Tensor,
}

impl OnDevice {
    fn new(inp: &Inputs, dtype: DType, dev: &Device) -> Result<Self> {
        let on = |t: &Tensor, dt: DType| -> Result<Tensor> { t.to_device(dev)?.to_dtype(dt) };
        Ok(Self {
            x: on(&inp.x, dtype)?,
            dt: on(&inp.dt, dtype)?,
            a: on(&inp.a_log, DType::F32)?.exp()?.neg()?,
            b: on(&inp.b, dtype)?,
            c: on(&inp.c, dtype)?,
            bias: on(&inp.bias, DType::F32)?,
            d: on(inp.d.as_ref().expect("D"), DType::F32)?,
            init: on(inp.init.as_ref().expect("init"), DType::F32)?,
            dy: on(&inp.wy, dtype)?,
            ws: on(&inp.ws, DType::F32)?,
        })
    }

    /// Case `k`'s options on these tensors (no z).
    fn opts(&self, k: &Case) -> SsdOptions<'_> {
        SsdOptions {
            chunk_size: k.chunk,
            dt: DtOptions {
                bias: Some(&self.bias),
                softplus: k.softplus,
                limit: k.limit,
            },
            d: Some(&self.d),
            z: None,
            initial_state: Some(&self.init),
            state_dtype: k.state_dtype,
        }
    }
}

/// Every named gradient of the loss Σ y·wy + Σ final·ws, computed on `dev` in `dtype`
/// (returned as f32 host tensors), through `ssd` or (`xbc`) `ssd_xbc`.
fn grads(
    k: &Case,
    inp: &Inputs,
    dev: &Device,
    dtype: DType,
    xbc: bool,
) -> Result<Vec<(String, Tensor)>> {
    let var = |t: &Tensor, dt: DType| Var::from_tensor(&t.to_device(dev)?.to_dtype(dt)?);
    let (x, dtv, b, c) = (
        var(&inp.x, dtype)?,
        var(&inp.dt, dtype)?,
        var(&inp.b, dtype)?,
        var(&inp.c, dtype)?,
    );
    let a_log = var(&inp.a_log, DType::F32)?;
    let bias = var(&inp.bias, DType::F32)?;
    let d = inp.d.as_ref().map(|t| var(t, DType::F32)).transpose()?;
    let z = inp.z.as_ref().map(|t| var(t, dtype)).transpose()?;
    let init = inp.init.as_ref().map(|t| var(t, DType::F32)).transpose()?;
    let a = a_log.as_tensor().exp()?.neg()?;
    let opts = SsdOptions {
        chunk_size: k.chunk,
        dt: DtOptions {
            bias: Some(bias.as_tensor()),
            softplus: k.softplus,
            limit: k.limit,
        },
        d: d.as_ref().map(Var::as_tensor),
        z: z.as_ref().map(Var::as_tensor),
        initial_state: init.as_ref().map(Var::as_tensor),
        state_dtype: k.state_dtype,
    };
    let (bs, l) = (k.batch, k.seqlen);
    let (y, last, xbc_var) = if xbc {
        let (hp, gn) = (k.nheads * k.headdim, k.ngroups * k.dstate);
        let joined = Tensor::cat(
            &[
                inp.x.reshape((bs, l, hp))?,
                inp.b.reshape((bs, l, gn))?,
                inp.c.reshape((bs, l, gn))?,
            ],
            2,
        )?;
        let v = var(&joined, dtype)?;
        let (y, last) = ssd_xbc(
            v.as_tensor(),
            dtv.as_tensor(),
            &a,
            (k.ngroups, k.dstate),
            &opts,
        )?;
        (y, last, Some(v))
    } else {
        let (y, last) = ssd(
            x.as_tensor(),
            dtv.as_tensor(),
            &a,
            b.as_tensor(),
            c.as_tensor(),
            &opts,
        )?;
        (y, last, None)
    };
    let wy = inp.wy.to_device(dev)?;
    let ws = inp.ws.to_device(dev)?;
    let loss = ((y.to_dtype(DType::F32)? * wy)?.sum_all()?
        + (last.to_dtype(DType::F32)? * ws)?.sum_all()?)?;
    let store = loss.backward()?;
    let mut leaves: Vec<(&str, &Var)> = vec![("dt", &dtv), ("A_log", &a_log), ("dt_bias", &bias)];
    match &xbc_var {
        Some(v) => leaves.push(("xbc", v)),
        None => leaves.extend([("x", &x), ("B", &b), ("C", &c)]),
    }
    let optional = [("D", &d), ("z", &z), ("init", &init)];
    leaves.extend(
        optional
            .iter()
            .filter_map(|(n, v)| v.as_ref().map(|v| (*n, v))),
    );
    leaves
        .into_iter()
        .map(|(name, v)| {
            let g = store
                .get(v.as_tensor())
                .unwrap_or_else(|| panic!("no gradient for {name}"));
            Ok((
                name.to_string(),
                g.to_device(&Device::Cpu)?.to_dtype(DType::F32)?,
            ))
        })
        .collect()
}

/// The CUDA gradients against the CPU's: the worst error relative to each gradient's largest
/// magnitude, asserted ≤ `tol` once every gradient's error is known (a failure names them all,
/// which tells the backward kernels' parts apart).
fn check(k: &Case, seed: u64, dtype: DType, xbc: bool) -> Result<f64> {
    let tol = if dtype == DType::F32 && k.state_dtype == DType::F32 {
        1e-4
    } else {
        2e-2
    };
    let inp = Inputs::new(k, seed, dtype)?;
    let want = grads(k, &inp, &Device::Cpu, DType::F32, xbc)?;
    let got = grads(k, &inp, &gpu(), dtype, xbc)?;
    let mut rows = Vec::with_capacity(want.len());
    for ((name, w), (_, g)) in want.iter().zip(&got) {
        let scale = w.abs()?.max_all()?.to_scalar::<f32>()? as f64;
        let err = (g - w)?.abs()?.max_all()?.to_scalar::<f32>()? as f64;
        rows.push((name.as_str(), err / scale.max(1e-12), scale));
    }
    let over: Vec<String> = rows
        .iter()
        .filter(|(_, rel, _)| !(rel.is_finite() && *rel <= tol))
        .map(|(name, rel, scale)| format!("{name}: off by {rel:e} of its scale {scale:e}"))
        .collect();
    let all: Vec<String> = rows
        .iter()
        .map(|(name, rel, _)| format!("{name} {rel:.2e}"))
        .collect();
    assert!(
        over.is_empty(),
        "CUDA gradients beyond {tol:e} ({dtype:?}, xbc {xbc}, {k:?}): {over:?}; every gradient: {}",
        all.join(", ")
    );
    Ok(rows.iter().map(|r| r.1).fold(0f64, f64::max))
}

/// [`check`] of each case (case i with seed `seed + i`), printing each one's worst error.
fn check_cases(cases: &[Case], seed: u64, dtype: DType) -> Result<()> {
    for (i, case) in cases.iter().enumerate() {
        let worst = check(case, seed + i as u64, dtype, false)?;
        println!("{dtype:?} case {i}: worst {worst:e}");
    }
    Ok(())
}

#[test]
fn f32_gradients_match_the_cpu() -> Result<()> {
    let cases = [
        BASE,
        Case { seqlen: 1, ..BASE },
        Case {
            seqlen: 64,
            ngroups: 1,
            d: 2,
            z: true,
            ..BASE
        },
        Case {
            seqlen: 200,
            chunk: 16,
            init: false,
            softplus: false,
            limit: (0.05, 0.6),
            ..BASE
        },
        Case {
            headdim: 24,
            dstate: 40,
            nheads: 3,
            ngroups: 1,
            chunk: 256,
            ..BASE
        },
        Case {
            seqlen: 333,
            dstate: 128,
            ngroups: 4,
            d: 0,
            ..BASE
        },
    ];
    check_cases(&cases, 7, DType::F32)
}

#[test]
fn bf16_gradients_match_the_cpu() -> Result<()> {
    let cases = [
        BASE,
        Case { seqlen: 1, ..BASE },
        Case {
            seqlen: 300,
            ngroups: 1,
            dstate: 128,
            d: 2,
            z: true,
            ..BASE
        },
        Case {
            seqlen: 129,
            state_dtype: DType::BF16,
            chunk: 128,
            ..BASE
        },
        Case {
            headdim: 24,
            dstate: 40,
            nheads: 3,
            ngroups: 3,
            chunk: 32,
            ..BASE
        },
        Case {
            seqlen: 100,
            dstate: 256,
            state_dtype: DType::BF16,
            ..BASE
        },
        // N = 256 with f32 states: four heads adding into one group's dB and dC over two state
        // chunks of 128 tokens and part of a third.
        Case {
            seqlen: 333,
            ngroups: 1,
            dstate: 256,
            d: 2,
            ..BASE
        },
        // bf16 states at N = 128: the tiles by tensor map where the device has them, two
        // sequences each ending 13 tokens into a program (rows past the end read as zeros).
        Case {
            seqlen: 333,
            dstate: 128,
            state_dtype: DType::BF16,
            ..BASE
        },
        // Eight heads adding into one group's dB and dC, over 264 chunks of 64.
        Case {
            batch: 1,
            seqlen: 264 * 64,
            nheads: 8,
            ngroups: 1,
            dstate: 128,
            d: 2,
            state_dtype: DType::BF16,
            ..BASE
        },
        // Sixteen heads adding into one group's dB and dC at N = 64, the sequences ending 22
        // tokens into a program.
        Case {
            nheads: 16,
            ngroups: 1,
            state_dtype: DType::BF16,
            ..BASE
        },
        // Two groups of eight heads at N = 256 with f32 states, ending 13 tokens into a program.
        Case {
            seqlen: 333,
            nheads: 16,
            dstate: 256,
            ..BASE
        },
        // One head per group at N = 256: dB's and dC's rows stored, not added, the sequences
        // ending 22 tokens into a program.
        Case {
            nheads: 2,
            dstate: 256,
            state_dtype: DType::BF16,
            ..BASE
        },
    ];
    check_cases(&cases, 31, DType::BF16)
}

/// f16 values take the tensor-core kernels too, with P and N compiled in where they are 64 and
/// 64, 128 or 256, and read at run time elsewhere; bf16 states are converted into their f16
/// tiles, not copied as bits. At N = 30 and L = 151, dB and dC have 9,060 values, the last four
/// rounded to f16 one at a time.
#[test]
fn f16_gradients_match_the_cpu() -> Result<()> {
    let cases = [
        Case {
            dstate: 128,
            ngroups: 1,
            ..BASE
        },
        Case {
            seqlen: 151,
            dstate: 30,
            ngroups: 1,
            ..BASE
        },
        Case {
            headdim: 48,
            state_dtype: DType::BF16,
            ..BASE
        },
        Case {
            state_dtype: DType::BF16,
            ..BASE
        },
    ];
    check_cases(&cases, 41, DType::F16)
}

#[test]
fn xbc_gradients_match_the_cpu() -> Result<()> {
    let case = Case {
        seqlen: 190,
        ngroups: 1,
        d: 1,
        ..BASE
    };
    for dtype in [DType::F32, DType::BF16] {
        let worst = check(&case, 5, dtype, true)?;
        println!("xbc {dtype:?}: worst {worst:e}");
    }
    Ok(())
}

/// At N = 64 dB and dC are added by bwd_compute_out's atomics; at N = 128 (two heads in one group)
/// bwd_bc forms them where the device runs it.
#[test]
fn a_million_tokens_give_finite_gradients() -> Result<()> {
    for n in [64, 128] {
        million_tokens(n)?;
    }
    Ok(())
}

fn million_tokens(n: usize) -> Result<()> {
    let dev = gpu();
    let (l, h, p) = (1 << 20, 2, 64);
    let rng = &mut Rng::new(3);
    let var = |t: Tensor| Var::from_tensor(&t.to_dtype(DType::BF16)?.to_device(&dev)?);
    let cpu = &Device::Cpu;
    let x = var(rng.tensor(&[1, l, h, p], 1.0, cpu)?)?;
    let dt = var(rng.tensor_in(&[1, l, h], -3.0, 0.0, cpu)?)?;
    let b = var(rng.tensor(&[1, l, 1, n], 0.5, cpu)?)?;
    let c = var(rng.tensor(&[1, l, 1, n], 0.5, cpu)?)?;
    let a_log = Var::from_tensor(&rng.tensor_in(&[h], -1.0, 1.0, cpu)?.to_device(&dev)?)?;
    let a = a_log.as_tensor().exp()?.neg()?;
    let opts = SsdOptions {
        chunk_size: 256,
        dt: DtOptions {
            bias: None,
            softplus: true,
            limit: (0.0, f32::INFINITY),
        },
        ..Default::default()
    };
    let (y, last) = ssd(
        x.as_tensor(),
        dt.as_tensor(),
        &a,
        b.as_tensor(),
        c.as_tensor(),
        &opts,
    )?;
    let loss = (y.to_dtype(DType::F32)?.sqr()?.mean_all()? + last.sqr()?.mean_all()?)?;
    let store = loss.backward()?;
    for (name, v) in [
        ("x", &x),
        ("dt", &dt),
        ("B", &b),
        ("C", &c),
        ("A_log", &a_log),
    ] {
        let g = store
            .get(v.as_tensor())
            .unwrap_or_else(|| panic!("no gradient for {name}"));
        let sum = g
            .to_dtype(DType::F32)?
            .abs()?
            .sum_all()?
            .to_scalar::<f32>()?;
        assert!(
            sum.is_finite() && sum > 0.0,
            "N = {n}, {name}: gradient sum {sum}"
        );
    }
    Ok(())
}

/// `ssd_backward` (no autograd) gives autograd's gradients, on the GPU, with and without the
/// final state's gradient.
#[test]
fn ssd_backward_matches_autograd() -> Result<()> {
    let dev = gpu();
    let k = Case {
        seqlen: 177,
        d: 2,
        ..BASE
    };
    let inp = Inputs::new(&k, 9, DType::BF16)?;
    for dtype in [DType::F32, DType::BF16] {
        let t = OnDevice::new(&inp, dtype, &dev)?;
        let (x, dtv, a, b, c) = (&t.x, &t.dt, &t.a, &t.b, &t.c);
        let opts = t.opts(&k);
        let (dy, ws) = (&t.dy, &t.ws);
        for with_last in [false, true] {
            let g = ssd_backward(x, dtv, a, b, c, &opts, dy, with_last.then_some(ws))?;
            let vars = [x, dtv, b, c].map(Var::from_tensor);
            let [xv, dv, bv, cv] = vars;
            let (xv, dv, bv, cv) = (xv?, dv?, bv?, cv?);
            let (y, last) = ssd(
                xv.as_tensor(),
                dv.as_tensor(),
                a,
                bv.as_tensor(),
                cv.as_tensor(),
                &opts,
            )?;
            let mut loss = (y.to_dtype(DType::F32)? * dy.to_dtype(DType::F32)?)?.sum_all()?;
            if with_last {
                loss = (loss + (last.to_dtype(DType::F32)? * ws)?.sum_all()?)?;
            }
            let store = loss.backward()?;
            for (name, v, got) in [
                ("x", &xv, &g.x),
                ("dt", &dv, &g.dt),
                ("B", &bv, &g.b),
                ("C", &cv, &g.c),
            ] {
                let want = store
                    .get(v.as_tensor())
                    .expect("a gradient")
                    .to_dtype(DType::F32)?;
                let got = got.to_dtype(DType::F32)?;
                let scale = want.abs()?.max_all()?.to_scalar::<f32>()?;
                let err = (got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
                let tol = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
                assert!(
                    err <= tol * scale,
                    "{name} {dtype:?} last {with_last}: {err} of {scale}"
                );
            }
        }
    }
    Ok(())
}

/// `ssd_saving` + `ssd_backward_saved` give `ssd` + `ssd_backward`'s outputs and gradients (the
/// kept states at 128-token chunks for bf16 with N = 128, at 64 for f32 and N = 64; lengths not
/// multiples of either), and kept states of another call are refused.
#[test]
fn kept_states_give_the_same_gradients() -> Result<()> {
    let dev = gpu();
    let wide = Case {
        seqlen: 333,
        nheads: 4,
        ngroups: 1,
        dstate: 128,
        chunk: 256,
        ..BASE
    };
    let narrow = Case {
        seqlen: 150,
        chunk: 128,
        ..BASE
    };
    for (k, dtype) in [
        (wide, DType::BF16),
        (narrow, DType::F32),
        (narrow, DType::BF16),
    ] {
        let inp = Inputs::new(&k, 17, dtype)?;
        let t = OnDevice::new(&inp, dtype, &dev)?;
        let (x, dtv, a, b, c) = (&t.x, &t.dt, &t.a, &t.b, &t.c);
        let opts = t.opts(&k);
        let (dy, ws) = (&t.dy, &t.ws);
        let (y, last) = ssd(x, dtv, a, b, c, &opts)?;
        let (y_kept, last_kept, saved) = ssd_saving(x, dtv, a, b, c, &opts)?;
        assert!(!saved.is_empty(), "{k:?}: no states kept");
        let tol = if dtype == DType::F32 { 1e-5 } else { 2e-2 };
        let close = |name: &str, want: &Tensor, got: &Tensor| -> Result<()> {
            let (want, got) = (want.to_dtype(DType::F32)?, got.to_dtype(DType::F32)?);
            let scale = want.abs()?.max_all()?.to_scalar::<f32>()?;
            let err = (got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(
                err <= tol * scale,
                "{name} {dtype:?} {k:?}: {err} of {scale}"
            );
            Ok(())
        };
        close("y", &y, &y_kept)?;
        close("final state", &last, &last_kept)?;
        let want = ssd_backward(x, dtv, a, b, c, &opts, dy, Some(ws))?;
        let got = ssd_backward_saved(saved, x, dtv, a, b, c, &opts, dy, Some(ws))?;
        for (name, w, g) in [
            ("x", &want.x, &got.x),
            ("dt", &want.dt, &got.dt),
            ("A", &want.a, &got.a),
            ("B", &want.b, &got.b),
            ("C", &want.c, &got.c),
            ("dt_bias", &want.dt_bias, &got.dt_bias),
        ] {
            close(name, w, g)?;
        }
        close("D", want.d.as_ref().expect("D"), got.d.as_ref().expect("D"))?;
        let (wi, gi) = (want.initial_state.as_ref(), got.initial_state.as_ref());
        close("initial state", wi.expect("h0"), gi.expect("h0"))?;
    }
    // States kept for 150 tokens, offered to a backward of 300.
    let k = Case {
        seqlen: 300,
        ..wide
    };
    let inp = Inputs::new(&k, 3, DType::BF16)?;
    let on = |t: &Tensor| -> Result<Tensor> { t.to_device(&dev)?.to_dtype(DType::BF16) };
    let (x, dtv, b, c) = (on(&inp.x)?, on(&inp.dt)?, on(&inp.b)?, on(&inp.c)?);
    let a = inp.a_log.to_device(&dev)?.exp()?.neg()?;
    let opts = SsdOptions {
        chunk_size: 128,
        ..Default::default()
    };
    let short = |t: &Tensor| t.narrow(1, 0, 150);
    let (_, _, saved) = ssd_saving(
        &short(&x)?,
        &short(&dtv)?,
        &a,
        &short(&b)?,
        &short(&c)?,
        &opts,
    )?;
    let err = ssd_backward_saved(saved, &x, &dtv, &a, &b, &c, &opts, &on(&inp.wy)?, None)
        .expect_err("states of another call");
    assert!(err.to_string().contains("kept chunk states"), "{err}");
    Ok(())
}

/// Only the inputs that record gradients get one, and those equal `ssd_backward`'s: x and C,
/// then dt alone, then B alone recorded, the other inputs plain tensors.
#[test]
fn only_recording_inputs_get_gradients() -> Result<()> {
    let dev = gpu();
    let k = Case {
        seqlen: 140,
        ..BASE
    };
    let inp = Inputs::new(&k, 13, DType::F32)?;
    let on = |t: &Tensor| t.to_device(&dev);
    let plain = [on(&inp.x)?, on(&inp.dt)?, on(&inp.b)?, on(&inp.c)?];
    let a = on(&inp.a_log)?.exp()?.neg()?;
    let opts = SsdOptions {
        chunk_size: k.chunk,
        dt: DtOptions {
            bias: None,
            softplus: true,
            limit: (0.0, f32::INFINITY),
        },
        ..Default::default()
    };
    let dy = on(&inp.wy)?;
    let [x, dtv, b, c] = &plain;
    let want = ssd_backward(x, dtv, &a, b, c, &opts, &dy, None)?;
    let want = [&want.x, &want.dt, &want.b, &want.c];
    let names = ["x", "dt", "B", "C"];
    for recorded in [
        [true, false, false, true],
        [false, true, false, false],
        [false, false, true, false],
    ] {
        let mut vars = Vec::new();
        for (t, r) in plain.iter().zip(recorded) {
            vars.push(r.then(|| Var::from_tensor(t)).transpose()?);
        }
        let inputs: Vec<Tensor> = vars
            .iter()
            .zip(&plain)
            .map(|(v, t)| {
                v.as_ref()
                    .map_or_else(|| t.clone(), |v| v.as_tensor().clone())
            })
            .collect();
        let (y, _) = ssd(&inputs[0], &inputs[1], &a, &inputs[2], &inputs[3], &opts)?;
        let store = (y * &dy)?.sum_all()?.backward()?;
        for ((name, v), w) in names.iter().zip(&vars).zip(want) {
            let Some(v) = v else { continue };
            let g = store
                .get(v.as_tensor())
                .unwrap_or_else(|| panic!("no gradient for {name} ({recorded:?})"));
            let scale = w.abs()?.max_all()?.to_scalar::<f32>()?;
            let err = (g - w)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(
                err <= 1e-5 * scale,
                "{name}: off by {err:e} of {scale:e} ({recorded:?})"
            );
        }
    }
    Ok(())
}

/// Each output alone gets its own gradients (the loss reading only y, or only the final state),
/// and they add up to those of the loss on both, which the core op's backward computes once.
#[test]
fn each_output_alone_adds_up_to_both() -> Result<()> {
    let dev = gpu();
    let k = Case {
        seqlen: 160,
        ..BASE
    };
    let inp = Inputs::new(&k, 21, DType::F32)?;
    let on = |t: &Tensor| t.to_device(&dev);
    let vars = [on(&inp.x)?, on(&inp.dt)?, on(&inp.b)?, on(&inp.c)?].map(|t| Var::from_tensor(&t));
    let [x, dtv, b, c] = vars;
    let (x, dtv, b, c) = (x?, dtv?, b?, c?);
    let init = Var::from_tensor(&on(inp.init.as_ref().expect("init"))?)?;
    let a = on(&inp.a_log)?.exp()?.neg()?;
    let opts = SsdOptions {
        chunk_size: k.chunk,
        dt: DtOptions {
            bias: None,
            softplus: true,
            limit: (0.0, f32::INFINITY),
        },
        initial_state: Some(init.as_tensor()),
        ..Default::default()
    };
    let (wy, ws) = (on(&inp.wy)?, on(&inp.ws)?);
    let leaves = [&x, &dtv, &b, &c, &init];
    let grads = |which: (bool, bool)| -> Result<Vec<Tensor>> {
        let (y, last) = ssd(
            x.as_tensor(),
            dtv.as_tensor(),
            &a,
            b.as_tensor(),
            c.as_tensor(),
            &opts,
        )?;
        let mut loss = Tensor::zeros((), DType::F32, &dev)?;
        if which.0 {
            loss = (loss + (y * &wy)?.sum_all()?)?;
        }
        if which.1 {
            loss = (loss + (last * &ws)?.sum_all()?)?;
        }
        let store = loss.backward()?;
        leaves
            .iter()
            .map(|v| match store.get(v.as_tensor()) {
                Some(g) => Ok(g.clone()),
                None => v.as_tensor().zeros_like(),
            })
            .collect()
    };
    let (both, of_y, of_last) = (
        grads((true, true))?,
        grads((true, false))?,
        grads((false, true))?,
    );
    for (i, (w, (gy, gl))) in both.iter().zip(of_y.iter().zip(&of_last)).enumerate() {
        let sum = (gy + gl)?;
        let scale = w.abs()?.max_all()?.to_scalar::<f32>()?;
        let err = (sum - w)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(
            err <= 1e-5 * scale,
            "input {i}: off by {err:e} of {scale:e}"
        );
    }
    Ok(())
}
