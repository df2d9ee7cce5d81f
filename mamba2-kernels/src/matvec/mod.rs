//! A linear layer applied to a few rows, the projections of a decode step:
//!
//! ```text
//! y[r, n] = Σ_k x[r, k]·w[n, k] (+ bias[n])      x [R,K], w [N,K] (a Linear's weight), bias [N]
//! ```
//!
//! `y [R,N]` has x's dtype; products accumulate in f32. A decode step is bound by reading its
//! weights once: on CUDA a warp owns four columns of `y` (four rows of `w`) for all R rows of x,
//! streams its rows of `w` with 16-byte loads and reduces across lanes, so `w` is read at close
//! to copy bandwidth, which cuBLAS's GEMM kernels do not reach at R = 1. Meant for R up to ~8;
//! larger R runs correctly in blocks of 8 rows, but a GEMM is then the better tool.

mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
mod plan;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};

use crate::check;
use crate::cpu::{small, to_storage, view, wide, CpuArg, Real};

/// The op on `(x, w)`; the bias is held.
#[derive(Debug)]
struct Matvec {
    bias: Option<Tensor>,
}

impl CustomOp2 for Matvec {
    fn name(&self) -> &'static str {
        "matvec"
    }

    fn cpu_fwd(
        &self,
        x_s: &CpuStorage,
        x_l: &Layout,
        w_s: &CpuStorage,
        w_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        if wide(x_s.dtype()) {
            self.cpu::<f64>((x_s, x_l), (w_s, w_l))
        } else {
            self.cpu::<f32>((x_s, x_l), (w_s, w_l))
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x_s: &candle_core::CudaStorage,
        x_l: &Layout,
        w_s: &candle_core::CudaStorage,
        w_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda::matvec((x_s, x_l), (w_s, w_l), self.bias.as_ref())
    }
}

impl Matvec {
    fn cpu<T: Real>(&self, (x_s, x_l): CpuArg, (w_s, w_l): CpuArg) -> Result<(CpuStorage, Shape)> {
        let op = "matvec";
        let x = view::<T>(op, "x", x_s, x_l)?;
        let w = view::<T>(op, "w", w_s, w_l)?;
        let (rows, k) = x_l.shape().dims2()?;
        let n = w_l.shape().dims2()?.0;
        let bias = self.bias.as_ref().map(small::<T>).transpose()?;
        let y = cpu::matvec(&x, &w, bias.as_deref(), (rows, k, n));
        Ok((to_storage(y, x_s.dtype())?, Shape::from((rows, n))))
    }
}

/// `x [R,K] · w [N,K]ᵀ (+ bias [N])`, as candle-nn's `Linear` computes it, for few rows R (see
/// the module doc). x, w and bias share a float dtype and a device.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use mamba2_kernels::matvec;
///
/// let dev = Device::Cpu;
/// let w = Tensor::randn(0f32, 1.0, (6, 16), &dev)?;
/// let bias = Tensor::randn(0f32, 1.0, 6, &dev)?;
/// let x = Tensor::randn(0f32, 1.0, (2, 16), &dev)?;
/// let linear = x.matmul(&w.t()?)?.broadcast_add(&bias)?;
/// let diff = (matvec(&x, &w, Some(&bias))? - linear)?;
/// assert!(diff.abs()?.max_all()?.to_scalar::<f32>()? < 1e-5);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn matvec(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let op = "matvec";
    let [rows, k] = check::rank::<2>(op, "x", x, "[R, K]")?;
    let [n, _] = check::rank::<2>(op, "w", w, "[N, K]")?;
    if rows == 0 || k == 0 || n == 0 {
        bail!(
            "{op}: empty dimension: x has shape {:?}, w {:?}",
            x.dims(),
            w.dims()
        )
    }
    check::float(op, "x", x)?;
    check::device(op, "w", w, x)?;
    check::same_dtype(op, "w", w, x)?;
    check::shape(op, "w", w, &[n, k], "[N, K] with K = x's last dimension")?;
    if let Some(b) = bias {
        check::device(op, "bias", b, x)?;
        check::same_dtype(op, "bias", b, x)?;
        check::shape(op, "bias", b, &[n], "[N]")?;
    }
    let op = Matvec {
        bias: bias.map(Tensor::contiguous).transpose()?,
    };
    x.contiguous()?.apply_op2_no_bwd(&w.contiguous()?, &op)
}
