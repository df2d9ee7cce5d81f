//! The two norms on the CPU, on contiguous slices of the compute type, parallel over rows.

use rayon::prelude::*;

use crate::cpu::Real;

/// `out = v / rms(v) · w` with `rms(v) = sqrt(mean(v²) + eps)`, the RMSNorm of one row or group.
#[inline]
fn rms_normalize<T: Real>(v: &[T], w: &[T], eps: T, out: &mut [T]) {
    let len = T::from_usize(v.len()).unwrap_or_else(T::one);
    let mean_sq = v.iter().map(|&a| a * a).sum::<T>() / len;
    let rstd = (mean_sq + eps).sqrt().recip();
    for ((o, &a), &wv) in out.iter_mut().zip(v).zip(w) {
        *o = a * rstd * wv;
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
            for ((g, &xv), &zv) in gated.iter_mut().zip(xr).zip(zr) {
                *g = xv * zv / (T::one() + (-zv).exp());
            }
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
    let mut y = vec![T::zero(); x.len()];
    y.par_chunks_mut(dim)
        .zip(x.par_chunks(dim))
        .for_each(|(yr, sr)| rms_normalize(sr, w, eps, yr));
    y
}
