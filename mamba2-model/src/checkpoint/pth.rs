//! `pytorch_model.bin`, a `torch.save` state dict: the tensors that `data.pkl` describes, each
//! checked against its storage entry of the archive before any tensor data is read.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use candle_core::{bail, DType, Device, Result, Tensor};

use super::archive::{zip_entries, ZipEntry};
use super::pickle::{unpickle, Node, Value};
use super::Checkpoint;

/// The tensors of a `torch.save` zip archive: where each one's bytes are, read on demand.
pub(super) struct Pth {
    file: PathBuf,
    pub(super) tensors: HashMap<String, PthTensor>,
}

/// One contiguous tensor of a `.bin`: its bytes start at `start` in the file.
pub(super) struct PthTensor {
    pub(super) dtype: DType,
    pub(super) dims: Vec<usize>,
    /// Stored column-major (Fortran order): read with the dims reversed, then transposed.
    fortran: bool,
    start: u64,
}

impl Pth {
    /// Lists the archive at `path` and locates every tensor of its state dict, checked against
    /// its storage.
    pub(super) fn open(path: &Path) -> Result<Self> {
        let mut file = File::open(path)?;
        let entries = zip_entries(&file)?;
        let mut pickles = entries
            .keys()
            .filter(|n| *n == "data.pkl" || n.ends_with("/data.pkl"));
        let (Some(pickle), None) = (pickles.next(), pickles.next()) else {
            bail!("not a torch.save archive: expected exactly one data.pkl entry")
        };
        let prefix = &pickle[..pickle.len() - "data.pkl".len()];
        if let Some(order) = entries.get(&format!("{prefix}byteorder")) {
            let order = order.read(&mut file, 16, "byteorder")?;
            if order != b"little" {
                bail!(
                    "tensors stored {:?}-endian; only little-endian ones are read",
                    String::from_utf8_lossy(&order)
                )
            }
        }
        let pickle = entries[pickle].read(&mut file, Checkpoint::MAX_PICKLE_BYTES, "data.pkl")?;
        let root = unpickle(&pickle)?;
        let mut tensors = HashMap::new();
        let Value::Dict(items) = &root.value else {
            bail!("data.pkl does not hold a state dict")
        };
        for (key, value) in items {
            let Value::Str(name) = &key.value else {
                continue;
            };
            let Some(raw) = raw_tensor(value).map_err(|e| e.context(format!("tensor {name}")))?
            else {
                continue;
            };
            let tensor = raw
                .locate(&entries, prefix)
                .map_err(|e| e.context(format!("tensor {name}")))?;
            if tensors.insert(name.clone(), tensor).is_some() {
                bail!("tensor {name} appears twice in the state dict")
            }
        }
        Ok(Self {
            file: path.to_path_buf(),
            tensors,
        })
    }

    /// Reads the tensor `name` on the CPU, in its stored dtype.
    pub(super) fn read(&self, name: &str) -> Result<Tensor> {
        let Some(t) = self.tensors.get(name) else {
            bail!("missing tensor {name}")
        };
        // `open` checked that these bytes lie inside the file, so the product does not overflow.
        let count: usize = t.dims.iter().product();
        let mut bytes = vec![0u8; count * t.dtype.size_in_bytes()];
        let mut file = File::open(&self.file)?;
        file.seek(SeekFrom::Start(t.start))?;
        file.read_exact(&mut bytes)?;
        if !t.fortran || t.dims.len() < 2 {
            return Tensor::from_raw_buffer(&bytes, t.dtype, &t.dims, &Device::Cpu);
        }
        let reversed: Vec<usize> = t.dims.iter().rev().copied().collect();
        let order: Vec<usize> = (0..t.dims.len()).rev().collect();
        Tensor::from_raw_buffer(&bytes, t.dtype, &reversed, &Device::Cpu)?.permute(order)
    }
}

/// A tensor as the pickle describes it, not yet checked against its storage.
struct RawTensor {
    dtype: DType,
    storage: String,
    /// Elements of `dtype` in the storage.
    storage_len: usize,
    offset: usize,
    dims: Vec<usize>,
    strides: Vec<usize>,
}

impl RawTensor {
    /// Checks the view against its storage and the storage against its archive entry
    /// (`<prefix>data/<storage>`), and says where the tensor's bytes start.
    fn locate(&self, entries: &HashMap<String, ZipEntry>, prefix: &str) -> Result<PthTensor> {
        let (dims, strides) = (&self.dims, &self.strides);
        if dims.len() != strides.len() {
            bail!("{} dims but {} strides", dims.len(), strides.len())
        }
        let Some(count) = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d)) else {
            bail!("shape {dims:?} has too many elements")
        };
        let row_major = contiguous(dims.iter().zip(strides).rev());
        if !row_major && !contiguous(dims.iter().zip(strides)) {
            bail!(
                "shape {dims:?} with strides {strides:?} is not contiguous; only contiguous \
                 tensors are read"
            )
        }
        let end = self.offset.checked_add(count);
        if end.is_none_or(|end| end > self.storage_len) {
            bail!(
                "shape {dims:?} from offset {} needs {} elements but its storage {} holds {}",
                self.offset,
                end.map_or("too many".to_string(), |e| e.to_string()),
                self.storage,
                self.storage_len
            )
        }
        let name = format!("{prefix}data/{}", self.storage);
        let Some(entry) = entries.get(&name) else {
            bail!("its storage {name} is not in the archive")
        };
        entry.check_stored()?;
        let size = self.dtype.size_in_bytes() as u64;
        let need = (self.storage_len as u64).checked_mul(size);
        if need.is_none_or(|n| n > entry.size) {
            bail!(
                "its storage {name} of {} {:?} elements needs more than the entry's {} bytes",
                self.storage_len,
                self.dtype,
                entry.size
            )
        }
        Ok(PthTensor {
            dtype: self.dtype,
            dims: dims.clone(),
            fortran: !row_major,
            start: entry.start + self.offset as u64 * size,
        })
    }
}

/// Whether `(dim, stride)` pairs, innermost first, are densely packed (dims of 1 may have any
/// stride, as in torch).
fn contiguous<'a>(pairs: impl Iterator<Item = (&'a usize, &'a usize)>) -> bool {
    let mut acc = Some(1usize);
    for (&d, &s) in pairs {
        if d > 1 && Some(s) != acc {
            return false;
        }
        acc = acc.and_then(|a| a.checked_mul(d));
    }
    true
}

/// The tensor that the state-dict value `v` rebuilds, or `None` when `v` is not a tensor.
fn raw_tensor(v: &Node) -> Result<Option<RawTensor>> {
    let Value::Reduce(f, args) = &v.value else {
        return Ok(None);
    };
    let (f, args) = match f.global() {
        Some(("torch._tensor", "_rebuild_from_type_v2")) => match args.tuple() {
            Some([func, _, inner, ..]) => (func, inner),
            _ => bail!("malformed _rebuild_from_type_v2 arguments"),
        },
        Some(("torch._utils", "_rebuild_parameter")) => match args.tuple() {
            Some([data, ..]) => match &data.value {
                Value::Reduce(f, args) => (f, args),
                _ => bail!("malformed _rebuild_parameter arguments"),
            },
            _ => bail!("malformed _rebuild_parameter arguments"),
        },
        _ => (f, args),
    };
    if f.global() != Some(("torch._utils", "_rebuild_tensor_v2")) {
        return Ok(None);
    }
    let Some([storage, offset, dims, strides, ..]) = args.tuple() else {
        bail!("_rebuild_tensor_v2 needs (storage, offset, size, stride, ...)")
    };
    let Value::PersId(id) = &storage.value else {
        bail!("the storage is not a persistent id")
    };
    let Some([_, class, key, _, len, ..]) = id.tuple() else {
        bail!("the storage id is not (\"storage\", class, key, location, size)")
    };
    let dtype = match class.global() {
        Some((_, "FloatStorage")) => DType::F32,
        Some((_, "DoubleStorage")) => DType::F64,
        Some((_, "HalfStorage")) => DType::F16,
        Some((_, "BFloat16Storage")) => DType::BF16,
        Some((_, "ByteStorage")) => DType::U8,
        Some((_, "LongStorage")) => DType::I64,
        Some((module, class)) => bail!("unsupported storage type {module}.{class}"),
        None => bail!("the storage type is not a class"),
    };
    let Value::Str(storage) = &key.value else {
        bail!("the storage key is not a string")
    };
    let ints = |n: &Node, what: &str| match n.tuple() {
        Some(items) => items
            .iter()
            .map(|i| i.index(what))
            .collect::<Result<Vec<_>>>(),
        None => bail!("{what} is not a tuple"),
    };
    Ok(Some(RawTensor {
        dtype,
        storage: storage.clone(),
        storage_len: len.index("the storage size")?,
        offset: offset.index("the storage offset")?,
        dims: ints(dims, "size")?,
        strides: ints(strides, "stride")?,
    }))
}
