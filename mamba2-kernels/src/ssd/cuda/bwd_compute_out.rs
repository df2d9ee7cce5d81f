//! Launcher of `kernels/ssd/bwd_compute_out.cu`, the backward of compute_out: one program per
//! (chunk of 64 tokens, batch·head) with every tile of the chunk in shared memory, the states and
//! their gradients at `p.chunk` (64, or 128 with P ≤ 64: the half-way ones formed by the
//! programs). Tensor-core values at P = 64 and N of 64, 128 or 256 take a kernel with P and N
//! compiled in (its tile walks unrolled, its column bounds folded; in bf16 on sm_90a its products
//! on wgmma, and with bf16 states its tiles by tensor map); other shapes one that reads them at
//! run time. For 16-bit values a second kernel then rounds dB's and dC's f32 sums to the value
//! type, except where the `_tma` form leaves dB and dC to [`bwd_bc`](super::bwd_bc).

use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::CudaStream;
use candle_core::{bail, DType, Result};

use super::bwd_pass_state::{pad, TOKENS};
use super::params::SsdParams;
use crate::cuda::tensor_map::{tensor_map_3d, tokens, TensorMap};
use crate::cuda::{cfg, fatbin, function, has_tma, launch, max_smem, runs_sm90a, Image, Ty};
use crate::instances;

const IMAGE: Image = fatbin!("ssd_bwd_compute_out");

/// Warps per program (the kernel's `WARPS`).
const WARPS: usize = 8;

/// What the kernel reads (values of the value type, states and their gradients of the state
/// type, per-token steps f32; `dskip` 0: no D) and writes (`dx` of the value type, the rest f32;
/// `dd` 0: no D).
pub(super) struct BwdOutPtrs {
    pub x: u64,
    pub dy: u64,
    pub b: u64,
    pub c: u64,
    pub dt: u64,
    pub da: u64,
    pub states: u64,
    pub dstates: u64,
    pub dskip: u64,
    pub a: u64,
    pub dx: u64,
    pub db: u64,
    pub dc: u64,
    pub ddt: u64,
    pub da_part: u64,
    pub dd: u64,
}

/// Shared memory of one program: x, dy, B, C, H and dH' padded to 64 columns, W and A, the
/// per-token sums (col in four parts, three more in two), D's gradient (four parts) and value
/// per channel, a value per warp. The mma.sync form pads each tile row by 8 values and aligns to
/// 128 bytes, the wgmma form pads nothing and aligns to 1024 (`wgmma`: the kernel runs that form,
/// bf16 with P and N compiled in on sm_90a, where three programs of N = 64 fit an SM).
fn smem(p: &SsdParams, t: Ty, wgmma: bool) -> usize {
    let (pp, np) = (pad(p.headdim), pad(p.dstate));
    let sums = (12 * TOKENS + 5 * pp + WARPS) * 4;
    let padded = 2 * TOKENS * (pp + 8) + 2 * TOKENS * (np + 8) + 2 * pp * (np + 8);
    let wa_padded = 2 * TOKENS * (TOKENS + 8);
    let swizzled = 2 * TOKENS * pp + 2 * TOKENS * np + 2 * pp * np + 2 * TOKENS * TOKENS;
    let swizzled = swizzled * t.bytes() + 1024;
    if wgmma {
        swizzled + sums
    } else {
        ((padded + wa_padded) * t.bytes() + 128).max(swizzled) + sums
    }
}

/// The (P, N) of a kernel with both compiled in, where the value type has one.
fn fixed_shape(p: &SsdParams, t: Ty) -> Option<(usize, usize)> {
    let shape = (p.headdim as usize, p.dstate as usize);
    (instances::MMA_VALUES.contains(&t) && instances::BWD_COMPUTE_OUT_FIXED.contains(&shape))
        .then_some(shape)
}

/// Whether the kernel runs its wgmma form: bf16 with P and N compiled in, on sm_90a.
fn runs_wgmma(p: &SsdParams, t: Ty, stream: &Arc<CudaStream>) -> Result<bool> {
    Ok(t == Ty::Bf16 && fixed_shape(p, t).is_some() && runs_sm90a(stream)?)
}

/// Whether the kernel runs its `_tma` form (which can leave dB and dC to bwd_bc).
pub(super) fn runs_tma(
    p: &SsdParams,
    (t, s): (Ty, Ty),
    q: &BwdOutPtrs,
    stream: &Arc<CudaStream>,
) -> Result<bool> {
    tma_fits(p, s, q, runs_wgmma(p, t, stream)?, stream)
}

/// `bc`: the kernel forms dB and dC (into `q.db` and `q.dc`); else it leaves them to bwd_bc,
/// which needs its `_tma` form ([`runs_tma`]).
pub(super) fn launch_bwd_out(
    p: &SsdParams,
    (t, s): (Ty, Ty),
    q: &BwdOutPtrs,
    bc: bool,
    stream: &Arc<CudaStream>,
) -> Result<()> {
    let name = "ssd backward";
    let shape = (p.headdim as usize, p.dstate as usize);
    let fixed = fixed_shape(p, t);
    let wgmma = runs_wgmma(p, t, stream)?;
    let bytes = smem(p, t, wgmma);
    let max = max_smem(stream)?;
    if bytes > max {
        bail!(
            "{name}: a chunk's tiles at P = {}, N = {} take {bytes} bytes of shared memory in {}, \
             over the device's {max}; run the backward on the CPU or in bf16",
            p.headdim,
            p.dstate,
            t.name()
        )
    }
    let programs = (p.seqlen as usize).div_ceil(TOKENS) * p.batch as usize * p.nheads as usize;
    let grid = [programs, 1, 1];
    let c = cfg(name, stream, grid, [32 * WARPS, 1, 1], bytes)?;
    let maps = tile_maps(p, s, q, wgmma, stream)?;
    if !bc && maps.is_none() {
        bail!("{name}: dB and dC left to bwd_bc where bwd_compute_out's `_tma` form does not run")
    }
    if let Some(maps) = maps {
        let f = function(
            stream,
            IMAGE,
            &instances::bwd_compute_out_tma(s, shape.1, bc),
        )?;
        let rest: [&dyn crate::cuda::Arg; 13] = [
            &q.dt, &q.da, &q.states, &q.dstates, &q.dskip, &q.a, &q.dx, &q.db, &q.dc, &q.ddt,
            &q.da_part, &q.dd, p,
        ];
        let args: Vec<&dyn crate::cuda::Arg> = maps
            .iter()
            .map(|m| m as &dyn crate::cuda::Arg)
            .chain(rest)
            .collect();
        return launch(stream, &f, c, &args);
    }
    let f = function(stream, IMAGE, &instances::bwd_compute_out(t, s, fixed))?;
    let args: [&dyn crate::cuda::Arg; 17] = [
        &q.x, &q.dy, &q.b, &q.c, &q.dt, &q.da, &q.states, &q.dstates, &q.dskip, &q.a, &q.dx, &q.db,
        &q.dc, &q.ddt, &q.da_part, &q.dd, p,
    ];
    launch(stream, &f, c, &args)
}

/// The rows of N of the states (and of their gradients).
fn state_rows(p: &SsdParams) -> usize {
    p.batch as usize * p.nheads as usize * (p.nchunks as usize + 1) * p.headdim as usize
}

/// Whether the `_tma` form runs: the wgmma form (`wgmma`) with TMA on the device and not turned
/// off by `MAMBA2_NO_TMA=1`, every tensor 16-byte aligned, bf16 states' rows indexed by an i32.
fn tma_fits(
    p: &SsdParams,
    s: Ty,
    q: &BwdOutPtrs,
    wgmma: bool,
    stream: &Arc<CudaStream>,
) -> Result<bool> {
    let aligned = [q.x, q.dy, q.b, q.c, q.states, q.dstates]
        .iter()
        .all(|a| a % 16 == 0);
    let states_fit = s != Ty::Bf16 || i32::try_from(state_rows(p)).is_ok();
    Ok(wgmma && aligned && states_fit && has_tma(stream)?)
}

/// The tensor maps of the `_tma` form where it runs ([`tma_fits`]): x, dY, B and C, then with
/// bf16 states (`s`) the states and their gradients.
fn tile_maps(
    p: &SsdParams,
    s: Ty,
    q: &BwdOutPtrs,
    wgmma: bool,
    stream: &Arc<CudaStream>,
) -> Result<Option<Vec<TensorMap>>> {
    if !tma_fits(p, s, q, wgmma, stream)? {
        return Ok(None);
    }
    let (b, l, h, g) = (
        p.batch as usize,
        p.seqlen as usize,
        p.nheads as usize,
        p.ngroups as usize,
    );
    let (hd, n) = (p.headdim as usize, p.dstate as usize);
    let rows = state_rows(p);
    let dtype = DType::BF16;
    let values = |ptr, row| tokens(ptr, dtype, [b, l, row], 64, TOKENS);
    let states = |ptr| tensor_map_3d(ptr, dtype, [n, rows, 1], [n, rows * n], [64, 64, 1]);
    let mut maps = vec![
        values(q.x, h * hd)?,
        values(q.dy, h * hd)?,
        values(q.b, g * n)?,
        values(q.c, g * n)?,
    ];
    if s == Ty::Bf16 {
        maps.extend([states(q.states)?, states(q.dstates)?]);
    }
    Ok(Some(maps))
}

/// Rounds dB's and dC's f32 sums (`len` values each, `db`, `dc`) into `db_out` and `dc_out` of
/// the 16-bit value type `t`: one launch for both, eight values per thread and step.
pub(super) fn launch_bwd_round(
    t: Ty,
    (db, dc): (u64, u64),
    (db_out, dc_out): (u64, u64),
    len: usize,
    stream: &Arc<CudaStream>,
) -> Result<()> {
    let f = function(stream, IMAGE, &instances::bwd_compute_out_round(t))?;
    let programs = (2 * len).div_ceil(8 * 256).clamp(1, 1 << 16);
    let c = cfg("ssd backward", stream, [programs, 1, 1], [256, 1, 1], 0)?;
    launch(stream, &f, c, &[&db, &dc, &db_out, &dc_out, &len])
}
