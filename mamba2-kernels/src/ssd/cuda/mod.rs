//! The SSD on CUDA: the stage ops' entry points, and [`ssd`], which queues the kernels of all
//! three stages itself (no candle op between them) with stage 1's step sizes and the chunk states
//! in the stream's scratch buffer. One launcher per `.cu` file of `kernels/ssd/`:
//! [`chunk_cumsum`](mod@chunk_cumsum), [`fwd_pass_state`](mod@fwd_pass_state) (the state pass)
//! and [`compute_out`](mod@compute_out); their parameters in [`params`]. The backward,
//! [`ssd_backward`], runs stage 1 and the state pass again at chunks of 128 or 64 tokens unless
//! the forward kept them at that chunk, then the backward kernels' launchers:
//! [`bwd_pass_state`](mod@bwd_pass_state), [`bwd_compute_out`](mod@bwd_compute_out), where it
//! runs [`bwd_bc`](mod@bwd_bc) for dB and dC, and [`bwd_chunk_cumsum`](mod@bwd_chunk_cumsum).

mod bwd_bc;
mod bwd_chunk_cumsum;
mod bwd_compute_out;
mod bwd_pass_state;
mod chunk_cumsum;
mod compute_out;
mod fwd_pass_state;
mod params;
#[cfg(feature = "timeline")]
pub(super) mod timeline;

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::CudaStream;
use candle_core::{bail, CudaStorage, DType, Layout, Result, Shape, Tensor};

use self::bwd_bc::launch_bwd_bc;
use self::bwd_chunk_cumsum::{launch_bwd_stage1, HeadSums};
use self::bwd_compute_out::{launch_bwd_out, launch_bwd_round, runs_tma, BwdOutPtrs};
use self::bwd_pass_state::{bwd_state_pass, BwdStatePtrs, TOKENS};
use self::compute_out::{out_pass, After, OutPtrs};
use self::fwd_pass_state::{chunk_state_tile, launch_chunk_state, state_pass, PassPtrs, RawSteps};
use self::params::{PackedPtrs, SsdParams, SsdSteps};
use crate::check::SsdDims;
use crate::cuda::{
    alloc, i, opt_ptr, ptr, rows_ptr, scratch, tensor, ty, written, zeroed, Guards, Held,
};
use crate::dt::DtRule;
use crate::seqs::Seqs;
use crate::ssd::plan::ChunkStateTile;
use crate::ssd::KeptPass;
use crate::DtOptions;

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
        packed: None,
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
        chunk_starts: 0,
    };
    let d_per_channel = op.d.is_some_and(|t| t.rank() == 2);
    let types = (x_s.dtype(), st_s.dtype());
    out_pass(
        &d,
        op.chunk_size,
        types,
        &p,
        d_per_channel,
        After::Any,
        &stream,
    )?;
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
    /// Keep the chunk states and stage 1's step sizes for the backward: the call then runs at the
    /// backward's state chunk ([`state_chunk`]) and allocates them apart from the scratch buffer.
    pub keep: bool,
    /// Sequences packed along L of the one row (`init` and the final states `[S,H,P,N]`): each
    /// sequence's first chunk and each chunk's first token (`dims.chunks` chunks).
    pub packed: Option<(&'a Seqs, &'a Seqs)>,
}

/// What an `ssd` call kept for its backward at `chunk` tokens: the chunk states `[B,H,C+1,P,N]`
/// and stage 1's step sizes `[2,B,H,L]` f32.
pub(crate) struct KeptStates {
    states: CudaStorage,
    steps: CudaStorage,
    chunk: usize,
}

impl KeptStates {
    /// Both as tensors of the call's dimensions `d`.
    pub fn into_tensor(self, d: &SsdDims) -> KeptPass {
        let states = (
            d.batch,
            d.nheads,
            d.nchunks(self.chunk) + 1,
            d.headdim,
            d.dstate,
        );
        KeptPass {
            states: tensor(self.states, states),
            steps: tensor(self.steps, (2, d.batch, d.nheads, d.seqlen)),
            chunk: self.chunk,
        }
    }
}

/// The `ssd` op: the state pass and compute_out launched back to back from here, stage 1's step
/// sizes and the chunk states in the stream's scratch buffer ([`scratch`]), y and the final state
/// allocated once the first kernel is on its way. For calls whose intermediates fit that buffer
/// nothing is allocated before the first launch. Returns `(y, final state)` and, with `keep`, the
/// chunk states.
pub(super) fn ssd(op: &Fused) -> Result<(CudaStorage, CudaStorage, Option<KeptStates>)> {
    let name = "ssd";
    let d = op.dims;
    let ((x_s, x_l), (b_s, b_l), (c_s, c_l)) = (op.x, op.b, op.c);
    let (dt, a, bias) = (Held::new(op.dt), Held::new(op.a), op.dt_bias.map(Held::new));
    let (dskip, z, init) = (
        op.d.map(Held::new),
        op.z.map(Held::new),
        op.init.map(Held::new),
    );
    let tables = match op.packed {
        Some((firsts, starts)) => {
            Some((firsts.count(), table(name, firsts)?, table(name, starts)?))
        }
        None => None,
    };
    let dev = &x_s.device;
    let stream = dev.cuda_stream();
    let (vt, st) = (x_s.dtype(), op.state_dtype);
    let bhl = d.batch * d.nheads * d.seqlen;
    // The inputs' read events are recorded once every kernel is launched (the guards' drop).
    let mut guards = Guards::new();
    let (x_p, g) = ptr(name, "x", x_s, x_l, &stream)?;
    guards.push(g);
    let (b_p, g) = ptr(name, "b", b_s, b_l, &stream)?;
    guards.push(g);
    // The backward's chunk as its chunk terms of dY and C would choose it, x and b standing in
    // for them.
    let chunk = if op.keep {
        let like = PassPtrs {
            x: x_p,
            b: b_p,
            init: 0,
            states: 0,
            dt: 0,
            da: 0,
            packed: None,
        };
        state_chunk(&d, (vt, st), &like, &stream)?.0
    } else {
        op.chunk_size
    };
    let states_len = d.chunk_states_len(chunk);
    // [chunk states | dt_out | da_cumsum], each part 256-byte aligned; kept, both apart.
    let mut kept = if op.keep {
        Some((
            alloc(dev, st, states_len)?,
            alloc(dev, DType::F32, 2 * bhl)?,
        ))
    } else {
        None
    };
    let (_scratch, states, steps) = match &kept {
        Some((s, t)) => (
            None,
            ptr(name, "states", s, &Layout::contiguous(states_len), &stream)?.0,
            ptr(name, "steps", t, &Layout::contiguous(2 * bhl), &stream)?.0,
        ),
        None => {
            let states_bytes = (states_len * st.size_in_bytes()).next_multiple_of(256);
            let scratch = scratch::take(&stream, states_bytes + 8 * bhl)?;
            let at = scratch.ptr();
            (Some(scratch), at, at + states_bytes as u64)
        }
    };
    let dt_s = dt.cuda(name, "dt")?;
    let (dt_raw, dt_stride, g) = rows_ptr(name, "dt", dt_s, dt.layout, &stream)?;
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
    let packed = match &tables {
        Some((seqs, firsts, starts)) => Some(PackedPtrs {
            seqs: *seqs,
            firsts: firsts.ptr(name, "first chunks", &stream, &mut guards)?,
            starts: starts.ptr(name, "chunk starts", &stream, &mut guards)?,
        }),
        None => None,
    };
    let p = PassPtrs {
        x: x_p,
        b: b_p,
        init: opt_ptr(name, "initial_state", &init, &stream, &mut guards)?,
        states,
        dt: steps,
        da: steps + 4 * bhl as u64,
        packed,
    };
    let rows = packed.map_or(d.batch, |q| q.seqs);
    let pn = rows * d.nheads * d.headdim * d.dstate;
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
        chunk_starts: packed.map_or(0, |q| q.starts),
    };
    let d_per_channel = op.d.is_some_and(|t| t.rank() == 2);
    let after = After::StatePass { kept: op.keep };
    out_pass(&d, chunk, (vt, st), &o, d_per_channel, after, &stream)?;
    drop(guards);
    written(&mut y, &stream)?;
    written(&mut last, &stream)?;
    if let Some((s, t)) = &mut kept {
        written(s, &stream)?;
        written(t, &stream)?;
    }
    let kept = kept.map(|(states, steps)| KeptStates {
        states,
        steps,
        chunk,
    });
    Ok((y, last, kept))
}

/// A packed call's chunk table, held on the device.
fn table<'s>(op: &str, seqs: &'s Seqs) -> Result<Held<'s>> {
    match &seqs.device {
        Some(t) => Ok(Held::new(t)),
        None => bail!("{op}: the packed sequences' chunk tables are not on the device"),
    }
}

/// The chunk of the backward's state passes and chunk_state_mma's tile for their chunk terms of
/// dY and C (`terms`): 2·[`TOKENS`] where bwd_compute_out can form the half-way states itself
/// (P ≤ [`TOKENS`]), the states are wide enough for the halved state passes to outweigh that
/// product (N ≥ 128) and chunk_state_mma takes the shape; else [`TOKENS`] (the backward kernels'
/// tiles are sized for it), with the tile where chunk_state_mma takes that chunk.
fn state_chunk(
    d: &SsdDims,
    types: (DType, DType),
    terms: &PassPtrs,
    stream: &Arc<CudaStream>,
) -> Result<(usize, Option<ChunkStateTile>)> {
    if d.headdim <= TOKENS && d.dstate >= 128 {
        if let Some(tile) = chunk_state_tile(d, 2 * TOKENS, types, terms, stream)? {
            return Ok((2 * TOKENS, Some(tile)));
        }
    }
    Ok((TOKENS, chunk_state_tile(d, TOKENS, types, terms, stream)?))
}

/// The backward's inputs: the forward's tensors (x, b and c contiguous in the value type, `init`
/// of any float dtype: it is read only where the chunk states are formed again) and the gradients
/// of y (`dy`, contiguous, the value type) and of the final state (`dlast` f32, `None`: zero).
pub(crate) struct Backward<'a> {
    pub x: &'a Tensor,
    pub b: &'a Tensor,
    pub c: &'a Tensor,
    pub dt: &'a Tensor,
    pub a: &'a Tensor,
    pub dt_opts: DtOptions<'a>,
    pub d: Option<&'a Tensor>,
    pub init: Option<&'a Tensor>,
    pub dy: &'a Tensor,
    pub dlast: Option<&'a Tensor>,
    pub dims: SsdDims,
    pub state_dtype: DType,
    /// What the forward kept (`ssd` with `keep`), used where it is at the backward's chunk,
    /// released once read.
    pub kept: Option<KeptPass>,
}

/// The gradients of [`Backward`]'s inputs: x, b and c (`[B,L,G,N]`) in x's type, raw dt in its
/// type, a and dt_bias `[H]` f32, D in its shape f32, the initial state `[B,H,P,N]` f32.
pub(crate) struct BackwardGrads {
    pub x: Tensor,
    pub b: Tensor,
    pub c: Tensor,
    pub dt: Tensor,
    pub a: Tensor,
    pub bias: Tensor,
    pub d: Option<Tensor>,
    pub init: Option<Tensor>,
}

/// The SSD backward on CUDA. Stage 1 and the chunk states are computed again at the chunk of
/// [`state_chunk`] (the SSD's results do not depend on the chunk) unless the forward kept them at
/// that chunk. Then the state gradients (bwd_pass_state), each chunk's gradients
/// (bwd_compute_out, [`TOKENS`] tokens a program; dB and dC by bwd_bc where it runs) and the dt
/// processing's (bwd_chunk_cumsum).
pub(super) fn ssd_backward(op: Backward) -> Result<BackwardGrads> {
    let name = "ssd backward";
    let d = op.dims;
    let dev = op.x.device().as_cuda_device()?;
    let stream = dev.cuda_stream();
    let (vt, st) = (ty(name, op.x.dtype())?, ty(name, op.state_dtype)?);
    let (bh, pn) = (d.batch * d.nheads, d.headdim * d.dstate);
    let bl = d.batch * d.seqlen;
    let contiguous = |n: usize| Layout::contiguous(n);
    let held = |t: &'_ Tensor| -> Result<Tensor> { t.contiguous() };
    let (x, b, c, dy) = (held(op.x)?, held(op.b)?, held(op.c)?, held(op.dy)?);
    let (hx, hb, hc, hdy) = (Held::new(&x), Held::new(&b), Held::new(&c), Held::new(&dy));
    let mut io_guards = Guards::new();
    let (dy_p, c_p) = (
        hdy.ptr(name, "dy", &stream, &mut io_guards)?,
        hc.ptr(name, "c", &stream, &mut io_guards)?,
    );

    // The chunk terms of dstates by the forward's chunk_state_mma where it takes the shape:
    // U_c = Σ_t exp2(d_t)·dy_t C_tᵀ is its Σ_s exp2(d_last − d_s)·dt_s·x_s B_sᵀ with d_last = 0,
    // −d for d and 1 for dt (its form with dt null).
    let mut terms = PassPtrs {
        x: dy_p,
        b: c_p,
        init: 0,
        states: 0,
        dt: 0,
        da: 0,
        packed: None,
    };
    let types = (op.x.dtype(), op.state_dtype);
    let (chunk, tile) = state_chunk(&d, types, &terms, &stream)?;
    let nch = d.nchunks(chunk);
    let (dt_out, da, states) = match op.kept {
        Some(k) if k.chunk == chunk => {
            let shape = [d.batch, d.nheads, nch + 1, d.headdim, d.dstate];
            let steps = [2, d.batch, d.nheads, d.seqlen];
            let (s, t) = (&k.states, &k.steps);
            if s.dims() != shape || s.dtype() != op.state_dtype {
                bail!(
                    "{name}: the kept chunk states are {:?} {:?}, not {shape:?} {:?}: they come from another call",
                    s.dims(),
                    s.dtype(),
                    op.state_dtype
                )
            }
            if t.dims() != steps || t.dtype() != DType::F32 {
                bail!(
                    "{name}: the kept step sizes are {:?} {:?}, not {steps:?} F32: they come from another call",
                    t.dims(),
                    t.dtype()
                )
            }
            (t.get(0)?, t.get(1)?, k.states)
        }
        // What was kept at another chunk (the forward chose by x's and b's alignment, this by dY's
        // and C's) is released before these are formed.
        other => {
            drop(other);
            let (dt_out, da) = super::stages::chunk_cumsum(op.dt, op.a, &op.dt_opts, chunk)?;
            let init = op
                .init
                .map(|s| s.to_dtype(op.state_dtype)?.contiguous())
                .transpose()?;
            let states = super::stages::fwd_pass_state(
                op.x,
                op.b,
                &dt_out,
                &da,
                init.as_ref(),
                chunk,
                op.state_dtype,
            )?;
            (dt_out, da, states)
        }
    };
    let p = SsdParams::new(&d, chunk)?;
    let (hdt, hda, hstates) = (Held::new(&dt_out), Held::new(&da), Held::new(&states));
    let (ha, hd) = (Held::new(op.a), op.d.map(Held::new));
    let hlast = op.dlast.map(Held::new);
    let (hbias, dt_s) = (op.dt_opts.bias.map(Held::new), Held::new(op.dt));
    let mut guards = Guards::new();

    let slots = bh * (nch + 1) * pn;
    let mut dstates = alloc(dev, op.state_dtype, slots)?;
    let dstates_p = ptr(name, "dstates", &dstates, &contiguous(slots), &stream)?.0;
    terms.states = dstates_p;
    let da_p = hda.ptr(name, "da_cumsum", &stream, &mut guards)?;
    if let Some(tile) = &tile {
        // dt null: the kernel's weights are exp2(d_s), its chunk terms of dstates.
        terms.da = da_p;
        launch_chunk_state(&d, chunk, tile, types, &terms, None, &stream)?;
    }
    let mut dinit = op
        .init
        .map(|_| alloc(dev, DType::F32, bh * pn))
        .transpose()?;
    let q = BwdStatePtrs {
        dy: dy_p,
        c: c_p,
        da: da_p,
        dlast: opt_ptr(name, "final state gradient", &hlast, &stream, &mut guards)?,
        dstates: dstates_p,
        dinit: match &dinit {
            Some(s) => ptr(name, "dinit", s, &contiguous(bh * pn), &stream)?.0,
            None => 0,
        },
    };
    bwd_state_pass(&p, (vt, st), &q, tile.is_none(), &stream)?;

    let gn = d.ngroups * d.dstate;
    let mut dx = alloc(dev, op.x.dtype(), bl * d.nheads * d.headdim)?;
    let mut ddt = alloc(dev, DType::F32, bh * d.seqlen)?;
    let parts = d.nchunks(TOKENS);
    let mut da_part = alloc(dev, DType::F32, bh * parts)?;
    // The sums that start at zero, one buffer: A's gradient [H], dt_bias's [H], D's per channel
    // [H,P] (bwd_compute_out's atomics) and, with D per head, their sums over P [H].
    let (h, pd) = (d.nheads, d.headdim);
    let (dd_len, head_len) = match op.d {
        Some(t) if t.rank() == 2 => (h * pd, 0),
        Some(_) => (h * pd, h),
        None => (0, 0),
    };
    let small_len = 2 * h + dd_len + head_len;
    let mut small = zeroed(dev, DType::F32, small_len)?;
    let small_p = ptr(name, "sums", &small, &contiguous(small_len), &stream)?.0;
    let small_at = |i: usize, len: usize| if len > 0 { small_p + 4 * i as u64 } else { 0 };
    let mut p_out = p;
    p_out.d_per_channel = op.d.is_some_and(|t| t.rank() == 2) as i32;
    let mut q = BwdOutPtrs {
        x: hx.ptr(name, "x", &stream, &mut guards)?,
        dy: q.dy,
        b: hb.ptr(name, "b", &stream, &mut guards)?,
        c: q.c,
        dt: hdt.ptr(name, "dt_out", &stream, &mut guards)?,
        da: q.da,
        states: hstates.ptr(name, "states", &stream, &mut guards)?,
        dstates: q.dstates,
        dskip: opt_ptr(name, "D", &hd, &stream, &mut guards)?,
        a: ha.ptr(name, "a", &stream, &mut guards)?,
        dx: ptr(name, "dx", &dx, &contiguous(bl * h * pd), &stream)?.0,
        db: 0,
        dc: 0,
        ddt: ptr(name, "ddt", &ddt, &contiguous(bh * d.seqlen), &stream)?.0,
        da_part: ptr(name, "da_part", &da_part, &contiguous(bh * parts), &stream)?.0,
        dd: small_at(2 * h, dd_len),
    };
    // dB and dC: by bwd_bc in the value type where it runs, else bwd_compute_out's f32 sums
    // (added by atomics from zero where a group has several heads), rounded below.
    let apart = bwd_bc::takes(&p, (vt, st), runs_tma(&p_out, (vt, st), &q, &stream)?);
    let grad_type = if apart { op.x.dtype() } else { DType::F32 };
    let group_grad = |len| {
        if !apart && d.heads_per_group() > 1 {
            zeroed(dev, grad_type, len)
        } else {
            alloc(dev, grad_type, len)
        }
    };
    let (mut db, mut dc) = (group_grad(bl * gn)?, group_grad(bl * gn)?);
    let (db_p, dc_p) = (
        ptr(name, "db", &db, &contiguous(bl * gn), &stream)?.0,
        ptr(name, "dc", &dc, &contiguous(bl * gn), &stream)?.0,
    );
    if !apart {
        (q.db, q.dc) = (db_p, dc_p);
    }
    launch_bwd_out(&p_out, (vt, st), &q, !apart, &stream)?;
    if apart {
        launch_bwd_bc(&p, st, &q, (db_p, dc_p), &stream)?;
    }

    let (dt_raw, dt_stride, g) =
        rows_ptr(name, "dt", dt_s.cuda(name, "dt")?, dt_s.layout, &stream)?;
    guards.push(g);
    let steps = SsdSteps::new(
        op.dt_opts.rule(),
        (dt_raw, dt_stride),
        q.a,
        opt_ptr(name, "dt_bias", &hbias, &stream, &mut guards)?,
        0,
    );
    let dt_type = op.dt.dtype();
    let mut ddt_raw = alloc(dev, dt_type, bl * h)?;
    let ptrs = (
        q.ddt,
        ptr(name, "ddt_raw", &ddt_raw, &contiguous(bl * h), &stream)?.0,
        small_at(h, h),
    );
    let sums = HeadSums {
        da_part: q.da_part,
        parts: i(parts)?,
        grad_a: small_at(0, h),
        dd: q.dd,
        d_head: small_at(2 * h + dd_len, head_len),
    };
    launch_bwd_stage1(&p, &steps, ty(name, dt_type)?, ptrs, &sums, &stream)?;
    drop(guards);
    drop(io_guards);

    for s in [
        &mut dstates,
        &mut dx,
        &mut db,
        &mut dc,
        &mut ddt,
        &mut da_part,
        &mut small,
        &mut ddt_raw,
    ] {
        written(s, &stream)?;
    }
    if let Some(s) = &mut dinit {
        written(s, &stream)?;
    }
    // 16-bit values: dB's and dC's f32 sums rounded to the value type, into buffers taken once
    // the states and their gradients are released (the call's peak memory stays theirs).
    drop(hstates);
    drop(states);
    drop(dstates);
    let (db, dc) = match op.x.dtype() {
        _ if apart => (db, dc),
        DType::F32 => (db, dc),
        value => {
            let len = bl * gn;
            let (mut b_out, mut c_out) = (alloc(dev, value, len)?, alloc(dev, value, len)?);
            let sums = (
                ptr(name, "db", &db, &contiguous(len), &stream)?.0,
                ptr(name, "dc", &dc, &contiguous(len), &stream)?.0,
            );
            let outs = (
                ptr(name, "db_out", &b_out, &contiguous(len), &stream)?.0,
                ptr(name, "dc_out", &c_out, &contiguous(len), &stream)?.0,
            );
            launch_bwd_round(vt, sums, outs, len, &stream)?;
            written(&mut b_out, &stream)?;
            written(&mut c_out, &stream)?;
            (b_out, c_out)
        }
    };
    let (bsz, l, g, n) = (d.batch, d.seqlen, d.ngroups, d.dstate);
    let small = tensor(small, small_len);
    let d_grad = match op.d {
        Some(t) if t.rank() == 2 => Some(small.narrow(0, 2 * h, dd_len)?.reshape(t.shape())?),
        Some(t) => Some(small.narrow(0, 2 * h + dd_len, h)?.reshape(t.shape())?),
        None => None,
    };
    Ok(BackwardGrads {
        x: tensor(dx, (bsz, l, h, pd)),
        b: tensor(db, (bsz, l, g, n)),
        c: tensor(dc, (bsz, l, g, n)),
        dt: tensor(ddt_raw, (bsz, l, h)),
        a: small.narrow(0, 0, h)?,
        bias: small.narrow(0, h, h)?,
        d: d_grad,
        init: dinit.map(|s| tensor(s, (bsz, h, pd, n))),
    })
}
