//! The SSD backward on the CPU, in the compute type (f64 for f64 values, f32 otherwise).
//!
//! One (batch, head, chunk) at a time, natural exponents, tokens t, s of the chunk, g_t the
//! chunk's inclusive cumulative sum of a·dt, H the state entering the chunk, dH' the gradient of
//! the state leaving it (the final state's gradient for the last chunk), S = C·Bᵀ, M = dY·Xᵀ,
//! E_ts = e^{g_t − g_s}·dt_s for s ≤ t (0 above), r_s = e^{g_T − g_s}·dt_s:
//!
//! ```text
//! dX = (E∘S)ᵀ·dY + D·dY + diag(r)·B·dH'ᵀ          dB = (E∘M)ᵀ·C + diag(r)·X·dH'
//! dC = diag(e^g)·dY·H + (E∘M)·B                    dH = e^{g_T}·dH' + (diag(e^g)·dY)ᵀ·C
//! ddt_s = Σ_{t≥s} e^{g_t−g_s}·S_ts·M_ts + e^{g_T−g_s}·x_sᵀ·dH'·B_s + a·q_s
//! da    = Σ_s dt_s·q_s
//! q_r   = Σ_{t≥r} e^{g_t}·dy_t·(H·C_t) + e^{g_T}·⟨dH', H⟩ + Σ_{t≥r>s} (E∘S∘M)_ts
//!         + Σ_{s<r} r_s·x_sᵀ·dH'·B_s
//! ```
//!
//! q_r is the gradient reaching g through every g_t with t ≥ r; the pair terms enter as the sum
//! over pairs that cross r (t ≥ r > s), kept by a running update instead of a cumulative sum of
//! ± terms that cancel. The gradients then go through the dt processing (zero where dt_limit
//! clamps, σ(dt + bias) under softplus) to raw dt and dt_bias, and through the gate
//! (y·silu(z)) to z. dH of the first chunk is the initial state's gradient. The chunk states are
//! the forward's, kept by the recorded op (or recomputed from the inputs and rounded
//! to the state dtype as the forward rounds them), and the group's B and C gradients are summed
//! over its heads.

use rayon::prelude::*;

use super::cpu::{self, OutInputs};
use crate::check::SsdDims;
use crate::cpu::{gemm, round_to, MatMut, MatRef, Real};
use crate::dt::{self, DtRule};
use crate::fastexp::vectorised;
use candle_core::DType;

/// What the backward reads: the forward's inputs (raw dt, a and bias as the op took them).
pub(super) struct GradInputs<'a, T> {
    pub x: &'a [T],
    pub b: &'a [T],
    pub c: &'a [T],
    pub z: Option<&'a [T]>,
    pub dt: &'a [T],
    pub a: &'a [T],
    pub bias: &'a [T],
    pub d: Option<&'a [T]>,
    pub init: Option<&'a [T]>,
    pub rule: DtRule,
    pub dims: SsdDims,
    pub chunk: usize,
    pub state_dtype: DType,
}

/// The gradients of every input, in the inputs' layouts.
pub(super) struct Grads<T> {
    pub x: Vec<T>,
    pub b: Vec<T>,
    pub c: Vec<T>,
    pub z: Option<Vec<T>>,
    pub dt: Vec<T>,
    pub a: Vec<T>,
    pub bias: Vec<T>,
    pub d: Option<Vec<T>>,
    pub init: Option<Vec<T>>,
}

/// One (batch, head)'s gradients: x, B, C (its own share), processed dt, a, D per channel and
/// the initial state.
struct HeadGrads<T> {
    x: Vec<T>,
    b: Vec<T>,
    c: Vec<T>,
    dt: Vec<T>,
    a: T,
    d: Vec<T>,
    init: Vec<T>,
}

/// A dense row-major `rows × cols` matrix, or its transpose.
fn mat<T>(data: &[T], cols: usize) -> MatRef<'_, T> {
    MatRef {
        data,
        rs: cols,
        cs: 1,
    }
}

fn mat_t<T>(data: &[T], cols: usize) -> MatRef<'_, T> {
    MatRef {
        data,
        rs: 1,
        cs: cols,
    }
}

fn out<T>(data: &mut [T], cols: usize) -> MatMut<'_, T> {
    MatMut {
        data,
        rs: cols,
        cs: 1,
    }
}

#[inline(always)]
fn silu<T: Real>(z: T) -> T {
    z / (T::one() + (-z).exp_v())
}

/// d silu(z) / dz = σ(z)·(1 + z·(1 − σ(z))).
#[inline(always)]
fn silu_grad<T: Real>(z: T) -> T {
    let s = (T::one() + (-z).exp_v()).recip();
    s * (T::one() + z * (T::one() - s))
}

/// Stage 1's outputs and the chunk states of a forward, as [`cpu::chunk_cumsum`] and
/// [`cpu::chunk_states`] (rounded to the state dtype) return them.
pub(super) struct Kept<T> {
    pub steps: Vec<T>,
    pub states: Vec<T>,
}

/// The gradients of the SSD's inputs given those of its outputs: `dy [B,L,H,P]` of the (gated)
/// output and `dlast [B,H,P,N]` of the final state; the forward's intermediates are recomputed
/// unless `kept`.
pub(super) fn backward<T: Real>(
    inp: &GradInputs<T>,
    dy_out: &[T],
    dlast: &[T],
    kept: Option<Kept<T>>,
) -> Grads<T> {
    let dims = inp.dims;
    let SsdDims {
        batch,
        seqlen,
        nheads,
        headdim,
        ngroups,
        dstate,
        ..
    } = dims;
    let chunk = inp.chunk;
    let Kept { steps, states } = match kept {
        Some(k) => k,
        None => {
            let shape = (batch, seqlen, nheads);
            let steps = cpu::chunk_cumsum(inp.dt, shape, inp.a, inp.bias, inp.rule, chunk);
            let (dtp, da) = steps.split_at(steps.len() / 2);
            let mut states = cpu::chunk_states((inp.x, inp.b), (dtp, da), inp.init, &dims, chunk);
            round_to(&mut states, inp.state_dtype);
            Kept { steps, states }
        }
    };
    let (dtp, da) = steps.split_at(steps.len() / 2);

    // Through the gate: y_out = y·silu(z).
    let (dy, dz) = match inp.z {
        Some(z) => {
            let pre = OutInputs {
                x: inp.x,
                b: inp.b,
                c: inp.c,
                dt: dtp,
                da,
                d: inp.d,
                z: None,
            };
            let y = cpu::compute_out(&pre, &states, &dims, chunk);
            let dy = dy_out.iter().zip(z).map(|(&g, &z)| g * silu(z)).collect();
            let dz = (dy_out.iter().zip(&y).zip(z))
                .map(|((&g, &y), &z)| g * y * silu_grad(z))
                .collect();
            (dy, Some(dz))
        }
        None => (dy_out.to_vec(), None),
    };

    let heads: Vec<HeadGrads<T>> = (0..batch * nheads)
        .into_par_iter()
        .map(|bh| vectorised(|| head(inp, &dy, dlast, (dtp, da), &states, bh)))
        .collect();

    let (hp, gn, pn) = (nheads * headdim, ngroups * dstate, headdim * dstate);
    let hpg = dims.heads_per_group();
    let mut g = Grads {
        x: vec![T::zero(); batch * seqlen * hp],
        b: vec![T::zero(); batch * seqlen * gn],
        c: vec![T::zero(); batch * seqlen * gn],
        z: dz,
        dt: vec![T::zero(); batch * seqlen * nheads],
        a: vec![T::zero(); nheads],
        bias: vec![T::zero(); nheads],
        d: None,
        init: inp.init.map(|_| vec![T::zero(); batch * nheads * pn]),
    };
    // Each batch entry's rows in parallel; the per-head parameters' sums are reduced after.
    let partials: Vec<(Vec<T>, Vec<T>, Vec<T>)> =
        g.x.par_chunks_mut(seqlen * hp)
            .zip(g.b.par_chunks_mut(seqlen * gn))
            .zip(g.c.par_chunks_mut(seqlen * gn))
            .zip(g.dt.par_chunks_mut(seqlen * nheads))
            .zip(heads.par_chunks(nheads))
            .enumerate()
            .map(|(bi, ((((gx, gb), gc), gdt), bheads))| {
                let (mut da, mut dbias, mut dd) = (
                    vec![T::zero(); nheads],
                    vec![T::zero(); nheads],
                    vec![T::zero(); hp],
                );
                for (h, hg) in bheads.iter().enumerate() {
                    let grp = h / hpg;
                    for l in 0..seqlen {
                        let xo = (l * nheads + h) * headdim;
                        gx[xo..xo + headdim].copy_from_slice(&hg.x[l * headdim..(l + 1) * headdim]);
                        let bo = (l * ngroups + grp) * dstate;
                        for n in 0..dstate {
                            gb[bo + n] += hg.b[l * dstate + n];
                            gc[bo + n] += hg.c[l * dstate + n];
                        }
                        // Through the dt processing, to raw dt and the bias.
                        let i = l * nheads + h;
                        let raw = inp.dt[bi * seqlen * nheads + i];
                        let grad = hg.dt[l] * process_grad(raw, inp.bias[h], inp.rule);
                        gdt[i] = grad;
                        dbias[h] += grad;
                    }
                    da[h] += hg.a;
                    for (acc, &v) in dd[h * headdim..(h + 1) * headdim].iter_mut().zip(&hg.d) {
                        *acc += v;
                    }
                }
                (da, dbias, dd)
            })
            .collect();
    let mut dd = vec![T::zero(); hp];
    for (da, dbias, ddb) in partials {
        let sums = [(&mut g.a, da), (&mut g.bias, dbias), (&mut dd, ddb)];
        for (acc, part) in sums {
            acc.iter_mut().zip(part).for_each(|(s, v)| *s += v);
        }
    }
    if let Some(init) = g.init.as_mut() {
        for (bh, hg) in heads.iter().enumerate() {
            init[bh * pn..(bh + 1) * pn].copy_from_slice(&hg.init);
        }
    }
    g.d = inp.d.map(|d| {
        if d.len() == hp {
            dd
        } else {
            dd.chunks(headdim)
                .map(|row| row.iter().copied().sum())
                .collect()
        }
    });
    g
}

/// d process(raw) / d raw: 0 where the limit clamps, σ(raw + bias) under softplus below its
/// threshold, 1 otherwise.
fn process_grad<T: Real>(raw: T, bias: T, rule: DtRule) -> T {
    let v = raw + bias;
    let processed = dt::process(raw, bias, rule);
    let (lo, hi) = (T::of(rule.limit.0), T::of(rule.limit.1));
    let unclamped = if rule.softplus && v <= T::of(20.0) {
        v.exp().ln_1p()
    } else {
        v
    };
    if unclamped < lo || unclamped > hi || processed != unclamped {
        return T::zero();
    }
    if rule.softplus && v <= T::of(20.0) {
        (T::one() + (-v).exp()).recip()
    } else {
        T::one()
    }
}

/// The backward of one (batch, head) over its chunks, last to first.
fn head<T: Real>(
    inp: &GradInputs<T>,
    dy: &[T],
    dlast: &[T],
    (dtp, da): (&[T], &[T]),
    states: &[T],
    bh: usize,
) -> HeadGrads<T> {
    let SsdDims {
        seqlen,
        nheads,
        headdim: p,
        ngroups,
        dstate: n,
        ..
    } = inp.dims;
    let chunk = inp.chunk;
    let nchunks = inp.dims.nchunks(chunk);
    let (bi, h) = (bh / nheads, bh % nheads);
    let grp = h / inp.dims.heads_per_group();
    let pn = p * n;
    let ln2 = T::from_f64(std::f64::consts::LN_2).unwrap_or_else(T::nan);
    let skip = |j: usize| match inp.d {
        Some(d) if d.len() == nheads => d[h],
        Some(d) => d[h * p + j],
        None => T::zero(),
    };
    let mut hg = HeadGrads {
        x: vec![T::zero(); seqlen * p],
        b: vec![T::zero(); seqlen * n],
        c: vec![T::zero(); seqlen * n],
        dt: vec![T::zero(); seqlen],
        a: T::zero(),
        d: vec![T::zero(); p],
        init: Vec::new(),
    };
    let mut dh = dlast[bh * pn..(bh + 1) * pn].to_vec();
    let t_max = chunk.min(seqlen);
    let zeros = |len: usize| vec![T::zero(); len];
    let (mut xs, mut dys) = (zeros(t_max * p), zeros(t_max * p));
    let (mut bs, mut cs) = (zeros(t_max * n), zeros(t_max * n));
    let (mut sm, mut mm) = (zeros(t_max * t_max), zeros(t_max * t_max));
    let (mut ws, mut am) = (zeros(t_max * t_max), zeros(t_max * t_max));
    let (mut bdh, mut dyh) = (zeros(t_max * p), zeros(t_max * n));
    for ci in (0..nchunks).rev() {
        let l0 = ci * chunk;
        let tc = chunk.min(seqlen - l0);
        let row = bh * seqlen + l0;
        let dts = &dtp[row..row + tc];
        let g: Vec<T> = da[row..row + tc].iter().map(|&v| v * ln2).collect();
        let g_last = g[tc - 1];
        for t in 0..tc {
            let xo = ((bi * seqlen + l0 + t) * nheads + h) * p;
            xs[t * p..(t + 1) * p].copy_from_slice(&inp.x[xo..xo + p]);
            dys[t * p..(t + 1) * p].copy_from_slice(&dy[xo..xo + p]);
            let bo = ((bi * seqlen + l0 + t) * ngroups + grp) * n;
            bs[t * n..(t + 1) * n].copy_from_slice(&inp.b[bo..bo + n]);
            cs[t * n..(t + 1) * n].copy_from_slice(&inp.c[bo..bo + n]);
        }
        let hs = &states[(bh * (nchunks + 1) + ci) * pn..][..pn];
        let (x, dyc, b, c) = (&xs[..tc * p], &dys[..tc * p], &bs[..tc * n], &cs[..tc * n]);
        // S = C·Bᵀ and M = dY·Xᵀ.
        let s = &mut sm[..tc * tc];
        gemm((tc, tc, n), out(s, tc), mat(c, n), mat_t(b, n), None);
        let m = &mut mm[..tc * tc];
        gemm((tc, tc, p), out(m, tc), mat(dyc, p), mat_t(x, p), None);
        // W = E∘S and A = E∘M (lower triangle), and the direct dt terms Σ_t e^{g_t−g_s}·S·M.
        let (w, a) = (&mut ws[..tc * tc], &mut am[..tc * tc]);
        let mut ddt = vec![T::zero(); tc];
        for t in 0..tc {
            let row = t * tc..(t + 1) * tc;
            let (wr, ar) = (&mut w[row.clone()], &mut a[row.clone()]);
            let (sr, mr) = (&s[row.clone()], &m[row]);
            let lower = (wr[..=t].iter_mut().zip(&mut ar[..=t]))
                .zip(sr.iter().zip(mr))
                .zip(ddt.iter_mut().zip(g.iter().zip(dts)));
            for (((wv, av), (&sv, &mv)), (dd, (&gs, &dt))) in lower {
                let decay = (g[t] - gs).exp_v();
                *dd += decay * sv * mv;
                let e = decay * dt;
                *wv = e * sv;
                *av = e * mv;
            }
            wr[t + 1..].fill(T::zero());
            ar[t + 1..].fill(T::zero());
        }
        let r: Vec<T> = (0..tc)
            .map(|s_| (g_last - g[s_]).exp_v() * dts[s_])
            .collect();
        let e_g: Vec<T> = g.iter().map(|v| v.exp_v()).collect();
        // B·dH'ᵀ (tc × P): the dH' terms of dx, and x_sᵀ·dH'·B_s by rows.
        let bdh = &mut bdh[..tc * p];
        gemm((tc, p, n), out(bdh, p), mat(b, n), mat_t(&dh, n), None);
        let xdhb: Vec<T> = (0..tc)
            .map(|t| (0..p).map(|j| x[t * p + j] * bdh[t * p + j]).sum())
            .collect();
        // dY·H (tc × N): the state term of dC, and dy_t·(H·C_t) by rows.
        let dyh = &mut dyh[..tc * n];
        gemm((tc, n, p), out(dyh, n), mat(dyc, p), mat(hs, n), None);
        let dyhc: Vec<T> = (0..tc)
            .map(|t| (0..n).map(|k| dyh[t * n + k] * c[t * n + k]).sum())
            .collect();

        // dX = Wᵀ·dY + D·dY + diag(r)·B·dH'ᵀ.
        let dx = &mut hg.x[l0 * p..(l0 + tc) * p];
        gemm((tc, p, tc), out(dx, p), mat_t(w, tc), mat(dyc, p), None);
        for t in 0..tc {
            for j in 0..p {
                dx[t * p + j] += skip(j) * dyc[t * p + j] + r[t] * bdh[t * p + j];
                hg.d[j] += dyc[t * p + j] * x[t * p + j];
            }
        }
        // dB = Aᵀ·C + diag(r)·X·dH'.
        let db = &mut hg.b[l0 * n..(l0 + tc) * n];
        gemm((tc, n, p), out(db, n), mat(x, p), mat(&dh, n), None);
        for t in 0..tc {
            db[t * n..(t + 1) * n].iter_mut().for_each(|v| *v *= r[t]);
        }
        gemm(
            (tc, n, tc),
            out(db, n),
            mat_t(a, tc),
            mat(c, n),
            Some(T::one()),
        );
        // dC = diag(e^g)·dY·H + A·B.
        let dc = &mut hg.c[l0 * n..(l0 + tc) * n];
        for t in 0..tc {
            for k in 0..n {
                dc[t * n + k] = e_g[t] * dyh[t * n + k];
            }
        }
        gemm(
            (tc, n, tc),
            out(dc, n),
            mat(a, tc),
            mat(b, n),
            Some(T::one()),
        );

        // q_r, from the last token down: the gate-free terms, then the crossing pairs kept by a
        // running sum (row r leaves the t ≥ r side, column r−1 joins the s < r side).
        let state_dot: T = dh.iter().zip(hs).map(|(&u, &v)| u * v).sum();
        let mut q = vec![T::zero(); tc];
        let mut tail = T::zero();
        for t in (0..tc).rev() {
            tail += e_g[t] * dyhc[t];
            q[t] = tail + g_last.exp() * state_dot;
        }
        let mut before = T::zero();
        let mut cross = T::zero();
        for r_ in 0..tc {
            if r_ > 0 {
                // Column r−1 (s = r−1) joins: pairs (t ≥ r, s = r−1); row r−1 (t = r−1) leaves:
                // pairs (t = r−1, s < r−1).
                let col: T = (r_..tc)
                    .map(|t| w[t * tc + r_ - 1] * m[t * tc + r_ - 1])
                    .sum();
                let left: T = (0..r_ - 1)
                    .map(|s_| w[(r_ - 1) * tc + s_] * m[(r_ - 1) * tc + s_])
                    .sum();
                cross += col - left;
                before += r[r_ - 1] * xdhb[r_ - 1];
            }
            q[r_] += cross + before;
        }
        let ah = inp.a[h];
        for t in 0..tc {
            hg.dt[l0 + t] = ddt[t] + (g_last - g[t]).exp() * xdhb[t] + ah * q[t];
            hg.a += dts[t] * q[t];
        }

        // dH = e^{g_T}·dH' + (diag(e^g)·dY)ᵀ·C.
        let scaled: Vec<T> = (0..tc * p).map(|i| e_g[i / p] * dyc[i]).collect();
        let decay_last = g_last.exp();
        dh.iter_mut().for_each(|v| *v *= decay_last);
        gemm(
            (p, n, tc),
            out(&mut dh, n),
            mat_t(&scaled, p),
            mat(c, n),
            Some(T::one()),
        );
    }
    hg.init = dh;
    hg
}
