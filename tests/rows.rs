//! `scatter_rows` on the CPU: each named row of dst takes its src row and the rest keep their
//! values, in every dtype; bad inputs are errors that name the problem.

mod common;

use candle_core::{DType, Device, Result, Tensor};
use common::{expect_err, rel_err, Rng};
use mamba2::kernels::{scatter_rows, RowIndex};

/// dst with rows `rows[r]` replaced by src's row r, built row by row.
fn expected(dst: &Tensor, src: &Tensor, rows: &[usize]) -> Result<Tensor> {
    let mut out: Vec<Tensor> = (0..dst.dim(0)?)
        .map(|i| dst.get(i))
        .collect::<Result<_>>()?;
    for (r, &at) in rows.iter().enumerate() {
        out[at] = src.get(r)?;
    }
    Tensor::stack(&out, 0)
}

#[test]
fn named_rows_take_the_source_rows_in_every_dtype() -> Result<()> {
    let dev = Device::Cpu;
    let mut rng = Rng::new(7);
    let rows = [4usize, 0, 2];
    for dtype in [
        DType::F32,
        DType::BF16,
        DType::F16,
        DType::F64,
        DType::U32,
        DType::I64,
    ] {
        let dst = rng.tensor(&[6, 3, 5], 10.0, &dev)?.to_dtype(dtype)?;
        let src = rng.tensor(&[3, 3, 5], 10.0, &dev)?.to_dtype(dtype)?;
        let want = expected(&dst, &src, &rows)?;
        scatter_rows(&dst, &src, &RowIndex::new(&rows, &dev)?)?;
        assert_eq!(rel_err(&dst, &want)?, 0.0, "{dtype:?}");
    }
    Ok(())
}

#[test]
fn a_strided_source_and_an_empty_index() -> Result<()> {
    let dev = Device::Cpu;
    let mut rng = Rng::new(8);
    let dst = rng.tensor(&[5, 4], 1.0, &dev)?;
    let src = rng.tensor(&[4, 2], 1.0, &dev)?.t()?;
    let want = expected(&dst, &src, &[1, 3])?;
    scatter_rows(&dst, &src, &RowIndex::new(&[1, 3], &dev)?)?;
    assert_eq!(dst.to_vec2::<f32>()?, want.to_vec2::<f32>()?);
    let before = dst.to_vec2::<f32>()?;
    let none = Tensor::zeros((0, 4), DType::F32, &dev)?;
    scatter_rows(&dst, &none, &RowIndex::new(&[], &dev)?)?;
    assert_eq!(dst.to_vec2::<f32>()?, before);
    Ok(())
}

#[test]
fn bad_inputs_are_named() -> Result<()> {
    let dev = Device::Cpu;
    let dst = Tensor::zeros((4, 3), DType::F32, &dev)?;
    let src = Tensor::ones((2, 3), DType::F32, &dev)?;
    let two = RowIndex::new(&[0, 1], &dev)?;
    expect_err(RowIndex::new(&[1, 2, 1], &dev), "appears twice");
    expect_err(
        scatter_rows(&dst, &src, &RowIndex::new(&[3, 4], &dev)?),
        "row 4 of a dst of 4 rows",
    );
    expect_err(
        scatter_rows(&dst, &src.to_dtype(DType::BF16)?, &two),
        "src is BF16 but dst is F32",
    );
    expect_err(
        scatter_rows(&dst, &Tensor::ones((2, 2), DType::F32, &dev)?, &two),
        "trailing dims",
    );
    expect_err(
        scatter_rows(&dst, &src, &RowIndex::new(&[0], &dev)?),
        "src has 2 rows but the index names 1",
    );
    let transposed = Tensor::zeros((3, 3), DType::F32, &dev)?.t()?;
    expect_err(
        scatter_rows(&transposed, &src, &two),
        "dst must be contiguous",
    );
    Ok(())
}
