//! Launchers of `kernels/loss/cross_entropy.cu`: each row's NLL (the forward) and the logits'
//! gradient from per-row output gradients (the backward), one program of 256 threads per row.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CudaStorage, DType, Layout, Result};

use crate::cuda::{alloc, cfg, fatbin, function, i, launch, ptr, ty, written, Image};
use crate::instances;

const IMAGE: Image = fatbin!("loss_cross_entropy");
const THREADS: usize = 256;

type Input<'a> = (&'a CudaStorage, &'a Layout);

/// The kernels' suffix for the ids' dtype.
fn ids_name(op: &str, dtype: DType) -> Result<&'static str> {
    Ok(match dtype {
        DType::U32 => "u32",
        DType::I64 => "i64",
        dt => bail!("{op}: targets must be u32 or i64 here, got {dt:?}"),
    })
}

/// (rows, V, whether rows can be moved 16 bytes at a time) of contiguous `[R, V]` logits at
/// address `p`.
fn rows_of(l: &Layout, dtype: DType, p: u64) -> Result<(usize, usize, i32)> {
    let &[rows, vocab] = l.dims() else {
        bail!("cross_entropy: logits must be [R, V], got {:?}", l.dims())
    };
    let vec = (vocab * dtype.size_in_bytes()) % 16 == 0 && p % 16 == 0;
    Ok((rows, vocab, i32::from(vec)))
}

/// `nll [R]` (f32) of `logits [R, V]` against `targets [R]`: NaN where a target is outside
/// `0..V`.
pub(super) fn nll_rows((x_s, x_l): Input, (t_s, t_l): Input) -> Result<CudaStorage> {
    let op = "cross_entropy";
    let dev = &x_s.device;
    let stream = dev.cuda_stream();
    let (x_p, _g1) = ptr(op, "logits", x_s, x_l, &stream)?;
    let (t_p, _g2) = ptr(op, "targets", t_s, t_l, &stream)?;
    let (rows, vocab, vec) = rows_of(x_l, x_s.dtype(), x_p)?;
    let mut nll = alloc(dev, DType::F32, rows)?;
    let nll_p = ptr(op, "nll", &nll, &Layout::contiguous(rows), &stream)?.0;
    let kernel = instances::nll_rows(ty(op, x_s.dtype())?, ids_name(op, t_s.dtype())?);
    let f = function(&stream, IMAGE, &kernel)?;
    let v = i(vocab)?;
    launch(
        &stream,
        &f,
        cfg(op, &stream, [rows, 1, 1], [THREADS, 1, 1], 0)?,
        &[&x_p, &t_p, &nll_p, &v, &vec],
    )?;
    written(&mut nll, &stream)?;
    Ok(nll)
}

/// `d logits [R, V]` (the logits' dtype) for the output gradient `grad [R]` (f32, contiguous)
/// of [`nll_rows`].
pub(super) fn dlogits(
    (x_s, x_l): Input,
    (t_s, t_l): Input,
    (g_s, g_l): Input,
) -> Result<CudaStorage> {
    let op = "cross_entropy backward";
    if g_s.dtype() != DType::F32 {
        bail!(
            "{op}: the output gradient must be f32, got {:?}",
            g_s.dtype()
        )
    }
    let dev = &x_s.device;
    let stream = dev.cuda_stream();
    let (x_p, _g1) = ptr(op, "logits", x_s, x_l, &stream)?;
    let (t_p, _g2) = ptr(op, "targets", t_s, t_l, &stream)?;
    let (g_p, _g3) = ptr(op, "output gradient", g_s, g_l, &stream)?;
    let (rows, vocab, vec) = rows_of(x_l, x_s.dtype(), x_p)?;
    let mut dx = alloc(dev, x_s.dtype(), rows * vocab)?;
    let dx_p = ptr(
        op,
        "dlogits",
        &dx,
        &Layout::contiguous(rows * vocab),
        &stream,
    )?
    .0;
    let kernel = instances::dlogits(ty(op, x_s.dtype())?, ids_name(op, t_s.dtype())?);
    let f = function(&stream, IMAGE, &kernel)?;
    let v = i(vocab)?;
    launch(
        &stream,
        &f,
        cfg(op, &stream, [rows, 1, 1], [THREADS, 1, 1], 0)?,
        &[&x_p, &t_p, &g_p, &dx_p, &v, &vec],
    )?;
    written(&mut dx, &stream)?;
    Ok(dx)
}
