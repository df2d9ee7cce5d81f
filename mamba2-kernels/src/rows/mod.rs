//! Whole rows of a batch written, in place, to the rows of a larger tensor that an index names:
//!
//! ```text
//! dst[rows[r], ..] = src[r, ..]        dst [S, ..], src [R, ..] (same trailing dims and dtype)
//! ```
//!
//! The rows are distinct and checked once, on the host, when the [`RowIndex`] is made, so no two
//! writes meet. On CUDA one kernel moves each row in the widest words its size and addresses
//! allow (`kernels/rows/rows.cu`): candle's `index_select` followed by `slice_set` moves every
//! element twice and indexes each one.

#[cfg(feature = "cuda")]
mod cuda;

use std::collections::HashSet;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, Device, InplaceOp3, Layout, Result, Tensor};

use crate::check;

const OP: &str = "scatter_rows";

/// Distinct row numbers, checked on the host and held on a device as u32.
#[derive(Clone, Debug)]
pub struct RowIndex {
    ids: Tensor,
    /// One past the largest row (0 when empty).
    bound: usize,
}

impl RowIndex {
    /// The index of `rows` on `device`; an error when a row repeats or exceeds u32.
    pub fn new(rows: &[usize], device: &Device) -> Result<Self> {
        let mut seen = HashSet::with_capacity(rows.len());
        let mut ids = Vec::with_capacity(rows.len());
        for (i, &r) in rows.iter().enumerate() {
            if !seen.insert(r) {
                bail!("{OP}: row {r} appears twice in the index (at position {i})")
            }
            match u32::try_from(r) {
                Ok(v) => ids.push(v),
                Err(_) => bail!("{OP}: row {r} (position {i}) exceeds u32"),
            }
        }
        let bound = rows.iter().max().map_or(0, |&m| m + 1);
        Ok(Self {
            ids: Tensor::new(ids.as_slice(), device)?,
            bound,
        })
    }

    /// The rows as a u32 tensor `[R]` on the index's device.
    pub fn ids(&self) -> &Tensor {
        &self.ids
    }

    /// How many rows the index names.
    pub fn len(&self) -> usize {
        self.ids.elem_count()
    }

    /// Whether the index names no row.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The in-place write of `src`'s rows into `dst`'s; `row` elements a row.
struct ScatterRows {
    row: usize,
}

/// `dst[ids[r]] = src[r]` over contiguous `[.., row]` slices.
fn copy_rows<T: Copy>(dst: &mut [T], src: &[T], ids: &[u32], row: usize) {
    for (r, &id) in ids.iter().enumerate() {
        let at = id as usize * row;
        dst[at..at + row].copy_from_slice(&src[r * row..(r + 1) * row]);
    }
}

/// The contiguous range of a layout's elements.
fn range(name: &str, l: &Layout) -> Result<(usize, usize)> {
    match l.contiguous_offsets() {
        Some(r) => Ok(r),
        None => bail!("{OP}: {name} must be contiguous"),
    }
}

impl InplaceOp3 for ScatterRows {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(
        &self,
        dst_s: &mut CpuStorage,
        dst_l: &Layout,
        src_s: &CpuStorage,
        src_l: &Layout,
        ids_s: &CpuStorage,
        ids_l: &Layout,
    ) -> Result<()> {
        let (d0, d1) = range("dst", dst_l)?;
        let (s0, s1) = range("src", src_l)?;
        let (i0, i1) = range("rows", ids_l)?;
        let CpuStorage::U32(ids) = ids_s else {
            bail!("{OP}: the row index must be u32, got {:?}", ids_s.dtype())
        };
        let ids = &ids[i0..i1];
        macro_rules! rows {
            ($($v:ident),*) => {
                match (dst_s, src_s) {
                    $((CpuStorage::$v(d), CpuStorage::$v(s)) => {
                        copy_rows(&mut d[d0..d1], &s[s0..s1], ids, self.row)
                    })*
                    (d, s) => bail!(
                        "{OP}: dst and src must share a dtype (u8, u32, i64, bf16, f16, f32 or f64), got {:?} and {:?}",
                        d.dtype(),
                        s.dtype()
                    ),
                }
            };
        }
        rows!(U8, U32, I64, BF16, F16, F32, F64);
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dst_s: &mut candle_core::CudaStorage,
        dst_l: &Layout,
        src_s: &candle_core::CudaStorage,
        src_l: &Layout,
        ids_s: &candle_core::CudaStorage,
        ids_l: &Layout,
    ) -> Result<()> {
        cuda::scatter_rows((dst_s, dst_l), (src_s, src_l), (ids_s, ids_l), self.row)
    }
}

/// Writes row `r` of `src [R, ..]` into row `rows[r]` of `dst [S, ..]`, in place; the other rows
/// of `dst` keep their values. `dst` must be contiguous, of `src`'s dtype and device, with its
/// trailing dims; every row of the index below S, and R of them.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use mamba2_kernels::{scatter_rows, RowIndex};
///
/// let dev = Device::Cpu;
/// let dst = Tensor::zeros((4, 2), candle_core::DType::F32, &dev)?;
/// let src = Tensor::new(&[[1f32, 2.0], [3.0, 4.0]], &dev)?;
/// scatter_rows(&dst, &src, &RowIndex::new(&[3, 0], &dev)?)?;
/// assert_eq!(dst.to_vec2::<f32>()?, [[3.0, 4.0], [0.0, 0.0], [0.0, 0.0], [1.0, 2.0]]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn scatter_rows(dst: &Tensor, src: &Tensor, rows: &RowIndex) -> Result<()> {
    check::device(OP, "src", src, dst)?;
    check::device(OP, "the row index", rows.ids(), dst)?;
    if src.dtype() != dst.dtype() {
        bail!(
            "{OP}: src is {:?} but dst is {:?}",
            src.dtype(),
            dst.dtype()
        )
    }
    let (dd, sd) = (dst.dims(), src.dims());
    if dd.is_empty() || sd.len() != dd.len() || sd[1..] != dd[1..] {
        bail!("{OP}: src {sd:?} must be [R, ..] with the trailing dims of dst {dd:?}")
    }
    if sd[0] != rows.len() {
        bail!(
            "{OP}: src has {} rows but the index names {}",
            sd[0],
            rows.len()
        )
    }
    if rows.bound > dd[0] {
        bail!(
            "{OP}: the index names row {} of a dst of {} rows",
            rows.bound - 1,
            dd[0]
        )
    }
    if !dst.is_contiguous() {
        bail!(
            "{OP}: dst must be contiguous, got strides {:?}",
            dst.stride()
        )
    }
    let row: usize = dd[1..].iter().product();
    if rows.is_empty() || row == 0 {
        return Ok(());
    }
    dst.inplace_op3(&src.contiguous()?, rows.ids(), &ScatterRows { row })
}
