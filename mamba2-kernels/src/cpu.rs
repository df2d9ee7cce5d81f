//! CPU helpers every family's CPU code shares: contiguous f32 views of candle storage, conversion
//! of f32 results back to the requested dtype, in-place f32 updates of any float storage, and a
//! strided single-threaded f32 GEMM (the `gemm` crate) for the SSD's chunk terms.

use std::borrow::Cow;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, DType, Layout, Result, Storage, StorageRef, Tensor};
use half::{bf16, f16};

/// The contiguous elements of `s` under layout `l` as f32, borrowed when already f32.
pub(crate) fn f32_view<'a>(
    op: &str,
    name: &str,
    s: &'a CpuStorage,
    l: &Layout,
) -> Result<Cow<'a, [f32]>> {
    let Some((start, end)) = l.contiguous_offsets() else {
        bail!("{op}: {name} must be contiguous (call .contiguous() first)")
    };
    Ok(match s {
        CpuStorage::F32(v) => Cow::Borrowed(&v[start..end]),
        CpuStorage::F16(v) => Cow::Owned(v[start..end].iter().map(|x| x.to_f32()).collect()),
        CpuStorage::BF16(v) => Cow::Owned(v[start..end].iter().map(|x| x.to_f32()).collect()),
        other => bail!(
            "{op}: {name} must be f32, f16 or bf16, got {:?}",
            other.dtype()
        ),
    })
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

    /// Its contiguous elements as f32 (see [`f32_view`]).
    pub fn f32(&self, op: &str, name: &str) -> Result<Cow<'_, [f32]>> {
        f32_view(op, name, cpu(op, name, &self.guard)?, self.layout)
    }
}

/// A small tensor (a per-head parameter) read into an f32 vector.
pub(crate) fn small_f32(t: &Tensor) -> Result<Vec<f32>> {
    t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()
}

/// Converts an f32 result into CPU storage of `dtype` (f32, f16 or bf16).
pub(crate) fn from_f32(v: Vec<f32>, dtype: DType) -> Result<CpuStorage> {
    Ok(match dtype {
        DType::F32 => CpuStorage::F32(v),
        DType::F16 => CpuStorage::F16(v.into_iter().map(f16::from_f32).collect()),
        DType::BF16 => CpuStorage::BF16(v.into_iter().map(bf16::from_f32).collect()),
        dt => bail!("unsupported output dtype {dt:?}"),
    })
}

/// Runs `f` on the contiguous elements of `s` under layout `l` as f32, in place: f32 storage is
/// handed over directly, f16 and bf16 are converted to f32 and rounded back after `f`.
pub(crate) fn update_f32(
    op: &str,
    name: &str,
    s: &mut CpuStorage,
    l: &Layout,
    f: impl FnOnce(&mut [f32]),
) -> Result<()> {
    let Some((start, end)) = l.contiguous_offsets() else {
        bail!("{op}: {name} must be contiguous to be updated in place")
    };
    match s {
        CpuStorage::F32(v) => f(&mut v[start..end]),
        CpuStorage::F16(v) => {
            let mut buf: Vec<f32> = v[start..end].iter().map(|x| x.to_f32()).collect();
            f(&mut buf);
            for (d, x) in v[start..end].iter_mut().zip(buf) {
                *d = f16::from_f32(x);
            }
        }
        CpuStorage::BF16(v) => {
            let mut buf: Vec<f32> = v[start..end].iter().map(|x| x.to_f32()).collect();
            f(&mut buf);
            for (d, x) in v[start..end].iter_mut().zip(buf) {
                *d = bf16::from_f32(x);
            }
        }
        other => bail!(
            "{op}: {name} must be f32, f16 or bf16, got {:?}",
            other.dtype()
        ),
    }
    Ok(())
}

/// A read-only strided matrix inside a slice: element (i, j) is `data[i·rs + j·cs]`.
#[derive(Clone, Copy)]
pub(crate) struct MatRef<'a> {
    pub data: &'a [f32],
    pub rs: usize,
    pub cs: usize,
}

/// A writable strided matrix inside a slice.
pub(crate) struct MatMut<'a> {
    pub data: &'a mut [f32],
    pub rs: usize,
    pub cs: usize,
}

fn fits(len: usize, rows: usize, cols: usize, rs: usize, cs: usize) -> bool {
    rows == 0 || cols == 0 || (rows - 1) * rs + (cols - 1) * cs < len
}

/// `dst[m×n] ← alpha·dst + lhs[m×k]·rhs[k×n]`; with `alpha = None` the old `dst` is not read.
pub(crate) fn gemm(
    (m, n, k): (usize, usize, usize),
    dst: MatMut<'_>,
    lhs: MatRef<'_>,
    rhs: MatRef<'_>,
    alpha: Option<f32>,
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
            alpha.unwrap_or(0.0),
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}
