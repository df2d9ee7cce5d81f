//! The chunked SSD forward, mamba_ssm's `mamba_chunk_scan_combined` with `return_final_states`:
//! [`ssd`] is one op, and its three stages are ops of their own — [`chunk_cumsum`] (step sizes and
//! their per-chunk cumulative sums), [`fwd_pass_state`] (the state entering every chunk) and
//! [`compute_out`] (the outputs).
//!
//! With `d` = da_cumsum (log2 space) and `h_c` the state entering chunk c, for tokens `t, s` of
//! one chunk:
//!
//! ```text
//! dt_s    = clamp(softplus(dt_s + dt_bias), lo, hi)          d_t = log2(e)·Σ_{s ≤ t} a·dt_s
//! h_{c+1} = exp2(d_last)·h_c + Σ_s exp2(d_last − d_s)·dt_s · x_s B_sᵀ
//! Y[t]    = exp2(d_t)·(h_c C_t) + Σ_{s ≤ t} exp2(d_t − d_s)·(C_t·B_s)·dt_s·x_s + D·x_t   (· silu(z_t))
//! ```
//!
//! Layouts: `x [B,L,H,P]`, `dt [B,L,H]`, `a [H]` f32, `b, c [B,L,G,N]` (head `h` reads group
//! `h / (H/G)`), `z [B,L,H,P]`, `D [H]` or `[H,P]` f32; stage 1's outputs `[B,H,L]` f32, chunk
//! states `[B,H,C+1,P,N]` (entry c enters chunk c, entry C is the final state) and states
//! `[B,H,P,N]` in f32 or bf16. Values are f32, f16 or bf16; arithmetic accumulates in f32.
//!
//! Gradients: when any input takes part in one (`Tensor::track_op`), `ssd` runs as an op candle
//! records (`autograd`), whose backward (`grad`) gives the gradients of x, dt (through dt_bias,
//! softplus and the dt_limit clamp), a, b, c, D, z and the initial state, from those of y and the
//! final state; it runs on the CPU and on CUDA (the `bwd_*` kernels: programs of 64 tokens, the
//! state passes at chunks of 128 or 64; the recorded forward runs at that chunk and keeps its
//! chunk states and step sizes for them), and [`ssd_backward`] is the same backward without
//! autograd ([`ssd_saving`] + [`ssd_backward_saved`] with the states kept). Otherwise:
//! on the CPU `ssd` runs the three stages' functions (`cpu`); on CUDA one launcher queues the
//! kernels of all three back to back (`cuda`: stage 1 inside the state pass's first kernel where
//! it pays, the intermediates in scratch memory kept per stream), so that a call spends little
//! host time before its first kernel and compute_out starts while the state pass drains.

mod autograd;
mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
mod grad;
mod packed;
mod plan;
mod stages;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp3, DType, Layout, Result, Shape, Storage, Tensor};

use crate::check::{self, SsdDims};
use crate::cpu::{round_to, small, to_storage, view, wide, CpuArg, Held, Real};
use crate::dt::DtRule;
use crate::seqs::Seqs;
use crate::slot::Slot;
use crate::DtOptions;

#[cfg(feature = "timeline")]
pub use cuda::timeline::{ssd_timeline, ssd_timeline_reset, TimelineMark};
pub use packed::ssd_packed;
pub use stages::{chunk_cumsum, compute_out, fwd_pass_state};

/// Options of [`ssd`]; `Default` is chunk 256, f32 states and mamba_ssm's defaults.
#[derive(Clone, Copy, Debug)]
pub struct SsdOptions<'a> {
    /// Tokens per chunk: a power of two ≥ 16.
    pub chunk_size: usize,
    /// How raw dt becomes the step size (bias, softplus, limit).
    pub dt: DtOptions<'a>,
    /// Skip term `D`, `[H]` or `[H,P]` f32.
    pub d: Option<&'a Tensor>,
    /// Gate `z [B,L,H,P]`: the output is `y·silu(z)`.
    pub z: Option<&'a Tensor>,
    /// State before the first token, `[B,H,P,N]` f32 or bf16 (zeros if `None`).
    pub initial_state: Option<&'a Tensor>,
    /// dtype of the chunk states and of the returned final state: f32 or bf16.
    pub state_dtype: DType,
}

impl Default for SsdOptions<'_> {
    fn default() -> Self {
        Self {
            chunk_size: 256,
            dt: DtOptions::default(),
            d: None,
            z: None,
            initial_state: None,
            state_dtype: DType::F32,
        }
    }
}

/// The `ssd` op on `(x, b, c)`; the other inputs are held, contiguous (`dt`: its rows, which
/// CUDA reads in place), the initial state in the state dtype. The final state is left in
/// `final_state`.
#[derive(Debug)]
struct Ssd {
    dt: Tensor,
    a: Tensor,
    dt_bias: Option<Tensor>,
    d: Option<Tensor>,
    z: Option<Tensor>,
    init: Option<Tensor>,
    rule: DtRule,
    dims: SsdDims,
    chunk_size: usize,
    state_dtype: DType,
    final_state: Slot,
    /// Keep the chunk states and step sizes for the backward, left in `kept` (the CUDA
    /// forward's: the CPU backward computes its own).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    keep: bool,
    /// What the forward kept for the backward.
    kept: Slot<KeptPass>,
    /// Sequences packed along L of the one row: each runs from its row of `init` `[S,H,P,N]`
    /// and ends in its row of the final states.
    packed: Option<Packed>,
}

/// Sequences packed along L as the op runs them: their offsets, and the chunks of the CUDA
/// kernels, split at every boundary (no chunk holds two sequences; `dims.chunks` of them): each
/// sequence's first chunk `[S+1]` and each chunk's first token `[C+1]`.
#[derive(Debug)]
struct Packed {
    cu: Vec<usize>,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    firsts: Seqs,
    starts: Seqs,
}

impl Packed {
    /// `cu_seqlens` (checked) at chunks of `chunk` tokens from each sequence's start.
    fn new(cu_seqlens: &[usize], chunk: usize, device: &candle_core::Device) -> Result<Self> {
        let (mut firsts, mut starts) = (vec![0], Vec::new());
        for w in cu_seqlens.windows(2) {
            starts.extend((w[0]..w[1]).step_by(chunk));
            firsts.push(starts.len());
        }
        starts.push(cu_seqlens[cu_seqlens.len() - 1]);
        Ok(Self {
            cu: cu_seqlens.to_vec(),
            firsts: Seqs::new(&firsts, device)?,
            starts: Seqs::new(&starts, device)?,
        })
    }
}

impl CustomOp3 for Ssd {
    fn name(&self) -> &'static str {
        "ssd"
    }

    fn cpu_fwd(
        &self,
        x_s: &CpuStorage,
        x_l: &Layout,
        b_s: &CpuStorage,
        b_l: &Layout,
        c_s: &CpuStorage,
        c_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let args = [(x_s, x_l), (b_s, b_l), (c_s, c_l)];
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
        b_s: &candle_core::CudaStorage,
        b_l: &Layout,
        c_s: &candle_core::CudaStorage,
        c_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let fused = cuda::Fused {
            x: (x_s, x_l),
            b: (b_s, b_l),
            c: (c_s, c_l),
            dt: &self.dt,
            a: &self.a,
            dt_bias: self.dt_bias.as_ref(),
            d: self.d.as_ref(),
            z: self.z.as_ref(),
            init: self.init.as_ref(),
            rule: self.rule,
            dims: self.dims,
            chunk_size: self.chunk_size,
            state_dtype: self.state_dtype,
            keep: self.keep,
            packed: self.packed.as_ref().map(|p| (&p.firsts, &p.starts)),
        };
        let (y, last, kept) = cuda::ssd(&fused)?;
        self.final_state.put(self.name(), Storage::Cuda(last))?;
        if let Some(k) = kept {
            self.kept.put(self.name(), k.into_tensor(&self.dims))?;
        }
        let d = &self.dims;
        Ok((y, Shape::from((d.batch, d.seqlen, d.nheads, d.headdim))))
    }
}

impl Ssd {
    /// The CPU forward in the compute type `T`.
    fn cpu<T: Real>(
        &self,
        [(x_s, x_l), (b_s, b_l), (c_s, c_l)]: [CpuArg; 3],
    ) -> Result<(CpuStorage, Shape)> {
        let (op, dims) = ("ssd", self.dims);
        let (x, b, c) = (
            view::<T>(op, "x", x_s, x_l)?,
            view::<T>(op, "b", b_s, b_l)?,
            view::<T>(op, "c", c_s, c_l)?,
        );
        let held = (
            Held::new(&self.dt),
            self.z.as_ref().map(Held::new),
            self.init.as_ref().map(Held::new),
        );
        let dt = held.0.view::<T>(op, "dt")?;
        let z = held.1.as_ref().map(|h| h.view::<T>(op, "z")).transpose()?;
        let init = held
            .2
            .as_ref()
            .map(|h| h.view::<T>(op, "initial_state"))
            .transpose()?;
        let params = CpuParams {
            a: small::<T>(&self.a)?,
            bias: match &self.dt_bias {
                Some(t) => small::<T>(t)?,
                None => vec![T::zero(); dims.nheads],
            },
            d: self.d.as_ref().map(small::<T>).transpose()?,
        };
        let (y, last) = match &self.packed {
            None => {
                let inputs = [&x[..], &b, &c, &dt];
                self.cpu_run(inputs, z.as_deref(), init.as_deref(), &params, dims)
            }
            Some(packed) => {
                // Each sequence alone, from its row of the initial states.
                let (hp, gn) = (dims.nheads * dims.headdim, dims.ngroups * dims.dstate);
                let state = dims.nheads * dims.headdim * dims.dstate;
                let (mut y, mut last) = (Vec::with_capacity(x.len()), Vec::new());
                for (s, w) in packed.cu.windows(2).enumerate() {
                    let (lo, hi) = (w[0], w[1]);
                    let one = SsdDims {
                        batch: 1,
                        seqlen: hi - lo,
                        chunks: None,
                        ..dims
                    };
                    let inputs = [
                        &x[lo * hp..hi * hp],
                        &b[lo * gn..hi * gn],
                        &c[lo * gn..hi * gn],
                        &dt[lo * dims.nheads..hi * dims.nheads],
                    ];
                    let zs = z.as_deref().map(|z| &z[lo * hp..hi * hp]);
                    let init = init.as_deref().map(|i| &i[s * state..(s + 1) * state]);
                    let (ys, ls) = self.cpu_run(inputs, zs, init, &params, one);
                    y.extend(ys);
                    last.extend(ls);
                }
                (y, last)
            }
        };
        self.final_state
            .put(op, Storage::Cpu(to_storage(last, self.state_dtype)?))?;
        let y_shape = Shape::from((dims.batch, dims.seqlen, dims.nheads, dims.headdim));
        Ok((to_storage(y, x_s.dtype())?, y_shape))
    }

    /// The three stages on the CPU over `[x, b, c, dt]` of `dims`: `(y, final state)`, the
    /// chunk states rounded to the state dtype as compute_out reads them.
    fn cpu_run<T: Real>(
        &self,
        [x, b, c, dt_in]: [&[T]; 4],
        z: Option<&[T]>,
        init: Option<&[T]>,
        params: &CpuParams<T>,
        dims: SsdDims,
    ) -> (Vec<T>, Vec<T>) {
        let chunk = self.chunk_size;
        let shape = (dims.batch, dims.seqlen, dims.nheads);
        let steps = cpu::chunk_cumsum(dt_in, shape, &params.a, &params.bias, self.rule, chunk);
        let (dt, da) = steps.split_at(steps.len() / 2);
        let mut states = cpu::chunk_states((x, b), (dt, da), init, &dims, chunk);
        round_to(&mut states, self.state_dtype);
        let last = cpu::final_states(&states, &dims, chunk);
        let inputs = cpu::OutInputs {
            x,
            b,
            c,
            dt,
            da,
            d: params.d.as_deref(),
            z,
        };
        (cpu::compute_out(&inputs, &states, &dims, chunk), last)
    }
}

/// The per-head parameters of the CPU forward in its compute type: a, dt's bias (zeros when
/// none) and D.
struct CpuParams<T> {
    a: Vec<T>,
    bias: Vec<T>,
    d: Option<Vec<T>>,
}

/// Runs the SSD over `x [B,L,H,P]` with `dt [B,L,H]`, `a [H]` f32, `b, c [B,L,G,N]`.
///
/// Returns `(y [B,L,H,P] in x's dtype, final_state [B,H,P,N] in opts.state_dtype)`.
///
/// On CUDA the intermediates (stage 1's step sizes and the chunk states) go to a scratch buffer
/// that the calling thread keeps for the stream and reuses on later calls when they need at most
/// 64 MiB (L = 4096 at B=4, H=8, N=128, bf16 states: 18 MiB); larger ones, and calls made while
/// the stream is being captured into a CUDA graph, allocate theirs per call.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use mamba2_kernels::{reference, ssd, DtOptions, SsdOptions};
///
/// let dev = Device::Cpu;
/// let (b, l, h, p, g, n) = (1, 50, 4, 8, 2, 16);
/// let x = Tensor::randn(0f32, 1.0, (b, l, h, p), &dev)?;
/// let dt = Tensor::randn(0f32, 1.0, (b, l, h), &dev)?;
/// let a = Tensor::new(&[-0.5f32, -1.0, -2.0, -4.0], &dev)?;
/// let bm = Tensor::randn(0f32, 1.0, (b, l, g, n), &dev)?;
/// let cm = Tensor::randn(0f32, 1.0, (b, l, g, n), &dev)?;
/// let bias = Tensor::zeros(h, DType::F32, &dev)?;
/// let opts = SsdOptions {
///     chunk_size: 16,
///     dt: DtOptions { bias: Some(&bias), softplus: true, limit: (0.0, f32::INFINITY) },
///     ..Default::default()
/// };
/// let (y, last) = ssd(&x, &dt, &a, &bm, &cm, &opts)?;
/// assert_eq!(y.dims(), &[b, l, h, p]);
/// assert_eq!(last.dims(), &[b, h, p, n]);
///
/// // The chunked form equals the token-by-token recurrence.
/// let exact = reference::ssd(&x, &dt, &a, &bm, &cm, &opts)?;
/// let err = (y.to_dtype(DType::F64)? - &exact.y)?.abs()?.max_all()?.to_scalar::<f64>()?;
/// assert!(err < 1e-4, "{err}");
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn ssd(
    x: &Tensor,
    dt: &Tensor,
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    opts: &SsdOptions,
) -> Result<(Tensor, Tensor)> {
    let (y, last, _) = forward((x, dt, a, b, c), opts, false)?;
    Ok((y, last))
}

/// What [`ssd_saving`] keeps of its forward for [`ssd_backward_saved`]: on CUDA, the chunk states
/// and stage 1's step sizes at the chunk the backward reads them, so that the backward does not
/// compute them again. Empty on the CPU (its backward computes what it needs) and for calls that
/// record gradients (the recorded op keeps its own).
#[derive(Debug, Default)]
pub struct SsdSaved {
    kept: Option<KeptPass>,
}

impl SsdSaved {
    /// Whether the backward will compute the chunk states itself.
    pub fn is_empty(&self) -> bool {
        self.kept.is_none()
    }

    /// The bytes held on the device.
    pub fn device_bytes(&self) -> usize {
        let bytes = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        self.kept
            .as_ref()
            .map_or(0, |k| bytes(&k.states) + bytes(&k.steps))
    }
}

/// What a CUDA forward keeps for its backward, at `chunk` tokens (the backward's state chunk):
/// the chunk states `[B,H,C+1,P,N]` of the state dtype and stage 1's step sizes `[2,B,H,L]` f32
/// (dt_out; da_cumsum), so that the backward forms neither again.
#[derive(Debug)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct KeptPass {
    pub states: Tensor,
    pub steps: Tensor,
    pub chunk: usize,
}

/// [`ssd`] for a caller that runs [`ssd_backward_saved`] next (its own backward pass, as a
/// training step does): the same outputs, and the chunk states and step sizes kept for the
/// backward, which then skips computing them again (stage 1 and a state pass). On CUDA the call
/// runs at the backward's chunk (128 or 64 tokens) whatever `opts.chunk_size`: the results do not
/// depend on the chunk beyond rounding. The states take `B·H·(⌈L/chunk⌉+1)·P·N` elements of the
/// state dtype and the step sizes `2·B·H·L` f32 ([`SsdSaved::device_bytes`]) until the backward
/// releases them.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use mamba2_kernels::{ssd_backward, ssd_backward_saved, ssd_saving, SsdOptions};
///
/// let dev = Device::Cpu;
/// let (b, l, h, p, g, n) = (1, 20, 2, 4, 1, 8);
/// let x = Tensor::randn(0f32, 1.0, (b, l, h, p), &dev)?;
/// let dt = Tensor::rand(0.1f32, 0.5, (b, l, h), &dev)?;
/// let a = Tensor::new(&[-1f32, -2.0], &dev)?;
/// let bm = Tensor::randn(0f32, 1.0, (b, l, g, n), &dev)?;
/// let cm = Tensor::randn(0f32, 1.0, (b, l, g, n), &dev)?;
/// let opts = SsdOptions { chunk_size: 16, ..Default::default() };
/// let (y, _, saved) = ssd_saving(&x, &dt, &a, &bm, &cm, &opts)?;
/// let dy = y.ones_like()?;
/// let grads = ssd_backward_saved(saved, &x, &dt, &a, &bm, &cm, &opts, &dy, None)?;
///
/// // The same gradients as without the kept states.
/// let plain = ssd_backward(&x, &dt, &a, &bm, &cm, &opts, &dy, None)?;
/// let err = (grads.x - plain.x)?.abs()?.max_all()?.to_scalar::<f32>()?;
/// assert!(err < 1e-6, "{err}");
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn ssd_saving(
    x: &Tensor,
    dt: &Tensor,
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    opts: &SsdOptions,
) -> Result<(Tensor, Tensor, SsdSaved)> {
    forward((x, dt, a, b, c), opts, true)
}

/// [`ssd`] and [`ssd_saving`]: the recorded op when an input records gradients, else the plain
/// op, keeping the chunk states with `keep` on CUDA.
fn forward(
    (x, dt, a, b, c): (&Tensor, &Tensor, &Tensor, &Tensor, &Tensor),
    opts: &SsdOptions,
    keep: bool,
) -> Result<(Tensor, Tensor, SsdSaved)> {
    let dims = checked((x, dt, a, b, c), opts)?;
    let optional = [opts.d, opts.z, opts.initial_state, opts.dt.bias];
    let inputs = [x, dt, a, b, c]
        .into_iter()
        .chain(optional.into_iter().flatten());
    if inputs.into_iter().any(Tensor::track_op) {
        let (y, last) = autograd::ssd((x, dt, a, b, c), opts, dims)?;
        return Ok((y, last, SsdSaved::default()));
    }
    let op = Ssd::new((dt, a), opts, dims, keep && x.device().is_cuda(), None)?;
    let y = x
        .contiguous()?
        .apply_op3_no_bwd(&b.contiguous()?, &c.contiguous()?, &op)?;
    let last_shape = (dims.batch, dims.nheads, dims.headdim, dims.dstate);
    let last = op.final_state.take("ssd", "final state", last_shape)?;
    let kept = op.kept.take_any("ssd")?;
    Ok((y, last, SsdSaved { kept }))
}

/// [`ssd`] of the sequences packed along L of `x [1,T,H,P]` (`cu_seqlens`, checked) as one call
/// that records no gradient: each from its row of `opts.initial_state` `[S,H,P,N]` (zeros if
/// `None`) to its row of the final states, in chunks of `opts.chunk_size` from its own start.
/// Returns `(y [1,T,H,P], final states [S,H,P,N])`.
pub(crate) fn forward_packed(
    (x, dt, a, b, c): (&Tensor, &Tensor, &Tensor, &Tensor, &Tensor),
    opts: &SsdOptions,
    cu_seqlens: &[usize],
) -> Result<(Tensor, Tensor)> {
    let unbatched = SsdOptions {
        initial_state: None,
        ..*opts
    };
    let mut dims = checked((x, dt, a, b, c), &unbatched)?;
    let count = cu_seqlens.len() - 1;
    if let Some(init) = opts.initial_state {
        SsdDims {
            batch: count,
            ..dims
        }
        .state("ssd_packed", "initial_state", init, x)?;
    }
    let packed = Packed::new(cu_seqlens, opts.chunk_size, x.device())?;
    dims.chunks = Some(packed.starts.count());
    let op = Ssd::new((dt, a), opts, dims, false, Some(packed))?;
    let y = x
        .contiguous()?
        .apply_op3_no_bwd(&b.contiguous()?, &c.contiguous()?, &op)?;
    let last_shape = (count, dims.nheads, dims.headdim, dims.dstate);
    let last = op
        .final_state
        .take("ssd_packed", "final states", last_shape)?;
    Ok((y, last))
}

impl Ssd {
    /// The op on `dims` (checked) with `opts`' parameters held contiguous.
    fn new(
        (dt, a): (&Tensor, &Tensor),
        opts: &SsdOptions,
        dims: SsdDims,
        keep: bool,
        packed: Option<Packed>,
    ) -> Result<Self> {
        let contiguous = |t: Option<&Tensor>| t.map(Tensor::contiguous).transpose();
        let init = opts
            .initial_state
            .map(|s| s.to_dtype(opts.state_dtype)?.contiguous())
            .transpose()?;
        Ok(Self {
            dt: check::rows_view(dt)?,
            a: a.contiguous()?,
            dt_bias: contiguous(opts.dt.bias)?,
            d: contiguous(opts.d)?,
            z: contiguous(opts.z)?,
            init,
            rule: opts.dt.rule(),
            dims,
            chunk_size: opts.chunk_size,
            state_dtype: opts.state_dtype,
            final_state: Slot::default(),
            keep,
            kept: Slot::default(),
            packed,
        })
    }
}

/// The gradients of [`ssd`]'s inputs that [`ssd_backward`] returns: x, dt, b and c in their
/// dtypes, a and dt_bias `[H]` (dt_bias's also when the call had none: the gradient of a zero
/// bias), D in its shape and the initial state `[B,H,P,N]`, each when the call had one; the
/// parameters' gradients are f32 (f64 for f64 values on the CPU).
#[derive(Debug)]
pub struct SsdGrads {
    pub x: Tensor,
    pub dt: Tensor,
    pub a: Tensor,
    pub b: Tensor,
    pub c: Tensor,
    pub dt_bias: Tensor,
    pub d: Option<Tensor>,
    pub initial_state: Option<Tensor>,
}

/// The backward of [`ssd`] without autograd: the gradients of every input given `dy`, the
/// gradient of y (`[B,L,H,P]`), and `dlast`, that of the final state (`[B,H,P,N]`; `None`: zero),
/// for callers that run their own backward pass (as mamba_ssm's `_mamba_chunk_scan_combined_bwd`
/// serves PyTorch). The gate is not part of it: `opts.z` must be `None` (apply `y·silu(z)`
/// outside, or call [`ssd`] on tensors that record gradients). On CUDA it is the backward
/// kernels that candle's autograd runs for [`ssd`]; on the CPU the same code as its CPU backward.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use mamba2_kernels::{ssd, ssd_backward, SsdOptions};
///
/// let dev = Device::Cpu;
/// let (b, l, h, p, g, n) = (1, 20, 2, 4, 1, 8);
/// let x = Tensor::randn(0f32, 1.0, (b, l, h, p), &dev)?;
/// let dt = Tensor::rand(0.1f32, 0.5, (b, l, h), &dev)?;
/// let a = Tensor::new(&[-1f32, -2.0], &dev)?;
/// let bm = Tensor::randn(0f32, 1.0, (b, l, g, n), &dev)?;
/// let cm = Tensor::randn(0f32, 1.0, (b, l, g, n), &dev)?;
/// let opts = SsdOptions { chunk_size: 16, ..Default::default() };
/// let dy = Tensor::ones((b, l, h, p), candle_core::DType::F32, &dev)?;
/// let grads = ssd_backward(&x, &dt, &a, &bm, &cm, &opts, &dy, None)?;
///
/// // The same gradient as autograd's.
/// let xv = candle_core::Var::from_tensor(&x)?;
/// let (y, _) = ssd(xv.as_tensor(), &dt, &a, &bm, &cm, &opts)?;
/// let auto = y.sum_all()?.backward()?;
/// let dx = auto.get(xv.as_tensor()).expect("x's gradient");
/// let err = (dx - &grads.x)?.abs()?.max_all()?.to_scalar::<f32>()?;
/// assert!(err < 1e-5, "{err}");
/// # Ok::<(), candle_core::Error>(())
/// ```
#[allow(clippy::too_many_arguments)]
pub fn ssd_backward(
    x: &Tensor,
    dt: &Tensor,
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    opts: &SsdOptions,
    dy: &Tensor,
    dlast: Option<&Tensor>,
) -> Result<SsdGrads> {
    ssd_backward_saved(SsdSaved::default(), x, dt, a, b, c, opts, dy, dlast)
}

/// [`ssd_backward`] after [`ssd_saving`] on the same inputs and options: the same gradients,
/// from the chunk states the forward kept (released once read). States of another call are
/// refused when their shape or dtype shows it; the inputs must be the forward's.
#[allow(clippy::too_many_arguments)]
pub fn ssd_backward_saved(
    saved: SsdSaved,
    x: &Tensor,
    dt: &Tensor,
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    opts: &SsdOptions,
    dy: &Tensor,
    dlast: Option<&Tensor>,
) -> Result<SsdGrads> {
    let op = "ssd_backward";
    let dims = checked((x, dt, a, b, c), opts)?;
    if opts.z.is_some() {
        bail!("{op}: differentiates the scan without its gate: opts.z must be None (apply y·silu(z) outside, or call ssd on tensors that record gradients)")
    }
    dims.like_x(op, "dy", dy, x)?;
    check::float(op, "dy", dy)?;
    if let Some(g) = dlast {
        dims.state(op, "dlast", g, x)?;
        check::float(op, "dlast", g)?;
    }
    let plain = |t: &Tensor| t.detach();
    let (x, dt, a, b, c, dy) = (plain(x), plain(dt), plain(a), plain(b), plain(c), plain(dy));
    let dlast = dlast.map(plain);
    if let Some(k) = &saved.kept {
        check::device(op, "saved chunk states", &k.states, &x)?;
    }
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        let held = |t: &Tensor| t.contiguous();
        let init = opts.initial_state.map(|s| s.detach());
        let f32s = |t: Option<&Tensor>| {
            t.map(|t| t.detach().to_dtype(DType::F32)?.contiguous())
                .transpose()
        };
        let (bias, dskip) = (f32s(opts.dt.bias)?, f32s(opts.d)?);
        let dlast = dlast
            .map(|g| g.to_dtype(DType::F32)?.contiguous())
            .transpose()?;
        let (xc, bc, cc) = (held(&x)?, held(&b)?, held(&c)?);
        let dyc = dy.to_dtype(x.dtype())?.contiguous()?;
        let af = a.to_dtype(DType::F32)?.contiguous()?;
        let g = cuda::ssd_backward(cuda::Backward {
            x: &xc,
            b: &bc,
            c: &cc,
            dt: &check::rows_view(&dt)?,
            a: &af,
            dt_opts: DtOptions {
                bias: bias.as_ref(),
                softplus: opts.dt.softplus,
                limit: opts.dt.limit,
            },
            d: dskip.as_ref(),
            init: init.as_ref(),
            dy: &dyc,
            dlast: dlast.as_ref(),
            dims,
            state_dtype: opts.state_dtype,
            kept: saved.kept,
        })?;
        return Ok(SsdGrads {
            x: g.x,
            dt: g.dt,
            a: g.a,
            b: g.b,
            c: g.c,
            dt_bias: g.bias,
            d: g.d,
            initial_state: g.init,
        });
    }
    autograd::backward_cpu((&x, &dt, &a, &b, &c), opts, dims, (&dy, dlast.as_ref()))
}

/// The dimensions of an `ssd` call, after every check of its inputs.
fn checked(
    (x, dt, a, b, c): (&Tensor, &Tensor, &Tensor, &Tensor, &Tensor),
    opts: &SsdOptions,
) -> Result<SsdDims> {
    let op = "ssd";
    let dims = SsdDims::values(op, x, b)?;
    check::device(op, "dt", dt, x)?;
    check::float(op, "dt", dt)?;
    let bld = [dims.batch, dims.seqlen, dims.nheads];
    check::shape(op, "dt", dt, &bld, "[B, L, H]")?;
    check::head_param(op, "a", a, x, dims.nheads)?;
    dims.like_b(op, "c", c, x)?;
    opts.dt.check(op, x, dims.nheads)?;
    dims.check_chunking(op, opts.chunk_size)?;
    check::state_dtype(op, "state_dtype", opts.state_dtype, x.device())?;
    if let Some(d) = opts.d {
        check::skip_param(op, d, x, dims.nheads, dims.headdim)?;
    }
    if let Some(z) = opts.z {
        dims.like_x(op, "z", z, x)?;
    }
    if let Some(s) = opts.initial_state {
        dims.state(op, "initial_state", s, x)?;
    }
    Ok(dims)
}

/// [`ssd`] on x, B and C held in one tensor `xbc [B, L, H·P + 2·G·N]`, per token `[x | B | C]` —
/// the causal conv's output in a Mamba-2 mixer —, with H read from `dt [B, L, H]` and
/// `(G, N) = groups_state`: the values of `ssd` on the three slices. When gradients are
/// recorded (and there is no z) the op reads xbc as it is and returns its gradient in xbc's
/// layout, so nothing is cut apart on the way in or scattered back on the way out.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use mamba2_kernels::{ssd, ssd_xbc, SsdOptions};
///
/// let dev = Device::Cpu;
/// let (b, l, h, p, g, n) = (1, 10, 2, 4, 1, 8);
/// let xbc = Tensor::randn(0f32, 1.0, (b, l, h * p + 2 * g * n), &dev)?;
/// let dt = Tensor::randn(0f32, 1.0, (b, l, h), &dev)?.exp()?;
/// let a = Tensor::new(&[-1f32, -2.0], &dev)?;
/// let opts = SsdOptions { chunk_size: 16, ..Default::default() };
/// let (y, _) = ssd_xbc(&xbc, &dt, &a, (g, n), &opts)?;
///
/// let x = xbc.narrow(2, 0, h * p)?.reshape((b, l, h, p))?;
/// let bm = xbc.narrow(2, h * p, g * n)?.reshape((b, l, g, n))?;
/// let cm = xbc.narrow(2, h * p + g * n, g * n)?.reshape((b, l, g, n))?;
/// let (y2, _) = ssd(&x, &dt, &a, &bm, &cm, &opts)?;
/// assert_eq!((y - y2)?.abs()?.max_all()?.to_scalar::<f32>()?, 0.0);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn ssd_xbc(
    xbc: &Tensor,
    dt: &Tensor,
    a: &Tensor,
    (ngroups, dstate): (usize, usize),
    opts: &SsdOptions,
) -> Result<(Tensor, Tensor)> {
    let op = "ssd";
    let [batch, seqlen, width] = check::rank::<3>(op, "xbc", xbc, "[B, L, H·P + 2·G·N]")?;
    let [_, _, nheads] = check::rank::<3>(op, "dt", dt, "[B, L, H]")?;
    let bc = ngroups.checked_mul(dstate).and_then(|gn| gn.checked_mul(2));
    let headdim = match bc {
        Some(bc) if nheads > 0 && width > bc && (width - bc) % nheads == 0 => (width - bc) / nheads,
        _ => bail!(
            "{op}: xbc has width {width}, which is not H·P + 2·G·N for H = {nheads} (from dt), \
             G = {ngroups} and N = {dstate} with P ≥ 1"
        ),
    };
    let (hp, gn) = (nheads * headdim, ngroups * dstate);
    if !xbc.track_op() || opts.z.is_some() {
        let x = xbc
            .narrow(2, 0, hp)?
            .reshape((batch, seqlen, nheads, headdim))?;
        let b = xbc
            .narrow(2, hp, gn)?
            .reshape((batch, seqlen, ngroups, dstate))?;
        let c = xbc
            .narrow(2, hp + gn, gn)?
            .reshape((batch, seqlen, ngroups, dstate))?;
        return ssd(&x, dt, a, &b, &c, opts);
    }
    // The checks of `ssd` on stand-ins of the slices' shapes (one element each, broadcast).
    let like = |shape: (usize, usize, usize, usize)| {
        Tensor::zeros((), xbc.dtype(), xbc.device())?.broadcast_as(shape)
    };
    let x = like((batch, seqlen, nheads, headdim))?;
    let bc = like((batch, seqlen, ngroups, dstate))?;
    let dims = checked((&x, dt, a, &bc, &bc), opts)?;
    autograd::ssd_xbc(xbc, (dt, a), opts, dims)
}
