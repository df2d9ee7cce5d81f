//! Stage 3 of the SSD: the outputs of every chunk, its three terms fused.
//!
//! For the tokens `t, s` of one chunk, `d` = da_cumsum (log2 space), entry state `h_c`:
//!
//! ```text
//! Y[t] = exp2(d_t)·(h_c C_t) + Σ_{s ≤ t} exp2(d_t − d_s)·(C_t·B_s)·dt_s·x_s + D·x_t
//! Y[t] ← Y[t]·silu(z_t)                                          (when z is given)
//! ```
//!
//! `C·Bᵀ` depends on the group only, so it is formed once per (batch, chunk, group) and reused by
//! the group's heads; the causal mask is an index compare, so no masked exponential is evaluated.
//! Inputs `x [B,L,H,P]`, `b, c [B,L,G,N]`, `dt_out, da_cumsum [B,H,L]` f32, `states [B,H,C+1,P,N]`,
//! optional `D [H] | [H,P]` f32 and `z [B,L,H,P]`. Output `y [B,L,H,P]` in x's dtype.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::check::{self, SsdDims};
use crate::cpu::{self, MatMut, MatRef};

/// The `compute_out` op on `(x, c, states)`; the other inputs are held here.
#[derive(Debug)]
pub(crate) struct ComputeOut {
    pub b: Tensor,
    pub dt_out: Tensor,
    pub da_cumsum: Tensor,
    pub d: Option<Tensor>,
    pub z: Option<Tensor>,
    pub dims: SsdDims,
    pub chunk_size: usize,
}

impl CustomOp3 for ComputeOut {
    fn name(&self) -> &'static str {
        "compute_out"
    }

    fn cpu_fwd(
        &self,
        x_s: &CpuStorage,
        x_l: &Layout,
        c_s: &CpuStorage,
        c_l: &Layout,
        st_s: &CpuStorage,
        st_l: &Layout,
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
        let (hp, gn, pn) = (nheads * headdim, ngroups * dstate, headdim * dstate);
        let x = cpu::f32_view(op, "x", x_s, x_l)?;
        let c = cpu::f32_view(op, "c", c_s, c_l)?;
        let states = cpu::f32_view(op, "states", st_s, st_l)?;
        let held = (
            cpu::Held::new(&self.b),
            cpu::Held::new(&self.dt_out),
            cpu::Held::new(&self.da_cumsum),
            self.z.as_ref().map(cpu::Held::new),
        );
        let b = held.0.f32(op, "b")?;
        let dt = held.1.f32(op, "dt_out")?;
        let da = held.2.f32(op, "da_cumsum")?;
        let z = held.3.as_ref().map(|h| h.f32(op, "z")).transpose()?;
        let d = self.d.as_ref().map(cpu::small_f32).transpose()?;
        let d_per_channel = d.as_ref().is_some_and(|d| d.len() == hp);

        let mut y = vec![0f32; batch * seqlen * hp];
        y.par_chunks_mut(seqlen * hp)
            .enumerate()
            .for_each(|(bi, yb)| {
                yb.par_chunks_mut(t * hp).enumerate().for_each(|(ci, yc)| {
                    let (l0, tc) = (ci * t, yc.len() / hp);
                    let mut cb = vec![0f32; tc * tc];
                    let mut m = vec![0f32; tc * tc];
                    let bc0 = (bi * seqlen + l0) * gn;
                    for g in 0..ngroups {
                        let cg = MatRef {
                            data: &c[bc0 + g * dstate..],
                            rs: gn,
                            cs: 1,
                        };
                        cpu::gemm(
                            (tc, tc, dstate),
                            MatMut {
                                data: &mut cb,
                                rs: tc,
                                cs: 1,
                            },
                            cg,
                            MatRef {
                                data: &b[bc0 + g * dstate..],
                                rs: 1,
                                cs: gn,
                            },
                            None,
                        );
                        for h in g * hpg..(g + 1) * hpg {
                            let row = (bi * nheads + h) * seqlen + l0;
                            let (d_t, dtv) = (&da[row..row + tc], &dt[row..row + tc]);
                            let s0 = ((bi * nheads + h) * (nchunks + 1) + ci) * pn;
                            let yh = &mut yc[h * headdim..];
                            cpu::gemm(
                                (tc, headdim, dstate),
                                MatMut {
                                    data: yh,
                                    rs: hp,
                                    cs: 1,
                                },
                                cg,
                                MatRef {
                                    data: &states[s0..s0 + pn],
                                    rs: 1,
                                    cs: dstate,
                                },
                                None,
                            );
                            for (tt, d) in d_t.iter().enumerate() {
                                let decay = d.exp2();
                                for v in &mut yh[tt * hp..tt * hp + headdim] {
                                    *v *= decay;
                                }
                            }
                            for tt in 0..tc {
                                let mrow = &mut m[tt * tc..(tt + 1) * tc];
                                for s in 0..=tt {
                                    mrow[s] = cb[tt * tc + s] * (d_t[tt] - d_t[s]).exp2() * dtv[s];
                                }
                                mrow[tt + 1..].fill(0.0);
                            }
                            let x0 = ((bi * seqlen + l0) * nheads + h) * headdim;
                            cpu::gemm(
                                (tc, headdim, tc),
                                MatMut {
                                    data: &mut yc[h * headdim..],
                                    rs: hp,
                                    cs: 1,
                                },
                                MatRef {
                                    data: &m,
                                    rs: tc,
                                    cs: 1,
                                },
                                MatRef {
                                    data: &x[x0..],
                                    rs: hp,
                                    cs: 1,
                                },
                                Some(1.0),
                            );
                            for tt in 0..tc {
                                let o = tt * hp + h * headdim;
                                let xo = x0 + tt * hp;
                                for p in 0..headdim {
                                    let mut v = yc[o + p];
                                    if let Some(d) = &d {
                                        let dv = if d_per_channel {
                                            d[h * headdim + p]
                                        } else {
                                            d[h]
                                        };
                                        v += dv * x[xo + p];
                                    }
                                    if let Some(z) = &z {
                                        let zv = z[xo + p];
                                        v *= zv / (1.0 + (-zv).exp());
                                    }
                                    yc[o + p] = v;
                                }
                            }
                        }
                    }
                })
            });
        let shape = Shape::from((batch, seqlen, nheads, headdim));
        Ok((cpu::from_f32(y, x_s.dtype())?, shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x_s: &candle_core::CudaStorage,
        x_l: &Layout,
        c_s: &candle_core::CudaStorage,
        c_l: &Layout,
        st_s: &candle_core::CudaStorage,
        st_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::compute_out(self, x_s, x_l, c_s, c_l, st_s, st_l)
    }
}

/// The SSD outputs `y [B,L,H,P]` (x's dtype) from the chunk states of [`crate::fwd_pass_state`].
///
/// `d` is the skip term, `[H]` or `[H,P]` f32; with `z [B,L,H,P]` the output is `y·silu(z)`.
#[allow(clippy::too_many_arguments)]
pub fn compute_out(
    x: &Tensor,
    b: &Tensor,
    c: &Tensor,
    dt_out: &Tensor,
    da_cumsum: &Tensor,
    states: &Tensor,
    d: Option<&Tensor>,
    z: Option<&Tensor>,
    chunk_size: usize,
) -> Result<Tensor> {
    let op = "compute_out";
    let dims = SsdDims::values(op, x, b)?;
    dims.like_b(op, "c", c, x)?;
    dims.per_token(op, "dt_out", dt_out, x)?;
    dims.per_token(op, "da_cumsum", da_cumsum, x)?;
    check::chunk_size(op, chunk_size)?;
    check::device(op, "states", states, x)?;
    let (h, p, n, nc) = (
        dims.nheads,
        dims.headdim,
        dims.dstate,
        dims.nchunks(chunk_size),
    );
    check::shape(
        op,
        "states",
        states,
        &[dims.batch, h, nc + 1, p, n],
        "[B, H, C+1, P, N]",
    )?;
    check::state_dtype(op, "states", states.dtype())?;
    if let Some(d) = d {
        check::skip_param(op, d, x, h, p)?;
    }
    if let Some(z) = z {
        dims.like_x(op, "z", z, x)?;
    }
    let stage = ComputeOut {
        b: b.contiguous()?,
        dt_out: dt_out.contiguous()?,
        da_cumsum: da_cumsum.contiguous()?,
        d: d.map(|d| d.contiguous()).transpose()?,
        z: z.map(|z| z.contiguous()).transpose()?,
        dims,
        chunk_size,
    };
    x.contiguous()?
        .apply_op3_no_bwd(&c.contiguous()?, &states.contiguous()?, &stage)
}
