//! Depthwise causal conv1d with its rolling state (mamba_ssm's `causal_conv1d_fn` for prefill and
//! `causal_conv1d_update` for decode), with optional bias and fused SiLU:
//!
//! ```text
//! y[b,t,d] = act(bias[d] + Σ_{k<K} w[d,k] · u[b, t−K+1+k, d])          act = SiLU or identity
//! u[b,s,d] = x[b,s,d] for s ≥ 0,   state[b,d,K+s] for −K ≤ s < 0
//! ```
//!
//! The state `[B,D,K]` holds the last K **pre-conv** inputs per channel, oldest first: exactly the
//! `conv_state` of HF's cache and of mamba_ssm's `Mamba2` (zeros for a fresh sequence, which is the
//! conv's causal zero padding; after fewer than K tokens the inputs are zero-padded on the left).
//! After a call the new state is the last K entries of `u`. Layouts: `x [B,L,D]` channels last (as
//! xBC leaves in_proj), `weight [D,K]` (the checkpoint's `[D,1,K]` squeezed), `bias [D]`; all in
//! x's dtype (f32, f16 or bf16), accumulation in f32.

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp3, InplaceOp2, Layout, Result, Shape, Storage, Tensor,
};
use rayon::prelude::*;

use crate::check;
use crate::cpu;
use crate::slot::Slot;

/// Options shared by [`causal_conv1d`] and [`causal_conv1d_step`].
#[derive(Clone, Copy, Debug, Default)]
pub struct ConvOptions<'a> {
    /// Per-channel bias `[D]`, in x's dtype.
    pub bias: Option<&'a Tensor>,
    /// Apply SiLU to the output (Mamba-2 always does).
    pub silu: bool,
}

/// The sizes of a conv problem: batch, length, channels, kernel width.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ConvDims {
    pub batch: usize,
    pub seqlen: usize,
    pub dim: usize,
    pub width: usize,
}

#[inline]
fn act(v: f32, silu: bool) -> f32 {
    if silu {
        v / (1.0 + (-v).exp())
    } else {
        v
    }
}

/// The bias as f32, zeros when absent.
fn bias_f32(bias: &Option<Tensor>, dim: usize) -> Result<Vec<f32>> {
    match bias {
        Some(t) => cpu::small_f32(t),
        None => Ok(vec![0.0; dim]),
    }
}

/// The prefill conv on `(x, weight, state)`; the new state is left in `state_out`.
#[derive(Debug)]
pub(crate) struct CausalConv1d {
    pub bias: Option<Tensor>,
    pub silu: bool,
    pub dims: ConvDims,
    /// Channel counts of the output pieces (sum D); piece 0 is the op's output.
    pub split: Vec<usize>,
    /// Pieces 1.. of the output.
    pub rest: Vec<Slot>,
    pub state_out: Slot,
}

impl CustomOp3 for CausalConv1d {
    fn name(&self) -> &'static str {
        "causal_conv1d"
    }

    fn cpu_fwd(
        &self,
        x_s: &CpuStorage,
        x_l: &Layout,
        w_s: &CpuStorage,
        w_l: &Layout,
        st_s: &CpuStorage,
        st_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let ConvDims {
            batch,
            seqlen,
            dim,
            width,
        } = self.dims;
        let x = cpu::f32_view(op, "x", x_s, x_l)?;
        let w = cpu::f32_view(op, "weight", w_s, w_l)?;
        let st = cpu::f32_view(op, "initial_state", st_s, st_l)?;
        let bias = bias_f32(&self.bias, dim)?;
        // Tap-major weights, so the inner loop runs over contiguous channels.
        let mut wt = vec![0f32; width * dim];
        for (d, taps) in w.chunks_exact(width).enumerate() {
            for (k, &v) in taps.iter().enumerate() {
                wt[k * dim + d] = v;
            }
        }
        let mut y = vec![0f32; batch * seqlen * dim];
        y.par_chunks_mut(dim).enumerate().for_each(|(row, yr)| {
            let (bi, t) = (row / seqlen, row % seqlen);
            yr.copy_from_slice(&bias);
            for (k, wk) in wt.chunks_exact(dim).enumerate() {
                // Input position of tap k; negative positions read the state.
                let back = width - 1 - k;
                if t >= back {
                    let xr = &x[(bi * seqlen + t - back) * dim..][..dim];
                    for ((yv, wv), xv) in yr.iter_mut().zip(wk).zip(xr) {
                        *yv += wv * xv;
                    }
                } else {
                    let j = width + t - back;
                    let sb = &st[bi * dim * width..][..dim * width];
                    for ((yv, wv), sv) in
                        yr.iter_mut().zip(wk).zip(sb.iter().skip(j).step_by(width))
                    {
                        *yv += wv * sv;
                    }
                }
            }
            for v in yr.iter_mut() {
                *v = act(*v, self.silu);
            }
        });
        let mut new_state = vec![0f32; batch * dim * width];
        for (bd, row) in new_state.chunks_exact_mut(width).enumerate() {
            let (bi, d) = (bd / dim, bd % dim);
            for (j, v) in row.iter_mut().enumerate() {
                // Entry j of the new state is input position seqlen − width + j.
                *v = if seqlen + j >= width {
                    x[(bi * seqlen + seqlen + j - width) * dim + d]
                } else {
                    st[bd * width + seqlen + j]
                };
            }
        }
        let dtype = x_s.dtype();
        self.state_out
            .put(op, Storage::Cpu(cpu::from_f32(new_state, dtype)?))?;
        let mut pieces = split_rows(&y, dim, &self.split).into_iter();
        let first = pieces.next().unwrap_or_default();
        for (slot, piece) in self.rest.iter().zip(pieces) {
            slot.put(op, Storage::Cpu(cpu::from_f32(piece, dtype)?))?;
        }
        Ok((
            cpu::from_f32(first, dtype)?,
            Shape::from((batch, seqlen, self.split[0])),
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x_s: &candle_core::CudaStorage,
        x_l: &Layout,
        w_s: &candle_core::CudaStorage,
        w_l: &Layout,
        st_s: &candle_core::CudaStorage,
        st_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::causal_conv1d(self, x_s, x_l, w_s, w_l, st_s, st_l)
    }
}

/// The decode conv, in place on the state, with source `x`; the output is left in `y`.
#[derive(Debug)]
pub(crate) struct CausalConv1dStep {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
    pub silu: bool,
    pub dims: ConvDims,
    /// Channel counts of the output pieces (sum D).
    pub split: Vec<usize>,
    /// The output pieces.
    pub pieces: Vec<Slot>,
}

impl InplaceOp2 for CausalConv1dStep {
    fn name(&self) -> &'static str {
        "causal_conv1d_step"
    }

    fn cpu_fwd(
        &self,
        st_s: &mut CpuStorage,
        st_l: &Layout,
        x_s: &CpuStorage,
        x_l: &Layout,
    ) -> Result<()> {
        let op = self.name();
        let ConvDims { dim, width, .. } = self.dims;
        let x = cpu::f32_view(op, "x", x_s, x_l)?;
        let w = cpu::small_f32(&self.weight)?;
        let bias = bias_f32(&self.bias, dim)?;
        let mut y = vec![0f32; x.len()];
        cpu::update_f32(op, "state", st_s, st_l, |st| {
            for (bd, (row, yv)) in st.chunks_exact_mut(width).zip(y.iter_mut()).enumerate() {
                let d = bd % dim;
                row.rotate_left(1);
                row[width - 1] = x[bd];
                let taps = &w[d * width..][..width];
                let acc = row.iter().zip(taps).fold(bias[d], |a, (s, w)| a + s * w);
                *yv = act(acc, self.silu);
            }
        })?;
        for (slot, piece) in self.pieces.iter().zip(split_rows(&y, dim, &self.split)) {
            slot.put(op, Storage::Cpu(cpu::from_f32(piece, x_s.dtype())?))?;
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        st_s: &mut candle_core::CudaStorage,
        st_l: &Layout,
        x_s: &candle_core::CudaStorage,
        x_l: &Layout,
    ) -> Result<()> {
        crate::cuda::causal_conv1d_step(self, st_s, st_l, x_s, x_l)
    }
}

/// Checks `weight [D,K]` and the optional bias against x; returns K.
fn check_params(
    op: &str,
    x: &Tensor,
    weight: &Tensor,
    opts: &ConvOptions,
    dim: usize,
) -> Result<usize> {
    check::float(op, "x", x)?;
    let [wd, width] = check::rank::<2>(op, "weight", weight, "[D, K]")?;
    check::device(op, "weight", weight, x)?;
    check::same_dtype(op, "weight", weight, x)?;
    if wd != dim || width == 0 {
        bail!(
            "{op}: weight must have shape [D, K] with D = {dim} (x's channels) and K >= 1, got {:?}",
            weight.dims()
        )
    }
    if let Some(bias) = opts.bias {
        check::device(op, "bias", bias, x)?;
        check::shape(op, "bias", bias, &[dim], "[D]")?;
        check::same_dtype(op, "bias", bias, x)?;
    }
    Ok(width)
}

/// Checks that `split` cuts D channels into 1 to 3 non-empty pieces.
fn check_split(op: &str, split: &[usize], dim: usize) -> Result<()> {
    if split.is_empty()
        || split.len() > 3
        || split.contains(&0)
        || split.iter().sum::<usize>() != dim
    {
        bail!("{op}: split must be 1 to 3 non-empty channel counts summing to D = {dim}, got {split:?}")
    }
    Ok(())
}

/// Splits rows of `dim` channels into contiguous pieces of `split` channels each.
fn split_rows(y: &[f32], dim: usize, split: &[usize]) -> Vec<Vec<f32>> {
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

/// Runs the causal conv over `x [B,L,D]` from `initial_state [B,D,K]` (zeros if `None`).
///
/// `weight [D,K]`, bias and state in x's dtype. Returns `(y [B,L,D], new_state [B,D,K])`, both in
/// x's dtype; the new state holds the last K inputs (see the module doc).
pub fn causal_conv1d(
    x: &Tensor,
    weight: &Tensor,
    initial_state: Option<&Tensor>,
    opts: &ConvOptions,
) -> Result<(Tensor, Tensor)> {
    let dim = x.dims().last().copied().unwrap_or(0);
    let (mut ys, state) = causal_conv1d_split(x, weight, initial_state, opts, &[dim])?;
    match ys.pop() {
        Some(y) => Ok((y, state)),
        None => bail!("causal_conv1d: no output"),
    }
}

/// [`causal_conv1d`] with its output cut by channels into `split` (1 to 3 counts summing to D):
/// returns the pieces `[B,L,split[i]]`, each contiguous, as the mixer wants x, B and C.
/// On CUDA the rows of x may be a slice of a wider tensor (read in place).
pub fn causal_conv1d_split(
    x: &Tensor,
    weight: &Tensor,
    initial_state: Option<&Tensor>,
    opts: &ConvOptions,
    split: &[usize],
) -> Result<(Vec<Tensor>, Tensor)> {
    let op = "causal_conv1d";
    let [batch, seqlen, dim] = check::rank::<3>(op, "x", x, "[B, L, D]")?;
    let width = check_params(op, x, weight, opts, dim)?;
    if batch == 0 || seqlen == 0 || dim == 0 {
        bail!("{op}: x has an empty dimension, shape {:?}", x.dims())
    }
    check_split(op, split, dim)?;
    let state = match initial_state {
        Some(s) => {
            check::device(op, "initial_state", s, x)?;
            check::shape(op, "initial_state", s, &[batch, dim, width], "[B, D, K]")?;
            check::same_dtype(op, "initial_state", s, x)?;
            s.contiguous()?
        }
        None => Tensor::zeros((batch, dim, width), x.dtype(), x.device())?,
    };
    let conv = CausalConv1d {
        bias: opts.bias.map(|b| b.contiguous()).transpose()?,
        silu: opts.silu,
        dims: ConvDims {
            batch,
            seqlen,
            dim,
            width,
        },
        split: split.to_vec(),
        rest: split[1..].iter().map(|_| Slot::default()).collect(),
        state_out: Slot::default(),
    };
    let first = check::rows_view(x)?.apply_op3_no_bwd(&weight.contiguous()?, &state, &conv)?;
    let mut ys = vec![first];
    for (slot, &w) in conv.rest.into_iter().zip(&split[1..]) {
        ys.push(slot.take(op, "output piece", (batch, seqlen, w))?);
    }
    let new_state = conv.state_out.take(op, "new state", (batch, dim, width))?;
    Ok((ys, new_state))
}

/// Advances `state [B,D,K]` by one token `x [B,D]` in place and returns the conv output `y [B,D]`.
///
/// The state must be contiguous and, like `weight [D,K]` and the bias, in x's dtype.
pub fn causal_conv1d_step(
    state: &Tensor,
    x: &Tensor,
    weight: &Tensor,
    opts: &ConvOptions,
) -> Result<Tensor> {
    let dim = x.dims().last().copied().unwrap_or(0);
    match causal_conv1d_step_split(state, x, weight, opts, &[dim])?.pop() {
        Some(y) => Ok(y),
        None => bail!("causal_conv1d_step: no output"),
    }
}

/// [`causal_conv1d_step`] with its output cut by channels into `split` (1 to 3 counts summing to
/// D): returns the contiguous pieces `[B,split[i]]`. On CUDA the row of x may be a slice.
pub fn causal_conv1d_step_split(
    state: &Tensor,
    x: &Tensor,
    weight: &Tensor,
    opts: &ConvOptions,
    split: &[usize],
) -> Result<Vec<Tensor>> {
    let op = "causal_conv1d_step";
    let [batch, dim] = check::rank::<2>(op, "x", x, "[B, D]")?;
    let width = check_params(op, x, weight, opts, dim)?;
    if batch == 0 || dim == 0 {
        bail!("{op}: x has an empty dimension, shape {:?}", x.dims())
    }
    check_split(op, split, dim)?;
    check::device(op, "state", state, x)?;
    check::shape(op, "state", state, &[batch, dim, width], "[B, D, K]")?;
    check::same_dtype(op, "state", state, x)?;
    if !state.is_contiguous() {
        bail!("{op}: state must be contiguous to be updated in place")
    }
    let step = CausalConv1dStep {
        weight: weight.contiguous()?,
        bias: opts.bias.map(|b| b.contiguous()).transpose()?,
        silu: opts.silu,
        dims: ConvDims {
            batch,
            seqlen: 1,
            dim,
            width,
        },
        split: split.to_vec(),
        pieces: split.iter().map(|_| Slot::default()).collect(),
    };
    state.inplace_op2(&check::rows_view(x)?, &step)?;
    step.pieces
        .into_iter()
        .zip(split)
        .map(|(slot, &w)| slot.take(op, "output piece", (batch, w)))
        .collect()
}
