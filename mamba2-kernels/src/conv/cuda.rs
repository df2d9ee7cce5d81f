//! Launchers of `kernels/conv/causal_conv1d.cu` (prefill, one-token step and the prefill's
//! backward). The input rows may be a slice of a wider tensor (xBC inside in_proj's output): the
//! kernels take their row stride. The output is written as up to three contiguous pieces cut by
//! channels (the mixer's x, B and C). The backward gives dx and one row of f32 partial sums of
//! dweight and dbias per program, spans of tokens as `plan` cuts them.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaStream, DeviceRepr};
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result, Tensor};

use super::plan;
use crate::check::ConvDims;
use crate::cuda::{alloc, cfg, fatbin, function, i, launch, m2_layout, opt_ptr, ptr, rows_ptr};
use crate::cuda::{sm_count, ty, written, Dest, Guards, Held, Image};
use crate::instances;

const IMAGE: Image = fatbin!("conv_causal_conv1d");
const THREADS: usize = 128;
/// Tokens per thread of the prefill kernel (its `TOKENS`).
const TOKENS: usize = 32;

/// `m2::ConvParams` (`kernels/conv/params.cuh`): the output pieces (cut at s0 and s0 + s1), the
/// token-row stride of x, the dimensions, SiLU.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct ConvParams {
    y0: u64,
    y1: u64,
    y2: u64,
    x_stride: i64,
    s0: i32,
    s1: i32,
    batch: i32,
    seqlen: i32,
    dim: i32,
    width: i32,
    silu: i32,
    seqs: i32,
    cu: u64,
}
m2_layout!(ConvParams, 72, {
    y0: 0, y1: 8, y2: 16, x_stride: 24, s0: 32, s1: 36, batch: 40, seqlen: 44, dim: 48,
    width: 52, silu: 56, seqs: 60, cu: 64,
});
// SAFETY: plain old data with the C struct's layout (asserted above).
unsafe impl DeviceRepr for ConvParams {}

/// `m2::ConvBwdParams` (`kernels/conv/params.cuh`): the token-row stride of x, dy's second and
/// third pieces, the dimensions, the tokens per program, SiLU, the pieces' channel counts, the
/// token-row stride of dx.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct ConvBwdParams {
    x_stride: i64,
    dy1: u64,
    dy2: u64,
    batch: i32,
    seqlen: i32,
    dim: i32,
    width: i32,
    span: i32,
    silu: i32,
    s0: i32,
    s1: i32,
    dx_stride: i64,
}
m2_layout!(ConvBwdParams, 64, {
    x_stride: 0, dy1: 8, dy2: 16, batch: 24, seqlen: 28, dim: 32, width: 36, span: 40,
    silu: 44, s0: 48, s1: 52, dx_stride: 56,
});
// SAFETY: plain old data with the C struct's layout (asserted above).
unsafe impl DeviceRepr for ConvBwdParams {}

/// What a conv op holds besides its arguments: SiLU, dimensions and the channel counts of the
/// output pieces.
pub(super) struct Conv<'a> {
    pub silu: bool,
    pub dims: ConvDims,
    pub split: &'a [usize],
    /// Sequences packed along L of the one row: their count and offsets `[seqs + 1]` (i32).
    pub packed: Option<(usize, Input<'a>)>,
}

impl Conv<'_> {
    /// Allocates the output pieces of `rows` rows and fills in the parameters (`x_stride`: the
    /// token-row stride of x).
    fn outputs(
        &self,
        dev: &CudaDevice,
        stream: &CudaStream,
        dtype: DType,
        rows: usize,
        x_stride: i64,
    ) -> Result<(Vec<CudaStorage>, ConvParams)> {
        let op = "causal_conv1d";
        let bufs = self
            .split
            .iter()
            .map(|&w| alloc(dev, dtype, rows * w))
            .collect::<Result<Vec<_>>>()?;
        let mut p = [0u64; 3];
        for (k, (b, &w)) in bufs.iter().zip(self.split).enumerate() {
            p[k] = ptr(op, "output", b, &Layout::contiguous(rows * w), stream)?.0;
        }
        let d = self.dims;
        let params = ConvParams {
            y0: p[0],
            y1: p[1],
            y2: p[2],
            x_stride,
            s0: i(self.split[0])?,
            s1: i(self.split.get(1).copied().unwrap_or(0))?,
            batch: i(d.batch)?,
            seqlen: i(d.seqlen)?,
            dim: i(d.dim)?,
            width: i(d.width)?,
            silu: self.silu as i32,
            seqs: 0,
            cu: 0,
        };
        Ok((bufs, params))
    }
}

/// A storage and its layout.
pub(super) type Input<'a> = (&'a CudaStorage, &'a Layout);

/// The prefill conv with the optional bias: returns the output pieces `[B·L, split[k]]` and the
/// new state `[B,D,K]` (packed: `[S,D,K]`, one per sequence).
pub(super) fn causal_conv1d(
    conv: &Conv,
    (x_s, x_l): Input,
    (w_s, w_l): Input,
    bias: Option<Input>,
    (st_s, st_l): Input,
) -> Result<(Vec<CudaStorage>, CudaStorage)> {
    let op = "causal_conv1d";
    let d = conv.dims;
    let dev = &x_s.device;
    let stream = dev.cuda_stream();
    let (x_p, x_stride, _g1) = rows_ptr(op, "x", x_s, x_l, &stream)?;
    let rows = d.batch * d.seqlen;
    let (mut ys, mut params) = conv.outputs(dev, &stream, x_s.dtype(), rows, x_stride)?;
    let mut _g0 = None;
    let states = match conv.packed {
        Some((seqs, (cu_s, cu_l))) => {
            let (p, g) = ptr(op, "cu_seqlens", cu_s, cu_l, &stream)?;
            (params.seqs, params.cu, _g0) = (i(seqs)?, p, Some(g));
            seqs
        }
        None => d.batch,
    };
    let state_len = states * d.dim * d.width;
    let mut st_out = alloc(dev, x_s.dtype(), state_len)?;
    let (w_p, _g2) = ptr(op, "weight", w_s, w_l, &stream)?;
    let (st_p, _g3) = ptr(op, "initial_state", st_s, st_l, &stream)?;
    let (bias_p, _g4) = match bias {
        Some((b_s, b_l)) => {
            let (p, g) = ptr(op, "bias", b_s, b_l, &stream)?;
            (p, Some(g))
        }
        None => (0, None),
    };
    let so_p = ptr(
        op,
        "state",
        &st_out,
        &Layout::contiguous(state_len),
        &stream,
    )?
    .0;
    let t = ty(op, x_s.dtype())?;
    let x_step = usize::try_from(x_stride).unwrap_or(1);
    let addrs = [x_p, params.y0, params.y1, params.y2];
    let shape = (d.dim, conv.split, x_step);
    let lanes = plan::lanes(&instances::CONV_LANES, t.bytes(), d.width, shape, &addrs);
    let kernel = match lanes {
        1 => instances::causal_conv1d(t),
        n => instances::causal_conv1d_lanes(t, n),
    };
    let f = function(&stream, IMAGE, &kernel)?;
    let grid = [
        (d.dim / lanes).div_ceil(THREADS),
        d.seqlen.div_ceil(TOKENS),
        d.batch,
    ];
    launch(
        &stream,
        &f,
        cfg(op, &stream, grid, [THREADS, 1, 1], 0)?,
        &[&x_p, &w_p, &bias_p, &st_p, &so_p, &params],
    )?;
    written(&mut st_out, &stream)?;
    for y in ys.iter_mut() {
        written(y, &stream)?;
    }
    Ok((ys, st_out))
}

/// The decode conv with `weight [D,K]` and the optional bias, in place on the state: returns the
/// output pieces `[B, split[k]]`.
pub(super) fn causal_conv1d_step(
    conv: &Conv,
    weight: &Tensor,
    bias: Option<&Tensor>,
    (st_s, st_l): (&mut CudaStorage, &Layout),
    (x_s, x_l): Input,
) -> Result<Vec<CudaStorage>> {
    let op = "causal_conv1d_step";
    let d = conv.dims;
    let dev = x_s.device.clone();
    let stream = dev.cuda_stream();
    let (x_p, x_stride, _g1) = rows_ptr(op, "x", x_s, x_l, &stream)?;
    let (mut ys, params) = conv.outputs(&dev, &stream, x_s.dtype(), d.batch, x_stride)?;
    let (w, bias) = (Held::new(weight), bias.map(Held::new));
    let mut guards = Guards::new();
    let w_p = w.ptr(op, "weight", &stream, &mut guards)?;
    let bias_p = opt_ptr(op, "bias", &bias, &stream, &mut guards)?;
    let (st_p, g3) = ptr(op, "state", st_s, st_l, &stream)?;
    let f = function(
        &stream,
        IMAGE,
        &instances::causal_conv1d_step(ty(op, x_s.dtype())?),
    )?;
    launch(
        &stream,
        &f,
        cfg(
            op,
            &stream,
            [d.dim.div_ceil(THREADS), d.batch, 1],
            [THREADS, 1, 1],
            0,
        )?,
        &[&st_p, &x_p, &w_p, &bias_p, &params],
    )?;
    drop(g3);
    written(st_s, &stream)?;
    for y in ys.iter_mut() {
        written(y, &stream)?;
    }
    Ok(ys)
}

/// The backward of the prefill conv: `dx [B·L, D]` contiguous (unless written elsewhere), and
/// the partial sums of the parameter gradients, one f32 row `[K+1, D]` per program (dweight
/// tap-major, then dbias), with their row count.
pub(super) struct ConvGrads {
    pub dx: Option<CudaStorage>,
    pub parts: CudaStorage,
    pub programs: usize,
}

/// The prefill conv's backward for the output gradient `dy`, given as 1 to 3 contiguous pieces
/// `[B·L, split[k]]` cut by channels (the forward's output pieces), from the forward's x,
/// weight, bias and initial state (see `kernels/conv/causal_conv1d.cu`); dx goes to `dx_into`
/// when given (the result's dx is then `None`).
pub(super) fn causal_conv1d_bwd(
    (silu, d): (bool, ConvDims),
    (x_s, x_l): Input,
    (w_s, w_l): Input,
    bias: Option<Input>,
    (st_s, st_l): Input,
    (dy, split): (&[Input], &[usize]),
    dx_into: Option<Dest>,
) -> Result<ConvGrads> {
    let op = "causal_conv1d backward";
    let dtype = x_s.dtype();
    if dy.is_empty() || dy.len() > 3 || dy.len() != split.len() {
        bail!(
            "{op}: {} output gradient pieces for {} channel counts",
            dy.len(),
            split.len()
        )
    }
    let others = [("weight", w_s), ("initial_state", st_s)];
    let pieces = dy.iter().map(|(s, _)| ("output gradient", *s));
    for (name, s) in others
        .into_iter()
        .chain(pieces)
        .chain(bias.map(|(b, _)| ("bias", b)))
    {
        if s.dtype() != dtype {
            bail!("{op}: {name} is {:?}, x is {dtype:?}", s.dtype())
        }
    }
    let dev = &x_s.device;
    let stream = dev.cuda_stream();
    let (x_p, x_stride, _g1) = rows_ptr(op, "x", x_s, x_l, &stream)?;
    let mut guards = Vec::with_capacity(3);
    let mut dy_p = [0u64; 3];
    for (k, &(s, l)) in dy.iter().enumerate() {
        let (p, g) = ptr(op, "output gradient", s, l, &stream)?;
        dy_p[k] = p;
        guards.push(g);
    }
    let t = ty(op, dtype)?;
    let x_step = usize::try_from(x_stride).unwrap_or(1);
    let rows = d.batch * d.seqlen;
    let mut dx = match dx_into {
        Some(_) => None,
        None => Some(alloc(dev, dtype, rows * d.dim)?),
    };
    let (dx_p, dx_stride) = match (&dx, dx_into) {
        (_, Some((p, stride))) => (p, stride),
        (Some(s), None) => {
            let out = Layout::contiguous(rows * d.dim);
            (ptr(op, "dx", s, &out, &stream)?.0, d.dim as i64)
        }
        (None, None) => bail!("{op}: no dx"),
    };
    let mut addrs = vec![x_p, dx_p];
    addrs.extend_from_slice(&dy_p[..dy.len()]);
    let steps = usize::try_from(dx_stride).map_or(1, |s| gcd(s, x_step));
    let shape = (d.dim, split, steps);
    let lanes = plan::lanes(
        &instances::CONV_BWD_LANES,
        t.bytes(),
        d.width,
        shape,
        &addrs,
    );
    let columns = d.dim / lanes;
    let threads = plan::threads(columns);
    let span = plan::span(d.batch, d.seqlen, columns, sm_count(&stream)?);
    // Token indices run up to L + K − 1 + span inside the kernel.
    i(d.seqlen + d.width + span)?;
    let spans = d.seqlen.div_ceil(span);
    let programs = d.batch * spans;
    let parts_len = programs * (d.width + 1) * d.dim;
    let mut parts = alloc(dev, DType::F32, parts_len)?;
    let (w_p, _g2) = ptr(op, "weight", w_s, w_l, &stream)?;
    let (bias_p, _g3) = match bias {
        Some((b_s, b_l)) => {
            let (p, g) = ptr(op, "bias", b_s, b_l, &stream)?;
            (p, Some(g))
        }
        None => (0, None),
    };
    let (st_p, _g4) = ptr(op, "initial_state", st_s, st_l, &stream)?;
    let parts_p = ptr(
        op,
        "partial sums",
        &parts,
        &Layout::contiguous(parts_len),
        &stream,
    )?
    .0;
    let params = ConvBwdParams {
        x_stride,
        dy1: dy_p[1],
        dy2: dy_p[2],
        batch: i(d.batch)?,
        seqlen: i(d.seqlen)?,
        dim: i(d.dim)?,
        width: i(d.width)?,
        span: i(span)?,
        silu: silu as i32,
        s0: i(split[0])?,
        s1: i(split.get(1).copied().unwrap_or(0))?,
        dx_stride,
    };
    let kernel = match lanes {
        1 => instances::causal_conv1d_bwd(t, plan::taps(d.width)),
        n => instances::causal_conv1d_bwd_lanes(t, n),
    };
    let f = function(&stream, IMAGE, &kernel)?;
    let grid = [columns.div_ceil(threads), spans, d.batch];
    launch(
        &stream,
        &f,
        cfg(op, &stream, grid, [threads, 1, 1], 0)?,
        &[
            &x_p, &dy_p[0], &w_p, &bias_p, &st_p, &dx_p, &parts_p, &params,
        ],
    )?;
    drop(guards);
    if let Some(s) = dx.as_mut() {
        written(s, &stream)?;
    }
    written(&mut parts, &stream)?;
    Ok(ConvGrads {
        dx,
        parts,
        programs,
    })
}

/// The greatest common divisor: the alignment two row strides share.
fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}
