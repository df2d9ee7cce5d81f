//! Residual add + RMSNorm, the pre-norm of every Mamba-2 block and the final norm (mamba_ssm's
//! fused `layer_norm_fn(..., residual, prenorm=True, is_rms_norm=True)`):
//!
//! ```text
//! r = x + residual            (r = x for the first block)          x, residual [..., D]
//! y = r / sqrt(mean(r²) + eps) · weight                            weight [D]
//! ```
//!
//! Returns `y` in x's dtype and the new residual `r`, kept in f32 when `residual_in_fp32` and in x's
//! dtype otherwise; the incoming residual must already have that dtype. Like the fused kernel, `y`
//! is normalised from the f32 sum, not from the rounded residual. Arithmetic in f32.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Storage, Tensor};
use rayon::prelude::*;

use crate::check;
use crate::cpu;
use crate::slot::Slot;

/// The norm on `(x, weight)`; the new residual is left in `residual_out`.
#[derive(Debug)]
pub(crate) struct AddRmsNorm {
    pub residual: Option<Tensor>,
    pub residual_dtype: DType,
    pub eps: f32,
    pub residual_out: Slot,
}

impl CustomOp2 for AddRmsNorm {
    fn name(&self) -> &'static str {
        "add_rms_norm"
    }

    fn cpu_fwd(
        &self,
        x_s: &CpuStorage,
        x_l: &Layout,
        w_s: &CpuStorage,
        w_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let x = cpu::f32_view(op, "x", x_s, x_l)?;
        let w = cpu::f32_view(op, "weight", w_s, w_l)?;
        let dim = w.len();
        let mut sum = x.into_owned();
        if let Some(residual) = &self.residual {
            let held = cpu::Held::new(residual);
            let r = held.f32(op, "residual")?;
            sum.par_chunks_mut(dim)
                .zip(r.par_chunks(dim))
                .for_each(|(s, r)| s.iter_mut().zip(r).for_each(|(s, r)| *s += r));
        }
        let mut y = vec![0f32; sum.len()];
        y.par_chunks_mut(dim)
            .zip(sum.par_chunks(dim))
            .for_each(|(yr, sr)| cpu::rms_normalize(sr, &w, self.eps, yr));
        self.residual_out
            .put(op, Storage::Cpu(cpu::from_f32(sum, self.residual_dtype)?))?;
        Ok((cpu::from_f32(y, x_s.dtype())?, x_l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x_s: &candle_core::CudaStorage,
        x_l: &Layout,
        w_s: &candle_core::CudaStorage,
        w_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::add_rms_norm(self, x_s, x_l, w_s, w_l)
    }
}

/// Adds `residual` to `x [..., D]` and RMS-normalises the sum with `weight [D]` (see the module
/// doc). Returns `(normed in x's dtype, new residual)`; the new residual is f32 when
/// `residual_in_fp32`, else x's dtype, and `residual` (when given) must have that dtype.
pub fn add_rms_norm(
    x: &Tensor,
    residual: Option<&Tensor>,
    weight: &Tensor,
    eps: f64,
    residual_in_fp32: bool,
) -> Result<(Tensor, Tensor)> {
    let op = "add_rms_norm";
    check::float(op, "x", x)?;
    let dim = check::last_dim(op, "x", x)?;
    check::device(op, "weight", weight, x)?;
    check::shape(op, "weight", weight, &[dim], "[D]")?;
    check::same_dtype(op, "weight", weight, x)?;
    check::eps(op, eps)?;
    let residual_dtype = if residual_in_fp32 {
        DType::F32
    } else {
        x.dtype()
    };
    if let Some(r) = residual {
        check::device(op, "residual", r, x)?;
        check::shape(op, "residual", r, x.dims(), "like x")?;
        if r.dtype() != residual_dtype {
            bail!(
                "{op}: residual must be {residual_dtype:?} (residual_in_fp32 = {residual_in_fp32}, x is {:?}), got {:?}",
                x.dtype(),
                r.dtype()
            )
        }
    }
    let norm = AddRmsNorm {
        residual: residual.map(|r| r.contiguous()).transpose()?,
        residual_dtype,
        eps: eps as f32,
        residual_out: Slot::default(),
    };
    let y = x
        .contiguous()?
        .apply_op2_no_bwd(&weight.contiguous()?, &norm)?;
    let residual = norm.residual_out.take(op, "residual", x.shape().clone())?;
    Ok((y, residual))
}
