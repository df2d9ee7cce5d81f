//! The weight files of a model directory, opened as a candle-nn `VarBuilder`.
//!
//! Looked up in this order: `model.safetensors.index.json` (sharded safetensors, the shards named by
//! its `weight_map`), `model.safetensors`, `pytorch_model.bin` (a `torch.save` state dict, read
//! with `candle_core::pickle`). Safetensors are memory-mapped. Every lookup checks the stored shape
//! against the one the model asks for before reading any data, and a missing or mis-shaped tensor
//! is an error naming the tensor, the file and both shapes. Tensors are converted to the
//! requested dtype and moved to the requested device as they are read. The checkpoint remembers
//! which tensors were read, so that tensors a model left unread (a config that does not match the
//! weights, e.g. fewer layers or no biases) can be reported: [`Checkpoint::unread`].

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use candle_core::pickle::PthTensors;
use candle_core::safetensors::{Load, MmapedSafetensors};
use candle_core::{bail, DType, Device, Result, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder};

/// The name of a sharded checkpoint's index.
pub const SHARD_INDEX: &str = "model.safetensors.index.json";
/// The name of a single-file safetensors checkpoint.
pub const SAFETENSORS: &str = "model.safetensors";
/// The name of a PyTorch pickle checkpoint.
pub const PYTORCH_BIN: &str = "pytorch_model.bin";

/// Where the tensors of a checkpoint are read from.
enum Store {
    Safetensors(MmapedSafetensors),
    Pickle(PthTensors),
}

/// A checkpoint on disk: the tensor store, the file that errors quote, and the names read so far.
/// Clones share all three.
///
/// ```
/// use candle_core::{DType, Device};
/// use mamba2_model::Checkpoint;
///
/// // The shipped model's four shards, found through their index.
/// let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../weights");
/// let checkpoint = Checkpoint::open(dir)?;
/// assert!(checkpoint.source().ends_with("model.safetensors.index.json (4 shards)"));
/// let vb = checkpoint.var_builder(DType::F16, &Device::Cpu);
/// // A wrong shape is refused before any data is read; a right one is read and converted.
/// assert!(vb.get((8192, 385), "backbone.embeddings.weight").is_err());
/// let embedding = vb.get((8192, 384), "backbone.embeddings.weight")?;
/// assert_eq!(embedding.dtype(), DType::F16);
/// let unread = checkpoint.unread()?;
/// assert_eq!(unread.len(), checkpoint.names().len() - 1);
/// assert!(!unread.iter().any(|n| n == "backbone.embeddings.weight"));
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Clone)]
pub struct Checkpoint(Arc<Inner>);

struct Inner {
    store: Store,
    source: String,
    read: Mutex<BTreeSet<String>>,
}

impl Checkpoint {
    /// Opens the checkpoint of `dir` (see the module doc for the files looked up).
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        if !dir.is_dir() {
            bail!("model directory {} does not exist", dir.display())
        }
        let index = dir.join(SHARD_INDEX);
        let single = dir.join(SAFETENSORS);
        let bin = dir.join(PYTORCH_BIN);
        if index.is_file() {
            let shards = shard_files(&index)?;
            // SAFETY: the files are mapped read-only; like every mmap user we rely on nobody
            // truncating them while the model is alive.
            let st = unsafe { MmapedSafetensors::multi(&shards)? };
            let files = format!("{} ({} shards)", index.display(), shards.len());
            Ok(Self::new(Store::Safetensors(st), files))
        } else if single.is_file() {
            // SAFETY: as above.
            let st = unsafe { MmapedSafetensors::new(&single)? };
            Ok(Self::new(
                Store::Safetensors(st),
                single.display().to_string(),
            ))
        } else if bin.is_file() {
            let pth = PthTensors::new(&bin, None)
                .map_err(|e| e.context(format!("cannot read {}", bin.display())))?;
            Ok(Self::new(Store::Pickle(pth), bin.display().to_string()))
        } else {
            bail!(
                "no weights in {}: expected {SHARD_INDEX}, {SAFETENSORS} or {PYTORCH_BIN}",
                dir.display()
            )
        }
    }

    fn new(store: Store, source: String) -> Self {
        Self(Arc::new(Inner {
            store,
            source,
            read: Mutex::new(BTreeSet::new()),
        }))
    }

    /// A `VarBuilder` over this checkpoint that yields tensors of `dtype` on `device`.
    pub fn var_builder(&self, dtype: DType, device: &Device) -> VarBuilder<'static> {
        VarBuilder::from_backend(Box::new(self.clone()), dtype, device.clone())
    }

    /// The file the tensors come from (for a sharded checkpoint, its index).
    pub fn source(&self) -> &str {
        &self.0.source
    }

    /// The names of every stored tensor, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = match &self.0.store {
            Store::Safetensors(st) => st.tensors().into_iter().map(|(n, _)| n).collect(),
            Store::Pickle(pth) => pth.tensor_infos().keys().cloned().collect(),
        };
        names.sort_unstable();
        names
    }

    /// The stored tensors that no one has read yet, sorted.
    pub fn unread(&self) -> Result<Vec<String>> {
        let Ok(read) = self.0.read.lock() else {
            bail!("checkpoint: read-set poisoned")
        };
        Ok(self
            .names()
            .into_iter()
            .filter(|n| !read.contains(n))
            .collect())
    }

    /// The stored shape of `name`, or `None` when the checkpoint has no such tensor.
    fn shape_of(&self, name: &str) -> Option<Shape> {
        match &self.0.store {
            Store::Safetensors(st) => st.get(name).ok().map(|v| Shape::from(v.shape())),
            Store::Pickle(pth) => pth
                .tensor_infos()
                .get(name)
                .map(|i| i.layout.shape().clone()),
        }
    }

    /// Reads `name` as stored (its dtype, on `dev`).
    fn read(&self, name: &str, dev: &Device) -> Result<Tensor> {
        let t = match &self.0.store {
            Store::Safetensors(st) => st.get(name)?.load(dev)?,
            Store::Pickle(pth) => match pth.get(name)? {
                Some(t) => t.to_device(dev)?,
                None => bail!("missing tensor {name} in {}", self.0.source),
            },
        };
        match self.0.read.lock() {
            Ok(mut read) => read.insert(name.to_string()),
            Err(_) => bail!("checkpoint: read-set poisoned"),
        };
        Ok(t)
    }

    fn load(&self, name: &str, want: Option<&Shape>, dtype: DType, dev: &Device) -> Result<Tensor> {
        let source = &self.0.source;
        let Some(shape) = self.shape_of(name) else {
            bail!("missing tensor {name} in {source}")
        };
        if let Some(want) = want {
            if &shape != want {
                bail!(
                    "tensor {name} in {source} has shape {:?}, the config expects {:?}",
                    shape.dims(),
                    want.dims()
                )
            }
        }
        self.read(name, dev)
            .and_then(|t| t.to_dtype(dtype))
            .map_err(|e| e.context(format!("cannot read tensor {name} from {source}")))
    }
}

impl SimpleBackend for Checkpoint {
    fn get(&self, s: Shape, name: &str, _: Init, dtype: DType, dev: &Device) -> Result<Tensor> {
        self.load(name, Some(&s), dtype, dev)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> Result<Tensor> {
        self.load(name, None, dtype, dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.shape_of(name).is_some()
    }
}

/// The shard file names of a `model.safetensors.index.json`: the distinct values of its
/// `weight_map`, sorted.
pub(crate) fn shard_names(index: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(index)
        .map_err(|e| candle_core::Error::msg(format!("cannot read {}: {e}", index.display())))?;
    let json: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| candle_core::Error::msg(format!("{}: invalid JSON: {e}", index.display())))?;
    let Some(map) = json.get("weight_map").and_then(|m| m.as_object()) else {
        bail!("{}: no \"weight_map\" object", index.display())
    };
    let mut names = BTreeSet::new();
    for (tensor, file) in map {
        match file.as_str() {
            Some(f) => names.insert(f.to_string()),
            None => bail!(
                "{}: weight_map entry for {tensor} is not a file name: {file}",
                index.display()
            ),
        };
    }
    if names.is_empty() {
        bail!("{}: weight_map is empty", index.display())
    }
    Ok(names.into_iter().collect())
}

/// The shard files of a `model.safetensors.index.json`, each checked to exist next to it.
fn shard_files(index: &Path) -> Result<Vec<PathBuf>> {
    let dir = index.parent().unwrap_or(Path::new("."));
    let files: Vec<PathBuf> = shard_names(index)?
        .into_iter()
        .map(|n| dir.join(n))
        .collect();
    if let Some(missing) = files.iter().find(|f| !f.is_file()) {
        bail!(
            "shard {} listed in {} does not exist",
            missing.display(),
            index.display()
        )
    }
    Ok(files)
}
