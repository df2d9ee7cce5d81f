//! One decode token of the SSD (mamba_ssm's `selective_state_update`), state updated in place:
//!
//! ```text
//! dt = clamp(softplus(dt + dt_bias), lo, hi)
//! h  ← exp(a·dt)·h + dt · x Bᵀ                  h [B,H,P,N], x [B,H,P], b, c [B,G,N]
//! y  = h C + D·x      (· silu(z))               y [B,H,P] in x's dtype
//! ```

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::op::BackpropOp;
use candle_core::{bail, CpuStorage, InplaceOp3, Layout, Result, Storage, Tensor};
use half::bf16;
use rayon::prelude::*;

use crate::check::{self, SsdDims};
use crate::{cpu, dt, DtOptions};

/// Options of [`ssd_step`]: dt processing, skip term `D` (`[H]` or `[H,P]` f32), gate `z [B,H,P]`.
#[derive(Clone, Copy, Debug, Default)]
pub struct StepOptions<'a> {
    pub dt: DtOptions<'a>,
    pub d: Option<&'a Tensor>,
    pub z: Option<&'a Tensor>,
}

/// The in-place step on the state, with sources `(x, dt)`; the output `y` is left in `y`.
#[derive(Debug)]
pub(crate) struct SsdStep {
    pub a: Tensor,
    pub b: Tensor,
    pub c: Tensor,
    pub d: Option<Tensor>,
    pub z: Option<Tensor>,
    pub dt_bias: Option<Tensor>,
    pub dt_softplus: bool,
    pub dt_limit: (f32, f32),
    pub dims: SsdDims,
    pub y: Mutex<Option<Storage>>,
}

impl SsdStep {
    fn put_y(&self, y: Storage) -> Result<()> {
        match self.y.lock() {
            Ok(mut slot) => {
                *slot = Some(y);
                Ok(())
            }
            Err(_) => bail!("ssd_step: output slot poisoned"),
        }
    }
}

/// The CPU inputs of one step, as f32 slices.
struct StepCtx<'a> {
    x: &'a [f32],
    dt: &'a [f32],
    a: &'a [f32],
    bias: &'a [f32],
    b: &'a [f32],
    c: &'a [f32],
    z: Option<&'a [f32]>,
    d: Option<&'a [f32]>,
    step: &'a SsdStep,
}

impl StepCtx<'_> {
    /// Updates the state of (batch, head) `bh` in place and writes its output row `yh [P]`.
    fn head<S: Copy>(
        &self,
        bh: usize,
        st: &mut [S],
        yh: &mut [f32],
        load: impl Fn(S) -> f32,
        store: impl Fn(f32) -> S,
    ) {
        let SsdDims {
            nheads,
            headdim,
            ngroups,
            dstate,
            ..
        } = self.step.dims;
        let (bi, h) = (bh / nheads, bh % nheads);
        let g = h / self.step.dims.heads_per_group();
        let dtv = dt::process(
            self.dt[bh],
            self.bias[h],
            self.step.dt_softplus,
            self.step.dt_limit,
        );
        let decay = (self.a[h] * dtv).exp();
        let bn = &self.b[(bi * ngroups + g) * dstate..][..dstate];
        let cn = &self.c[(bi * ngroups + g) * dstate..][..dstate];
        for (p, (yv, row)) in yh.iter_mut().zip(st.chunks_exact_mut(dstate)).enumerate() {
            let xv = self.x[bh * headdim + p];
            let mut acc = 0f32;
            for ((s, bv), cv) in row.iter_mut().zip(bn).zip(cn) {
                let v = load(*s) * decay + dtv * xv * bv;
                *s = store(v);
                acc += v * cv;
            }
            if let Some(d) = self.d {
                acc += xv
                    * if d.len() == nheads {
                        d[h]
                    } else {
                        d[h * headdim + p]
                    };
            }
            if let Some(z) = self.z {
                let zv = z[bh * headdim + p];
                acc *= zv / (1.0 + (-zv).exp());
            }
            *yv = acc;
        }
    }
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
        let op = self.name();
        let SsdDims {
            nheads,
            headdim,
            dstate,
            ..
        } = self.dims;
        let pn = headdim * dstate;
        let x = cpu::f32_view(op, "x", x_s, x_l)?;
        let dt_in = cpu::f32_view(op, "dt", dt_s, dt_l)?;
        let held = (
            cpu::Held::new(&self.b),
            cpu::Held::new(&self.c),
            self.z.as_ref().map(cpu::Held::new),
        );
        let b = held.0.f32(op, "b")?;
        let c = held.1.f32(op, "c")?;
        let z = held.2.as_ref().map(|h| h.f32(op, "z")).transpose()?;
        let a = cpu::small_f32(&self.a)?;
        let bias = match &self.dt_bias {
            Some(t) => cpu::small_f32(t)?,
            None => vec![0.0; nheads],
        };
        let d = self.d.as_ref().map(cpu::small_f32).transpose()?;
        let Some((start, end)) = st_l.contiguous_offsets() else {
            bail!("{op}: state must be contiguous to be updated in place")
        };

        let ctx = StepCtx {
            x: &x,
            dt: &dt_in,
            a: &a,
            bias: &bias,
            b: &b,
            c: &c,
            z: z.as_deref(),
            d: d.as_deref(),
            step: self,
        };
        let mut y = vec![0f32; x.len()];
        match st_s {
            CpuStorage::F32(v) => v[start..end]
                .par_chunks_mut(pn)
                .zip(y.par_chunks_mut(headdim))
                .enumerate()
                .for_each(|(bh, (st, yh))| ctx.head(bh, st, yh, |s| s, |s| s)),
            CpuStorage::BF16(v) => v[start..end]
                .par_chunks_mut(pn)
                .zip(y.par_chunks_mut(headdim))
                .enumerate()
                .for_each(|(bh, (st, yh))| ctx.head(bh, st, yh, bf16::to_f32, bf16::from_f32)),
            other => bail!("{op}: state must be f32 or bf16, got {:?}", other.dtype()),
        }
        self.put_y(Storage::Cpu(cpu::from_f32(y, x_s.dtype())?))
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
        let y = crate::cuda::ssd_step(self, st_s, st_l, x_s, x_l, dt_s, dt_l)?;
        self.put_y(Storage::Cuda(y))
    }
}

/// Advances `state [B,H,P,N]` (f32 or bf16) by one token in place and returns `y [B,H,P]`.
///
/// `x [B,H,P]`, `dt [B,H]`, `a [H]` f32, `b, c [B,G,N]`; `state` must be contiguous.
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
        dt_softplus: opts.dt.softplus,
        dt_limit: opts.dt.limit,
        dims,
        y: Mutex::new(None),
    };
    state.inplace_op3(&check::rows_view(x)?, &check::rows_view(dt)?, &step)?;
    let y = match step.y.into_inner() {
        Ok(Some(y)) => y,
        _ => bail!("{op}: the step produced no output"),
    };
    Ok(Tensor::from_storage(
        y,
        (batch, nheads, headdim),
        BackpropOp::none(),
        false,
    ))
}
