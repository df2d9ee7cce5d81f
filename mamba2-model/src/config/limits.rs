//! The limits of a [`Config`] and their check: every dimension in range and every derived size
//! computed with checked arithmetic and at most [`Config::MAX_ELEMENTS`].

use candle_core::{bail, Result};

use super::{Config, ConfigFormat};

impl Config {
    /// The largest value of one dimension (`hidden_size`, `vocab_size`, `state_size`, `head_dim`,
    /// ...): 2^20, four times the largest vocabulary of published language models, so that a
    /// mistyped or hostile value fails here rather than in an allocation.
    pub const MAX_DIM: usize = 1 << 20;
    /// The most layers: 2^16, hundreds of times the deepest published models (each layer holds
    /// tensors and a cache state, so the count bounds work done before the weights are read).
    pub const MAX_LAYERS: usize = 1 << 16;
    /// The largest `chunk_size`: 2^16 (the scan runs with at most 256 whatever the config says;
    /// see [`crate::Mixer`]).
    pub const MAX_CHUNK_SIZE: usize = 1 << 16;
    /// The most elements of a derived size (`d_inner`, `conv_dim`, in_proj rows, each weight
    /// matrix, the SSM state of one sequence, the parameters of one layer): `i32::MAX`, because the
    /// CUDA kernels index tensors with 32-bit integers.
    pub const MAX_ELEMENTS: usize = i32::MAX as usize;
    /// The largest `layer_norm_epsilon`: 1 (a larger ε swamps the mean square of unit-scale
    /// activations; real models use 1e-5 or 1e-6).
    pub const MAX_NORM_EPS: f64 = 1.0;
    /// The largest `config.json` read: 1 MiB (real ones are a few KiB).
    pub const MAX_FILE_BYTES: u64 = 1 << 20;

    /// Checks sizes and values that both formats share: every dimension in `1..=` its limit,
    /// every derived size at most [`Config::MAX_ELEMENTS`] (computed with checked arithmetic),
    /// the step-size limit and ε in range. Errors name the key of this config's format.
    pub fn validate(&self) -> Result<()> {
        let k = |hf: &'static str, original: &'static str| match self.format {
            ConfigFormat::Hf => hf,
            ConfigFormat::Original => original,
        };
        let (d_model, d_state, expand) = (
            k("hidden_size", "d_model"),
            k("state_size", "ssm_cfg.d_state"),
            k("expand", "ssm_cfg.expand"),
        );
        let (headdim, nheads, ngroups) = (
            k("head_dim", "ssm_cfg.headdim"),
            k("num_heads", "nheads = expand·d_model/headdim"),
            k("n_groups", "ssm_cfg.ngroups"),
        );
        let d_conv = k("conv_kernel", "ssm_cfg.d_conv");
        for (key, v, max) in [
            (d_model, self.d_model, Self::MAX_DIM),
            (
                k("num_hidden_layers", "n_layer"),
                self.n_layer,
                Self::MAX_LAYERS,
            ),
            ("vocab_size", self.vocab_size, Self::MAX_DIM),
            (d_state, self.d_state, Self::MAX_DIM),
            (d_conv, self.d_conv, Self::MAX_DIM),
            (expand, self.expand, Self::MAX_DIM),
            (headdim, self.headdim, Self::MAX_DIM),
            (nheads, self.nheads, Self::MAX_DIM),
            (ngroups, self.ngroups, Self::MAX_DIM),
            (
                k("chunk_size", "ssm_cfg.chunk_size"),
                self.chunk_size,
                Self::MAX_CHUNK_SIZE,
            ),
        ] {
            check_dim(key, v, max)?;
        }
        let d_inner = checked_elements(
            &format!("{expand}·{d_model}"),
            &format!("{}·{}", self.expand, self.d_model),
            self.expand.checked_mul(self.d_model),
        )?;
        let heads_inner = checked_elements(
            &format!("{nheads}·{headdim}"),
            &format!("{}·{}", self.nheads, self.headdim),
            self.nheads.checked_mul(self.headdim),
        )?;
        if heads_inner != d_inner {
            bail!(
                "{nheads}·{headdim} ({}·{} = {heads_inner}) must equal {expand}·{d_model} \
                 ({}·{} = {d_inner})",
                self.nheads,
                self.headdim,
                self.expand,
                self.d_model,
            )
        }
        if self.nheads % self.ngroups != 0 {
            bail!(
                "{ngroups} ({}) must divide {nheads} ({})",
                self.ngroups,
                self.nheads
            )
        }
        let gn = checked_elements(
            &format!("{ngroups}·{d_state}"),
            &format!("{}·{}", self.ngroups, self.d_state),
            self.ngroups.checked_mul(self.d_state),
        )?;
        let conv_dim = checked_elements(
            &format!("conv_dim = d_inner + 2·{ngroups}·{d_state}"),
            &format!("{d_inner} + 2·{gn}"),
            gn.checked_mul(2).and_then(|x| x.checked_add(d_inner)),
        )?;
        let in_proj = checked_elements(
            &format!("in_proj rows = d_inner + conv_dim + {nheads}"),
            &format!("{d_inner} + {conv_dim} + {}", self.nheads),
            d_inner
                .checked_add(conv_dim)
                .and_then(|x| x.checked_add(self.nheads)),
        )?;
        let product = |what: &str, a: usize, b: usize| {
            checked_elements(what, &format!("{a}·{b}"), a.checked_mul(b))
        };
        let in_proj_weight = product(
            &format!("in_proj weight = in_proj rows·{d_model}"),
            in_proj,
            self.d_model,
        )?;
        let out_proj_weight = product(
            &format!("out_proj weight = {d_model}·d_inner"),
            self.d_model,
            d_inner,
        )?;
        let conv_weight = product(
            &format!("conv1d weight = conv_dim·{d_conv}"),
            conv_dim,
            self.d_conv,
        )?;
        product(
            &format!("SSM state of a sequence = d_inner·{d_state}"),
            d_inner,
            self.d_state,
        )?;
        product(
            &format!("embedding = vocab_size·{d_model}"),
            self.vocab_size,
            self.d_model,
        )?;
        // in_proj and its bias, conv1d and its bias, A | D | dt_bias, the gated norm, out_proj and
        // its bias, the block's norm.
        let layer = [
            in_proj_weight,
            if self.bias { in_proj } else { 0 },
            conv_weight,
            if self.conv_bias { conv_dim } else { 0 },
            self.nheads.saturating_mul(3),
            d_inner,
            out_proj_weight,
            if self.bias { self.d_model } else { 0 },
            self.d_model,
        ];
        checked_elements(
            "parameters of one layer",
            &layer.map(|n| n.to_string()).join(" + "),
            layer.iter().try_fold(0usize, |acc, &n| acc.checked_add(n)),
        )?;

        let (lo, hi) = self.dt_limit;
        if !(lo.is_finite() && lo >= 0.0 && hi > 0.0 && hi >= lo) {
            bail!(
                "{} must be [lo, hi] with lo finite and >= 0, hi > 0 and >= lo (hi may be \
                 Infinity), got [{lo:?}, {hi:?}]",
                k("time_step_limit", "ssm_cfg.dt_limit")
            )
        }
        let eps = self.norm_eps;
        if !(eps.is_finite() && eps > 0.0 && eps <= Self::MAX_NORM_EPS) {
            bail!(
                "{} must be finite, > 0 and <= {}, got {eps:?}",
                k("layer_norm_epsilon", "norm_eps"),
                Self::MAX_NORM_EPS
            )
        }
        Ok(())
    }
}

/// Checks that the dimension `key` is in `1..=max`.
pub(super) fn check_dim(key: &str, v: usize, max: usize) -> Result<()> {
    if v == 0 {
        bail!("{key} must be >= 1, got 0")
    }
    if v > max {
        bail!("{key} = {v} is above the limit of {max}")
    }
    Ok(())
}

/// `value` (the checked result of `expr`, the size `what`), refused when it overflowed or is
/// above [`Config::MAX_ELEMENTS`].
pub(super) fn checked_elements(what: &str, expr: &str, value: Option<usize>) -> Result<usize> {
    match value {
        Some(v) if v <= Config::MAX_ELEMENTS => Ok(v),
        Some(v) => bail!(
            "{what} = {expr} = {v} is above the limit of {} elements (the CUDA kernels index \
             tensors with i32)",
            Config::MAX_ELEMENTS
        ),
        None => bail!("{what} = {expr} overflows"),
    }
}
