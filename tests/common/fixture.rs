//! The HF reference fixtures of `tests/fixtures/` (see its README): one case directory each.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Result, Tensor};

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
