//! Gradients of `gated_rms_norm` and `add_rms_norm` through candle's autograd against central
//! finite differences in f64: `loss = Σ out·W` for fixed random weights W, every input a `Var`,
//! each element stepped by `h = 1e-6·max(1, |v|)` (for an f32 input, the power of two at or below
//! it, so that `v ± h` is exact), `(L(v+h) − L(v−h)) / 2h` from the unrecorded forward. The error
//! of one input's gradient is `max |grad − fd| / max |fd|`, at most 1e-6.

mod common;

use candle_core::{DType, Device, Result, Tensor, Var};
use common::grad::{backward_grads, check_grads, weighted};
use common::{rel_err, Rng};
use mamba2::kernels::{add_rms_norm, gated_rms_norm};

const EPS: f64 = 1e-5;

/// Random `[x, z, weight]` of `shape` in f64, z widened to `z_width` channels (the norm reads its
/// first D), and loss weights.
fn gated_inputs(shape: &[usize], z_width: usize, seed: u64) -> Result<(Vec<Tensor>, Tensor)> {
    let dev = Device::Cpu;
    let mut rng = Rng::new(seed);
    let d = shape[shape.len() - 1];
    let mut z_shape = shape.to_vec();
    z_shape[shape.len() - 1] = z_width;
    let ins = vec![
        rng.tensor(shape, 1.0, &dev)?,
        rng.tensor(&z_shape, 2.0, &dev)?,
        rng.tensor_in(&[d], 0.5, 1.5, &dev)?,
    ];
    let ins = ins
        .into_iter()
        .map(|t| t.to_dtype(DType::F64))
        .collect::<Result<Vec<_>>>()?;
    Ok((ins, rng.tensor(shape, 1.0, &dev)?.to_dtype(DType::F64)?))
}

fn gated_loss(ins: &[Tensor], group: usize, lw: &Tensor) -> Result<Tensor> {
    let d = ins[0].dims()[ins[0].rank() - 1];
    let z = ins[1].narrow(ins[1].rank() - 1, 0, d)?;
    weighted(&gated_rms_norm(&ins[0], &z, &ins[2], group, EPS)?, lw)
}

#[test]
fn gated_norm_gradients_match_finite_differences() -> Result<()> {
    let cases = [
        (vec![2, 3, 8], 8, 8),
        (vec![2, 3, 8], 4, 8),
        (vec![5, 6], 3, 6),
        // z a slice of a wider tensor, as the mixer's gate is.
        (vec![2, 2, 8], 4, 12),
    ];
    for (i, (shape, group, z_width)) in cases.into_iter().enumerate() {
        let (ins, lw) = gated_inputs(&shape, z_width, 100 + i as u64)?;
        let groups = shape[shape.len() - 1] / group;
        let name = format!("gated norm {shape:?} G{groups} z width {z_width}");
        check_grads(&name, &ins, &|ins| gated_loss(ins, group, &lw))?;
    }
    Ok(())
}

struct AddCase {
    residual: bool,
    residual_in_fp32: bool,
}

/// Random `[x, weight, (residual)]` of `shape` (x and weight f64, the residual in its dtype) and
/// loss weights for y and the new residual.
fn add_inputs(c: &AddCase, shape: &[usize], seed: u64) -> Result<(Vec<Tensor>, Tensor, Tensor)> {
    let dev = Device::Cpu;
    let mut rng = Rng::new(seed);
    let d = shape[shape.len() - 1];
    let f64t = |t: Tensor| t.to_dtype(DType::F64);
    let mut ins = vec![
        f64t(rng.tensor(shape, 1.0, &dev)?)?,
        f64t(rng.tensor_in(&[d], 0.5, 1.5, &dev)?)?,
    ];
    if c.residual {
        let rdtype = if c.residual_in_fp32 {
            DType::F32
        } else {
            DType::F64
        };
        ins.push(rng.tensor(shape, 2.0, &dev)?.to_dtype(rdtype)?);
    }
    let wy = f64t(rng.tensor(shape, 1.0, &dev)?)?;
    let wr = f64t(rng.tensor(shape, 1.0, &dev)?)?;
    Ok((ins, wy, wr))
}

/// `add_rms_norm` on `[x, weight, (residual)]`.
fn add_norm(ins: &[Tensor], residual_in_fp32: bool) -> Result<(Tensor, Tensor)> {
    add_rms_norm(&ins[0], ins.get(2), &ins[1], EPS, residual_in_fp32)
}

#[test]
fn add_norm_gradients_match_finite_differences() -> Result<()> {
    let shape = [2, 3, 8];
    let mut seed = 200;
    for residual_in_fp32 in [false, true] {
        for residual in [false, true] {
            let c = AddCase {
                residual,
                residual_in_fp32,
            };
            let (ins, wy, wr) = add_inputs(&c, &shape, seed)?;
            seed += 1;
            let name = format!("add norm residual {residual} fp32 {residual_in_fp32}");
            // An f32 new residual is rounded: its term would drown the differences in rounding
            // steps, so it is checked apart, below.
            check_grads(&name, &ins, &|ins| {
                let (y, r) = add_norm(ins, residual_in_fp32)?;
                let loss = weighted(&y, &wy)?;
                if residual_in_fp32 {
                    Ok(loss)
                } else {
                    loss.add(&weighted(&r, &wr)?)
                }
            })?;
            if residual_in_fp32 {
                // The new residual passes its gradient (rounded to f32) to x and the residual
                // unchanged, and none to the weight.
                let vars = ins
                    .iter()
                    .map(Var::from_tensor)
                    .collect::<Result<Vec<_>>>()?;
                let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
                let grads = weighted(&add_norm(&ts, true)?.1, &wr)?.backward()?;
                let want = wr.to_dtype(DType::F32)?;
                for (i, t) in ts.iter().enumerate() {
                    match (i, grads.get(t)) {
                        (1, g) => assert!(g.is_none(), "{name}: weight"),
                        (_, Some(g)) => assert_eq!(rel_err(g, &want)?, 0.0, "{name}: input {i}"),
                        (_, None) => panic!("{name}: no gradient for input {i}"),
                    }
                }
            }
        }
    }
    Ok(())
}

/// Plain tensors record nothing; with `Var`s the outputs equal the unrecorded ones in every dtype.
#[test]
fn inference_records_nothing_and_training_computes_the_same() -> Result<()> {
    let (ins, _) = gated_inputs(&[3, 8], 8, 300)?;
    let y = gated_rms_norm(&ins[0], &ins[1], &ins[2], 4, EPS)?;
    assert!(!y.track_op());
    let z = Var::from_tensor(&ins[1])?;
    let rec = gated_rms_norm(&ins[0], z.as_tensor(), &ins[2], 4, EPS)?;
    assert!(rec.track_op());
    assert_eq!(rel_err(&rec, &y)?, 0.0);
    // Only z a Var: x and the weight get no gradient.
    let grads = rec.sum_all()?.backward()?;
    assert!(grads.get(z.as_tensor()).is_some());
    assert!(grads.get(&ins[0]).is_none() && grads.get(&ins[2]).is_none());

    for dtype in [DType::F64, DType::F32, DType::BF16] {
        for residual_in_fp32 in [false, true] {
            let c = AddCase {
                residual: true,
                residual_in_fp32,
            };
            let (ins, _, _) = add_inputs(&c, &[3, 16], 310)?;
            let rdtype = if residual_in_fp32 { DType::F32 } else { dtype };
            let ins = [
                ins[0].to_dtype(dtype)?,
                ins[1].to_dtype(dtype)?,
                ins[2].to_dtype(rdtype)?,
            ];
            let (y, r) = add_norm(&ins, residual_in_fp32)?;
            assert!(!y.track_op() && !r.track_op());
            let x = Var::from_tensor(&ins[0])?;
            let (ry, rr) = add_norm(
                &[x.as_tensor().clone(), ins[1].clone(), ins[2].clone()],
                residual_in_fp32,
            )?;
            assert!(ry.track_op() && rr.track_op());
            let ctx = format!("{dtype:?} fp32 residual {residual_in_fp32}");
            assert_eq!((ry.dtype(), rr.dtype()), (dtype, rdtype), "{ctx}");
            assert_eq!(rel_err(&ry, &y)?, 0.0, "y {ctx}");
            assert_eq!(rel_err(&rr, &r)?, 0.0, "residual {ctx}");
        }
    }
    Ok(())
}

/// f32 inputs give the f64 gradients to f32 accuracy.
#[test]
fn f32_gradients_agree_with_f64() -> Result<()> {
    let to32 = |ins: &[Tensor]| -> Result<Vec<Tensor>> {
        ins.iter().map(|t| t.to_dtype(DType::F32)).collect()
    };
    let compare = |name: &str, got: &[Tensor], want: &[Tensor]| -> Result<()> {
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert_eq!(g.dtype(), DType::F32);
            let e = rel_err(g, w)?;
            println!("{name}: f32 vs f64 gradient {i} rel err {e:.1e}");
            assert!(e <= 1e-4, "{name}: f32 gradient {i} rel err {e:e}");
        }
        Ok(())
    };
    let (ins, lw) = gated_inputs(&[4, 7, 32], 32, 400)?;
    let loss = |ins: &[Tensor]| gated_loss(ins, 16, &lw);
    let want = backward_grads(&ins, &loss)?;
    compare("gated norm", &backward_grads(&to32(&ins)?, &loss)?, &want)?;

    let c = AddCase {
        residual: true,
        residual_in_fp32: false,
    };
    let (ins, wy, wr) = add_inputs(&c, &[4, 7, 32], 401)?;
    let loss = |ins: &[Tensor]| {
        let (y, r) = add_norm(ins, false)?;
        weighted(&y, &wy)?.add(&weighted(&r, &wr)?)
    };
    let want = backward_grads(&ins, &loss)?;
    compare("add norm", &backward_grads(&to32(&ins)?, &loss)?, &want)?;
    Ok(())
}

/// `gated_rms_norm_backward`, the backward without autograd, returns autograd's gradients (which
/// the finite differences above check).
#[test]
fn gated_norm_backward_without_autograd_equals_autograd() -> Result<()> {
    let (shape, group) = (vec![3, 5, 12], 4);
    let (ins, lw) = gated_inputs(&shape, 12, 7)?;
    let want = backward_grads(&ins, &|ins| gated_loss(ins, group, &lw))?;
    let (dx, dz, dw) =
        mamba2::kernels::gated_rms_norm_backward(&ins[0], &ins[1], &ins[2], group, EPS, &lw)?;
    for (name, got, want) in [
        ("dx", dx, &want[0]),
        ("dz", dz, &want[1]),
        ("dweight", dw, &want[2]),
    ] {
        let err = rel_err(&got, want)?;
        assert!(err < 1e-12, "{name}: {err}");
    }
    let bad = mamba2::kernels::gated_rms_norm_backward(&ins[0], &ins[1], &ins[2], 5, EPS, &lw);
    let msg = bad.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(msg.contains("group_size (5) must divide"), "{msg}");
    // The `_into` form: dz in columns 2..14 of a wider buffer.
    let buffer = Tensor::zeros((3, 5, 20), DType::F64, &Device::Cpu)?;
    let (dx, dw) = mamba2::kernels::gated_rms_norm_backward_into(
        &ins[0],
        &ins[1],
        &ins[2],
        (group, EPS),
        &lw,
        (&buffer, 2),
    )?;
    assert!(
        rel_err(&buffer.narrow(2, 2, 12)?, &want[1])? < 1e-12,
        "dz into"
    );
    assert!(rel_err(&dx, &want[0])? < 1e-12 && rel_err(&dw, &want[2])? < 1e-12);
    let bad = mamba2::kernels::gated_rms_norm_backward_into(
        &ins[0],
        &ins[1],
        &ins[2],
        (group, EPS),
        &lw,
        (&buffer, 9),
    );
    let msg = bad.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(msg.contains("dz_buffer"), "{msg}");
    Ok(())
}

/// `add_rms_norm_backward`, the backward without autograd, returns autograd's gradient of y for
/// the weight, and for x and the residual alike (both equal d sum), plus the carried gradient.
#[test]
fn add_norm_backward_without_autograd_equals_autograd() -> Result<()> {
    let dev = Device::Cpu;
    let mut rng = Rng::new(11);
    let shape = [3, 5, 12];
    let f64t = |t: Tensor| t.to_dtype(DType::F64);
    let ins = vec![
        f64t(rng.tensor(&shape, 1.0, &dev)?)?,
        f64t(rng.tensor_in(&[12], 0.5, 1.5, &dev)?)?,
        f64t(rng.tensor(&shape, 1.0, &dev)?)?,
    ];
    let lw = f64t(rng.tensor(&shape, 1.0, &dev)?)?;
    let carried = f64t(rng.tensor(&shape, 1.0, &dev)?)?;
    let loss = |ins: &[Tensor]| -> Result<Tensor> {
        let (y, _) = add_rms_norm(&ins[0], Some(&ins[2]), &ins[1], EPS, false)?;
        weighted(&y, &lw)
    };
    let want = backward_grads(&ins, &loss)?;
    let sum = (&ins[0] + &ins[2])?;
    let g = mamba2::kernels::add_rms_norm_backward(&sum, &ins[1], EPS, &lw, None)?;
    for (name, got, want) in [
        ("dx", &g.x, &want[0]),
        ("dresidual", &g.residual, &want[2]),
        ("dweight", &g.weight, &want[1]),
    ] {
        let err = rel_err(got, want)?;
        assert!(err < 1e-12, "{name}: {err}");
    }
    let with = mamba2::kernels::add_rms_norm_backward(&sum, &ins[1], EPS, &lw, Some(&carried))?;
    let err = rel_err(&with.residual, &(&want[2] + &carried)?)?;
    assert!(err < 1e-12, "carried + d sum: {err}");
    let bad =
        mamba2::kernels::add_rms_norm_backward(&sum, &ins[1].narrow(0, 0, 5)?, EPS, &lw, None);
    let msg = bad.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(msg.contains("weight"), "{msg}");
    let narrow = carried.to_dtype(DType::F32)?;
    let bad = mamba2::kernels::add_rms_norm_backward(&sum, &ins[1], EPS, &lw, Some(&narrow));
    let msg = bad.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(msg.contains("carried"), "{msg}");
    Ok(())
}
