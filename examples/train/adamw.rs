//! The optimizer of the train example: AdamW whose moments can be saved and restored, gradient
//! clipping by global norm, and the learning-rate schedule.
//!
//! candle-nn's `AdamW` keeps its moments and step count private, so a checkpoint could not hold
//! them; this one computes the same update in the same order (so it matches candle-nn's bit for
//! bit, see `tests/train_cli.rs`), PyTorch's `AdamW`:
//!
//! ```text
//! m ← β1·m + (1−β1)·g        v ← β2·v + (1−β2)·g²        (t = the step, from 1)
//! θ ← θ·(1 − lr·λ) − lr · (m / (1−β1ᵗ)) / (√(v / (1−β2ᵗ)) + ε)
//! ```
//!
//! with the decay λ applied to the weights `new`'s predicate picks (the train example: matrices,
//! not biases, norms, `A_log`, `D` or `dt_bias`, as `tools/train.py` does). On the CPU each
//! weight's update is three passes in place (the two moments, then the weight) instead of a
//! dozen tensor ops, every product rounded as its tensor op rounds it, so the bits are the same.

use std::collections::HashMap;

use anyhow::{bail, Result};
use candle_core::{CpuStorage, DType, InplaceOp2, InplaceOp3, Layout, Tensor, Var};
use candle_nn::ParamsAdamW;
use rayon::prelude::*;

use crate::cli::Settings;

/// β1, β2 and ε of `tools/train.py`.
pub const BETA1: f64 = 0.9;
pub const BETA2: f64 = 0.95;
pub const EPS: f64 = 1e-8;

/// Names of the moments in a saved state (PyTorch's).
const FIRST: &str = "exp_avg";
const SECOND: &str = "exp_avg_sq";

struct Slot {
    name: String,
    var: Var,
    m: Tensor,
    v: Tensor,
    decay: bool,
}

/// Elements per task of the in-place updates.
const TASK: usize = 1 << 14;

/// The contiguous f32 elements of a CPU storage, or an error naming `what`.
fn f32s<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> candle_core::Result<&'a [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((a, b))) => Ok(&v[a..b]),
        _ => candle_core::bail!("adamw: {what} must be contiguous f32"),
    }
}

fn f32s_mut<'a>(
    s: &'a mut CpuStorage,
    l: &Layout,
    what: &str,
) -> candle_core::Result<&'a mut [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((a, b))) => Ok(&mut v[a..b]),
        _ => candle_core::bail!("adamw: {what} must be contiguous f32"),
    }
}

/// A moment updated in place: `m ← keep·m + mix·g` (`g²` for the second moment), each product
/// rounded as candle's `affine` rounds it, so the update equals the tensor formula bit for bit.
struct Ema {
    keep: f32,
    mix: f32,
    square: bool,
}

impl Ema {
    fn new(beta: f64, square: bool) -> Self {
        Self {
            keep: beta as f32,
            mix: (1.0 - beta) as f32,
            square,
        }
    }
}

impl InplaceOp2 for Ema {
    fn name(&self) -> &'static str {
        "adamw-moment"
    }

    fn cpu_fwd(
        &self,
        m: &mut CpuStorage,
        m_l: &Layout,
        g: &CpuStorage,
        g_l: &Layout,
    ) -> candle_core::Result<()> {
        let (m, g) = (f32s_mut(m, m_l, "a moment")?, f32s(g, g_l, "a gradient")?);
        let (keep, mix, square) = (self.keep, self.mix, self.square);
        m.par_chunks_mut(TASK)
            .zip(g.par_chunks(TASK))
            .for_each(|(m, g)| {
                for (m, &g) in m.iter_mut().zip(g) {
                    let g = if square { g * g } else { g };
                    *m = (*m * keep + 0.0) + (g * mix + 0.0);
                }
            });
        Ok(())
    }
}

/// The weight updated in place from its new moments:
/// `θ ← keep·θ − lr · (m·scale_m) / (√(v·scale_v) + ε)`, rounded as the tensor formula.
struct Update {
    scale_m: f32,
    scale_v: f32,
    keep: f32,
    eps: f32,
    lr: f32,
}

impl InplaceOp3 for Update {
    fn name(&self) -> &'static str {
        "adamw-update"
    }

    fn cpu_fwd(
        &self,
        theta: &mut CpuStorage,
        t_l: &Layout,
        m: &CpuStorage,
        m_l: &Layout,
        v: &CpuStorage,
        v_l: &Layout,
    ) -> candle_core::Result<()> {
        let theta = f32s_mut(theta, t_l, "a weight")?;
        let (m, v) = (f32s(m, m_l, "a moment")?, f32s(v, v_l, "a moment")?);
        let Update {
            scale_m,
            scale_v,
            keep,
            eps,
            lr,
        } = *self;
        theta
            .par_chunks_mut(TASK)
            .zip(m.par_chunks(TASK).zip(v.par_chunks(TASK)))
            .for_each(|(t, (m, v))| {
                for ((t, &m), &v) in t.iter_mut().zip(m).zip(v) {
                    let adjusted = (m * scale_m + 0.0) / ((v * scale_v + 0.0).sqrt() * 1.0 + eps);
                    *t = (*t * keep + 0.0) - (adjusted * lr + 0.0);
                }
            });
        Ok(())
    }
}

/// AdamW over named weights (see the module doc).
pub struct AdamW {
    params: ParamsAdamW,
    slots: Vec<Slot>,
    step: usize,
}

impl AdamW {
    /// An optimizer of `vars` with zero moments; `decay(name, var)` says which weights decay.
    pub fn new(
        vars: Vec<(String, Var)>,
        params: ParamsAdamW,
        decay: impl Fn(&str, &Var) -> bool,
    ) -> Result<Self> {
        let slots = vars
            .into_iter()
            .map(|(name, var)| {
                // Two tensors: on the CPU the moments are updated in place.
                let (m, v) = (var.as_tensor().zeros_like()?, var.as_tensor().zeros_like()?);
                Ok(Slot {
                    decay: decay(&name, &var),
                    name,
                    var,
                    m,
                    v,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            params,
            slots,
            step: 0,
        })
    }

    pub fn set_lr(&mut self, lr: f64) {
        self.params.lr = lr
    }

    /// One update with `grads`, one per weight in the order of `new`'s `vars`.
    pub fn step(&mut self, grads: &[Tensor]) -> Result<()> {
        if grads.len() != self.slots.len() {
            bail!("{} gradients for {} weights", grads.len(), self.slots.len())
        }
        self.step += 1;
        let p = &self.params;
        let (beta1, beta2, lr) = (p.beta1, p.beta2, p.lr);
        let scale_m = 1f64 / (1f64 - beta1.powi(self.step as i32));
        let scale_v = 1f64 / (1f64 - beta2.powi(self.step as i32));
        for (slot, g) in self.slots.iter_mut().zip(grads) {
            let lr_lambda = if slot.decay { lr * p.weight_decay } else { 0.0 };
            let theta = slot.var.as_tensor();
            if theta.device().is_cpu() && theta.dtype() == DType::F32 {
                let g = g.contiguous()?;
                slot.m.inplace_op2(&g, &Ema::new(beta1, false))?;
                slot.v.inplace_op2(&g, &Ema::new(beta2, true))?;
                let update = Update {
                    scale_m: scale_m as f32,
                    scale_v: scale_v as f32,
                    keep: (1f64 - lr_lambda) as f32,
                    eps: p.eps as f32,
                    lr: lr as f32,
                };
                theta.inplace_op3(&slot.m, &slot.v, &update)?;
                continue;
            }
            let next_m = ((&slot.m * beta1)? + (g * (1.0 - beta1))?)?;
            let next_v = ((&slot.v * beta2)? + (g.sqr()? * (1.0 - beta2))?)?;
            let m_hat = (&next_m * scale_m)?;
            let v_hat = (&next_v * scale_v)?;
            let next_theta = (theta * (1f64 - lr_lambda))?;
            let adjusted = (m_hat / (v_hat.sqrt()? + p.eps)?)?;
            slot.var.set(&(next_theta - (adjusted * lr)?)?)?;
            (slot.m, slot.v) = (next_m, next_v);
        }
        Ok(())
    }

    /// The moments, `exp_avg.NAME` and `exp_avg_sq.NAME`, for a checkpoint.
    pub fn state(&self) -> Vec<(String, Tensor)> {
        self.slots
            .iter()
            .flat_map(|s| {
                [
                    (format!("{FIRST}.{}", s.name), s.m.clone()),
                    (format!("{SECOND}.{}", s.name), s.v.clone()),
                ]
            })
            .collect()
    }

    /// Restores the moments saved by [`AdamW::state`] after `step` updates; every weight's two
    /// moments must be there, f32, of the weight's shape, and nothing else.
    pub fn load_state(&mut self, mut saved: HashMap<String, Tensor>, step: usize) -> Result<()> {
        for slot in &mut self.slots {
            let shape = slot.var.shape().clone();
            let mut take = |kind: &str| -> Result<Tensor> {
                let key = format!("{kind}.{}", slot.name);
                let Some(t) = saved.remove(&key) else {
                    bail!("the optimizer state has no {key}: it belongs to another model")
                };
                if t.shape() != &shape || t.dtype() != DType::F32 {
                    bail!(
                        "the optimizer state's {key} is {:?} {:?}, the weight is {:?} F32: it \
                         belongs to another model",
                        t.dtype(),
                        t.dims(),
                        shape.dims()
                    )
                }
                Ok(t.to_device(slot.var.device())?)
            };
            slot.m = take(FIRST)?;
            slot.v = take(SECOND)?;
        }
        if let Some(extra) = saved.keys().min() {
            bail!(
                "the optimizer state has {} tensor(s) for weights this model lacks (e.g. {extra}): \
                 it belongs to another model",
                saved.len()
            )
        }
        self.step = step;
        Ok(())
    }
}

/// The learning rate of update `step` (from 0): linear warm-up to `lr` over `warmup` steps,
/// then a cosine down to `final_lr_frac · lr` at the last step.
pub fn lr_at(s: &Settings, step: usize) -> f64 {
    if step < s.warmup {
        return s.lr * (step + 1) as f64 / s.warmup as f64;
    }
    let decay_steps = (s.steps - s.warmup).saturating_sub(1).max(1);
    let progress = ((step - s.warmup) as f64 / decay_steps as f64).min(1.0);
    let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
    s.lr * (s.final_lr_frac + (1.0 - s.final_lr_frac) * cosine)
}

/// The global L2 norm of `grads` and the gradients scaled to a norm of at most `clip` (0: left
/// as they are), as PyTorch's `clip_grad_norm_` does.
pub fn clip_global_norm(grads: Vec<Tensor>, clip: f64) -> Result<(f64, Vec<Tensor>)> {
    let squares = grads
        .iter()
        .map(|g| g.sqr()?.sum_all())
        .collect::<candle_core::Result<Vec<_>>>()?;
    let norm = Tensor::stack(&squares, 0)?
        .to_vec1::<f32>()?
        .iter()
        .map(|&s| f64::from(s))
        .sum::<f64>()
        .sqrt();
    // The 1e-6 keeps the scale finite at a zero norm, as PyTorch's.
    let scale = clip / (norm + 1e-6);
    if clip == 0.0 || scale >= 1.0 || !norm.is_finite() {
        return Ok((norm, grads));
    }
    let scaled = grads
        .iter()
        .map(|g| g * scale)
        .collect::<candle_core::Result<_>>()?;
    Ok((norm, scaled))
}
