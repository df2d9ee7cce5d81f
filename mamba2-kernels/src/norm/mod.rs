//! The two RMSNorms of a Mamba-2 block.
//!
//! [`gated_rms_norm`] closes the mixer (mamba_ssm's `RMSNormGated` with
//! `norm_before_gate=False`), per group of `group_size` channels:
//!
//! ```text
//! g = x · silu(z)                                        x, z [..., D], D = G · group_size
//! y[i] = g[i] / sqrt(mean_{j ∈ group(i)} g[j]² + eps) · weight[i]
//! ```
//!
//! mamba_ssm builds it with `group_size = d_inner / ngroups`; HF transformers (5.17) normalises
//! over the whole row, which is `group_size = D` and equals it only when ngroups = 1.
//!
//! [`add_rms_norm`] is the pre-norm of every block and the final norm (mamba_ssm's fused
//! `layer_norm_fn(..., residual, prenorm=True, is_rms_norm=True)`):
//!
//! ```text
//! r = x + residual            (r = x for the first block)          x, residual [..., D]
//! y = r / sqrt(mean(r²) + eps) · weight                            weight [D]
//! ```
//!
//! It returns `y` in x's dtype and the new residual `r`, kept in f32 when `residual_in_fp32` and
//! in x's dtype otherwise; the incoming residual must already have that dtype. Like the fused
//! kernel, `y` is normalised from the f32 sum, not from the rounded residual.
//!
//! Inputs f32, f16 or bf16 (x, z and `weight [D]` of one dtype), f32 arithmetic, output in x's
//! dtype; on the CPU also f64, computed in f64.
//!
//! Autograd: both norms are differentiable in every tensor argument. When none tracks gradients
//! (inference) nothing is recorded and the ops cost nothing extra. Otherwise [`gated_rms_norm`]
//! is the same op recorded with its backward (dx, dz, dweight), and [`add_rms_norm`] is two
//! recorded ops on one fused forward: `y` on `(x, residual, weight)`, whose backward is the
//! RMSNorm's on the unrounded sum (its gradient goes to x and to the residual alike), and the new
//! residual on `(x, residual)`, which passes its gradient to both. Two nodes per norm, so that
//! candle's backward adds few activation-sized gradients. The backwards run on the device of their
//! inputs: on the CPU, or on CUDA, where the kernels' per-program partial sums of dweight are added
//! up in f32 by candle before they take the weight's dtype. [`gated_rms_norm_backward`] is the
//! gated norm's backward without autograd, for a fused layer's own backward pass.

mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
mod plan;

use std::sync::{Arc, OnceLock};

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Storage, Tensor,
};

use crate::check;
use crate::cpu::{gradient, host, to_storage, values_like, view, wide, CpuArg, Held, Real};
use crate::slot::Slot;

/// The gradients of a norm's arguments, each `None` when its tensor tracks no gradient.
type Grads3 = (Option<Tensor>, Option<Tensor>, Option<Tensor>);

/// Which of a norm's `(x, z, weight)` gradients a backward computes.
#[cfg(feature = "cuda")]
type Want = (bool, bool, bool);

/// Whether any of `ts` tracks gradients: only then is an op recorded, so inference pays nothing.
fn tracked(ts: &[Option<&Tensor>]) -> bool {
    ts.iter().flatten().any(|t| t.track_op())
}

/// The gated norm on `(x, z, weight)`.
#[derive(Clone, Copy, Debug)]
struct GatedRmsNorm {
    group_size: usize,
    eps: f32,
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
        let args = [(x_s, x_l), (z_s, z_l), (w_s, w_l)];
        if wide(x_s.dtype()) {
            self.cpu::<f64>(args)
        } else {
            self.cpu::<f32>(args)
        }
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
        let (group, eps) = (self.group_size, self.eps);
        let y = cuda::gated_rms_norm((x_s, x_l), (z_s, z_l), (w_s, w_l), group, eps)?;
        Ok((y, x_l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, z: &Tensor, w: &Tensor, _y: &Tensor, dy: &Tensor) -> Result<Grads3> {
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            let want = (x.track_op(), z.track_op(), w.track_op());
            return cuda_grads(x, Some(z), w, dy, (self.group_size, self.eps), want);
        }
        if wide(x.dtype()) {
            self.grads::<f64>(x, z, w, dy)
        } else {
            self.grads::<f32>(x, z, w, dy)
        }
    }
}

impl GatedRmsNorm {
    fn cpu<T: Real>(
        &self,
        [(x_s, x_l), (z_s, z_l), (w_s, w_l)]: [CpuArg; 3],
    ) -> Result<(CpuStorage, Shape)> {
        let op = "gated_rms_norm";
        let x = view::<T>(op, "x", x_s, x_l)?;
        let z = view::<T>(op, "z", z_s, z_l)?;
        let w = view::<T>(op, "weight", w_s, w_l)?;
        let y = cpu::gated_rms_norm(&x, &z, &w, self.group_size, T::of(self.eps));
        Ok((to_storage(y, x_s.dtype())?, x_l.shape().clone()))
    }

    fn grads<T: Real>(&self, x: &Tensor, z: &Tensor, w: &Tensor, dy: &Tensor) -> Result<Grads3> {
        let op = "gated_rms_norm";
        let dyv = host::<T>(op, "output gradient", dy)?;
        let (xv, zv) = (host::<T>(op, "x", x)?, host::<T>(op, "z", z)?);
        let wv = host::<T>(op, "weight", w)?;
        let eps = T::of(self.eps);
        let (dx, dz, dw) = cpu::gated_rms_norm_backward(&xv, &zv, &wv, &dyv, self.group_size, eps);
        Ok((gradient(dx, x)?, gradient(dz, z)?, gradient(dw, w)?))
    }
}

/// The CUDA backward of the gated norm (with `z`) or of the RMSNorm of whole rows (without):
/// the gradients of x, z and the weight that `want` asks for.
#[cfg(feature = "cuda")]
fn cuda_grads(
    x: &Tensor,
    z: Option<&Tensor>,
    w: &Tensor,
    dy: &Tensor,
    (group, eps): (usize, f32),
    want: Want,
) -> Result<Grads3> {
    use crate::cuda::{tensor, Held};
    let op = if z.is_some() {
        "gated_rms_norm"
    } else {
        "add_rms_norm"
    };
    let dy = dy.contiguous()?;
    let [xh, wh, dyh] = [x, w, &dy].map(Held::new);
    let zh = z.map(Held::new);
    let g = cuda::rms_norm_bwd(
        xh.arg(op, "x")?,
        zh.as_ref().map(|h| h.arg(op, "z")).transpose()?,
        wh.arg(op, "weight")?,
        dyh.arg(op, "output gradient")?,
        (group, eps),
        None,
    )?;
    let dim = w.elem_count();
    let dx = want.0.then(|| tensor(g.dx, x.shape()));
    let dz = match (z, g.dz) {
        (Some(z), Some(dz)) if want.1 => Some(tensor(dz, z.shape())),
        _ => None,
    };
    let dw = if want.2 {
        let sums = tensor(g.parts, (g.programs, dim)).sum(0)?;
        Some(sums.to_dtype(w.dtype())?.reshape(w.shape())?)
    } else {
        None
    };
    Ok((dx, dz, dw))
}

/// `rmsnorm_per_group(x · silu(z)) · weight` over the last dimension of `x` (see the module doc).
///
/// `x, z [..., D]` and `weight [D]` share one dtype; `group_size` must divide D. Returns x's shape
/// and dtype. On CUDA the rows of z may be a slice of a wider tensor (read in place).
/// Differentiable in x, z and the weight (see the module doc).
///
/// ```
/// use candle_core::{Device, Tensor};
/// use mamba2_kernels::gated_rms_norm;
///
/// let x = Tensor::new(&[[3f32, 4.0, 1.0, 1.0]], &Device::Cpu)?;
/// let z = Tensor::new(&[[30f32, 30.0, 30.0, 30.0]], &Device::Cpu)?; // silu(30) ≈ 30
/// let w = Tensor::new(&[1f32, 1.0, 2.0, 2.0], &Device::Cpu)?;
/// // Two groups of two: each is scaled to a root mean square of 1, times the weight.
/// let y = gated_rms_norm(&x, &z, &w, 2, 0.0)?.to_vec2::<f32>()?;
/// let rms = (12.5f32).sqrt();
/// for (got, want) in y[0].iter().zip([3.0 / rms, 4.0 / rms, 2.0, 2.0]) {
///     assert!((got - want).abs() < 1e-5, "{got} vs {want}");
/// }
/// # Ok::<(), candle_core::Error>(())
/// ```
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
    let (x, z, weight) = (x.contiguous()?, check::rows_view(z)?, weight.contiguous()?);
    if tracked(&[Some(&x), Some(&z), Some(&weight)]) {
        x.apply_op3(&z, &weight, norm)
    } else {
        x.apply_op3_no_bwd(&z, &weight, &norm)
    }
}

/// The add norm on `(x, weight)`; the new residual is left in `residual_out`.
#[derive(Debug)]
struct AddRmsNorm {
    residual: Option<Tensor>,
    residual_dtype: DType,
    eps: f32,
    residual_out: Slot,
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
        let residual = (self.residual.as_ref(), self.residual_dtype);
        let (y, r) = cuda::add_rms_norm((x_s, x_l), (w_s, w_l), residual, self.eps)?;
        self.residual_out.put(self.name(), Storage::Cuda(r))?;
        Ok((y, x_l.shape().clone()))
    }
}

impl AddRmsNorm {
    fn cpu<T: Real>(&self, (x_s, x_l): CpuArg, (w_s, w_l): CpuArg) -> Result<(CpuStorage, Shape)> {
        let op = "add_rms_norm";
        let mut sum = view::<T>(op, "x", x_s, x_l)?.into_owned();
        let w = view::<T>(op, "weight", w_s, w_l)?;
        let held = self.residual.as_ref().map(Held::new);
        let residual = held
            .as_ref()
            .map(|h| h.view::<T>(op, "residual"))
            .transpose()?;
        let y = cpu::add_rms_norm(&mut sum, residual.as_deref(), &w, T::of(self.eps));
        self.residual_out
            .put(op, Storage::Cpu(to_storage(sum, self.residual_dtype)?))?;
        Ok((to_storage(y, x_s.dtype())?, x_l.shape().clone()))
    }
}

/// Adds `residual` to `x [..., D]` and RMS-normalises the sum with `weight [D]` (see the module
/// doc). Returns `(normed in x's dtype, new residual)`; the new residual is f32 when
/// `residual_in_fp32`, else x's dtype, and `residual` (when given) must have that dtype.
/// Differentiable in x, the residual and the weight (see the module doc for how).
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use mamba2_kernels::add_rms_norm;
///
/// let x = Tensor::new(&[[1f32, 2.0], [3.0, 4.0]], &Device::Cpu)?;
/// let w = Tensor::ones(2, DType::F32, &Device::Cpu)?;
/// // The first block has no residual yet: its residual is x itself.
/// let (y, residual) = add_rms_norm(&x, None, &w, 1e-5, true)?;
/// assert_eq!(residual.to_vec2::<f32>()?, x.to_vec2::<f32>()?);
/// let (_, residual) = add_rms_norm(&y, Some(&residual), &w, 1e-5, true)?;
/// assert_eq!(residual.dims(), &[2, 2]);
/// # Ok::<(), candle_core::Error>(())
/// ```
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
    let residual = residual.map(|r| r.contiguous()).transpose()?;
    let norm = Arc::new(AddRmsNorm {
        residual: residual.as_ref().map(Tensor::detach),
        residual_dtype,
        eps: eps as f32,
        residual_out: Slot::default(),
    });
    let (x, weight) = (x.contiguous()?, weight.contiguous()?);
    if tracked(&[Some(&x), residual.as_ref(), Some(&weight)]) {
        return recorded_add_rms_norm(&x, residual.as_ref(), &weight, norm);
    }
    let y = x.apply_op2_no_bwd(&weight, &*norm)?;
    let residual = norm.residual_out.take(op, "residual", x.shape().clone())?;
    Ok((y, residual))
}

/// The backward of [`gated_rms_norm`] without autograd: `(dx, dz, dweight)` for the output
/// gradient `dy`, each in its input's dtype, for callers that run their own backward pass (a
/// fused layer's). On CUDA the kernel candle's autograd runs for [`gated_rms_norm`], whose
/// per-program partial sums of dweight are added up in f32; on the CPU its CPU backward.
pub fn gated_rms_norm_backward(
    x: &Tensor,
    z: &Tensor,
    weight: &Tensor,
    group_size: usize,
    eps: f64,
    dy: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let op = "gated_rms_norm_backward";
    check_gated_backward(op, (x, z, weight, dy), group_size, eps)?;
    let (x, z, w, dy) = (x.detach(), z.detach(), weight.detach(), dy.detach());
    // z may stay a slice of a wider tensor on CUDA, as in the forward (read in place).
    let (x, z, w) = (x.contiguous()?, check::rows_view(&z)?, w.contiguous()?);
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        let all = (true, true, true);
        if let (Some(dx), Some(dz), Some(dw)) =
            cuda_grads(&x, Some(&z), &w, &dy, (group_size, eps as f32), all)?
        {
            return Ok((dx, dz, dw));
        }
        bail!("{op}: the backward kernel returned no gradient")
    }
    fn on_host<T: Real>(
        op: &str,
        (x, z, w, dy): (&Tensor, &Tensor, &Tensor, &Tensor),
        group: usize,
        eps: f64,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (xv, zv) = (host::<T>(op, "x", x)?, host::<T>(op, "z", z)?);
        let (wv, dyv) = (host::<T>(op, "weight", w)?, host::<T>(op, "dy", dy)?);
        let (dx, dz, dw) =
            cpu::gated_rms_norm_backward(&xv, &zv, &wv, &dyv, group, T::of(eps as f32));
        Ok((
            values_like(dx, x)?,
            values_like(dz, z)?,
            values_like(dw, w)?,
        ))
    }
    let args = (&x, &z, &w, &dy);
    if wide(x.dtype()) {
        on_host::<f64>(op, args, group_size, eps)
    } else {
        on_host::<f32>(op, args, group_size, eps)
    }
}

/// The differentiable [`add_rms_norm`]: two recorded ops on one fused forward, y on
/// `(x[, residual], weight)` and the new residual on `(x, residual)` (see the module doc).
fn recorded_add_rms_norm(
    x: &Tensor,
    residual: Option<&Tensor>,
    weight: &Tensor,
    norm: Arc<AddRmsNorm>,
) -> Result<(Tensor, Tensor)> {
    let op = RecordedAddNorm {
        norm: norm.clone(),
        sum: Arc::new(OnceLock::new()),
    };
    let sum = op.sum.clone();
    let (y, new_residual) = match residual {
        Some(r) => {
            let y = x.apply_op3(r, weight, op)?;
            (y, x.apply_op2(r, NewResidual(norm))?)
        }
        None => (x.apply_op2(weight, op)?, x.to_dtype(norm.residual_dtype)?),
    };
    // The backward reads the unrounded sum: kept when the residual holds it, else recomputed.
    let _ = sum.set(new_residual.detach());
    Ok((y, new_residual))
}

/// `(d sum, d weight)` of `y = rms_norm(sum)·weight` for `dy`, with `sum` already in the compute
/// dtype (f32, or f64 for f64 inputs): both gradients in that dtype.
fn sum_backward(sum: &Tensor, w: &Tensor, eps: f32, dy: &Tensor) -> Result<(Tensor, Tensor)> {
    let compute = sum.dtype();
    let (wc, dyc) = (w.to_dtype(compute)?, dy.to_dtype(compute)?.contiguous()?);
    #[cfg(feature = "cuda")]
    if sum.device().is_cuda() {
        let dim = w.elem_count();
        return match cuda_grads(sum, None, &wc, &dyc, (dim, eps), (true, false, true))? {
            (Some(ds), _, Some(dw)) => Ok((ds, dw)),
            _ => bail!("add_rms_norm: the backward kernel returned no gradient"),
        };
    }
    fn on_host<T: Real>(
        (s, w, dy): (&Tensor, &Tensor, &Tensor),
        eps: f32,
    ) -> Result<(Tensor, Tensor)> {
        let op = "add_rms_norm";
        let (sv, wv) = (host::<T>(op, "x", s)?, host::<T>(op, "weight", w)?);
        let dyv = host::<T>(op, "output gradient", dy)?;
        let (ds, dw) = cpu::rms_norm_backward(&sv, &wv, &dyv, wv.len(), T::of(eps));
        Ok((values_like(ds, s)?, values_like(dw, w)?))
    }
    let args = (sum, &wc, &dyc);
    if wide(compute) {
        on_host::<f64>(args, eps)
    } else {
        on_host::<f32>(args, eps)
    }
}

/// The checks of the gated norm's backwards without autograd: x, z, dy alike, weight `[D]`,
/// the group dividing D.
fn check_gated_backward(
    op: &str,
    (x, z, weight, dy): (&Tensor, &Tensor, &Tensor, &Tensor),
    group_size: usize,
    eps: f64,
) -> Result<()> {
    check::float(op, "x", x)?;
    let dim = check::last_dim(op, "x", x)?;
    for (name, t) in [("z", z), ("dy", dy)] {
        check::device(op, name, t, x)?;
        check::shape(op, name, t, x.dims(), "like x")?;
        check::same_dtype(op, name, t, x)?;
    }
    check::device(op, "weight", weight, x)?;
    check::shape(op, "weight", weight, &[dim], "[D]")?;
    check::same_dtype(op, "weight", weight, x)?;
    if group_size == 0 || dim % group_size != 0 {
        bail!("{op}: group_size ({group_size}) must divide the channel count D ({dim})")
    }
    check::eps(op, eps)
}

/// [`gated_rms_norm_backward`] writing dz into columns `offset..offset + D` of `dz_buffer [..,
/// W]` (contiguous, x's leading dims and dtype) instead of a tensor of its own, as a fused
/// layer's backward wants it beside other gradients (in_proj's `[dz | dxBC | ddt]`): returns
/// `(dx, dweight)`. On CUDA the kernel writes there directly.
pub fn gated_rms_norm_backward_into(
    x: &Tensor,
    z: &Tensor,
    weight: &Tensor,
    (group_size, eps): (usize, f64),
    dy: &Tensor,
    (dz_buffer, offset): (&Tensor, usize),
) -> Result<(Tensor, Tensor)> {
    let op = "gated_rms_norm_backward";
    check_gated_backward(op, (x, z, weight, dy), group_size, eps)?;
    check::into(op, "dz_buffer", dz_buffer, x, offset)?;
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        let (x, w) = (x.detach().contiguous()?, weight.detach().contiguous()?);
        let (z, dy) = (check::rows_view(&z.detach())?, dy.detach().contiguous()?);
        let into = GatedBwdInto {
            args: [&x, &z, &w, &dy],
            group: (group_size, eps as f32),
            offset,
            done: std::sync::Mutex::new(None),
        };
        dz_buffer.inplace_op1(&into)?;
        let g = match into.done.into_inner() {
            Ok(Some(g)) => g,
            _ => bail!("{op}: the backward kernel did not run"),
        };
        use crate::cuda::tensor;
        let sums = tensor(g.parts, (g.programs, w.elem_count())).sum(0)?;
        return Ok((tensor(g.dx, x.shape()), sums.to_dtype(w.dtype())?));
    }
    let (dx, dz, dw) = gated_rms_norm_backward(x, z, weight, group_size, eps, dy)?;
    dz_buffer.slice_set(&dz, dz.rank() - 1, offset)?;
    Ok((dx, dw))
}

/// The gated norm's CUDA backward on `[x, z, weight, dy]`, in place on the buffer that takes dz.
#[cfg(feature = "cuda")]
struct GatedBwdInto<'a> {
    args: [&'a Tensor; 4],
    group: (usize, f32),
    offset: usize,
    done: std::sync::Mutex<Option<cuda::NormGrads>>,
}

#[cfg(feature = "cuda")]
impl candle_core::InplaceOp1 for GatedBwdInto<'_> {
    fn name(&self) -> &'static str {
        "gated_rms_norm_backward"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> Result<()> {
        bail!("gated_rms_norm_backward: the in-place backward runs on CUDA")
    }

    fn cuda_fwd(&self, s: &mut candle_core::CudaStorage, l: &Layout) -> Result<()> {
        use crate::cuda::{dest, written, Held};
        let op = self.name();
        let stream = s.device.cuda_stream();
        let at = dest(op, "dz_buffer", (s, l), self.offset, &stream)?;
        let [xh, zh, wh, dyh] = self.args.map(Held::new);
        let g = cuda::rms_norm_bwd(
            xh.arg(op, "x")?,
            Some(zh.arg(op, "z")?),
            wh.arg(op, "weight")?,
            dyh.arg(op, "output gradient")?,
            self.group,
            Some(at),
        )?;
        written(s, &stream)?;
        match self.done.lock() {
            Ok(mut d) => *d = Some(g),
            Err(_) => bail!("{op}: state poisoned"),
        }
        Ok(())
    }
}

/// The gradients of [`add_rms_norm_backward`].
#[derive(Debug)]
pub struct AddNormGrads {
    /// The gradient of the new residual, `carried + d sum`: f32 (f64 for f64 inputs). It is the
    /// gradient of x and of the residual alike.
    pub residual: Tensor,
    /// The same rounded to dy's dtype: the gradient of x (the previous block's output).
    pub x: Tensor,
    /// `[D]`, the weight's dtype.
    pub weight: Tensor,
}

/// The backward of [`add_rms_norm`] without autograd, along the residual stream: for the output
/// gradient `dy` of `y = rms_norm(sum)·weight`, where `sum [..., D]` is the new residual the
/// forward returned (x + residual) and `weight [D]`, and the gradient `carried` (f32, like sum)
/// that the new residual already receives from later blocks, if any: `carried + d sum` and d
/// weight (see [`AddNormGrads`]), for callers that run their own backward pass (a fused stack of
/// blocks'). On CUDA one kernel reads the sum, dy and the carried gradient once and writes both
/// forms of the result.
pub fn add_rms_norm_backward(
    sum: &Tensor,
    weight: &Tensor,
    eps: f64,
    dy: &Tensor,
    carried: Option<&Tensor>,
) -> Result<AddNormGrads> {
    let op = "add_rms_norm_backward";
    check::float(op, "sum", sum)?;
    let dim = check::last_dim(op, "sum", sum)?;
    check::device(op, "dy", dy, sum)?;
    check::shape(op, "dy", dy, sum.dims(), "like sum")?;
    check::float(op, "dy", dy)?;
    check::device(op, "weight", weight, sum)?;
    check::shape(op, "weight", weight, &[dim], "[D]")?;
    check::float(op, "weight", weight)?;
    check::eps(op, eps)?;
    let compute = if wide(sum.dtype()) {
        DType::F64
    } else {
        DType::F32
    };
    if let Some(c) = carried {
        check::device(op, "carried", c, sum)?;
        check::shape(op, "carried", c, sum.dims(), "like sum")?;
        check::dtype(op, "carried", c, compute)?;
    }
    let sum = sum.detach().to_dtype(compute)?.contiguous()?;
    let (weight_dtype, dy) = (weight.dtype(), dy.detach());
    #[cfg(feature = "cuda")]
    if sum.device().is_cuda() && compute == DType::F32 && !wide(dy.dtype()) {
        use crate::cuda::{tensor, Held};
        let dy = dy.contiguous()?;
        let w = weight.detach().to_dtype(dy.dtype())?.contiguous()?;
        let carried = carried.map(|c| c.detach().contiguous()).transpose()?;
        let [sh, wh, dyh] = [&sum, &w, &dy].map(Held::new);
        let ch = carried.as_ref().map(Held::new);
        let g = cuda::add_norm_bwd(
            sh.arg(op, "sum")?,
            wh.arg(op, "weight")?,
            dyh.arg(op, "dy")?,
            ch.as_ref().map(|h| h.arg(op, "carried")).transpose()?,
            eps as f32,
        )?;
        let Some(x) = g.dz else {
            bail!("{op}: the backward kernel returned no rounded gradient")
        };
        let sums = tensor(g.parts, (g.programs, dim)).sum(0)?;
        return Ok(AddNormGrads {
            residual: tensor(g.dx, sum.shape()),
            x: tensor(x, sum.shape()),
            weight: sums.to_dtype(weight_dtype)?,
        });
    }
    let (dsum, dw) = sum_backward(&sum, &weight.detach(), eps as f32, &dy)?;
    let residual = match carried {
        Some(c) => (c.detach() + dsum)?,
        None => dsum,
    };
    Ok(AddNormGrads {
        x: residual.to_dtype(dy.dtype())?,
        residual,
        weight: dw.to_dtype(weight_dtype)?,
    })
}

/// y of the recorded add norm: the fused forward (leaving the new residual for
/// [`NewResidual`]); its backward is the RMSNorm's on the sum `x + residual`.
#[derive(Debug)]
struct RecordedAddNorm {
    norm: Arc<AddRmsNorm>,
    /// The new residual, once it exists.
    sum: Arc<OnceLock<Tensor>>,
}

impl RecordedAddNorm {
    /// `(dx, dresidual, dweight)` for dy, from the sum of x and the residual.
    fn grads(
        &self,
        x: &Tensor,
        residual: Option<&Tensor>,
        w: &Tensor,
        dy: &Tensor,
    ) -> Result<Grads3> {
        let compute = if wide(x.dtype()) {
            DType::F64
        } else {
            DType::F32
        };
        let sum = match (self.sum.get(), residual) {
            (Some(s), Some(_)) if s.dtype() == compute => s.clone(),
            (_, Some(r)) => (x.to_dtype(compute)? + r.to_dtype(compute)?)?,
            (_, None) => x.to_dtype(compute)?,
        };
        let (dsum, dw) = sum_backward(&sum, w, self.norm.eps, dy)?;
        let dx = x.track_op().then(|| dsum.to_dtype(x.dtype())).transpose()?;
        let dres = residual
            .filter(|r| r.track_op())
            .map(|r| dsum.to_dtype(r.dtype()))
            .transpose()?;
        let dw = w.track_op().then(|| dw.to_dtype(w.dtype())).transpose()?;
        Ok((dx, dres, dw))
    }
}

impl CustomOp2 for RecordedAddNorm {
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
        self.norm.cpu_fwd(x_s, x_l, w_s, w_l)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x_s: &candle_core::CudaStorage,
        x_l: &Layout,
        w_s: &candle_core::CudaStorage,
        w_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.norm.cuda_fwd(x_s, x_l, w_s, w_l)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, _, dw) = self.grads(x, None, w, dy)?;
        Ok((dx, dw))
    }
}

impl CustomOp3 for RecordedAddNorm {
    fn name(&self) -> &'static str {
        "add_rms_norm"
    }

    /// The residual is read from the held norm, as in inference; the argument routes its gradient.
    fn cpu_fwd(
        &self,
        x_s: &CpuStorage,
        x_l: &Layout,
        _r_s: &CpuStorage,
        _r_l: &Layout,
        w_s: &CpuStorage,
        w_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.norm.cpu_fwd(x_s, x_l, w_s, w_l)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x_s: &candle_core::CudaStorage,
        x_l: &Layout,
        _r_s: &candle_core::CudaStorage,
        _r_l: &Layout,
        w_s: &candle_core::CudaStorage,
        w_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.norm.cuda_fwd(x_s, x_l, w_s, w_l)
    }

    fn bwd(&self, x: &Tensor, r: &Tensor, w: &Tensor, _y: &Tensor, dy: &Tensor) -> Result<Grads3> {
        self.grads(x, Some(r), w, dy)
    }
}

/// The new residual of the recorded add norm on `(x, residual)`: the storage its y op's forward
/// left; the gradient passes to both arguments unchanged.
#[derive(Debug)]
struct NewResidual(Arc<AddRmsNorm>);

impl NewResidual {
    fn storage(&self) -> Result<Storage> {
        self.0.residual_out.take_storage("add_rms_norm", "residual")
    }
}

impl CustomOp2 for NewResidual {
    fn name(&self) -> &'static str {
        "add_rms_norm"
    }

    fn cpu_fwd(
        &self,
        _x_s: &CpuStorage,
        x_l: &Layout,
        _r_s: &CpuStorage,
        _r_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        match self.storage()? {
            Storage::Cpu(s) => Ok((s, x_l.shape().clone())),
            _ => bail!("add_rms_norm: the residual is not on the CPU"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _x_s: &candle_core::CudaStorage,
        x_l: &Layout,
        _r_s: &candle_core::CudaStorage,
        _r_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        match self.storage()? {
            Storage::Cuda(s) => Ok((s, x_l.shape().clone())),
            _ => bail!("add_rms_norm: the residual is not on CUDA"),
        }
    }

    fn bwd(
        &self,
        x: &Tensor,
        r: &Tensor,
        _sum: &Tensor,
        dsum: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dx = x.track_op().then(|| dsum.to_dtype(x.dtype())).transpose()?;
        let dr = r.track_op().then(|| dsum.to_dtype(r.dtype())).transpose()?;
        Ok((dx, dr))
    }
}
