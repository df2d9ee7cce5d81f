//! The mean cross-entropy of logits against target ids, the training loss, as one op:
//!
//! ```text
//! lse_r = log Σ_v exp(logits[r,v])                        logits [R,V], targets [R]
//! loss  = (1/R) Σ_r (lse_r − logits[r, targets[r]])
//! d loss / d logits[r,v] = (exp(logits[r,v] − lse_r) − [v = targets[r]]) / R
//! ```
//!
//! candle's composition (log-softmax, gather, mean, each with its backward) makes about a dozen
//! passes over the `[R,V]` logits, the largest tensor of a training step; the op makes one in
//! its forward and one in its backward, parallel over rows. Logits f32, f16 or bf16 are
//! computed in f32 and the loss is f32; f64 logits in f64.
//!
//! On the CPU the op keeps lse_r for its backward. On CUDA (`kernels/loss/cross_entropy.cu`) it
//! gives each row's NLL, whose mean is the loss, and its backward computes lse_r again from the
//! row (a read that hits L2); the targets are checked there rather than read back to the host
//! (which would wait for the forward queued before): a target out of range makes the loss NaN
//! instead of an error. f64 logits on CUDA, and other devices, use candle's ops.
//!
//! [`linear_cross_entropy`] takes the rows before the output layer and its weight, `logits =
//! hidden · weightᵀ`. On CUDA it is one recorded op on `(hidden, weight)` that keeps the logits
//! and, in its backward, makes their gradient and multiplies it out: candle's backward would
//! otherwise add the `[R,V]` gradient into a zeroed buffer of its own, two more passes over the
//! step's largest tensor.

mod cpu;
#[cfg(feature = "cuda")]
mod cuda;

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor, D,
};

use crate::check;
use crate::cpu::{gradient, view, wide, Held, Real};

const OP: &str = "cross_entropy";

/// The recorded loss on `logits`; the targets are held.
#[derive(Debug)]
struct CrossEntropy {
    targets: Vec<u32>,
    vocab: usize,
    /// lse of every row, written by the forward for the backward.
    lse: Mutex<Vec<f64>>,
}

impl CrossEntropy {
    fn forward<T: Real>(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let logits = view::<T>(OP, "logits", s, l)?;
        let (nll, lse) = cpu::forward(&logits, &self.targets, self.vocab);
        match self.lse.lock() {
            Ok(mut slot) => *slot = lse,
            Err(_) => bail!("{OP}: state poisoned"),
        }
        let mean = nll / self.targets.len() as f64;
        let out = if wide(s.dtype()) {
            CpuStorage::F64(vec![mean])
        } else {
            CpuStorage::F32(vec![mean as f32])
        };
        Ok((out, Shape::from(())))
    }

    fn backward<T: Real>(&self, logits: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let scale = grad.to_dtype(DType::F64)?.to_scalar::<f64>()? / self.targets.len() as f64;
        let logits_c = logits.contiguous()?;
        let held = Held::new(&logits_c);
        let values = held.view::<T>(OP, "logits")?;
        let lse = match self.lse.lock() {
            Ok(lse) => lse.clone(),
            Err(_) => bail!("{OP}: state poisoned"),
        };
        if lse.len() != self.targets.len() {
            bail!("{OP}: the backward ran before the forward")
        }
        let dlogits = cpu::backward(&values, &self.targets, &lse, self.vocab, scale);
        gradient(dlogits, logits)
    }
}

impl CustomOp1 for CrossEntropy {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        if wide(s.dtype()) {
            self.forward::<f64>(s, l)
        } else {
            self.forward::<f32>(s, l)
        }
    }

    fn bwd(&self, logits: &Tensor, _loss: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        if !logits.device().is_cpu() {
            bail!("{OP}: the recorded op runs on the CPU only")
        }
        if wide(logits.dtype()) {
            self.backward::<f64>(logits, grad)
        } else {
            self.backward::<f32>(logits, grad)
        }
    }
}

/// Each row's NLL `[R]` (f32) of `logits [R, V]` against `targets [R]` (u32 or i64), recorded:
/// the CUDA op.
#[derive(Debug)]
struct NllRows;

impl CustomOp2 for NllRows {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        bail!("{OP}: the per-row op runs on CUDA; the CPU's is the recorded mean")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x_s: &candle_core::CudaStorage,
        x_l: &Layout,
        t_s: &candle_core::CudaStorage,
        t_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let nll = cuda::nll_rows((x_s, x_l), (t_s, t_l))?;
        Ok((nll, Shape::from(x_l.dims()[0])))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        _nll: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        // The mean's gradient arrives broadcast from one value.
        let grad = grad.to_dtype(DType::F32)?.contiguous()?;
        let d = logits.apply_op3_no_bwd(targets, &grad, &DLogits)?;
        Ok((Some(d), None))
    }
}

/// The logits' gradient `[R, V]` from (logits, targets, per-row output gradient): the backward
/// of [`NllRows`].
#[derive(Debug)]
struct DLogits;

impl CustomOp3 for DLogits {
    fn name(&self) -> &'static str {
        "cross_entropy backward"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        bail!("{OP}: the per-row backward runs on CUDA")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x_s: &candle_core::CudaStorage,
        x_l: &Layout,
        t_s: &candle_core::CudaStorage,
        t_l: &Layout,
        g_s: &candle_core::CudaStorage,
        g_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let dx = cuda::dlogits((x_s, x_l), (t_s, t_l), (g_s, g_l))?;
        Ok((dx, x_l.shape().clone()))
    }
}

/// Each row's NLL `[R]` (f32) of `hidden · weightᵀ` against the held targets, recorded on
/// `(hidden [R, d], weight [V, d])`: the logits are the op's own, kept for the backward.
#[derive(Debug)]
struct LinearNllRows {
    logits: Tensor,
    targets: Tensor,
}

impl CustomOp2 for LinearNllRows {
    fn name(&self) -> &'static str {
        "linear_cross_entropy"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        bail!("linear_cross_entropy: the recorded op runs on CUDA; the CPU composes the product and cross_entropy")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _h_s: &candle_core::CudaStorage,
        _h_l: &Layout,
        _w_s: &candle_core::CudaStorage,
        _w_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (x_s, x_l) = self.logits.storage_and_layout();
        let (t_s, t_l) = self.targets.storage_and_layout();
        match (&*x_s, &*t_s) {
            (candle_core::Storage::Cuda(x), candle_core::Storage::Cuda(t)) => {
                let nll = cuda::nll_rows((x, x_l), (t, t_l))?;
                Ok((nll, Shape::from(x_l.dims()[0])))
            }
            _ => bail!("linear_cross_entropy: the logits and targets are not on CUDA"),
        }
    }

    fn bwd(
        &self,
        hidden: &Tensor,
        weight: &Tensor,
        _nll: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad.to_dtype(DType::F32)?.contiguous()?;
        let d = self
            .logits
            .apply_op3_no_bwd(&self.targets, &grad, &DLogits)?;
        let dh = hidden
            .track_op()
            .then(|| d.matmul(&weight.detach()))
            .transpose()?;
        let dw = weight
            .track_op()
            .then(|| d.t()?.matmul(&hidden.detach()))
            .transpose()?;
        Ok((dh, dw))
    }
}

/// The mean cross-entropy of `logits [R, V]` (f32, f16, bf16 or f64) against `targets [R]` (u8,
/// u32 or i64 ids below V): a scalar, f32 (f64 for f64 logits), differentiable in the logits.
/// A target outside `0..V` is an error on the CPU and makes the loss NaN on other devices.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use mamba2_kernels::cross_entropy;
///
/// let logits = Tensor::new(&[[2f32, 0.0, 0.0], [0.0, 0.0, 0.0]], &Device::Cpu)?;
/// let targets = Tensor::new(&[0u32, 2], &Device::Cpu)?;
/// let loss = cross_entropy(&logits, &targets)?.to_scalar::<f32>()?;
/// let lse0 = (2f32.exp() + 2.0).ln();
/// assert!((loss - (lse0 - 2.0 + 3f32.ln()) / 2.0).abs() < 1e-6);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let [rows, vocab] = check::rank::<2>(OP, "logits", logits, "[R, V]")?;
    check::float(OP, "logits", logits)?;
    check::device(OP, "targets", targets, logits)?;
    check::shape(OP, "targets", targets, &[rows], "[R]")?;
    if rows == 0 || vocab == 0 {
        bail!(
            "{OP}: logits have an empty dimension, shape {:?}",
            logits.dims()
        )
    }
    if !matches!(targets.dtype(), DType::U8 | DType::U32 | DType::I64) {
        bail!(
            "{OP}: targets must be u8, u32 or i64 ids, got {:?}",
            targets.dtype()
        )
    }
    if logits.device().is_cuda() && !wide(logits.dtype()) {
        let targets = match targets.dtype() {
            DType::U8 => targets.to_dtype(DType::U32)?,
            _ => targets.contiguous()?,
        };
        let logits = logits.contiguous()?;
        let nll = if logits.track_op() {
            logits.apply_op2(&targets, NllRows)?
        } else {
            logits.apply_op2_no_bwd(&targets, &NllRows)?
        };
        return nll.mean_all();
    }
    if !logits.device().is_cpu() {
        return composed(logits, targets, vocab);
    }
    let ids = targets.to_dtype(DType::I64)?.to_vec1::<i64>()?;
    let mut held = Vec::with_capacity(rows);
    for (r, &id) in ids.iter().enumerate() {
        match u32::try_from(id) {
            Ok(t) if (t as usize) < vocab => held.push(t),
            _ => bail!("{OP}: target {id} at row {r} is not below the vocabulary size {vocab}"),
        }
    }
    let op = CrossEntropy {
        targets: held,
        vocab,
        lse: Mutex::new(Vec::new()),
    };
    if logits.track_op() {
        logits.apply_op1(op)
    } else {
        logits.apply_op1_no_bwd(&op)
    }
}

/// [`cross_entropy`] of the logits `hidden · weightᵀ`, for `hidden [R, d]` and an output
/// layer's `weight [V, d]` (same dtype and device) against `targets [R]`: differentiable in both.
/// On CUDA (f32, f16, bf16) one recorded op whose backward makes the logits' gradient itself (the
/// module doc); elsewhere the product and [`cross_entropy`].
///
/// ```
/// use candle_core::{Device, Tensor};
/// use mamba2_kernels::{cross_entropy, linear_cross_entropy};
///
/// let dev = Device::Cpu;
/// let hidden = Tensor::new(&[[1f32, 0.5], [-1.0, 2.0]], &dev)?;
/// let weight = Tensor::new(&[[0.5f32, 1.0], [2.0, -1.0], [0.0, 0.25]], &dev)?;
/// let targets = Tensor::new(&[2u32, 0], &dev)?;
/// let fused = linear_cross_entropy(&hidden, &weight, &targets)?.to_scalar::<f32>()?;
/// let logits = hidden.matmul(&weight.t()?)?;
/// let plain = cross_entropy(&logits, &targets)?.to_scalar::<f32>()?;
/// assert!((fused - plain).abs() < 1e-6);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn linear_cross_entropy(hidden: &Tensor, weight: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let op = "linear_cross_entropy";
    let [rows, dim] = check::rank::<2>(op, "hidden", hidden, "[R, d]")?;
    let [_, wdim] = check::rank::<2>(op, "weight", weight, "[V, d]")?;
    check::float(op, "hidden", hidden)?;
    check::device(op, "weight", weight, hidden)?;
    check::dtype(op, "weight", weight, hidden.dtype())?;
    check::device(op, "targets", targets, hidden)?;
    check::shape(op, "targets", targets, &[rows], "[R]")?;
    if wdim != dim {
        bail!(
            "{op}: weight must be [V, {dim}] for hidden [{rows}, {dim}], got {:?}",
            weight.dims()
        )
    }
    let tracked = hidden.track_op() || weight.track_op();
    if !(tracked && hidden.device().is_cuda() && !wide(hidden.dtype())) {
        return cross_entropy(&hidden.matmul(&weight.t()?)?, targets);
    }
    if rows == 0 || weight.dim(0)? == 0 {
        bail!(
            "{op}: an empty dimension, hidden {:?} and weight {:?}",
            hidden.dims(),
            weight.dims()
        )
    }
    let targets = match targets.dtype() {
        DType::U8 => targets.to_dtype(DType::U32)?,
        DType::U32 | DType::I64 => targets.contiguous()?,
        dt => bail!("{op}: targets must be u8, u32 or i64 ids, got {dt:?}"),
    };
    let logits = hidden.detach().matmul(&weight.detach().t()?)?;
    let nll = hidden.apply_op2(weight, LinearNllRows { logits, targets })?;
    nll.mean_all()
}

/// The loss from candle's ops, for devices without the op: `mean(lse − picked)` in f32 (f64).
/// The ids are checked where they are, without reading them back (which would wait for the
/// work queued before): a target outside `0..vocab` makes the loss NaN.
fn composed(logits: &Tensor, targets: &Tensor, vocab: usize) -> Result<Tensor> {
    let compute = if wide(logits.dtype()) {
        DType::F64
    } else {
        DType::F32
    };
    let x = logits.to_dtype(compute)?;
    let max = x.max_keepdim(D::Minus1)?;
    let shifted = x.broadcast_sub(&max)?;
    let lse = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    let wide_ids = targets.to_dtype(DType::I64)?;
    let valid = wide_ids.ge(0i64)?.mul(&wide_ids.lt(vocab as i64)?)?;
    let ids = wide_ids
        .clamp(0i64, vocab as i64 - 1)?
        .to_dtype(DType::U32)?
        .unsqueeze(1)?;
    let picked = shifted.gather(&ids, 1)?;
    let loss = (lse - picked)?.mean_all()?;
    let zero = Tensor::zeros((), compute, logits.device())?;
    let bad = valid
        .where_cond(
            &zero.broadcast_as(valid.shape())?,
            &zero.affine(0.0, f64::NAN)?.broadcast_as(valid.shape())?,
        )?
        .sum_all()?;
    loss + bad
}
