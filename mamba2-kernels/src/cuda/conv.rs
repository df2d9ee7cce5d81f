//! Launchers of the causal conv1d (prefill and one-token step). The input rows may be a slice of a
//! wider tensor (xBC inside in_proj's output): the kernels take their row stride. The output is
//! written as up to three contiguous pieces cut by channels (the mixer's x, B and C).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaStream, DeviceRepr};
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result, Shape, Storage};

use super::{
    alloc, cfg, dtype_name, function, i, launch, opt_ptr, ptr, rows_ptr, written, Guards, Held,
    CAUSAL_CONV1D,
};
use crate::causal_conv1d::{CausalConv1d, CausalConv1dStep};

const THREADS: usize = 128;
const TOKENS: usize = 32;

/// The output pieces as the kernels read them: up to three buffers cut at s0 and s0 + s1.
#[repr(C)]
#[derive(Clone, Copy)]
struct Out {
    y0: u64,
    y1: u64,
    y2: u64,
    s0: i32,
    s1: i32,
}
// SAFETY: plain old data laid out as the kernels' `Out` struct.
unsafe impl DeviceRepr for Out {}

/// Allocates the pieces of `rows` rows cut by `split`, and their kernel descriptor.
fn pieces(
    op: &str,
    dev: &CudaDevice,
    stream: &CudaStream,
    dtype: DType,
    rows: usize,
    split: &[usize],
) -> Result<(Vec<CudaStorage>, Out)> {
    let bufs = split
        .iter()
        .map(|&w| alloc(dev, dtype, rows * w))
        .collect::<Result<Vec<_>>>()?;
    let mut p = [0u64; 3];
    for (k, (b, &w)) in bufs.iter().zip(split).enumerate() {
        p[k] = ptr(op, "output", b, &Layout::contiguous(rows * w), stream)?.0;
    }
    let s1 = split.get(1).copied().unwrap_or(0);
    let out = Out {
        y0: p[0],
        y1: p[1],
        y2: p[2],
        s0: i(split[0])?,
        s1: i(s1)?,
    };
    Ok((bufs, out))
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
    let (mut ys, out) = pieces(
        op,
        dev,
        &stream,
        x_s.dtype(),
        d.batch * d.seqlen,
        &conv.split,
    )?;
    let state_len = d.batch * d.dim * d.width;
    let mut st_out = alloc(dev, x_s.dtype(), state_len)?;
    let bias = conv.bias.as_ref().map(Held::new);
    let mut guards = Guards::new();
    let (x_p, x_stride, _g1) = rows_ptr(op, "x", x_s, x_l, &stream)?;
    let (w_p, _g2) = ptr(op, "weight", w_s, w_l, &stream)?;
    let (st_p, _g3) = ptr(op, "initial_state", st_s, st_l, &stream)?;
    let bias_p = opt_ptr(op, "bias", &bias, &stream, &mut guards)?;
    let so_p = ptr(
        op,
        "state",
        &st_out,
        &Layout::contiguous(state_len),
        &stream,
    )?
    .0;
    let name = format!("causal_conv1d_{}", dtype_name(op, x_s.dtype())?);
    let f = function(&stream, CAUSAL_CONV1D, &name)?;
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
            &x_p, &w_p, &bias_p, &st_p, &out, &so_p, &b, &l, &dd, &k, &x_stride, &silu,
        ],
    )?;
    written(&mut st_out, &stream)?;
    for y in ys.iter_mut() {
        written(y, &stream)?;
    }
    conv.state_out.put(op, Storage::Cuda(st_out))?;
    let rest = ys.split_off(1);
    for (slot, y) in conv.rest.iter().zip(rest) {
        slot.put(op, Storage::Cuda(y))?;
    }
    match ys.pop() {
        Some(y) => Ok((y, Shape::from((d.batch, d.seqlen, conv.split[0])))),
        None => bail!("{op}: no output"),
    }
}

pub(crate) fn causal_conv1d_step(
    step: &CausalConv1dStep,
    st_s: &mut CudaStorage,
    st_l: &Layout,
    x_s: &CudaStorage,
    x_l: &Layout,
) -> Result<()> {
    let op = "causal_conv1d_step";
    let d = step.dims;
    let dev = x_s.device.clone();
    let stream = dev.cuda_stream();
    let (mut ys, out) = pieces(op, &dev, &stream, x_s.dtype(), d.batch, &step.split)?;
    let (w, bias) = (Held::new(&step.weight), step.bias.as_ref().map(Held::new));
    let mut guards = Guards::new();
    let (x_p, x_stride, _g1) = rows_ptr(op, "x", x_s, x_l, &stream)?;
    let w_p = w.ptr(op, "weight", &stream, &mut guards)?;
    let bias_p = opt_ptr(op, "bias", &bias, &stream, &mut guards)?;
    let (st_p, g3) = ptr(op, "state", st_s, st_l, &stream)?;
    let name = format!("causal_conv1d_step_{}", dtype_name(op, x_s.dtype())?);
    let f = function(&stream, CAUSAL_CONV1D, &name)?;
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
            &st_p, &x_p, &w_p, &bias_p, &out, &b, &dd, &k, &x_stride, &silu,
        ],
    )?;
    drop(g3);
    written(st_s, &stream)?;
    for y in ys.iter_mut() {
        written(y, &stream)?;
    }
    for (slot, y) in step.pieces.iter().zip(ys) {
        slot.put(op, Storage::Cuda(y))?;
    }
    Ok(())
}
