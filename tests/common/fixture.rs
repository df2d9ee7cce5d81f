//! The HF reference fixtures of `tests/fixtures/` (see its README): one case directory each.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, IndexOp, Result, Tensor};
use mamba2::model::Model;

use super::rel_err;

/// The directory holding every fixture case.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// The names of all case directories, from `index.json`.
pub fn case_names() -> Vec<String> {
    let text =
        std::fs::read_to_string(root().join("index.json")).expect("tests/fixtures/index.json");
    let index: serde_json::Value = serde_json::from_str(&text).expect("index.json is JSON");
    index
        .as_array()
        .expect("index.json is a list")
        .iter()
        .map(|c| c["dir"].as_str().expect("dir").to_string())
        .collect()
}

/// One case: its directory, `case.json` and the tensors of `reference.safetensors`.
pub struct Case {
    pub name: String,
    pub dir: PathBuf,
    pub meta: serde_json::Value,
    pub tensors: HashMap<String, Tensor>,
}

impl Case {
    pub fn load(name: &str) -> Result<Self> {
        let dir = root().join(name);
        let text = std::fs::read_to_string(dir.join("case.json"))?;
        let meta = serde_json::from_str(&text).map_err(candle_core::Error::wrap)?;
        let tensors =
            candle_core::safetensors::load(dir.join("reference.safetensors"), &Device::Cpu)?;
        Ok(Self {
            name: name.to_string(),
            dir,
            meta,
            tensors,
        })
    }

    pub fn get(&self, key: &str) -> &Tensor {
        self.tensors
            .get(key)
            .unwrap_or_else(|| panic!("{}: reference has no {key}", self.name))
    }

    /// `input_ids [B, L]` as u32.
    pub fn input_ids(&self) -> Result<Tensor> {
        self.get("input_ids").to_dtype(DType::U32)
    }

    pub fn prefix_len(&self) -> usize {
        self.meta["prefix_len"].as_u64().expect("prefix_len") as usize
    }

    pub fn reference(&self) -> &str {
        self.meta["reference"].as_str().expect("reference")
    }

    pub fn n_layer(&self) -> usize {
        self.meta["params"]["n_layer"].as_u64().expect("n_layer") as usize
    }
}

/// Max rel errs of one case: prefill logits, decode logits, SSM states, conv states.
pub fn run_case(case: &Case, model: &Model) -> Result<[f64; 4]> {
    let ids = case.input_ids()?.to_device(model.device())?;
    let (batch, len) = ids.dims2()?;
    let l0 = case.prefix_len();

    let mut cache = model.new_cache(batch)?;
    let logits = model.forward(&ids, &mut cache)?;
    let prefill = rel_err(&logits, case.get("logits_prefill"))?;
    assert_eq!(cache.tokens(), len);
    let (mut ssm, mut conv) = (0f64, 0f64);
    for (i, layer) in cache.layers().iter().enumerate() {
        ssm = ssm.max(rel_err(&layer.ssm, case.get(&format!("ssm_state.{i}")))?);
        conv = conv.max(rel_err(&layer.conv, case.get(&format!("conv_state.{i}")))?);
    }

    let mut cache = model.new_cache(batch)?;
    let last = model.prefill(&ids.i((.., ..l0))?, &mut cache)?;
    let want_last = case.get("logits_prefill").i((.., l0 - 1))?;
    let prefix = rel_err(&last, &want_last)?;
    let mut steps = Vec::new();
    for t in l0..len {
        steps.push(model.step(&ids.i((.., t))?.contiguous()?, &mut cache)?);
    }
    let decode = rel_err(&Tensor::stack(&steps, 1)?, case.get("logits_decode"))?;
    Ok([prefill.max(prefix), decode, ssm, conv])
}
