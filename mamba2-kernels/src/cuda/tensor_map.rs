//! TMA tensor maps (`CUtensorMap`), the descriptors by which the sm_90+ kernels copy tiles with
//! one thread's instruction: encoded by the driver on the host, passed by value as kernel
//! parameters (`m2::TensorMap`), and cached per thread, since encoding one is a driver call on
//! the host path of every launch that uses it.

use std::ffi::c_void;

use candle_core::cuda_backend::cudarc::driver::{sys, DeviceRepr};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, DType, Result};

/// A tensor map as a kernel parameter (`m2::TensorMap`, passed by value).
#[repr(transparent)]
#[derive(Clone, Copy)]
pub(crate) struct TensorMap(sys::CUtensorMap);
// SAFETY: 128 bytes of plain data, 64-byte aligned like the kernels' `m2::TensorMap`.
unsafe impl DeviceRepr for TensorMap {}

/// The tensor map of a 3-D tensor of 2-byte values at `base` (16-byte aligned): `dims`
/// innermost first, the outer dimensions' strides in elements (multiples of 8), boxes of
/// `box_dims` landing with the swizzle of their row bytes (32, 64 or 128).
pub(crate) fn tensor_map_3d(
    base: u64,
    dtype: DType,
    dims: [usize; 3],
    strides: [usize; 2],
    box_dims: [usize; 3],
) -> Result<TensorMap> {
    type Key = (u64, DType, [usize; 3], [usize; 2], [usize; 3]);
    const KEPT: usize = 32;
    thread_local! {
        /// The maps this thread encoded last, keyed by everything the encoding reads (the same
        /// inputs give the same map, so a hit is exact): each encoding is a driver call on the
        /// host path before the first kernel, and buffers come back at the same addresses (the
        /// stream-ordered pool). An `ssd` call uses six maps, so 32 hold those of five calls.
        static MAPS: std::cell::RefCell<Vec<(Key, TensorMap)>> =
            const { std::cell::RefCell::new(Vec::new()) };
    }
    let key = (base, dtype, dims, strides, box_dims);
    if let Some(map) = MAPS.with(|m| m.borrow().iter().find(|(k, _)| *k == key).map(|e| e.1)) {
        return Ok(map);
    }
    let map = encode_map_3d(base, dtype, dims, strides, box_dims)?;
    MAPS.with(|m| {
        let mut m = m.borrow_mut();
        if m.len() == KEPT {
            m.remove(0);
        }
        m.push((key, map));
    });
    Ok(map)
}

/// [`tensor_map_3d`] encoded by the driver.
fn encode_map_3d(
    base: u64,
    dtype: DType,
    dims: [usize; 3],
    strides: [usize; 2],
    box_dims: [usize; 3],
) -> Result<TensorMap> {
    use sys::{
        CUtensorMapDataType as Ty, CUtensorMapFloatOOBfill as Fill,
        CUtensorMapInterleave as Interleave, CUtensorMapL2promotion as L2,
        CUtensorMapSwizzle as Swizzle,
    };
    let ty = match dtype {
        DType::BF16 => Ty::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        DType::F16 => Ty::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        dt => bail!("no tensor map for dtype {dt:?}"),
    };
    let swizzle = match box_dims[0] * 2 {
        32 => Swizzle::CU_TENSOR_MAP_SWIZZLE_32B,
        64 => Swizzle::CU_TENSOR_MAP_SWIZZLE_64B,
        128 => Swizzle::CU_TENSOR_MAP_SWIZZLE_128B,
        b => bail!("tensor map rows of {b} bytes (32, 64 or 128 needed)"),
    };
    let dims = dims.map(|d| d as u64);
    let strides = strides.map(|s| 2 * s as u64);
    let box_dims = box_dims.map(|b| b as u32);
    let unit = [1u32; 3];
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::uninit();
    // SAFETY: the arrays outlive the call and hold rank (dims, box, element strides) or rank − 1
    // (strides) entries; the driver only encodes them into `map`, checking the ranges.
    unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            ty,
            3,
            base as *mut c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            box_dims.as_ptr(),
            unit.as_ptr(),
            Interleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle,
            L2::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            Fill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
        .result()
        .w()?;
        Ok(TensorMap(map.assume_init()))
    }
}

/// The tensor map of a `[batch, seqlen, row]` tensor of 2-byte values at `p` (x, b, c), boxes of
/// `cols` channels by `rows` tokens of one sequence (tokens past its end read as zeros).
pub(crate) fn tokens(
    p: u64,
    dtype: DType,
    [batch, seqlen, row]: [usize; 3],
    cols: usize,
    rows: usize,
) -> Result<TensorMap> {
    tensor_map_3d(
        p,
        dtype,
        [row, seqlen, batch],
        [row, seqlen * row],
        [cols, rows, 1],
    )
}
