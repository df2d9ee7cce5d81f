//! The mixer's training forward as one recorded op, with its backward written out.
//!
//! ```text
//! out = mixer(u; w)               u [B,L,d_model], out like u
//! w   = [in_proj.w | in_proj.b | conv.w | conv.b | norm.w | out_proj.w | out_proj.b]   flat, the model dtype
//! p   = [A | dt_bias | D]         flat, f32
//! ```
//!
//! Composed of candle ops, the mixer records a dozen nodes per layer whose gradients are as large
//! as its activations, and candle's backward adds each into a zeroed buffer of its own: on CUDA
//! those adds, not the kernels, were most of a training step. Recorded as one op on `(u, w, p)`,
//! the forward is the inference path's on detached tensors (its intermediates kept for the
//! backward), and the backward runs the ops' own backwards in sequence:
//!
//! ```text
//! dyn = dout · W_out,  dW_out = doutᵀ · yn                     yn = gated_rms_norm(y, z)
//! (dy, dz, dnorm.w) = gated_rms_norm_backward(y, z, dyn)
//! (dx, dB, dC, ddt, dA, ddt_bias, dD) = ssd_backward_saved(states; x, dt, A, B, C, dy)
//! (dxBC_in, dconv.w, dconv.b) = causal_conv1d_split_backward(xBC_in, [dx, dB, dC])
//! du = [dz | dxBC_in | ddt] · W_in,  dW_in = [dz | dxBC_in | ddt]ᵀ · u
//! ```
//!
//! (dz and dxBC_in are written in place into one `[dz | dxBC_in | ddt]` buffer, the `_into`
//! forms of the backwards; `states` are the scan's chunk states, which the forward keeps.)
//!
//! so that candle accumulates one gradient per argument: u's, and the packed weights', which it
//! cuts back to each weight (`cat`'s backward).
//!
//! in_proj's weight is held with zero rows appended up to a multiple of [`ROW_ALIGN`], so that
//! the rows of in_proj's output and of its gradient start 16-byte aligned: cuBLAS runs products on
//! rows of any other width on its older, alignment-2 kernels, about 2.5× slower on the H200.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp3, DType, Layout, Result, Shape, Storage, Tensor, D};
use candle_nn::Linear;
use mamba2_kernels::{
    causal_conv1d_split, causal_conv1d_split_backward_into, gated_rms_norm,
    gated_rms_norm_backward_into, ssd_backward_saved, ssd_saving, ConvOptions, DtOptions,
    SsdOptions, SsdSaved,
};

use super::{rows_linear, Mixer};

/// in_proj's output width is padded to a multiple of this many elements (16 bytes in bf16).
const ROW_ALIGN: usize = 8;

/// The mixer's weights, detached (the forward's and the backward's), and which optional ones
/// exist.
struct Weights {
    /// in_proj's weight and bias with zero rows appended (the module doc).
    w_in: Tensor,
    b_in: Option<Tensor>,
    conv_w: Tensor,
    conv_b: Option<Tensor>,
    norm: Tensor,
    w_out: Tensor,
    b_out: Option<Tensor>,
    a: Tensor,
    dt_bias: Tensor,
    d: Tensor,
}

/// What the forward keeps for the backward.
struct Kept {
    /// in_proj's output `[B,L,in_dim + pad]`: z, xBC before the conv, raw dt, zero columns.
    zxbcdt: Tensor,
    /// The conv's output cut into x `[B,L,H,P]`, B and C `[B,L,G,N]`.
    x: Tensor,
    bm: Tensor,
    cm: Tensor,
    /// The scan's output `[B,L,d_inner]` and the gated norm's.
    y: Tensor,
    yn: Tensor,
    /// The scan's chunk states, until the backward takes them.
    scan: Mutex<Option<SsdSaved>>,
}

/// The recorded mixer on `(u, w, p)`; also one block's part of the recorded blocks
/// (`model/grad.rs`).
pub(crate) struct MixerGrad {
    weights: Weights,
    kept: Kept,
    /// The forward's output, which the op returns as its own.
    out: Tensor,
    /// (d_inner, H, P, G·N).
    sizes: (usize, usize, usize, usize),
    /// The scan's chunk and dt limit, the norm's group and eps.
    chunk: usize,
    dt_limit: (f32, f32),
    group_size: usize,
    eps: f64,
}

impl Mixer {
    /// [`Mixer::forward_train`] as one recorded op (the module doc): the same values, and the
    /// same gradients for `u` and every weight.
    pub(crate) fn forward_train_fused(&self, u: &Tensor) -> Result<Tensor> {
        let op = self.fused_forward(u)?;
        Recorded(op).apply(u, &packed_weights(self)?, &packed_params(self)?)
    }

    /// The fused op's forward on `u` and the weights, detached: its output and all its backward
    /// needs.
    pub(crate) fn fused_forward(&self, u: &Tensor) -> Result<MixerGrad> {
        let (b, l, _) = u.dims3()?;
        let (di, h, p, gn) = self.sizes();
        let detached = |t: &Tensor| t.detach();
        let weights = Weights {
            w_in: padded_rows(self.in_proj.weight())?,
            b_in: self.in_proj.bias().map(padded_rows).transpose()?,
            conv_w: detached(&self.conv_weight),
            conv_b: self.conv_bias.as_ref().map(detached),
            norm: detached(&self.norm),
            w_out: detached(self.out_proj.weight()),
            b_out: self.out_proj.bias().map(detached),
            a: detached(&self.a),
            dt_bias: detached(&self.dt_bias),
            d: detached(&self.d),
        };
        let w = &weights;
        let ud = u.detach();
        let zxbcdt = rows_linear(&Linear::new(w.w_in.clone(), w.b_in.clone()), &ud)?;
        let (z, xbc, dt) = self.split(&zxbcdt)?;
        let conv_opts = ConvOptions {
            bias: w.conv_b.as_ref(),
            silu: true,
        };
        let (parts, _) = causal_conv1d_split(&xbc, &w.conv_w, None, &conv_opts, &[di, gn, gn])?;
        let groups = (b, l, self.ngroups, self.d_state);
        let x = parts[0].reshape((b, l, h, p))?;
        let bm = parts[1].reshape(groups)?;
        let cm = parts[2].reshape(groups)?;
        let (chunk, dt_limit) = (self.chunk_for(u), self.dt_limit);
        let opts = scan_options(w, chunk, dt_limit);
        let (y, _, saved) = ssd_saving(&x, &dt, &w.a, &bm, &cm, &opts)?;
        let y = y.reshape((b, l, di))?;
        let yn = gated_rms_norm(&y, &z, &w.norm, self.group_size, self.eps)?;
        let out = rows_linear(&Linear::new(w.w_out.clone(), w.b_out.clone()), &yn)?;
        Ok(MixerGrad {
            kept: Kept {
                zxbcdt,
                x,
                bm,
                cm,
                y,
                yn,
                scan: Mutex::new(Some(saved)),
            },
            out,
            sizes: (di, h, p, gn),
            chunk,
            dt_limit,
            group_size: self.group_size,
            eps: self.eps,
            weights,
        })
    }
}

/// `t [R, ..]` detached, with zero rows appended up to a multiple of [`ROW_ALIGN`] rows.
fn padded_rows(t: &Tensor) -> Result<Tensor> {
    let t = t.detach();
    let rows = t.dim(0)?;
    let pad = rows.next_multiple_of(ROW_ALIGN) - rows;
    if pad == 0 {
        return Ok(t);
    }
    let mut dims = t.dims().to_vec();
    dims[0] = pad;
    Tensor::cat(&[&t, &Tensor::zeros(dims, t.dtype(), t.device())?], 0)
}

/// The scan's options on the held weights: from zero states, f32 states.
fn scan_options(w: &Weights, chunk: usize, limit: (f32, f32)) -> SsdOptions<'_> {
    SsdOptions {
        chunk_size: chunk,
        dt: DtOptions {
            bias: Some(&w.dt_bias),
            softplus: true,
            limit,
        },
        d: Some(&w.d),
        z: None,
        initial_state: None,
        state_dtype: DType::F32,
    }
}

/// The mixer's (recording) weights flattened into one tensor, in the module doc's order.
pub(crate) fn packed_weights(m: &Mixer) -> Result<Tensor> {
    let pieces = [
        Some(m.in_proj.weight()),
        m.in_proj.bias(),
        Some(&m.conv_weight),
        m.conv_bias.as_ref(),
        Some(&m.norm),
        Some(m.out_proj.weight()),
        m.out_proj.bias(),
    ];
    let flat = pieces
        .into_iter()
        .flatten()
        .map(Tensor::flatten_all)
        .collect::<Result<Vec<_>>>()?;
    Tensor::cat(&flat, 0)
}

/// The mixer's f32 parameters `[A | dt_bias | D]` flattened into one tensor.
pub(crate) fn packed_params(m: &Mixer) -> Result<Tensor> {
    Tensor::cat(&[&m.a, &m.dt_bias, &m.d.flatten_all()?], 0)
}

/// A training forward computed outside candle's graph (on detached tensors, keeping what its
/// backward needs), recorded as one op on `(input, packed weights, packed f32 parameters)`.
pub(crate) trait Fused: Send + Sync + 'static {
    /// The op's name in candle's graph.
    const NAME: &'static str;
    /// The forward's output.
    fn out(&self) -> &Tensor;
    /// `(d input, d packed weights, d packed parameters)` for the output gradient `dout`.
    fn grads(&self, input: &Tensor, dout: &Tensor) -> Result<(Tensor, Tensor, Tensor)>;
}

/// A [`Fused`] forward as candle's op: its value is a copy of the forward's output (an op's
/// result is a tensor of its own), its backward the fused one.
pub(crate) struct Recorded<F>(pub F);

impl<F: Fused> Recorded<F> {
    /// The op on `input`, the packed weights `w` and the packed parameters `p`.
    pub(crate) fn apply(self, input: &Tensor, w: &Tensor, p: &Tensor) -> Result<Tensor> {
        input.contiguous()?.apply_op3(w, p, self)
    }

    fn output(&self) -> Result<Storage> {
        let out = self.0.out();
        let (s, l) = out.storage_and_layout();
        match &*s {
            Storage::Cpu(c) => Ok(Storage::Cpu(c.try_clone(l)?)),
            #[cfg(feature = "cuda")]
            Storage::Cuda(c) => Ok(Storage::Cuda(c.try_clone(l)?)),
            _ => bail!(
                "{}: the fused training forward runs on the CPU or CUDA",
                F::NAME
            ),
        }
    }
}

impl<F: Fused> CustomOp3 for Recorded<F> {
    fn name(&self) -> &'static str {
        F::NAME
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
        match self.output()? {
            Storage::Cpu(s) => Ok((s, self.0.out().shape().clone())),
            _ => bail!("{}: the forward's output is not on the CPU", F::NAME),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        match self.output()? {
            Storage::Cuda(s) => Ok((s, self.0.out().shape().clone())),
            _ => bail!("{}: the forward's output is not on CUDA", F::NAME),
        }
    }

    fn bwd(
        &self,
        input: &Tensor,
        _w: &Tensor,
        _p: &Tensor,
        _out: &Tensor,
        dout: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (d_input, dw, dp) = self.0.grads(&input.detach(), &dout.detach())?;
        Ok((Some(d_input), Some(dw), Some(dp)))
    }
}

impl Fused for MixerGrad {
    const NAME: &'static str = "mixer";

    fn out(&self) -> &Tensor {
        &self.out
    }

    /// `(du, dw, dp)` for the output gradient `dout` (the module doc): du in u's dtype, dw
    /// flat in the weights' order, dp flat f32.
    fn grads(&self, u: &Tensor, dout: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let (w, k) = (&self.weights, &self.kept);
        let (b, l, dm) = u.dims3()?;
        let (di, h, p, gn) = self.sizes;
        let rows = b * l;
        let dtype = u.dtype();
        let dout = dout.to_dtype(dtype)?.reshape((rows, dm))?;
        let dyn_ = dout.matmul(&w.w_out)?;
        let dw_out = dout.t()?.matmul(&k.yn.reshape((rows, di))?)?;
        let db_out = w.b_out.as_ref().map(|_| dout.sum(0)).transpose()?;
        // in_proj's output gradient [dz | dxBC_in | ddt | 0]: the norm's and the conv's
        // backwards write their pieces into it in place.
        let width = w.w_in.dim(0)?;
        let dproj = Tensor::zeros((b, l, width), dtype, u.device())?;
        let z = k.zxbcdt.narrow(D::Minus1, 0, di)?;
        let (dy, dnorm) = gated_rms_norm_backward_into(
            &k.y,
            &z,
            &w.norm,
            (self.group_size, self.eps),
            &dyn_.reshape((b, l, di))?,
            (&dproj, 0),
        )?;
        let dt = k.zxbcdt.narrow(D::Minus1, 2 * di + 2 * gn, h)?;
        let saved = match k.scan.lock() {
            Ok(mut slot) => slot.take().unwrap_or_default(),
            Err(_) => bail!("mixer: the scan's kept states are poisoned"),
        };
        let g = ssd_backward_saved(
            saved,
            &k.x,
            &dt,
            &w.a,
            &k.bm,
            &k.cm,
            &scan_options(w, self.chunk, self.dt_limit),
            &dy.reshape((b, l, h, p))?,
            None,
        )?;
        let dxbc = [
            g.x.reshape((b, l, di))?.to_dtype(dtype)?,
            g.b.reshape((b, l, gn))?.to_dtype(dtype)?,
            g.c.reshape((b, l, gn))?.to_dtype(dtype)?,
        ];
        let xbc = k.zxbcdt.narrow(D::Minus1, di, di + 2 * gn)?;
        let conv_opts = ConvOptions {
            bias: w.conv_b.as_ref(),
            silu: true,
        };
        let (dconv_w, dconv_b) = causal_conv1d_split_backward_into(
            &xbc,
            &w.conv_w,
            None,
            &conv_opts,
            &dxbc,
            (&dproj, di),
        )?;
        let in_dim = 2 * di + 2 * gn + h;
        dproj.slice_set(&g.dt.to_dtype(dtype)?, 2, 2 * di + 2 * gn)?;
        let dproj = dproj.reshape((rows, width))?;
        let du = dproj.matmul(&w.w_in)?.reshape((b, l, dm))?;
        let dw_in = dproj
            .t()?
            .matmul(&u.reshape((rows, dm))?)?
            .narrow(0, 0, in_dim)?;
        let db_in = w
            .b_in
            .as_ref()
            .map(|_| dproj.sum(0)?.narrow(0, 0, in_dim))
            .transpose()?;
        let pieces = [
            Some(dw_in),
            db_in,
            Some(dconv_w),
            w.conv_b.as_ref().and(dconv_b),
            Some(dnorm),
            Some(dw_out),
            db_out,
        ];
        let flat = pieces
            .into_iter()
            .flatten()
            .map(|t| t.to_dtype(dtype)?.flatten_all())
            .collect::<Result<Vec<_>>>()?;
        let dw = Tensor::cat(&flat, 0)?;
        let d = g.d.unwrap_or(w.d.zeros_like()?);
        let dp = Tensor::cat(
            &[
                g.a.to_dtype(DType::F32)?,
                g.dt_bias.to_dtype(DType::F32)?,
                d.to_dtype(DType::F32)?.flatten_all()?,
            ],
            0,
        )?;
        Ok((du, dw, dp))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};
    use candle_nn::{VarBuilder, VarMap};

    use super::*;
    use crate::Config;

    /// A mixer on random `Var`s: two groups, every bias, a chunk shorter than the sequence.
    fn mixer(dtype: DType) -> Result<(Mixer, VarMap)> {
        let cfg = Config::from_json(
            r#"{"model_type": "mamba2", "hidden_size": 24, "num_hidden_layers": 1,
                "num_heads": 6, "head_dim": 8, "state_size": 8, "n_groups": 2, "expand": 2,
                "conv_kernel": 4, "chunk_size": 16, "vocab_size": 16, "use_bias": true,
                "use_conv_bias": true, "layer_norm_epsilon": 1e-5}"#,
        )?;
        let dev = Device::Cpu;
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, dtype, &dev);
        Mixer::new(&cfg, vb.clone())?;
        let data = varmap
            .data()
            .lock()
            .map_err(|e| candle_core::Error::msg(e.to_string()))?;
        for (i, (name, var)) in data.iter().enumerate() {
            let scale = if name.contains("A_log") { 1.0 } else { 0.5 };
            let r = Tensor::randn(0f32, scale, var.shape(), &dev)?.to_dtype(var.dtype())?;
            var.set(&(r + 0.01 * i as f64)?)?;
        }
        drop(data);
        Ok((Mixer::new(&cfg, vb)?, varmap))
    }

    /// The fused op against the composed ops in `dtype`: outputs and every gradient within `tol`
    /// of the largest value.
    fn check(dtype: DType, tol: f32) -> Result<()> {
        let (m, varmap) = mixer(dtype)?;
        let dev = Device::Cpu;
        let u = Tensor::randn(0f32, 1.0, (2, 37, 24), &dev)?.to_dtype(dtype)?;
        let u = Var::from_tensor(&u)?;
        let probe = Tensor::randn(0f32, 1.0, (2, 37, 24), &dev)?.to_dtype(dtype)?;
        let fused = m.forward_train_fused(&u)?;
        let composed = m.run(&u, None, None)?.0;
        let rel = |a: &Tensor, b: &Tensor| -> Result<f32> {
            let (a, b) = (a.to_dtype(DType::F32)?, b.to_dtype(DType::F32)?);
            let scale = b.abs()?.max_all()?.to_scalar::<f32>()?.max(1e-6);
            Ok((a - b)?.abs()?.max_all()?.to_scalar::<f32>()? / scale)
        };
        let diff = rel(&fused, &composed)?;
        assert!(diff < tol, "{dtype:?}: outputs differ by {diff}");
        let gf = (fused * &probe)?.sum_all()?.backward()?;
        let gc = (composed * &probe)?.sum_all()?.backward()?;
        let mut vars = vec![("u".to_string(), u.as_tensor().clone())];
        let data = varmap
            .data()
            .lock()
            .map_err(|e| candle_core::Error::msg(e.to_string()))?;
        vars.extend(data.iter().map(|(n, v)| (n.clone(), v.as_tensor().clone())));
        assert_eq!(vars.len(), 11, "u and the mixer's 10 weights");
        for (name, t) in &vars {
            let (Some(a), Some(b)) = (gf.get(t), gc.get(t)) else {
                panic!("{name}: no gradient on one of the paths")
            };
            let err = rel(a, b)?;
            assert!(
                err < tol,
                "{dtype:?} {name}: gradients differ by {err} (relative to the largest)"
            );
        }
        Ok(())
    }

    #[test]
    fn the_fused_op_has_the_composed_values_and_gradients() -> Result<()> {
        check(DType::F32, 1e-5)?;
        // bf16 rounds the intermediates of the two paths at different places.
        check(DType::BF16, 2e-2)
    }
}
