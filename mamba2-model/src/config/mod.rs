//! Model hyper-parameters, read from either `config.json` format:
//!
//! - HF transformers `Mamba2Config` (`hidden_size`, `num_heads`, `head_dim`, `state_size`, ...).
//!   Absent keys take transformers' defaults (the Codestral-sized ones), as `from_pretrained` does.
//! - state-spaces `MambaConfig` (`d_model`, `n_layer`, `vocab_size`, `ssm_cfg {...}`, ...). Absent
//!   keys take `MambaConfig`'s defaults and absent `ssm_cfg` keys the `Mamba2` module's (d_state 128,
//!   d_conv 4, expand 2, headdim 64, ngroups 1, chunk_size 256, dt_limit (0, ∞)); the vocabulary is
//!   padded up to `pad_vocab_size_multiple` as mamba_ssm does at load.
//!
//! Derived sizes: `d_inner = expand·d_model = nheads·headdim`, `conv_dim = d_inner + 2·ngroups·d_state`
//! (the xBC channels), in_proj rows `2·d_inner + 2·ngroups·d_state + nheads` (z | xBC | dt).
//! transformers writes an infinite `time_step_limit` bound as `{"__float__": "Infinity"}` (5.x) or
//! as a bare `Infinity` (older versions, hub checkpoints; not JSON): both are read. Every invalid,
//! inconsistent or unsupported value is an error naming the key.
//!
//! Limits (associated constants of [`Config`]): every dimension is at most [`Config::MAX_DIM`]
//! (layers [`Config::MAX_LAYERS`], `chunk_size` [`Config::MAX_CHUNK_SIZE`]), and every derived size
//! — `d_inner`, `conv_dim`, in_proj rows, each weight matrix, a sequence's SSM state, one layer's
//! parameters — at most [`Config::MAX_ELEMENTS`]; they are computed with checked arithmetic, so no
//! size wraps around. `config.json` itself is read up to [`Config::MAX_FILE_BYTES`].

mod fields;
mod limits;
#[cfg(test)]
mod tests;

use std::io::Read;
use std::path::Path;

use candle_core::{bail, Result};
use serde_json::{Map, Value};

use fields::{quote_bare_floats, Fields};
use limits::{check_dim, checked_elements};

/// Which `config.json` dialect a [`Config`] was read from; it also fixes the tensor key names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConfigFormat {
    /// HF transformers `Mamba2Config`.
    Hf,
    /// state-spaces `MambaConfig` with `ssm_cfg.layer = "Mamba2"`.
    Original,
}

/// The hyper-parameters of a Mamba-2 language model.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub format: ConfigFormat,
    pub d_model: usize,
    pub n_layer: usize,
    /// Rows of the embedding and the LM head (padded for the original format).
    pub vocab_size: usize,
    pub d_state: usize,
    pub d_conv: usize,
    pub expand: usize,
    pub headdim: usize,
    pub nheads: usize,
    pub ngroups: usize,
    /// The checkpoint's chunk size (the result does not depend on it; see `Mixer`).
    pub chunk_size: usize,
    /// `(lo, hi)` clamp of the processed step size, applied in prefill and decode.
    pub dt_limit: (f32, f32),
    /// in_proj / out_proj have biases.
    pub bias: bool,
    pub conv_bias: bool,
    pub norm_eps: f64,
    pub residual_in_fp32: bool,
    pub tie_embeddings: bool,
    /// End-of-sequence token ids from the config (HF `eos_token_id`; empty for the original format).
    pub eos_token_ids: Vec<u32>,
}

impl Config {
    /// Reads and validates `path` (a `config.json` of either format).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        Self::read(path, path)
    }

    /// Reads and validates `path`, called `shown` in errors (the file as the caller named it,
    /// before symlinks were resolved).
    pub(crate) fn read(path: &Path, shown: &Path) -> Result<Self> {
        let cannot = |e: &dyn std::fmt::Display| {
            candle_core::Error::msg(format!("cannot read config {}: {e}", shown.display()))
        };
        let mut bytes = Vec::new();
        std::fs::File::open(path)
            .map_err(|e| cannot(&e))?
            .take(Self::MAX_FILE_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| cannot(&e))?;
        if bytes.len() as u64 > Self::MAX_FILE_BYTES {
            return Err(cannot(&format!(
                "larger than the limit of {} bytes",
                Self::MAX_FILE_BYTES
            )));
        }
        let text = String::from_utf8(bytes).map_err(|e| cannot(&e))?;
        Self::from_json(&text)
            .map_err(|e| candle_core::Error::msg(format!("config {}: {e}", shown.display())))
    }

    /// Parses and validates the text of a `config.json` of either format.
    pub fn from_json(text: &str) -> Result<Self> {
        let value: Value = serde_json::from_str(&quote_bare_floats(text))
            .map_err(|e| candle_core::Error::msg(format!("config is not valid JSON: {e}")))?;
        let Value::Object(obj) = value else {
            bail!("config must be a JSON object")
        };
        let hf = obj.contains_key("hidden_size");
        let original = obj.contains_key("d_model");
        let cfg = match (hf, original) {
            (true, false) => Self::from_hf(&Fields::new(&obj, ""))?,
            (false, true) => Self::from_original(&obj)?,
            (true, true) => {
                bail!("config has both hidden_size (HF format) and d_model (state-spaces format)")
            }
            (false, false) => bail!(
                "config has neither hidden_size (HF Mamba2Config) nor d_model (state-spaces \
                 MambaConfig): not a Mamba-2 config"
            ),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    fn from_hf(f: &Fields) -> Result<Self> {
        match f.string("model_type", Some("mamba2"))?.as_str() {
            "mamba2" => {}
            other => bail!("model_type is {other:?}, expected \"mamba2\""),
        }
        let act = f.string("hidden_act", Some("silu"))?;
        if act != "silu" && act != "swish" {
            bail!("hidden_act {act:?} is not supported (Mamba-2 uses silu)")
        }
        Ok(Self {
            format: ConfigFormat::Hf,
            d_model: f.usize("hidden_size", 4096)?,
            n_layer: f.usize("num_hidden_layers", 64)?,
            vocab_size: f.usize("vocab_size", 32768)?,
            d_state: f.usize("state_size", 128)?,
            d_conv: f.usize("conv_kernel", 4)?,
            expand: f.usize("expand", 2)?,
            headdim: f.usize("head_dim", 64)?,
            nheads: f.usize("num_heads", 128)?,
            ngroups: f.usize("n_groups", 8)?,
            chunk_size: f.usize("chunk_size", 256)?,
            dt_limit: f.limit("time_step_limit")?,
            bias: f.bool("use_bias", false)?,
            conv_bias: f.bool("use_conv_bias", true)?,
            norm_eps: f.float("layer_norm_epsilon", 1e-5)?,
            residual_in_fp32: f.bool("residual_in_fp32", true)?,
            tie_embeddings: f.bool("tie_word_embeddings", false)?,
            eos_token_ids: f.token_ids("eos_token_id", &[2])?,
        })
    }

    /// This config as an HF `Mamba2Config` `config.json` (what `save_pretrained` of transformers
    /// 5.17 writes for these fields; an infinite dt limit as `{"__float__": "Infinity"}`, its
    /// spelling for a non-finite float).
    pub fn to_hf_json(&self) -> Value {
        let float = |v: f32| {
            if v.is_finite() {
                serde_json::json!(v)
            } else {
                serde_json::json!({ "__float__": if v > 0.0 { "Infinity" } else { "-Infinity" } })
            }
        };
        let eos = match self.eos_token_ids.as_slice() {
            [one] => serde_json::json!(one),
            many => serde_json::json!(many),
        };
        serde_json::json!({
            "architectures": ["Mamba2ForCausalLM"],
            "model_type": "mamba2",
            "hidden_act": "silu",
            "hidden_size": self.d_model,
            "num_hidden_layers": self.n_layer,
            "vocab_size": self.vocab_size,
            "state_size": self.d_state,
            "conv_kernel": self.d_conv,
            "expand": self.expand,
            "head_dim": self.headdim,
            "num_heads": self.nheads,
            "n_groups": self.ngroups,
            "chunk_size": self.chunk_size,
            "time_step_limit": [float(self.dt_limit.0), float(self.dt_limit.1)],
            "use_bias": self.bias,
            "use_conv_bias": self.conv_bias,
            "layer_norm_epsilon": self.norm_eps,
            "residual_in_fp32": self.residual_in_fp32,
            "tie_word_embeddings": self.tie_embeddings,
            "eos_token_id": eos,
        })
    }

    fn from_original(obj: &Map<String, Value>) -> Result<Self> {
        let f = Fields::new(obj, "");
        f.only(&[
            "d_model",
            "d_intermediate",
            "n_layer",
            "vocab_size",
            "ssm_cfg",
            "attn_layer_idx",
            "attn_cfg",
            "rms_norm",
            "residual_in_fp32",
            "fused_add_norm",
            "pad_vocab_size_multiple",
            "tie_embeddings",
        ])?;
        if f.usize("d_intermediate", 0)? != 0 {
            bail!("d_intermediate > 0 (an MLP after each mixer) is not supported")
        }
        if !f.list_is_empty("attn_layer_idx")? {
            bail!("attn_layer_idx is not empty: hybrid attention layers are not supported")
        }
        if !f.bool("rms_norm", true)? {
            bail!("rms_norm = false (LayerNorm blocks) is not supported")
        }
        f.bool("fused_add_norm", true)?;
        let empty = Map::new();
        let ssm = match obj.get("ssm_cfg") {
            None | Some(Value::Null) => &empty,
            Some(Value::Object(m)) => m,
            Some(v) => bail!("ssm_cfg must be an object, got {v}"),
        };
        let s = Fields::new(ssm, "ssm_cfg.");
        s.only(&[
            "layer",
            "d_state",
            "d_conv",
            "conv_init",
            "expand",
            "headdim",
            "d_ssm",
            "ngroups",
            "A_init_range",
            "D_has_hdim",
            "rmsnorm",
            "norm_before_gate",
            "dt_min",
            "dt_max",
            "dt_init_floor",
            "dt_limit",
            "bias",
            "conv_bias",
            "chunk_size",
            "use_mem_eff_path",
            "activation",
            "learnable_init_states",
        ])?;
        match s.string("layer", Some("Mamba1"))?.as_str() {
            "Mamba2" => {}
            other => bail!("ssm_cfg.layer is {other:?}: only \"Mamba2\" models are supported"),
        }
        let act = s.string("activation", Some("swish"))?;
        if act != "silu" && act != "swish" {
            bail!("ssm_cfg.activation {act:?} is not supported (Mamba-2 uses silu)")
        }
        for (key, default, supported) in [
            ("D_has_hdim", false, false),
            ("rmsnorm", true, true),
            ("norm_before_gate", false, false),
            ("learnable_init_states", false, false),
        ] {
            if s.bool(key, default)? != supported {
                bail!("ssm_cfg.{key} = {} is not supported", !supported)
            }
        }
        let d_model = f.usize("d_model", 2560)?;
        let expand = s.usize("expand", 2)?;
        let headdim = s.usize("headdim", 64)?;
        for (key, v) in [
            ("d_model", d_model),
            ("ssm_cfg.expand", expand),
            ("ssm_cfg.headdim", headdim),
        ] {
            check_dim(key, v, Self::MAX_DIM)?;
        }
        let d_inner = checked_elements(
            "ssm_cfg.expand·d_model",
            &format!("{expand}·{d_model}"),
            expand.checked_mul(d_model),
        )?;
        if let Some(d_ssm) = s.opt_usize("d_ssm")? {
            if d_ssm != d_inner {
                bail!(
                    "ssm_cfg.d_ssm = {d_ssm} is not supported: only d_ssm = d_inner = {d_inner} \
                     (no extra gated-MLP channels)"
                )
            }
        }
        if d_inner % headdim != 0 {
            bail!(
                "ssm_cfg.headdim ({headdim}) must divide d_inner = expand·d_model \
                 ({expand}·{d_model} = {d_inner})"
            )
        }
        let pad = f.usize("pad_vocab_size_multiple", 8)?;
        let vocab = f.usize("vocab_size", 50277)?;
        for (key, v) in [("pad_vocab_size_multiple", pad), ("vocab_size", vocab)] {
            check_dim(key, v, Self::MAX_DIM)?;
        }
        let Some(vocab_size) = vocab.div_ceil(pad).checked_mul(pad) else {
            bail!("vocab_size {vocab} padded to a multiple of {pad} overflows")
        };
        Ok(Self {
            format: ConfigFormat::Original,
            d_model,
            n_layer: f.usize("n_layer", 64)?,
            vocab_size,
            d_state: s.usize("d_state", 128)?,
            d_conv: s.usize("d_conv", 4)?,
            expand,
            headdim,
            nheads: d_inner / headdim,
            ngroups: s.usize("ngroups", 1)?,
            chunk_size: s.usize("chunk_size", 256)?,
            dt_limit: s.limit("dt_limit")?,
            bias: s.bool("bias", false)?,
            conv_bias: s.bool("conv_bias", true)?,
            norm_eps: 1e-5,
            residual_in_fp32: f.bool("residual_in_fp32", true)?,
            tie_embeddings: f.bool("tie_embeddings", true)?,
            eos_token_ids: Vec::new(),
        })
    }

    /// `expand·d_model`, the SSM channels. Like every derived size it saturates instead of
    /// wrapping on a config that [`Config::validate`] refuses.
    pub fn d_inner(&self) -> usize {
        self.nheads.saturating_mul(self.headdim)
    }

    /// Channels of the causal conv: x | B | C.
    pub fn conv_dim(&self) -> usize {
        let gn = self.ngroups.saturating_mul(self.d_state);
        self.d_inner().saturating_add(gn.saturating_mul(2))
    }

    /// Output rows of in_proj: z | xBC | dt.
    pub fn in_proj_dim(&self) -> usize {
        self.d_inner()
            .saturating_add(self.conv_dim())
            .saturating_add(self.nheads)
    }

    /// Channels per group of the gated RMSNorm (mamba_ssm: `d_inner / ngroups`).
    pub fn norm_group_size(&self) -> usize {
        self.d_inner() / self.ngroups.max(1)
    }
}
