//! The cross-entropy's two passes on the CPU, over contiguous rows of `vocab` logits in the
//! compute type, parallel over rows.

use rayon::prelude::*;

use crate::cpu::Real;
use crate::fastexp::vectorised;

/// Lanes of the row reductions: eight running values, so that the loops vectorise.
const LANES: usize = 8;

/// `log Σ exp(row)`, shifted by the row's maximum so that no exp overflows; a row holding NaN
/// or ±∞ gives NaN (through `v − max`).
fn log_sum_exp<T: Real>(row: &[T]) -> T {
    let (chunks, tail) = row.split_at(row.len() - row.len() % LANES);
    let mut lanes = [T::neg_infinity(); LANES];
    for c in chunks.chunks_exact(LANES) {
        lanes.iter_mut().zip(c).for_each(|(m, &v)| *m = m.max(v));
    }
    let max = tail
        .iter()
        .chain(&lanes)
        .copied()
        .fold(T::neg_infinity(), T::max);
    let mut sums = [T::zero(); LANES];
    for c in chunks.chunks_exact(LANES) {
        sums.iter_mut()
            .zip(c)
            .for_each(|(s, &v)| *s += (v - max).exp_v());
    }
    let tail: T = tail.iter().map(|&v| (v - max).exp_v()).sum();
    max + (sums.iter().copied().sum::<T>() + tail).ln()
}

/// `(Σ_r lse_r − logits[r, target_r], lse)` over the rows.
pub(super) fn forward<T: Real>(logits: &[T], targets: &[u32], vocab: usize) -> (f64, Vec<f64>) {
    let per_row: Vec<(f64, f64)> = logits
        .par_chunks(vocab)
        .zip(targets.par_iter())
        .map(|(row, &t)| {
            let lse = vectorised(|| log_sum_exp(row));
            ((lse - row[t as usize]).as_f64(), lse.as_f64())
        })
        .collect();
    let nll = per_row.iter().map(|&(n, _)| n).sum();
    (nll, per_row.into_iter().map(|(_, l)| l).collect())
}

/// `scale · (softmax(row) − onehot(target))` for every row.
pub(super) fn backward<T: Real>(
    logits: &[T],
    targets: &[u32],
    lse: &[f64],
    vocab: usize,
    scale: f64,
) -> Vec<T> {
    let mut grad = vec![T::zero(); logits.len()];
    let one = T::one();
    let s = T::from_f64(scale).unwrap_or_else(T::nan);
    grad.par_chunks_mut(vocab)
        .zip(logits.par_chunks(vocab))
        .zip(targets.par_iter().zip(lse.par_iter()))
        .for_each(|((g, row), (&t, &lse))| {
            let lse = T::from_f64(lse).unwrap_or_else(T::nan);
            vectorised(|| {
                for (gv, &v) in g.iter_mut().zip(row) {
                    *gv = (v - lse).exp_v() * s;
                }
            });
            g[t as usize] -= one * s;
        });
    grad
}
