//! dt processing shared by prefill and decode (mamba_ssm semantics):
//! `dt ← clamp(softplus(dt + dt_bias), lo, hi)`, softplus(v) = ln(1 + eˣ) for v ≤ 20, else v.

use candle_core::{bail, Result, Tensor};

use crate::check;
use crate::cpu::Real;

/// How raw `dt` becomes the step size: optional per-head bias `[H]` (f32), softplus, clamp.
#[derive(Clone, Copy, Debug)]
pub struct DtOptions<'a> {
    pub bias: Option<&'a Tensor>,
    pub softplus: bool,
    pub limit: (f32, f32),
}

impl Default for DtOptions<'_> {
    /// No bias, no softplus, limit (0, ∞): mamba_ssm's `mamba_chunk_scan_combined` defaults.
    fn default() -> Self {
        Self {
            bias: None,
            softplus: false,
            limit: (0.0, f32::INFINITY),
        }
    }
}

/// The per-value part of [`DtOptions`] (softplus, clamp), as the kernels apply it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct DtRule {
    pub softplus: bool,
    pub limit: (f32, f32),
}

impl DtOptions<'_> {
    pub(crate) fn rule(&self) -> DtRule {
        DtRule {
            softplus: self.softplus,
            limit: self.limit,
        }
    }

    pub(crate) fn check(&self, op: &str, x: &Tensor, nheads: usize) -> Result<()> {
        if let Some(bias) = self.bias {
            check::head_param(op, "dt_bias", bias, x, nheads)?;
        }
        let (lo, hi) = self.limit;
        // A step size is finite and non-negative; an infinite upper limit leaves it unclamped.
        if !lo.is_finite() || lo < 0.0 || hi.is_nan() || lo > hi {
            bail!("{op}: dt_limit must be (lo, hi) with 0 <= lo <= hi, lo finite, got ({lo}, {hi})")
        }
        Ok(())
    }
}

/// The processed step size of one raw value.
#[inline]
pub(crate) fn process<T: Real>(raw: T, bias: T, rule: DtRule) -> T {
    let (lo, hi) = (T::of(rule.limit.0), T::of(rule.limit.1));
    let v = raw + bias;
    let v = if rule.softplus && v <= T::of(20.0) {
        v.exp().ln_1p()
    } else {
        v
    };
    v.max(lo).min(hi)
}
