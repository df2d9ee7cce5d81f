//! `ssd` with gradients: the op candle records when any input takes part in a gradient.
//!
//! candle's custom ops take at most three tensors and return one, so this form packs them:
//!
//! - `values` = `[x | b | c | z]`, each flattened, in x's dtype — or, from
//!   [`super::ssd_xbc`], the caller's `xbc [B, L, H·P + 2·G·N]` itself (per token `[x | B | C]`,
//!   no z), read and returned in that layout, so that nothing is packed on the way in and the
//!   gradient needs no scatter on the way out;
//! - `dt` = the raw `dt [B, L, H]`;
//! - `params` = `[a | dt_bias | D | initial state]`, each flattened, in the parameter dtype (f32,
//!   or f64 for f64 values); a missing D or initial state takes no room, a missing bias is zeros;
//!
//! and returns `[y | final state]`, flattened, in the compute dtype (f32 or f64), which
//! [`super::ssd`] cuts and converts to x's dtype and the state dtype. The packing and the cuts
//! are candle's own `flatten`, `cat`, `narrow`, `reshape` and `to_dtype`, so the gradients reach
//! the caller's tensors and every `Var` behind them (e.g. `A_log` through `a = −exp(A_log)`).
//! The backward ([`super::grad`]) runs on the CPU; inference never takes this path.

use std::any::Any;
use std::borrow::Cow;
use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};

use super::cpu::{self as fwd, OutInputs};
use super::grad::{self, GradInputs, Kept};
use super::SsdOptions;
use crate::check::{param_dtype, SsdDims};
use crate::cpu::{round_to, to_storage, view, wide, CpuArg, Real};
use crate::dt::DtRule;
use rayon::prelude::*;

/// The recorded SSD on `(values, dt, params)`.
#[derive(Debug)]
struct SsdGrad {
    dims: SsdDims,
    chunk: usize,
    rule: DtRule,
    state_dtype: DType,
    has_z: bool,
    /// D's element count: 0 (none), H or H·P.
    d_len: usize,
    has_init: bool,
    /// `values` is `xbc` rows rather than the flat `[x | b | c | z]`.
    rows: bool,
    /// The forward's intermediates, for the backward.
    kept: KeptSlot,
}

/// The [`Kept`] intermediates of the last forward in its compute type. On the CPU keeping them
/// (`[B,H,C+1,P,N]` states, about as large as x) costs less than recomputing them in the backward.
#[derive(Default)]
struct KeptSlot(Mutex<Option<Box<dyn Any + Send>>>);

impl KeptSlot {
    fn put<T: Real>(&self, kept: Kept<T>) {
        if let Ok(mut slot) = self.0.lock() {
            *slot = Some(Box::new(kept));
        }
    }

    /// The kept intermediates (once), if the forward ran in `T`.
    fn take<T: Real>(&self) -> Option<Kept<T>> {
        let boxed = self.0.lock().ok()?.take()?;
        boxed.downcast::<Kept<T>>().ok().map(|k| *k)
    }
}

impl std::fmt::Debug for KeptSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeptSlot")
    }
}

/// Where each input sits in the packed tensors.
struct Parts {
    x: usize,
    bc: usize,
    pn: usize,
}

impl SsdGrad {
    fn parts(&self) -> Parts {
        let d = &self.dims;
        Parts {
            x: d.batch * d.seqlen * d.nheads * d.headdim,
            bc: d.batch * d.seqlen * d.ngroups * d.dstate,
            pn: d.batch * d.nheads * d.headdim * d.dstate,
        }
    }

    /// `(x, b, c, z)` of `values` in the flat layout: slices of it, or cut from its rows.
    fn unpack<'a, T: Real>(&self, values: &'a [T]) -> [Cow<'a, [T]>; 4] {
        let p = self.parts();
        if !self.rows {
            let (x, rest) = values.split_at(p.x);
            let (b, rest) = rest.split_at(p.bc);
            let (c, z) = rest.split_at(p.bc);
            return [x, b, c, z].map(Cow::Borrowed);
        }
        let d = &self.dims;
        let (hp, gn) = (d.nheads * d.headdim, d.ngroups * d.dstate);
        let width = hp + 2 * gn;
        let cut = |start: usize, len: usize| -> Cow<'a, [T]> {
            let mut out = vec![T::zero(); d.batch * d.seqlen * len];
            out.par_chunks_mut(len)
                .zip(values.par_chunks(width))
                .for_each(|(o, row)| o.copy_from_slice(&row[start..start + len]));
            Cow::Owned(out)
        };
        [
            cut(0, hp),
            cut(hp, gn),
            cut(hp + gn, gn),
            Cow::Borrowed(&[]),
        ]
    }

    /// The gradients of `(x, b, c, z)` in the layout of `values`.
    fn pack<T: Real>(&self, [x, b, c, z]: [Vec<T>; 4]) -> Vec<T> {
        if !self.rows {
            let mut out = x;
            for part in [b, c, z] {
                out.extend(part);
            }
            return out;
        }
        let d = &self.dims;
        let (hp, gn) = (d.nheads * d.headdim, d.ngroups * d.dstate);
        let mut out = vec![T::zero(); d.batch * d.seqlen * (hp + 2 * gn)];
        out.par_chunks_mut(hp + 2 * gn)
            .zip(x.par_chunks(hp).zip(b.par_chunks(gn).zip(c.par_chunks(gn))))
            .for_each(|(row, (xr, (br, cr)))| {
                row[..hp].copy_from_slice(xr);
                row[hp..hp + gn].copy_from_slice(br);
                row[hp + gn..].copy_from_slice(cr);
            });
        out
    }

    /// The forward in the compute type: `[y | final state]`.
    fn forward<T: Real>(&self, values: &[T], dt: &[T], params: &[T]) -> Vec<T> {
        let h = self.dims.nheads;
        let [x, b, c, z] = self.unpack(values);
        let (x, b, c, z) = (&x[..], &b[..], &c[..], &z[..]);
        let (a, rest) = params.split_at(h);
        let (bias, rest) = rest.split_at(h);
        let (d, init) = rest.split_at(self.d_len);
        let (dims, chunk) = (&self.dims, self.chunk);
        let steps = fwd::chunk_cumsum(dt, (dims.batch, dims.seqlen, h), a, bias, self.rule, chunk);
        let (dtp, da) = steps.split_at(steps.len() / 2);
        let init = self.has_init.then_some(init);
        let mut states = fwd::chunk_states((x, b), (dtp, da), init, dims, chunk);
        round_to(&mut states, self.state_dtype);
        let inputs = OutInputs {
            x,
            b,
            c,
            dt: dtp,
            da,
            d: (self.d_len > 0).then_some(d),
            z: self.has_z.then_some(z),
        };
        let mut out = fwd::compute_out(&inputs, &states, dims, chunk);
        out.extend(fwd::final_states(&states, dims, chunk));
        self.kept.put(Kept { steps, states });
        out
    }

    fn cpu<T: Real>(
        &self,
        [(v_s, v_l), (dt_s, dt_l), (p_s, p_l)]: [CpuArg; 3],
    ) -> Result<(CpuStorage, Shape)> {
        let op = "ssd";
        let values = view::<T>(op, "x, b, c and z", v_s, v_l)?;
        let dt = view::<T>(op, "dt", dt_s, dt_l)?;
        let params = view::<T>(op, "a, dt_bias, D and the initial state", p_s, p_l)?;
        let out = self.forward(&values, &dt, &params);
        let len = out.len();
        let dtype = if wide(v_s.dtype()) {
            DType::F64
        } else {
            DType::F32
        };
        Ok((to_storage(out, dtype)?, Shape::from(len)))
    }

    /// The gradients of the packed inputs, on the host in the compute type.
    fn grads<T: Real>(
        &self,
        (values, dt, params): (&[T], &[T], &[T]),
        grad_out: &[T],
    ) -> (Vec<T>, Vec<T>, Vec<T>) {
        let (p, h) = (self.parts(), self.dims.nheads);
        let [x, b, c, z] = self.unpack(values);
        let (x, b, c, z) = (&x[..], &b[..], &c[..], &z[..]);
        let (a, rest) = params.split_at(h);
        let (bias, rest) = rest.split_at(h);
        let (d, init) = rest.split_at(self.d_len);
        let inputs = GradInputs {
            x,
            b,
            c,
            z: self.has_z.then_some(z),
            dt,
            a,
            bias,
            d: (self.d_len > 0).then_some(d),
            init: self.has_init.then_some(init),
            rule: self.rule,
            dims: self.dims,
            chunk: self.chunk,
            state_dtype: self.state_dtype,
        };
        let (dy, dlast) = grad_out.split_at(p.x);
        let g = grad::backward(&inputs, dy, dlast, self.kept.take());
        let dvalues = self.pack([g.x, g.b, g.c, g.z.unwrap_or_default()]);
        let mut dparams = g.a;
        dparams.extend(g.bias);
        dparams.extend(g.d.unwrap_or_default());
        dparams.extend(g.init.unwrap_or_default());
        (dvalues, g.dt, dparams)
    }

    fn bwd_in<T: Real + candle_core::WithDType>(
        &self,
        (values, dt, params): (&Tensor, &Tensor, &Tensor),
        grad_res: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let host =
            |t: &Tensor| -> Result<Vec<T>> { t.flatten_all()?.to_dtype(T::DTYPE)?.to_vec1::<T>() };
        let (v, d, p, g) = (host(values)?, host(dt)?, host(params)?, host(grad_res)?);
        let (dv, dd, dp) = self.grads((&v, &d, &p), &g);
        let back = |g: Vec<T>, like: &Tensor| -> Result<Tensor> {
            Tensor::from_vec(g, like.shape(), like.device())?.to_dtype(like.dtype())
        };
        Ok((back(dv, values)?, back(dd, dt)?, back(dp, params)?))
    }
}

impl CustomOp3 for SsdGrad {
    fn name(&self) -> &'static str {
        "ssd"
    }

    fn cpu_fwd(
        &self,
        v_s: &CpuStorage,
        v_l: &Layout,
        dt_s: &CpuStorage,
        dt_l: &Layout,
        p_s: &CpuStorage,
        p_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let args = [(v_s, v_l), (dt_s, dt_l), (p_s, p_l)];
        if wide(v_s.dtype()) {
            self.cpu::<f64>(args)
        } else {
            self.cpu::<f32>(args)
        }
    }

    fn bwd(
        &self,
        values: &Tensor,
        dt: &Tensor,
        params: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        if !values.device().is_cpu() {
            bail!("ssd: the backward runs on the CPU; no CUDA backward kernels yet")
        }
        let args = (values, dt, params);
        let (dv, dd, dp) = if wide(values.dtype()) {
            self.bwd_in::<f64>(args, grad_res)?
        } else {
            self.bwd_in::<f32>(args, grad_res)?
        };
        Ok((Some(dv), Some(dd), Some(dp)))
    }
}

/// [`super::ssd`] for inputs that take part in a gradient (checked by the caller): packs them,
/// runs the recorded op and cuts `(y, final state)` from its output.
pub(super) fn ssd(
    (x, dt, a, b, c): (&Tensor, &Tensor, &Tensor, &Tensor, &Tensor),
    opts: &SsdOptions,
    dims: SsdDims,
) -> Result<(Tensor, Tensor)> {
    let mut values = vec![x.flatten_all()?, b.flatten_all()?, c.flatten_all()?];
    if let Some(z) = opts.z {
        values.push(z.flatten_all()?);
    }
    recorded(&Tensor::cat(&values, 0)?, (dt, a), opts, dims, false)
}

/// [`super::ssd_xbc`] for inputs that take part in a gradient, without z (checked by the caller):
/// the op reads `xbc` as it is.
pub(super) fn ssd_xbc(
    xbc: &Tensor,
    (dt, a): (&Tensor, &Tensor),
    opts: &SsdOptions,
    dims: SsdDims,
) -> Result<(Tensor, Tensor)> {
    recorded(&xbc.contiguous()?, (dt, a), opts, dims, true)
}

/// Runs the recorded op on `values` (flat, or xbc `rows`) and the packed parameters, and cuts
/// `(y, final state)` from its output.
fn recorded(
    values: &Tensor,
    (dt, a): (&Tensor, &Tensor),
    opts: &SsdOptions,
    dims: SsdDims,
    rows: bool,
) -> Result<(Tensor, Tensor)> {
    if !values.device().is_cpu() {
        bail!(
            "ssd: gradients are computed on the CPU for now (no CUDA backward kernels yet); \
             detach the inputs to run the forward on {:?}",
            values.device().location()
        )
    }
    let pt = param_dtype(values);
    let h = dims.nheads;
    let bias = match opts.dt.bias {
        Some(t) => t.to_dtype(pt)?,
        None => Tensor::zeros(h, pt, values.device())?,
    };
    let mut params = vec![a.to_dtype(pt)?, bias];
    if let Some(d) = opts.d {
        params.push(d.flatten_all()?.to_dtype(pt)?);
    }
    // The initial state as the forward reads it: rounded to the state dtype.
    if let Some(s) = opts.initial_state {
        params.push(s.to_dtype(opts.state_dtype)?.to_dtype(pt)?.flatten_all()?);
    }
    let op = SsdGrad {
        dims,
        chunk: opts.chunk_size,
        rule: opts.dt.rule(),
        state_dtype: opts.state_dtype,
        has_z: opts.z.is_some(),
        d_len: opts.d.map_or(0, Tensor::elem_count),
        has_init: opts.initial_state.is_some(),
        rows,
        kept: KeptSlot::default(),
    };
    let parts = op.parts();
    let out = values.apply_op3(&dt.contiguous()?, &Tensor::cat(&params, 0)?, op)?;
    let y = out
        .narrow(0, 0, parts.x)?
        .reshape((dims.batch, dims.seqlen, h, dims.headdim))?
        .to_dtype(values.dtype())?;
    let last = out
        .narrow(0, parts.x, parts.pn)?
        .reshape((dims.batch, h, dims.headdim, dims.dstate))?
        .to_dtype(opts.state_dtype)?;
    Ok((y, last))
}
