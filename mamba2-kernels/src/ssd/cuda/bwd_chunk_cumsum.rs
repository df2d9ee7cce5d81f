//! Launcher of `kernels/ssd/bwd_chunk_cumsum.cu`, the backward of stage 1: processed-dt
//! gradients to raw dt and dt_bias, 256 tokens of one (batch, head) per program, and the sums of
//! bwd_compute_out's partial gradients of A and (per head) D.

use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::CudaStream;
use candle_core::Result;

use super::params::{SsdParams, SsdSteps};
use crate::cuda::{cfg, fatbin, function, launch, Image, Ty};
use crate::instances;

const IMAGE: Image = fatbin!("ssd_bwd_chunk_cumsum");

/// The partial sums bwd_compute_out leaves: A's `da_part [B,H,parts]` f32, into `grad_a [H]`;
/// D's `dd [H,P]` f32, into `d_head [H]` where D is per head (else 0).
pub(super) struct HeadSums {
    pub da_part: u64,
    pub parts: i32,
    pub grad_a: u64,
    pub dd: u64,
    pub d_head: u64,
}

/// `ddt [B,H,L]` f32 → `ddt_raw [B,L,H]` of raw dt's type `t` (read through `steps`, whose `out`
/// is unused), adding the bias's gradient into `dbias [H]` f32 (0: none), and the sums of `sums`
/// (`grad_a` and `dbias` start at zero).
pub(super) fn launch_bwd_stage1(
    p: &SsdParams,
    steps: &SsdSteps,
    t: Ty,
    (ddt, ddt_raw, dbias): (u64, u64, u64),
    sums: &HeadSums,
    stream: &Arc<CudaStream>,
) -> Result<()> {
    let f = function(stream, IMAGE, &instances::bwd_chunk_cumsum(t))?;
    let (seqlen, nheads, batch) = (p.seqlen as usize, p.nheads as usize, p.batch as usize);
    let grid = [seqlen.div_ceil(256), nheads, batch];
    let cfg = cfg("ssd backward", stream, grid, [256, 1, 1], 0)?;
    let s = sums;
    launch(
        stream,
        &f,
        cfg,
        &[
            &ddt, &ddt_raw, &dbias, &s.da_part, &s.parts, &s.grad_a, &s.dd, &s.d_head, steps, p,
        ],
    )
}
