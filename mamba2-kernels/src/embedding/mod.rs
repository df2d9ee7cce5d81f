//! The embedding lookup, rows of a weight picked by ids, with its backward:
//!
//! ```text
//! y[.., :] = w[ids[..], :]                    w [V, D], ids [..] (u8, u32 or i64), y [.., D]
//! dw[v, :] = Σ_{r : ids[r] = v} dy[r, :]
//! ```
//!
//! The forward is candle's `index_select` on every device. The backward on the CPU is candle's
//! `index_add`; on CUDA it is a scatter-add with f32 atomics, one program per row of dy
//! (`kernels/embedding/embedding.cu`): candle's CUDA `index_add` walks every id in each thread,
//! which for a training batch of 64k ids costs tens of milliseconds.

#[cfg(feature = "cuda")]
mod cuda;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};

use crate::check;

const OP: &str = "embedding";

/// The recorded lookup on (weight, flat ids).
#[derive(Debug)]
struct Embedding;

/// The output shape `[R, D]` of a weight layout and flat ids.
fn rows_shape(w_l: &Layout, ids_l: &Layout) -> Result<Shape> {
    let &[_, d] = w_l.dims() else {
        bail!("{OP}: the weight must be [V, D], got {:?}", w_l.dims())
    };
    Ok(Shape::from((ids_l.shape().elem_count(), d)))
}

impl CustomOp2 for Embedding {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(
        &self,
        w_s: &CpuStorage,
        w_l: &Layout,
        ids_s: &CpuStorage,
        ids_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        Ok((
            w_s.index_select(ids_s, w_l, ids_l, 0)?,
            rows_shape(w_l, ids_l)?,
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        w_s: &candle_core::CudaStorage,
        w_l: &Layout,
        ids_s: &candle_core::CudaStorage,
        ids_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((
            w_s.index_select(ids_s, w_l, ids_l, 0)?,
            rows_shape(w_l, ids_l)?,
        ))
    }

    fn bwd(
        &self,
        weight: &Tensor,
        ids: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        if !weight.device().is_cuda() {
            let dw = weight.zeros_like()?.index_add(ids, grad, 0)?;
            return Ok((Some(dw), None));
        }
        let ids = ids.to_dtype(DType::U32)?.contiguous()?;
        let grad = grad.contiguous()?;
        let dw = grad.apply_op2_no_bwd(
            &ids,
            &EmbeddingBwd {
                vocab: weight.dim(0)?,
            },
        )?;
        Ok((Some(dw.to_dtype(weight.dtype())?), None))
    }
}

/// The weight's gradient `[V, D]` (f32) from (dy `[R, D]`, ids `[R]` u32): the backward of
/// [`Embedding`] on CUDA.
#[derive(Debug)]
struct EmbeddingBwd {
    vocab: usize,
}

impl CustomOp2 for EmbeddingBwd {
    fn name(&self) -> &'static str {
        "embedding backward"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        bail!(
            "{OP}: the scatter-add into {} rows runs on CUDA; the CPU's backward is index_add",
            self.vocab
        )
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dy_s: &candle_core::CudaStorage,
        dy_l: &Layout,
        ids_s: &candle_core::CudaStorage,
        ids_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let d = dy_l.dims().last().copied().unwrap_or(0);
        let dw = cuda::embedding_bwd((dy_s, dy_l), (ids_s, ids_l), self.vocab)?;
        Ok((dw, Shape::from((self.vocab, d))))
    }
}

/// The rows of `weight [V, D]` picked by `ids` (any shape; u8, u32 or i64): `[..ids, D]`, in
/// the weight's dtype, differentiable in the weight. Ids are not checked against V here: a
/// model checks them first (an id outside `0..V` is an error on the CPU and undefined on CUDA,
/// as for candle's `index_select`).
///
/// ```
/// use candle_core::{Device, Tensor};
/// use mamba2_kernels::embedding;
///
/// let w = Tensor::new(&[[0f32, 1.0], [2.0, 3.0], [4.0, 5.0]], &Device::Cpu)?;
/// let ids = Tensor::new(&[[2u32, 0]], &Device::Cpu)?;
/// let y = embedding(&w, &ids)?;
/// assert_eq!(y.to_vec3::<f32>()?, [[[4.0, 5.0], [0.0, 1.0]]]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn embedding(weight: &Tensor, ids: &Tensor) -> Result<Tensor> {
    let [_, d] = check::rank::<2>(OP, "weight", weight, "[V, D]")?;
    check::device(OP, "ids", ids, weight)?;
    if !matches!(ids.dtype(), DType::U8 | DType::U32 | DType::I64) {
        bail!("{OP}: ids must be u8, u32 or i64, got {:?}", ids.dtype())
    }
    let mut dims = ids.dims().to_vec();
    dims.push(d);
    let flat = ids.flatten_all()?;
    let rows = if weight.track_op() {
        weight.apply_op2(&flat, Embedding)?
    } else {
        weight.apply_op2_no_bwd(&flat, &Embedding)?
    };
    rows.reshape(dims)
}
