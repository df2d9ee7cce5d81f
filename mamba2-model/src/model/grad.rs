//! The blocks' training forward, from the embedding's output to the final norm's, as one recorded
//! op with its backward written out:
//!
//! ```text
//! out = norm_f(blocks(h₀))         h₀ [B,L,d_model] (the embedding's rows), out like h₀
//! w   = [norm₀ | mixer₀'s w | norm₁ | mixer₁'s w | … | norm_f]    flat, the model dtype
//! p   = [mixer₀'s p | mixer₁'s p | …]                            flat, f32
//! ```
//!
//! Recorded block by block, each block's residual add and norm are two ops and its mixer one
//! (`mixer/grad.rs`): the residual stream, the hidden rows and the norm's output each receive
//! their gradients through candle, which adds every one into a zeroed buffer of its own and casts
//! between the f32 residual and the model dtype on the way. Here the backward carries the
//! residual stream's gradient `g` itself, in f32, from the last block to the first:
//!
//! ```text
//! s_i = h_i + s_{i−1}  (s_{−1} = 0),  n_i = rms_norm(s_i)·norm_i,  h_{i+1} = mixer_i(n_i)
//! g = d s_last                               (from norm_f's backward)
//! for i = last..0:  dn_i = mixer_i's backward(d h_{i+1} = g);  g += rms_norm's backward(s_i, dn_i)
//! d h₀ = g
//! ```
//!
//! (`add_rms_norm_backward` makes each step of g in one pass, with g's copy in the model dtype
//! that the next mixer's backward reads.)
//!
//! so that candle accumulates one gradient per argument: h₀'s, and the packed weights', which it
//! cuts back to each weight (`cat`'s backward).

use candle_core::{Result, Tensor};
use mamba2_kernels::{add_rms_norm, add_rms_norm_backward};

use super::Model;
use crate::mixer::{packed_params, packed_weights, Fused, MixerGrad, Recorded};

/// One block's part of the forward, kept for the backward.
struct Kept {
    /// The new residual `s_i` and the norm's output `n_i` (the mixer's input).
    sum: Tensor,
    normed: Tensor,
    /// The block's norm weight, detached.
    norm: Tensor,
    mixer: MixerGrad,
}

/// The recorded blocks on `(h₀, w, p)`.
struct BlocksGrad {
    blocks: Vec<Kept>,
    /// The final residual and norm_f's weight, detached.
    sum_f: Tensor,
    norm_f: Tensor,
    /// The final norm's output, which the op returns as its own.
    out: Tensor,
    eps: f64,
}

impl Model {
    /// The final norm's output of the training forward from the embedding's rows `h0
    /// [B,L,d_model]`, as one recorded op (the module doc): the values and the gradients of the
    /// blocks recorded one by one.
    pub(crate) fn blocks_train_fused(&self, h0: &Tensor) -> Result<Tensor> {
        let (eps, fp32) = (self.config.norm_eps, self.config.residual_in_fp32);
        let mut h = h0.detach();
        let mut residual: Option<Tensor> = None;
        let mut blocks = Vec::with_capacity(self.blocks.len());
        let (mut w, mut p) = (Vec::new(), Vec::new());
        for block in &self.blocks {
            let norm = block.norm.detach();
            let (normed, sum) = add_rms_norm(&h, residual.as_ref(), &norm, eps, fp32)?;
            let mixer = block.mixer.fused_forward(&normed)?;
            h = mixer.out().clone();
            residual = Some(sum.clone());
            blocks.push(Kept {
                sum,
                normed,
                norm,
                mixer,
            });
            w.push(block.norm.flatten_all()?);
            w.push(packed_weights(&block.mixer)?);
            p.push(packed_params(&block.mixer)?);
        }
        let norm_f = self.norm_f.detach();
        let (out, sum_f) = add_rms_norm(&h, residual.as_ref(), &norm_f, eps, fp32)?;
        w.push(self.norm_f.flatten_all()?);
        let op = BlocksGrad {
            blocks,
            sum_f,
            norm_f,
            out,
            eps,
        };
        Recorded(op).apply(h0, &Tensor::cat(&w, 0)?, &Tensor::cat(&p, 0)?)
    }
}

impl Fused for BlocksGrad {
    const NAME: &'static str = "blocks";

    fn out(&self) -> &Tensor {
        &self.out
    }

    /// `(dh₀, dw, dp)` for the output gradient `dout` (the module doc).
    fn grads(&self, h0: &Tensor, dout: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let last = add_rms_norm_backward(&self.sum_f, &self.norm_f, self.eps, dout, None)?;
        let (mut g, mut dh) = (last.residual, last.x);
        let mut dw = vec![last.weight.flatten_all()?];
        let mut dp = Vec::with_capacity(self.blocks.len());
        for k in self.blocks.iter().rev() {
            let (dn, dw_mixer, dp_mixer) = k.mixer.grads(&k.normed, &dh)?;
            let step = add_rms_norm_backward(&k.sum, &k.norm, self.eps, &dn, Some(&g))?;
            (g, dh) = (step.residual, step.x);
            dw.push(dw_mixer);
            dw.push(step.weight.flatten_all()?);
            dp.push(dp_mixer);
        }
        dw.reverse();
        dp.reverse();
        Ok((
            dh.to_dtype(h0.dtype())?,
            Tensor::cat(&dw, 0)?,
            Tensor::cat(&dp, 0)?,
        ))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Var};
    use candle_nn::{VarBuilder, VarMap};

    use super::*;
    use crate::Config;

    /// Fixed values of `shape` spread over about ±1.7·scale (the same on every run).
    fn noise(shape: &[usize], scale: f32, seed: u64, dev: &Device) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let step = 0.618_034 * (seed as f64 + 1.0) + 0.1;
        let v = (0..n)
            .map(|i| (scale as f64 * 1.7 * ((i as f64 + 1.0) * step).sin()) as f32)
            .collect::<Vec<_>>();
        Tensor::from_vec(v, shape, dev)
    }

    /// A three-block model on fixed pseudo-random `Var`s: two groups, every bias, a chunk shorter than the
    /// sequence.
    fn model(dtype: DType, residual_in_fp32: bool) -> Result<(Model, VarMap)> {
        let cfg = Config::from_json(&format!(
            r#"{{"model_type": "mamba2", "hidden_size": 24, "num_hidden_layers": 3,
                "num_heads": 6, "head_dim": 8, "state_size": 8, "n_groups": 2, "expand": 2,
                "conv_kernel": 4, "chunk_size": 16, "vocab_size": 16, "use_bias": true,
                "use_conv_bias": true, "layer_norm_epsilon": 1e-5,
                "residual_in_fp32": {residual_in_fp32}}}"#
        ))?;
        let dev = Device::Cpu;
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, dtype, &dev);
        Model::new(&cfg, vb.clone())?;
        let data = varmap
            .data()
            .lock()
            .map_err(|e| candle_core::Error::msg(e.to_string()))?;
        for (name, var) in data.iter() {
            // The values follow from the name, so that models of two dtypes hold the same ones.
            let i = name
                .bytes()
                .fold(7u64, |h, b| h.wrapping_mul(31).wrapping_add(b as u64))
                % 1000;
            let (mean, scale) = if name.contains("norm") {
                (1.0, 0.2)
            } else if name.contains("A_log") {
                (0.0, 1.0)
            } else {
                (0.0, 0.5)
            };
            let r = noise(var.shape().dims(), scale, i, &dev)?.to_dtype(var.dtype())?;
            var.set(&(r + mean)?)?;
        }
        drop(data);
        Ok((Model::new(&cfg, vb)?, varmap))
    }

    /// A run's output and its named gradients.
    type Run = (Tensor, Vec<(String, Tensor)>);

    /// The gradients of `Σ out·probe` for h₀ and every block and norm_f weight (by name), through
    /// the fused op or the blocks recorded one by one, and the output.
    fn grads(m: &Model, varmap: &VarMap, h0: &Tensor, probe: &Tensor, fused: bool) -> Result<Run> {
        let h0 = Var::from_tensor(&h0.to_dtype(m.dtype)?)?;
        let out = if fused {
            m.blocks_train_fused(&h0)?
        } else {
            m.blocks_train_composed(&h0)?
        };
        let g = (out.to_dtype(DType::F32)? * probe)?.sum_all()?.backward()?;
        let mut vars = vec![("h0".to_string(), h0.as_tensor().clone())];
        let data = varmap
            .data()
            .lock()
            .map_err(|e| candle_core::Error::msg(e.to_string()))?;
        vars.extend(
            data.iter()
                .filter(|(n, _)| n.contains("layers") || n.contains("norm_f"))
                .map(|(n, v)| (n.clone(), v.as_tensor().clone())),
        );
        assert_eq!(vars.len(), 1 + 3 * 11 + 1, "h0, 11 weights a block, norm_f");
        let mut named = Vec::new();
        for (name, t) in vars {
            match g.get(&t) {
                Some(d) => named.push((name, d.to_dtype(DType::F32)?)),
                None => panic!("{name}: no gradient (fused: {fused})"),
            }
        }
        named.sort_by(|a, b| a.0.cmp(&b.0));
        Ok((out.to_dtype(DType::F32)?, named))
    }

    /// The outputs and gradients (as [`grads`]) of the fused op and of the blocks recorded one by
    /// one, on the same model and inputs.
    #[allow(clippy::type_complexity)]
    fn both_paths(
        dtype: DType,
        residual_in_fp32: bool,
    ) -> Result<(
        (Tensor, Vec<(String, Tensor)>),
        (Tensor, Vec<(String, Tensor)>),
    )> {
        let (m, varmap) = model(dtype, residual_in_fp32)?;
        let dev = Device::Cpu;
        let h0 = noise(&[2, 37, 24], 1.0, 100, &dev)?;
        let probe = noise(&[2, 37, 24], 1.0, 101, &dev)?;
        Ok((
            grads(&m, &varmap, &h0, &probe, true)?,
            grads(&m, &varmap, &h0, &probe, false)?,
        ))
    }

    /// `max |a − b| / max |b|`.
    fn rel(a: &Tensor, b: &Tensor) -> Result<f32> {
        let scale = b.abs()?.max_all()?.to_scalar::<f32>()?.max(1e-6);
        (a - b)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()
            .map(|e| e / scale)
    }

    /// `‖a − b‖ / ‖b‖`.
    fn rel_l2(a: &Tensor, b: &Tensor) -> Result<f32> {
        let norm = |t: &Tensor| -> Result<f32> { t.sqr()?.sum_all()?.sqrt()?.to_scalar::<f32>() };
        Ok(norm(&(a - b)?)? / norm(b)?.max(1e-12))
    }

    /// In f32 the fused op against the blocks recorded one by one: the output and every gradient
    /// within `tol` of the largest value.
    fn check_f32(residual_in_fp32: bool, tol: f32) -> Result<()> {
        let ((yf, gf), (yc, gc)) = both_paths(DType::F32, residual_in_fp32)?;
        let diff = rel(&yf, &yc)?;
        assert!(diff < tol, "outputs differ by {diff}");
        for ((name, a), (_, b)) in gf.iter().zip(&gc) {
            let err = rel(a, b)?;
            assert!(
                err < tol,
                "{name}: gradients differ by {err} (relative to the largest)"
            );
        }
        Ok(())
    }

    #[test]
    fn the_fused_op_has_the_composed_values_and_gradients() -> Result<()> {
        // The mixers' fused backwards sum in another order than the composed ops (1e-5 apart in
        // one block, `mixer/grad.rs`), three blocks deep.
        check_f32(true, 1e-4)?;
        check_f32(false, 1e-4)
    }

    /// In bf16 the two paths round at different places (the fused one carries the residual
    /// stream's gradient in f32, the composed one rounds each block's to bf16), three blocks
    /// deep, and a sum over every position with terms of both signs (a bias's, D's, A_log's
    /// gradient) keeps few correct bits in either: the outputs agree within 2e-2 and all the
    /// gradients together within 4e-2 (relative, L2; 2.0e-2 seen), each within 0.15 (3.5e-2 seen).
    #[test]
    fn the_fused_op_in_bf16_has_the_composed_values_and_gradients() -> Result<()> {
        let ((yf, gf), (yc, gc)) = both_paths(DType::BF16, true)?;
        let diff = rel(&yf, &yc)?;
        assert!(diff < 2e-2, "outputs differ by {diff}");
        let flat = |g: &[(String, Tensor)]| -> Result<Tensor> {
            let all = g
                .iter()
                .map(|(_, t)| t.flatten_all())
                .collect::<Result<Vec<_>>>()?;
            Tensor::cat(&all, 0)
        };
        let all = rel_l2(&flat(&gf)?, &flat(&gc)?)?;
        assert!(all < 4e-2, "the gradients differ by {all} (relative, L2)");
        for ((name, a), (_, b)) in gf.iter().zip(&gc) {
            let err = rel_l2(a, b)?;
            assert!(
                err < 0.15,
                "{name}: gradients differ by {err} (relative, L2)"
            );
        }
        Ok(())
    }
}
