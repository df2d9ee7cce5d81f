//! The SSD kernels' parameters, mirrored from `kernels/ssd/params.cuh` (sizes and offsets
//! asserted on both sides).

use candle_core::cuda_backend::cudarc::driver::DeviceRepr;
use candle_core::Result;

use crate::check::SsdDims;
use crate::cuda::{i, m2_layout};
use crate::dt::DtRule;

/// Sequences packed along L of the one row as the kernels take them: their count, and the
/// addresses of their first chunks (i32 `[seqs + 1]`) and of every chunk's first token (i32
/// `[nchunks + 1]`).
#[derive(Clone, Copy, Debug)]
pub(super) struct PackedPtrs {
    pub seqs: usize,
    pub firsts: u64,
    pub starts: u64,
}

/// `m2::SsdParams`: the dimensions and the launch's choices, taken by every SSD kernel.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct SsdParams {
    pub batch: i32,
    pub seqlen: i32,
    pub nheads: i32,
    pub headdim: i32,
    pub ngroups: i32,
    pub dstate: i32,
    pub chunk: i32,
    pub nchunks: i32,
    /// compute_out: heads per program.
    pub heads_per_block: i32,
    /// compute_out: D per channel (1) or per head (0).
    pub d_per_channel: i32,
    /// compute_out: its step 0 runs before it waits on the kernel before it.
    pub early: i32,
    /// compute_out: the states are `ssd`'s intermediates, read by no one after it: each tile's
    /// L2 lines are dropped once it has landed.
    pub discard_states: i32,
    /// state_scan: the chunk from which it lets the next kernel start.
    pub release_at: i32,
    /// The state pass over packed sequences: their count, 0 for none.
    pub seqs: i32,
    /// Its `[seqs + 1]` first chunks of the sequences (i32 on the device), 0 for none.
    pub seq_chunks: u64,
    /// Every chunk's first token, `[nchunks + 1]` (i32 on the device), 0 for chunks of `chunk`.
    pub chunk_starts: u64,
}
m2_layout!(SsdParams, 72, {
    batch: 0, seqlen: 4, nheads: 8, headdim: 12, ngroups: 16, dstate: 20, chunk: 24,
    nchunks: 28, heads_per_block: 32, d_per_channel: 36, early: 40, discard_states: 44,
    release_at: 48, seqs: 52, seq_chunks: 56, chunk_starts: 64,
});
// SAFETY: plain old data with the C struct's layout (asserted above).
unsafe impl DeviceRepr for SsdParams {}

impl SsdParams {
    /// The dimensions of `d` with chunks of `chunk`; every choice off, the scan releasing at its
    /// end.
    pub fn new(d: &SsdDims, chunk: usize) -> Result<Self> {
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
            seqs: 0,
            seq_chunks: 0,
            chunk_starts: 0,
        })
    }

    /// The packed sequences' tables of `p`, if any.
    pub fn packed(mut self, p: Option<PackedPtrs>) -> Result<Self> {
        if let Some(p) = p {
            (self.seqs, self.seq_chunks, self.chunk_starts) = (i(p.seqs)?, p.firsts, p.starts);
        }
        Ok(self)
    }

    /// The dimensions stage 1 reads (chunk_cumsum on its own: dt `[B,L,H]`).
    pub fn stage1(batch: usize, seqlen: usize, nheads: usize, chunk: usize) -> Result<Self> {
        let dims = SsdDims {
            batch,
            seqlen,
            nheads,
            headdim: 1,
            ngroups: 1,
            dstate: 1,
            chunks: None,
        };
        Self::new(&dims, chunk)
    }
}

/// `m2::SsdSteps`: stage 1's inputs and outputs as addresses — raw dt (rows `dt_stride`
/// elements apart), a, the bias (0: none), out = `[dt_out; da_cumsum]` — and its rule.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct SsdSteps {
    pub dt: u64,
    pub a: u64,
    pub bias: u64,
    pub out: u64,
    pub dt_stride: i64,
    pub softplus: i32,
    pub lo: f32,
    pub hi: f32,
}
m2_layout!(SsdSteps, 56, {
    dt: 0, a: 8, bias: 16, out: 24, dt_stride: 32, softplus: 40, lo: 44, hi: 48,
});
// SAFETY: plain old data with the C struct's layout (asserted above).
unsafe impl DeviceRepr for SsdSteps {}

impl SsdSteps {
    pub fn new(rule: DtRule, (dt, dt_stride): (u64, i64), a: u64, bias: u64, out: u64) -> Self {
        Self {
            dt,
            a,
            bias,
            out,
            dt_stride,
            softplus: rule.softplus as i32,
            lo: rule.limit.0,
            hi: rule.limit.1,
        }
    }
}
