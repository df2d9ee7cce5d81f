//! Launchers of the gated RMSNorm (one program per row and group) and of residual add + RMSNorm
//! (one program per row), each row held in registers when it fits. The gate z may be a slice of in_proj's output: its row stride is passed.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CudaStorage, DType, Layout, Result, Shape, Storage};

use super::{
    alloc, cfg, dtype_name, function, i, launch, opt_ptr, ptr, rows_ptr, written, Guards, Held,
    RMS_NORM,
};
use crate::add_rms_norm::AddRmsNorm;
use crate::gated_rms_norm::GatedRmsNorm;

/// Values a thread holds in registers in the `reg` kernels.
const PER_THREAD: usize = 8;

/// Threads per row program and the kernel variant: `vec` (8 consecutive values per thread in
/// registers, 16-byte accesses) when the rows allow it (`aligned`, a length that is a multiple of
/// 8), else `reg` (8 strided values per thread) for rows up to 1024·8 values, `loop` beyond.
fn row_program(len: usize, aligned: bool) -> (u32, &'static str) {
    let threads = (len.div_ceil(PER_THREAD).div_ceil(32) * 32).clamp(32, 1024);
    let kind = match (
        len <= threads * PER_THREAD,
        aligned && len % PER_THREAD == 0,
    ) {
        (true, true) => "vec",
        (true, false) => "reg",
        (false, _) => "loop",
    };
    (threads as u32, kind)
}

/// Whether every address is 16-byte aligned.
fn aligned16(addrs: &[u64]) -> bool {
    addrs.iter().all(|a| a % 16 == 0)
}

pub(crate) fn gated_rms_norm(
    norm: &GatedRmsNorm,
    x_s: &CudaStorage,
    x_l: &Layout,
    z_s: &CudaStorage,
    z_l: &Layout,
    w_s: &CudaStorage,
    w_l: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let op = "gated_rms_norm";
    let dim = w_l.shape().elem_count();
    let rows = x_l.shape().elem_count() / dim;
    let dev = &x_s.device;
    let stream = dev.cuda_stream();
    let mut y = alloc(dev, x_s.dtype(), rows * dim)?;
    let (x_p, _g1) = ptr(op, "x", x_s, x_l, &stream)?;
    let (z_p, z_stride, _g2) = rows_ptr(op, "z", z_s, z_l, &stream)?;
    let (w_p, _g3) = ptr(op, "weight", w_s, w_l, &stream)?;
    let y_p = ptr(op, "y", &y, &Layout::contiguous(rows * dim), &stream)?.0;
    let esize = x_s.dtype().size_in_bytes() as u64;
    let aligned = aligned16(&[
        x_p,
        z_p,
        w_p,
        y_p,
        z_stride as u64 * esize,
        dim as u64 * esize,
    ]);
    let (threads, kind) = row_program(norm.group_size, aligned);
    let f = function(
        &stream,
        RMS_NORM,
        &format!("gated_rms_norm_{}_{kind}", dtype_name(op, x_s.dtype())?),
    )?;
    let (dd, group) = (i(dim)?, i(norm.group_size)?);
    let grid = (rows as u32, (dim / norm.group_size) as u32, 1);
    launch(
        &stream,
        &f,
        cfg(grid, (threads, 1, 1), 0),
        &[&x_p, &z_p, &w_p, &y_p, &dd, &group, &z_stride, &norm.eps],
    )?;
    written(&mut y, &stream)?;
    Ok((y, x_l.shape().clone()))
}

pub(crate) fn add_rms_norm(
    norm: &AddRmsNorm,
    x_s: &CudaStorage,
    x_l: &Layout,
    w_s: &CudaStorage,
    w_l: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let op = "add_rms_norm";
    let dim = w_l.shape().elem_count();
    let rows = x_l.shape().elem_count() / dim;
    let dev = &x_s.device;
    let stream = dev.cuda_stream();
    let mut y = alloc(dev, x_s.dtype(), rows * dim)?;
    let mut res_out = alloc(dev, norm.residual_dtype, rows * dim)?;
    let residual = norm.residual.as_ref().map(Held::new);
    let mut guards = Guards::new();
    let (x_p, _g1) = ptr(op, "x", x_s, x_l, &stream)?;
    let (w_p, _g2) = ptr(op, "weight", w_s, w_l, &stream)?;
    let res_p = opt_ptr(op, "residual", &residual, &stream, &mut guards)?;
    let y_p = ptr(op, "y", &y, &Layout::contiguous(rows * dim), &stream)?.0;
    let ro_p = ptr(
        op,
        "residual",
        &res_out,
        &Layout::contiguous(rows * dim),
        &stream,
    )?
    .0;
    let kind = match norm.residual_dtype {
        DType::F32 => "res_f32",
        dt if dt == x_s.dtype() => "res_same",
        dt => bail!("{op}: residual must be f32 or x's dtype, got {dt:?}"),
    };
    let aligned = aligned16(&[x_p, w_p, y_p, res_p, ro_p]);
    let (threads, variant) = row_program(dim, aligned);
    let f = function(
        &stream,
        RMS_NORM,
        &format!(
            "add_rms_norm_{}_{kind}_{variant}",
            dtype_name(op, x_s.dtype())?
        ),
    )?;
    let dd = i(dim)?;
    launch(
        &stream,
        &f,
        cfg((rows as u32, 1, 1), (threads, 1, 1), 0),
        &[&x_p, &res_p, &w_p, &y_p, &ro_p, &dd, &norm.eps],
    )?;
    written(&mut y, &stream)?;
    written(&mut res_out, &stream)?;
    norm.residual_out.put(op, Storage::Cuda(res_out))?;
    Ok((y, x_l.shape().clone()))
}
