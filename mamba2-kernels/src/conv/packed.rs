//! The causal conv over sequences packed along L (`cu_seqlens`, as [`crate::ssd_packed`]):
//! `x [1,T,D]`, sequence s on tokens `cu[s]..cu[s+1]`, initial states `[S,D,K]` → `y [1,T,D]`
//! and the final states `[S,D,K]`. No window reaches across a boundary: each sequence's window
//! starts from its own state (a sequence shorter than the kernel included), so the result is the
//! one it has alone. Without gradients it is one call (one launch on CUDA, each program finding
//! its tokens' sequences in the offsets); when x, the weight or the bias records gradients, each
//! sequence runs as [`causal_conv1d_split`] on its own tokens, differentiable as the conv is.

use candle_core::{bail, Result, Tensor};

use super::{causal_conv1d_split, split_packed_unrecorded, ConvOptions};
use crate::check;

/// [`causal_conv1d_split`] over the sequences packed along L of `x [1,T,D]`, split at
/// `cu_seqlens` (`[0, l_0, l_0 + l_1, …, T]`, every sequence at least one token), from
/// `initial_states [S,D,K]` (zeros if `None`). Returns the pieces `[1,T,split[i]]` and the final
/// states `[S,D,K]`.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use mamba2_kernels::{causal_conv1d, causal_conv1d_split_packed, ConvOptions};
///
/// // One channel, taps [1, 2, 3]; sequences [1, 10] and [100]: no window crosses between them.
/// let x = Tensor::new(&[[[1f32], [10.0], [100.0]]], &Device::Cpu)?;
/// let w = Tensor::new(&[[1f32, 2.0, 3.0]], &Device::Cpu)?;
/// let opts = ConvOptions::default();
/// let (y, states) = causal_conv1d_split_packed(&x, &w, None, &opts, &[1], &[0, 2, 3])?;
/// assert_eq!(y[0].flatten_all()?.to_vec1::<f32>()?, [3.0, 32.0, 300.0]);
/// assert_eq!(states.dims(), &[2, 1, 3]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn causal_conv1d_split_packed(
    x: &Tensor,
    weight: &Tensor,
    initial_states: Option<&Tensor>,
    opts: &ConvOptions,
    split: &[usize],
    cu_seqlens: &[usize],
) -> Result<(Vec<Tensor>, Tensor)> {
    let op = "causal_conv1d_packed";
    let [rows, total, _] = check::rank::<3>(op, "x", x, "[1, T, D]")?;
    if rows != 1 {
        bail!(
            "{op}: packed sequences lie along L of one row: x must be [1, T, D], got {:?}",
            x.dims()
        )
    }
    let count = check::cu_seqlens(op, cu_seqlens, total)?;
    if let Some(init) = initial_states {
        let [s, ..] = check::rank::<3>(op, "initial_states", init, "[S, D, K]")?;
        if s != count {
            bail!("{op}: initial_states holds {s} states for {count} sequences (cu_seqlens {cu_seqlens:?})")
        }
    }
    let tracked = x.track_op() || weight.track_op() || opts.bias.is_some_and(Tensor::track_op);
    if !tracked {
        return split_packed_unrecorded(x, weight, initial_states, opts, split, cu_seqlens);
    }
    let mut pieces: Vec<Vec<Tensor>> = vec![Vec::with_capacity(count); split.len()];
    let mut states = Vec::with_capacity(count);
    for (i, w) in cu_seqlens.windows(2).enumerate() {
        let (start, len) = (w[0], w[1] - w[0]);
        let init = initial_states.map(|t| t.narrow(0, i, 1)).transpose()?;
        let (ys, state) = causal_conv1d_split(
            &x.narrow(1, start, len)?,
            weight,
            init.as_ref(),
            opts,
            split,
        )
        .map_err(|e| {
            candle_core::Error::msg(format!(
                "{op}: sequence {i} (tokens {start}..{}): {e}",
                w[1]
            ))
        })?;
        for (all, y) in pieces.iter_mut().zip(ys) {
            all.push(y);
        }
        states.push(state);
    }
    let ys = pieces
        .iter()
        .map(|p| Tensor::cat(p, 1))
        .collect::<Result<Vec<_>>>()?;
    Ok((ys, Tensor::cat(&states, 0)?))
}
