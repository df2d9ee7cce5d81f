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

use std::path::Path;

use candle_core::{bail, Result};
use serde_json::{Map, Value};

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
        let text = std::fs::read_to_string(path).map_err(|e| {
            candle_core::Error::msg(format!("cannot read config {}: {e}", path.display()))
        })?;
        Self::from_json(&text)
            .map_err(|e| candle_core::Error::msg(format!("config {}: {e}", path.display())))
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
        let d_inner = expand * d_model;
        if let Some(d_ssm) = s.opt_usize("d_ssm")? {
            if d_ssm != d_inner {
                bail!(
                    "ssm_cfg.d_ssm = {d_ssm} is not supported: only d_ssm = d_inner = {d_inner} \
                     (no extra gated-MLP channels)"
                )
            }
        }
        if headdim == 0 || d_inner % headdim != 0 {
            bail!(
                "ssm_cfg.headdim ({headdim}) must divide d_inner = expand·d_model \
                 ({expand}·{d_model} = {d_inner})"
            )
        }
        let pad = f.usize("pad_vocab_size_multiple", 8)?;
        if pad == 0 {
            bail!("pad_vocab_size_multiple must be >= 1")
        }
        Ok(Self {
            format: ConfigFormat::Original,
            d_model,
            n_layer: f.usize("n_layer", 64)?,
            vocab_size: f.usize("vocab_size", 50277)?.div_ceil(pad) * pad,
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

    /// Checks sizes and values that both formats share.
    pub fn validate(&self) -> Result<()> {
        for (name, v) in [
            ("d_model / hidden_size", self.d_model),
            ("n_layer / num_hidden_layers", self.n_layer),
            ("vocab_size", self.vocab_size),
            ("d_state / state_size", self.d_state),
            ("d_conv / conv_kernel", self.d_conv),
            ("expand", self.expand),
            ("headdim / head_dim", self.headdim),
            ("nheads / num_heads", self.nheads),
            ("ngroups / n_groups", self.ngroups),
            ("chunk_size", self.chunk_size),
        ] {
            if v == 0 {
                bail!("{name} must be >= 1, got 0")
            }
        }
        if self.nheads * self.headdim != self.expand * self.d_model {
            bail!(
                "num_heads·head_dim ({}·{} = {}) must equal expand·hidden_size ({}·{} = {})",
                self.nheads,
                self.headdim,
                self.nheads * self.headdim,
                self.expand,
                self.d_model,
                self.expand * self.d_model
            )
        }
        if self.nheads % self.ngroups != 0 {
            bail!(
                "n_groups ({}) must divide num_heads ({})",
                self.ngroups,
                self.nheads
            )
        }
        let (lo, hi) = self.dt_limit;
        if lo.is_nan() || hi.is_nan() || lo < 0.0 || lo > hi {
            bail!(
                "time_step_limit / dt_limit must be (lo, hi) with 0 <= lo <= hi, got ({lo}, {hi})"
            )
        }
        if !self.norm_eps.is_finite() || self.norm_eps <= 0.0 {
            bail!(
                "layer_norm_epsilon must be finite and > 0, got {}",
                self.norm_eps
            )
        }
        Ok(())
    }

    /// `expand·d_model`, the SSM channels.
    pub fn d_inner(&self) -> usize {
        self.nheads * self.headdim
    }

    /// Channels of the causal conv: x | B | C.
    pub fn conv_dim(&self) -> usize {
        self.d_inner() + 2 * self.ngroups * self.d_state
    }

    /// Output rows of in_proj: z | xBC | dt.
    pub fn in_proj_dim(&self) -> usize {
        self.d_inner() + self.conv_dim() + self.nheads
    }

    /// Channels per group of the gated RMSNorm (mamba_ssm: `d_inner / ngroups`).
    pub fn norm_group_size(&self) -> usize {
        self.d_inner() / self.ngroups
    }
}

/// Rewrites the bare `Infinity`, `-Infinity` and `NaN` tokens that Python's json module writes
/// (outside string literals) as transformers 5's `{"__float__": "..."}` objects, so that the text
/// becomes JSON.
fn quote_bare_floats(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    let mut in_string = false;
    while let Some(c) = rest.chars().next() {
        if in_string {
            if c == '\\' {
                let skip: usize = rest.chars().take(2).map(char::len_utf8).sum();
                out.push_str(&rest[..skip]);
                rest = &rest[skip..];
                continue;
            }
            in_string = c != '"';
        } else if c == '"' {
            in_string = true;
        } else if let Some(word) = ["-Infinity", "Infinity", "NaN"]
            .into_iter()
            .find(|w| rest.starts_with(w))
        {
            out.push_str(&format!("{{\"__float__\": \"{word}\"}}"));
            rest = &rest[word.len()..];
            continue;
        }
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    out
}

/// Typed access to the keys of one JSON object, with errors that name the key.
struct Fields<'a> {
    obj: &'a Map<String, Value>,
    prefix: &'a str,
}

impl<'a> Fields<'a> {
    fn new(obj: &'a Map<String, Value>, prefix: &'a str) -> Self {
        Self { obj, prefix }
    }

    /// The value of `key`, `None` when absent or null.
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    fn bad<T>(&self, key: &str, want: &str, v: &Value) -> Result<T> {
        bail!("{}{key} must be {want}, got {v}", self.prefix)
    }

    /// Errors on the first key outside `known`.
    fn only(&self, known: &[&str]) -> Result<()> {
        match self.obj.keys().find(|k| !known.contains(&k.as_str())) {
            Some(k) => bail!(
                "unknown key {}{k} (known keys: {})",
                self.prefix,
                known.join(", ")
            ),
            None => Ok(()),
        }
    }

    fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => match v.as_u64().and_then(|n| usize::try_from(n).ok()) {
                Some(n) => Ok(Some(n)),
                None => self.bad(key, "a non-negative integer", v),
            },
        }
    }

    fn usize(&self, key: &str, default: usize) -> Result<usize> {
        Ok(self.opt_usize(key)?.unwrap_or(default))
    }

    fn bool(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => self.bad(key, "true or false", v),
        }
    }

    fn float(&self, key: &str, default: f64) -> Result<f64> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => match special_float(v) {
                Some(x) => Ok(x),
                None => self.bad(key, "a number", v),
            },
        }
    }

    fn string(&self, key: &str, default: Option<&str>) -> Result<String> {
        match (self.get(key), default) {
            (Some(Value::String(s)), _) => Ok(s.clone()),
            (None, Some(d)) => Ok(d.to_string()),
            (None, None) => bail!("{}{key} is missing", self.prefix),
            (Some(v), _) => self.bad(key, "a string", v),
        }
    }

    fn list_is_empty(&self, key: &str) -> Result<bool> {
        match self.get(key) {
            None => Ok(true),
            Some(Value::Array(a)) => Ok(a.is_empty()),
            Some(v) => self.bad(key, "a list", v),
        }
    }

    /// A `[lo, hi]` pair of numbers (either bound possibly infinite); `(0, ∞)` when absent.
    fn limit(&self, key: &str) -> Result<(f32, f32)> {
        let Some(v) = self.get(key) else {
            return Ok((0.0, f32::INFINITY));
        };
        match v
            .as_array()
            .map(|a| a.iter().map(special_float).collect::<Vec<_>>())
        {
            Some(pair) => match pair.as_slice() {
                [Some(lo), Some(hi)] => Ok((*lo as f32, *hi as f32)),
                _ => self.bad(key, "a pair [lo, hi] of numbers", v),
            },
            None => self.bad(key, "a pair [lo, hi] of numbers", v),
        }
    }

    /// A token id or a list of token ids.
    fn token_ids(&self, key: &str, default: &[u32]) -> Result<Vec<u32>> {
        let id = |v: &Value| v.as_u64().and_then(|n| u32::try_from(n).ok());
        match self.get(key) {
            None if self.obj.contains_key(key) => Ok(Vec::new()),
            None => Ok(default.to_vec()),
            Some(Value::Array(a)) => match a.iter().map(id).collect::<Option<Vec<_>>>() {
                Some(ids) => Ok(ids),
                None => self.bad(
                    key,
                    "a token id or a list of token ids",
                    &Value::Array(a.clone()),
                ),
            },
            Some(v) => match id(v) {
                Some(i) => Ok(vec![i]),
                None => self.bad(key, "a token id or a list of token ids", v),
            },
        }
    }
}

/// A JSON number, or transformers' `{"__float__": "Infinity" | "-Infinity" | "NaN"}`.
fn special_float(v: &Value) -> Option<f64> {
    match v {
        Value::Number(n) => n.as_f64(),
        Value::Object(m) if m.len() == 1 => match m.get("__float__")?.as_str()? {
            "Infinity" => Some(f64::INFINITY),
            "-Infinity" => Some(f64::NEG_INFINITY),
            "NaN" => Some(f64::NAN),
            _ => None,
        },
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// An HF config of 2 heads of 64 on d_model 64, with `extra` keys (each preceded by a comma).
    fn hf(extra: &str) -> Result<Config> {
        Config::from_json(&format!(
            r#"{{"hidden_size": 64, "num_heads": 2, "n_groups": 1{extra}}}"#
        ))
    }

    #[test]
    fn derived_sizes_follow_the_projection_layout() -> Result<()> {
        // (config, d_inner, conv_dim, in_proj_dim, norm_group_size): the shipped model's sizes,
        // then transformers' defaults (8 groups of 128 states).
        let shipped = r#"{"hidden_size": 384, "num_heads": 12, "head_dim": 64, "state_size": 64,
                          "n_groups": 1}"#;
        for (text, d_inner, conv_dim, in_proj, group) in [
            (shipped, 768, 896, 1676, 768),
            (r#"{"hidden_size": 4096}"#, 8192, 10240, 18560, 1024),
        ] {
            let c = Config::from_json(text)?;
            assert_eq!((c.d_inner(), c.conv_dim()), (d_inner, conv_dim));
            assert_eq!((c.in_proj_dim(), c.norm_group_size()), (in_proj, group));
            assert_eq!(c.d_inner(), c.expand * c.d_model);
            assert_eq!(c.norm_group_size() * c.ngroups, c.d_inner());
            // z | x B C | dt.
            let gn = c.ngroups * c.d_state;
            assert_eq!(c.in_proj_dim(), 2 * c.d_inner() + 2 * gn + c.nheads);
        }
        Ok(())
    }

    #[test]
    fn original_format_derives_nheads_and_pads_the_vocabulary() -> Result<()> {
        let original = |pad: usize| {
            Config::from_json(&format!(
                r#"{{"d_model": 96, "vocab_size": 1000, "pad_vocab_size_multiple": {pad},
                     "ssm_cfg": {{"layer": "Mamba2", "headdim": 32, "ngroups": 3}}}}"#
            ))
        };
        let c = original(16)?;
        // nheads = expand·d_model / headdim = 2·96 / 32.
        assert_eq!((c.nheads, c.ngroups, c.norm_group_size()), (6, 3, 64));
        assert_eq!(c.vocab_size, 1008);
        assert_eq!(original(1)?.vocab_size, 1000);
        assert_eq!(original(8)?.vocab_size, 1000);
        let err = original(0).map(|_| ()).unwrap_err().to_string();
        assert!(err.contains("pad_vocab_size_multiple must be >= 1"));
        Ok(())
    }

    #[test]
    fn bare_non_finite_floats_are_quoted_outside_strings_only() {
        let text = r#"{"l": [-Infinity, Infinity], "n": NaN, "s": "Infinity \" NaN"}"#;
        let want = concat!(
            r#"{"l": [{"__float__": "-Infinity"}, {"__float__": "Infinity"}], "#,
            r#""n": {"__float__": "NaN"}, "s": "Infinity \" NaN"}"#
        );
        assert_eq!(quote_bare_floats(text), want);
        assert_eq!(quote_bare_floats(want), want);
    }

    #[test]
    fn special_floats_are_numbers_or_one_tagged_key() {
        assert_eq!(special_float(&json!(1.5)), Some(1.5));
        assert_eq!(special_float(&json!(3)), Some(3.0));
        let tagged = |s: &str| special_float(&json!({ "__float__": s }));
        assert_eq!(tagged("Infinity"), Some(f64::INFINITY));
        assert_eq!(tagged("-Infinity"), Some(f64::NEG_INFINITY));
        assert!(tagged("NaN").is_some_and(f64::is_nan));
        assert_eq!(tagged("inf"), None);
        assert_eq!(special_float(&json!({"__float__": "NaN", "x": 1})), None);
        assert_eq!(special_float(&json!("1.0")), None);
    }

    #[test]
    fn eos_token_id_is_one_id_a_list_or_null() -> Result<()> {
        assert_eq!(hf("")?.eos_token_ids, vec![2]);
        assert_eq!(hf(r#", "eos_token_id": 7"#)?.eos_token_ids, vec![7]);
        assert_eq!(hf(r#", "eos_token_id": [0, 9]"#)?.eos_token_ids, vec![0, 9]);
        assert!(hf(r#", "eos_token_id": null"#)?.eos_token_ids.is_empty());
        let err = hf(r#", "eos_token_id": -1"#).map(|_| ()).unwrap_err();
        assert!(err.to_string().contains("eos_token_id must be a token id"));
        Ok(())
    }

    #[test]
    fn validate_names_zero_sizes_and_bad_values() -> Result<()> {
        let c = hf("")?;
        let refused = |edit: fn(&mut Config), needle: &str| {
            let mut bad = c.clone();
            edit(&mut bad);
            let err = bad.validate().map(|_| ()).unwrap_err().to_string();
            assert!(err.contains(needle), "{err:?} lacks {needle:?}");
        };
        refused(|c| c.d_state = 0, "d_state / state_size must be >= 1");
        refused(|c| c.ngroups = 0, "ngroups / n_groups must be >= 1");
        refused(
            |c| c.norm_eps = 0.0,
            "layer_norm_epsilon must be finite and > 0",
        );
        refused(|c| c.dt_limit.0 = f32::NAN, "dt_limit must be (lo, hi)");
        c.validate()
    }
}
