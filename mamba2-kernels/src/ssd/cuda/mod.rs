//! The SSD on CUDA: the stage ops' entry points, and [`ssd`], which queues the kernels of all
//! three stages itself (no candle op between them) with stage 1's step sizes and the chunk states
//! in the stream's scratch buffer. One launcher per `.cu` file of `kernels/ssd/`:
//! [`chunk_cumsum`](mod@chunk_cumsum), [`fwd_pass_state`](mod@fwd_pass_state) (the state pass)
//! and [`compute_out`](mod@compute_out); their parameters in [`params`].

mod chunk_cumsum;
mod compute_out;
mod fwd_pass_state;
mod params;
#[cfg(feature = "timeline")]
pub(super) mod timeline;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CudaStorage, DType, Layout, Result, Shape, Tensor};

use self::compute_out::{out_pass, OutPtrs};
use self::fwd_pass_state::{state_pass, PassPtrs, RawSteps};
use self::params::{SsdParams, SsdSteps};
use crate::check::SsdDims;
use crate::cuda::{alloc, opt_ptr, ptr, rows_ptr, scratch, ty, written, Guards, Held};
use crate::dt::DtRule;

/// A candle argument of an op: its storage and layout.
pub(crate) type Input<'a> = (&'a CudaStorage, &'a Layout);

/// The `chunk_cumsum` op: `[dt_out; da_cumsum]` `[2,B,H,L]` f32 from `dt [B,L,H]` (rows possibly
/// spaced) and `a [H]`.
pub(super) fn chunk_cumsum(
    (dt_s, dt_l): Input,
    (a_s, a_l): Input,
    bias: Option<&Tensor>,
    rule: DtRule,
    chunk: usize,
) -> Result<(CudaStorage, Shape)> {
    let name = "chunk_cumsum";
    let (batch, seqlen, nheads) = dt_l.shape().dims3()?;
    let dev = &dt_s.device;
    let stream = dev.cuda_stream();
    let len = 2 * batch * nheads * seqlen;
    let mut out = alloc(dev, DType::F32, len)?;
    let bias = bias.map(Held::new);
    let mut guards = Guards::new();
    let (a, _g1) = ptr(name, "a", a_s, a_l, &stream)?;
    let (dt, dt_stride, _g2) = rows_ptr(name, "dt", dt_s, dt_l, &stream)?;
    let bias_p = opt_ptr(name, "dt_bias", &bias, &stream, &mut guards)?;
    let out_p = ptr(name, "out", &out, &Layout::contiguous(len), &stream)?.0;
    let steps = SsdSteps::new(rule, (dt, dt_stride), a, bias_p, out_p);
    let p = SsdParams::stage1(batch, seqlen, nheads, chunk)?;
    chunk_cumsum::launch_stage1(&p, &steps, ty(name, dt_s.dtype())?, &stream)?;
    written(&mut out, &stream)?;
    Ok((out, Shape::from((2, batch, nheads, seqlen))))
}

/// The `fwd_pass_state` op's inputs: its arguments x, b and dt_out, and what it holds.
pub(crate) struct StatePass<'a> {
    pub x: Input<'a>,
    pub b: Input<'a>,
    pub dt_out: Input<'a>,
    pub da_cumsum: &'a Tensor,
    pub init: Option<&'a Tensor>,
    pub dims: SsdDims,
    pub chunk_size: usize,
    pub state_dtype: DType,
}

/// The `fwd_pass_state` op: the chunk states `[B,H,C+1,P,N]`.
pub(super) fn fwd_pass_state(op: &StatePass) -> Result<(CudaStorage, Shape)> {
    let name = "fwd_pass_state";
    let (d, chunk) = (op.dims, op.chunk_size);
    let ((x_s, x_l), (b_s, b_l), (dt_s, dt_l)) = (op.x, op.b, op.dt_out);
    let dev = &x_s.device;
    let stream = dev.cuda_stream();
    let total = d.chunk_states_len(chunk);
    let mut out = alloc(dev, op.state_dtype, total)?;
    let (init, da) = (op.init.map(Held::new), Held::new(op.da_cumsum));
    let mut guards = Guards::new();
    let (x, _g1) = ptr(name, "x", x_s, x_l, &stream)?;
    let (b, _g2) = ptr(name, "b", b_s, b_l, &stream)?;
    let (dt, _g3) = ptr(name, "dt_out", dt_s, dt_l, &stream)?;
    let p = PassPtrs {
        x,
        b,
        init: opt_ptr(name, "init_state", &init, &stream, &mut guards)?,
        states: ptr(name, "states", &out, &Layout::contiguous(total), &stream)?.0,
        dt,
        da: da.ptr(name, "da_cumsum", &stream, &mut guards)?,
    };
    let types = (x_s.dtype(), op.state_dtype);
    state_pass(&d, chunk, types, &p, None, &stream, || Ok(0))?;
    written(&mut out, &stream)?;
    let shape = (d.batch, d.nheads, d.nchunks(chunk) + 1, d.headdim, d.dstate);
    Ok((out, Shape::from(shape)))
}

/// The `compute_out` op's inputs: its arguments x, c and the chunk states, and what it holds.
pub(crate) struct OutPass<'a> {
    pub x: Input<'a>,
    pub c: Input<'a>,
    pub states: Input<'a>,
    pub b: &'a Tensor,
    pub dt_out: &'a Tensor,
    pub da_cumsum: &'a Tensor,
    pub d: Option<&'a Tensor>,
    pub z: Option<&'a Tensor>,
    pub dims: SsdDims,
    pub chunk_size: usize,
}

/// The `compute_out` op: `y [B,L,H,P]`.
pub(super) fn compute_out(op: &OutPass) -> Result<(CudaStorage, Shape)> {
    let name = "compute_out";
    let d = op.dims;
    let ((x_s, x_l), (c_s, c_l), (st_s, st_l)) = (op.x, op.c, op.states);
    let dev = &x_s.device;
    let stream = dev.cuda_stream();
    let total = d.batch * d.seqlen * d.nheads * d.headdim;
    let mut out = alloc(dev, x_s.dtype(), total)?;
    let (b, dt, da) = (
        Held::new(op.b),
        Held::new(op.dt_out),
        Held::new(op.da_cumsum),
    );
    let (dskip, z) = (op.d.map(Held::new), op.z.map(Held::new));
    let mut guards = Guards::new();
    let (x, _g1) = ptr(name, "x", x_s, x_l, &stream)?;
    let (c, _g2) = ptr(name, "c", c_s, c_l, &stream)?;
    let (states, _g3) = ptr(name, "states", st_s, st_l, &stream)?;
    let p = OutPtrs {
        x,
        b: b.ptr(name, "b", &stream, &mut guards)?,
        c,
        dt: dt.ptr(name, "dt_out", &stream, &mut guards)?,
        da: da.ptr(name, "da_cumsum", &stream, &mut guards)?,
        states,
        d: opt_ptr(name, "D", &dskip, &stream, &mut guards)?,
        z: opt_ptr(name, "z", &z, &stream, &mut guards)?,
        y: ptr(name, "y", &out, &Layout::contiguous(total), &stream)?.0,
    };
    let d_per_channel = op.d.is_some_and(|t| t.rank() == 2);
    let types = (x_s.dtype(), st_s.dtype());
    out_pass(&d, op.chunk_size, types, &p, d_per_channel, false, &stream)?;
    written(&mut out, &stream)?;
    Ok((out, Shape::from((d.batch, d.seqlen, d.nheads, d.headdim))))
}

/// The `ssd` op's inputs: its arguments x, b and c, and what it holds (every tensor contiguous,
/// `dt`: its rows; `init` in the state dtype).
pub(crate) struct Fused<'a> {
    pub x: Input<'a>,
    pub b: Input<'a>,
    pub c: Input<'a>,
    pub dt: &'a Tensor,
    pub a: &'a Tensor,
    pub dt_bias: Option<&'a Tensor>,
    pub d: Option<&'a Tensor>,
    pub z: Option<&'a Tensor>,
    pub init: Option<&'a Tensor>,
    pub rule: DtRule,
    pub dims: SsdDims,
    pub chunk_size: usize,
    pub state_dtype: DType,
}

/// The `ssd` op: the state pass and compute_out launched back to back from here, stage 1's step
/// sizes and the chunk states in the stream's scratch buffer ([`scratch`]), y and the final state
/// allocated once the first kernel is on its way. For calls whose intermediates fit that buffer
/// nothing is allocated before the first launch. Returns `(y, final state)`.
pub(super) fn ssd(op: &Fused) -> Result<(CudaStorage, CudaStorage)> {
    let name = "ssd";
    let (d, chunk) = (op.dims, op.chunk_size);
    let ((x_s, x_l), (b_s, b_l), (c_s, c_l)) = (op.x, op.b, op.c);
    let (dt, a, bias) = (Held::new(op.dt), Held::new(op.a), op.dt_bias.map(Held::new));
    let (dskip, z, init) = (
        op.d.map(Held::new),
        op.z.map(Held::new),
        op.init.map(Held::new),
    );
    let dev = &x_s.device;
    let stream = dev.cuda_stream();
    let (vt, st) = (x_s.dtype(), op.state_dtype);
    let bhl = d.batch * d.nheads * d.seqlen;
    // [chunk states | dt_out | da_cumsum], each part 256-byte aligned.
    let states_bytes = (d.chunk_states_len(chunk) * st.size_in_bytes()).next_multiple_of(256);
    let scratch = scratch::take(&stream, states_bytes + 8 * bhl)?;
    let states = scratch.ptr();
    let steps = states + states_bytes as u64;
    let dt_s = dt.cuda(name, "dt")?;
    // The inputs' read events are recorded once every kernel is launched (the guards' drop).
    let mut guards = Guards::new();
    let (dt_raw, dt_stride, g) = rows_ptr(name, "dt", dt_s, dt.layout, &stream)?;
    guards.push(g);
    let (x_p, g) = ptr(name, "x", x_s, x_l, &stream)?;
    guards.push(g);
    let (b_p, g) = ptr(name, "b", b_s, b_l, &stream)?;
    guards.push(g);
    let raw = RawSteps {
        steps: SsdSteps::new(
            op.rule,
            (dt_raw, dt_stride),
            a.ptr(name, "a", &stream, &mut guards)?,
            opt_ptr(name, "dt_bias", &bias, &stream, &mut guards)?,
            steps,
        ),
        dtype: dt_s.dtype(),
    };
    let p = PassPtrs {
        x: x_p,
        b: b_p,
        init: opt_ptr(name, "initial_state", &init, &stream, &mut guards)?,
        states,
        dt: steps,
        da: steps + 4 * bhl as u64,
    };
    let pn = d.batch * d.nheads * d.headdim * d.dstate;
    let total = d.batch * d.seqlen * d.nheads * d.headdim;
    let mut outs = None;
    state_pass(&d, chunk, (vt, st), &p, Some(&raw), &stream, || {
        let last = alloc(dev, st, pn)?;
        let y = alloc(dev, vt, total)?;
        let last_p = ptr(name, "final_state", &last, &Layout::contiguous(pn), &stream)?.0;
        outs = Some((last, y));
        Ok(last_p)
    })?;
    let Some((mut last, mut y)) = outs else {
        bail!("{name}: the state pass allocated no outputs")
    };
    let (c_p, g) = ptr(name, "c", c_s, c_l, &stream)?;
    guards.push(g);
    let o = OutPtrs {
        x: p.x,
        b: p.b,
        c: c_p,
        dt: p.dt,
        da: p.da,
        states,
        d: opt_ptr(name, "D", &dskip, &stream, &mut guards)?,
        z: opt_ptr(name, "z", &z, &stream, &mut guards)?,
        y: ptr(name, "y", &y, &Layout::contiguous(total), &stream)?.0,
    };
    let d_per_channel = op.d.is_some_and(|t| t.rank() == 2);
    out_pass(&d, chunk, (vt, st), &o, d_per_channel, true, &stream)?;
    drop(guards);
    written(&mut y, &stream)?;
    written(&mut last, &stream)?;
    Ok((y, last))
}
