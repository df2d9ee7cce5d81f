//! The differentiable prefill conv. When x, the weight or the bias tracks gradients,
//! [`causal_conv1d_split`](super::causal_conv1d_split) records the conv as one candle op on
//! `(x, weight, bias)` (on `(x, weight)` without a bias) whose backward returns dx, dweight and
//! dbias (`cpu::backward` on the CPU; on CUDA the backward kernel, whose per-program partial sums
//! of dweight and dbias candle adds up in f32 before they take the weight's dtype), and cuts the
//! pieces from its one output with `narrow`, which candle differentiates. The initial state is
//! held by the op, not one of its arguments: it gets no gradient. The returned new state, the
//! last K inputs, is cut from detached tensors and carries no gradient either.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};

use super::cpu;
use crate::check::{self, ConvDims};
use crate::cpu::{host, to_storage, values_like, view, wide, CpuArg, Held, Real};

const OP: &str = "causal_conv1d";

/// The prefill conv as a recorded op on `(x, weight[, bias])`, from a held initial state.
#[derive(Debug)]
struct RecordedConv {
    /// `[B,D,K]`, contiguous and detached.
    state: Tensor,
    silu: bool,
    dims: ConvDims,
}

/// The gradients of x, the weight and the bias, each `None` when not asked for.
type Grads = (Option<Tensor>, Option<Tensor>, Option<Tensor>);

/// Which of the `(x, weight, bias)` gradients a backward computes.
type Want = (bool, bool, bool);

/// The gradients that candle's autograd wants: those of the arguments that track one.
fn tracking(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Want {
    (
        x.track_op(),
        w.track_op(),
        bias.is_some_and(Tensor::track_op),
    )
}

impl RecordedConv {
    fn out_shape(&self) -> Shape {
        let d = self.dims;
        Shape::from((d.batch, d.seqlen, d.dim))
    }

    fn cpu(&self, x: CpuArg, w: CpuArg, bias: Option<CpuArg>) -> Result<(CpuStorage, Shape)> {
        if wide(x.0.dtype()) {
            self.cpu_in::<f64>(x, w, bias)
        } else {
            self.cpu_in::<f32>(x, w, bias)
        }
    }

    fn cpu_in<T: Real>(
        &self,
        (x_s, x_l): CpuArg,
        (w_s, w_l): CpuArg,
        bias: Option<CpuArg>,
    ) -> Result<(CpuStorage, Shape)> {
        let x = view::<T>(OP, "x", x_s, x_l)?;
        let w = view::<T>(OP, "weight", w_s, w_l)?;
        let bias = match bias {
            Some((b_s, b_l)) => view::<T>(OP, "bias", b_s, b_l)?.into_owned(),
            None => vec![T::zero(); self.dims.dim],
        };
        let held = Held::new(&self.state);
        let state = held.view::<T>(OP, "initial_state")?;
        let y = cpu::prefill(&x, &w, &state, &bias, self.silu, self.dims).0;
        Ok((to_storage(y, x_s.dtype())?, self.out_shape()))
    }

    #[cfg(feature = "cuda")]
    fn cuda(
        &self,
        x: super::cuda::Input,
        w: super::cuda::Input,
        bias: Option<super::cuda::Input>,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let held = crate::cuda::Held::new(&self.state);
        let state = (held.cuda(OP, "initial_state")?, held.layout);
        let conv = super::cuda::Conv {
            silu: self.silu,
            dims: self.dims,
            split: &[self.dims.dim],
            packed: None,
        };
        let (ys, _) = super::cuda::causal_conv1d(&conv, x, w, bias, state)?;
        match ys.into_iter().next() {
            Some(y) => Ok((y, self.out_shape())),
            None => candle_core::bail!("{OP}: no output"),
        }
    }

    /// The gradients for the output gradient given as its pieces `dy [B,L,split[k]]`, cut by
    /// channels (one piece: all of dy).
    fn grads(
        &self,
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
        dy: &[Tensor],
        want: Want,
    ) -> Result<Grads> {
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            return self.cuda_grads(x, w, bias, dy, want);
        }
        let dy = Tensor::cat(dy, 2)?;
        if wide(x.dtype()) {
            self.grads_in::<f64>(x, w, bias, &dy, want)
        } else {
            self.grads_in::<f32>(x, w, bias, &dy, want)
        }
    }

    fn grads_in<T: Real>(
        &self,
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
        dy: &Tensor,
        want: Want,
    ) -> Result<Grads> {
        let dyv = host::<T>(OP, "output gradient", dy)?;
        let xv = host::<T>(OP, "x", x)?;
        let wv = host::<T>(OP, "weight", w)?;
        let state = host::<T>(OP, "initial_state", &self.state)?;
        let bv = match bias {
            Some(b) => host::<T>(OP, "bias", b)?,
            None => vec![T::zero(); self.dims.dim],
        };
        let g = cpu::backward(&xv, &wv, &state, &bv, &dyv, self.silu, self.dims);
        let dbias = match bias.filter(|_| want.2) {
            Some(b) => Some(values_like(g.dbias, b)?),
            None => None,
        };
        let dx = want.0.then(|| values_like(g.dx, x)).transpose()?;
        let dw = want.1.then(|| values_like(g.dw, w)).transpose()?;
        Ok((dx, dw, dbias))
    }
}

#[cfg(feature = "cuda")]
impl RecordedConv {
    fn cuda_grads(
        &self,
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
        dy: &[Tensor],
        want: Want,
    ) -> Result<Grads> {
        let g = self.cuda_launch(x, w, bias, dy, None)?;
        self.cuda_finish(g, x, w, bias, want)
    }

    /// The backward's kernel, dx written to `dx_into` when given.
    fn cuda_launch(
        &self,
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
        dy: &[Tensor],
        dx_into: Option<crate::cuda::Dest>,
    ) -> Result<super::cuda::ConvGrads> {
        use crate::cuda::Held;
        let dy = dy
            .iter()
            .map(|t| t.contiguous())
            .collect::<Result<Vec<_>>>()?;
        let split = dy.iter().map(|t| t.dim(2)).collect::<Result<Vec<_>>>()?;
        let [xh, wh, sh] = [x, w, &self.state].map(Held::new);
        let dyh = dy.iter().map(Held::new).collect::<Vec<_>>();
        let dy_args = dyh
            .iter()
            .map(|h| h.arg(OP, "output gradient"))
            .collect::<Result<Vec<_>>>()?;
        let bh = bias.map(Held::new);
        super::cuda::causal_conv1d_bwd(
            (self.silu, self.dims),
            xh.arg(OP, "x")?,
            wh.arg(OP, "weight")?,
            bh.as_ref().map(|h| h.arg(OP, "bias")).transpose()?,
            sh.arg(OP, "initial_state")?,
            (&dy_args, &split),
            dx_into,
        )
    }

    /// The gradients from the kernel's outputs: dx (unless written elsewhere) and the sums of
    /// the programs' rows for dweight and dbias.
    fn cuda_finish(
        &self,
        g: super::cuda::ConvGrads,
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
        want: Want,
    ) -> Result<Grads> {
        use crate::cuda::tensor;
        let ConvDims { dim, width, .. } = self.dims;
        let sums = tensor(g.parts, (g.programs, (width + 1) * dim)).sum(0)?;
        let dx = g.dx.filter(|_| want.0).map(|s| tensor(s, x.shape()));
        let dw = if want.1 {
            let taps = sums.narrow(0, 0, width * dim)?.reshape((width, dim))?;
            Some(taps.t()?.to_dtype(w.dtype())?.contiguous()?)
        } else {
            None
        };
        let dbias = match bias.filter(|_| want.2) {
            Some(b) => Some(sums.narrow(0, width * dim, dim)?.to_dtype(b.dtype())?),
            None => None,
        };
        Ok((dx, dw, dbias))
    }
}

/// The conv's CUDA backward, in place on the buffer that takes dx.
#[cfg(feature = "cuda")]
struct BackwardInto<'a> {
    args: &'a Args,
    offset: usize,
    done: std::sync::Mutex<Option<super::cuda::ConvGrads>>,
}

#[cfg(feature = "cuda")]
impl candle_core::InplaceOp1 for BackwardInto<'_> {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> Result<()> {
        candle_core::bail!("{OP}: the in-place backward runs on CUDA")
    }

    fn cuda_fwd(&self, s: &mut candle_core::CudaStorage, l: &Layout) -> Result<()> {
        use crate::cuda::{dest, written};
        let stream = s.device.cuda_stream();
        let at = dest(OP, "dx_buffer", (s, l), self.offset, &stream)?;
        let a = self.args;
        let g = a
            .conv
            .cuda_launch(&a.x, &a.w, a.bias.as_ref(), &a.dy, Some(at))?;
        written(s, &stream)?;
        match self.done.lock() {
            Ok(mut d) => *d = Some(g),
            Err(_) => candle_core::bail!("{OP}: state poisoned"),
        }
        Ok(())
    }
}

impl CustomOp3 for RecordedConv {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(
        &self,
        x_s: &CpuStorage,
        x_l: &Layout,
        w_s: &CpuStorage,
        w_l: &Layout,
        b_s: &CpuStorage,
        b_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.cpu((x_s, x_l), (w_s, w_l), Some((b_s, b_l)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x_s: &candle_core::CudaStorage,
        x_l: &Layout,
        w_s: &candle_core::CudaStorage,
        w_l: &Layout,
        b_s: &candle_core::CudaStorage,
        b_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.cuda((x_s, x_l), (w_s, w_l), Some((b_s, b_l)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        bias: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<Grads> {
        let dy = std::slice::from_ref(dy);
        self.grads(x, w, Some(bias), dy, tracking(x, w, Some(bias)))
    }
}

impl CustomOp2 for RecordedConv {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(
        &self,
        x_s: &CpuStorage,
        x_l: &Layout,
        w_s: &CpuStorage,
        w_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.cpu((x_s, x_l), (w_s, w_l), None)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x_s: &candle_core::CudaStorage,
        x_l: &Layout,
        w_s: &candle_core::CudaStorage,
        w_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.cuda((x_s, x_l), (w_s, w_l), None)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dy = std::slice::from_ref(dy);
        let (dx, dw, _) = self.grads(x, w, None, dy, tracking(x, w, None))?;
        Ok((dx, dw))
    }
}

/// The conv of `x [B,L,D]` (checked by the caller) as a recorded op: returns the output pieces of
/// `split` channels and the new state.
pub(super) fn causal_conv1d_recorded(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    state: &Tensor,
    (silu, dims): (bool, ConvDims),
    split: &[usize],
) -> Result<(Vec<Tensor>, Tensor)> {
    let x = check::rows_view(x)?;
    let new_state = last_inputs(&x, state, dims)?;
    let conv = RecordedConv {
        state: state.detach(),
        silu,
        dims,
    };
    let weight = weight.contiguous()?;
    let y = match bias {
        Some(b) => x.apply_op3(&weight, &b.contiguous()?, conv)?,
        None => x.apply_op2(&weight, conv)?,
    };
    let mut start = 0;
    let mut pieces = Vec::with_capacity(split.len());
    for &width in split {
        pieces.push(y.narrow(2, start, width)?.contiguous()?);
        start += width;
    }
    Ok((pieces, new_state))
}

/// The new state `[B,D,K]`: the last K entries of `u` (the state, then x) channels first, cut
/// from detached tensors.
fn last_inputs(x: &Tensor, state: &Tensor, dims: ConvDims) -> Result<Tensor> {
    let ConvDims { seqlen, width, .. } = dims;
    let from_x = seqlen.min(width);
    let tail = x
        .detach()
        .narrow(1, seqlen - from_x, from_x)?
        .transpose(1, 2)?;
    let new_state = if from_x < width {
        let kept = state.detach().narrow(2, from_x, width - from_x)?;
        Tensor::cat(&[&kept, &tail], 2)?
    } else {
        tail
    };
    new_state.contiguous()
}

/// [`super::causal_conv1d_split_backward_into`] on checked arguments: dx written into columns
/// `offset..` of `buffer`; returns the weight's and the bias's gradients.
pub(super) fn backward_into(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    state: &Tensor,
    (silu, dims): (bool, ConvDims),
    dy: &[Tensor],
    (buffer, offset): (&Tensor, usize),
) -> Result<(Option<Tensor>, Option<Tensor>)> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        let args = Args::new(x, weight, bias, state, (silu, dims), dy)?;
        let into = BackwardInto {
            args: &args,
            offset,
            done: std::sync::Mutex::new(None),
        };
        buffer.inplace_op1(&into)?;
        let Ok(Some(g)) = into.done.into_inner() else {
            candle_core::bail!("{OP}: the backward kernel did not run")
        };
        let a = &args;
        let (_, dw, db) = a
            .conv
            .cuda_finish(g, &a.x, &a.w, a.bias.as_ref(), a.want(false))?;
        return Ok((dw, db));
    }
    let (dx, dw, db) = backward(x, weight, bias, state, (silu, dims), dy)?;
    match dx {
        Some(dx) => buffer.slice_set(&dx, dx.rank() - 1, offset)?,
        None => candle_core::bail!("{OP}: the backward returned no dx"),
    }
    Ok((dw, db))
}

/// [`super::causal_conv1d_split_backward`] on checked arguments: all three gradients.
pub(super) fn backward(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    state: &Tensor,
    (silu, dims): (bool, ConvDims),
    dy: &[Tensor],
) -> Result<Grads> {
    let a = Args::new(x, weight, bias, state, (silu, dims), dy)?;
    a.conv
        .grads(&a.x, &a.w, a.bias.as_ref(), &a.dy, a.want(true))
}

/// The backward's arguments, detached and laid out as the kernels read them: x's rows may stay a
/// slice, the rest contiguous.
struct Args {
    conv: RecordedConv,
    x: Tensor,
    w: Tensor,
    bias: Option<Tensor>,
    dy: Vec<Tensor>,
}

impl Args {
    fn new(
        x: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
        state: &Tensor,
        (silu, dims): (bool, ConvDims),
        dy: &[Tensor],
    ) -> Result<Self> {
        Ok(Self {
            conv: RecordedConv {
                state: state.detach(),
                silu,
                dims,
            },
            x: check::rows_view(&x.detach())?,
            w: weight.detach().contiguous()?,
            bias: bias.map(|b| b.detach().contiguous()).transpose()?,
            dy: dy
                .iter()
                .map(|t| t.detach().contiguous())
                .collect::<Result<Vec<_>>>()?,
        })
    }

    /// The weight's and the bias's gradients, and dx when `dx`.
    fn want(&self, dx: bool) -> Want {
        (dx, true, self.bias.is_some())
    }
}
