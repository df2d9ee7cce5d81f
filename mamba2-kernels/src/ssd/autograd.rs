//! `ssd` with gradients: the op candle records when any input takes part in a gradient.
//!
//! candle's custom ops take at most three tensors and return one. On the CPU a core op takes
//!
//! - `values` = `[x | b | c | z]`, each flattened, in x's dtype — or, from
//!   [`super::ssd_xbc`], the caller's `xbc [B, L, H·P + 2·G·N]` itself (per token `[x | B | C]`,
//!   no z), read and returned in that layout, so that nothing is packed on the way in and the
//!   gradient needs no scatter on the way out;
//! - `dt` = the raw `dt [B, L, H]`;
//! - `params` = `[a | dt_bias | D | initial state]`, each flattened, in the parameter dtype (f32,
//!   or f64 for f64 values); a missing D or initial state takes no room, a missing bias is zeros;
//!
//! runs the forward and returns a one-element tensor, on which two output ops give y in x's
//! dtype and the final state in the state dtype; their backwards leave their gradients for the
//! core's, which candle runs after both. The packing is candle's own `flatten`, `cat` and
//! `to_dtype`, so the gradients reach the caller's tensors and every `Var` behind them (e.g.
//! `A_log` through `a = −exp(A_log)`).
//! On the CPU the backward is [`super::grad`]. On CUDA nothing is packed: the core op reads the
//! held inputs and takes as arguments only what routes the gradients — xbc's rows and dt, or x
//! and b, then one-element stand-ins for the other inputs two by two (see `Route`) — with the
//! same output ops on its result (z's gate is applied after them by candle ops); its backward is
//! the CUDA kernels' (`super::cuda::ssd_backward`), run once for both outputs. Inference never
//! takes this path.

use std::any::Any;
use std::borrow::Cow;
use std::sync::{Arc, Mutex};

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};

use super::cpu::{self as fwd, OutInputs};
use super::grad::{self, GradInputs, Kept};
use super::SsdOptions;
use crate::check::{param_dtype, SsdDims};
use crate::cpu::{round_to, to_storage, view, wide, CpuArg, Real};
use crate::dt::DtRule;
use crate::slot::Slot;
use rayon::prelude::*;

/// The core of the recorded SSD on the CPU, on `(values, dt, params)`: the forward, which leaves
/// y and the final state in [`Outputs`], and the backward.
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
    /// Where the forward leaves y and the final state, and the output ops their gradients.
    outputs: Arc<Outputs>,
}

/// What the recorded SSD's core op leaves for its two output ops (y, the final state) and they
/// for its backward: candle ops return one tensor, and an output op of its own lets each output
/// have its dtype and shape and its gradient come back as it is (a packed `[y | final state]`
/// cut by `narrow` would have candle build a full-size gradient for every cut).
#[derive(Debug, Default)]
struct Outputs {
    y: Slot,
    last: Slot,
    /// The gradients of y and of the final state, by [`Output`], left by the output ops'
    /// backwards for the core's (`None`: zero).
    pending: Handed,
}

/// An output of the recorded SSD (its place in [`Outputs::pending`]).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Output {
    Y = 0,
    Last = 1,
}

/// One output of the recorded SSD, on the core op's one-element result: its forward takes the
/// output the core left, its backward leaves the output's gradient for the core's, which candle
/// runs after both (they read its result).
#[derive(Debug)]
struct SsdOutput {
    outputs: Arc<Outputs>,
    out: Output,
    shape: Shape,
}

impl SsdOutput {
    fn slot(&self) -> (&Slot, &'static str) {
        match self.out {
            Output::Y => (&self.outputs.y, "y"),
            Output::Last => (&self.outputs.last, "final state"),
        }
    }
}

impl candle_core::CustomOp1 for SsdOutput {
    fn name(&self) -> &'static str {
        match self.out {
            Output::Y => "ssd_y",
            Output::Last => "ssd_final_state",
        }
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        let (slot, name) = self.slot();
        match slot.take_storage("ssd", name)? {
            candle_core::Storage::Cpu(s) => Ok((s, self.shape.clone())),
            _ => bail!("ssd: the {name} is not on the CPU"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (slot, name) = self.slot();
        match slot.take_storage("ssd", name)? {
            candle_core::Storage::Cuda(s) => Ok((s, self.shape.clone())),
            _ => bail!("ssd: the {name} is not on the CUDA device"),
        }
    }

    /// Leaves the gradient contiguous: the core's backward reads it as a slice.
    fn bwd(&self, core: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let place = self.out as usize;
        self.outputs.pending.set(place, grad_res.contiguous()?)?;
        chain_grad(core)
    }
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

    /// The forward in the compute type: y and the final state.
    fn forward<T: Real>(&self, values: &[T], dt: &[T], params: &[T]) -> (Vec<T>, Vec<T>) {
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
        let y = fwd::compute_out(&inputs, &states, dims, chunk);
        let last = fwd::final_states(&states, dims, chunk);
        self.kept.put(Kept { steps, states });
        (y, last)
    }

    fn cpu<T: Real>(
        &self,
        [(v_s, v_l), (dt_s, dt_l), (p_s, p_l)]: [CpuArg; 3],
    ) -> Result<(CpuStorage, Shape)> {
        let op = "ssd";
        let values = view::<T>(op, "x, b, c and z", v_s, v_l)?;
        let dt = view::<T>(op, "dt", dt_s, dt_l)?;
        let params = view::<T>(op, "a, dt_bias, D and the initial state", p_s, p_l)?;
        let (y, last) = self.forward(&values, &dt, &params);
        let outputs = &self.outputs;
        let cpu = candle_core::Storage::Cpu;
        outputs.y.put(op, cpu(to_storage(y, v_s.dtype())?))?;
        outputs
            .last
            .put(op, cpu(to_storage(last, self.state_dtype)?))?;
        Ok((to_storage(vec![T::zero()], DType::F32)?, Shape::from(1)))
    }

    /// The gradients of the packed inputs, on the host in the compute type.
    fn grads<T: Real>(
        &self,
        (values, dt, params): (&[T], &[T], &[T]),
        (dy, dlast): (&[T], &[T]),
    ) -> (Vec<T>, Vec<T>, Vec<T>) {
        let h = self.dims.nheads;
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
        let g = grad::backward(&inputs, dy, dlast, self.kept.take());
        let dvalues = self.pack([g.x, g.b, g.c, g.z.unwrap_or_default()]);
        let mut dparams = g.a;
        dparams.extend(g.bias);
        dparams.extend(g.d.unwrap_or_default());
        dparams.extend(g.init.unwrap_or_default());
        (dvalues, g.dt, dparams)
    }

    /// The gradients of `(values, dt, params)` given y's and the final state's (`None`: zero),
    /// as tensors like those arguments.
    fn bwd_in<T: Real + candle_core::WithDType>(
        &self,
        (values, dt, params): (&Tensor, &Tensor, &Tensor),
        (dy, dlast): (Option<&Tensor>, Option<&Tensor>),
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let op = "ssd backward";
        let p = self.parts();
        let (g_v, g_dt, g_p) = (
            values.storage_and_layout(),
            dt.storage_and_layout(),
            params.storage_and_layout(),
        );
        let (g_dy, g_last) = (
            dy.map(Tensor::storage_and_layout),
            dlast.map(Tensor::storage_and_layout),
        );
        let zeros = |len: usize| Cow::Owned(vec![T::zero(); len]);
        let (dy_h, dlast_h) = (
            match &g_dy {
                Some((s, l)) => host_slice(op, "y's gradient", s, l)?,
                None => zeros(p.x),
            },
            match &g_last {
                Some((s, l)) => host_slice(op, "the final state's gradient", s, l)?,
                None => zeros(p.pn),
            },
        );
        let (dv, dd, dp) = self.grads(
            (
                &host_slice(op, "values", &g_v.0, g_v.1)?,
                &host_slice(op, "dt", &g_dt.0, g_dt.1)?,
                &host_slice(op, "params", &g_p.0, g_p.1)?,
            ),
            (&dy_h, &dlast_h),
        );
        let back = |g: Vec<T>, like: &Tensor| -> Result<Tensor> {
            Tensor::from_vec(g, like.shape(), like.device())?.to_dtype(like.dtype())
        };
        Ok((back(dv, values)?, back(dd, dt)?, back(dp, params)?))
    }
}

/// The contiguous elements of a CPU tensor's storage in the compute type, borrowed when they
/// already have it.
fn host_slice<'a, T: Real>(
    op: &str,
    name: &str,
    s: &'a candle_core::Storage,
    l: &Layout,
) -> Result<Cow<'a, [T]>> {
    match s {
        candle_core::Storage::Cpu(s) => view::<T>(op, name, s, l),
        _ => bail!("{op}: {name} is not on the CPU"),
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
        _grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        if !values.device().is_cpu() {
            bail!("ssd: the recorded op of the CPU got tensors on another device")
        }
        let args = (values, dt, params);
        let pending = &self.outputs.pending;
        let (dy, dlast) = (
            pending.take(Output::Y as usize)?,
            pending.take(Output::Last as usize)?,
        );
        let grads = (dy.as_ref(), dlast.as_ref());
        let (dv, dd, dp) = if wide(values.dtype()) {
            self.bwd_in::<f64>(args, grads)?
        } else {
            self.bwd_in::<f32>(args, grads)?
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
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        let held = |t: &Tensor| t.detach().contiguous();
        let parts = (held(x)?, held(b)?, held(c)?);
        let (y, last) = on_cuda(Route::Split(x, b, c), (dt, a), parts, opts, dims)?;
        // The gate as candle ops, which differentiate it.
        let y = match opts.z {
            Some(z) => (y * z.silu()?)?,
            None => y,
        };
        return Ok((y, last));
    }
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
    let xbc = xbc.contiguous()?;
    #[cfg(feature = "cuda")]
    if xbc.device().is_cuda() {
        let (hp, gn) = (dims.nheads * dims.headdim, dims.ngroups * dims.dstate);
        let (bl, l) = (dims.batch, dims.seqlen);
        let cut = |start: usize, len: usize, shape: (usize, usize, usize, usize)| {
            xbc.detach()
                .narrow(2, start, len)?
                .reshape(shape)?
                .contiguous()
        };
        let x = cut(0, hp, (bl, l, dims.nheads, dims.headdim))?;
        let b = cut(hp, gn, (bl, l, dims.ngroups, dims.dstate))?;
        let c = cut(hp + gn, gn, (bl, l, dims.ngroups, dims.dstate))?;
        return on_cuda(Route::Rows(&xbc), (dt, a), (x, b, c), opts, dims);
    }
    recorded(&xbc, (dt, a), opts, dims, true)
}

/// Runs the recorded core op on `values` (flat, or xbc `rows`) and the packed parameters, and its
/// output ops for `(y, final state)`.
fn recorded(
    values: &Tensor,
    (dt, a): (&Tensor, &Tensor),
    opts: &SsdOptions,
    dims: SsdDims,
    rows: bool,
) -> Result<(Tensor, Tensor)> {
    if !values.device().is_cpu() {
        bail!(
            "ssd: gradients are computed on the CPU and on CUDA, not on {:?}",
            values.device().location()
        )
    }
    let h = dims.nheads;
    let params = packed_params(values, a, opts, h)?;
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
        outputs: Arc::new(Outputs::default()),
    };
    let outputs = op.outputs.clone();
    let core = values.apply_op3(&dt.contiguous()?, &params, op)?;
    output_ops(&core, &outputs, dims)
}

/// y `[B,L,H,P]` and the final state `[B,H,P,N]`: the two output ops on the core op's result.
fn output_ops(core: &Tensor, outputs: &Arc<Outputs>, dims: SsdDims) -> Result<(Tensor, Tensor)> {
    let output = |out: Output, shape: Shape| {
        core.apply_op1(SsdOutput {
            outputs: outputs.clone(),
            out,
            shape,
        })
    };
    let (bsz, h, p) = (dims.batch, dims.nheads, dims.headdim);
    let y = output(Output::Y, Shape::from((bsz, dims.seqlen, h, p)))?;
    let last = output(Output::Last, Shape::from((bsz, h, p, dims.dstate)))?;
    Ok((y, last))
}

/// The packed parameters `[a | dt_bias | D | initial state]` in the parameter dtype; a missing
/// bias is zeros, and the initial state is rounded to the state dtype as the forward reads it.
fn packed_params(values: &Tensor, a: &Tensor, opts: &SsdOptions, h: usize) -> Result<Tensor> {
    let pt = param_dtype(values);
    let bias = match opts.dt.bias {
        Some(t) => t.to_dtype(pt)?,
        None => Tensor::zeros(h, pt, values.device())?,
    };
    let mut params = vec![a.to_dtype(pt)?, bias];
    if let Some(d) = opts.d {
        params.push(d.flatten_all()?.to_dtype(pt)?);
    }
    if let Some(s) = opts.initial_state {
        params.push(s.to_dtype(opts.state_dtype)?.to_dtype(pt)?.flatten_all()?);
    }
    Tensor::cat(&params, 0)
}

/// How the recorded SSD on CUDA reaches the caller's tensors. candle's custom ops take three
/// tensors; the arguments only route the gradients, since the forward reads the held tensors, so
/// every input is an argument as it is, never packed (a `cat` would copy it, and its gradient
/// would be cut and added again): the op's first two, then the rest behind a chain of
/// [`Handoff`]s.
#[cfg(feature = "cuda")]
#[derive(Clone, Copy)]
enum Route<'a> {
    /// `(xbc, dt, …)`: the caller's `[x | B | C]` rows, its gradient one tensor in that layout.
    Rows(&'a Tensor),
    /// `(x, b, …)`, c and dt in the chain.
    Split(&'a Tensor, &'a Tensor, &'a Tensor),
}

/// The recorded SSD on CUDA: the core op on the inputs (see [`Route`]), which runs the forward,
/// and the two output ops on its result. The forward reads the detached tensors the core holds: x,
/// b and c contiguous (cut from xbc's rows by the caller), the parameters.
#[cfg(feature = "cuda")]
fn on_cuda(
    route: Route,
    (dt, a): (&Tensor, &Tensor),
    (x, b, c): (Tensor, Tensor, Tensor),
    opts: &SsdOptions,
    dims: SsdDims,
) -> Result<(Tensor, Tensor)> {
    let held = Arc::new(CudaHeld {
        x,
        b,
        c,
        dt: crate::check::rows_view(&dt.detach())?,
        a: a.detach().to_dtype(DType::F32)?.contiguous()?,
        bias: opts
            .dt
            .bias
            .map(|t| t.detach().to_dtype(DType::F32)?.contiguous())
            .transpose()?,
        d: opts
            .d
            .map(|t| t.detach().to_dtype(DType::F32)?.contiguous())
            .transpose()?,
        init: opts
            .initial_state
            .map(|s| s.detach().to_dtype(opts.state_dtype)?.contiguous())
            .transpose()?,
        rule: opts.dt.rule(),
        dims,
        chunk: opts.chunk_size,
        state_dtype: opts.state_dtype,
        outputs: Arc::new(Outputs::default()),
        kept: Slot::default(),
    });
    let params = [Some(a), opts.dt.bias, opts.d, opts.initial_state];
    let (first, second, chained, rows) = match route {
        Route::Rows(xbc) => (xbc, dt, Vec::new(), true),
        Route::Split(x, b, c) => (x, b, vec![Some(c), Some(dt)], false),
    };
    let chained: Vec<Option<&Tensor>> = chained.into_iter().chain(params).collect();
    let handed = Arc::new(Handed::default());
    let rest = handoff_chain(&chained, &handed)?;
    let outputs = held.outputs.clone();
    let core = SsdCore { held, rows, handed };
    let done = first.apply_op3(second, &rest, core)?;
    output_ops(&done, &outputs, dims)
}

/// What the core op on CUDA holds: the forward's inputs, detached, and the outputs' slots.
#[cfg(feature = "cuda")]
struct CudaHeld {
    x: Tensor,
    b: Tensor,
    c: Tensor,
    dt: Tensor,
    a: Tensor,
    bias: Option<Tensor>,
    d: Option<Tensor>,
    init: Option<Tensor>,
    rule: DtRule,
    dims: SsdDims,
    chunk: usize,
    state_dtype: DType,
    outputs: Arc<Outputs>,
    /// What the forward kept for the backward, until the backward takes it.
    kept: Slot<super::KeptPass>,
}

#[cfg(feature = "cuda")]
impl std::fmt::Debug for CudaHeld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaHeld")
            .field("dims", &self.dims)
            .finish()
    }
}

#[cfg(feature = "cuda")]
impl CudaHeld {
    /// Runs the SSD, leaves y and the final state in the outputs' slots and keeps the chunk
    /// states and step sizes for the backward.
    fn forward(&self) -> Result<()> {
        let (xs, xl) = self.x.storage_and_layout();
        let (bs, bl) = self.b.storage_and_layout();
        let (cs, cl) = self.c.storage_and_layout();
        let (
            candle_core::Storage::Cuda(xs),
            candle_core::Storage::Cuda(bs),
            candle_core::Storage::Cuda(cs),
        ) = (&*xs, &*bs, &*cs)
        else {
            bail!("ssd: x, b and c must be on one CUDA device")
        };
        let fused = super::cuda::Fused {
            x: (xs, xl),
            b: (bs, bl),
            c: (cs, cl),
            dt: &self.dt,
            a: &self.a,
            dt_bias: self.bias.as_ref(),
            d: self.d.as_ref(),
            z: None,
            init: self.init.as_ref(),
            rule: self.rule,
            dims: self.dims,
            chunk_size: self.chunk,
            state_dtype: self.state_dtype,
            keep: true,
            packed: None,
        };
        let (y, last, kept) = super::cuda::ssd(&fused)?;
        let cuda = candle_core::Storage::Cuda;
        self.outputs.y.put("ssd", cuda(y))?;
        self.outputs.last.put("ssd", cuda(last))?;
        match kept {
            Some(k) => self.kept.put("ssd", k.into_tensor(&self.dims)),
            None => Ok(()),
        }
    }

    /// The backward's kernels on the held inputs, given y's gradient and the final state's
    /// (`None`: zero).
    fn backward(
        &self,
        dy: Option<&Tensor>,
        dlast: Option<&Tensor>,
    ) -> Result<super::cuda::BackwardGrads> {
        let dy = match dy {
            Some(g) => g.to_dtype(self.x.dtype())?.contiguous()?,
            None => self.x.zeros_like()?,
        };
        let dlast = dlast
            .map(|g| g.to_dtype(DType::F32)?.contiguous())
            .transpose()?;
        let rule = self.rule;
        let kept = self.kept.take_any("ssd")?;
        super::cuda::ssd_backward(super::cuda::Backward {
            x: &self.x,
            b: &self.b,
            c: &self.c,
            dt: &self.dt,
            a: &self.a,
            dt_opts: crate::DtOptions {
                bias: self.bias.as_ref(),
                softplus: rule.softplus,
                limit: rule.limit,
            },
            d: self.d.as_ref(),
            init: self.init.as_ref(),
            dy: &dy,
            dlast: dlast.as_ref(),
            dims: self.dims,
            state_dtype: self.state_dtype,
            kept,
        })
    }
}

/// The core of the recorded SSD on CUDA: its forward runs the SSD, its backward the backward's
/// kernels, once for both outputs.
#[cfg(feature = "cuda")]
#[derive(Debug)]
struct SsdCore {
    held: Arc<CudaHeld>,
    /// The first argument is xbc's rows ([`Route::Rows`]).
    rows: bool,
    /// Where the backward leaves the gradients of the inputs behind its third argument, the
    /// chain of [`Handoff`]s.
    handed: Arc<Handed>,
}

#[cfg(feature = "cuda")]
impl CustomOp3 for SsdCore {
    fn name(&self) -> &'static str {
        "ssd"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        bail!("ssd: the recorded op of CUDA got CPU tensors")
    }

    fn cuda_fwd(
        &self,
        first: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.held.forward()?;
        one_zero(first)
    }

    /// The arguments are `(xbc, dt, chain)` or `(x, b, chain)` (see [`Route`]).
    fn bwd(
        &self,
        first: &Tensor,
        second: &Tensor,
        chain: &Tensor,
        _res: &Tensor,
        _grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let pending = &self.held.outputs.pending;
        let (dy, dlast) = (
            pending.take(Output::Y as usize)?,
            pending.take(Output::Last as usize)?,
        );
        let g = self.held.backward(dy.as_ref(), dlast.as_ref())?;
        let d = self.held.dims;
        let (dfirst, dsecond, mut chained) = if self.rows {
            let (bl, l) = (d.batch, d.seqlen);
            let (hp, gn) = (d.nheads * d.headdim, d.ngroups * d.dstate);
            let dxbc = Tensor::cat(
                &[
                    g.x.reshape((bl, l, hp))?,
                    g.b.reshape((bl, l, gn))?,
                    g.c.reshape((bl, l, gn))?,
                ],
                2,
            )?;
            (dxbc, g.dt, Vec::new())
        } else {
            (g.x, g.b, vec![Some(g.c), Some(g.dt)])
        };
        chained.extend([Some(g.a), Some(g.bias), g.d, g.init]);
        if chain.track_op() {
            self.handed.put(chained)?;
        }
        Ok((
            recorded_grad(first, dfirst)?,
            recorded_grad(second, dsecond)?,
            chain_grad(chain)?,
        ))
    }
}

/// A one-element zero on `like`'s device: the result of the ops whose output is elsewhere.
#[cfg(feature = "cuda")]
fn one_zero(like: &candle_core::CudaStorage) -> Result<(candle_core::CudaStorage, Shape)> {
    use candle_core::backend::BackendDevice;
    let one = Shape::from(1);
    Ok((like.device().zeros_impl(&one, DType::F32)?, one))
}

/// `grad` in `arg`'s dtype, or `None` when `arg` records no gradient (candle would add it to
/// zeros).
#[cfg(feature = "cuda")]
fn recorded_grad(arg: &Tensor, grad: Tensor) -> Result<Option<Tensor>> {
    match arg.track_op() {
        true => Ok(Some(grad.to_dtype(arg.dtype())?)),
        false => Ok(None),
    }
}

/// The gradient of a one-element stand-in (a chain link, the core op's result): a zero, so that
/// candle runs the stand-in's backward.
fn chain_grad(link: &Tensor) -> Result<Option<Tensor>> {
    match link.track_op() {
        true => Ok(Some(Tensor::zeros(1, DType::F32, link.device())?)),
        false => Ok(None),
    }
}

/// Gradients one op's backward leaves for another's, by place: those [`SsdCore`]'s backward
/// computed for the inputs behind its chain of [`Handoff`]s, or those the output ops leave for
/// the core op (`None`: no such gradient).
#[derive(Default)]
struct Handed(Mutex<Vec<Option<Tensor>>>);

impl Handed {
    /// Replaces every gradient with `grads`.
    #[cfg(feature = "cuda")]
    fn put(&self, grads: Vec<Option<Tensor>>) -> Result<()> {
        self.with(|slot| *slot = grads)
    }

    /// Sets the gradient at `place`.
    fn set(&self, place: usize, grad: Tensor) -> Result<()> {
        self.with(|slot| {
            if slot.len() <= place {
                slot.resize(place + 1, None);
            }
            slot[place] = Some(grad);
        })
    }

    /// The gradient at `place`, once.
    fn take(&self, place: usize) -> Result<Option<Tensor>> {
        self.with(|slot| slot.get_mut(place).and_then(Option::take))
    }

    fn with<R>(&self, f: impl FnOnce(&mut Vec<Option<Tensor>>) -> R) -> Result<R> {
        match self.0.lock() {
            Ok(mut slot) => Ok(f(&mut slot)),
            Err(_) => bail!("ssd: gradient slot poisoned"),
        }
    }
}

impl std::fmt::Debug for Handed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Handed")
    }
}

/// The chain standing for `inputs` as [`SsdCore`]'s third argument: each link a [`Handoff`] on
/// two inputs and the next link; a missing input, and the last link's next, a one-element zero
/// that records nothing.
#[cfg(feature = "cuda")]
fn handoff_chain(inputs: &[Option<&Tensor>], handed: &Arc<Handed>) -> Result<Tensor> {
    let Some(dev) = inputs.iter().flatten().next().map(|t| t.device()) else {
        bail!("ssd: nothing to route gradients to")
    };
    let none = Tensor::zeros(1, DType::F32, dev)?;
    let mut next = none.clone();
    for place in (0..inputs.len()).step_by(2).rev() {
        let arg = |i: usize| inputs.get(i).copied().flatten().unwrap_or(&none);
        let link = Handoff {
            handed: handed.clone(),
            place,
        };
        next = arg(place).apply_op3(arg(place + 1), &next, link)?;
    }
    Ok(next)
}

/// A link of the chain: a one-element tensor standing for the inputs at `place` and `place + 1`
/// and the links after it. Its forward reads nothing; its backward returns the gradients
/// [`SsdCore`]'s backward, which candle runs first, left in [`Handed`].
#[cfg(feature = "cuda")]
#[derive(Debug)]
struct Handoff {
    handed: Arc<Handed>,
    place: usize,
}

#[cfg(feature = "cuda")]
impl CustomOp3 for Handoff {
    fn name(&self) -> &'static str {
        "ssd_handoff"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        bail!("ssd: the recorded op of CUDA got CPU tensors")
    }

    fn cuda_fwd(
        &self,
        first: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        one_zero(first)
    }

    fn bwd(
        &self,
        first: &Tensor,
        second: &Tensor,
        next: &Tensor,
        _res: &Tensor,
        _grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let handed = |arg: &Tensor, place: usize| -> Result<Option<Tensor>> {
            match self.handed.take(place)? {
                Some(g) => recorded_grad(arg, g),
                None => Ok(None),
            }
        };
        Ok((
            handed(first, self.place)?,
            handed(second, self.place + 1)?,
            chain_grad(next)?,
        ))
    }
}

/// [`super::ssd_backward`] on the CPU: the recorded op's backward on the packed inputs, cut back
/// into the inputs' shapes and dtypes.
pub(super) fn backward_cpu(
    (x, dt, a, b, c): (&Tensor, &Tensor, &Tensor, &Tensor, &Tensor),
    opts: &SsdOptions,
    dims: SsdDims,
    (dy, dlast): (&Tensor, Option<&Tensor>),
) -> Result<super::SsdGrads> {
    let values = Tensor::cat(&[x.flatten_all()?, b.flatten_all()?, c.flatten_all()?], 0)?;
    let params = packed_params(&values, a, opts, dims.nheads)?;
    let op = SsdGrad {
        dims,
        chunk: opts.chunk_size,
        rule: opts.dt.rule(),
        state_dtype: opts.state_dtype,
        has_z: false,
        d_len: opts.d.map_or(0, Tensor::elem_count),
        has_init: opts.initial_state.is_some(),
        rows: false,
        kept: KeptSlot::default(),
        outputs: Arc::new(Outputs::default()),
    };
    let parts = op.parts();
    let ct = param_dtype(&values);
    let dy = dy.contiguous()?;
    let dlast = dlast.map(Tensor::contiguous).transpose()?;
    let args = (&values, &dt.contiguous()?, &params);
    let grads = (Some(&dy), dlast.as_ref());
    let (dv, ddt, dp) = if wide(values.dtype()) {
        op.bwd_in::<f64>(args, grads)?
    } else {
        op.bwd_in::<f32>(args, grads)?
    };
    let h = dims.nheads;
    let cut = |t: &Tensor, start: usize, len: usize, like: &Tensor| -> Result<Tensor> {
        t.narrow(0, start, len)?
            .reshape(like.shape())?
            .to_dtype(like.dtype())
    };
    let (px, bc) = (parts.x, parts.bc);
    let pf = ct;
    let d_len = op.d_len;
    Ok(super::SsdGrads {
        x: cut(&dv, 0, px, x)?,
        b: cut(&dv, px, bc, b)?,
        c: cut(&dv, px + bc, bc, c)?,
        dt: ddt,
        a: dp.narrow(0, 0, h)?.to_dtype(pf)?,
        dt_bias: dp.narrow(0, h, h)?.to_dtype(pf)?,
        d: opts
            .d
            .map(|d| dp.narrow(0, 2 * h, d_len)?.reshape(d.shape())?.to_dtype(pf))
            .transpose()?,
        initial_state: opts
            .initial_state
            .map(|s| {
                dp.narrow(0, 2 * h + d_len, parts.pn)?
                    .reshape(s.shape())?
                    .to_dtype(pf)
            })
            .transpose()?,
    })
}
