//! The few-row linear layer on the CPU: one dot product per output, rows in parallel.

use rayon::prelude::*;

use crate::cpu::Real;

/// `y [R,N] = x [R,K] · w [N,K]ᵀ (+ bias [N])`.
pub(super) fn matvec<T: Real>(
    x: &[T],
    w: &[T],
    bias: Option<&[T]>,
    (rows, k, n): (usize, usize, usize),
) -> Vec<T> {
    let mut y = vec![T::zero(); rows * n];
    y.par_chunks_mut(n).enumerate().for_each(|(r, yr)| {
        let xr = &x[r * k..(r + 1) * k];
        for (j, out) in yr.iter_mut().enumerate() {
            let dot: T = xr
                .iter()
                .zip(&w[j * k..(j + 1) * k])
                .map(|(&a, &b)| a * b)
                .sum();
            *out = dot + bias.map_or(T::zero(), |b| b[j]);
        }
    });
    y
}
