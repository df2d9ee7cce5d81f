//! The few-row linear layer on the CPU: one dot product per output, rows in parallel.

use rayon::prelude::*;

/// `y [R,N] = x [R,K] · w [N,K]ᵀ (+ bias [N])`.
pub(super) fn matvec(
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    (rows, k, n): (usize, usize, usize),
) -> Vec<f32> {
    let mut y = vec![0f32; rows * n];
    y.par_chunks_mut(n).enumerate().for_each(|(r, yr)| {
        let xr = &x[r * k..(r + 1) * k];
        for (j, out) in yr.iter_mut().enumerate() {
            let dot: f32 = xr
                .iter()
                .zip(&w[j * k..(j + 1) * k])
                .map(|(a, b)| a * b)
                .sum();
            *out = dot + bias.map_or(0., |b| b[j]);
        }
    });
    y
}
