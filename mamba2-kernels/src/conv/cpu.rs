//! The causal conv on the CPU, on contiguous f32 slices: prefill parallel over output rows, the
//! decode step over the state rows.

use rayon::prelude::*;

use crate::check::ConvDims;
use crate::cpu::Real;

#[inline]
fn act<T: Real>(v: T, silu: bool) -> T {
    if silu {
        v / (T::one() + (-v).exp())
    } else {
        v
    }
}

/// The conv over `x [B,L,D]` from `state [B,D,K]` with `w [D,K]` and `bias [D]`: returns
/// `(y [B,L,D], new state [B,D,K])`.
pub(super) fn prefill<T: Real>(
    x: &[T],
    w: &[T],
    state: &[T],
    bias: &[T],
    silu: bool,
    dims: ConvDims,
) -> (Vec<T>, Vec<T>) {
    let ConvDims {
        batch,
        seqlen,
        dim,
        width,
    } = dims;
    // Tap-major weights, so the inner loop runs over contiguous channels.
    let mut wt = vec![T::zero(); width * dim];
    for (d, taps) in w.chunks_exact(width).enumerate() {
        for (k, &v) in taps.iter().enumerate() {
            wt[k * dim + d] = v;
        }
    }
    let mut y = vec![T::zero(); batch * seqlen * dim];
    y.par_chunks_mut(dim).enumerate().for_each(|(row, yr)| {
        let (bi, t) = (row / seqlen, row % seqlen);
        yr.copy_from_slice(bias);
        for (k, wk) in wt.chunks_exact(dim).enumerate() {
            // Input position of tap k; negative positions read the state.
            let back = width - 1 - k;
            if t >= back {
                let xr = &x[(bi * seqlen + t - back) * dim..][..dim];
                for ((yv, &wv), &xv) in yr.iter_mut().zip(wk).zip(xr) {
                    *yv += wv * xv;
                }
            } else {
                let j = width + t - back;
                let sb = &state[bi * dim * width..][..dim * width];
                for ((yv, &wv), &sv) in yr.iter_mut().zip(wk).zip(sb.iter().skip(j).step_by(width))
                {
                    *yv += wv * sv;
                }
            }
        }
        for v in yr.iter_mut() {
            *v = act(*v, silu);
        }
    });
    let mut new_state = vec![T::zero(); batch * dim * width];
    for (bd, row) in new_state.chunks_exact_mut(width).enumerate() {
        let (bi, d) = (bd / dim, bd % dim);
        for (j, v) in row.iter_mut().enumerate() {
            // Entry j of the new state is input position seqlen − width + j.
            *v = if seqlen + j >= width {
                x[(bi * seqlen + seqlen + j - width) * dim + d]
            } else {
                state[bd * width + seqlen + j]
            };
        }
    }
    (y, new_state)
}

/// One token `x [B,D]` into `state [B,D,K]` (in place) with `w [D,K]` and `bias [D]`; returns
/// `y [B,D]`.
pub(super) fn step<T: Real>(
    state: &mut [T],
    x: &[T],
    w: &[T],
    bias: &[T],
    silu: bool,
    dims: ConvDims,
) -> Vec<T> {
    let ConvDims { dim, width, .. } = dims;
    let mut y = vec![T::zero(); x.len()];
    for (bd, (row, yv)) in state.chunks_exact_mut(width).zip(y.iter_mut()).enumerate() {
        let d = bd % dim;
        row.rotate_left(1);
        row[width - 1] = x[bd];
        let taps = &w[d * width..][..width];
        let acc = row.iter().zip(taps).fold(bias[d], |a, (&s, &w)| a + s * w);
        *yv = act(acc, silu);
    }
    y
}

/// Rows of `dim` channels cut into contiguous pieces of `split` channels each.
pub(super) fn split_rows<T: Copy>(y: &[T], dim: usize, split: &[usize]) -> Vec<Vec<T>> {
    let rows = y.len() / dim;
    let mut start = 0;
    split
        .iter()
        .map(|&w| {
            let piece = (0..rows)
                .flat_map(|r| &y[r * dim + start..r * dim + start + w])
                .copied()
                .collect();
            start += w;
            piece
        })
        .collect()
}
