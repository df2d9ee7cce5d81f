//! Launchers of the SSD ops. Dispatch: bf16/f16 values on the tensor-core kernels —
//! fwd_pass_state as a pair (every chunk's own state in parallel, then the scan across chunks)
//! when P % 32 == 0, N % 16 == 0 and the chunk is at most 512, compute_out when P % 32 == 0, N is
//! one of 16, 32, 64, 128, 256 and the chunk a power of two up to 256, both with 16-byte
//! aligned tiles; everything else — f32, odd sizes or views — on the SIMT kernels. `ssd` launches
//! the kernels of all three stages itself (no candle op between them), stage 1 inside the first
//! kernel of the pair (raw dt of the values' type, up to `FUSE_PROGRAMS_PER_SM` programs per SM),
//! else by the chunk_cumsum kernel before it, the intermediates in scratch memory.
//! On sm_90+ both tensor-core kernels take x, b and (compute_out, states of the values' type)
//! the chunk states as TMA tensor maps: one thread copies a tile instead of every thread a part.

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaStream, DeviceRepr};
use candle_core::op::BackpropOp;
use candle_core::{bail, CudaStorage, DType, Layout, Result, Shape, Storage, Tensor};

use super::{
    alloc, cfg, dtype_name, function, has_tma, i, l2_bytes, launch, max_smem, opt_ptr, ptr,
    rows_ptr, scratch, sm_count, tensor_map_3d, written, Arg, Guards, Held, TensorMap,
};
use super::{CHUNK_CUMSUM, COMPUTE_OUT, FWD_PASS_STATE, SSD_STEP};
use crate::check::SsdDims;
use crate::chunk_cumsum::ChunkCumsum;
use crate::compute_out::ComputeOut;
use crate::fwd_pass_state::{FwdPassState, Steps};
use crate::ssd::Call;
use crate::ssd_step::SsdStep;

/// The dimensions as the SSD kernels read them.
#[repr(C)]
#[derive(Clone, Copy)]
struct KDims {
    batch: i32,
    seqlen: i32,
    nheads: i32,
    headdim: i32,
    ngroups: i32,
    dstate: i32,
    chunk: i32,
    nchunks: i32,
    heads_per_block: i32,
    d_per_channel: i32,
    /// compute_out: its step 0 runs before it waits on the kernel before it.
    early: i32,
    /// compute_out: the states are `ssd`'s intermediates, read by no one after it: each tile's
    /// L2 lines are dropped once it has landed (see `out_pass`).
    discard_states: i32,
    /// state_scan: the chunk at which it lets the next kernel start (`i32::MAX`: at its end).
    release_at: i32,
}
// SAFETY: plain old data of i32 fields, laid out as the kernels' `Dims` structs.
unsafe impl DeviceRepr for KDims {}

impl KDims {
    fn new(d: &SsdDims, chunk: usize) -> Result<Self> {
        Ok(Self {
            batch: i(d.batch)?,
            seqlen: i(d.seqlen)?,
            nheads: i(d.nheads)?,
            headdim: i(d.headdim)?,
            ngroups: i(d.ngroups)?,
            dstate: i(d.dstate)?,
            chunk: i(chunk)?,
            nchunks: i(d.nchunks(chunk))?,
            heads_per_block: 1,
            d_per_channel: 0,
            early: 0,
            discard_states: 0,
            release_at: i32::MAX,
        })
    }
}

/// `dt [B,L,H]`'s dimensions.
fn dt_dims(name: &str, dt_l: &Layout) -> Result<(usize, usize, usize)> {
    let &[batch, seqlen, nheads] = dt_l.dims() else {
        bail!(
            "{name}: dt must have rank 3 [B, L, H], got {:?}",
            dt_l.dims()
        )
    };
    Ok((batch, seqlen, nheads))
}

pub(crate) fn chunk_cumsum(
    op: &ChunkCumsum,
    dt_s: &CudaStorage,
    dt_l: &Layout,
    a_s: &CudaStorage,
    a_l: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let name = "chunk_cumsum";
    let (batch, seqlen, nheads) = dt_dims(name, dt_l)?;
    let dev = &dt_s.device;
    let stream = dev.cuda_stream();
    let len = 2 * batch * nheads * seqlen;
    let mut out = alloc(dev, DType::F32, len)?;
    let bias = op.dt_bias.as_ref().map(Held::new);
    let mut guards = Guards::new();
    let (a, _g1) = ptr(name, "a", a_s, a_l, &stream)?;
    let (dt, dt_stride, _g2) = rows_ptr(name, "dt", dt_s, dt_l, &stream)?;
    let raw = RawSteps {
        stage: op,
        dt,
        dt_stride,
        dtype: dt_s.dtype(),
        a,
        bias: opt_ptr(name, "dt_bias", &bias, &stream, &mut guards)?,
    };
    let out_p = ptr(name, "out", &out, &Layout::contiguous(len), &stream)?.0;
    launch_cumsum(&raw, (batch, seqlen, nheads), out_p, &stream)?;
    written(&mut out, &stream)?;
    Ok((out, Shape::from((2, batch, nheads, seqlen))))
}

/// Raw step sizes `dt [B,L,H]` (rows `dt_stride` apart, of `dtype`), `a` and the bias (0: none)
/// as addresses, with stage 1's options.
struct RawSteps<'a> {
    stage: &'a ChunkCumsum,
    dt: u64,
    dt_stride: i64,
    dtype: DType,
    a: u64,
    bias: u64,
}

/// The chunk_cumsum kernel from `raw` (dimensions `(B, L, H)`) into the `[2,B,H,L]` f32 buffer
/// at `out_p`.
fn launch_cumsum(
    raw: &RawSteps,
    (batch, seqlen, nheads): (usize, usize, usize),
    out_p: u64,
    stream: &Arc<CudaStream>,
) -> Result<()> {
    let name = "chunk_cumsum";
    let op = raw.stage;
    let f = function(
        stream,
        CHUNK_CUMSUM,
        &format!("chunk_cumsum_{}", dtype_name(name, raw.dtype)?),
    )?;
    let warps = nheads.min(8);
    let grid = (
        i(seqlen.div_ceil(op.chunk_size))? as u32,
        batch as u32,
        nheads.div_ceil(warps) as u32,
    );
    let (softplus, lo, hi) = (op.dt_softplus as i32, op.dt_limit.0, op.dt_limit.1);
    let (b, l, h, c) = (i(batch)?, i(seqlen)?, i(nheads)?, i(op.chunk_size)?);
    launch(
        stream,
        &f,
        cfg(grid, (32, warps as u32, 1), 0),
        &[
            &raw.dt,
            &raw.a,
            &raw.bias,
            &out_p,
            &b,
            &l,
            &h,
            &c,
            &softplus,
            &lo,
            &hi,
            &raw.dt_stride,
        ],
    )
}

/// Stage 1's pointers and options as chunk_state_mma's `_cs` form reads them (its `Steps`).
#[repr(C)]
#[derive(Clone, Copy)]
struct KSteps {
    dt: u64,
    a: u64,
    bias: u64,
    out: u64,
    dt_stride: i64,
    softplus: i32,
    lo: f32,
    hi: f32,
}
// SAFETY: plain old data laid out as the kernel's `Steps` struct (four pointers, a long, an int,
// two floats).
unsafe impl DeviceRepr for KSteps {}

pub(crate) fn fwd_pass_state(
    op: &FwdPassState,
    x_s: &CudaStorage,
    x_l: &Layout,
    b_s: &CudaStorage,
    b_l: &Layout,
    dt_s: &CudaStorage,
    dt_l: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let name = "fwd_pass_state";
    let d = op.dims;
    let dev = &x_s.device;
    let stream = dev.cuda_stream();
    let chunk = op.chunk_size;
    let nchunks = d.nchunks(chunk);
    let total = d.chunk_states_len(chunk);
    // Stage 1 and the final state come with the op only inside `ssd`, which launches its
    // kernels itself on the GPU (`ssd` below).
    let (Steps::Given(da), None) = (&op.steps, &op.final_state) else {
        bail!("{name}: raw step sizes and a separate final state are for ssd's own launches")
    };
    let mut out = alloc(dev, op.state_dtype, total)?;
    let (init, da) = (op.init_state.as_ref().map(Held::new), Held::new(da));
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
    let shape = Shape::from((d.batch, d.nheads, nchunks + 1, d.headdim, d.dstate));
    Ok((out, shape))
}

/// A state pass's tensors as addresses: x, b, the initial state (0: zeros), the chunk states,
/// and dt_out and da_cumsum (read, or written by stage 1 when the step sizes are raw).
struct PassPtrs {
    x: u64,
    b: u64,
    init: u64,
    states: u64,
    dt: u64,
    da: u64,
}

/// Launches a state pass with values of type `vt` and states of type `st`: with `raw` step
/// sizes, stage 1 first (inside chunk_state_mma's `_cs` form, else by the chunk_cumsum kernel);
/// then the chunk states. `before_last` runs once the first kernel is on its way and gives the
/// final state's address (0: none), after allocating whatever the caller needs before the last
/// kernel (`ssd`: compute_out's output, so that nothing comes between that kernel and
/// compute_out in the stream — in a captured graph an allocation is a node of its own).
fn state_pass(
    d: &SsdDims,
    chunk: usize,
    (vt, st): (DType, DType),
    p: &PassPtrs,
    raw: Option<&RawSteps>,
    stream: &Arc<CudaStream>,
    before_last: impl FnOnce() -> Result<u64>,
) -> Result<()> {
    let name = "fwd_pass_state";
    let nchunks = d.nchunks(chunk);
    let kd = KDims::new(d, chunk)?;
    let (t, s) = (dtype_name(name, vt)?, dtype_name(name, st)?);
    let bh = (d.batch * d.nheads) as u32;
    let dims = (d.batch, d.seqlen, d.nheads);
    let max = max_smem(stream)?;
    let ptrs = [p.x, p.b, p.init];
    let pair = matches!(vt, DType::BF16 | DType::F16) && chunk % 16 == 0;
    let tile = pair
        .then(|| chunk_state_tile(d, chunk, st.size_in_bytes(), &ptrs, max))
        .flatten();
    let Some((warps, nt, smem)) = tile else {
        if let Some(raw) = raw {
            launch_cumsum(raw, dims, p.dt, stream)?;
        }
        let last_p = before_last()?;
        let f = function(
            stream,
            FWD_PASS_STATE,
            &format!("fwd_pass_state_simt_{t}_{s}"),
        )?;
        let grid = ((d.headdim * d.dstate).div_ceil(256) as u32, bh, 1);
        return launch(
            stream,
            &f,
            cfg(grid, (256, 1, 1), chunk * 4),
            &[&p.x, &p.b, &p.dt, &p.da, &p.init, &p.states, &last_p, &kd],
        );
    };
    // Every chunk's own contribution in parallel (stage 1 on the way when the step sizes are raw
    // dt of the values' type), one program per (batch, head, chunk, tile), then the scan across
    // chunks.
    let programs = d.batch * d.nheads * nchunks * (d.dstate / nt) * (d.headdim / (16 * warps));
    let grid = (i(programs)? as u32, 1, 1);
    let sms = sm_count(stream)?;
    let fused = match raw {
        Some(r) if r.dtype == vt && programs <= FUSE_PROGRAMS_PER_SM * sms => Some(KSteps {
            dt: r.dt,
            a: r.a,
            bias: r.bias,
            out: p.dt,
            dt_stride: r.dt_stride,
            softplus: r.stage.dt_softplus as i32,
            lo: r.stage.dt_limit.0,
            hi: r.stage.dt_limit.1,
        }),
        Some(r) => {
            launch_cumsum(r, dims, p.dt, stream)?;
            None
        }
        None => None,
    };
    // On sm_90+ the x and b tiles come by tensor map (one thread issues the copies), their
    // shared tiles aligned to 1024 bytes instead of the 128 `smem` allows for.
    let tma_smem = smem - 128 + 1024;
    let tma = has_tma(stream)? && tma_smem <= max;
    let maps = if tma {
        let rows = box_rows(chunk);
        let tx = token_map(p.x, vt, d.nheads * d.headdim, d, 16 * warps, rows)?;
        let tb = token_map(p.b, vt, d.ngroups * d.dstate, d, nt.min(64), rows)?;
        Some((tx, tb, i(rows)?))
    } else {
        None
    };
    let launch_cfg = cfg(
        grid,
        (32 * warps as u32, 1, 1),
        if tma { tma_smem } else { smem },
    );
    let (kernel, args): (_, Vec<&dyn Arg>) = match (&fused, &maps) {
        (Some(ks), Some((tx, tb, rows))) => (
            "chunk_state_mma_tma_cs",
            vec![tx, tb, rows, &p.states, &kd, ks],
        ),
        (None, Some((tx, tb, rows))) => (
            "chunk_state_mma_tma",
            vec![tx, tb, rows, &p.dt, &p.da, &p.states, &kd],
        ),
        (Some(ks), None) => ("chunk_state_mma_cs", vec![&p.x, &p.b, &p.states, &kd, ks]),
        (None, None) => (
            "chunk_state_mma",
            vec![&p.x, &p.b, &p.dt, &p.da, &p.states, &kd],
        ),
    };
    let f = function(
        stream,
        FWD_PASS_STATE,
        &format!("{kernel}_{t}_{s}_w{warps}_n{nt}"),
    )?;
    launch(stream, &f, launch_cfg, &args)?;
    let last_p = before_last()?;
    // The scan's ring of chunks in flight: 128 bytes per thread, or 256 (`_deep`) where that
    // would leave too few bytes in flight per SM.
    let threads = d.batch * d.nheads * d.headdim * d.dstate / 8;
    let deep = threads * 128 < SCAN_BYTES_PER_SM * sms;
    let ring = if deep { "_deep" } else { "" };
    let f = function(stream, FWD_PASS_STATE, &format!("state_scan{ring}_{s}"))?;
    // The next kernel (compute_out in `ssd`, which loads c and b and forms C·Bᵀ before it
    // waits) may be scheduled from this chunk of the scan on: at once after the usual ring;
    // three quarters in for the deep ring, whose few threads suffer early blocks beside them
    // (H200, session 11 runs 5 and 9: N=64 110.4 → 107.3 µs graph; at once, the 130m layer
    // 21.6 → 24.0).
    let mut kd = kd;
    kd.release_at = if deep { i(3 * nchunks / 4)? } else { 0 };
    let grid = ((d.headdim * d.dstate / 8).div_ceil(256) as u32, bh, 1);
    launch(
        stream,
        &f,
        cfg(grid, (256, 1, 1), 0),
        &[&p.da, &p.init, &p.states, &last_p, &kd],
    )?;
    Ok(())
}

/// Stage 1 runs inside chunk_state_mma (its `_cs` form) while that kernel has at most this many
/// programs per SM (about eight waves): there the launch it saves outweighs the stage-1 latency
/// each program then carries. H200, `ssd` in a graph, fused against not: −1.5 to −2.4 µs at 3–10
/// programs per SM (L=4096, both model layers; session 8 runs 7–8), +3.7 and +6.5 µs at 62 and
/// 124 (N=256, L=65536; cp.async tiles), −2.7 and −1.4 µs at 31 (the seed shape, N=64) with the
/// tiles by TMA (session 9 run 9).
const FUSE_PROGRAMS_PER_SM: usize = 32;

/// The scan's threads each keep a ring of 128 bytes of chunks in flight (8 bf16 / 4 f32 chunks
/// of 8 elements); with fewer than this many bytes per SM in all (too few (batch, head) pairs
/// and state elements to cover the memory latency) the `_deep` kernel keeps 256. H200, state
/// pass µs with 128 / 256 bytes per thread (session 6 runs 14–15): N=64 seed shape (16 KB per SM)
/// 60.9 / 57.5, 130m layer (23 KB) 15.1 / 14.9; at 32 KB — L=4096 27.4 / 26.8, seed 93.3 / 92.5,
/// L=65536 353.9 / 355.4 — and 78 KB (2.7b layer, 31.8 / 32.6) the deep ring does not pay.
const SCAN_BYTES_PER_SM: usize = 24 * 1024;

/// The tensor map of a `[B, L, row]` tensor of 2-byte values at `p` (x, b), boxes of `cols`
/// channels by `rows` tokens of one sequence (tokens past its end read as zeros).
fn token_map(
    p: u64,
    dtype: DType,
    row: usize,
    d: &SsdDims,
    cols: usize,
    rows: usize,
) -> Result<TensorMap> {
    tensor_map_3d(
        p,
        dtype,
        [row, d.seqlen, d.batch],
        [row, d.seqlen * row],
        [cols, rows, 1],
    )
}

/// Tokens per tensor-map box of chunk_state_mma: the largest of 128, 64, 32, 16 that divides both
/// halves of the chunk (the kernel's `half` = ⌊chunk / 32⌋·16 and the rest).
fn box_rows(chunk: usize) -> usize {
    let half = chunk / 32 * 16;
    [128, 64, 32, 16]
        .into_iter()
        .find(|r| half % r == 0 && (chunk - half) % r == 0)
        .unwrap_or(16)
}

/// Whether the tensor-core kernels' tile loads (`m2::load_tile`: 32-bit byte offsets from a
/// chunk's first row of x, b or c) reach every row of a chunk.
fn tile_offsets_fit(d: &SsdDims, chunk: usize) -> bool {
    let row = (d.nheads * d.headdim).max(d.ngroups * d.dstate);
    chunk * row * 2 <= u32::MAX as usize
}

/// The launch of `chunk_state_mma` — (warps, N-tile, shared bytes) — if the shape suits it: P a
/// multiple of 32, N of 16, 16-byte aligned x, b and initial state (`ptrs`), and a chunk of at
/// most 512 tokens (the kernel's `MAXC`) that fits in shared memory.
fn chunk_state_tile(
    d: &SsdDims,
    chunk: usize,
    state_bytes: usize,
    ptrs: &[u64],
    max_smem: usize,
) -> Option<(usize, usize, usize)> {
    if d.headdim % 32 != 0
        || d.dstate % 16 != 0
        || ptrs.iter().any(|p| p % 16 != 0)
        || chunk > 512
        || !tile_offsets_fit(d, chunk)
    {
        return None;
    }
    let warps = if d.headdim % 64 == 0 { 4 } else { 2 };
    let nt = [128, 64, 32, 16]
        .into_iter()
        .find(|nt| d.dstate % nt == 0)?;
    // x and b tiles and w (2-byte values), or the warps' output staging if larger, and 128 bytes
    // to align the tiles.
    let tiles = chunk * 16 * warps * 2 + chunk * nt * 2 + chunk * 2;
    let staging = warps * 16 * (nt + 8) * state_bytes;
    let smem = tiles.max(staging) + 128;
    (smem <= max_smem).then_some((warps, nt, smem))
}

pub(crate) fn compute_out(
    op: &ComputeOut,
    x_s: &CudaStorage,
    x_l: &Layout,
    c_s: &CudaStorage,
    c_l: &Layout,
    st_s: &CudaStorage,
    st_l: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let name = "compute_out";
    let d = op.dims;
    let dev = &x_s.device;
    let stream = dev.cuda_stream();
    let total = d.batch * d.seqlen * d.nheads * d.headdim;
    let mut out = alloc(dev, x_s.dtype(), total)?;
    let (b, dt, da) = (
        Held::new(&op.b),
        Held::new(&op.dt_out),
        Held::new(&op.da_cumsum),
    );
    let dskip = op.d.as_ref().map(Held::new);
    let z = op.z.as_ref().map(Held::new);
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
    let d_per_channel = op.d.as_ref().is_some_and(|t| t.rank() == 2);
    let types = (x_s.dtype(), st_s.dtype());
    out_pass(&d, op.chunk_size, types, &p, d_per_channel, false, &stream)?;
    written(&mut out, &stream)?;
    Ok((out, Shape::from((d.batch, d.seqlen, d.nheads, d.headdim))))
}

/// compute_out's tensors as addresses (`d`, `z`: 0 when absent).
struct OutPtrs {
    x: u64,
    b: u64,
    c: u64,
    dt: u64,
    da: u64,
    states: u64,
    d: u64,
    z: u64,
    y: u64,
}

/// Launches compute_out with values of type `vt` and chunk states of type `st`; `early` when the
/// kernel before it on the stream is the state pass's last, which wrote only the states (see
/// `KDims::early`), and those states are `ssd`'s own intermediates.
fn out_pass(
    d: &SsdDims,
    chunk: usize,
    (vt, st): (DType, DType),
    p: &OutPtrs,
    d_per_channel: bool,
    early: bool,
    stream: &Arc<CudaStream>,
) -> Result<()> {
    let name = "compute_out";
    let nchunks = d.nchunks(chunk);
    let mut kd = KDims::new(d, chunk)?;
    kd.d_per_channel = d_per_channel as i32;
    kd.early = early as i32;
    // After the state pass (`ssd`) the states are its own intermediates and compute_out is their
    // last reader: it drops each tile's L2 lines once loaded, so that the lines still dirty there
    // are never written back, which otherwise the next kernels pay for in DRAM bandwidth. Only
    // where the states fit in half the L2: larger ones have mostly been written back before
    // compute_out reads them, and the drops then cost ~1 %. H200 (RESULTS, session 23 run 1),
    // graph µs without / with: L=4096 39.2–39.4 / 38.6–38.8, 2.7b layer 47.1 / 46.8; seed
    // L=16384 145.9 / 147.3, L=65536 572.4 / 577.4.
    let states_bytes = d.chunk_states_len(chunk) * st.size_in_bytes();
    kd.discard_states =
        (early && p.states % 128 == 0 && states_bytes <= l2_bytes(stream)? / 2) as i32;
    let (t, s) = (dtype_name(name, vt)?, dtype_name(name, st)?);
    // 16-byte aligned x, b, c and states for the tile copies; z is read in pairs.
    let aligned = [p.x, p.b, p.c, p.states].iter().all(|a| a % 16 == 0) && p.z % 4 == 0;
    let mma = matches!(vt, DType::BF16 | DType::F16)
        && aligned
        && d.headdim % 32 == 0
        && matches!(d.dstate, 16 | 32 | 64 | 128 | 256)
        && chunk.is_power_of_two()
        && (16..=256).contains(&chunk)
        && tile_offsets_fit(d, chunk);
    let ptile = if d.headdim % 64 == 0 && d.dstate <= 128 {
        64
    } else {
        32
    };
    let limit = max_smem(stream)?;
    let sms = sm_count(stream)?;
    let plan = mma
        .then(|| {
            out_plan(
                nchunks * d.batch * d.nheads,
                d.heads_per_group(),
                sms,
                limit,
                |hb| mma_smem(chunk, d.headdim, d.dstate, ptile, hb),
                2 * chunk,
            )
        })
        .flatten();
    if let Some((hb, smem)) = plan {
        kd.heads_per_block = i(hb)?;
        let n = d.dstate;
        let grid = (nchunks as u32, (d.nheads / hb) as u32, d.batch as u32);
        // On sm_90+ with states of the value type, the unit tiles come by tensor map (the states
        // as rows of N), and step 0's c and b tiles by tensor map too where it uses wgmma.
        let maps = if has_tma(stream)? && st == vt {
            let rows = d.batch * d.nheads * (nchunks + 1) * d.headdim;
            let tx = token_map(p.x, vt, d.nheads * d.headdim, d, ptile, chunk)?;
            let th = tensor_map_3d(
                p.states,
                st,
                [n, rows, 1],
                [n, rows * n],
                [n.min(64), ptile, 1],
            )?;
            let gn = d.ngroups * n;
            let tc = token_map(p.c, vt, gn, d, n.min(64), chunk)?;
            let tb = token_map(p.b, vt, gn, d, n.min(64), chunk)?;
            Some((tx, th, tc, tb))
        } else {
            None
        };
        let (kernel, args): (_, Vec<&dyn Arg>) = match &maps {
            Some((tx, th, tc, tb)) => (
                format!("compute_out_mma_tma_{t}_n{n}_p{ptile}"),
                vec![
                    tx, th, tc, tb, &p.b, &p.c, &p.dt, &p.da, &p.states, &p.d, &p.z, &p.y, &kd,
                ],
            ),
            None => (
                format!("compute_out_mma_{t}_{s}_n{n}_p{ptile}"),
                vec![
                    &p.x, &p.b, &p.c, &p.dt, &p.da, &p.states, &p.d, &p.z, &p.y, &kd,
                ],
            ),
        };
        let f = function(stream, COMPUTE_OUT, &kernel)?;
        return launch(stream, &f, cfg(grid, (2 * chunk as u32, 1, 1), smem), &args);
    }
    let f = function(stream, COMPUTE_OUT, &format!("compute_out_simt_{t}_{s}"))?;
    let grid = (nchunks as u32, (d.batch * d.nheads) as u32, 1);
    launch(
        stream,
        &f,
        cfg(grid, (256, 1, 1), 16 * chunk * 4),
        &[
            &p.x, &p.b, &p.c, &p.dt, &p.da, &p.states, &p.d, &p.z, &p.y, &kd,
        ],
    )
}

/// [`crate::ssd`] on the GPU: the state pass and compute_out launched back to back from here (no
/// candle op between them), stage 1's step sizes and the chunk states in the stream's scratch
/// buffer ([`scratch`]), y and the final state allocated once the first kernel is on its way. For
/// calls whose intermediates fit that buffer nothing is allocated before the first launch.
pub(crate) fn ssd(call: &Call) -> Result<(Tensor, Tensor)> {
    let name = "ssd";
    let d = call.dims;
    let chunk = call.stage.chunk_size;
    let (x, b, c) = (Held::new(call.x), Held::new(call.b), Held::new(call.c));
    let (dt, a) = (Held::new(call.dt), Held::new(call.a));
    let bias = call.stage.dt_bias.as_ref().map(Held::new);
    let (dskip, z, init) = (
        call.d.map(Held::new),
        call.z.map(Held::new),
        call.init.map(Held::new),
    );
    let x_s = x.cuda(name, "x")?;
    let dev = &x_s.device;
    let stream = dev.cuda_stream();
    let (vt, st) = (x_s.dtype(), call.state_dtype);
    let bhl = d.batch * d.nheads * d.seqlen;
    let states_len = d.chunk_states_len(chunk);
    // [chunk states | dt_out | da_cumsum], each part 256-byte aligned.
    let states_bytes = (states_len * st.size_in_bytes()).next_multiple_of(256);
    let scratch = scratch::take(&stream, states_bytes + 8 * bhl)?;
    let states = scratch.ptr();
    let steps = states + states_bytes as u64;
    let dt_s = dt.cuda(name, "dt")?;
    // The inputs' read events are recorded once every kernel is launched (the guards' drop).
    let mut guards = Guards::new();
    let (dt_raw, dt_stride, g) = rows_ptr(name, "dt", dt_s, dt.layout, &stream)?;
    guards.push(g);
    let raw = RawSteps {
        stage: call.stage,
        dt: dt_raw,
        dt_stride,
        dtype: dt_s.dtype(),
        a: a.ptr(name, "a", &stream, &mut guards)?,
        bias: opt_ptr(name, "dt_bias", &bias, &stream, &mut guards)?,
    };
    let p = PassPtrs {
        x: x.ptr(name, "x", &stream, &mut guards)?,
        b: b.ptr(name, "b", &stream, &mut guards)?,
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
    let o = OutPtrs {
        x: p.x,
        b: p.b,
        c: c.ptr(name, "c", &stream, &mut guards)?,
        dt: p.dt,
        da: p.da,
        states,
        d: opt_ptr(name, "D", &dskip, &stream, &mut guards)?,
        z: opt_ptr(name, "z", &z, &stream, &mut guards)?,
        y: ptr(name, "y", &y, &Layout::contiguous(total), &stream)?.0,
    };
    let d_per_channel = call.d.is_some_and(|t| t.rank() == 2);
    out_pass(&d, chunk, (vt, st), &o, d_per_channel, true, &stream)?;
    drop(guards);
    written(&mut y, &stream)?;
    written(&mut last, &stream)?;
    let y_shape = (d.batch, d.seqlen, d.nheads, d.headdim);
    let last_shape = (d.batch, d.nheads, d.headdim, d.dstate);
    Ok((
        Tensor::from_storage(Storage::Cuda(y), y_shape, BackpropOp::none(), false),
        Tensor::from_storage(Storage::Cuda(last), last_shape, BackpropOp::none(), false),
    ))
}

/// Shared memory of `compute_out_mma` in bytes (its `Layout`, 2-byte values): C·Bᵀ in 16×16
/// blocks at or below the diagonal, four f32 scalars per token and head, D per channel of each
/// head, and from the next multiple of 1024 bytes a region holding c and b at the start, then
/// two unit buffers (x tile and state tile); 1024 bytes more to align the base.
fn mma_smem(chunk: usize, headdim: usize, dstate: usize, ptile: usize, hb: usize) -> usize {
    let rblocks = chunk / 16;
    let cb = rblocks * (rblocks + 1) / 2 * 512;
    let scalars = hb * 4 * chunk * 4 + hb * headdim * 4;
    let cb_tiles = 2 * chunk * dstate * 2;
    let buffers = 2 * (chunk * ptile + ptile * dstate) * 2;
    (cb + scalars).next_multiple_of(1024) + cb_tiles.max(buffers) + 1024
}

/// Heads per program for `compute_out_mma` (`threads` per program) and its shared bytes: a
/// divisor (≤ 8) of the heads per group whose shared memory fits, chosen by the time of the
/// busiest SM: ⌈programs / SMs⌉ programs, each worth its heads plus the shared c/b load and C·Bᵀ
/// (about 0.7 of a head), where two programs resident together take 1.6× one alone, not 1×.
/// Fitted on the H200 (µs for 2 / 3 / 4 / 5 / 8 heads; session 4 runs 5–6): seed L=16384 130 /
/// – / 113 / – / 106, L=4096 41 / – / 35 / – / 38, 130m layer 22 / 20 / 23 / – / 36, 2.7b layer
/// 53 / – / 57 / 41 / 53 — the model picks the best of each.
fn out_plan(
    head_chunks: usize,
    heads_per_group: usize,
    sms: usize,
    limit: usize,
    smem: impl Fn(usize) -> usize,
    threads: usize,
) -> Option<(usize, usize)> {
    // Programs resident per SM: the opt-in limit plus the 1 KiB reserved per program is the
    // SM's shared memory; 64 Ki registers, up to 128 per thread.
    let resident = |bytes: usize| ((limit + 1024) / (bytes + 1024)).min(65536 / (threads * 128));
    (1..=heads_per_group.min(8))
        .filter(|hb| heads_per_group % hb == 0)
        .map(|hb| (hb, smem(hb)))
        .filter(|&(_, bytes)| bytes <= limit)
        .min_by_key(|&(hb, bytes)| {
            let per_sm = head_chunks.div_ceil(hb).div_ceil(sms.max(1));
            // Tenths of one program's time alone.
            let time = if resident(bytes) >= 2 {
                16 * (per_sm / 2) + 10 * (per_sm % 2)
            } else {
                10 * per_sm
            };
            (time * (10 * hb + 7), usize::MAX - hb)
        })
}

/// The dimensions as the step kernel reads them.
#[repr(C)]
#[derive(Clone, Copy)]
struct StepDims {
    batch: i32,
    nheads: i32,
    headdim: i32,
    ngroups: i32,
    dstate: i32,
    softplus: i32,
    d_per_channel: i32,
    rows_per_block: i32,
    lo: f32,
    hi: f32,
    x_stride: i64,
    dt_stride: i64,
    b_stride: i64,
    c_stride: i64,
    z_stride: i64,
}
// SAFETY: plain old data laid out as the step kernel's `Dims` struct.
unsafe impl DeviceRepr for StepDims {}

pub(crate) fn ssd_step(
    op: &SsdStep,
    st_s: &mut CudaStorage,
    st_l: &Layout,
    x_s: &CudaStorage,
    x_l: &Layout,
    dt_s: &CudaStorage,
    dt_l: &Layout,
) -> Result<CudaStorage> {
    let name = "ssd_step";
    let d = op.dims;
    let dev = x_s.device.clone();
    let stream = dev.cuda_stream();
    let total = d.batch * d.nheads * d.headdim;
    let mut out = alloc(&dev, x_s.dtype(), total)?;
    let (a, b, c) = (Held::new(&op.a), Held::new(&op.b), Held::new(&op.c));
    let bias = op.dt_bias.as_ref().map(Held::new);
    let dskip = op.d.as_ref().map(Held::new);
    let z = op.z.as_ref().map(Held::new);
    let mut guards = Guards::new();
    let (x_p, x_stride, _g1) = rows_ptr(name, "x", x_s, x_l, &stream)?;
    let (dt_p, dt_stride, _g2) = rows_ptr(name, "dt", dt_s, dt_l, &stream)?;
    let a_p = a.ptr(name, "a", &stream, &mut guards)?;
    let (b_p, b_stride, _g4) = rows_ptr(name, "b", b.cuda(name, "b")?, b.layout, &stream)?;
    let (c_p, c_stride, _g5) = rows_ptr(name, "c", c.cuda(name, "c")?, c.layout, &stream)?;
    let bias_p = opt_ptr(name, "dt_bias", &bias, &stream, &mut guards)?;
    let d_p = opt_ptr(name, "D", &dskip, &stream, &mut guards)?;
    let (z_p, z_stride) = match &z {
        Some(h) => {
            let (p, s, g) = rows_ptr(name, "z", h.cuda(name, "z")?, h.layout, &stream)?;
            guards.push(g);
            (p, s)
        }
        None => (0, 0),
    };
    let y_p = ptr(name, "y", &out, &Layout::contiguous(total), &stream)?.0;
    let state_dtype = st_s.dtype();
    let (st_p, g7) = ptr(name, "state", st_s, st_l, &stream)?;
    // One warp per state row while (batch, head) pairs alone cannot fill the GPU; a whole head
    // per program once they can (fewer, longer programs stream better at large batch).
    let warps = d.headdim.clamp(1, 8);
    let heads = d.batch * d.nheads;
    let rows_per_block = if heads < 4 * sm_count(&stream)? {
        warps
    } else {
        d.headdim
    };
    let sd = StepDims {
        batch: i(d.batch)?,
        nheads: i(d.nheads)?,
        headdim: i(d.headdim)?,
        ngroups: i(d.ngroups)?,
        dstate: i(d.dstate)?,
        softplus: op.dt_softplus as i32,
        d_per_channel: op.d.as_ref().is_some_and(|t| t.rank() == 2) as i32,
        rows_per_block: i(rows_per_block)?,
        lo: op.dt_limit.0,
        hi: op.dt_limit.1,
        // Row strides → batch strides: x and z have H rows of P per batch, b and c G rows of N.
        x_stride: x_stride * d.nheads as i64,
        dt_stride,
        b_stride: b_stride * d.ngroups as i64,
        c_stride: c_stride * d.ngroups as i64,
        z_stride: z_stride * d.nheads as i64,
    };
    // Vector accesses: 4 columns per lane from 16-byte (f32) or 8-byte aligned rows of B, C and
    // the state, up to 256 columns held in registers.
    let quad = 4 * x_s.dtype().size_in_bytes();
    let vec = d.dstate % 4 == 0
        && d.dstate <= 256
        && st_p % 16 == 0
        && [b_p, c_p].iter().all(|&p| p as usize % quad == 0)
        && [sd.b_stride, sd.c_stride].iter().all(|&s| s % 4 == 0);
    let path = match (vec, d.dstate <= 128) {
        (false, _) => "scalar",
        (true, true) => "vec1",
        (true, false) => "vec2",
    };
    let fname = format!(
        "ssd_step_{}_{}_{path}",
        dtype_name(name, x_s.dtype())?,
        dtype_name(name, state_dtype)?,
    );
    let f = function(&stream, SSD_STEP, &fname)?;
    let row_blocks = d.headdim.div_ceil(rows_per_block);
    launch(
        &stream,
        &f,
        cfg(
            (heads as u32, row_blocks as u32, 1),
            (32 * warps as u32, 1, 1),
            0,
        ),
        &[
            &st_p, &x_p, &dt_p, &a_p, &bias_p, &b_p, &c_p, &d_p, &z_p, &y_p, &sd,
        ],
    )?;
    drop(g7);
    written(st_s, &stream)?;
    written(&mut out, &stream)?;
    Ok(out)
}
