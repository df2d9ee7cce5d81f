//! Stage 1 of the SSD: step sizes and per-chunk cumulative sums of `a·dt`, in log2 space.
//!
//! ```text
//! dt_out[b,h,l]    = clamp(softplus(dt[b,l,h] + dt_bias[h]), lo, hi)
//! da_cumsum[b,h,l] = log2(e) · Σ_{s = start of l's chunk ..= l} a[h]·dt_out[b,h,s]
//! ```
//!
//! Inputs `dt [B,L,H]` (f32/f16/bf16), `a [H]` f32. Both outputs are `[B,H,L]` f32, contiguous
//! per head, so later stages read a head's chunk as one run; downstream uses `exp2`.

use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::{check, cpu, dt, DtOptions};

/// The `chunk_cumsum` op on `(dt, a)`; output `[2,B,H,L]` f32 = (dt_out, da_cumsum).
#[derive(Clone, Debug)]
pub(crate) struct ChunkCumsum {
    pub dt_bias: Option<Tensor>,
    pub dt_softplus: bool,
    pub dt_limit: (f32, f32),
    pub chunk_size: usize,
}

impl CustomOp2 for ChunkCumsum {
    fn name(&self) -> &'static str {
        "chunk_cumsum"
    }

    fn cpu_fwd(
        &self,
        dt_s: &CpuStorage,
        dt_l: &Layout,
        a_s: &CpuStorage,
        a_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let &[batch, seqlen, nheads] = dt_l.dims() else {
            candle_core::bail!("{op}: dt must have rank 3 [B, L, H], got {:?}", dt_l.dims())
        };
        let dt_in = cpu::f32_view(op, "dt", dt_s, dt_l)?;
        let a = cpu::f32_view(op, "a", a_s, a_l)?;
        let bias = match &self.dt_bias {
            Some(t) => cpu::small_f32(t)?,
            None => vec![0.0; nheads],
        };
        let mut out = vec![0f32; 2 * batch * nheads * seqlen];
        let (dt_out, da_out) = out.split_at_mut(batch * nheads * seqlen);
        dt_out
            .par_chunks_mut(seqlen)
            .zip(da_out.par_chunks_mut(seqlen))
            .enumerate()
            .for_each(|(bh, (dts, das))| {
                let (bi, h) = (bh / nheads, bh % nheads);
                let mut acc = 0f32;
                for (l, (dto, dao)) in dts.iter_mut().zip(das.iter_mut()).enumerate() {
                    if l % self.chunk_size == 0 {
                        acc = 0.0;
                    }
                    let raw = dt_in[(bi * seqlen + l) * nheads + h];
                    let v = dt::process(raw, bias[h], self.dt_softplus, self.dt_limit);
                    acc += a[h] * v;
                    *dto = v;
                    *dao = acc * std::f32::consts::LOG2_E;
                }
            });
        Ok((
            CpuStorage::F32(out),
            Shape::from((2, batch, nheads, seqlen)),
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dt_s: &candle_core::CudaStorage,
        dt_l: &Layout,
        a_s: &candle_core::CudaStorage,
        a_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::chunk_cumsum(self, dt_s, dt_l, a_s, a_l)
    }
}

/// Processes `dt [B,L,H]` and returns `(dt_out, da_cumsum)`, both `[B,H,L]` f32.
///
/// `a [H]` is f32 (`a = −exp(A_log)`); the sums restart at every multiple of `chunk_size` (a power
/// of two ≥ 16) and are scaled by log2(e).
pub fn chunk_cumsum(
    dt: &Tensor,
    a: &Tensor,
    opts: &DtOptions,
    chunk_size: usize,
) -> Result<(Tensor, Tensor)> {
    let op = "chunk_cumsum";
    let [_, _, nheads] = check::rank::<3>(op, "dt", dt, "[B, L, H]")?;
    check::float(op, "dt", dt)?;
    check::head_param(op, "a", a, dt, nheads)?;
    opts.check(op, dt, nheads)?;
    check::chunk_size(op, chunk_size)?;
    let stage = ChunkCumsum {
        dt_bias: opts.bias.map(|b| b.contiguous()).transpose()?,
        dt_softplus: opts.softplus,
        dt_limit: opts.limit,
        chunk_size,
    };
    let both = check::rows_view(dt)?.apply_op2_no_bwd(&a.contiguous()?, &stage)?;
    Ok((both.get(0)?, both.get(1)?))
}
