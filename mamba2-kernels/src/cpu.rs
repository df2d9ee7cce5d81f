//! CPU helpers every family's CPU code shares: the compute types ([`Real`]: f32 for f32, f16
//! and bf16 values, f64 for f64), contiguous views of candle storage in a compute type, results
//! converted back to the requested dtype, in-place updates of any float storage, and a strided
//! single-threaded GEMM (the `gemm` crate) for the SSD's chunk terms.

use std::borrow::Cow;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, DType, Layout, Result, Storage, StorageRef, Tensor};
use half::{bf16, f16};
use num_traits::{Float, FromPrimitive};

use crate::fastexp;

/// A CPU compute type: values of every float dtype are read into one and results written back.
pub(crate) trait Real:
    Float
    + FromPrimitive
    + std::ops::AddAssign
    + std::ops::SubAssign
    + std::ops::MulAssign
    + std::iter::Sum
    + Default
    + Send
    + Sync
    + std::fmt::Debug
    + 'static
{
    /// The contiguous elements of a storage, converted unless the storage holds this type.
    fn slice<'a>(s: &'a CpuStorage, start: usize, end: usize) -> Option<Cow<'a, [Self]>>;
    /// The elements of a storage of this type, for updates in place.
    fn slice_mut(s: &mut CpuStorage) -> Option<&mut [Self]>;
    /// `v` as storage of `dtype`.
    fn storage(v: Vec<Self>, dtype: DType) -> Option<CpuStorage>;
    fn of(v: f32) -> Self;
    /// e^x in a form element loops vectorise ([`fastexp`] in f32, libm in f64).
    fn exp_v(self) -> Self;
    /// 2^x, as [`Real::exp_v`].
    fn exp2_v(self) -> Self;
    fn as_f32(self) -> f32;
    fn as_f64(self) -> f64;
}

fn cast<A: Copy, B>(v: &[A], f: impl Fn(A) -> B) -> Vec<B> {
    v.iter().map(|&x| f(x)).collect()
}

impl Real for f32 {
    fn slice<'a>(s: &'a CpuStorage, start: usize, end: usize) -> Option<Cow<'a, [f32]>> {
        Some(match s {
            CpuStorage::F32(v) => Cow::Borrowed(&v[start..end]),
            CpuStorage::F64(v) => Cow::Owned(cast(&v[start..end], |x| x as f32)),
            CpuStorage::F16(v) => Cow::Owned(cast(&v[start..end], f16::to_f32)),
            CpuStorage::BF16(v) => Cow::Owned(cast(&v[start..end], bf16::to_f32)),
            _ => return None,
        })
    }

    fn slice_mut(s: &mut CpuStorage) -> Option<&mut [f32]> {
        match s {
            CpuStorage::F32(v) => Some(v),
            _ => None,
        }
    }

    fn storage(v: Vec<f32>, dtype: DType) -> Option<CpuStorage> {
        Some(match dtype {
            DType::F32 => CpuStorage::F32(v),
            DType::F64 => CpuStorage::F64(cast(&v, f64::from)),
            DType::F16 => CpuStorage::F16(cast(&v, f16::from_f32)),
            DType::BF16 => CpuStorage::BF16(cast(&v, bf16::from_f32)),
            _ => return None,
        })
    }

    fn of(v: f32) -> f32 {
        v
    }

    #[inline(always)]
    fn exp_v(self) -> f32 {
        fastexp::exp(self)
    }

    #[inline(always)]
    fn exp2_v(self) -> f32 {
        fastexp::exp2(self)
    }

    fn as_f32(self) -> f32 {
        self
    }

    fn as_f64(self) -> f64 {
        f64::from(self)
    }
}

impl Real for f64 {
    fn slice<'a>(s: &'a CpuStorage, start: usize, end: usize) -> Option<Cow<'a, [f64]>> {
        Some(match s {
            CpuStorage::F64(v) => Cow::Borrowed(&v[start..end]),
            CpuStorage::F32(v) => Cow::Owned(cast(&v[start..end], f64::from)),
            CpuStorage::F16(v) => Cow::Owned(cast(&v[start..end], f16::to_f64)),
            CpuStorage::BF16(v) => Cow::Owned(cast(&v[start..end], bf16::to_f64)),
            _ => return None,
        })
    }

    fn slice_mut(s: &mut CpuStorage) -> Option<&mut [f64]> {
        match s {
            CpuStorage::F64(v) => Some(v),
            _ => None,
        }
    }

    fn storage(v: Vec<f64>, dtype: DType) -> Option<CpuStorage> {
        Some(match dtype {
            DType::F64 => CpuStorage::F64(v),
            DType::F32 => CpuStorage::F32(cast(&v, |x| x as f32)),
            DType::F16 => CpuStorage::F16(cast(&v, f16::from_f64)),
            DType::BF16 => CpuStorage::BF16(cast(&v, bf16::from_f64)),
            _ => return None,
        })
    }

    fn of(v: f32) -> f64 {
        f64::from(v)
    }

    #[inline(always)]
    fn exp_v(self) -> f64 {
        self.exp()
    }

    #[inline(always)]
    fn exp2_v(self) -> f64 {
        self.exp2()
    }

    fn as_f32(self) -> f32 {
        self as f32
    }

    fn as_f64(self) -> f64 {
        self
    }
}

/// Elements one rayon task takes in an element-wise pass: large enough that splitting costs
/// nothing beside the work, small enough that every core gets several tasks.
pub(crate) const ELEMENTS_PER_TASK: usize = 1 << 14;

/// A candle argument of a CPU op: its storage and layout.
pub(crate) type CpuArg<'a> = (&'a CpuStorage, &'a Layout);

/// Rounds `v` to the precision of `dtype` in place (values stored in `dtype` and read back).
pub(crate) fn round_to<T: Real>(v: &mut [T], dtype: DType) {
    let round: fn(T) -> T = match dtype {
        DType::F32 => |x| T::of(x.as_f32()),
        DType::BF16 => |x| T::of(bf16::from_f64(x.as_f64()).to_f32()),
        DType::F16 => |x| T::of(f16::from_f64(x.as_f64()).to_f32()),
        _ => return,
    };
    v.iter_mut().for_each(|x| *x = round(*x));
}

/// Whether values of `dtype` are computed in f64 on the CPU (else in f32).
pub(crate) fn wide(dtype: DType) -> bool {
    dtype == DType::F64
}

/// The contiguous elements of `s` under layout `l` in the compute type, borrowed when they
/// already have it.
pub(crate) fn view<'a, T: Real>(
    op: &str,
    name: &str,
    s: &'a CpuStorage,
    l: &Layout,
) -> Result<Cow<'a, [T]>> {
    let Some((start, end)) = l.contiguous_offsets() else {
        bail!("{op}: {name} must be contiguous (call .contiguous() first)")
    };
    match T::slice(s, start, end) {
        Some(v) => Ok(v),
        None => bail!(
            "{op}: {name} must be f32, f64, f16 or bf16, got {:?}",
            s.dtype()
        ),
    }
}

/// The CPU storage behind a locked tensor storage, or a named error for other devices.
pub(crate) fn cpu<'a>(op: &str, name: &str, s: &'a Storage) -> Result<&'a CpuStorage> {
    match s {
        Storage::Cpu(s) => Ok(s),
        _ => bail!("{op}: {name} is not on the CPU while the op runs on the CPU"),
    }
}

/// A tensor an op holds beside its candle arguments, locked for the CPU forward.
pub(crate) struct Held<'a> {
    guard: StorageRef<'a>,
    layout: &'a Layout,
}

impl<'a> Held<'a> {
    pub fn new(t: &'a Tensor) -> Self {
        let (guard, layout) = t.storage_and_layout();
        Self { guard, layout }
    }

    /// Its contiguous elements in the compute type (see [`view`]).
    pub fn view<T: Real>(&self, op: &str, name: &str) -> Result<Cow<'_, [T]>> {
        view(op, name, cpu(op, name, &self.guard)?, self.layout)
    }
}

/// A small tensor (a per-head parameter) read into a vector of the compute type.
pub(crate) fn small<T: Real>(t: &Tensor) -> Result<Vec<T>> {
    let v = t.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?;
    Ok(v.into_iter()
        .map(|x| T::from_f64(x).unwrap_or_else(T::nan))
        .collect())
}

/// Converts a result into CPU storage of `dtype` (f32, f64, f16 or bf16).
pub(crate) fn to_storage<T: Real>(v: Vec<T>, dtype: DType) -> Result<CpuStorage> {
    match T::storage(v, dtype) {
        Some(s) => Ok(s),
        None => bail!("unsupported output dtype {dtype:?}"),
    }
}

/// Runs `f` on the contiguous elements of `s` under layout `l` in the compute type, in place:
/// storage of that type is handed over directly, others are converted and written back after
/// `f`.
pub(crate) fn update<T: Real>(
    op: &str,
    name: &str,
    s: &mut CpuStorage,
    l: &Layout,
    f: impl FnOnce(&mut [T]),
) -> Result<()> {
    let Some((start, end)) = l.contiguous_offsets() else {
        bail!("{op}: {name} must be contiguous to be updated in place")
    };
    if let Some(v) = T::slice_mut(s) {
        f(&mut v[start..end]);
        return Ok(());
    }
    let dtype = s.dtype();
    let mut buf = view::<T>(op, name, s, l)?.into_owned();
    f(&mut buf);
    let new = to_storage(buf, dtype)?;
    macro_rules! put {
        ($($variant:ident),*) => {
            match (s, new) {
                $((CpuStorage::$variant(dst), CpuStorage::$variant(src)) => {
                    dst[start..end].copy_from_slice(&src)
                })*
                _ => bail!("{op}: {name} must be f32, f64, f16 or bf16"),
            }
        };
    }
    put!(F32, F64, F16, BF16);
    Ok(())
}

/// A read-only strided matrix inside a slice: element (i, j) is `data[i·rs + j·cs]`.
pub(crate) struct MatRef<'a, T> {
    pub data: &'a [T],
    pub rs: usize,
    pub cs: usize,
}

impl<T> Clone for MatRef<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for MatRef<'_, T> {}

/// A writable strided matrix inside a slice.
pub(crate) struct MatMut<'a, T> {
    pub data: &'a mut [T],
    pub rs: usize,
    pub cs: usize,
}

fn fits(len: usize, rows: usize, cols: usize, rs: usize, cs: usize) -> bool {
    rows == 0 || cols == 0 || (rows - 1) * rs + (cols - 1) * cs < len
}

/// `dst[m×n] ← alpha·dst + lhs[m×k]·rhs[k×n]`; with `alpha = None` the old `dst` is not read.
pub(crate) fn gemm<T: Real>(
    (m, n, k): (usize, usize, usize),
    dst: MatMut<'_, T>,
    lhs: MatRef<'_, T>,
    rhs: MatRef<'_, T>,
    alpha: Option<T>,
) {
    assert!(
        fits(dst.data.len(), m, n, dst.rs, dst.cs),
        "gemm: dst out of bounds"
    );
    assert!(
        fits(lhs.data.len(), m, k, lhs.rs, lhs.cs),
        "gemm: lhs out of bounds"
    );
    assert!(
        fits(rhs.data.len(), k, n, rhs.rs, rhs.cs),
        "gemm: rhs out of bounds"
    );
    if m == 0 || n == 0 {
        return;
    }
    // SAFETY: the asserts above keep every element the product touches inside the three slices,
    // and `dst` is borrowed mutably, so it aliases neither input.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.data.as_mut_ptr(),
            dst.cs as isize,
            dst.rs as isize,
            alpha.is_some(),
            lhs.data.as_ptr(),
            lhs.cs as isize,
            lhs.rs as isize,
            rhs.data.as_ptr(),
            rhs.cs as isize,
            rhs.rs as isize,
            alpha.unwrap_or_else(T::zero),
            T::one(),
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// The values of a tensor read to the host in the compute type: the inputs of a CPU backward (a
/// tensor on a device with no backward of the op is an error naming the op).
pub(crate) fn host<T: Real>(op: &str, name: &str, t: &Tensor) -> Result<Vec<T>> {
    if !t.device().is_cpu() {
        bail!(
            "{op}: no backward on {:?} ({name}); gradients run on the CPU or CUDA",
            t.device().location()
        )
    }
    let t = t.contiguous()?;
    let held = Held::new(&t);
    let v = held.view::<T>(op, name)?.into_owned();
    Ok(v)
}

/// `v` as the gradient of `arg` (a CPU tensor of its dtype and shape), or `None` when `arg` tracks
/// no gradient: candle adds every gradient a backward returns into its store.
pub(crate) fn gradient<T: Real>(v: Vec<T>, arg: &Tensor) -> Result<Option<Tensor>> {
    if !arg.track_op() {
        return Ok(None);
    }
    values_like(v, arg).map(Some)
}

/// Host values `v` as a CPU tensor of `like`'s shape and dtype, recording nothing.
pub(crate) fn values_like<T: Real>(v: Vec<T>, like: &Tensor) -> Result<Tensor> {
    let shape = like.shape().clone();
    if v.len() != shape.elem_count() {
        bail!("{} gradient values for shape {shape:?}", v.len())
    }
    let storage = Storage::Cpu(to_storage(v, like.dtype())?);
    let none = candle_core::op::BackpropOp::none();
    Ok(Tensor::from_storage(storage, shape, none, false))
}
