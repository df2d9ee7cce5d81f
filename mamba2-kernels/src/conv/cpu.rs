//! The causal conv on the CPU, on contiguous slices of the compute type: prefill parallel over
//! output rows, the decode step over the state rows, and the prefill's backward:
//!
//! ```text
//! da = dy · act'(a)            (a the pre-activation; act' = silu' or 1)
//! dbias[d] = Σ_{b,t} da[b,t,d]     dw[d,k] = Σ_{b,t} da[b,t,d] · u[b,t−K+1+k,d]
//! dx[b,s,d] = Σ_k w[d,k] · da[b,s+K−1−k,d]        (terms with s+K−1−k < L)
//! ```

use rayon::prelude::*;

use crate::check::ConvDims;
use crate::cpu::{Real, ELEMENTS_PER_TASK};
use crate::fastexp::vectorised;

/// Rows of the output gradient one task sums for dw and dbias; a fixed split keeps the sums
/// (and so the gradients) the same from run to run.
const ROWS_PER_TASK: usize = 64;

#[inline(always)]
fn sigmoid<T: Real>(v: T) -> T {
    (T::one() + (-v).exp_v()).recip()
}

#[inline(always)]
fn act<T: Real>(v: T, silu: bool) -> T {
    if silu {
        v / (T::one() + (-v).exp_v())
    } else {
        v
    }
}

/// `silu'(v) = σ(v)·(1 + v·(1 − σ(v)))`.
#[inline(always)]
fn silu_grad<T: Real>(v: T) -> T {
    let s = sigmoid(v);
    s * (T::one() + v * (T::one() - s))
}

/// The conv input `u` as rows of D channels: x's rows, and before them the state transposed to
/// rows, so every tap reads a contiguous row.
struct Inputs<'a, T> {
    x: &'a [T],
    /// `state [B,D,K]` as `[B,K,D]`.
    state_rows: Vec<T>,
    dims: ConvDims,
}

impl<'a, T: Real> Inputs<'a, T> {
    fn new(x: &'a [T], state: &[T], dims: ConvDims) -> Self {
        let ConvDims { dim, width, .. } = dims;
        let mut state_rows = vec![T::zero(); state.len()];
        for (bd, taps) in state.chunks_exact(width).enumerate() {
            let (bi, d) = (bd / dim, bd % dim);
            for (j, &v) in taps.iter().enumerate() {
                state_rows[(bi * width + j) * dim + d] = v;
            }
        }
        Self {
            x,
            state_rows,
            dims,
        }
    }

    /// The row `u[bi, t − back]` (`back ≤ K−1`: negative positions read the state).
    #[inline]
    fn row(&self, bi: usize, t: usize, back: usize) -> &[T] {
        let ConvDims {
            seqlen, dim, width, ..
        } = self.dims;
        if t >= back {
            &self.x[(bi * seqlen + t - back) * dim..][..dim]
        } else {
            &self.state_rows[(bi * width + width + t - back) * dim..][..dim]
        }
    }
}

/// `w [D,K]` tap-major (`[K,D]`), so the inner loops run over contiguous channels.
fn taps_major<T: Real>(w: &[T], dim: usize, width: usize) -> Vec<T> {
    let mut wt = vec![T::zero(); width * dim];
    for (d, taps) in w.chunks_exact(width).enumerate() {
        for (k, &v) in taps.iter().enumerate() {
            wt[k * dim + d] = v;
        }
    }
    wt
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
    let wt = taps_major(w, dim, width);
    let u = Inputs::new(x, state, dims);
    let mut y = vec![T::zero(); batch * seqlen * dim];
    y.par_chunks_mut(dim).enumerate().for_each(|(row, yr)| {
        let (bi, t) = (row / seqlen, row % seqlen);
        vectorised(|| {
            yr.copy_from_slice(bias);
            for (k, wk) in wt.chunks_exact(dim).enumerate() {
                let ur = u.row(bi, t, width - 1 - k);
                for ((yv, &wv), &uv) in yr.iter_mut().zip(wk).zip(ur) {
                    *yv += wv * uv;
                }
            }
            for v in yr.iter_mut() {
                *v = act(*v, silu);
            }
        })
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

/// The gradients of [`prefill`]'s output with respect to x, the weight and the bias.
pub(super) struct ConvGrads<T> {
    /// `[B,L,D]`.
    pub dx: Vec<T>,
    /// `[D,K]`.
    pub dw: Vec<T>,
    /// `[D]`.
    pub dbias: Vec<T>,
}

/// The backward of [`prefill`] for the output gradient `dy [B,L,D]` (see the module doc).
pub(super) fn backward<T: Real>(
    x: &[T],
    w: &[T],
    state: &[T],
    bias: &[T],
    dy: &[T],
    silu: bool,
    dims: ConvDims,
) -> ConvGrads<T> {
    let ConvDims {
        seqlen, dim, width, ..
    } = dims;
    // The output holds act(a), which SiLU does not let us invert: a is recomputed.
    let da = if silu {
        let mut a = prefill(x, w, state, bias, false, dims).0;
        a.par_chunks_mut(ELEMENTS_PER_TASK)
            .zip(dy.par_chunks(ELEMENTS_PER_TASK))
            .for_each(|(a, g)| {
                vectorised(|| {
                    for (a, &g) in a.iter_mut().zip(g) {
                        *a = g * silu_grad(*a);
                    }
                })
            });
        a
    } else {
        dy.to_vec()
    };
    let wt = taps_major(w, dim, width);
    let mut dx = vec![T::zero(); da.len()];
    dx.par_chunks_mut(dim).enumerate().for_each(|(row, dxr)| {
        let (bi, s) = (row / seqlen, row % seqlen);
        for (k, wk) in wt.chunks_exact(dim).enumerate() {
            // Tap k of output t = s + K−1−k reads input s.
            let t = s + width - 1 - k;
            if t < seqlen {
                let dar = &da[(bi * seqlen + t) * dim..][..dim];
                for ((g, &wv), &dav) in dxr.iter_mut().zip(wk).zip(dar) {
                    *g += wv * dav;
                }
            }
        }
    });
    let u = Inputs::new(x, state, dims);
    // Per task: the tap sums `[K,D]` (tap-major), then the bias sums `[D]`.
    let parts: Vec<Vec<T>> = da
        .par_chunks(ROWS_PER_TASK * dim)
        .enumerate()
        .map(|(task, rows)| {
            let mut acc = vec![T::zero(); (width + 1) * dim];
            let (taps, db) = acc.split_at_mut(width * dim);
            for (i, dar) in rows.chunks_exact(dim).enumerate() {
                let row = task * ROWS_PER_TASK + i;
                let (bi, t) = (row / seqlen, row % seqlen);
                for (a, &g) in db.iter_mut().zip(dar) {
                    *a += g;
                }
                for (k, tk) in taps.chunks_exact_mut(dim).enumerate() {
                    let ur = u.row(bi, t, width - 1 - k);
                    for ((a, &g), &uv) in tk.iter_mut().zip(dar).zip(ur) {
                        *a += g * uv;
                    }
                }
            }
            acc
        })
        .collect();
    let mut sums = vec![T::zero(); (width + 1) * dim];
    for part in parts {
        for (s, v) in sums.iter_mut().zip(part) {
            *s += v;
        }
    }
    let (taps, dbias) = sums.split_at(width * dim);
    let mut dw = vec![T::zero(); dim * width];
    for (k, tk) in taps.chunks_exact(dim).enumerate() {
        for (d, &v) in tk.iter().enumerate() {
            dw[d * width + k] = v;
        }
    }
    ConvGrads {
        dx,
        dw,
        dbias: dbias.to_vec(),
    }
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
