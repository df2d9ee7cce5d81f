//! `scatter_rows` on CUDA (run on a GPU machine: `cargo test --release --features cuda --test
//! rows_cuda`): the same rows as on the CPU, bit for bit, in each word width the kernel picks
//! (16, 8, 4 and 2 bytes, by row size and by a dst that starts mid-buffer), for rows of one
//! element up to an SSM state's 196,608, and with more rows than the grid's y axis holds.
#![cfg(feature = "cuda")]

mod common;

use candle_core::{DType, Device, Result, Tensor};
use common::{rel_err, Rng};
use mamba2::kernels::{scatter_rows, RowIndex};

/// Scatters on the CPU and on CUDA from the same values and compares the whole dst.
fn same_as_cpu(
    dst_rows: usize,
    row: &[usize],
    rows: &[usize],
    dtype: DType,
    seed: u64,
) -> Result<()> {
    let (cpu, gpu) = (Device::Cpu, Device::new_cuda(0)?);
    let mut rng = Rng::new(seed);
    let shape = |n: usize| [&[n][..], row].concat();
    let dst = rng.tensor(&shape(dst_rows), 4.0, &cpu)?.to_dtype(dtype)?;
    let src = rng.tensor(&shape(rows.len()), 4.0, &cpu)?.to_dtype(dtype)?;
    let on_gpu = dst.to_device(&gpu)?;
    scatter_rows(&dst, &src, &RowIndex::new(rows, &cpu)?)?;
    scatter_rows(&on_gpu, &src.to_device(&gpu)?, &RowIndex::new(rows, &gpu)?)?;
    let diff = rel_err(&on_gpu.to_device(&cpu)?, &dst)?;
    assert_eq!(diff, 0.0, "{dtype:?} rows {row:?}");
    Ok(())
}

#[test]
fn every_word_width_matches_the_cpu() -> Result<()> {
    // f32 rows of 4, 2 and 1 elements: 16-, 8- and 4-byte words; bf16 rows of 3: 2-byte words.
    for (i, (row, dtype)) in [
        (vec![4], DType::F32),
        (vec![2], DType::F32),
        (vec![1], DType::F32),
        (vec![3], DType::BF16),
        (vec![4, 3], DType::BF16),
        (vec![24, 64, 128], DType::F32),
    ]
    .into_iter()
    .enumerate()
    {
        same_as_cpu(9, &row, &[7, 0, 3, 8], dtype, i as u64)?;
    }
    Ok(())
}

#[test]
fn a_dst_starting_mid_buffer_and_many_rows() -> Result<()> {
    let gpu = Device::new_cuda(0)?;
    // A dst one f32 past a 16-byte boundary: 4-byte words although the rows are 16 bytes.
    let whole = Tensor::zeros((3 * 4 + 1,), DType::F32, &gpu)?;
    let dst = whole.narrow(0, 1, 12)?.reshape((3, 4))?;
    let src = Tensor::arange(0f32, 8.0, &gpu)?.reshape((2, 4))?;
    scatter_rows(&dst, &src, &RowIndex::new(&[2, 0], &gpu)?)?;
    let want = [[4f32, 5.0, 6.0, 7.0], [0.0; 4], [0.0, 1.0, 2.0, 3.0]];
    assert_eq!(dst.to_vec2::<f32>()?, want);
    assert_eq!(whole.get(0)?.to_scalar::<f32>()?, 0.0);
    // 70,000 rows, past the 65,535 programs of the grid's y axis, in reverse order.
    let n = 70_000;
    let rows: Vec<usize> = (0..n).rev().collect();
    same_as_cpu(n, &[2], &rows, DType::F32, 11)
}
