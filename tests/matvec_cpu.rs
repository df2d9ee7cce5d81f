//! `matvec` (a linear layer on a few rows) on the CPU against candle's matmul in f64, and its
//! input checks.

mod common;

use candle_core::{DType, Device, Result, Tensor};
use common::{expect_err, rel_err, Rng};
use mamba2::kernels::matvec;

/// `x·wᵀ + bias` through candle's matmul in f64.
fn reference(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let y = x
        .to_dtype(DType::F64)?
        .matmul(&w.to_dtype(DType::F64)?.t()?)?;
    match bias {
        Some(b) => y.broadcast_add(&b.to_dtype(DType::F64)?),
        None => Ok(y),
    }
}

#[test]
fn matvec_matches_matmul() -> Result<()> {
    let dev = Device::Cpu;
    let mut rng = Rng::new(5);
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let tol = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
        for (rows, k, n) in [(1, 64, 40), (3, 77, 13), (8, 256, 129), (11, 40, 9)] {
            let x = rng.tensor(&[rows, k], 1.0, &dev)?.to_dtype(dtype)?;
            let w = rng.tensor(&[n, k], 0.1, &dev)?.to_dtype(dtype)?;
            let bias = rng.tensor(&[n], 1.0, &dev)?.to_dtype(dtype)?;
            for b in [None, Some(&bias)] {
                let got = matvec(&x, &w, b)?;
                assert_eq!(got.dims(), &[rows, n]);
                assert_eq!(got.dtype(), dtype);
                let err = rel_err(&got, &reference(&x, &w, b)?)?;
                assert!(err <= tol, "{dtype:?} {rows}x{k}x{n}: {err:e}");
            }
        }
    }
    Ok(())
}

#[test]
fn matvec_rejects_bad_inputs() -> Result<()> {
    let dev = Device::Cpu;
    let x = Tensor::zeros((2, 8), DType::F32, &dev)?;
    let w = Tensor::zeros((5, 8), DType::F32, &dev)?;
    expect_err(matvec(&x.unsqueeze(0)?, &w, None), "x must have rank 2");
    expect_err(
        matvec(&x, &Tensor::zeros((5, 7), DType::F32, &dev)?, None),
        "w must have shape",
    );
    expect_err(
        matvec(&x, &w.to_dtype(DType::BF16)?, None),
        "w must have the dtype of x",
    );
    expect_err(
        matvec(&x, &w, Some(&Tensor::zeros(4, DType::F32, &dev)?)),
        "bias must have shape",
    );
    expect_err(
        matvec(&x.to_dtype(DType::U32)?, &w.to_dtype(DType::U32)?, None),
        "x must be",
    );
    Ok(())
}
