//! Stage 2 of the SSD: the state entering every chunk, by the jump formula.
//!
//! With `d` = da_cumsum (log2 space) and `d_last` its value at a chunk's last token:
//!
//! ```text
//! h_{c+1} = exp2(d_last)·h_c + Σ_{s in chunk c} exp2(d_last − d_s)·dt_s · x_s B_sᵀ
//! ```
//!
//! Inputs `x [B,L,H,P]`, `b [B,L,G,N]`, `dt_out` and `da_cumsum` `[B,H,L]` f32 (stage 1),
//! optional `init_state [B,H,P,N]`. Output `states [B,H,C+1,P,N]`: entry `c` enters chunk `c`,
//! entry `C` is the final state; stored in f32 or bf16, carried in f32.
//!
//! Inside [`crate::ssd`] on the CPU the op also does stage 1 itself (raw dt in,
//! [`crate::chunk_cumsum`]'s outputs left beside the states); on the GPU `ssd` launches the
//! kernels itself, stage 1 inside the state pass's first kernel.

use std::borrow::Cow;

use candle_core::{
    CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Storage, Tensor,
};
use rayon::prelude::*;

use crate::check::{self, SsdDims};
use crate::chunk_cumsum::ChunkCumsum;
use crate::cpu::{self, MatMut, MatRef};
use crate::slot::Slot;

/// [`Steps`] on the CPU: the held da_cumsum, or stage 1's output.
enum CpuSteps<'a> {
    Given(cpu::Held<'a>),
    Raw(CpuStorage),
}

/// Where the step sizes of [`FwdPassState`] come from.
#[derive(Debug)]
pub(crate) enum Steps {
    /// chunk_cumsum's outputs: the op's third input is `dt_out`, `da_cumsum` is held here.
    Given(Tensor),
    /// Raw `dt [B,L,H]` (the op's third input, rows possibly spaced) and `a [H]`: the op runs
    /// `stage` itself and leaves its `[2,B,H,L]` output (dt_out, da_cumsum) in `steps_out` (on
    /// the CPU; the CUDA launcher refuses it, `ssd` there launching its kernels itself).
    Raw { a: Tensor, stage: ChunkCumsum },
}

/// The `fwd_pass_state` op on `(x, b, dt)`; the step sizes' other inputs and the initial state
/// are held here. With `final_state`, the op also leaves the final state `[B,H,P,N]` there as a
/// contiguous storage of its own (no strided copy out of the states afterwards).
#[derive(Debug)]
pub(crate) struct FwdPassState {
    pub steps: Steps,
    pub steps_out: Slot,
    pub init_state: Option<Tensor>,
    pub dims: SsdDims,
    pub chunk_size: usize,
    pub state_dtype: DType,
    pub final_state: Option<Slot>,
}

impl CustomOp3 for FwdPassState {
    fn name(&self) -> &'static str {
        "fwd_pass_state"
    }

    fn cpu_fwd(
        &self,
        x_s: &CpuStorage,
        x_l: &Layout,
        b_s: &CpuStorage,
        b_l: &Layout,
        dt_s: &CpuStorage,
        dt_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let SsdDims {
            batch,
            seqlen,
            nheads,
            headdim,
            ngroups,
            dstate,
        } = self.dims;
        let (t, hpg) = (self.chunk_size, self.dims.heads_per_group());
        let nchunks = self.dims.nchunks(t);
        let pn = headdim * dstate;
        let x = cpu::f32_view(op, "x", x_s, x_l)?;
        let b = cpu::f32_view(op, "b", b_s, b_l)?;
        let init = self.init_state.as_ref().map(cpu::Held::new);
        let init = init.as_ref().map(|h| h.f32(op, "init_state")).transpose()?;
        // dt_out and da_cumsum: given, or stage 1 run here (its output left for the caller at the
        // end).
        let steps = match &self.steps {
            Steps::Given(da_cumsum) => CpuSteps::Given(cpu::Held::new(da_cumsum)),
            Steps::Raw { a, stage } => {
                let (guard, a_l) = a.storage_and_layout();
                CpuSteps::Raw(
                    stage
                        .cpu_fwd(dt_s, dt_l, cpu::cpu(op, "a", &guard)?, a_l)?
                        .0,
                )
            }
        };
        let (dt, da) = match &steps {
            CpuSteps::Given(h) => (
                cpu::f32_view(op, "dt_out", dt_s, dt_l)?,
                h.f32(op, "da_cumsum")?,
            ),
            CpuSteps::Raw(both) => {
                let n = batch * nheads * seqlen;
                match cpu::f32_view(op, "steps", both, &Layout::contiguous(2 * n))? {
                    Cow::Borrowed(v) => (Cow::Borrowed(&v[..n]), Cow::Borrowed(&v[n..])),
                    Cow::Owned(v) => (Cow::Owned(v[..n].to_vec()), Cow::Owned(v[n..].to_vec())),
                }
            }
        };

        let mut states = vec![0f32; self.dims.chunk_states_len(t)];
        states
            .par_chunks_mut((nchunks + 1) * pn)
            .enumerate()
            .for_each(|(bh, st)| {
                let (bi, h) = (bh / nheads, bh % nheads);
                let g = h / hpg;
                if let Some(init) = &init {
                    st[..pn].copy_from_slice(&init[bh * pn..(bh + 1) * pn]);
                }
                let mut w = vec![0f32; t * dstate];
                for c in 0..nchunks {
                    let l0 = c * t;
                    let tc = t.min(seqlen - l0);
                    let row = (bi * nheads + h) * seqlen + l0;
                    let (d, dtv) = (&da[row..row + tc], &dt[row..row + tc]);
                    let d_last = d[tc - 1];
                    for s in 0..tc {
                        let scale = (d_last - d[s]).exp2() * dtv[s];
                        let bs = ((bi * seqlen + l0 + s) * ngroups + g) * dstate;
                        for (wv, bv) in w[s * dstate..(s + 1) * dstate].iter_mut().zip(&b[bs..]) {
                            *wv = bv * scale;
                        }
                    }
                    let (prev, next) = st[c * pn..(c + 2) * pn].split_at_mut(pn);
                    next.copy_from_slice(prev);
                    let x0 = ((bi * seqlen + l0) * nheads + h) * headdim;
                    cpu::gemm(
                        (headdim, dstate, tc),
                        MatMut {
                            data: next,
                            rs: dstate,
                            cs: 1,
                        },
                        MatRef {
                            data: &x[x0..],
                            rs: 1,
                            cs: nheads * headdim,
                        },
                        MatRef {
                            data: &w,
                            rs: dstate,
                            cs: 1,
                        },
                        Some(d_last.exp2()),
                    );
                }
            });
        if let Some(slot) = &self.final_state {
            let last = states
                .chunks(pn)
                .skip(nchunks)
                .step_by(nchunks + 1)
                .flatten()
                .copied()
                .collect();
            slot.put(op, Storage::Cpu(cpu::from_f32(last, self.state_dtype)?))?;
        }
        drop((dt, da));
        if let CpuSteps::Raw(both) = steps {
            self.steps_out.put(op, Storage::Cpu(both))?;
        }
        let shape = Shape::from((batch, nheads, nchunks + 1, headdim, dstate));
        Ok((cpu::from_f32(states, self.state_dtype)?, shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x_s: &candle_core::CudaStorage,
        x_l: &Layout,
        b_s: &candle_core::CudaStorage,
        b_l: &Layout,
        dt_s: &candle_core::CudaStorage,
        dt_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::fwd_pass_state(self, x_s, x_l, b_s, b_l, dt_s, dt_l)
    }
}

/// The chunk-entry states `[B,H,C+1,P,N]` in `state_dtype` (f32 or bf16).
///
/// `dt_out` and `da_cumsum` come from [`crate::chunk_cumsum`] with the same `chunk_size`;
/// `init_state [B,H,P,N]` (f32 or bf16) is the state before the first token (zeros if `None`).
pub fn fwd_pass_state(
    x: &Tensor,
    b: &Tensor,
    dt_out: &Tensor,
    da_cumsum: &Tensor,
    init_state: Option<&Tensor>,
    chunk_size: usize,
    state_dtype: DType,
) -> Result<Tensor> {
    let op = "fwd_pass_state";
    let dims = SsdDims::values(op, x, b)?;
    dims.per_token(op, "dt_out", dt_out, x)?;
    dims.per_token(op, "da_cumsum", da_cumsum, x)?;
    if let Some(s) = init_state {
        dims.state(op, "init_state", s, x)?;
    }
    let steps = Steps::Given(da_cumsum.contiguous()?);
    let stage = stage(dims, steps, init_state, chunk_size, state_dtype, false)?;
    x.contiguous()?
        .apply_op3_no_bwd(&b.contiguous()?, &dt_out.contiguous()?, &stage)
}

/// What [`steps_and_states`] makes.
pub(crate) struct StatePass {
    pub states: Tensor,
    pub final_state: Tensor,
    pub dt_out: Tensor,
    pub da_cumsum: Tensor,
}

/// Stages 1 and 2 of [`crate::ssd`] in one op, from raw `dt [B,L,H]` and `a [H]` (checked by
/// the caller).
pub(crate) fn steps_and_states(
    (x, b, dt, a, init_state): (&Tensor, &Tensor, &Tensor, &Tensor, Option<&Tensor>),
    cumsum: ChunkCumsum,
    state_dtype: DType,
) -> Result<StatePass> {
    let op = "fwd_pass_state";
    let dims = SsdDims::values(op, x, b)?;
    let chunk_size = cumsum.chunk_size;
    let steps = Steps::Raw {
        a: a.contiguous()?,
        stage: cumsum,
    };
    let stage = stage(dims, steps, init_state, chunk_size, state_dtype, true)?;
    let states =
        x.contiguous()?
            .apply_op3_no_bwd(&b.contiguous()?, &check::rows_view(dt)?, &stage)?;
    let (bsz, h, l) = (dims.batch, dims.nheads, dims.seqlen);
    let both = stage
        .steps_out
        .take(op, "dt_out and da_cumsum", (2, bsz, h, l))?;
    let last = stage
        .final_state
        .ok_or_else(|| candle_core::Error::Msg(format!("{op}: no final state was asked for")))?
        .take(op, "final state", (bsz, h, dims.headdim, dims.dstate))?;
    Ok(StatePass {
        states,
        final_state: last,
        dt_out: both.get(0)?,
        da_cumsum: both.get(1)?,
    })
}

/// The op for `dims` after the checks every caller shares.
fn stage(
    dims: SsdDims,
    steps: Steps,
    init_state: Option<&Tensor>,
    chunk_size: usize,
    state_dtype: DType,
    with_final: bool,
) -> Result<FwdPassState> {
    let op = "fwd_pass_state";
    check::chunk_size(op, chunk_size)?;
    check::state_dtype(op, "state_dtype", state_dtype)?;
    Ok(FwdPassState {
        steps,
        steps_out: Slot::default(),
        init_state: init_state
            .map(|s| s.to_dtype(state_dtype)?.contiguous())
            .transpose()?,
        dims,
        chunk_size,
        state_dtype,
        final_state: with_final.then(Slot::default),
    })
}
