//! The CUDA plumbing every op family's launcher shares: the kernel images (fatbins compiled by
//! build.rs) loaded once per CUDA context, device attributes, launches on candle's stream with
//! raw device pointers, pointers and stream guards of candle storages, fresh outputs, scratch
//! memory kept per stream ([`scratch`]) and TMA tensor maps ([`tensor_map`]). Outputs and scratch
//! are filled with NaN first under [`set_poison`], so tests can see any element a kernel fails to
//! write. The families (`crate::ssd`, `crate::conv`, …) import from here; nothing here imports a
//! family.
//!
//! On first use of a context, the device's default memory pool (the one candle's stream-ordered
//! allocations come from) is told to keep freed memory instead of returning it to the driver at
//! every synchronisation: otherwise each call would re-map its outputs and intermediates, which a
//! host call would pay every time. PyTorch's caching allocator keeps memory the same way.

use std::collections::HashMap;
use std::ffi::c_void;
use std::ptr::null_mut;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::sys::{
    self, CUdevice_attribute, CUfunction_attribute,
};
use candle_core::cuda_backend::cudarc::driver::{
    result, CudaContext, CudaFunction, CudaModule, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr,
    LaunchConfig, SyncOnDrop,
};
use candle_core::cuda_backend::cudarc::nvrtc::Ptx;
use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result, Storage, Tensor};

pub(crate) mod scratch;
pub(crate) mod tensor_map;

pub(crate) use crate::instances::Ty;

/// Asserts at compile time that a kernel parameter struct has the size and field offsets that its
/// C definition asserts (`M2_SIZE`, `M2_AT` in the family's `params.cuh`).
macro_rules! m2_layout {
    ($t:ty, $size:expr, { $($field:ident: $offset:expr),* $(,)? }) => {
        const _: () = {
            assert!(std::mem::size_of::<$t>() == $size, "size differs from the C struct");
            $(assert!(
                std::mem::offset_of!($t, $field) == $offset,
                "field offset differs from the C struct"
            );)*
        };
    };
}
pub(crate) use m2_layout;

/// A kernel image: the fatbin build.rs compiled from `kernels/<family>/<file>.cu`, named
/// `<family>_<file>`.
pub(crate) type Image = (&'static str, &'static [u8]);

/// The [`Image`] of `kernels/<family>/<file>.cu`, given as `"<family>_<file>"`.
macro_rules! fatbin {
    ($name:literal) => {
        (
            $name,
            include_bytes!(concat!(env!("OUT_DIR"), "/", $name, ".fatbin")),
        )
    };
}
pub(crate) use fatbin;

/// Loaded modules and functions, per CUDA context (a context is a device's primary context).
#[derive(Default)]
struct Cache {
    modules: HashMap<(usize, &'static str), Arc<CudaModule>>,
    functions: HashMap<usize, HashMap<String, CudaFunction>>,
    info: HashMap<usize, Info>,
    pools: std::collections::HashSet<usize>,
}

fn cache() -> &'static Mutex<Cache> {
    static CACHE: OnceLock<Mutex<Cache>> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

fn lock() -> Result<std::sync::MutexGuard<'static, Cache>> {
    cache()
        .lock()
        .map_err(|_| candle_core::Error::Msg("mamba2 CUDA module cache poisoned".into()))
}

/// The kernel `name` of `image`, loaded on first use with its dynamic shared memory limit raised.
pub(crate) fn function(stream: &Arc<CudaStream>, image: Image, name: &str) -> Result<CudaFunction> {
    let ctx = stream.context();
    let key = ctx.cu_ctx() as usize;
    let mut c = lock()?;
    if let Some(f) = c.functions.get(&key).and_then(|fs| fs.get(name)) {
        return Ok(f.clone());
    }
    if c.pools.insert(key) && ctx.has_async_alloc() {
        keep_freed_memory(ctx)?;
    }
    let module = match c.modules.get(&(key, image.0)) {
        Some(m) => m.clone(),
        None => {
            let m = ctx.load_module(Ptx::from_binary(image.1.to_vec())).w()?;
            c.modules.insert((key, image.0), m.clone());
            m
        }
    };
    let f = module.load_function(name).w()?;
    // The dynamic limit is what the opt-in maximum leaves beside the kernel's static memory.
    let max_dynamic = i(device_max_smem(ctx)?)?
        - f.get_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)
            .w()?;
    f.set_attribute(
        CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        max_dynamic,
    )
    .w()?;
    c.functions
        .entry(key)
        .or_default()
        .insert(name.to_string(), f.clone());
    Ok(f)
}

/// The module of `image` on the stream's context, if a kernel of it has been loaded there.
#[cfg(feature = "timeline")]
pub(crate) fn loaded_module(
    stream: &Arc<CudaStream>,
    image: Image,
) -> Result<Option<Arc<CudaModule>>> {
    let key = stream.context().cu_ctx() as usize;
    Ok(lock()?.modules.get(&(key, image.0)).cloned())
}

/// Raises the release threshold of `ctx`'s device's default memory pool to "never".
fn keep_freed_memory(ctx: &Arc<CudaContext>) -> Result<()> {
    let mut pool = std::ptr::null_mut();
    let mut threshold = u64::MAX;
    // SAFETY: `pool` receives the device's default pool handle, which lives as long as the
    // device; the attribute value is a u64 as the driver API requires for this attribute.
    unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device())
            .result()
            .w()?;
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
        .result()
        .w()?;
    }
    Ok(())
}

fn device_max_smem(ctx: &Arc<CudaContext>) -> Result<usize> {
    let attr = CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN;
    Ok(ctx.attribute(attr).w()? as usize)
}

/// What the launchers need to know of a device.
#[derive(Clone, Copy)]
struct Info {
    sms: usize,
    max_smem: usize,
    /// L2 cache bytes.
    l2: usize,
    /// Programmatic dependent launch and tensor-map copies (sm_90+).
    sm90: bool,
    /// The fatbins' sm_90a images run here (compute capability 9.0; later devices JIT the PTX).
    sm90a: bool,
}

/// The stream's device's [`Info`], cached (the last one asked for on each thread without a lock).
fn info(stream: &Arc<CudaStream>) -> Result<Info> {
    thread_local! {
        static LAST: std::cell::Cell<Option<(usize, Info)>> = const { std::cell::Cell::new(None) };
    }
    let ctx = stream.context();
    let key = ctx.cu_ctx() as usize;
    if let Some((k, v)) = LAST.get() {
        if k == key {
            return Ok(v);
        }
    }
    let cached = lock()?.info.get(&key).copied();
    let v = match cached {
        Some(v) => v,
        None => {
            let attr = |a| Ok::<_, candle_core::Error>(ctx.attribute(a).w()? as usize);
            let major = attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
            let minor = attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
            let v = Info {
                sms: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
                max_smem: device_max_smem(ctx)?,
                l2: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?,
                sm90: major >= 9,
                sm90a: (major, minor) == (9, 0),
            };
            lock()?.info.insert(key, v);
            v
        }
    };
    LAST.set(Some((key, v)));
    Ok(v)
}

pub(crate) fn max_smem(stream: &Arc<CudaStream>) -> Result<usize> {
    Ok(info(stream)?.max_smem)
}

pub(crate) fn l2_bytes(stream: &Arc<CudaStream>) -> Result<usize> {
    Ok(info(stream)?.l2)
}

pub(crate) fn sm_count(stream: &Arc<CudaStream>) -> Result<usize> {
    Ok(info(stream)?.sms)
}

/// Whether the kernels run their sm_90a machine code (wgmma) on the stream's device.
pub(crate) fn runs_sm90a(stream: &Arc<CudaStream>) -> Result<bool> {
    Ok(info(stream)?.sm90a)
}

/// Whether the SSD kernels copy their tiles by tensor map: on sm_90+, unless `MAMBA2_NO_TMA=1`
/// (read once; the tests use it to run the cp.async path of sm_80 on Hopper too).
pub(crate) fn has_tma(stream: &Arc<CudaStream>) -> Result<bool> {
    static OFF: OnceLock<bool> = OnceLock::new();
    let off = *OFF.get_or_init(|| std::env::var("MAMBA2_NO_TMA").is_ok_and(|v| v == "1"));
    Ok(info(stream)?.sm90 && !off)
}

/// The kernels' type of values of `dtype`, or an error naming the op.
pub(crate) fn ty(op: &str, dtype: DType) -> Result<Ty> {
    Ok(match dtype {
        DType::F32 => Ty::F32,
        DType::F16 => Ty::F16,
        DType::BF16 => Ty::Bf16,
        dt => bail!("{op}: no CUDA kernel for dtype {dt:?}"),
    })
}

/// The device address of a storage's first element, and its stream guard.
fn base_ptr<'a>(
    op: &str,
    name: &str,
    s: &'a CudaStorage,
    stream: &'a CudaStream,
) -> Result<(u64, SyncOnDrop<'a>)> {
    Ok(match &s.slice {
        CudaStorageSlice::F32(v) => v.device_ptr(stream),
        CudaStorageSlice::F16(v) => v.device_ptr(stream),
        CudaStorageSlice::BF16(v) => v.device_ptr(stream),
        CudaStorageSlice::U32(v) => v.device_ptr(stream),
        CudaStorageSlice::I64(v) => v.device_ptr(stream),
        _ => bail!(
            "{op}: {name} must be f32, f16, bf16 or (ids) u32, i64, got {:?}",
            s.dtype()
        ),
    })
}

/// The device address of the first element of a contiguous tensor, and its stream guard.
pub(crate) fn ptr<'a>(
    op: &str,
    name: &str,
    s: &'a CudaStorage,
    l: &Layout,
    stream: &'a CudaStream,
) -> Result<(u64, SyncOnDrop<'a>)> {
    let Some((start, _)) = l.contiguous_offsets() else {
        bail!("{op}: {name} must be contiguous")
    };
    let (p, g) = base_ptr(op, name, s, stream)?;
    Ok((p + (start * s.dtype().size_in_bytes()) as u64, g))
}

/// Like [`ptr`] for a tensor whose rows (last dim) are contiguous but may be spaced apart, as a
/// slice of a wider tensor is: also returns the row stride in elements.
pub(crate) fn rows_ptr<'a>(
    op: &str,
    name: &str,
    s: &'a CudaStorage,
    l: &Layout,
    stream: &'a CudaStream,
) -> Result<(u64, i64, SyncOnDrop<'a>)> {
    let Some(row_stride) = crate::check::row_stride(l) else {
        bail!(
            "{op}: {name} must have contiguous rows and one row stride, got strides {:?} for shape {:?}",
            l.stride(),
            l.dims()
        )
    };
    let (p, g) = base_ptr(op, name, s, stream)?;
    Ok((
        p + (l.start_offset() * s.dtype().size_in_bytes()) as u64,
        row_stride as i64,
        g,
    ))
}

/// The stream guards of a launch's inputs. Each records its tensor's read event when dropped
/// (cudarc's event tracking, on in candle), so they are kept until the kernels that read the
/// tensors are on the stream: a write from another stream then waits for those kernels.
pub(crate) type Guards<'a> = Vec<SyncOnDrop<'a>>;

/// Where a kernel writes an output into a buffer the caller holds mutably, instead of a tensor of
/// its own: the address of its first element and its row stride (elements).
pub(crate) type Dest = (u64, i64);

/// The [`Dest`] of columns `offset..` of the contiguous `[.., W]` buffer `(s, l)`, held mutably
/// by the caller (an in-place op's storage).
pub(crate) fn dest(
    op: &str,
    name: &str,
    (s, l): (&CudaStorage, &Layout),
    offset: usize,
    stream: &CudaStream,
) -> Result<Dest> {
    let width = l.dims().last().copied().unwrap_or(0);
    let start = ptr(op, name, s, l, stream)?.0;
    Ok((
        start + (offset * s.dtype().size_in_bytes()) as u64,
        width as i64,
    ))
}

/// Records that the kernels on `stream` so far write `s` (its write event, which a read from
/// another stream waits for): called once they are launched.
pub(crate) fn written(s: &mut CudaStorage, stream: &CudaStream) -> Result<()> {
    match &mut s.slice {
        CudaStorageSlice::F32(v) => drop(v.device_ptr_mut(stream)),
        CudaStorageSlice::F16(v) => drop(v.device_ptr_mut(stream)),
        CudaStorageSlice::BF16(v) => drop(v.device_ptr_mut(stream)),
        _ => bail!(
            "written: an output must be f32, f16 or bf16, got {:?}",
            s.dtype()
        ),
    }
    Ok(())
}

/// A tensor held by an op (not one of its candle arguments), locked for the launch.
pub(crate) struct Held<'a> {
    pub guard: candle_core::StorageRef<'a>,
    pub layout: &'a Layout,
}

impl<'a> Held<'a> {
    pub fn new(t: &'a Tensor) -> Self {
        let (guard, layout) = t.storage_and_layout();
        Self { guard, layout }
    }

    pub fn cuda(&self, op: &str, name: &str) -> Result<&CudaStorage> {
        match &*self.guard {
            Storage::Cuda(s) => Ok(s),
            _ => bail!("{op}: {name} is not on the CUDA device of the other inputs"),
        }
    }

    /// Its CUDA storage and layout, as a launcher takes an argument.
    pub fn arg(&self, op: &str, name: &str) -> Result<(&CudaStorage, &Layout)> {
        Ok((self.cuda(op, name)?, self.layout))
    }

    /// Its device address (it must be contiguous), its stream guard kept in `guards`.
    pub fn ptr<'s>(
        &'s self,
        op: &str,
        name: &str,
        stream: &'s CudaStream,
        guards: &mut Guards<'s>,
    ) -> Result<u64> {
        let (p, g) = ptr(op, name, self.cuda(op, name)?, self.layout, stream)?;
        guards.push(g);
        Ok(p)
    }
}

/// A storage the kernels wrote, as a tensor of `shape` that records no op.
pub(crate) fn tensor(s: CudaStorage, shape: impl Into<candle_core::Shape>) -> Tensor {
    let none = candle_core::op::BackpropOp::none();
    Tensor::from_storage(Storage::Cuda(s), shape, none, false)
}

/// The device address of an optional held tensor, or 0 (the kernels' "absent").
pub(crate) fn opt_ptr<'s>(
    op: &str,
    name: &str,
    h: &'s Option<Held>,
    stream: &'s CudaStream,
    guards: &mut Guards<'s>,
) -> Result<u64> {
    match h {
        Some(h) => h.ptr(op, name, stream, guards),
        None => Ok(0),
    }
}

/// A fresh output of `len` elements of `dtype`, poisoned with NaN under [`set_poison`].
pub(crate) fn alloc(dev: &CudaDevice, dtype: DType, len: usize) -> Result<CudaStorage> {
    let s = match dtype {
        DType::F32 => CudaStorage::wrap_cuda_slice(unsafe { dev.alloc::<f32>(len)? }, dev.clone()),
        DType::F16 => {
            CudaStorage::wrap_cuda_slice(unsafe { dev.alloc::<half::f16>(len)? }, dev.clone())
        }
        DType::BF16 => {
            CudaStorage::wrap_cuda_slice(unsafe { dev.alloc::<half::bf16>(len)? }, dev.clone())
        }
        dt => bail!("no CUDA output of dtype {dt:?}"),
    };
    if poisoning() && len > 0 {
        let stream = dev.cuda_stream();
        let p = ptr("alloc", "output", &s, &Layout::contiguous(len), &stream)?.0;
        poison(&stream, p, len * dtype.size_in_bytes())?;
    }
    Ok(s)
}

/// A fresh buffer of `len` zeros of `dtype` (for outputs that kernels accumulate into).
pub(crate) fn zeroed(dev: &CudaDevice, dtype: DType, len: usize) -> Result<CudaStorage> {
    let s = alloc(dev, dtype, len)?;
    if len > 0 {
        let stream = dev.cuda_stream();
        let p = ptr("zeroed", "output", &s, &Layout::contiguous(len), &stream)?.0;
        // SAFETY: `p` addresses the `len` elements just allocated on this stream.
        unsafe {
            result::memset_d8_async(p, 0, len * dtype.size_in_bytes(), stream.cu_stream()).w()?
        }
    }
    Ok(s)
}

/// Whether fresh buffers are poisoned: 0 not decided yet, 1 no, 2 yes.
static POISON: AtomicU8 = AtomicU8::new(0);

/// Fills every fresh CUDA output and scratch buffer with NaN before the kernels that write it
/// (`on`), so that a test sees any element a kernel fails to write; off by default, or as
/// `MAMBA2_POISON=1` sets it when this is never called. For tests: setting the variable from a
/// running (multi-threaded) process instead races with the CUDA driver's own reads of the
/// environment, which is undefined behaviour.
pub fn set_poison(on: bool) {
    POISON.store(if on { 2 } else { 1 }, Ordering::Relaxed);
}

/// Whether fresh buffers are filled with NaN first ([`set_poison`], else `MAMBA2_POISON=1`, read
/// once).
pub(crate) fn poisoning() -> bool {
    match POISON.load(Ordering::Relaxed) {
        0 => {
            let on = std::env::var("MAMBA2_POISON").is_ok_and(|v| v == "1");
            let v = if on { 2 } else { 1 };
            // A concurrent `set_poison` wins.
            match POISON.compare_exchange(0, v, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => on,
                Err(now) => now == 2,
            }
        }
        v => v == 2,
    }
}

/// Fills `bytes` bytes at `p` with NaN (0xFF bytes) on `stream`.
pub(crate) fn poison(stream: &CudaStream, p: u64, bytes: usize) -> Result<()> {
    // SAFETY: the caller's `p` addresses at least `bytes` bytes allocated on this stream.
    unsafe { result::memset_d8_async(p, 0xFF, bytes, stream.cu_stream()).w() }
}

/// Launches `f` on `stream`. On sm_90+ with programmatic stream serialization: the kernel may be
/// scheduled while the previous kernel on the stream drains, hiding the launch latency between
/// the many small kernels of a decode step; every kernel of ours waits for its predecessor first
/// thing (`m2::wait_prior_grid`), so results are as with a plain launch.
pub(crate) fn launch(
    stream: &Arc<CudaStream>,
    f: &CudaFunction,
    cfg: LaunchConfig,
    args: &[&dyn Arg],
) -> Result<()> {
    let mut params: Vec<*mut c_void> = args.iter().map(|a| a.param()).collect();
    // SAFETY: all-zero bytes are a valid value of this plain C union.
    let mut value: sys::CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
    value.programmaticStreamSerializationAllowed = 1;
    let mut attr = sys::CUlaunchAttribute {
        id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
        pad: [0; 4],
        value,
    };
    let config = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: &mut attr,
        numAttrs: info(stream)?.sm90 as u32,
    };
    stream.context().bind_to_thread().w()?;
    // SAFETY: every kernel's parameter list matches the argument order its launcher builds,
    // `params` points at those arguments, which outlive the call, and every device pointer
    // addresses a live, contiguous buffer of the size the kernel indexes.
    unsafe {
        sys::cuLaunchKernelEx(&config, f.cu_function(), params.as_mut_ptr(), null_mut())
            .result()
            .w()?
    };
    Ok(())
}

/// A kernel argument, passed by value.
pub(crate) trait Arg {
    /// The address of the value, as `cuLaunchKernel` takes kernel parameters.
    fn param(&self) -> *mut c_void;
}
impl<T: DeviceRepr> Arg for T {
    fn param(&self) -> *mut c_void {
        (self as *const T).cast_mut().cast()
    }
}

/// The CUDA grid's limits: up to 2³¹ − 1 programs along x, 65,535 along y and z.
const GRID_LIMITS: [usize; 3] = [i32::MAX as usize, 65_535, 65_535];
/// Threads per program at most.
const MAX_THREADS: usize = 1024;

/// The launch of `grid` programs of `block` threads with `smem` bytes of dynamic shared memory,
/// checked against the grid's limits, [`MAX_THREADS`] and the device's shared memory per program:
/// past them a launch fails, or runs on stale memory where a size would have wrapped into range.
pub(crate) fn cfg(
    op: &str,
    stream: &Arc<CudaStream>,
    grid: [usize; 3],
    block: [usize; 3],
    smem: usize,
) -> Result<LaunchConfig> {
    for (axis, (&n, &limit)) in ["x", "y", "z"].iter().zip(grid.iter().zip(&GRID_LIMITS)) {
        if n == 0 || n > limit {
            bail!("{op}: {n} programs along the grid's {axis} axis, outside 1..={limit}: the problem is too large for one launch")
        }
    }
    let threads = block.iter().product::<usize>();
    if threads == 0 || threads > MAX_THREADS {
        bail!("{op}: {threads} threads per program, outside 1..={MAX_THREADS}")
    }
    let max = max_smem(stream)?;
    if smem > max {
        bail!("{op}: {smem} bytes of shared memory per program, over the device's {max}")
    }
    let u = |v: usize| {
        u32::try_from(v).map_err(|_| candle_core::Error::Msg(format!("{op}: {v} exceeds u32")))
    };
    Ok(LaunchConfig {
        grid_dim: (u(grid[0])?, u(grid[1])?, u(grid[2])?),
        block_dim: (u(block[0])?, u(block[1])?, u(block[2])?),
        shared_mem_bytes: u(smem)?,
    })
}

pub(crate) fn i(v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| {
        candle_core::Error::Msg(format!(
            "dimension {v} exceeds the kernels' i32 index space ({})",
            i32::MAX
        ))
    })
}
