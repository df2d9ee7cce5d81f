//! The three SSD stages on the CPU, on contiguous slices of the compute type (f32, or f64 for
//! f64 values; the layouts of the module doc), parallel over (batch, head) or (batch, chunk)
//! with rayon; the chunk products are strided single-threaded GEMMs ([`crate::cpu::gemm`]).

use rayon::prelude::*;

use crate::check::SsdDims;
use crate::cpu::{gemm, MatMut, MatRef, Real};
use crate::dt::{self, DtRule};
use crate::fastexp::vectorised;

/// Stage 1: `[dt_out; da_cumsum]`, each `[B,H,L]`, from raw `dt [B,L,H]`, `a [H]` and the bias
/// `[H]` (zeros when absent).
pub(super) fn chunk_cumsum<T: Real>(
    dt_in: &[T],
    (batch, seqlen, nheads): (usize, usize, usize),
    a: &[T],
    bias: &[T],
    rule: DtRule,
    chunk: usize,
) -> Vec<T> {
    let log2e = T::from_f64(std::f64::consts::LOG2_E).unwrap_or_else(T::nan);
    let mut out = vec![T::zero(); 2 * batch * nheads * seqlen];
    let (dt_out, da_out) = out.split_at_mut(batch * nheads * seqlen);
    dt_out
        .par_chunks_mut(seqlen)
        .zip(da_out.par_chunks_mut(seqlen))
        .enumerate()
        .for_each(|(bh, (dts, das))| {
            let (bi, h) = (bh / nheads, bh % nheads);
            let mut acc = T::zero();
            for (l, (dto, dao)) in dts.iter_mut().zip(das.iter_mut()).enumerate() {
                if l % chunk == 0 {
                    acc = T::zero();
                }
                let v = dt::process(dt_in[(bi * seqlen + l) * nheads + h], bias[h], rule);
                acc += a[h] * v;
                *dto = v;
                *dao = acc * log2e;
            }
        });
    out
}

/// Stage 2: the chunk states `[B,H,C+1,P,N]` from `x`, `b`, stage 1's `dt_out` and `da_cumsum`
/// and the initial state `[B,H,P,N]` (zeros when absent).
pub(super) fn chunk_states<T: Real>(
    (x, b): (&[T], &[T]),
    (dt, da): (&[T], &[T]),
    init: Option<&[T]>,
    dims: &SsdDims,
    chunk: usize,
) -> Vec<T> {
    let SsdDims {
        seqlen,
        nheads,
        headdim,
        ngroups,
        dstate,
        ..
    } = *dims;
    let (t, hpg, nchunks) = (chunk, dims.heads_per_group(), dims.nchunks(chunk));
    let pn = headdim * dstate;
    let mut states = vec![T::zero(); dims.chunk_states_len(t)];
    states
        .par_chunks_mut((nchunks + 1) * pn)
        .enumerate()
        .for_each(|(bh, st)| {
            let (bi, h) = (bh / nheads, bh % nheads);
            let g = h / hpg;
            if let Some(init) = init {
                st[..pn].copy_from_slice(&init[bh * pn..(bh + 1) * pn]);
            }
            let mut w = vec![T::zero(); t.min(seqlen) * dstate];
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
                        *wv = *bv * scale;
                    }
                }
                let (prev, next) = st[c * pn..(c + 2) * pn].split_at_mut(pn);
                next.copy_from_slice(prev);
                let x0 = ((bi * seqlen + l0) * nheads + h) * headdim;
                gemm(
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
    states
}

/// The final states `[B,H,P,N]`: entry C of every (batch, head) of the chunk states.
pub(super) fn final_states<T: Real>(states: &[T], dims: &SsdDims, chunk: usize) -> Vec<T> {
    let (pn, nchunks) = (dims.headdim * dims.dstate, dims.nchunks(chunk));
    states
        .chunks(pn)
        .skip(nchunks)
        .step_by(nchunks + 1)
        .flatten()
        .copied()
        .collect()
}

/// Stage 3's inputs besides the chunk states: x, b, c, stage 1's outputs, D (`[H]` or `[H,P]`)
/// and z.
pub(super) struct OutInputs<'a, T> {
    pub x: &'a [T],
    pub b: &'a [T],
    pub c: &'a [T],
    pub dt: &'a [T],
    pub da: &'a [T],
    pub d: Option<&'a [T]>,
    pub z: Option<&'a [T]>,
}

/// Stage 3: `y [B,L,H,P]` from the chunk states `[B,H,C+1,P,N]`.
pub(super) fn compute_out<T: Real>(
    inp: &OutInputs<T>,
    states: &[T],
    dims: &SsdDims,
    chunk: usize,
) -> Vec<T> {
    let SsdDims {
        batch,
        seqlen,
        nheads,
        headdim,
        ngroups,
        dstate,
        ..
    } = *dims;
    let (t, hpg, nchunks) = (chunk, dims.heads_per_group(), dims.nchunks(chunk));
    let (hp, gn, pn) = (nheads * headdim, ngroups * dstate, headdim * dstate);
    let OutInputs {
        x,
        b,
        c,
        dt,
        da,
        d,
        z,
    } = *inp;
    let d_per_channel = d.is_some_and(|d| d.len() == hp);
    let mut y = vec![T::zero(); batch * seqlen * hp];
    y.par_chunks_mut(seqlen * hp)
        .enumerate()
        .for_each(|(bi, yb)| {
            yb.par_chunks_mut(t * hp).enumerate().for_each(|(ci, yc)| {
                vectorised(|| {
                    let (l0, tc) = (ci * t, yc.len() / hp);
                    let mut cb = vec![T::zero(); tc * tc];
                    let mut m = vec![T::zero(); tc * tc];
                    let bc0 = (bi * seqlen + l0) * gn;
                    for g in 0..ngroups {
                        let cg = MatRef {
                            data: &c[bc0 + g * dstate..],
                            rs: gn,
                            cs: 1,
                        };
                        gemm(
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
                            gemm(
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
                            for (tt, dv) in d_t.iter().enumerate() {
                                let decay = dv.exp2_v();
                                for v in &mut yh[tt * hp..tt * hp + headdim] {
                                    *v *= decay;
                                }
                            }
                            for tt in 0..tc {
                                let mrow = &mut m[tt * tc..(tt + 1) * tc];
                                for s in 0..=tt {
                                    mrow[s] =
                                        cb[tt * tc + s] * (d_t[tt] - d_t[s]).exp2_v() * dtv[s];
                                }
                                mrow[tt + 1..].fill(T::zero());
                            }
                            let x0 = ((bi * seqlen + l0) * nheads + h) * headdim;
                            gemm(
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
                                Some(T::one()),
                            );
                            for tt in 0..tc {
                                let o = tt * hp + h * headdim;
                                let xo = x0 + tt * hp;
                                for p in 0..headdim {
                                    let mut v = yc[o + p];
                                    if let Some(d) = d {
                                        let dv = if d_per_channel {
                                            d[h * headdim + p]
                                        } else {
                                            d[h]
                                        };
                                        v += dv * x[xo + p];
                                    }
                                    if let Some(z) = z {
                                        let zv = z[xo + p];
                                        v *= zv / (T::one() + (-zv).exp_v());
                                    }
                                    yc[o + p] = v;
                                }
                            }
                        }
                    }
                })
            })
        });
    y
}
