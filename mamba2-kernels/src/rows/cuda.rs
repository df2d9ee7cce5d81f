//! Launcher of `kernels/rows/rows.cu`: programs of 256 threads over (1,024-word pieces of a row,
//! rows), in the widest words (16, 8, 4 or 2 bytes) that divide the row and both base addresses.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CudaStorage, DType, Layout, Result};

use crate::cuda::{cfg, fatbin, function, i, launch, ptr, Image};
use crate::instances;

const IMAGE: Image = fatbin!("rows_rows");
const THREADS: usize = 256;
/// Words per thread (the kernel's `PER`).
const PER: usize = 4;

type Input<'a> = (&'a CudaStorage, &'a Layout);

/// `dst[ids[r]] = src[r]` for rows of `row` elements (dst and src contiguous, ids u32 `[R]`).
pub(super) fn scatter_rows(
    (dst_s, dst_l): (&mut CudaStorage, &Layout),
    (src_s, src_l): Input,
    (ids_s, ids_l): Input,
    row: usize,
) -> Result<()> {
    let op = "scatter_rows";
    if ids_s.dtype() != DType::U32 {
        bail!("{op}: the row index must be u32, got {:?}", ids_s.dtype())
    }
    let n = ids_l.shape().elem_count();
    let row_bytes = row * src_s.dtype().size_in_bytes();
    let stream = src_s.device.cuda_stream();
    let (src_p, _g1) = ptr(op, "src", src_s, src_l, &stream)?;
    let (ids_p, _g2) = ptr(op, "the row index", ids_s, ids_l, &stream)?;
    let (dst_p, _g3) = ptr(op, "dst", dst_s, dst_l, &stream)?;
    let Some(&(bytes, _)) = instances::ROW_WORDS
        .iter()
        .find(|&&(b, _)| row_bytes % b == 0 && src_p % b as u64 == 0 && dst_p % b as u64 == 0)
    else {
        bail!("{op}: rows of {row_bytes} bytes at {src_p:#x} → {dst_p:#x} are not 2-byte aligned")
    };
    let words = row_bytes / bytes;
    let f = function(&stream, IMAGE, &instances::scatter_rows(bytes))?;
    let grid = [words.div_ceil(THREADS * PER), n.min(65_535), 1];
    let (count, words) = (i(n)?, words as i64);
    launch(
        &stream,
        &f,
        cfg(op, &stream, grid, [THREADS, 1, 1], 0)?,
        &[&dst_p, &src_p, &ids_p, &count, &words],
    )
}
