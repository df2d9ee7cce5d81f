//! Launcher of `kernels/ssd/fwd_pass_state.cu`, the state pass: bf16/f16 values on tensor cores
//! as a pair of kernels (chunk_state_mma: every chunk's own state in parallel, stage 1 inside its
//! `_cs` forms; then state_scan: the recurrence across chunks), everything else on the SIMT
//! kernel (`ssd::plan` says which). On sm_90+ chunk_state_mma takes x and b as TMA tensor maps:
//! one thread copies a tile instead of every thread a part.

use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::CudaStream;
use candle_core::{DType, Result};

use super::chunk_cumsum::launch_stage1;
use super::params::{PackedPtrs, SsdParams, SsdSteps};
use crate::check::SsdDims;
use crate::cuda::tensor_map::tokens;
use crate::cuda::{cfg, fatbin, function, has_tma, i, launch, max_smem, sm_count, ty, Arg, Image};
use crate::instances::{self, ChunkStateForm};
use crate::ssd::plan;

pub(super) const IMAGE: Image = fatbin!("ssd_fwd_pass_state");

/// A state pass's tensors as addresses: x, b, the initial state (0: zeros), the chunk states,
/// and dt_out and da_cumsum (read, or written by stage 1 when the step sizes are raw); for
/// sequences packed along L of the one row, their tables, each sequence then running from its
/// own initial state.
pub(super) struct PassPtrs {
    pub x: u64,
    pub b: u64,
    pub init: u64,
    pub states: u64,
    pub dt: u64,
    pub da: u64,
    pub packed: Option<PackedPtrs>,
}

/// Raw step sizes for stage 1 (`steps.out` = [dt_out; da_cumsum]), of dtype `dtype`.
pub(super) struct RawSteps {
    pub steps: SsdSteps,
    pub dtype: DType,
}

/// Launches a state pass with values of type `vt` and states of type `st`: with `raw` step
/// sizes, stage 1 first (inside chunk_state_mma's `_cs` forms, else by the chunk_cumsum kernel);
/// then the chunk states. `before_last` runs once the first kernel is on its way and gives the
/// final state's address (0: none), after allocating whatever the caller needs before the last
/// kernel (`ssd`: compute_out's output, so that nothing comes between that kernel and
/// compute_out in the stream — in a captured graph an allocation is a node of its own).
pub(super) fn state_pass(
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
    let mut kp = SsdParams::new(d, chunk)?.packed(p.packed)?;
    let (t, s) = (ty(name, vt)?, ty(name, st)?);
    // The scan's program rows: one per (batch, head), or per (sequence, head) when packed.
    let rows = match p.packed {
        Some(q) => SsdDims {
            batch: q.seqs,
            ..*d
        },
        None => *d,
    };
    let bh = rows.batch * rows.nheads;
    let Some(tile) = chunk_state_tile(d, chunk, (vt, st), p, stream)? else {
        if let Some(raw) = raw {
            launch_stage1(&kp, &raw.steps, ty(name, raw.dtype)?, stream)?;
        }
        let last_p = before_last()?;
        let f = function(stream, IMAGE, &instances::fwd_pass_state_simt(t, s))?;
        let grid = [(d.headdim * d.dstate).div_ceil(256), bh, 1];
        return launch(
            stream,
            &f,
            cfg(name, stream, grid, [256, 1, 1], chunk * 4)?,
            &[&p.x, &p.b, &p.dt, &p.da, &p.init, &p.states, &last_p, &kp],
        );
    };
    // Every chunk's own contribution in parallel (stage 1 on the way when the step sizes are raw
    // dt of the values' type and the grid is small enough), then the scan across chunks.
    let programs = tile.programs(d, chunk);
    let sms = sm_count(stream)?;
    let fused = match raw {
        Some(r) if r.dtype == vt && programs <= plan::FUSE_PROGRAMS_PER_SM * sms => Some(r.steps),
        Some(r) => {
            launch_stage1(&kp, &r.steps, ty(name, r.dtype)?, stream)?;
            None
        }
        None => None,
    };
    launch_chunk_state(d, chunk, &tile, (vt, st), p, fused.as_ref(), stream)?;
    let last_p = before_last()?;
    let deep = plan::deep_scan(&rows, sms);
    let f = function(
        stream,
        IMAGE,
        &instances::state_scan(deep, p.packed.is_some(), s),
    )?;
    if p.packed.is_none() {
        // Packed, a program's chunks are its sequence's: the scan releases compute_out at its end.
        kp.release_at = i(plan::scan_release_at(deep, nchunks))?;
    }
    let grid = [(d.headdim * d.dstate / 8).div_ceil(256), bh, 1];
    launch(
        stream,
        &f,
        cfg(name, stream, grid, [256, 1, 1], 0)?,
        &[&p.da, &p.init, &p.states, &last_p, &kp],
    )
}

/// The tile of chunk_state_mma for values of type `vt` and states of type `st`, or `None` where
/// none fits (f32 values, odd sizes, addresses not 16-byte aligned): the SIMT kernel's case.
pub(super) fn chunk_state_tile(
    d: &SsdDims,
    chunk: usize,
    (vt, st): (DType, DType),
    p: &PassPtrs,
    stream: &Arc<CudaStream>,
) -> Result<Option<plan::ChunkStateTile>> {
    let aligned = [p.x, p.b, p.init].iter().all(|a| a % 16 == 0);
    let t = ty("fwd_pass_state", vt)?;
    let max = max_smem(stream)?;
    Ok(plan::chunk_state_tile(
        d,
        chunk,
        t,
        st.size_in_bytes(),
        aligned,
        max,
    ))
}

/// Launches chunk_state_mma on `tile`: every chunk's own term Σ_s exp2(d_last − d_s)·dt_s ·
/// x_s B_sᵀ into slot c + 1 of `p.states`, from `p.dt` and `p.da`, or (`fused`) from raw step
/// sizes, stage 1 on the way.
pub(super) fn launch_chunk_state(
    d: &SsdDims,
    chunk: usize,
    tile: &plan::ChunkStateTile,
    (vt, st): (DType, DType),
    p: &PassPtrs,
    fused: Option<&SsdSteps>,
    stream: &Arc<CudaStream>,
) -> Result<()> {
    let name = "fwd_pass_state";
    let kp = SsdParams::new(d, chunk)?.packed(p.packed)?;
    let (t, s) = (ty(name, vt)?, ty(name, st)?);
    let max = max_smem(stream)?;
    let programs = tile.programs(d, chunk);
    // On sm_90+ the x and b tiles come by tensor map (one thread issues the copies), their
    // shared tiles aligned to 1024 bytes instead of 128.
    let tma = has_tma(stream)? && tile.tma_smem() <= max;
    let maps = if tma {
        let rows = plan::box_rows(chunk);
        let (bl, hp, gn) = (
            [d.batch, d.seqlen],
            d.nheads * d.headdim,
            d.ngroups * d.dstate,
        );
        let tx = tokens(p.x, vt, [bl[0], bl[1], hp], 16 * tile.warps, rows)?;
        let tb = tokens(p.b, vt, [bl[0], bl[1], gn], tile.nt.min(64), rows)?;
        Some((tx, tb, i(rows)?))
    } else {
        None
    };
    let smem = if tma { tile.tma_smem() } else { tile.smem };
    let launch_cfg = cfg(
        name,
        stream,
        [programs, 1, 1],
        [32 * tile.warps, 1, 1],
        smem,
    )?;
    let (form, args): (_, Vec<&dyn Arg>) = match (fused, &maps) {
        (Some(ks), Some((tx, tb, rows))) => (
            ChunkStateForm::TmaCs,
            vec![tx, tb, rows, &p.states, &kp, ks],
        ),
        (None, Some((tx, tb, rows))) => (
            ChunkStateForm::Tma,
            vec![tx, tb, rows, &p.dt, &p.da, &p.states, &kp],
        ),
        (Some(ks), None) => (ChunkStateForm::Cs, vec![&p.x, &p.b, &p.states, &kp, ks]),
        (None, None) => (
            ChunkStateForm::Plain,
            vec![&p.x, &p.b, &p.dt, &p.da, &p.states, &kp],
        ),
    };
    let f = function(stream, IMAGE, &tile.kernel(form, p.packed.is_some(), t, s))?;
    launch(stream, &f, launch_cfg, &args)
}
