//! One decode token of the SSD (mamba_ssm's `selective_state_update`), state updated in place:
//!
//! ```text
//! dt = clamp(softplus(dt + dt_bias), lo, hi)
//! h  ← exp(a·dt)·h + dt · x Bᵀ                  h [B,H,P,N], x [B,H,P], b, c [B,G,N]
//! y  = h C + D·x      (· silu(z))               y [B,H,P] in x's dtype
//! ```

mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
mod plan;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, InplaceOp3, Layout, Result, Storage, Tensor};
use half::bf16;

use crate::check::{self, SsdDims};
use crate::cpu::{small, to_storage, view, wide, CpuArg, Held, Real};
use crate::dt::DtRule;
use crate::slot::Slot;
use crate::DtOptions;

/// Options of [`ssd_step`]: dt processing, skip term `D` (`[H]` or `[H,P]` f32), gate `z [B,H,P]`.
#[derive(Clone, Copy, Debug, Default)]
pub struct StepOptions<'a> {
    pub dt: DtOptions<'a>,
    pub d: Option<&'a Tensor>,
    pub z: Option<&'a Tensor>,
}

/// The in-place step on the state, with sources `(x, dt)`; the output `y` is left in `y`.
#[derive(Debug)]
struct SsdStep {
    a: Tensor,
    b: Tensor,
    c: Tensor,
    d: Option<Tensor>,
    z: Option<Tensor>,
    dt_bias: Option<Tensor>,
    rule: DtRule,
    dims: SsdDims,
    y: Slot,
}

impl InplaceOp3 for SsdStep {
    fn name(&self) -> &'static str {
        "ssd_step"
    }

    fn cpu_fwd(
        &self,
        st_s: &mut CpuStorage,
        st_l: &Layout,
        x_s: &CpuStorage,
        x_l: &Layout,
        dt_s: &CpuStorage,
        dt_l: &Layout,
    ) -> Result<()> {
        let (state, x, dt) = ((st_s, st_l), (x_s, x_l), (dt_s, dt_l));
        if wide(x_s.dtype()) {
            self.cpu::<f64>(state, x, dt)
        } else {
            self.cpu::<f32>(state, x, dt)
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        st_s: &mut candle_core::CudaStorage,
        st_l: &Layout,
        x_s: &candle_core::CudaStorage,
        x_l: &Layout,
        dt_s: &candle_core::CudaStorage,
        dt_l: &Layout,
    ) -> Result<()> {
        let step = cuda::Step {
            a: &self.a,
            b: &self.b,
            c: &self.c,
            d: self.d.as_ref(),
            z: self.z.as_ref(),
            dt_bias: self.dt_bias.as_ref(),
            rule: self.rule,
            dims: self.dims,
        };
        let y = cuda::ssd_step(&step, (st_s, st_l), (x_s, x_l), (dt_s, dt_l))?;
        self.y.put(self.name(), Storage::Cuda(y))
    }
}

impl SsdStep {
    fn cpu<T: Real>(
        &self,
        (st_s, st_l): (&mut CpuStorage, &Layout),
        (x_s, x_l): CpuArg,
        (dt_s, dt_l): CpuArg,
    ) -> Result<()> {
        let op = "ssd_step";
        let x = view::<T>(op, "x", x_s, x_l)?;
        let dt = view::<T>(op, "dt", dt_s, dt_l)?;
        let held = (
            Held::new(&self.b),
            Held::new(&self.c),
            self.z.as_ref().map(Held::new),
        );
        let b = held.0.view::<T>(op, "b")?;
        let c = held.1.view::<T>(op, "c")?;
        let z = held.2.as_ref().map(|h| h.view::<T>(op, "z")).transpose()?;
        let a = small::<T>(&self.a)?;
        let bias = match &self.dt_bias {
            Some(t) => small::<T>(t)?,
            None => vec![T::zero(); self.dims.nheads],
        };
        let d = self.d.as_ref().map(small::<T>).transpose()?;
        let Some((start, end)) = st_l.contiguous_offsets() else {
            bail!("{op}: state must be contiguous to be updated in place")
        };
        let step = cpu::Step {
            x: &x,
            dt: &dt,
            a: &a,
            bias: &bias,
            b: &b,
            c: &c,
            z: z.as_deref(),
            d: d.as_deref(),
            rule: self.rule,
            dims: self.dims,
        };
        let y = match st_s {
            CpuStorage::F32(v) => step.run(&mut v[start..end], T::of, T::as_f32),
            CpuStorage::F64(v) => step.run(
                &mut v[start..end],
                |s| T::from_f64(s).unwrap_or_else(T::nan),
                T::as_f64,
            ),
            CpuStorage::BF16(v) => step.run(
                &mut v[start..end],
                |s| T::of(s.to_f32()),
                |t| bf16::from_f64(t.as_f64()),
            ),
            other => bail!(
                "{op}: state must be f32, f64 or bf16, got {:?}",
                other.dtype()
            ),
        };
        self.y.put(op, Storage::Cpu(to_storage(y, x_s.dtype())?))
    }
}

/// Advances `state [B,H,P,N]` (f32 or bf16) by one token in place and returns `y [B,H,P]`.
///
/// `x [B,H,P]`, `dt [B,H]`, `a [H]` f32, `b, c [B,G,N]`; `state` must be contiguous.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use mamba2_kernels::{ssd, ssd_step, SsdOptions, StepOptions};
///
/// let dev = Device::Cpu;
/// let (b, l, h, p, g, n) = (1, 5, 2, 4, 1, 8);
/// let x = Tensor::randn(0f32, 1.0, (b, l, h, p), &dev)?;
/// let dt = Tensor::rand(0f32, 0.5, (b, l, h), &dev)?;
/// let a = Tensor::new(&[-1f32, -2.0], &dev)?;
/// let bm = Tensor::randn(0f32, 1.0, (b, l, g, n), &dev)?;
/// let cm = Tensor::randn(0f32, 1.0, (b, l, g, n), &dev)?;
/// // Decoding the tokens one by one ends in the state a prefill of all of them ends in.
/// let state = Tensor::zeros((b, h, p, n), DType::F32, &dev)?;
/// for t in 0..l {
///     let at = |v: &Tensor| v.narrow(1, t, 1)?.squeeze(1);
///     let opts = StepOptions::default();
///     ssd_step(&state, &at(&x)?, &at(&dt)?, &a, &at(&bm)?, &at(&cm)?, &opts)?;
/// }
/// let opts = SsdOptions { chunk_size: 16, ..Default::default() };
/// let (_, last) = ssd(&x, &dt, &a, &bm, &cm, &opts)?;
/// let diff = (state - last)?.abs()?.max_all()?.to_scalar::<f32>()?;
/// assert!(diff < 1e-5, "{diff}");
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn ssd_step(
    state: &Tensor,
    x: &Tensor,
    dt: &Tensor,
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    opts: &StepOptions,
) -> Result<Tensor> {
    let op = "ssd_step";
    let [batch, nheads, headdim] = check::rank::<3>(op, "x", x, "[B, H, P]")?;
    check::rank::<4>(op, "state", state, "[B, H, P, N]")?;
    let [_, ngroups, dstate] = check::rank::<3>(op, "b", b, "[B, G, N]")?;
    let dims = SsdDims {
        batch,
        seqlen: 1,
        nheads,
        headdim,
        ngroups,
        dstate,
        chunks: None,
    };
    check::float(op, "x", x)?;
    dims.check_groups(op)?;
    dims.state(op, "state", state, x)?;
    if !state.is_contiguous() {
        bail!("{op}: state must be contiguous to be updated in place")
    }
    check::device(op, "dt", dt, x)?;
    check::float(op, "dt", dt)?;
    check::shape(op, "dt", dt, &[batch, nheads], "[B, H]")?;
    check::head_param(op, "a", a, x, nheads)?;
    for (name, t) in [("b", b), ("c", c)] {
        check::device(op, name, t, x)?;
        check::shape(op, name, t, &[batch, ngroups, dstate], "[B, G, N]")?;
        check::same_dtype(op, name, t, x)?;
    }
    opts.dt.check(op, x, nheads)?;
    if let Some(d) = opts.d {
        check::skip_param(op, d, x, nheads, headdim)?;
    }
    if let Some(z) = opts.z {
        check::device(op, "z", z, x)?;
        check::shape(op, "z", z, &[batch, nheads, headdim], "[B, H, P]")?;
        check::same_dtype(op, "z", z, x)?;
    }
    let step = SsdStep {
        a: a.contiguous()?,
        b: check::rows_view(b)?,
        c: check::rows_view(c)?,
        d: opts.d.map(|d| d.contiguous()).transpose()?,
        z: opts.z.map(check::rows_view).transpose()?,
        dt_bias: opts.dt.bias.map(|t| t.contiguous()).transpose()?,
        rule: opts.dt.rule(),
        dims,
        y: Slot::default(),
    };
    state.inplace_op3(&check::rows_view(x)?, &check::rows_view(dt)?, &step)?;
    step.y.take(op, "output", (batch, nheads, headdim))
}
