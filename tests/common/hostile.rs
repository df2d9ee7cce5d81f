//! Shared helpers of the hostile loading tests: fixtures copied into fresh temp directories,
//! a sharded copy of a small model, configs with one key replaced, and error matching.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use candle_core::{DType, Device, Result, Tensor};
use mamba2::model::{Config, Model, SHARD_INDEX};

/// The fixture every directory here starts from: 2 layers, d_model 32, 4 heads of 16, vocab 64.
pub const G1: &str = "g1_p16_n16_c8_k4_fp32res_tied";
/// A state-spaces `pytorch_model.bin` fixture (a `torch.save` zip archive, tied weights).
pub const BIN: &str = "mamba2-130m-original-bin";

/// The directory of the fixture case `name`.
pub fn fixture(name: &str) -> PathBuf {
    super::fixture::root().join(name)
}

/// A fresh directory under the system temp dir, removed on drop.
pub struct Tmp(pub PathBuf);

impl Tmp {
    pub fn new(name: &str) -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("mamba2-hostile-{}-{name}-{n}", std::process::id()));
        if dir.exists() {
            std::fs::remove_dir_all(&dir).expect("clear temp dir");
        }
        std::fs::create_dir_all(&dir).expect("create temp dir");
        Self(dir)
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Tmp {
    fn drop(&mut self) {
        // Best effort: a directory left behind by a failed removal is only litter.
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The message of `r`'s error; a panic when `r` is Ok.
pub fn err<T>(r: Result<T>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

/// The message proper: candle appends a backtrace when `RUST_BACKTRACE` is set.
pub fn first_line(msg: &str) -> &str {
    msg.lines().next().unwrap_or("")
}

pub fn assert_contains(msg: &str, needle: &str) {
    assert!(
        msg.contains(needle),
        "error {msg:?} does not contain {needle:?}"
    );
}

pub fn load(dir: &Path) -> Result<Model> {
    Model::load(dir, DType::F32, &Device::Cpu)
}

/// The names of the three shards [`sharded`] writes.
pub fn shard_file(i: usize) -> String {
    format!("model-{:05}-of-00003.safetensors", i + 1)
}

/// G1's config and weights as three shards with their index, written into `tmp`.
pub fn sharded(tmp: &Tmp) -> Result<()> {
    std::fs::copy(fixture(G1).join("config.json"), tmp.path("config.json"))?;
    let tensors =
        candle_core::safetensors::load(fixture(G1).join("model.safetensors"), &Device::Cpu)?;
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    let mut weight_map = serde_json::Map::new();
    for (i, chunk) in names.chunks(names.len().div_ceil(3)).enumerate() {
        let file = shard_file(i);
        let shard: HashMap<&str, Tensor> = chunk
            .iter()
            .map(|n| (n.as_str(), tensors[*n].clone()))
            .collect();
        candle_core::safetensors::save(&shard, tmp.path(&file))?;
        for n in chunk {
            weight_map.insert(n.to_string(), file.clone().into());
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(tmp.path(SHARD_INDEX), index.to_string())?;
    Ok(())
}

/// G1's config with `key` set to the JSON text `value` (which may hold Python's bare `NaN` and
/// `Infinity`).
pub fn g1_config(key: &str, value: &str) -> String {
    let text = std::fs::read_to_string(fixture(G1).join("config.json")).expect("fixture config");
    let mut obj: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&text).expect("fixture config is JSON");
    obj.insert(key.to_string(), "@@VALUE@@".into());
    serde_json::to_string(&obj)
        .expect("serialize")
        .replace("\"@@VALUE@@\"", value)
}

pub fn config_err(json: &str) -> String {
    err(Config::from_json(json))
}

/// Writes a safetensors file of `header` JSON and `data` bytes, the length field set to `n`.
pub fn raw_safetensors(path: &Path, n: u64, header: &[u8], data: &[u8]) -> Result<()> {
    let mut bytes = n.to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    bytes.extend_from_slice(data);
    std::fs::write(path, bytes)?;
    Ok(())
}
