//! Launchers of the causal conv1d (prefill and one-token step). The input rows may be a slice of a
//! wider tensor (xBC inside in_proj's output): the kernels take their row stride.

use candle_core::backend::BackendStorage;
use candle_core::{CudaStorage, Layout, Result, Shape, Storage};

use super::{alloc, cfg, dtype_name, function, i, launch, ptr, rows_ptr, Held, CAUSAL_CONV1D};
use crate::causal_conv1d::{CausalConv1d, CausalConv1dStep};

const THREADS: usize = 128;
const TOKENS: usize = 32;

/// Optional tensor → (device address or 0, its lock).
fn optional<'a>(
    op: &str,
    name: &str,
    h: &'a Option<Held<'a>>,
    stream: &'a candle_core::cuda_backend::cudarc::driver::CudaStream,
) -> Result<u64> {
    match h {
        Some(h) => Ok(ptr(op, name, h.cuda(op, name)?, h.layout, stream)?.0),
        None => Ok(0),
    }
}

pub(crate) fn causal_conv1d(
    conv: &CausalConv1d,
    x_s: &CudaStorage,
    x_l: &Layout,
    w_s: &CudaStorage,
    w_l: &Layout,
    st_s: &CudaStorage,
    st_l: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let op = "causal_conv1d";
    let d = conv.dims;
    let dev = &x_s.device;
    let stream = dev.cuda_stream();
    let y = alloc(dev, x_s.dtype(), d.batch * d.seqlen * d.dim)?;
    let st_out = alloc(dev, x_s.dtype(), d.batch * d.dim * d.width)?;
    let bias = conv.bias.as_ref().map(Held::new);
    let (x_p, x_stride, _g1) = rows_ptr(op, "x", x_s, x_l, &stream)?;
    let (w_p, _g2) = ptr(op, "weight", w_s, w_l, &stream)?;
    let (st_p, _g3) = ptr(op, "initial_state", st_s, st_l, &stream)?;
    let bias_p = optional(op, "bias", &bias, &stream)?;
    let y_p = ptr(
        op,
        "y",
        &y,
        &Layout::contiguous(d.batch * d.seqlen * d.dim),
        &stream,
    )?
    .0;
    let so_p = ptr(
        op,
        "state",
        &st_out,
        &Layout::contiguous(d.batch * d.dim * d.width),
        &stream,
    )?
    .0;
    let f = function(
        &stream,
        CAUSAL_CONV1D,
        &format!("causal_conv1d_{}", dtype_name(op, x_s.dtype())?),
    )?;
    let grid = (
        d.dim.div_ceil(THREADS) as u32,
        d.seqlen.div_ceil(TOKENS) as u32,
        d.batch as u32,
    );
    let (b, l, dd, k) = (i(d.batch)?, i(d.seqlen)?, i(d.dim)?, i(d.width)?);
    let silu = conv.silu as i32;
    launch(
        &stream,
        &f,
        cfg(grid, (THREADS as u32, 1, 1), 0),
        &[
            &x_p, &w_p, &bias_p, &st_p, &y_p, &so_p, &b, &l, &dd, &k, &x_stride, &silu,
        ],
    )?;
    conv.state_out.put(op, Storage::Cuda(st_out))?;
    Ok((y, Shape::from((d.batch, d.seqlen, d.dim))))
}

pub(crate) fn causal_conv1d_step(
    step: &CausalConv1dStep,
    st_s: &mut CudaStorage,
    st_l: &Layout,
    x_s: &CudaStorage,
    x_l: &Layout,
) -> Result<CudaStorage> {
    let op = "causal_conv1d_step";
    let d = step.dims;
    let dev = x_s.device.clone();
    let stream = dev.cuda_stream();
    let y = alloc(&dev, x_s.dtype(), d.batch * d.dim)?;
    let (w, bias) = (Held::new(&step.weight), step.bias.as_ref().map(Held::new));
    let (x_p, x_stride, _g1) = rows_ptr(op, "x", x_s, x_l, &stream)?;
    let (w_p, _g2) = ptr(op, "weight", w.cuda(op, "weight")?, w.layout, &stream)?;
    let bias_p = optional(op, "bias", &bias, &stream)?;
    let y_p = ptr(op, "y", &y, &Layout::contiguous(d.batch * d.dim), &stream)?.0;
    let (st_p, _g3) = ptr(op, "state", st_s, st_l, &stream)?;
    let f = function(
        &stream,
        CAUSAL_CONV1D,
        &format!("causal_conv1d_step_{}", dtype_name(op, x_s.dtype())?),
    )?;
    let (b, dd, k) = (i(d.batch)?, i(d.dim)?, i(d.width)?);
    let silu = step.silu as i32;
    launch(
        &stream,
        &f,
        cfg(
            (d.dim.div_ceil(THREADS) as u32, d.batch as u32, 1),
            (THREADS as u32, 1, 1),
            0,
        ),
        &[
            &st_p, &x_p, &w_p, &bias_p, &y_p, &b, &dd, &k, &x_stride, &silu,
        ],
    )?;
    Ok(y)
}
