//! The gated RMSNorm that closes the Mamba-2 mixer (mamba_ssm's `RMSNormGated` with
//! `norm_before_gate=False`), per group of `group_size` channels:
//!
//! ```text
//! g = x · silu(z)                                        x, z [..., D], D = G · group_size
//! y[i] = g[i] / sqrt(mean_{j ∈ group(i)} g[j]² + eps) · weight[i]
//! ```
//!
//! mamba_ssm builds it with `group_size = d_inner / ngroups`; HF transformers (5.17) normalises over
//! the whole row, which is `group_size = D` and equals it only when ngroups = 1. Inputs f32, f16 or
//! bf16 (x, z and `weight [D]` of one dtype), f32 arithmetic, output in x's dtype.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::{check, cpu};

/// The gated norm on `(x, z, weight)`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct GatedRmsNorm {
    pub group_size: usize,
    pub eps: f32,
}

impl CustomOp3 for GatedRmsNorm {
    fn name(&self) -> &'static str {
        "gated_rms_norm"
    }

    fn cpu_fwd(
        &self,
        x_s: &CpuStorage,
        x_l: &Layout,
        z_s: &CpuStorage,
        z_l: &Layout,
        w_s: &CpuStorage,
        w_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let x = cpu::f32_view(op, "x", x_s, x_l)?;
        let z = cpu::f32_view(op, "z", z_s, z_l)?;
        let w = cpu::f32_view(op, "weight", w_s, w_l)?;
        let dim = w.len();
        let gs = self.group_size;
        let mut y = vec![0f32; x.len()];
        y.par_chunks_mut(dim)
            .zip(x.par_chunks(dim).zip(z.par_chunks(dim)))
            .for_each(|(yr, (xr, zr))| {
                let mut gated = vec![0f32; dim];
                for ((g, xv), zv) in gated.iter_mut().zip(xr).zip(zr) {
                    *g = xv * zv / (1.0 + (-zv).exp());
                }
                for ((yg, gg), wg) in yr
                    .chunks_exact_mut(gs)
                    .zip(gated.chunks_exact(gs))
                    .zip(w.chunks_exact(gs))
                {
                    cpu::rms_normalize(gg, wg, self.eps, yg);
                }
            });
        Ok((cpu::from_f32(y, x_s.dtype())?, x_l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x_s: &candle_core::CudaStorage,
        x_l: &Layout,
        z_s: &candle_core::CudaStorage,
        z_l: &Layout,
        w_s: &candle_core::CudaStorage,
        w_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::gated_rms_norm(self, x_s, x_l, z_s, z_l, w_s, w_l)
    }
}

/// `rmsnorm_per_group(x · silu(z)) · weight` over the last dimension of `x` (see the module doc).
///
/// `x, z [..., D]` and `weight [D]` share one dtype; `group_size` must divide D. Returns x's shape
/// and dtype.
pub fn gated_rms_norm(
    x: &Tensor,
    z: &Tensor,
    weight: &Tensor,
    group_size: usize,
    eps: f64,
) -> Result<Tensor> {
    let op = "gated_rms_norm";
    check::float(op, "x", x)?;
    let dim = check::last_dim(op, "x", x)?;
    check::device(op, "z", z, x)?;
    check::shape(op, "z", z, x.dims(), "like x")?;
    check::same_dtype(op, "z", z, x)?;
    check::device(op, "weight", weight, x)?;
    check::shape(op, "weight", weight, &[dim], "[D]")?;
    check::same_dtype(op, "weight", weight, x)?;
    if group_size == 0 || dim % group_size != 0 {
        bail!("{op}: group_size ({group_size}) must divide the channel count D ({dim})")
    }
    check::eps(op, eps)?;
    let norm = GatedRmsNorm {
        group_size,
        eps: eps as f32,
    };
    x.contiguous()?
        .apply_op3_no_bwd(&check::rows_view(z)?, &weight.contiguous()?, &norm)
}
