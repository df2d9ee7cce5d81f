//! A Mamba-2 mixer of one's own, written from the public ops of `mamba2::kernels` and candle-nn's
//! `Linear`, checked against the model's `mamba2::model::Mixer` on the same random weights:
//!
//! ```text
//! [z | xBC | dt] = in_proj(u)                           u [B,L,d_model]
//! [x | B | C] = silu(causal_conv1d(xBC) + conv_bias)    x [B,L,H,P], B, C [B,L,G,N]
//! dt ← clamp(softplus(dt + dt_bias), dt_limit)          dt [B,L,H]
//! y = ssd(x, dt, A = −exp(A_log), B, C) + D·x           the SSM scan, chunked
//! out = out_proj(rmsnorm_per_group(y · silu(z)) · w)    groups of d_inner/G channels
//! ```
//!
//! `MyMixer` runs whole sequences from an empty state, as a candle `Module`. The check uses a
//! length that is not a multiple of either chunk length and two groups, and fails when the outputs
//! differ by more than 1e-5 (f32):
//!
//! ```sh
//! cargo run --release --example custom_block
//! ```

use std::collections::HashMap;

use anyhow::{bail, Result};
use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{linear_b, Linear, VarBuilder};
use mamba2::kernels::{
    causal_conv1d_split, gated_rms_norm, ssd, ConvOptions, DtOptions, SsdOptions,
};
use mamba2::model::{Config, LayerState, Mixer};

/// A Mamba-2 mixer, with the tensor names of mamba_ssm and HF checkpoints.
struct MyMixer {
    in_proj: Linear,
    /// `[conv_dim, d_conv]`, the stored `[conv_dim, 1, d_conv]` squeezed.
    conv_weight: Tensor,
    conv_bias: Option<Tensor>,
    /// `[H]` f32, `−exp(A_log)`.
    a: Tensor,
    d: Tensor,
    dt_bias: Tensor,
    norm: Tensor,
    out_proj: Linear,
    cfg: Config,
}

impl MyMixer {
    fn new(cfg: &Config, vb: VarBuilder) -> Result<Self> {
        let (di, h, conv_dim) = (cfg.d_inner(), cfg.nheads, cfg.conv_dim());
        let conv_weight = vb.get((conv_dim, 1, cfg.d_conv), "conv1d.weight")?;
        Ok(Self {
            in_proj: linear_b(cfg.d_model, cfg.in_proj_dim(), cfg.bias, vb.pp("in_proj"))?,
            conv_weight: conv_weight.squeeze(1)?,
            conv_bias: cfg
                .conv_bias
                .then(|| vb.get(conv_dim, "conv1d.bias"))
                .transpose()?,
            a: vb.get(h, "A_log")?.exp()?.neg()?,
            d: vb.get(h, "D")?,
            dt_bias: vb.get(h, "dt_bias")?,
            norm: vb.get(di, "norm.weight")?,
            out_proj: linear_b(di, cfg.d_model, cfg.bias, vb.pp("out_proj"))?,
            cfg: cfg.clone(),
        })
    }
}

impl Module for MyMixer {
    fn forward(&self, u: &Tensor) -> candle_core::Result<Tensor> {
        let c = &self.cfg;
        let (b, l, _) = u.dims3()?;
        let (di, h, g, n) = (c.d_inner(), c.nheads, c.ngroups, c.d_state);
        let zxbcdt = self.in_proj.forward(u)?;
        let z = zxbcdt.narrow(D::Minus1, 0, di)?;
        let xbc = zxbcdt.narrow(D::Minus1, di, di + 2 * g * n)?;
        let dt = zxbcdt.narrow(D::Minus1, 2 * di + 2 * g * n, h)?;
        let conv = ConvOptions {
            bias: self.conv_bias.as_ref(),
            silu: true,
        };
        let split = [di, g * n, g * n];
        let (xbc, _) = causal_conv1d_split(&xbc, &self.conv_weight, None, &conv, &split)?;
        let x = xbc[0].reshape((b, l, h, c.headdim))?;
        let bm = xbc[1].reshape((b, l, g, n))?;
        let cm = xbc[2].reshape((b, l, g, n))?;
        // The chunk length is free (a power of two ≥ 16): the result does not depend on it.
        let opts = SsdOptions {
            chunk_size: 64,
            dt: DtOptions {
                bias: Some(&self.dt_bias),
                softplus: true,
                limit: c.dt_limit,
            },
            d: Some(&self.d),
            ..Default::default()
        };
        let (y, _final_state) = ssd(&x, &dt, &self.a, &bm, &cm, &opts)?;
        let y = y.reshape((b, l, di))?;
        let y = gated_rms_norm(&y, &z, &self.norm, di / g, c.norm_eps)?;
        self.out_proj.forward(&y)
    }
}

fn main() -> Result<()> {
    let cfg = Config::from_json(
        r#"{"hidden_size": 64, "expand": 2, "num_heads": 8, "head_dim": 16, "state_size": 16,
            "n_groups": 2, "conv_kernel": 4, "chunk_size": 32, "time_step_limit": [0.0, 0.2],
            "num_hidden_layers": 1, "vocab_size": 16}"#,
    )?;
    let (dm, di, h, cd) = (cfg.d_model, cfg.d_inner(), cfg.nheads, cfg.conv_dim());
    let dev = Device::Cpu;
    let randn = |shape: &[usize], std: f64| Tensor::randn(0f32, std as f32, shape, &dev);
    let weights = [
        (
            "in_proj.weight",
            randn(&[cfg.in_proj_dim(), dm], (dm as f64).powf(-0.5)),
        ),
        ("conv1d.weight", randn(&[cd, 1, cfg.d_conv], 0.5)),
        ("conv1d.bias", randn(&[cd], 0.1)),
        ("A_log", Tensor::rand(0f32, 2.5, h, &dev)),
        ("D", randn(&[h], 1.0)),
        ("dt_bias", Tensor::rand(-4f32, -2., h, &dev)),
        ("norm.weight", Tensor::rand(0.5f32, 1.5, di, &dev)),
        ("out_proj.weight", randn(&[dm, di], (di as f64).powf(-0.5))),
    ];
    let weights = weights
        .into_iter()
        .map(|(name, t)| Ok((name.to_string(), t?)))
        .collect::<Result<HashMap<_, _>>>()?;
    let vb = VarBuilder::from_tensors(weights, DType::F32, &dev);
    let mine = MyMixer::new(&cfg, vb.clone())?;
    let model = Mixer::new(&cfg, vb)?;

    let (batch, len) = (2, 100);
    let u = Tensor::randn(0f32, 1., (batch, len, dm), &dev)?;
    let mut state = LayerState {
        conv: Tensor::zeros((batch, cd, cfg.d_conv), DType::F32, &dev)?,
        ssm: Tensor::zeros((batch, h, cfg.headdim, cfg.d_state), DType::F32, &dev)?,
    };
    let want = model.forward(&u, &mut state)?;
    let got = mine.forward(&u)?;
    let diff: f32 = (got - &want)?.abs()?.max_all()?.to_scalar()?;
    let scale: f32 = want.abs()?.max_all()?.to_scalar()?;
    println!(
        "MyMixer vs mamba2::model::Mixer (B={batch} L={len} H={h} P={} G={} N={}, f32): \
         max |diff| = {diff:.3e} (max |out| = {scale:.3})",
        cfg.headdim, cfg.ngroups, cfg.d_state
    );
    if diff > 1e-5 {
        bail!("MyMixer departs from Mixer by {diff:.3e} > 1e-5");
    }
    Ok(())
}
