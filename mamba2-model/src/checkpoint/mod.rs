//! The weight files of a model directory, opened as a candle-nn `VarBuilder`.
//!
//! Looked up in this order: `model.safetensors.index.json` (sharded safetensors, the shards named by
//! its `weight_map`), `model.safetensors`, `pytorch_model.bin` (a `torch.save` state dict: a zip
//! archive of stored entries whose `data.pkl` is read by a pickle reader of our own). Safetensors
//! are memory-mapped. Every lookup checks the stored shape against the one the model asks for
//! before reading any data, and a missing, mis-shaped or non-float tensor is an error naming the
//! tensor, the file and both shapes. Tensors are converted to the requested dtype and moved to
//! the requested device as they are read. The checkpoint remembers which tensors were read, so
//! that tensors a model left unread (a config that does not match the weights, e.g. fewer layers
//! or no biases) can be reported: [`Checkpoint::unread`].
//!
//! Hostile files are errors, never panics, aborts or huge allocations:
//!
//! - every file read lies inside the model directory once symlinks are resolved (or, for a
//!   Hugging Face cache snapshot `…/snapshots/<rev>/`, in that repository's `blobs/`, where the
//!   cache keeps the files its snapshot links point to); shard names are plain file names; a link
//!   that leads elsewhere gets the same error whether or not its target exists;
//! - a tensor stored in two shards is an error naming both (the shards' headers are read, not
//!   only the index);
//! - the index, each safetensors header, a `.bin`'s zip central directory and its pickle are read
//!   only up to a limit ([`Checkpoint::MAX_INDEX_BYTES`], [`Checkpoint::MAX_HEADER_BYTES`],
//!   [`Checkpoint::MAX_ZIP_DIRECTORY_BYTES`], [`Checkpoint::MAX_PICKLE_BYTES`]), a safetensors
//!   header must fit its file, and its tensors' byte ranges must lie inside it;
//! - in a `.bin`, each tensor's shape, strides and offset must stay inside its storage, and the
//!   storage inside its archive entry, before any tensor data is allocated; the pickle reader
//!   shares memoized objects instead of copying them and bounds nesting
//!   ([`Checkpoint::MAX_PICKLE_DEPTH`]), so its memory stays proportional to the pickle's size.

mod archive;
mod confine;
mod pickle;
mod pth;
mod safetensors;
mod save;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use candle_core::safetensors::{Load, MmapedSafetensors};
use candle_core::{bail, DType, Device, Result, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder};

pub(crate) use confine::ModelDir;
use pth::Pth;
#[cfg(feature = "hub")]
pub(crate) use safetensors::shard_names;
use safetensors::{safetensors_names, shard_names_of};
pub(crate) use save::save_hf;

/// The name of a sharded checkpoint's index.
pub const SHARD_INDEX: &str = "model.safetensors.index.json";
/// The name of a single-file safetensors checkpoint.
pub const SAFETENSORS: &str = "model.safetensors";
/// The name of a PyTorch pickle checkpoint.
pub const PYTORCH_BIN: &str = "pytorch_model.bin";

/// Where the tensors of a checkpoint are read from.
enum Store {
    Safetensors(MmapedSafetensors),
    Pickle(Pth),
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
    /// The largest `model.safetensors.index.json` read: 16 MiB (a 400B-parameter model's index
    /// is well under 1 MiB).
    pub const MAX_INDEX_BYTES: u64 = 16 << 20;
    /// The largest safetensors header (the JSON after the 8-byte length): 16 MiB, about 100k
    /// tensors per file.
    pub const MAX_HEADER_BYTES: u64 = 16 << 20;
    /// The largest `data.pkl` of a `.bin`: 16 MiB, about 100k tensors.
    pub const MAX_PICKLE_BYTES: u64 = 16 << 20;
    /// The largest central directory of a `.bin`'s zip archive: 16 MiB, about 300k entries.
    pub const MAX_ZIP_DIRECTORY_BYTES: u64 = 16 << 20;
    /// The deepest nesting of pickle objects: 64 (a torch state dict nests about 8 deep; the
    /// bound keeps dropping a nested object from overflowing the thread's stack).
    pub const MAX_PICKLE_DEPTH: usize = 64;

    /// Opens the checkpoint of `dir` (see the module doc for the files looked up and the checks).
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        if !dir.is_dir() {
            bail!("model directory {} does not exist", dir.display())
        }
        let root = ModelDir::new(dir)?;
        let present = |name: &str| dir.join(name).symlink_metadata().is_ok();
        if present(SHARD_INDEX) {
            let index = root.resolve(SHARD_INDEX, "index", "")?;
            let index_shown = dir.join(SHARD_INDEX).display().to_string();
            let listed = format!(" listed in {index_shown}");
            let mut shards = Vec::new();
            for name in shard_names_of(&index, &index_shown)? {
                let shard = root.resolve(&name, "shard", &listed)?;
                shards.push((name, shard));
            }
            let mut owner: BTreeMap<String, &str> = BTreeMap::new();
            for (name, path) in &shards {
                let shown = dir.join(name).display().to_string();
                for tensor in safetensors_names(path, &shown)? {
                    if let Some(first) = owner.insert(tensor.clone(), name) {
                        bail!(
                            "tensor {tensor} is stored twice: in shard {first} and in shard \
                             {name} of {index_shown}"
                        )
                    }
                }
            }
            let paths: Vec<&PathBuf> = shards.iter().map(|(_, p)| p).collect();
            // SAFETY: the files are mapped read-only; like every mmap user we rely on nobody
            // truncating them while the model is alive.
            let st = unsafe { MmapedSafetensors::multi(&paths)? };
            let files = format!("{index_shown} ({} shards)", shards.len());
            Ok(Self::new(Store::Safetensors(st), files))
        } else if present(SAFETENSORS) {
            let single = root.resolve(SAFETENSORS, "weights", "")?;
            let shown = dir.join(SAFETENSORS).display().to_string();
            safetensors_names(&single, &shown)?;
            // SAFETY: as above.
            let st = unsafe { MmapedSafetensors::new(&single)? };
            Ok(Self::new(Store::Safetensors(st), shown))
        } else if present(PYTORCH_BIN) {
            let bin = root.resolve(PYTORCH_BIN, "weights", "")?;
            let shown = dir.join(PYTORCH_BIN).display().to_string();
            let pth = Pth::open(&bin).map_err(|e| e.context(format!("cannot read {shown}")))?;
            Ok(Self::new(Store::Pickle(pth), shown))
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
            Store::Pickle(pth) => pth.tensors.keys().cloned().collect(),
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

    /// The stored shape and dtype of `name`, or `None` when the checkpoint has no such tensor.
    fn info(&self, name: &str) -> Option<(Shape, Result<DType>)> {
        match &self.0.store {
            Store::Safetensors(st) => st
                .get(name)
                .ok()
                .map(|v| (Shape::from(v.shape()), DType::try_from(v.dtype()))),
            Store::Pickle(pth) => pth
                .tensors
                .get(name)
                .map(|t| (Shape::from(t.dims.clone()), Ok(t.dtype))),
        }
    }

    /// Reads `name` as stored (its dtype, on `dev`).
    fn read(&self, name: &str, dev: &Device) -> Result<Tensor> {
        let t = match &self.0.store {
            Store::Safetensors(st) => st.get(name)?.load(dev)?,
            Store::Pickle(pth) => pth.read(name)?.to_device(dev)?,
        };
        match self.0.read.lock() {
            Ok(mut read) => read.insert(name.to_string()),
            Err(_) => bail!("checkpoint: read-set poisoned"),
        };
        Ok(t)
    }

    fn load(&self, name: &str, want: Option<&Shape>, dtype: DType, dev: &Device) -> Result<Tensor> {
        let source = &self.0.source;
        let Some((shape, stored)) = self.info(name) else {
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
        match stored {
            Ok(DType::F16 | DType::BF16 | DType::F32 | DType::F64) => {}
            Ok(other) => bail!(
                "tensor {name} in {source} is stored as {other:?}, not as a float (f16, bf16, f32 \
                 or f64)"
            ),
            Err(e) => bail!("tensor {name} in {source}: {e}"),
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
        self.info(name).is_some()
    }
}
