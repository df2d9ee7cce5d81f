//! The three stages of [`super::ssd`] as ops of their own, for callers that keep or inspect the
//! intermediates: [`chunk_cumsum`] → [`fwd_pass_state`] → [`compute_out`] gives what `ssd` gives.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};

use super::cpu;
#[cfg(feature = "cuda")]
use super::cuda;
use crate::check::{self, SsdDims};
use crate::cpu::{small, to_storage, view, wide, CpuArg, Held, Real};
use crate::dt::DtRule;
use crate::DtOptions;

/// The `chunk_cumsum` op on `(dt, a)`; output `[2,B,H,L]` f32 = (dt_out, da_cumsum).
#[derive(Debug)]
struct ChunkCumsum {
    dt_bias: Option<Tensor>,
    rule: DtRule,
    chunk_size: usize,
}

impl CustomOp2 for ChunkCumsum {
    fn name(&self) -> &'static str {
        "chunk_cumsum"
    }

    fn cpu_fwd(
        &self,
        dt_s: &CpuStorage,
        dt_l: &Layout,
        a_s: &CpuStorage,
        a_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        if wide(dt_s.dtype()) {
            self.cpu::<f64>((dt_s, dt_l), (a_s, a_l))
        } else {
            self.cpu::<f32>((dt_s, dt_l), (a_s, a_l))
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dt_s: &candle_core::CudaStorage,
        dt_l: &Layout,
        a_s: &candle_core::CudaStorage,
        a_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (bias, rule, chunk) = (self.dt_bias.as_ref(), self.rule, self.chunk_size);
        cuda::chunk_cumsum((dt_s, dt_l), (a_s, a_l), bias, rule, chunk)
    }
}

impl ChunkCumsum {
    fn cpu<T: Real>(
        &self,
        (dt_s, dt_l): CpuArg,
        (a_s, a_l): CpuArg,
    ) -> Result<(CpuStorage, Shape)> {
        let op = "chunk_cumsum";
        let (batch, seqlen, nheads) = dt_l.shape().dims3()?;
        let dt = view::<T>(op, "dt", dt_s, dt_l)?;
        let a = view::<T>(op, "a", a_s, a_l)?;
        let bias = match &self.dt_bias {
            Some(t) => small::<T>(t)?,
            None => vec![T::zero(); nheads],
        };
        let dims = (batch, seqlen, nheads);
        let out = cpu::chunk_cumsum(&dt, dims, &a, &bias, self.rule, self.chunk_size);
        let dtype = if wide(dt_s.dtype()) {
            DType::F64
        } else {
            DType::F32
        };
        Ok((
            to_storage(out, dtype)?,
            Shape::from((2, batch, nheads, seqlen)),
        ))
    }
}

/// Processes `dt [B,L,H]` and returns `(dt_out, da_cumsum)`, both `[B,H,L]` f32.
///
/// `a [H]` is f32 (`a = −exp(A_log)`); the sums restart at every multiple of `chunk_size` (a power
/// of two ≥ 16) and are scaled by log2(e).
///
/// ```
/// use candle_core::{Device, Tensor};
/// use mamba2_kernels::{chunk_cumsum, DtOptions};
///
/// let dt = Tensor::new(&[[[1f32], [2.0], [3.0]]], &Device::Cpu)?; // [B=1, L=3, H=1]
/// let a = Tensor::new(&[-1f32], &Device::Cpu)?;
/// let (dt_out, da) = chunk_cumsum(&dt, &a, &DtOptions::default(), 16)?;
/// assert_eq!(dt_out.to_vec3::<f32>()?, [[[1.0, 2.0, 3.0]]]);
/// let e = std::f32::consts::LOG2_E;
/// assert_eq!(da.to_vec3::<f32>()?, [[[-e, -3.0 * e, -6.0 * e]]]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn chunk_cumsum(
    dt: &Tensor,
    a: &Tensor,
    opts: &DtOptions,
    chunk_size: usize,
) -> Result<(Tensor, Tensor)> {
    let op = "chunk_cumsum";
    let [batch, seqlen, nheads] = check::rank::<3>(op, "dt", dt, "[B, L, H]")?;
    if batch == 0 || seqlen == 0 || nheads == 0 {
        bail!("{op}: dt has an empty dimension, shape {:?}", dt.dims())
    }
    check::float(op, "dt", dt)?;
    check::head_param(op, "a", a, dt, nheads)?;
    opts.check(op, dt, nheads)?;
    check::chunk_size(op, chunk_size)?;
    let stage = ChunkCumsum {
        dt_bias: opts.bias.map(|b| b.contiguous()).transpose()?,
        rule: opts.rule(),
        chunk_size,
    };
    let both = check::rows_view(dt)?.apply_op2_no_bwd(&a.contiguous()?, &stage)?;
    Ok((both.get(0)?, both.get(1)?))
}

/// The `fwd_pass_state` op on `(x, b, dt_out)`; `da_cumsum` and the initial state are held.
#[derive(Debug)]
struct FwdPassState {
    da_cumsum: Tensor,
    init: Option<Tensor>,
    dims: SsdDims,
    chunk_size: usize,
    state_dtype: DType,
}

impl CustomOp3 for FwdPassState {
    fn name(&self) -> &'static str {
        "fwd_pass_state"
    }

    fn cpu_fwd(
        &self,
        x_s: &CpuStorage,
        x_l: &Layout,
        b_s: &CpuStorage,
        b_l: &Layout,
        dt_s: &CpuStorage,
        dt_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let args = [(x_s, x_l), (b_s, b_l), (dt_s, dt_l)];
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
        dt_s: &candle_core::CudaStorage,
        dt_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let pass = cuda::StatePass {
            x: (x_s, x_l),
            b: (b_s, b_l),
            dt_out: (dt_s, dt_l),
            da_cumsum: &self.da_cumsum,
            init: self.init.as_ref(),
            dims: self.dims,
            chunk_size: self.chunk_size,
            state_dtype: self.state_dtype,
        };
        cuda::fwd_pass_state(&pass)
    }
}

impl FwdPassState {
    fn cpu<T: Real>(
        &self,
        [(x_s, x_l), (b_s, b_l), (dt_s, dt_l)]: [CpuArg; 3],
    ) -> Result<(CpuStorage, Shape)> {
        let (op, d) = ("fwd_pass_state", &self.dims);
        let x = view::<T>(op, "x", x_s, x_l)?;
        let b = view::<T>(op, "b", b_s, b_l)?;
        let dt = view::<T>(op, "dt_out", dt_s, dt_l)?;
        let held = (
            Held::new(&self.da_cumsum),
            self.init.as_ref().map(Held::new),
        );
        let da = held.0.view::<T>(op, "da_cumsum")?;
        let init = held
            .1
            .as_ref()
            .map(|h| h.view::<T>(op, "init_state"))
            .transpose()?;
        let states = cpu::chunk_states((&x, &b), (&dt, &da), init.as_deref(), d, self.chunk_size);
        let nc = d.nchunks(self.chunk_size);
        let shape = Shape::from((d.batch, d.nheads, nc + 1, d.headdim, d.dstate));
        Ok((to_storage(states, self.state_dtype)?, shape))
    }
}

/// The chunk-entry states `[B,H,C+1,P,N]` in `state_dtype` (f32 or bf16).
///
/// `dt_out` and `da_cumsum` come from [`chunk_cumsum`] with the same `chunk_size`; `init_state
/// [B,H,P,N]` (f32 or bf16) is the state before the first token (zeros if `None`).
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use mamba2_kernels::{chunk_cumsum, fwd_pass_state, DtOptions};
///
/// let dev = Device::Cpu;
/// let (b, l, h, p, g, n) = (2, 40, 2, 4, 1, 8);
/// let x = Tensor::randn(0f32, 1.0, (b, l, h, p), &dev)?;
/// let bm = Tensor::randn(0f32, 1.0, (b, l, g, n), &dev)?;
/// let dt = Tensor::rand(0f32, 0.5, (b, l, h), &dev)?;
/// let a = Tensor::new(&[-1f32, -2.0], &dev)?;
/// let (dt_out, da) = chunk_cumsum(&dt, &a, &DtOptions::default(), 16)?;
/// let states = fwd_pass_state(&x, &bm, &dt_out, &da, None, 16, DType::F32)?;
/// assert_eq!(states.dims(), &[b, h, 4, p, n]); // ⌈40 / 16⌉ = 3 chunks, and the final state
/// // No initial state: the first chunk starts from zeros.
/// assert_eq!(states.narrow(2, 0, 1)?.abs()?.sum_all()?.to_scalar::<f32>()?, 0.0);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn fwd_pass_state(
    x: &Tensor,
    b: &Tensor,
    dt_out: &Tensor,
    da_cumsum: &Tensor,
    init_state: Option<&Tensor>,
    chunk_size: usize,
    state_dtype: DType,
) -> Result<Tensor> {
    let op = "fwd_pass_state";
    let dims = SsdDims::values(op, x, b)?;
    dims.per_token(op, "dt_out", dt_out, x)?;
    dims.per_token(op, "da_cumsum", da_cumsum, x)?;
    if let Some(s) = init_state {
        dims.state(op, "init_state", s, x)?;
    }
    dims.check_chunking(op, chunk_size)?;
    check::state_dtype(op, "state_dtype", state_dtype, x.device())?;
    let stage = FwdPassState {
        da_cumsum: da_cumsum.contiguous()?,
        init: init_state
            .map(|s| s.to_dtype(state_dtype)?.contiguous())
            .transpose()?,
        dims,
        chunk_size,
        state_dtype,
    };
    x.contiguous()?
        .apply_op3_no_bwd(&b.contiguous()?, &dt_out.contiguous()?, &stage)
}

/// The `compute_out` op on `(x, c, states)`; the other inputs are held.
#[derive(Debug)]
struct ComputeOut {
    b: Tensor,
    dt_out: Tensor,
    da_cumsum: Tensor,
    d: Option<Tensor>,
    z: Option<Tensor>,
    dims: SsdDims,
    chunk_size: usize,
}

impl CustomOp3 for ComputeOut {
    fn name(&self) -> &'static str {
        "compute_out"
    }

    fn cpu_fwd(
        &self,
        x_s: &CpuStorage,
        x_l: &Layout,
        c_s: &CpuStorage,
        c_l: &Layout,
        st_s: &CpuStorage,
        st_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let args = [(x_s, x_l), (c_s, c_l), (st_s, st_l)];
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
        c_s: &candle_core::CudaStorage,
        c_l: &Layout,
        st_s: &candle_core::CudaStorage,
        st_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let pass = cuda::OutPass {
            x: (x_s, x_l),
            c: (c_s, c_l),
            states: (st_s, st_l),
            b: &self.b,
            dt_out: &self.dt_out,
            da_cumsum: &self.da_cumsum,
            d: self.d.as_ref(),
            z: self.z.as_ref(),
            dims: self.dims,
            chunk_size: self.chunk_size,
        };
        cuda::compute_out(&pass)
    }
}

impl ComputeOut {
    fn cpu<T: Real>(
        &self,
        [(x_s, x_l), (c_s, c_l), (st_s, st_l)]: [CpuArg; 3],
    ) -> Result<(CpuStorage, Shape)> {
        let (op, d) = ("compute_out", &self.dims);
        let x = view::<T>(op, "x", x_s, x_l)?;
        let c = view::<T>(op, "c", c_s, c_l)?;
        let states = view::<T>(op, "states", st_s, st_l)?;
        let held = (
            Held::new(&self.b),
            Held::new(&self.dt_out),
            Held::new(&self.da_cumsum),
            self.z.as_ref().map(Held::new),
        );
        let b = held.0.view::<T>(op, "b")?;
        let dt = held.1.view::<T>(op, "dt_out")?;
        let da = held.2.view::<T>(op, "da_cumsum")?;
        let z = held.3.as_ref().map(|h| h.view::<T>(op, "z")).transpose()?;
        let skip = self.d.as_ref().map(small::<T>).transpose()?;
        let inputs = cpu::OutInputs {
            x: &x,
            b: &b,
            c: &c,
            dt: &dt,
            da: &da,
            d: skip.as_deref(),
            z: z.as_deref(),
        };
        let y = cpu::compute_out(&inputs, &states, d, self.chunk_size);
        let shape = Shape::from((d.batch, d.seqlen, d.nheads, d.headdim));
        Ok((to_storage(y, x_s.dtype())?, shape))
    }
}

/// The SSD outputs `y [B,L,H,P]` (x's dtype) from the chunk states of [`fwd_pass_state`].
///
/// `d` is the skip term, `[H]` or `[H,P]` f32; with `z [B,L,H,P]` the output is `y·silu(z)`.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use mamba2_kernels::{chunk_cumsum, compute_out, fwd_pass_state, ssd, DtOptions, SsdOptions};
///
/// let dev = Device::Cpu;
/// let (b, l, h, p, g, n) = (1, 24, 2, 4, 1, 8);
/// let x = Tensor::randn(0f32, 1.0, (b, l, h, p), &dev)?;
/// let bm = Tensor::randn(0f32, 1.0, (b, l, g, n), &dev)?;
/// let cm = Tensor::randn(0f32, 1.0, (b, l, g, n), &dev)?;
/// let dt = Tensor::rand(0f32, 0.5, (b, l, h), &dev)?;
/// let a = Tensor::new(&[-1f32, -2.0], &dev)?;
/// let (dt_out, da) = chunk_cumsum(&dt, &a, &DtOptions::default(), 16)?;
/// let states = fwd_pass_state(&x, &bm, &dt_out, &da, None, 16, DType::F32)?;
/// let y = compute_out(&x, &bm, &cm, &dt_out, &da, &states, None, None, 16)?;
///
/// // The three stages give what `ssd` gives.
/// let opts = SsdOptions { chunk_size: 16, ..Default::default() };
/// let (y_ssd, _) = ssd(&x, &dt, &a, &bm, &cm, &opts)?;
/// let diff = (y - y_ssd)?.abs()?.max_all()?.to_scalar::<f32>()?;
/// assert!(diff < 1e-6, "{diff}");
/// # Ok::<(), candle_core::Error>(())
/// ```
#[allow(clippy::too_many_arguments)]
pub fn compute_out(
    x: &Tensor,
    b: &Tensor,
    c: &Tensor,
    dt_out: &Tensor,
    da_cumsum: &Tensor,
    states: &Tensor,
    d: Option<&Tensor>,
    z: Option<&Tensor>,
    chunk_size: usize,
) -> Result<Tensor> {
    let op = "compute_out";
    let dims = SsdDims::values(op, x, b)?;
    dims.like_b(op, "c", c, x)?;
    dims.per_token(op, "dt_out", dt_out, x)?;
    dims.per_token(op, "da_cumsum", da_cumsum, x)?;
    dims.check_chunking(op, chunk_size)?;
    check::device(op, "states", states, x)?;
    let (h, p, n) = (dims.nheads, dims.headdim, dims.dstate);
    let want = [dims.batch, h, dims.nchunks(chunk_size) + 1, p, n];
    check::shape(op, "states", states, &want, "[B, H, C+1, P, N]")?;
    check::state_dtype(op, "states", states.dtype(), states.device())?;
    if let Some(d) = d {
        check::skip_param(op, d, x, h, p)?;
    }
    if let Some(z) = z {
        dims.like_x(op, "z", z, x)?;
    }
    let stage = ComputeOut {
        b: b.contiguous()?,
        dt_out: dt_out.contiguous()?,
        da_cumsum: da_cumsum.contiguous()?,
        d: d.map(|d| d.contiguous()).transpose()?,
        z: z.map(|z| z.contiguous()).transpose()?,
        dims,
        chunk_size,
    };
    x.contiguous()?
        .apply_op3_no_bwd(&c.contiguous()?, &states.contiguous()?, &stage)
}
