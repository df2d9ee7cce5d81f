//! The training-path ops: `cross_entropy` (value against candle's log-softmax composition,
//! gradient against central finite differences in f64, bad input named), `embedding` (rows picked,
//! gradient against finite differences in f64 with repeated ids) and `ssd_xbc` (the values and
//! gradients of `ssd` on the three slices of xbc, and its gradients against finite differences).

mod common;

use candle_core::{DType, Device, Result, Tensor, D};
use common::grad::{backward_grads, check_grads, weighted};
use common::{expect_err, rel_err, Rng};
use mamba2::kernels::{
    cross_entropy, embedding, linear_cross_entropy, ssd, ssd_xbc, DtOptions, SsdOptions,
};

fn targets(rows: usize, vocab: usize, rng: &mut Rng) -> Result<Tensor> {
    let ids: Vec<u32> = (0..rows).map(|_| rng.below(vocab) as u32).collect();
    Tensor::from_vec(ids, rows, &Device::Cpu)
}

#[test]
fn cross_entropy_equals_log_softmax_and_matches_finite_differences() -> Result<()> {
    let mut rng = Rng::new(7);
    for (rows, vocab) in [(1, 1), (3, 5), (17, 33)] {
        let logits = rng.tensor(&[rows, vocab], 3.0, &Device::Cpu)?;
        let ids = targets(rows, vocab, &mut rng)?;
        let logp = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
        let want = logp.gather(&ids.unsqueeze(1)?, 1)?.mean_all()?.neg()?;
        let got = cross_entropy(&logits, &ids)?;
        assert_eq!(got.dtype(), DType::F32);
        let err = (got.to_scalar::<f32>()? - want.to_scalar::<f32>()?).abs();
        assert!(err < 1e-5, "[{rows}, {vocab}]: {err}");
        let x = logits.to_dtype(DType::F64)?;
        let name = format!("cross_entropy [{rows}, {vocab}]");
        check_grads(&name, &[x], &|ins| cross_entropy(&ins[0], &ids))?;
    }
    // bf16 logits: an f32 loss, a bf16 gradient.
    let logits = rng
        .tensor(&[4, 9], 2.0, &Device::Cpu)?
        .to_dtype(DType::BF16)?;
    let ids = targets(4, 9, &mut rng)?;
    let g = backward_grads(std::slice::from_ref(&logits), &|ins| {
        cross_entropy(&ins[0], &ids)
    })?;
    assert_eq!(cross_entropy(&logits, &ids)?.dtype(), DType::F32);
    assert_eq!(g[0].dtype(), DType::BF16);
    Ok(())
}

#[test]
fn embedding_picks_rows_and_matches_finite_differences() -> Result<()> {
    let mut rng = Rng::new(9);
    let weight = rng
        .tensor(&[5, 3], 1.0, &Device::Cpu)?
        .to_dtype(DType::F64)?;
    // Repeated ids: their rows' gradients add up.
    let ids = Tensor::new(&[[4u32, 0, 4], [2, 4, 0]], &Device::Cpu)?;
    let y = embedding(&weight, &ids)?;
    assert_eq!(y.dims(), &[2, 3, 3]);
    let want = weight
        .index_select(&ids.flatten_all()?, 0)?
        .reshape((2, 3, 3))?;
    assert_eq!(y.to_vec3::<f64>()?, want.to_vec3::<f64>()?);
    let w = rng
        .tensor(&[2, 3, 3], 1.0, &Device::Cpu)?
        .to_dtype(DType::F64)?;
    check_grads("embedding [5, 3]", &[weight], &|ins| {
        weighted(&embedding(&ins[0], &ids)?, &w)
    })?;
    Ok(())
}

#[test]
fn cross_entropy_names_bad_input() -> Result<()> {
    let dev = &Device::Cpu;
    let logits = Tensor::zeros((2, 4), DType::F32, dev)?;
    let ids = |v: &[u32]| Tensor::new(v, dev);
    expect_err(cross_entropy(&logits, &ids(&[0, 4])?), "target 4 at row 1");
    expect_err(cross_entropy(&logits, &ids(&[0])?), "targets");
    expect_err(cross_entropy(&logits.flatten_all()?, &ids(&[0])?), "logits");
    let neg = Tensor::new(&[0i64, -1], dev)?;
    expect_err(cross_entropy(&logits, &neg), "target -1 at row 1");
    let float_ids = Tensor::new(&[0f32, 1.0], dev)?;
    expect_err(cross_entropy(&logits, &float_ids), "u8, u32 or i64");
    let empty = Tensor::zeros((0, 4), DType::F32, dev)?;
    expect_err(
        cross_entropy(&empty, &Tensor::zeros(0, DType::U32, dev)?),
        "empty",
    );
    let nan = Tensor::new(&[[0f32, f32::NAN]], dev)?;
    assert!(cross_entropy(&nan, &ids(&[0])?)?
        .to_scalar::<f32>()?
        .is_nan());
    Ok(())
}

#[test]
fn linear_cross_entropy_names_bad_input() -> Result<()> {
    let dev = &Device::Cpu;
    let hidden = Tensor::zeros((2, 3), DType::F32, dev)?;
    let weight = Tensor::zeros((5, 3), DType::F32, dev)?;
    let ids = Tensor::new(&[0u32, 4], dev)?;
    let narrow = Tensor::zeros((5, 2), DType::F32, dev)?;
    expect_err(linear_cross_entropy(&hidden, &narrow, &ids), "[V, 3]");
    let wide = weight.to_dtype(DType::F64)?;
    expect_err(linear_cross_entropy(&hidden, &wide, &ids), "weight");
    expect_err(
        linear_cross_entropy(&hidden.flatten_all()?, &weight, &ids),
        "hidden",
    );
    expect_err(
        linear_cross_entropy(&hidden, &weight, &Tensor::new(&[0u32], dev)?),
        "targets",
    );
    expect_err(
        linear_cross_entropy(&hidden, &weight, &Tensor::new(&[0u32, 5], dev)?),
        "target 5 at row 1",
    );
    Ok(())
}

/// `(xbc, dt, a_log, D, bias, init)` of a small case in f64 and the loss weights of y and the
/// final state.
fn xbc_inputs(
    (b, l, h, p, g, n): (usize, usize, usize, usize, usize, usize),
    rng: &mut Rng,
) -> Result<(Vec<Tensor>, Tensor, Tensor)> {
    let dev = &Device::Cpu;
    let ins = vec![
        rng.tensor(&[b, l, h * p + 2 * g * n], 1.0, dev)?,
        rng.tensor_in(&[b, l, h], -1.5, 0.5, dev)?,
        rng.tensor_in(&[h], -0.5, 1.5, dev)?,
        rng.tensor(&[h], 1.0, dev)?,
        rng.tensor_in(&[h], -0.5, 0.5, dev)?,
        rng.tensor(&[b, h, p, n], 0.5, dev)?,
    ];
    let ins = ins
        .into_iter()
        .map(|t| t.to_dtype(DType::F64))
        .collect::<Result<Vec<_>>>()?;
    let wy = rng.tensor(&[b, l, h, p], 1.0, dev)?.to_dtype(DType::F64)?;
    let ws = rng.tensor(&[b, h, p, n], 1.0, dev)?.to_dtype(DType::F64)?;
    Ok((ins, wy, ws))
}

fn options<'a>(ins: &'a [Tensor], chunk: usize) -> SsdOptions<'a> {
    SsdOptions {
        chunk_size: chunk,
        dt: DtOptions {
            bias: Some(&ins[4]),
            softplus: true,
            limit: (0.0, 2.0),
        },
        d: Some(&ins[3]),
        z: None,
        initial_state: Some(&ins[5]),
        state_dtype: DType::F64,
    }
}

#[test]
fn ssd_xbc_equals_ssd_on_the_slices_and_matches_finite_differences() -> Result<()> {
    let mut rng = Rng::new(11);
    for (shape, chunk) in [((2, 21, 4, 3, 2, 5), 16), ((1, 9, 2, 4, 1, 3), 16)] {
        let (b, l, h, p, g, n) = shape;
        let (ins, wy, ws) = xbc_inputs(shape, &mut rng)?;
        let packed = |ins: &[Tensor]| -> Result<Tensor> {
            let a = ins[2].exp()?.neg()?;
            let (y, last) = ssd_xbc(&ins[0], &ins[1], &a, (g, n), &options(ins, chunk))?;
            weighted(&y, &wy)? + weighted(&last, &ws)?
        };
        let sliced = |ins: &[Tensor]| -> Result<Tensor> {
            let a = ins[2].exp()?.neg()?;
            let xbc = &ins[0];
            let x = xbc.narrow(2, 0, h * p)?.reshape((b, l, h, p))?;
            let bm = xbc.narrow(2, h * p, g * n)?.reshape((b, l, g, n))?;
            let cm = xbc.narrow(2, h * p + g * n, g * n)?.reshape((b, l, g, n))?;
            let (y, last) = ssd(&x, &ins[1], &a, &bm, &cm, &options(ins, chunk))?;
            weighted(&y, &wy)? + weighted(&last, &ws)?
        };
        let ours = backward_grads(&ins, &packed)?;
        let theirs = backward_grads(&ins, &sliced)?;
        for (i, (o, t)) in ours.iter().zip(&theirs).enumerate() {
            let e = rel_err(o, t)?;
            assert!(
                e < 1e-12,
                "{shape:?}: gradient {i} differs from ssd's by {e:e}"
            );
        }
        check_grads(&format!("ssd_xbc {shape:?}"), &ins, &packed)?;
    }
    Ok(())
}

#[test]
fn ssd_xbc_names_a_width_that_does_not_split() -> Result<()> {
    let dev = &Device::Cpu;
    let xbc = Tensor::zeros((1, 4, 13), DType::F32, dev)?;
    let dt = Tensor::zeros((1, 4, 2), DType::F32, dev)?;
    let a = Tensor::new(&[-1f32, -1.0], dev)?;
    let opts = SsdOptions {
        chunk_size: 16,
        ..Default::default()
    };
    expect_err(ssd_xbc(&xbc, &dt, &a, (1, 4), &opts), "width 13");
    expect_err(ssd_xbc(&xbc, &dt, &a, (usize::MAX, 4), &opts), "width 13");
    Ok(())
}
