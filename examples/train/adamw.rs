//! The optimizer of the train example: AdamW whose moments can be saved and restored, and
//! gradient clipping by global norm.
//!
//! candle-nn's `AdamW` keeps its moments and step count private, so a checkpoint could not hold
//! them; this one computes the same update in the same order (so it matches candle-nn's bit for
//! bit, see `tests/train_cli.rs`), PyTorch's `AdamW`:
//!
//! ```text
//! m ← β1·m + (1−β1)·g        v ← β2·v + (1−β2)·g²        (t = the step, from 1)
//! θ ← θ·(1 − lr·λ) − lr · (m / (1−β1ᵗ)) / (√(v / (1−β2ᵗ)) + ε)
//! ```
//!
//! with the decay λ applied to the weights `new`'s predicate picks (the train example: matrices,
//! not biases, norms, `A_log`, `D` or `dt_bias`, as `tools/train.py` does). On the CPU each
//! weight's update is three passes in place (the two moments, then the weight) instead of a
//! dozen tensor ops, every product rounded as its tensor op rounds it, so the bits are the same.
//!
//! On CUDA (with the `cuda` feature) a step is three kernel launches for all the weights
//! together, compiled at run time with NVRTC (which candle's CUDA backend links): the sums of
//! squares of the gradients, chunk by chunk; their total, the global norm and the clipping
//! scale, in one block; and the update of every weight and both moments in place, which also
//! flags a non-finite weight. The launches read the weights' table (addresses, sizes, decay),
//! copied to the device once per step; nothing waits for the device, and the norm and the flag
//! come back with the step's losses in one read ([`Stats::read`]). Each product is rounded as
//! on the CPU (no fused multiply-add), so the update is the CPU's bit for bit when clipping does
//! not scale the gradients (the norm's summation order differs). Other devices update with
//! tensor ops.

use std::collections::HashMap;

use anyhow::{bail, Result};
use candle_core::{CpuStorage, DType, InplaceOp2, InplaceOp3, Layout, Tensor, Var};
use candle_nn::ParamsAdamW;
use rayon::prelude::*;

/// β1, β2 and ε of `tools/train.py`.
pub const BETA1: f64 = 0.9;
pub const BETA2: f64 = 0.95;
pub const EPS: f64 = 1e-8;

/// Names of the moments in a saved state (PyTorch's).
const FIRST: &str = "exp_avg";
const SECOND: &str = "exp_avg_sq";

struct Slot {
    name: String,
    var: Var,
    m: Tensor,
    v: Tensor,
    decay: bool,
}

/// Elements per task of the in-place updates.
const TASK: usize = 1 << 14;

/// The contiguous f32 elements of a CPU storage, or an error naming `what`.
fn f32s<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> candle_core::Result<&'a [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((a, b))) => Ok(&v[a..b]),
        _ => candle_core::bail!("adamw: {what} must be contiguous f32"),
    }
}

fn f32s_mut<'a>(
    s: &'a mut CpuStorage,
    l: &Layout,
    what: &str,
) -> candle_core::Result<&'a mut [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((a, b))) => Ok(&mut v[a..b]),
        _ => candle_core::bail!("adamw: {what} must be contiguous f32"),
    }
}

/// A moment updated in place: `m ← keep·m + mix·g` (`g²` for the second moment), each product
/// rounded as candle's `affine` rounds it, so the update equals the tensor formula bit for bit.
struct Ema {
    keep: f32,
    mix: f32,
    square: bool,
}

impl Ema {
    fn new(beta: f64, square: bool) -> Self {
        Self {
            keep: beta as f32,
            mix: (1.0 - beta) as f32,
            square,
        }
    }
}

impl InplaceOp2 for Ema {
    fn name(&self) -> &'static str {
        "adamw-moment"
    }

    fn cpu_fwd(
        &self,
        m: &mut CpuStorage,
        m_l: &Layout,
        g: &CpuStorage,
        g_l: &Layout,
    ) -> candle_core::Result<()> {
        let (m, g) = (f32s_mut(m, m_l, "a moment")?, f32s(g, g_l, "a gradient")?);
        let (keep, mix, square) = (self.keep, self.mix, self.square);
        m.par_chunks_mut(TASK)
            .zip(g.par_chunks(TASK))
            .for_each(|(m, g)| {
                for (m, &g) in m.iter_mut().zip(g) {
                    let g = if square { g * g } else { g };
                    *m = (*m * keep + 0.0) + (g * mix + 0.0);
                }
            });
        Ok(())
    }
}

/// The weight updated in place from its new moments:
/// `θ ← keep·θ − lr · (m·scale_m) / (√(v·scale_v) + ε)`, rounded as the tensor formula.
struct Update {
    scale_m: f32,
    scale_v: f32,
    keep: f32,
    eps: f32,
    lr: f32,
}

impl InplaceOp3 for Update {
    fn name(&self) -> &'static str {
        "adamw-update"
    }

    fn cpu_fwd(
        &self,
        theta: &mut CpuStorage,
        t_l: &Layout,
        m: &CpuStorage,
        m_l: &Layout,
        v: &CpuStorage,
        v_l: &Layout,
    ) -> candle_core::Result<()> {
        let theta = f32s_mut(theta, t_l, "a weight")?;
        let (m, v) = (f32s(m, m_l, "a moment")?, f32s(v, v_l, "a moment")?);
        let Update {
            scale_m,
            scale_v,
            keep,
            eps,
            lr,
        } = *self;
        theta
            .par_chunks_mut(TASK)
            .zip(m.par_chunks(TASK).zip(v.par_chunks(TASK)))
            .for_each(|(t, (m, v))| {
                for ((t, &m), &v) in t.iter_mut().zip(m).zip(v) {
                    let adjusted = (m * scale_m + 0.0) / ((v * scale_v + 0.0).sqrt() * 1.0 + eps);
                    *t = (*t * keep + 0.0) - (adjusted * lr + 0.0);
                }
            });
        Ok(())
    }
}

/// AdamW over named weights (see the module doc).
pub struct AdamW {
    params: ParamsAdamW,
    slots: Vec<Slot>,
    step: usize,
    /// The fused kernels, on a CUDA device.
    #[cfg(feature = "cuda")]
    fused: Option<fused::Fused>,
}

/// What an update leaves to read: the gradients' global norm and whether the weights stayed
/// finite, on the host already or in a device tensor `[norm, 1 if a weight is not finite]`.
pub enum Stats {
    Host {
        norm: f64,
        finite: bool,
    },
    #[cfg(feature = "cuda")]
    Device(Tensor),
}

/// A step's numbers, read back.
pub struct Readout {
    /// The loss of each micro-batch.
    pub losses: Vec<f32>,
    pub norm: f64,
    /// Whether every weight is finite after the update (an update is skipped when the norm is
    /// not finite).
    pub finite: bool,
}

impl Stats {
    /// The norm, the finiteness and `losses` (a 1-D tensor on the update's device, one loss per
    /// micro-batch): one copy from the device, which waits for the step's kernels.
    pub fn read(self, losses: &Tensor) -> Result<Readout> {
        let losses = losses.to_dtype(DType::F32)?;
        Ok(match self {
            Stats::Host { norm, finite } => Readout {
                losses: losses.to_vec1::<f32>()?,
                norm,
                finite,
            },
            #[cfg(feature = "cuda")]
            Stats::Device(stats) => {
                let mut all = Tensor::cat(&[&losses, &stats], 0)?.to_vec1::<f32>()?;
                let tail = all.split_off(losses.elem_count());
                let [norm, flag] = *tail.as_slice() else {
                    bail!("the update gave {} numbers instead of 2", tail.len())
                };
                Readout {
                    losses: all,
                    norm: f64::from(norm),
                    finite: flag == 0.0,
                }
            }
        })
    }
}

impl AdamW {
    /// An optimizer of `vars` with zero moments; `decay(name, var)` says which weights decay.
    pub fn new(
        vars: Vec<(String, Var)>,
        params: ParamsAdamW,
        decay: impl Fn(&str, &Var) -> bool,
    ) -> Result<Self> {
        let slots: Vec<Slot> = vars
            .into_iter()
            .map(|(name, var)| {
                // Two tensors: on the CPU the moments are updated in place.
                let (m, v) = (var.as_tensor().zeros_like()?, var.as_tensor().zeros_like()?);
                Ok(Slot {
                    decay: decay(&name, &var),
                    name,
                    var,
                    m,
                    v,
                })
            })
            .collect::<Result<_>>()?;
        #[cfg(feature = "cuda")]
        let fused = match slots.first().map(|s| s.var.device()) {
            Some(candle_core::Device::Cuda(dev)) => Some(fused::Fused::new(dev, &slots)?),
            _ => None,
        };
        Ok(Self {
            params,
            slots,
            step: 0,
            #[cfg(feature = "cuda")]
            fused,
        })
    }

    pub fn set_lr(&mut self, lr: f64) {
        self.params.lr = lr
    }

    /// Clips `grads` (one per weight, in the order of `new`'s `vars`) to a global norm of `clip`
    /// (0: no clipping) and updates the weights with them, unless the norm is not finite. On CUDA
    /// nothing is read back: the returned [`Stats`] hold the norm and the finiteness flag.
    pub fn clip_and_step(&mut self, grads: Vec<Tensor>, clip: f64) -> Result<Stats> {
        if grads.len() != self.slots.len() {
            bail!("{} gradients for {} weights", grads.len(), self.slots.len())
        }
        #[cfg(feature = "cuda")]
        if let Some(fused) = self.fused.as_mut() {
            self.step += 1;
            let stats = fused.step(&self.slots, &grads, &self.params, self.step, clip)?;
            return Ok(Stats::Device(stats));
        }
        let (norm, grads) = clip_global_norm(grads, clip)?;
        if !norm.is_finite() {
            return Ok(Stats::Host { norm, finite: true });
        }
        self.step_tensors(&grads)?;
        Ok(Stats::Host {
            norm,
            finite: self.weights_finite()?,
        })
    }

    /// Whether every weight is finite: x·0 is 0 for a finite x and NaN for NaN or ±inf, so the
    /// sum is 0 exactly when all are.
    fn weights_finite(&self) -> Result<bool> {
        let sums = self
            .slots
            .iter()
            .map(|s| (s.var.as_tensor() * 0.0)?.sum_all())
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Tensor::stack(&sums, 0)?.sum_all()?.to_scalar::<f32>()? == 0.0)
    }

    /// The update of the CPU (in place) and of devices without fused kernels (tensor ops).
    fn step_tensors(&mut self, grads: &[Tensor]) -> Result<()> {
        self.step += 1;
        let p = &self.params;
        let (beta1, beta2, lr) = (p.beta1, p.beta2, p.lr);
        let scale_m = 1f64 / (1f64 - beta1.powi(self.step as i32));
        let scale_v = 1f64 / (1f64 - beta2.powi(self.step as i32));
        for (slot, g) in self.slots.iter_mut().zip(grads) {
            let lr_lambda = if slot.decay { lr * p.weight_decay } else { 0.0 };
            let theta = slot.var.as_tensor();
            if theta.device().is_cpu() && theta.dtype() == DType::F32 {
                let g = g.contiguous()?;
                slot.m.inplace_op2(&g, &Ema::new(beta1, false))?;
                slot.v.inplace_op2(&g, &Ema::new(beta2, true))?;
                let update = Update {
                    scale_m: scale_m as f32,
                    scale_v: scale_v as f32,
                    keep: (1f64 - lr_lambda) as f32,
                    eps: p.eps as f32,
                    lr: lr as f32,
                };
                theta.inplace_op3(&slot.m, &slot.v, &update)?;
                continue;
            }
            let next_m = ((&slot.m * beta1)? + (g * (1.0 - beta1))?)?;
            let next_v = ((&slot.v * beta2)? + (g.sqr()? * (1.0 - beta2))?)?;
            let m_hat = (&next_m * scale_m)?;
            let v_hat = (&next_v * scale_v)?;
            let next_theta = (theta * (1f64 - lr_lambda))?;
            let adjusted = (m_hat / (v_hat.sqrt()? + p.eps)?)?;
            slot.var.set(&(next_theta - (adjusted * lr)?)?)?;
            (slot.m, slot.v) = (next_m, next_v);
        }
        Ok(())
    }

    /// The moments, `exp_avg.NAME` and `exp_avg_sq.NAME`, for a checkpoint.
    pub fn state(&self) -> Vec<(String, Tensor)> {
        self.slots
            .iter()
            .flat_map(|s| {
                [
                    (format!("{FIRST}.{}", s.name), s.m.clone()),
                    (format!("{SECOND}.{}", s.name), s.v.clone()),
                ]
            })
            .collect()
    }

    /// Restores the moments saved by [`AdamW::state`] after `step` updates; every weight's two
    /// moments must be there, f32, of the weight's shape, and nothing else.
    pub fn load_state(&mut self, mut saved: HashMap<String, Tensor>, step: usize) -> Result<()> {
        for slot in &mut self.slots {
            let shape = slot.var.shape().clone();
            let mut take = |kind: &str| -> Result<Tensor> {
                let key = format!("{kind}.{}", slot.name);
                let Some(t) = saved.remove(&key) else {
                    bail!("the optimizer state has no {key}: it belongs to another model")
                };
                if t.shape() != &shape || t.dtype() != DType::F32 {
                    bail!(
                        "the optimizer state's {key} is {:?} {:?}, the weight is {:?} F32: it \
                         belongs to another model",
                        t.dtype(),
                        t.dims(),
                        shape.dims()
                    )
                }
                Ok(t.to_device(slot.var.device())?)
            };
            slot.m = take(FIRST)?;
            slot.v = take(SECOND)?;
        }
        if let Some(extra) = saved.keys().min() {
            bail!(
                "the optimizer state has {} tensor(s) for weights this model lacks (e.g. {extra}): \
                 it belongs to another model",
                saved.len()
            )
        }
        self.step = step;
        Ok(())
    }
}

/// The global L2 norm of `grads` and the gradients scaled to a norm of at most `clip` (0: left
/// as they are), as PyTorch's `clip_grad_norm_` does.
pub fn clip_global_norm(grads: Vec<Tensor>, clip: f64) -> Result<(f64, Vec<Tensor>)> {
    let squares = grads
        .iter()
        .map(|g| g.sqr()?.sum_all())
        .collect::<candle_core::Result<Vec<_>>>()?;
    let norm = Tensor::stack(&squares, 0)?
        .to_vec1::<f32>()?
        .iter()
        .map(|&s| f64::from(s))
        .sum::<f64>()
        .sqrt();
    // The 1e-6 keeps the scale finite at a zero norm, as PyTorch's.
    let scale = clip / (norm + 1e-6);
    if clip == 0.0 || scale >= 1.0 || !norm.is_finite() {
        return Ok((norm, grads));
    }
    let scaled = grads
        .iter()
        .map(|g| g * scale)
        .collect::<candle_core::Result<_>>()?;
    Ok((norm, scaled))
}

/// The fused update on CUDA (see the module doc).
#[cfg(feature = "cuda")]
mod fused {
    use std::sync::OnceLock;

    use anyhow::{anyhow, bail, Result};
    use candle_core::cuda_backend::cudarc::driver::{
        CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg, SyncOnDrop,
    };
    use candle_core::cuda_backend::cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
    use candle_core::cuda_backend::WrapErr;
    use candle_core::op::BackpropOp;
    use candle_core::{CudaDevice, CudaStorage, DType, Layout, Storage, StorageRef, Tensor};
    use candle_nn::ParamsAdamW;

    use super::Slot;

    /// The kernels. A block of `adamw_sumsq` and `adamw_update` handles one chunk of `CHUNK`
    /// elements of one weight, found in the table by its first chunk; `adamw_norm` is one block.
    const SOURCE: &str = r#"
struct Param {
    float* theta;
    float* m;
    float* v;
    const float* g;
    unsigned long long n;
    unsigned long long first;
    float keep;
    float unused;
};

#define CHUNK 8192
#define THREADS 256

__device__ __forceinline__ int owner(const Param* p, int count, unsigned long long chunk) {
    int lo = 0, hi = count - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (p[mid].first <= chunk) lo = mid; else hi = mid - 1;
    }
    return lo;
}

__device__ __forceinline__ bool finite(float x) {
    return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u;
}

// The sum over the block (blockDim.x a multiple of 32), in thread 0, in a fixed order.
__device__ double block_sum(double x) {
    __shared__ double part[32];
    for (int o = 16; o > 0; o >>= 1) x += __shfl_down_sync(0xffffffffu, x, o);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) part[warp] = x;
    __syncthreads();
    x = threadIdx.x < (blockDim.x >> 5) ? part[threadIdx.x] : 0.0;
    if (warp == 0) {
        for (int o = 16; o > 0; o >>= 1) x += __shfl_down_sync(0xffffffffu, x, o);
    }
    return x;
}

extern "C" __global__ void __launch_bounds__(THREADS)
adamw_sumsq(const Param* params, int count, double* work) {
    __shared__ int which;
    if (threadIdx.x == 0) which = owner(params, count, blockIdx.x);
    __syncthreads();
    const Param p = params[which];
    unsigned long long start = (blockIdx.x - p.first) * CHUNK;
    unsigned long long end = start + CHUNK < p.n ? start + CHUNK : p.n;
    float acc = 0.0f;
    for (unsigned long long i = start + threadIdx.x; i < end; i += THREADS) {
        float g = p.g[i];
        acc += g * g;
    }
    double sum = block_sum((double)acc);
    if (threadIdx.x == 0) work[blockIdx.x] = sum;
}

// work[0..chunks) holds the chunks' sums of squares; work[chunks] receives the gradients' scale,
// or -1 when the norm is not finite (no update). stats = [norm, non-finite weight flag].
extern "C" __global__ void adamw_norm(double* work, int chunks, double clip, float* stats) {
    double acc = 0.0;
    for (int i = threadIdx.x; i < chunks; i += blockDim.x) acc += work[i];
    double squares = block_sum(acc);
    if (threadIdx.x == 0) {
        double norm = sqrt(squares);
        double scale = clip / (norm + 1e-6);
        stats[0] = (float)norm;
        stats[1] = 0.0f;
        work[chunks] = !finite((float)norm) ? -1.0 : (clip == 0.0 || scale >= 1.0) ? 1.0 : scale;
    }
}

// Each product is rounded on its own (the program is compiled without contraction) and the
// `+ 0.0f` terms are the CPU path's, so that zeros keep the same sign.
extern "C" __global__ void __launch_bounds__(THREADS)
adamw_update(const Param* params, int count, const double* work, int chunks, float* stats,
             float keep1, float mix1, float keep2, float mix2, float scale_m, float scale_v,
             float eps, float lr) {
    double scale = work[chunks];
    if (scale < 0.0) return;
    float gs = (float)scale;
    __shared__ int which;
    if (threadIdx.x == 0) which = owner(params, count, blockIdx.x);
    __syncthreads();
    const Param p = params[which];
    unsigned long long start = (blockIdx.x - p.first) * CHUNK;
    unsigned long long end = start + CHUNK < p.n ? start + CHUNK : p.n;
    int bad = 0;
    for (unsigned long long i = start + threadIdx.x; i < end; i += THREADS) {
        float g = p.g[i] * gs;
        float m = (p.m[i] * keep1 + 0.0f) + (g * mix1 + 0.0f);
        float v = (p.v[i] * keep2 + 0.0f) + ((g * g) * mix2 + 0.0f);
        float adjusted = (m * scale_m + 0.0f) / (sqrtf(v * scale_v + 0.0f) * 1.0f + eps);
        float theta = (p.theta[i] * p.keep + 0.0f) - (adjusted * lr + 0.0f);
        p.m[i] = m;
        p.v[i] = v;
        p.theta[i] = theta;
        bad |= !finite(theta);
    }
    if (__syncthreads_or(bad) && threadIdx.x == 0) stats[1] = 1.0f;
}
"#;

    /// Elements per block and threads per block, as in `SOURCE`.
    const CHUNK: usize = 8192;
    const THREADS: u32 = 256;
    /// Threads of the one block of `adamw_norm`.
    const NORM_THREADS: u32 = 1024;
    /// 64-bit words per weight in the table (`struct Param`).
    const WORDS: usize = 7;
    /// The module name under which candle keeps the kernels per device.
    const MODULE: &str = "mamba2_train_adamw";

    /// The kernels' PTX, compiled once per process.
    fn ptx() -> Result<&'static str> {
        static PTX: OnceLock<std::result::Result<String, String>> = OnceLock::new();
        let compiled = PTX.get_or_init(|| {
            let opts = CompileOptions {
                fmad: Some(false),
                ..Default::default()
            };
            compile_ptx_with_opts(SOURCE, opts)
                .map(|ptx| ptx.to_src())
                .map_err(|e| e.to_string())
        });
        compiled
            .as_deref()
            .map_err(|e| anyhow!("compiling the AdamW kernels with NVRTC: {e}"))
    }

    /// The kernels loaded on one device and the buffers they share between steps.
    pub struct Fused {
        dev: CudaDevice,
        sumsq: CudaFunction,
        norm: CudaFunction,
        update: CudaFunction,
        /// Each weight's first chunk; the weights, and the chunks of all.
        firsts: Vec<u64>,
        count: i32,
        chunks: u32,
        /// The table, rewritten at every step.
        table: CudaSlice<u64>,
        /// The chunks' sums of squares and the scale.
        work: CudaSlice<f64>,
    }

    /// The address of the first element of a contiguous f32 tensor on the CUDA device, with the
    /// guard that orders its use on `stream`.
    fn address<'a>(
        guard: &'a StorageRef<'_>,
        layout: &Layout,
        stream: &'a CudaStream,
        what: &str,
        name: &str,
    ) -> Result<(u64, SyncOnDrop<'a>)> {
        let Storage::Cuda(storage) = &**guard else {
            bail!("adamw: the {what} of {name} is not on the CUDA device")
        };
        let (Some((start, _)), Ok(slice)) =
            (layout.contiguous_offsets(), storage.as_cuda_slice::<f32>())
        else {
            bail!("adamw: the {what} of {name} must be contiguous f32")
        };
        let (base, sync) = slice.device_ptr(stream);
        Ok((base + (start * std::mem::size_of::<f32>()) as u64, sync))
    }

    /// The number of kernel blocks for `n` elements.
    fn blocks(n: usize) -> Result<u32> {
        u32::try_from(n).map_err(|_| anyhow!("adamw: {n} chunks are more than one launch takes"))
    }

    impl Fused {
        /// Compiles (once) and loads the kernels on `dev` for the weights of `slots`.
        pub fn new(dev: &CudaDevice, slots: &[Slot]) -> Result<Self> {
            let ptx = ptx()?;
            let load = |name: &str| -> Result<CudaFunction> {
                Ok(dev
                    .get_or_load_custom_func(name, MODULE, ptx)?
                    .into_cuda_function())
            };
            let mut firsts = Vec::with_capacity(slots.len());
            let mut chunks = 0usize;
            for slot in slots {
                firsts.push(chunks as u64);
                chunks += slot.var.elem_count().div_ceil(CHUNK);
            }
            if chunks == 0 {
                bail!("adamw: no weights to update")
            }
            Ok(Self {
                sumsq: load("adamw_sumsq")?,
                norm: load("adamw_norm")?,
                update: load("adamw_update")?,
                table: dev.alloc_zeros::<u64>(WORDS * slots.len())?,
                work: dev.alloc_zeros::<f64>(chunks + 1)?,
                firsts,
                count: i32::try_from(slots.len())?,
                chunks: blocks(chunks)?,
                dev: dev.clone(),
            })
        }

        /// Queues update number `step` (from 1) of the weights of `slots` with `grads`, clipped
        /// to `clip` (0: not clipped); returns the device tensor `[norm, flag]`.
        pub fn step(
            &mut self,
            slots: &[Slot],
            grads: &[Tensor],
            p: &ParamsAdamW,
            step: usize,
            clip: f64,
        ) -> Result<Tensor> {
            let grads = grads
                .iter()
                .map(|g| g.to_dtype(DType::F32)?.contiguous())
                .collect::<candle_core::Result<Vec<_>>>()?;
            for (slot, g) in slots.iter().zip(&grads) {
                if g.shape() != slot.var.shape() {
                    bail!(
                        "adamw: the gradient of {} is {:?}, the weight {:?}",
                        slot.name,
                        g.dims(),
                        slot.var.dims()
                    )
                }
            }
            let stream = self.dev.cuda_stream();
            // The kernels write the weights and moments through addresses taken under read
            // locks, as candle lends no write lock on several tensors at once: nothing else
            // uses them during the step, and every kernel runs on this one stream, so the
            // update is ordered after the step's reads of them and before the next step's.
            let held: Vec<[(StorageRef, &Layout); 4]> = slots
                .iter()
                .zip(&grads)
                .map(|(s, g)| {
                    [
                        s.var.as_tensor().storage_and_layout(),
                        s.m.storage_and_layout(),
                        s.v.storage_and_layout(),
                        g.storage_and_layout(),
                    ]
                })
                .collect();
            let mut syncs = Vec::with_capacity(4 * held.len());
            let mut table = Vec::with_capacity(WORDS * held.len());
            for ((slot, tensors), &first) in slots.iter().zip(&held).zip(&self.firsts) {
                for ((guard, layout), what) in tensors
                    .iter()
                    .zip(["weight", "moment", "moment", "gradient"])
                {
                    let (address, sync) = address(guard, layout, &stream, what, &slot.name)?;
                    table.push(address);
                    syncs.push(sync);
                }
                let decay = if slot.decay {
                    p.lr * p.weight_decay
                } else {
                    0.0
                };
                let keep = (1f64 - decay) as f32;
                table.extend([
                    slot.var.elem_count() as u64,
                    first,
                    u64::from(keep.to_bits()),
                ]);
            }
            self.dev.memcpy_htod(table.as_slice(), &mut self.table)?;

            let (count, all) = (self.count, self.chunks);
            let chunks = i32::try_from(all)?;
            let grid = |blocks: u32, threads: u32| LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut stats = self.dev.alloc_zeros::<f32>(2)?;
            let scale_m = (1f64 / (1f64 - p.beta1.powi(step as i32))) as f32;
            let scale_v = (1f64 / (1f64 - p.beta2.powi(step as i32))) as f32;
            let (keep1, mix1) = (p.beta1 as f32, (1.0 - p.beta1) as f32);
            let (keep2, mix2) = (p.beta2 as f32, (1.0 - p.beta2) as f32);
            let (eps, lr) = (p.eps as f32, p.lr as f32);
            // SAFETY: the arguments match the kernels' parameters in order and type; the table
            // holds the addresses of live, contiguous f32 tensors of the sizes it gives (their
            // locks and stream guards are held until the launches are queued), and `work` has
            // a slot for every chunk and the scale.
            unsafe {
                {
                    let mut b = stream.launch_builder(&self.sumsq);
                    b.arg(&self.table).arg(&count).arg(&mut self.work);
                    b.launch(grid(all, THREADS)).w()?;
                }
                {
                    let mut b = stream.launch_builder(&self.norm);
                    b.arg(&mut self.work)
                        .arg(&chunks)
                        .arg(&clip)
                        .arg(&mut stats);
                    b.launch(grid(1, NORM_THREADS)).w()?;
                }
                let mut b = stream.launch_builder(&self.update);
                b.arg(&self.table).arg(&count).arg(&self.work).arg(&chunks);
                b.arg(&mut stats)
                    .arg(&keep1)
                    .arg(&mix1)
                    .arg(&keep2)
                    .arg(&mix2);
                b.arg(&scale_m).arg(&scale_v).arg(&eps).arg(&lr);
                b.launch(grid(all, THREADS)).w()?;
            }
            drop(syncs);
            drop(held);
            let storage = CudaStorage::wrap_cuda_slice(stats, self.dev.clone());
            Ok(Tensor::from_storage(
                Storage::Cuda(storage),
                2,
                BackpropOp::none(),
                false,
            ))
        }
    }
}
