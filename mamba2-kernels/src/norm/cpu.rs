//! The two norms on the CPU, on contiguous f32 slices, parallel over rows.

use rayon::prelude::*;

/// `out = v / rms(v) · w` with `rms(v) = sqrt(mean(v²) + eps)`, the RMSNorm of one row or group.
#[inline]
fn rms_normalize(v: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let mean_sq = v.iter().map(|a| a * a).sum::<f32>() / v.len() as f32;
    let rstd = 1.0 / (mean_sq + eps).sqrt();
    for ((o, a), wv) in out.iter_mut().zip(v).zip(w) {
        *o = a * rstd * wv;
    }
}

/// `rmsnorm_per_group(x · silu(z)) · w` over rows of `w.len()` channels.
pub(super) fn gated_rms_norm(x: &[f32], z: &[f32], w: &[f32], group: usize, eps: f32) -> Vec<f32> {
    let dim = w.len();
    let mut y = vec![0f32; x.len()];
    y.par_chunks_mut(dim)
        .zip(x.par_chunks(dim).zip(z.par_chunks(dim)))
        .for_each(|(yr, (xr, zr))| {
            let mut gated = vec![0f32; dim];
            for ((g, xv), zv) in gated.iter_mut().zip(xr).zip(zr) {
                *g = xv * zv / (1.0 + (-zv).exp());
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
pub(super) fn add_rms_norm(
    x: &mut [f32],
    residual: Option<&[f32]>,
    w: &[f32],
    eps: f32,
) -> Vec<f32> {
    let dim = w.len();
    if let Some(r) = residual {
        x.par_chunks_mut(dim)
            .zip(r.par_chunks(dim))
            .for_each(|(s, r)| s.iter_mut().zip(r).for_each(|(s, r)| *s += r));
    }
    let mut y = vec![0f32; x.len()];
    y.par_chunks_mut(dim)
        .zip(x.par_chunks(dim))
        .for_each(|(yr, sr)| rms_normalize(sr, w, eps, yr));
    y
}
