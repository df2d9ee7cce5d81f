//! Launcher of `kernels/ssd/bwd_chunk_cumsum.cu`, the backward of stage 1: processed-dt
//! gradients to raw dt and dt_bias, 256 tokens of one (batch, head) per program.

use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::CudaStream;
use candle_core::Result;

use super::params::{SsdParams, SsdSteps};
use crate::cuda::{cfg, fatbin, function, launch, Image, Ty};
use crate::instances;

const IMAGE: Image = fatbin!("ssd_bwd_chunk_cumsum");

/// `ddt [B,H,L]` f32 → `ddt_raw [B,L,H]` of raw dt's type `t` (read through `steps`, whose `out`
/// is unused), adding the bias's gradient into `dbias [H]` f32 (0: none).
pub(super) fn launch_bwd_stage1(
    p: &SsdParams,
    steps: &SsdSteps,
    t: Ty,
    (ddt, ddt_raw, dbias): (u64, u64, u64),
    stream: &Arc<CudaStream>,
) -> Result<()> {
    let f = function(stream, IMAGE, &instances::bwd_chunk_cumsum(t))?;
    let (seqlen, nheads, batch) = (p.seqlen as usize, p.nheads as usize, p.batch as usize);
    let grid = [seqlen.div_ceil(256), nheads, batch];
    let cfg = cfg("ssd backward", stream, grid, [256, 1, 1], 0)?;
    launch(stream, &f, cfg, &[&ddt, &ddt_raw, &dbias, steps, p])
}
