//! The two norms on the CPU, on contiguous slices of the compute type, parallel over rows, and
//! the backward of the (gated) per-group norm. With `g` a group of the normalised input (the gated
//! `x·silu(z)` or the plain input), `r = 1/sqrt(mean(g²) + eps)` and `y = g·r·w`:
//!
//! ```text
//! dw = Σ_rows dy·g·r          dg = r·w·dy − g·r³·mean_group(g·w·dy)
//! dx = dg·silu(z)             dz = dg·x·silu'(z),   silu'(z) = σ(z)·(1 + z·(1 − σ(z)))
//! ```

use rayon::prelude::*;

use crate::cpu::{Real, ELEMENTS_PER_TASK};
use crate::fastexp::vectorised;

/// Rows one task of the backward sums for dw; a fixed split keeps the sums (and so the gradients)
/// the same from run to run.
const ROWS_PER_TASK: usize = 64;

/// `1 / sqrt(mean(v²) + eps)`, the reciprocal RMS of one row or group.
#[inline]
fn rstd<T: Real>(v: &[T], eps: T) -> T {
    let len = T::from_usize(v.len()).unwrap_or_else(T::one);
    let mean_sq = v.iter().map(|&a| a * a).sum::<T>() / len;
    (mean_sq + eps).sqrt().recip()
}

#[inline(always)]
fn sigmoid<T: Real>(v: T) -> T {
    (T::one() + (-v).exp_v()).recip()
}

/// `x·silu(z)`.
#[inline(always)]
fn gate<T: Real>(x: T, z: T) -> T {
    x * z / (T::one() + (-z).exp_v())
}

/// `out = v / rms(v) · w` with `rms(v) = sqrt(mean(v²) + eps)`, the RMSNorm of one row or group.
#[inline]
fn rms_normalize<T: Real>(v: &[T], w: &[T], eps: T, out: &mut [T]) {
    let r = rstd(v, eps);
    for ((o, &a), &wv) in out.iter_mut().zip(v).zip(w) {
        *o = a * r * wv;
    }
}

/// `rmsnorm_per_group(x · silu(z)) · w` over rows of `w.len()` channels.
pub(super) fn gated_rms_norm<T: Real>(x: &[T], z: &[T], w: &[T], group: usize, eps: T) -> Vec<T> {
    let dim = w.len();
    let mut y = vec![T::zero(); x.len()];
    y.par_chunks_mut(dim)
        .zip(x.par_chunks(dim).zip(z.par_chunks(dim)))
        .for_each(|(yr, (xr, zr))| {
            let mut gated = vec![T::zero(); dim];
            vectorised(|| {
                for ((g, &xv), &zv) in gated.iter_mut().zip(xr).zip(zr) {
                    *g = gate(xv, zv);
                }
            });
            for ((yg, gg), wg) in yr
                .chunks_exact_mut(group)
                .zip(gated.chunks_exact(group))
                .zip(w.chunks_exact(group))
            {
                rms_normalize(gg, wg, eps, yg);
            }
        });
    y
}

/// The RMSNorm of every row of `w.len()` channels of `v`, times `w`.
pub(super) fn rms_norm<T: Real>(v: &[T], w: &[T], eps: T) -> Vec<T> {
    let dim = w.len();
    let mut y = vec![T::zero(); v.len()];
    y.par_chunks_mut(dim)
        .zip(v.par_chunks(dim))
        .for_each(|(yr, vr)| rms_normalize(vr, w, eps, yr));
    y
}

/// Adds `residual` to `x` in place (the new residual) and returns its RMSNorm with `w`.
pub(super) fn add_rms_norm<T: Real>(
    x: &mut [T],
    residual: Option<&[T]>,
    w: &[T],
    eps: T,
) -> Vec<T> {
    let dim = w.len();
    if let Some(r) = residual {
        x.par_chunks_mut(dim)
            .zip(r.par_chunks(dim))
            .for_each(|(s, r)| s.iter_mut().zip(r).for_each(|(s, &r)| *s += r));
    }
    rms_norm(x, w, eps)
}

/// The backward of the per-group RMSNorm `y = g·r·w` of `g` (rows of `w.len()` channels, groups of
/// `group`) for the output gradient `dy`: returns `(dg, dw)`.
pub(super) fn rms_norm_backward<T: Real>(
    g: &[T],
    w: &[T],
    dy: &[T],
    group: usize,
    eps: T,
) -> (Vec<T>, Vec<T>) {
    let dim = w.len();
    let len = T::from_usize(group).unwrap_or_else(T::one);
    let mut dg = vec![T::zero(); g.len()];
    let task = ROWS_PER_TASK * dim;
    let parts: Vec<Vec<T>> = dg
        .par_chunks_mut(task)
        .zip(g.par_chunks(task).zip(dy.par_chunks(task)))
        .map(|(dgc, (gc, dyc))| {
            let mut dw = vec![T::zero(); dim];
            let rows = dgc.chunks_exact_mut(dim).zip(gc.chunks_exact(dim));
            for ((dgr, gr), dyr) in rows.zip(dyc.chunks_exact(dim)) {
                let groups = dgr.chunks_exact_mut(group).zip(gr.chunks_exact(group));
                let groups = groups.zip(dyr.chunks_exact(group));
                let params = w.chunks_exact(group).zip(dw.chunks_exact_mut(group));
                for (((dgg, gg), dyg), (wg, dwg)) in groups.zip(params) {
                    let r = rstd(gg, eps);
                    let mean = gg
                        .iter()
                        .zip(wg)
                        .zip(dyg)
                        .map(|((&a, &wv), &d)| a * wv * d)
                        .sum::<T>()
                        / len;
                    let r3_mean = r * r * r * mean;
                    for ((((o, &a), &wv), &d), acc) in
                        dgg.iter_mut().zip(gg).zip(wg).zip(dyg).zip(dwg.iter_mut())
                    {
                        *o = r * wv * d - a * r3_mean;
                        *acc += d * a * r;
                    }
                }
            }
            dw
        })
        .collect();
    let mut dw = vec![T::zero(); dim];
    for part in parts {
        for (s, v) in dw.iter_mut().zip(part) {
            *s += v;
        }
    }
    (dg, dw)
}

/// The backward of [`gated_rms_norm`] for the output gradient `dy`: returns `(dx, dz, dw)`.
pub(super) fn gated_rms_norm_backward<T: Real>(
    x: &[T],
    z: &[T],
    w: &[T],
    dy: &[T],
    group: usize,
    eps: T,
) -> (Vec<T>, Vec<T>, Vec<T>) {
    let mut gated = vec![T::zero(); x.len()];
    gated
        .par_chunks_mut(ELEMENTS_PER_TASK)
        .zip(
            x.par_chunks(ELEMENTS_PER_TASK)
                .zip(z.par_chunks(ELEMENTS_PER_TASK)),
        )
        .for_each(|(g, (x, z))| {
            vectorised(|| {
                for ((g, &xv), &zv) in g.iter_mut().zip(x).zip(z) {
                    *g = gate(xv, zv);
                }
            })
        });
    let (dg, dw) = rms_norm_backward(&gated, w, dy, group, eps);
    let (mut dx, mut dz) = (gated, vec![T::zero(); x.len()]);
    dx.par_chunks_mut(ELEMENTS_PER_TASK)
        .zip(dz.par_chunks_mut(ELEMENTS_PER_TASK))
        .zip(
            dg.par_chunks(ELEMENTS_PER_TASK).zip(
                x.par_chunks(ELEMENTS_PER_TASK)
                    .zip(z.par_chunks(ELEMENTS_PER_TASK)),
            ),
        )
        .for_each(|((dx, dz), (dg, (x, z)))| {
            vectorised(|| {
                let rows = dx.iter_mut().zip(dz.iter_mut());
                for ((dxv, dzv), ((&d, &xv), &zv)) in rows.zip(dg.iter().zip(x).zip(z)) {
                    let s = sigmoid(zv);
                    *dxv = d * zv * s;
                    *dzv = d * xv * s * (T::one() + zv * (T::one() - s));
                }
            })
        });
    (dx, dz, dw)
}
