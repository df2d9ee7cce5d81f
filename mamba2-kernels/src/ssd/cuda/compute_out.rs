//! Launcher of `kernels/ssd/compute_out.cu`: bf16/f16 values on the tensor-core kernel (a
//! program per chunk and a few heads of one group, `ssd::plan` says how many), everything else on
//! the SIMT kernel. On sm_90+ with states of the value type, x's and the states' unit tiles and
//! step 0's c and b tiles come by TMA tensor map.

use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::CudaStream;
use candle_core::{DType, Result};

use super::params::SsdParams;
use crate::check::SsdDims;
use crate::cuda::tensor_map::{tensor_map_3d, tokens};
use crate::cuda::{cfg, fatbin, function, has_tma, i, l2_bytes, launch, max_smem, sm_count, ty};
use crate::cuda::{Arg, Image};
use crate::instances;
use crate::ssd::plan;

pub(super) const IMAGE: Image = fatbin!("ssd_compute_out");

/// compute_out's tensors as addresses (`d`, `z`: 0 when absent).
pub(super) struct OutPtrs {
    pub x: u64,
    pub b: u64,
    pub c: u64,
    pub dt: u64,
    pub da: u64,
    pub states: u64,
    pub d: u64,
    pub z: u64,
    pub y: u64,
    /// Every chunk's first token (i32 `[nchunks + 1]`) for sequences packed along L, 0 for none.
    pub chunk_starts: u64,
}

/// What comes before compute_out on its stream.
#[derive(Clone, Copy)]
pub(super) enum After {
    /// Any kernels: compute_out waits for them before its first load.
    Any,
    /// `ssd`'s state pass, whose last kernel wrote only the states (see `SsdParams::early`);
    /// `kept`: the states outlive the call (kept for the backward), else compute_out is their
    /// last reader.
    StatePass { kept: bool },
}

/// Launches compute_out with values of type `vt` and chunk states of type `st`, after `after`.
pub(super) fn out_pass(
    d: &SsdDims,
    chunk: usize,
    (vt, st): (DType, DType),
    p: &OutPtrs,
    d_per_channel: bool,
    after: After,
    stream: &Arc<CudaStream>,
) -> Result<()> {
    let name = "compute_out";
    let nchunks = d.nchunks(chunk);
    let mut kp = SsdParams::new(d, chunk)?;
    kp.chunk_starts = p.chunk_starts;
    kp.d_per_channel = d_per_channel as i32;
    kp.early = matches!(after, After::StatePass { .. }) as i32;
    // Where the states are `ssd`'s own intermediates compute_out is their last reader: it drops
    // each tile's L2 lines once loaded, so that the lines still dirty there are never written
    // back, which the next kernels would pay for in DRAM bandwidth (their memory is undefined
    // after that, so never for kept states). Only where the states fit in half the L2: larger
    // ones have mostly been written back before compute_out reads them, and the drops then cost
    // more than they save.
    let states_bytes = d.chunk_states_len(chunk) * st.size_in_bytes();
    let last_reader = matches!(after, After::StatePass { kept: false });
    kp.discard_states =
        (last_reader && p.states % 128 == 0 && states_bytes <= l2_bytes(stream)? / 2) as i32;
    let (t, s) = (ty(name, vt)?, ty(name, st)?);
    // 16-byte aligned x, b, c and states for the tile copies; z is read in pairs.
    let aligned = [p.x, p.b, p.c, p.states].iter().all(|a| a % 16 == 0) && p.z % 4 == 0;
    let limit = max_smem(stream)?;
    let sms = sm_count(stream)?;
    let plan = plan::out_tile(d, chunk, t, aligned).and_then(|(n, ptile)| {
        let (hb, smem) = plan::out_plan(
            nchunks * d.batch * d.nheads,
            d.heads_per_group(),
            sms,
            limit,
            |hb| plan::mma_smem(chunk, d.headdim, n, ptile, hb),
            2 * chunk,
        )?;
        Some((n, ptile, hb, smem))
    });
    if let Some((n, ptile, hb, smem)) = plan {
        kp.heads_per_block = i(hb)?;
        let grid = [nchunks, d.nheads / hb, d.batch];
        let cfg = cfg(name, stream, grid, [2 * chunk, 1, 1], smem)?;
        // With states of the value type, the unit tiles come by tensor map (the states as rows
        // of N, addressed by an i32 row), and step 0's c and b tiles too.
        let rows = d.batch * d.nheads * (nchunks + 1) * d.headdim;
        let maps = if has_tma(stream)? && st == vt && i32::try_from(rows).is_ok() {
            let (bl, hp, gn) = ([d.batch, d.seqlen], d.nheads * d.headdim, d.ngroups * n);
            let tx = tokens(p.x, vt, [bl[0], bl[1], hp], ptile, chunk)?;
            let th = tensor_map_3d(
                p.states,
                st,
                [n, rows, 1],
                [n, rows * n],
                [n.min(64), ptile, 1],
            )?;
            let tc = tokens(p.c, vt, [bl[0], bl[1], gn], n.min(64), chunk)?;
            let tb = tokens(p.b, vt, [bl[0], bl[1], gn], n.min(64), chunk)?;
            Some((tx, th, tc, tb))
        } else {
            None
        };
        let (kernel, args): (_, Vec<&dyn Arg>) = match &maps {
            Some((tx, th, tc, tb)) => (
                instances::compute_out_mma(true, p.chunk_starts != 0, t, s, n, ptile),
                vec![
                    tx, th, tc, tb, &p.b, &p.c, &p.dt, &p.da, &p.states, &p.d, &p.z, &p.y, &kp,
                ],
            ),
            None => (
                instances::compute_out_mma(false, p.chunk_starts != 0, t, s, n, ptile),
                vec![
                    &p.x, &p.b, &p.c, &p.dt, &p.da, &p.states, &p.d, &p.z, &p.y, &kp,
                ],
            ),
        };
        let f = function(stream, IMAGE, &kernel)?;
        return launch(stream, &f, cfg, &args);
    }
    let f = function(stream, IMAGE, &instances::compute_out_simt(t, s))?;
    let grid = [nchunks, d.batch * d.nheads, 1];
    launch(
        stream,
        &f,
        cfg(name, stream, grid, [256, 1, 1], 16 * chunk * 4)?,
        &[
            &p.x, &p.b, &p.c, &p.dt, &p.da, &p.states, &p.d, &p.z, &p.y, &kp,
        ],
    )
}
