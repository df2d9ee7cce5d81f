//! The SSD over sequences packed along L (variable lengths in one row, as vLLM's and mamba_ssm's
//! `cu_seqlens`):
//!
//! ```text
//! x [1,T,H,P], dt [1,T,H], b, c [1,T,G,N], z [1,T,H,P]      sequence s: tokens cu[s]..cu[s+1]
//! initial states [S,H,P,N]  →  y [1,T,H,P], final states [S,H,P,N]
//! ```
//!
//! No state crosses a boundary: each sequence runs from its own initial state, whatever its
//! length (1 token, or boundaries inside chunks), so the result is the one it has alone. Where
//! no input records gradients the whole row is one `ssd` call: on CUDA one launch of the pipeline
//! for all sequences, over chunks of `chunk_size` counted from each sequence's start (a
//! sequence's last chunk may be shorter; no chunk holds two sequences), the state pass restarting
//! at each sequence's first chunk; on the CPU each sequence through the three stages alone.
//! Where an input records gradients each sequence runs as [`ssd`] on its own tokens, the pieces
//! views of the packed inputs and y their concatenation, differentiable as `ssd` is.

use candle_core::{bail, Result, Tensor};

use super::{forward_packed, ssd, SsdOptions};
use crate::check;

/// [`ssd`] over the sequences packed along L of `x [1,T,H,P]` (see the module doc), split at
/// `cu_seqlens` (`[0, l_0, l_0 + l_1, …, T]`, every sequence at least one token).
/// `opts.initial_state` is `[S,H,P,N]` (zeros if `None`) and `opts.z`, if any, `[1,T,H,P]`.
/// Returns `(y [1,T,H,P], final states [S,H,P,N])`.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use mamba2_kernels::{ssd, ssd_packed, SsdOptions};
///
/// let dev = Device::Cpu;
/// let (t, h, p, n) = (10, 2, 4, 16);
/// let x = Tensor::randn(0f32, 1.0, (1, t, h, p), &dev)?;
/// let dt = Tensor::randn(0f32, 1.0, (1, t, h), &dev)?;
/// let a = Tensor::new(&[-0.5f32, -1.0], &dev)?;
/// let b = Tensor::randn(0f32, 1.0, (1, t, 1, n), &dev)?;
/// let c = Tensor::randn(0f32, 1.0, (1, t, 1, n), &dev)?;
/// let opts = SsdOptions { chunk_size: 16, ..Default::default() };
/// // Two sequences: tokens 0..3 and 3..10.
/// let (y, states) = ssd_packed(&x, &dt, &a, &b, &c, &[0, 3, 10], &opts)?;
/// assert_eq!(states.dims(), &[2, h, p, n]);
/// // The second sequence alone gives the same.
/// let rest = |v: &Tensor| v.narrow(1, 3, 7);
/// let (alone, last) = ssd(&rest(&x)?, &rest(&dt)?, &a, &rest(&b)?, &rest(&c)?, &opts)?;
/// let same = |u: &Tensor, v: &Tensor| -> candle_core::Result<bool> {
///     Ok(u.flatten_all()?.to_vec1::<f32>()? == v.flatten_all()?.to_vec1::<f32>()?)
/// };
/// assert!(same(&rest(&y)?, &alone)? && same(&states.narrow(0, 1, 1)?, &last)?);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn ssd_packed(
    x: &Tensor,
    dt: &Tensor,
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    cu_seqlens: &[usize],
    opts: &SsdOptions,
) -> Result<(Tensor, Tensor)> {
    let op = "ssd_packed";
    let [rows, total, _, _] = check::rank::<4>(op, "x", x, "[1, T, H, P]")?;
    if rows != 1 {
        bail!(
            "{op}: packed sequences lie along L of one row: x must be [1, T, H, P], got {:?}",
            x.dims()
        )
    }
    let count = check::cu_seqlens(op, cu_seqlens, total)?;
    if let Some(init) = opts.initial_state {
        let [s, ..] = check::rank::<4>(op, "initial_state", init, "[S, H, P, N]")?;
        if s != count {
            bail!("{op}: initial_state holds {s} states for {count} sequences (cu_seqlens {cu_seqlens:?})")
        }
    }
    let optional = [opts.d, opts.z, opts.initial_state, opts.dt.bias];
    let inputs = [x, dt, a, b, c]
        .into_iter()
        .chain(optional.into_iter().flatten());
    if !inputs.into_iter().any(Tensor::track_op) {
        return forward_packed((x, dt, a, b, c), opts, cu_seqlens);
    }
    let mut ys = Vec::with_capacity(count);
    let mut states = Vec::with_capacity(count);
    for (i, w) in cu_seqlens.windows(2).enumerate() {
        let (start, len) = (w[0], w[1] - w[0]);
        let piece = |t: &Tensor| t.narrow(1, start, len);
        let init = opts.initial_state.map(|t| t.narrow(0, i, 1)).transpose()?;
        let z = opts.z.map(piece).transpose()?;
        let one = SsdOptions {
            z: z.as_ref(),
            initial_state: init.as_ref(),
            ..*opts
        };
        let (y, last) =
            ssd(&piece(x)?, &piece(dt)?, a, &piece(b)?, &piece(c)?, &one).map_err(|e| {
                candle_core::Error::msg(format!(
                    "{op}: sequence {i} (tokens {start}..{}): {e}",
                    w[1]
                ))
            })?;
        ys.push(y);
        states.push(last);
    }
    Ok((Tensor::cat(&ys, 1)?, Tensor::cat(&states, 0)?))
}
