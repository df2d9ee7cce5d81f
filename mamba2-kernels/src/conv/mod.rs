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
//! x's dtype (f32, f16 or bf16), accumulation in f32; on the CPU also f64, computed in f64.
//!
//! Autograd: [`causal_conv1d`] and [`causal_conv1d_split`] are differentiable in x, the weight and
//! the bias. When none of them tracks gradients (inference) the op is not recorded and costs
//! nothing extra; otherwise the conv is a recorded op with a backward (see `grad.rs`). The
//! initial state gets no gradient and the returned new state carries none. The backward runs on
//! the device of its inputs, CPU or CUDA. The one-token step is not differentiable.

mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
mod grad;
mod packed;
mod plan;

pub use packed::causal_conv1d_split_packed;

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp3, InplaceOp2, Layout, Result, Shape, Storage, Tensor,
};

use crate::check::{self, ConvDims};
use crate::cpu::{small, to_storage, update, view, wide, CpuArg, Real};
use crate::seqs::Seqs;
use crate::slot::Slot;

/// Options shared by [`causal_conv1d`] and [`causal_conv1d_step`].
#[derive(Clone, Copy, Debug, Default)]
pub struct ConvOptions<'a> {
    /// Per-channel bias `[D]`, in x's dtype.
    pub bias: Option<&'a Tensor>,
    /// Apply SiLU to the output (Mamba-2 always does).
    pub silu: bool,
}

/// The bias in the compute type, zeros when absent.
fn bias_of<T: Real>(bias: &Option<Tensor>, dim: usize) -> Result<Vec<T>> {
    match bias {
        Some(t) => small(t),
        None => Ok(vec![T::zero(); dim]),
    }
}

/// The prefill conv on `(x, weight, state)`; the new state is left in `state_out`.
#[derive(Debug)]
struct CausalConv1d {
    bias: Option<Tensor>,
    silu: bool,
    dims: ConvDims,
    /// Channel counts of the output pieces (sum D); piece 0 is the op's output.
    split: Vec<usize>,
    /// Pieces 1.. of the output.
    rest: Vec<Slot>,
    state_out: Slot,
    /// Sequences packed along L of the one row, each from its own row of the state `[S,D,K]`.
    packed: Option<Seqs>,
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
        let args = [(x_s, x_l), (w_s, w_l), (st_s, st_l)];
        if wide(x_s.dtype()) {
            self.cpu::<f64>(args)
        } else {
            self.cpu::<f32>(args)
        }
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
        let cu = self
            .packed
            .as_ref()
            .map(|p| match &p.device {
                Some(t) => Ok((p.count(), crate::cuda::Held::new(t))),
                None => bail!("{}: packed offsets are not on the device", self.name()),
            })
            .transpose()?;
        let packed = match &cu {
            Some((n, held)) => Some((*n, held.arg(self.name(), "cu_seqlens")?)),
            None => None,
        };
        let conv = cuda::Conv {
            silu: self.silu,
            dims: self.dims,
            split: &self.split,
            packed,
        };
        let held = self.bias.as_ref().map(crate::cuda::Held::new);
        let bias = match &held {
            Some(h) => Some((h.cuda(self.name(), "bias")?, h.layout)),
            None => None,
        };
        let (ys, new_state) =
            cuda::causal_conv1d(&conv, (x_s, x_l), (w_s, w_l), bias, (st_s, st_l))?;
        self.state_out.put(self.name(), Storage::Cuda(new_state))?;
        let mut ys = ys.into_iter();
        let Some(first) = ys.next() else {
            bail!("{}: no output", self.name())
        };
        for (slot, y) in self.rest.iter().zip(ys) {
            slot.put(self.name(), Storage::Cuda(y))?;
        }
        let d = self.dims;
        Ok((first, Shape::from((d.batch, d.seqlen, self.split[0]))))
    }
}

impl CausalConv1d {
    fn cpu<T: Real>(
        &self,
        [(x_s, x_l), (w_s, w_l), (st_s, st_l)]: [CpuArg; 3],
    ) -> Result<(CpuStorage, Shape)> {
        let op = "causal_conv1d";
        let x = view::<T>(op, "x", x_s, x_l)?;
        let w = view::<T>(op, "weight", w_s, w_l)?;
        let st = view::<T>(op, "initial_state", st_s, st_l)?;
        let bias = bias_of::<T>(&self.bias, self.dims.dim)?;
        let (y, new_state) = match &self.packed {
            None => cpu::prefill(&x, &w, &st, &bias, self.silu, self.dims),
            Some(seqs) => {
                // Each sequence alone, from its row of the state.
                let ConvDims { dim, width, .. } = self.dims;
                let (mut y, mut states) = (Vec::with_capacity(x.len()), Vec::new());
                for s in 0..seqs.count() {
                    let r = seqs.range(s);
                    let dims = ConvDims {
                        batch: 1,
                        seqlen: r.len(),
                        ..self.dims
                    };
                    let one = &st[s * dim * width..][..dim * width];
                    let (ys, state) = cpu::prefill(
                        &x[r.start * dim..r.end * dim],
                        &w,
                        one,
                        &bias,
                        self.silu,
                        dims,
                    );
                    y.extend(ys);
                    states.extend(state);
                }
                (y, states)
            }
        };
        let dtype = x_s.dtype();
        self.state_out
            .put(op, Storage::Cpu(to_storage(new_state, dtype)?))?;
        let mut pieces = cpu::split_rows(&y, self.dims.dim, &self.split).into_iter();
        let first = pieces.next().unwrap_or_default();
        for (slot, piece) in self.rest.iter().zip(pieces) {
            slot.put(op, Storage::Cpu(to_storage(piece, dtype)?))?;
        }
        let d = self.dims;
        Ok((
            to_storage(first, dtype)?,
            Shape::from((d.batch, d.seqlen, self.split[0])),
        ))
    }
}

/// The decode conv, in place on the state, with source `x`; the output is left in `y`.
#[derive(Debug)]
struct CausalConv1dStep {
    weight: Tensor,
    bias: Option<Tensor>,
    silu: bool,
    dims: ConvDims,
    /// Channel counts of the output pieces (sum D).
    split: Vec<usize>,
    /// The output pieces.
    pieces: Vec<Slot>,
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
        if wide(x_s.dtype()) {
            self.cpu::<f64>((st_s, st_l), (x_s, x_l))
        } else {
            self.cpu::<f32>((st_s, st_l), (x_s, x_l))
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        st_s: &mut candle_core::CudaStorage,
        st_l: &Layout,
        x_s: &candle_core::CudaStorage,
        x_l: &Layout,
    ) -> Result<()> {
        let conv = cuda::Conv {
            silu: self.silu,
            dims: self.dims,
            split: &self.split,
            packed: None,
        };
        let bias = self.bias.as_ref();
        let ys = cuda::causal_conv1d_step(&conv, &self.weight, bias, (st_s, st_l), (x_s, x_l))?;
        for (slot, y) in self.pieces.iter().zip(ys) {
            slot.put(self.name(), Storage::Cuda(y))?;
        }
        Ok(())
    }
}

impl CausalConv1dStep {
    fn cpu<T: Real>(
        &self,
        (st_s, st_l): (&mut CpuStorage, &Layout),
        (x_s, x_l): CpuArg,
    ) -> Result<()> {
        let op = "causal_conv1d_step";
        let x = view::<T>(op, "x", x_s, x_l)?;
        let w = small::<T>(&self.weight)?;
        let bias = bias_of::<T>(&self.bias, self.dims.dim)?;
        let mut y = Vec::new();
        update::<T>(op, "state", st_s, st_l, |st| {
            y = cpu::step(st, &x, &w, &bias, self.silu, self.dims);
        })?;
        let pieces = cpu::split_rows(&y, self.dims.dim, &self.split);
        for (slot, piece) in self.pieces.iter().zip(pieces) {
            slot.put(op, Storage::Cpu(to_storage(piece, x_s.dtype())?))?;
        }
        Ok(())
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

/// Initial states `[rows, D, K]` named `name` (shape written `doc`): checked against x and
/// contiguous, zeros when `None`.
fn states_of(
    op: &str,
    (name, doc): (&str, &str),
    x: &Tensor,
    states: Option<&Tensor>,
    [rows, dim, width]: [usize; 3],
) -> Result<Tensor> {
    match states {
        Some(s) => {
            check::device(op, name, s, x)?;
            check::shape(op, name, s, &[rows, dim, width], doc)?;
            check::same_dtype(op, name, s, x)?;
            s.contiguous()
        }
        None => Tensor::zeros((rows, dim, width), x.dtype(), x.device()),
    }
}

/// The conv's dims and its initial state `[B,D,K]` (checked against x, contiguous; zeros when
/// `None`).
fn initial_state_of(
    op: &str,
    x: &Tensor,
    initial_state: Option<&Tensor>,
    [batch, seqlen, dim, width]: [usize; 4],
) -> Result<(Tensor, ConvDims)> {
    let named = ("initial_state", "[B, D, K]");
    let state = states_of(op, named, x, initial_state, [batch, dim, width])?;
    let dims = ConvDims {
        batch,
        seqlen,
        dim,
        width,
    };
    Ok((state, dims))
}

/// Runs the causal conv over `x [B,L,D]` from `initial_state [B,D,K]` (zeros if `None`).
///
/// `weight [D,K]`, bias and state in x's dtype. Returns `(y [B,L,D], new_state [B,D,K])`, both in
/// x's dtype; the new state holds the last K inputs (see the module doc). Differentiable in x, the
/// weight and the bias (not in the initial state; the new state carries no gradient).
///
/// ```
/// use candle_core::{Device, Tensor};
/// use mamba2_kernels::{causal_conv1d, ConvOptions};
///
/// // One channel, taps [1, 2, 3] (oldest first): y_t = x_{t−2} + 2·x_{t−1} + 3·x_t.
/// let x = Tensor::new(&[[[1f32], [10.0], [100.0]]], &Device::Cpu)?; // [B=1, L=3, D=1]
/// let w = Tensor::new(&[[1f32, 2.0, 3.0]], &Device::Cpu)?;
/// let (y, state) = causal_conv1d(&x, &w, None, &ConvOptions::default())?;
/// assert_eq!(y.flatten_all()?.to_vec1::<f32>()?, [3.0, 32.0, 321.0]);
/// assert_eq!(state.flatten_all()?.to_vec1::<f32>()?, [1.0, 10.0, 100.0]);
/// # Ok::<(), candle_core::Error>(())
/// ```
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
///
/// ```
/// use candle_core::{Device, Tensor, D};
/// use mamba2_kernels::{causal_conv1d, causal_conv1d_split, ConvOptions};
///
/// let dev = Device::Cpu;
/// let xbc = Tensor::randn(0f32, 1.0, (1, 7, 10), &dev)?; // x | B | C of 6 + 2 + 2 channels
/// let w = Tensor::randn(0f32, 1.0, (10, 4), &dev)?;
/// let opts = ConvOptions { bias: None, silu: true };
/// let (pieces, _) = causal_conv1d_split(&xbc, &w, None, &opts, &[6, 2, 2])?;
/// let (whole, _) = causal_conv1d(&xbc, &w, None, &opts)?;
/// assert_eq!(pieces[1].dims(), &[1, 7, 2]);
/// let joined = Tensor::cat(&pieces, D::Minus1)?;
/// assert_eq!(joined.to_vec3::<f32>()?, whole.to_vec3::<f32>()?);
/// # Ok::<(), candle_core::Error>(())
/// ```
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
    let (state, dims) = initial_state_of(op, x, initial_state, [batch, seqlen, dim, width])?;
    // Only a graph that tracks gradients records the op: inference runs it unrecorded.
    if x.track_op() || weight.track_op() || opts.bias.is_some_and(Tensor::track_op) {
        let mode = (opts.silu, dims);
        return grad::causal_conv1d_recorded(x, weight, opts.bias, &state, mode, split);
    }
    let conv = CausalConv1d {
        bias: opts.bias.map(|b| b.contiguous()).transpose()?,
        silu: opts.silu,
        dims,
        split: split.to_vec(),
        rest: split[1..].iter().map(|_| Slot::default()).collect(),
        state_out: Slot::default(),
        packed: None,
    };
    let first = check::rows_view(x)?.apply_op3_no_bwd(&weight.contiguous()?, &state, &conv)?;
    let mut ys = vec![first];
    for (slot, &w) in conv.rest.into_iter().zip(&split[1..]) {
        ys.push(slot.take(op, "output piece", (batch, seqlen, w))?);
    }
    let new_state = conv.state_out.take(op, "new state", (batch, dim, width))?;
    Ok((ys, new_state))
}

/// [`causal_conv1d_split`] over the sequences packed along L of `x [1,T,D]` (`cu_seqlens`,
/// checked) as one call that records no gradient, each sequence from its row of
/// `initial_states [S,D,K]` (zeros if `None`): returns the pieces `[1,T,split[i]]` and the new
/// states `[S,D,K]`.
pub(crate) fn split_packed_unrecorded(
    x: &Tensor,
    weight: &Tensor,
    initial_states: Option<&Tensor>,
    opts: &ConvOptions,
    split: &[usize],
    cu_seqlens: &[usize],
) -> Result<(Vec<Tensor>, Tensor)> {
    let op = "causal_conv1d_packed";
    let [_, total, dim] = check::rank::<3>(op, "x", x, "[1, T, D]")?;
    let width = check_params(op, x, weight, opts, dim)?;
    check_split(op, split, dim)?;
    let seqs = Seqs::new(cu_seqlens, x.device())?;
    let count = seqs.count();
    let named = ("initial_states", "[S, D, K]");
    let states = states_of(op, named, x, initial_states, [count, dim, width])?;
    let conv = CausalConv1d {
        bias: opts.bias.map(|b| b.contiguous()).transpose()?,
        silu: opts.silu,
        dims: ConvDims {
            batch: 1,
            seqlen: total,
            dim,
            width,
        },
        split: split.to_vec(),
        rest: split[1..].iter().map(|_| Slot::default()).collect(),
        state_out: Slot::default(),
        packed: Some(seqs),
    };
    let first = check::rows_view(x)?.apply_op3_no_bwd(&weight.contiguous()?, &states, &conv)?;
    let mut ys = vec![first];
    for (slot, &w) in conv.rest.into_iter().zip(&split[1..]) {
        ys.push(slot.take(op, "output piece", (1, total, w))?);
    }
    let new_states = conv.state_out.take(op, "new states", (count, dim, width))?;
    Ok((ys, new_states))
}

/// The gradients of [`causal_conv1d`]'s differentiable arguments.
#[derive(Debug)]
pub struct ConvGrads {
    /// `[B,L,D]`, x's dtype.
    pub x: Tensor,
    /// `[D,K]`, the weight's dtype.
    pub weight: Tensor,
    /// `[D]`, when the conv has a bias.
    pub bias: Option<Tensor>,
}

/// The backward of [`causal_conv1d`] without autograd: the gradients of x, the weight and the
/// bias for `dy [B,L,D]`, the gradient of y, for callers that run their own backward pass (a fused
/// layer's). The initial state gets none, as in [`causal_conv1d`]. On CUDA the kernel candle's
/// autograd runs for [`causal_conv1d`]; on the CPU its CPU backward.
pub fn causal_conv1d_backward(
    x: &Tensor,
    weight: &Tensor,
    initial_state: Option<&Tensor>,
    opts: &ConvOptions,
    dy: &Tensor,
) -> Result<ConvGrads> {
    causal_conv1d_split_backward(x, weight, initial_state, opts, std::slice::from_ref(dy))
}

/// [`causal_conv1d_backward`] for the gradients of [`causal_conv1d_split`]'s pieces: `dy` holds
/// 1 to 3 tensors `[B,L,D_k]` whose channel counts sum to D (the mixer's dx, dB and dC). On CUDA
/// the kernel reads the pieces where they are, rather than a copy of them side by side.
pub fn causal_conv1d_split_backward(
    x: &Tensor,
    weight: &Tensor,
    initial_state: Option<&Tensor>,
    opts: &ConvOptions,
    dy: &[Tensor],
) -> Result<ConvGrads> {
    let op = "causal_conv1d_backward";
    let (state, dims) = split_backward_checked(op, x, weight, initial_state, opts, dy)?;
    match grad::backward(x, weight, opts.bias, &state, (opts.silu, dims), dy)? {
        (Some(x), Some(weight), bias) => Ok(ConvGrads { x, weight, bias }),
        _ => bail!("{op}: the backward returned no gradient"),
    }
}

/// The checks of the split backward's arguments: returns the initial state (zeros if none) and
/// the conv's dimensions.
fn split_backward_checked(
    op: &str,
    x: &Tensor,
    weight: &Tensor,
    initial_state: Option<&Tensor>,
    opts: &ConvOptions,
    dy: &[Tensor],
) -> Result<(Tensor, ConvDims)> {
    let [batch, seqlen, dim] = check::rank::<3>(op, "x", x, "[B, L, D]")?;
    let width = check_params(op, x, weight, opts, dim)?;
    if batch == 0 || seqlen == 0 || dim == 0 {
        bail!("{op}: x has an empty dimension, shape {:?}", x.dims())
    }
    let mut split = Vec::with_capacity(dy.len());
    for piece in dy {
        check::device(op, "dy", piece, x)?;
        check::same_dtype(op, "dy", piece, x)?;
        let [b, l, d] = check::rank::<3>(op, "dy", piece, "[B, L, D_k]")?;
        if (b, l) != (batch, seqlen) {
            bail!(
                "{op}: dy pieces must be [{batch}, {seqlen}, D_k] like x's rows, got {:?}",
                piece.dims()
            )
        }
        split.push(d);
    }
    check_split(op, &split, dim)?;
    initial_state_of(op, x, initial_state, [batch, seqlen, dim, width])
}

/// [`causal_conv1d_split_backward`] writing dx into columns `offset..offset + D` of `dx_buffer
/// [B, L, W]` (contiguous, x's dtype) instead of a tensor of its own, as a fused layer's backward
/// wants it beside other gradients (in_proj's `[dz | dxBC | ddt]`): returns the weight's and the
/// bias's gradients. On CUDA the kernel writes there directly.
pub fn causal_conv1d_split_backward_into(
    x: &Tensor,
    weight: &Tensor,
    initial_state: Option<&Tensor>,
    opts: &ConvOptions,
    dy: &[Tensor],
    (dx_buffer, offset): (&Tensor, usize),
) -> Result<(Tensor, Option<Tensor>)> {
    let op = "causal_conv1d_backward";
    let (state, dims) = split_backward_checked(op, x, weight, initial_state, opts, dy)?;
    check::into(op, "dx_buffer", dx_buffer, x, offset)?;
    let into = (dx_buffer, offset);
    match grad::backward_into(x, weight, opts.bias, &state, (opts.silu, dims), dy, into)? {
        (Some(weight), bias) => Ok((weight, bias)),
        _ => bail!("{op}: the backward returned no gradient"),
    }
}

/// Advances `state [B,D,K]` by one token `x [B,D]` in place and returns the conv output `y [B,D]`.
///
/// The state must be contiguous and, like `weight [D,K]` and the bias, in x's dtype.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use mamba2_kernels::{causal_conv1d, causal_conv1d_step, ConvOptions};
///
/// let dev = Device::Cpu;
/// let opts = ConvOptions { bias: None, silu: true };
/// let x = Tensor::randn(0f32, 1.0, (2, 6, 5), &dev)?; // [B, L, D]
/// let w = Tensor::randn(0f32, 1.0, (5, 4), &dev)?;
/// let (y, _) = causal_conv1d(&x, &w, None, &opts)?;
/// // The same conv one token at a time, on a rolling state.
/// let state = Tensor::zeros((2, 5, 4), x.dtype(), &dev)?;
/// for t in 0..6 {
///     let yt = causal_conv1d_step(&state, &x.narrow(1, t, 1)?.squeeze(1)?, &w, &opts)?;
///     let diff = (yt - y.narrow(1, t, 1)?.squeeze(1)?)?.abs()?.max_all()?;
///     assert!(diff.to_scalar::<f32>()? < 1e-6);
/// }
/// # Ok::<(), candle_core::Error>(())
/// ```
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
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use mamba2_kernels::{causal_conv1d_step_split, ConvOptions};
///
/// let dev = Device::Cpu;
/// let state = Tensor::zeros((2, 5, 3), DType::F32, &dev)?; // [B, D, K]
/// let w = Tensor::ones((5, 3), DType::F32, &dev)?;
/// let x = Tensor::new(&[[1f32, 2.0, 3.0, 4.0, 5.0], [6.0, 7.0, 8.0, 9.0, 10.0]], &dev)?;
/// let pieces = causal_conv1d_step_split(&state, &x, &w, &ConvOptions::default(), &[3, 2])?;
/// // From a zero state, all-ones taps give back the token itself.
/// assert_eq!(pieces[0].to_vec2::<f32>()?, [[1.0, 2.0, 3.0], [6.0, 7.0, 8.0]]);
/// assert_eq!(pieces[1].to_vec2::<f32>()?, [[4.0, 5.0], [9.0, 10.0]]);
/// // The state now ends with the token.
/// assert_eq!(state.narrow(2, 2, 1)?.squeeze(2)?.to_vec2::<f32>()?, x.to_vec2::<f32>()?);
/// # Ok::<(), candle_core::Error>(())
/// ```
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
