//! Launcher of `kernels/ssd/bwd_bc.cu`: dB and dC of the SSD backward, summed over each group's
//! heads inside one program per (chunk of 128 tokens, batch, group) and written once in the value
//! type. It runs where bwd_compute_out's `_tma` form can leave them to it: bf16 values, P = 64, N
//! of 128 or 256, the states at chunks of 128 tokens, two heads or more per group, sm_90a.

use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::CudaStream;
use candle_core::Result;

use super::bwd_compute_out::BwdOutPtrs;
use super::params::SsdParams;
use crate::cuda::{cfg, fatbin, function, launch, max_smem, Image, Ty};
use crate::instances::{self, BWD_BC_DSTATES};

const IMAGE: Image = fatbin!("ssd_bwd_bc");

/// Tokens per program (the kernel's `Q`): the state chunk it reads the states at.
const CHUNK: usize = 128;

/// Threads per program (the kernel's `THREADS`: two warpgroups).
const THREADS: usize = 256;

/// Shared memory of one program: B's and C's block, Σ, two slots of a head's x and dY ([128, 64]
/// bf16 each; Σ two of them) and per-token sums, the states' blocks ([64, 64]: bf16 per slot, or
/// one bf16 pair and f32 rows per slot), and 1024 bytes to align the swizzled tiles.
fn smem(s: Ty) -> usize {
    let (tile, block) = (CHUNK * 64, 64 * 64);
    let states = match s {
        Ty::Bf16 => 2 * 2 * block * 2,
        _ => 2 * block * 2 + 2 * 2 * block * 4,
    };
    8 * tile * 2 + states + 2 * 2 * CHUNK * 4 + 1024
}

/// Whether bwd_bc takes this call's dB and dC: bf16 values, P = 64, N it has kernels for, states
/// at chunks of 128 tokens, bf16 or f32 states, bwd_compute_out's `_tma` form running (`tma`,
/// which is sm_90a's), and two heads or more per group (B's and C's block is taken with a group's
/// last head, while the block before is still read with the one before it).
pub(super) fn takes(p: &SsdParams, (t, s): (Ty, Ty), tma: bool) -> bool {
    tma && t == Ty::Bf16
        && matches!(s, Ty::Bf16 | Ty::F32)
        && p.headdim == 64
        && p.chunk as usize == CHUNK
        && BWD_BC_DSTATES.contains(&(p.dstate as usize))
        && p.nheads >= 2 * p.ngroups
}

/// Reads bwd_compute_out's inputs in `q` (x, dY, B and C bf16; the processed steps and their
/// cumulative sums f32; the states and their gradients of type `s`) and writes `db` and `dc`
/// (bf16; `q.db` and `q.dc` are not read).
pub(super) fn launch_bwd_bc(
    p: &SsdParams,
    s: Ty,
    q: &BwdOutPtrs,
    (db, dc): (u64, u64),
    stream: &Arc<CudaStream>,
) -> Result<()> {
    let name = "ssd backward";
    let bytes = smem(s);
    let max = max_smem(stream)?;
    if bytes > max {
        candle_core::bail!(
            "{name}: bwd_bc's tiles take {bytes} bytes of shared memory, over the device's {max}"
        )
    }
    let n = p.dstate as usize;
    let programs = (p.seqlen as usize).div_ceil(CHUNK) * p.batch as usize * p.ngroups as usize;
    let c = cfg(name, stream, [programs, 1, 1], [THREADS, 1, 1], bytes)?;
    let f = function(stream, IMAGE, &instances::bwd_bc(s, n))?;
    let args: [&dyn crate::cuda::Arg; 11] = [
        &q.x, &q.dy, &q.b, &q.c, &q.dt, &q.da, &q.states, &q.dstates, &db, &dc, p,
    ];
    launch(stream, &f, c, &args)
}
