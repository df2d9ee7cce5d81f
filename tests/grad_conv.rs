//! Gradients of `causal_conv1d` / `causal_conv1d_split` through candle's autograd against central
//! finite differences in f64: `loss = Σ out·W` for fixed random weights W, every input a `Var`,
//! each element stepped by `h = 1e-6·max(1, |v|)`, `(L(v+h) − L(v−h)) / 2h` from the unrecorded
//! forward. The error of one input's gradient is `max |grad − fd| / max |fd|`, at most 1e-6.

mod common;

use candle_core::{DType, Device, Result, Tensor, Var};
use common::grad::{backward_grads, check_grads, weighted};
use common::{rel_err, Rng};
use mamba2::kernels::{causal_conv1d, causal_conv1d_split, ConvOptions};

struct Case {
    batch: usize,
    seqlen: usize,
    dim: usize,
    width: usize,
    bias: bool,
    state: bool,
    silu: bool,
}

/// Inputs `[x, weight, (bias)]` in f64, the initial state (if any) and the loss weights.
fn inputs(c: &Case, seed: u64) -> Result<(Vec<Tensor>, Option<Tensor>, Tensor)> {
    let dev = Device::Cpu;
    let mut rng = Rng::new(seed);
    let f64t = |t: Tensor| t.to_dtype(DType::F64);
    let mut ins = vec![
        f64t(rng.tensor(&[c.batch, c.seqlen, c.dim], 1.0, &dev)?)?,
        f64t(rng.tensor(&[c.dim, c.width], 0.7, &dev)?)?,
    ];
    if c.bias {
        ins.push(f64t(rng.tensor(&[c.dim], 0.5, &dev)?)?);
    }
    let state = c
        .state
        .then(|| rng.tensor(&[c.batch, c.dim, c.width], 1.0, &dev))
        .transpose()?
        .map(f64t)
        .transpose()?;
    let lw = f64t(rng.tensor(&[c.batch, c.seqlen, c.dim], 1.0, &dev)?)?;
    Ok((ins, state, lw))
}

fn conv_loss(ins: &[Tensor], state: Option<&Tensor>, silu: bool, lw: &Tensor) -> Result<Tensor> {
    let opts = ConvOptions {
        bias: ins.get(2),
        silu,
    };
    let (y, _) = causal_conv1d(&ins[0], &ins[1], state, &opts)?;
    weighted(&y, lw)
}

fn check_case(c: &Case, seed: u64) -> Result<()> {
    let (ins, state, lw) = inputs(c, seed)?;
    let name = format!(
        "conv B{} L{} D{} K{} bias {} state {} silu {}",
        c.batch, c.seqlen, c.dim, c.width, c.bias, c.state, c.silu
    );
    check_grads(&name, &ins, &|ins| {
        conv_loss(ins, state.as_ref(), c.silu, &lw)
    })?;
    Ok(())
}

#[test]
fn conv_gradients_match_finite_differences() -> Result<()> {
    let cases = [
        (3, 7, true, true, true),
        (4, 7, true, true, true),
        (4, 6, false, false, false),
        (4, 6, true, false, true),
        (4, 6, false, true, false),
        (3, 5, false, true, true),
        (1, 5, true, true, true),
        (1, 4, false, false, false),
        // Fewer tokens than taps: the first outputs read the state.
        (4, 2, true, true, true),
    ];
    for (i, (width, seqlen, bias, state, silu)) in cases.into_iter().enumerate() {
        let case = Case {
            batch: 2,
            seqlen,
            dim: 3,
            width,
            bias,
            state,
            silu,
        };
        check_case(&case, 10 + i as u64)?;
    }
    Ok(())
}

/// The gradient reaches a wider tensor x is a slice of, and flows through one split piece only.
#[test]
fn split_piece_gradient_matches_finite_differences() -> Result<()> {
    let dev = Device::Cpu;
    let mut rng = Rng::new(40);
    let (b, l, d, k) = (2, 6, 5, 4);
    let f64t = |t: Tensor| t.to_dtype(DType::F64);
    let wide = f64t(rng.tensor(&[b, l, d + 3], 1.0, &dev)?)?;
    let w = f64t(rng.tensor(&[d, k], 0.7, &dev)?)?;
    let bias = f64t(rng.tensor(&[d], 0.5, &dev)?)?;
    let state = f64t(rng.tensor(&[b, d, k], 1.0, &dev)?)?;
    let lw = f64t(rng.tensor(&[b, l, 1], 1.0, &dev)?)?;
    for piece in 0..3 {
        let loss = |ins: &[Tensor]| -> Result<Tensor> {
            let x = ins[0].narrow(2, 2, d)?;
            let opts = ConvOptions {
                bias: Some(&ins[2]),
                silu: true,
            };
            let (pieces, _) = causal_conv1d_split(&x, &ins[1], Some(&state), &opts, &[2, 1, 2])?;
            let lw = lw.broadcast_as(pieces[piece].shape())?;
            weighted(&pieces[piece], &lw)
        };
        let name = format!("conv split [2, 1, 2], piece {piece}, x a slice");
        check_grads(&name, &[wide.clone(), w.clone(), bias.clone()], &loss)?;
    }
    Ok(())
}

/// Plain tensors record nothing; with `Var`s the outputs equal the unrecorded ones and the new
/// state carries no gradient.
#[test]
fn inference_records_nothing_and_training_computes_the_same() -> Result<()> {
    let case = Case {
        batch: 2,
        seqlen: 9,
        dim: 6,
        width: 4,
        bias: true,
        state: true,
        silu: true,
    };
    let (ins, state, _) = inputs(&case, 50)?;
    let opts = ConvOptions {
        bias: Some(&ins[2]),
        silu: true,
    };
    let split = [3, 1, 2];
    let (pieces, new_state) = causal_conv1d_split(&ins[0], &ins[1], state.as_ref(), &opts, &split)?;
    assert!(pieces.iter().all(|p| !p.track_op()) && !new_state.track_op());
    let x = Var::from_tensor(&ins[0])?;
    let (rec, rec_state) =
        causal_conv1d_split(x.as_tensor(), &ins[1], state.as_ref(), &opts, &split)?;
    assert!(rec.iter().all(Tensor::track_op) && !rec_state.track_op());
    for (p, r) in pieces.iter().zip(&rec) {
        assert_eq!(rel_err(r, p)?, 0.0);
    }
    assert_eq!(rel_err(&rec_state, &new_state)?, 0.0);
    // Only the weight a Var: x and the bias get no gradient.
    let w = Var::from_tensor(&ins[1])?;
    let opts = ConvOptions {
        bias: Some(&ins[2]),
        silu: true,
    };
    let (y, _) = causal_conv1d(&ins[0], w.as_tensor(), state.as_ref(), &opts)?;
    let grads = y.sum_all()?.backward()?;
    assert!(grads.get(w.as_tensor()).is_some());
    assert!(grads.get(&ins[0]).is_none() && grads.get(&ins[2]).is_none());
    Ok(())
}

/// f32 inputs give the f64 gradients to f32 accuracy.
#[test]
fn f32_gradients_agree_with_f64() -> Result<()> {
    for (silu, seed) in [(true, 60), (false, 61)] {
        let case = Case {
            batch: 2,
            seqlen: 33,
            dim: 8,
            width: 4,
            bias: true,
            state: true,
            silu,
        };
        let (ins, state, lw) = inputs(&case, seed)?;
        let loss = |ins: &[Tensor], state: Option<&Tensor>| conv_loss(ins, state, silu, &lw);
        let want = backward_grads(&ins, &|ins| loss(ins, state.as_ref()))?;
        let ins32 = ins
            .iter()
            .map(|t| t.to_dtype(DType::F32))
            .collect::<Result<Vec<_>>>()?;
        let state32 = state.map(|s| s.to_dtype(DType::F32)).transpose()?;
        let got = backward_grads(&ins32, &|ins| loss(ins, state32.as_ref()))?;
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.dtype(), DType::F32);
            let e = rel_err(g, w)?;
            println!("conv silu {silu}: f32 vs f64 gradient {i} rel err {e:.1e}");
            assert!(e <= 1e-4, "f32 gradient {i} rel err {e:e}");
        }
    }
    Ok(())
}

/// `causal_conv1d_backward`, the backward without autograd, returns autograd's gradients (which
/// the finite differences above check), with and without a bias and an initial state.
#[test]
fn conv_backward_without_autograd_equals_autograd() -> Result<()> {
    for (bias, state) in [(true, true), (false, false)] {
        let c = Case {
            batch: 2,
            seqlen: 9,
            dim: 5,
            width: 4,
            bias,
            state,
            silu: true,
        };
        let (ins, state, lw) = inputs(&c, 11)?;
        let want = backward_grads(&ins, &|ins| conv_loss(ins, state.as_ref(), true, &lw))?;
        let opts = ConvOptions {
            bias: ins.get(2),
            silu: true,
        };
        let g =
            mamba2::kernels::causal_conv1d_backward(&ins[0], &ins[1], state.as_ref(), &opts, &lw)?;
        assert!(rel_err(&g.x, &want[0])? < 1e-12, "dx");
        assert!(rel_err(&g.weight, &want[1])? < 1e-12, "dweight");
        match (g.bias, want.get(2)) {
            (Some(got), Some(want)) => assert!(rel_err(&got, want)? < 1e-12, "dbias"),
            (None, None) => {}
            _ => panic!("a bias gradient without a bias, or none with one"),
        }
    }
    Ok(())
}

/// `causal_conv1d_split_backward` takes dy as the pieces `causal_conv1d_split` returns and gives
/// the gradients of the whole dy; pieces that do not cut D are an error naming them.
#[test]
fn conv_split_backward_equals_the_whole_backward() -> Result<()> {
    let mut rng = Rng::new(31);
    let dev = Device::Cpu;
    let x = rng.tensor(&[2, 9, 10], 1.0, &dev)?;
    let w = rng.tensor(&[10, 4], 0.5, &dev)?;
    let bias = rng.tensor(&[10], 0.5, &dev)?;
    let dy = rng.tensor(&[2, 9, 10], 1.0, &dev)?;
    let opts = ConvOptions {
        bias: Some(&bias),
        silu: true,
    };
    let whole = mamba2::kernels::causal_conv1d_backward(&x, &w, None, &opts, &dy)?;
    let pieces = [
        dy.narrow(2, 0, 6)?,
        dy.narrow(2, 6, 2)?,
        dy.narrow(2, 8, 2)?,
    ];
    let split = mamba2::kernels::causal_conv1d_split_backward(&x, &w, None, &opts, &pieces)?;
    assert_eq!(split.x.to_vec3::<f32>()?, whole.x.to_vec3::<f32>()?);
    assert_eq!(
        split.weight.to_vec2::<f32>()?,
        whole.weight.to_vec2::<f32>()?
    );
    let short = mamba2::kernels::causal_conv1d_split_backward(&x, &w, None, &opts, &pieces[..2]);
    let msg = short.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(msg.contains("summing to D = 10"), "{msg}");
    // The `_into` form: dx in columns 3..13 of a wider buffer, the rest untouched.
    let buffer = Tensor::ones((2, 9, 16), DType::F32, &dev)?;
    let (dw, db) = mamba2::kernels::causal_conv1d_split_backward_into(
        &x,
        &w,
        None,
        &opts,
        &pieces,
        (&buffer, 3),
    )?;
    assert_eq!(
        buffer.narrow(2, 3, 10)?.to_vec3::<f32>()?,
        whole.x.to_vec3::<f32>()?
    );
    let rest = Tensor::cat(&[buffer.narrow(2, 0, 3)?, buffer.narrow(2, 13, 3)?], 2)?;
    assert_eq!(rest.flatten_all()?.min(0)?.to_scalar::<f32>()?, 1.0);
    assert_eq!(dw.to_vec2::<f32>()?, whole.weight.to_vec2::<f32>()?);
    assert!(db.is_some());
    let small = Tensor::ones((2, 9, 12), DType::F32, &dev)?;
    let bad = mamba2::kernels::causal_conv1d_split_backward_into(
        &x,
        &w,
        None,
        &opts,
        &pieces,
        (&small, 3),
    );
    let msg = bad.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(msg.contains("dx_buffer"), "{msg}");
    Ok(())
}
