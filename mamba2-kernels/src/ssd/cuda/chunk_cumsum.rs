//! Launcher of `kernels/ssd/chunk_cumsum.cu`, stage 1 on its own: one warp per (batch, chunk,
//! head), up to eight heads per program.

use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::CudaStream;
use candle_core::Result;

use super::params::{SsdParams, SsdSteps};
use crate::cuda::{cfg, fatbin, function, launch, Image, Ty};
use crate::instances;

const IMAGE: Image = fatbin!("ssd_chunk_cumsum");

/// Stage 1 from raw dt of type `t` (`steps`) for the dimensions of `p` into `steps.out`.
pub(super) fn launch_stage1(
    p: &SsdParams,
    steps: &SsdSteps,
    t: Ty,
    stream: &Arc<CudaStream>,
) -> Result<()> {
    let f = function(stream, IMAGE, &instances::chunk_cumsum(t))?;
    // The dimensions came in as usize, checked into i32.
    let (nchunks, batch, nheads) = (p.nchunks as usize, p.batch as usize, p.nheads as usize);
    let warps = nheads.min(8);
    let grid = [nchunks, batch, nheads.div_ceil(warps)];
    let cfg = cfg("chunk_cumsum", stream, grid, [32, warps, 1], 0)?;
    launch(stream, &f, cfg, &[steps, p])
}
