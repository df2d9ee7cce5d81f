//! Launcher of `kernels/embedding/embedding.cu`: the embedding's backward, one program of 128
//! threads per row of the output gradient, scattering into a zeroed f32 weight gradient.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CudaStorage, DType, Layout, Result};

use crate::cuda::{cfg, fatbin, function, i, launch, ptr, ty, zeroed, Image};
use crate::instances;

const IMAGE: Image = fatbin!("embedding_embedding");
const THREADS: usize = 128;

type Input<'a> = (&'a CudaStorage, &'a Layout);

/// `dw [vocab, D]` (f32) of the output gradient `dy [R, D]` and the ids `[R]` (u32).
pub(super) fn embedding_bwd(
    (dy_s, dy_l): Input,
    (ids_s, ids_l): Input,
    vocab: usize,
) -> Result<CudaStorage> {
    let op = "embedding backward";
    let &[rows, d] = dy_l.dims() else {
        bail!(
            "{op}: the output gradient must be [R, D], got {:?}",
            dy_l.dims()
        )
    };
    if ids_s.dtype() != DType::U32 || ids_l.shape().elem_count() != rows {
        bail!(
            "{op}: ids must be {rows} u32 values, got {:?} {:?}",
            ids_s.dtype(),
            ids_l.dims()
        )
    }
    let dev = &dy_s.device;
    let stream = dev.cuda_stream();
    let dw = zeroed(dev, DType::F32, vocab * d)?;
    let (dy_p, _g1) = ptr(op, "output gradient", dy_s, dy_l, &stream)?;
    let (ids_p, _g2) = ptr(op, "ids", ids_s, ids_l, &stream)?;
    let dw_p = ptr(op, "dweight", &dw, &Layout::contiguous(vocab * d), &stream)?.0;
    if rows > 0 && d > 0 {
        let kernel = instances::embedding_bwd(ty(op, dy_s.dtype())?);
        let f = function(&stream, IMAGE, &kernel)?;
        let (v, dim) = (i(vocab)?, i(d)?);
        launch(
            &stream,
            &f,
            cfg(op, &stream, [rows, 1, 1], [THREADS, 1, 1], 0)?,
            &[&dy_p, &ids_p, &dw_p, &v, &dim],
        )?;
    }
    Ok(dw)
}
