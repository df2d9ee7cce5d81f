//! Launcher of `kernels/ssd/bwd_pass_state.cu`, the backward state pass: every chunk's own
//! state gradient `(dY)ᵀ·(exp2(d)∘C)` in parallel (bwd_chunk_state, where the caller has not
//! written them with the forward's chunk_state_mma), then the scan across chunks from the last
//! (bwd_state_scan), which leaves each chunk's exit-state gradient in place of its own term and
//! writes the initial state's gradient.

use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::CudaStream;
use candle_core::{bail, Result};

use super::params::SsdParams;
use crate::cuda::{cfg, fatbin, function, launch, Image, Ty};
use crate::instances;

const IMAGE: Image = fatbin!("ssd_bwd_pass_state");

/// Tokens per chunk of bwd_chunk_state and per program of bwd_compute_out (any forward chunk: the
/// SSD's results do not depend on it); bwd_state_scan takes its chunk from the parameters.
pub(super) const TOKENS: usize = 64;

/// The addresses the pass reads and writes: dy, c, da_cumsum, the final state's gradient (0:
/// zero), the chunk gradients `[B,H,C+1,P,N]` (chunk c in slot c + 1) and the initial state's
/// gradient (0: not needed).
pub(super) struct BwdStatePtrs {
    pub dy: u64,
    pub c: u64,
    pub da: u64,
    pub dlast: u64,
    pub dstates: u64,
    pub dinit: u64,
}

/// Shared memory of bwd_chunk_state: dY and exp2(d)∘C tiles padded to 64 columns, the scales.
fn chunk_state_smem(p: &SsdParams, t: Ty) -> usize {
    let (pp, np) = (pad(p.headdim), pad(p.dstate));
    TOKENS * (pp + 8 + np + 8) * t.bytes() + TOKENS * 4 + 128
}

/// `v` rounded up to a multiple of 64.
pub(super) fn pad(v: i32) -> usize {
    (v as usize).next_multiple_of(64)
}

/// Launches the scan with chunk gradients of type `s`, after bwd_chunk_state (values of type
/// `t`) where `own_terms` (else the caller has written the chunk terms).
pub(super) fn bwd_state_pass(
    p: &SsdParams,
    (t, s): (Ty, Ty),
    q: &BwdStatePtrs,
    own_terms: bool,
    stream: &Arc<CudaStream>,
) -> Result<()> {
    let name = "ssd backward";
    let bh = p.batch as usize * p.nheads as usize;
    if own_terms {
        if p.chunk as usize != TOKENS {
            bail!(
                "{name}: bwd_chunk_state takes chunks of {TOKENS} tokens, not {}",
                p.chunk
            )
        }
        let f = function(stream, IMAGE, &instances::bwd_chunk_state(t, s))?;
        let smem = chunk_state_smem(p, t);
        let grid = [p.nchunks as usize * bh, 1, 1];
        let c = cfg(name, stream, grid, [128, 1, 1], smem)?;
        launch(stream, &f, c, &[&q.dy, &q.c, &q.da, &q.dstates, p])?;
    }
    // 8 elements per thread where a state's row allows it, else one.
    let pn = p.headdim as usize * p.dstate as usize;
    let wide = pn % 8 == 0;
    let per_thread = if wide { 8 } else { 1 };
    let f = function(stream, IMAGE, &instances::bwd_state_scan(wide, s))?;
    let c = cfg(
        name,
        stream,
        [pn.div_ceil(per_thread).div_ceil(256), bh, 1],
        [256, 1, 1],
        0,
    )?;
    launch(stream, &f, c, &[&q.da, &q.dlast, &q.dstates, &q.dinit, p])
}
