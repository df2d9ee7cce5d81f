//! The Mamba-2 mixer (mamba_ssm's `Mamba2` module), on the `mamba2-kernels` ops:
//!
//! ```text
//! [z | xBC | dt] = in_proj(u)                           u [B,L,d_model]
//! xBC = silu(causal_conv1d(xBC, conv state))            xBC [B,L,conv_dim]
//! [x | B | C] = xBC                                     x [B,L,H,P], B, C [B,L,G,N]
//! y, h = ssd(x, dt, A = −exp(A_log), B, C, D; h)        dt ← clamp(softplus(dt + dt_bias), dt_limit)
//! out = out_proj(rmsnorm_per_group(y · silu(z)) · w)    groups of d_inner/G channels
//! ```
//!
//! Decode is the same with `causal_conv1d_step` and `ssd_step` on one token. The conv writes x, B
//! and C as separate contiguous tensors, and z and dt stay slices of in_proj's output (read in
//! place on CUDA), so a decode step is six kernels per layer. The dt clamp is
//! applied in both paths: mamba_ssm's `Mamba2.step` and HF's single-token path skip it, so their
//! decode departs from their own prefill when `dt_limit` is finite; here they agree. `A`,
//! `dt_bias` and `D` are f32 whatever the model dtype. The chunked scan runs with chunks of
//! `chunk_size` tokens rounded up to a power of two and clamped to [16, 256]: the result does not
//! depend on the chunk length, the kernels need a power of two ≥ 16, and 256 keeps the CUDA
//! kernels on their tensor-core paths and bounds their shared memory. On the CPU the chunk is at
//! most 64 tokens.

mod grad;

pub(crate) use grad::{packed_params, packed_weights, Fused, MixerGrad, Recorded};

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::{linear_b, Linear, VarBuilder};
use mamba2_kernels::{
    causal_conv1d, causal_conv1d_split, causal_conv1d_split_packed, causal_conv1d_step_split,
    check_cu_seqlens, gated_rms_norm, matvec, scatter_rows, ssd, ssd_packed, ssd_step, ssd_xbc,
    ConvOptions, DtOptions, SsdOptions, StepOptions,
};

use crate::cache::LayerState;
use crate::packing::{Group, Packing, GROUP_COST, PAD_DT};
use crate::Config;

/// On the CPU the scan runs in chunks of at most this many tokens: the work inside a chunk grows
/// with its length while the state passes between chunks are cheap there.
const CPU_CHUNK: usize = 64;

/// The weights of one mixer and the sizes it splits its projections by.
#[derive(Debug)]
pub struct Mixer {
    in_proj: Linear,
    /// `[conv_dim, d_conv]`: the checkpoint's `[conv_dim, 1, d_conv]` squeezed.
    conv_weight: Tensor,
    conv_bias: Option<Tensor>,
    /// `[H]` f32, `−exp(A_log)`.
    a: Tensor,
    /// `[H]` f32.
    d: Tensor,
    /// `[H]` f32.
    dt_bias: Tensor,
    /// `[d_inner]`, the gated norm's weight.
    norm: Tensor,
    out_proj: Linear,
    d_inner: usize,
    nheads: usize,
    headdim: usize,
    ngroups: usize,
    d_state: usize,
    group_size: usize,
    chunk_size: usize,
    dt_limit: (f32, f32),
    eps: f64,
}

impl Mixer {
    /// Loads a mixer from `vb` (the `...mixer.` prefix), in `vb`'s dtype except A, D, dt_bias.
    pub fn new(cfg: &Config, vb: VarBuilder) -> Result<Self> {
        let (d_inner, h, conv_dim) = (cfg.d_inner(), cfg.nheads, cfg.conv_dim());
        let f32_param =
            |name: &str| vb.get_with_hints_dtype(h, name, Default::default(), DType::F32);
        let a = f32_param("A_log")?.exp()?.neg()?;
        Ok(Self {
            in_proj: linear_b(cfg.d_model, cfg.in_proj_dim(), cfg.bias, vb.pp("in_proj"))?,
            conv_weight: vb
                .get((conv_dim, 1, cfg.d_conv), "conv1d.weight")?
                .squeeze(1)?,
            conv_bias: cfg
                .conv_bias
                .then(|| vb.get(conv_dim, "conv1d.bias"))
                .transpose()?,
            a,
            d: f32_param("D")?,
            dt_bias: f32_param("dt_bias")?,
            norm: vb.get(d_inner, "norm.weight")?,
            out_proj: linear_b(d_inner, cfg.d_model, cfg.bias, vb.pp("out_proj"))?,
            d_inner,
            nheads: h,
            headdim: cfg.headdim,
            ngroups: cfg.ngroups,
            d_state: cfg.d_state,
            group_size: cfg.norm_group_size(),
            chunk_size: cfg.chunk_size.clamp(16, 256).next_power_of_two(),
            dt_limit: cfg.dt_limit,
            eps: cfg.norm_eps,
        })
    }

    fn dt_options(&self) -> DtOptions<'_> {
        DtOptions {
            bias: Some(&self.dt_bias),
            softplus: true,
            limit: self.dt_limit,
        }
    }

    /// The scan's options for `u`'s device, from `initial_state` (zeros when `None`); states f32.
    fn ssd_options<'a>(&'a self, u: &Tensor, initial_state: Option<&'a Tensor>) -> SsdOptions<'a> {
        SsdOptions {
            chunk_size: self.chunk_for(u),
            dt: self.dt_options(),
            d: Some(&self.d),
            z: None,
            initial_state,
            state_dtype: DType::F32,
        }
    }

    /// `out_proj(rmsnorm_per_group(y · silu(z)) · w)` of the scan's `y` (any shape of `z`'s
    /// elements, reshaped to `z`'s).
    fn output(&self, y: &Tensor, z: &Tensor) -> Result<Tensor> {
        let y = gated_rms_norm(
            &y.reshape(z.shape())?,
            z,
            &self.norm,
            self.group_size,
            self.eps,
        )?;
        rows_linear(&self.out_proj, &y)
    }

    fn conv_options(&self) -> ConvOptions<'_> {
        ConvOptions {
            bias: self.conv_bias.as_ref(),
            silu: true,
        }
    }

    /// (d_inner, nheads, headdim, ngroups·d_state).
    fn sizes(&self) -> (usize, usize, usize, usize) {
        (
            self.d_inner,
            self.nheads,
            self.headdim,
            self.ngroups * self.d_state,
        )
    }

    /// in_proj's output `[.., 2·d_inner + 2·G·N + H]` cut along its last dim into
    /// `(z, xBC, dt)` (views, no copies).
    fn split(&self, zxbcdt: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let (di, h, _, gn) = self.sizes();
        let last = zxbcdt.rank() - 1;
        Ok((
            zxbcdt.narrow(last, 0, di)?,
            zxbcdt.narrow(last, di, di + 2 * gn)?,
            zxbcdt.narrow(last, 2 * di + 2 * gn, h)?,
        ))
    }

    /// `(z, xBC, dt)` of `u [B,L,d_model]`. When in_proj's weight tracks gradients, each piece is
    /// its own product with rows of the weight: cut from one output, every piece's gradient would
    /// be scattered into a zeroed `[B,L,in_proj_dim]` buffer.
    fn project(&self, u: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        if !self.in_proj.weight().track_op() {
            return self.split(&rows_linear(&self.in_proj, u)?);
        }
        self.project_pieces(u)
    }

    /// `(z, xBC, dt)` of `u [B,L,d_model]`, each its own contiguous product with its rows of
    /// in_proj's weight.
    fn project_pieces(&self, u: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let w = self.in_proj.weight();
        let (di, h, _, gn) = self.sizes();
        let piece = |start: usize, len: usize| {
            let bias = self
                .in_proj
                .bias()
                .map(|b| b.narrow(0, start, len))
                .transpose()?;
            rows_linear(&Linear::new(w.narrow(0, start, len)?, bias), u)
        };
        Ok((
            piece(0, di)?,
            piece(di, di + 2 * gn)?,
            piece(2 * di + 2 * gn, h)?,
        ))
    }

    /// The scan of the conv's `[x | B | C]` pieces `[rows, len, ·]` with `dt [rows, len, H]`.
    fn scan(&self, parts: &[Tensor], dt: &Tensor, opts: &SsdOptions) -> Result<(Tensor, Tensor)> {
        let (rows, len, _) = parts[0].dims3()?;
        let groups = (rows, len, self.ngroups, self.d_state);
        ssd(
            &parts[0].reshape((rows, len, self.nheads, self.headdim))?,
            dt,
            &self.a,
            &parts[1].reshape(groups)?,
            &parts[2].reshape(groups)?,
            opts,
        )
    }

    /// The scan's chunk length for `u`'s device: on the CPU at most [`CPU_CHUNK`].
    fn chunk_for(&self, u: &Tensor) -> usize {
        if u.device().is_cpu() {
            self.chunk_size.min(CPU_CHUNK)
        } else {
            self.chunk_size
        }
    }

    /// Runs `u [B,L,d_model]` from `state` and leaves the state after the last token there.
    pub fn forward(&self, u: &Tensor, state: &mut LayerState) -> Result<Tensor> {
        let (out, conv, ssm) = self.run(u, Some(&state.conv), Some(&state.ssm))?;
        state.conv.slice_set(&conv, 0, 0)?;
        state.ssm.slice_set(&ssm, 0, 0)?;
        Ok(out)
    }

    /// Runs the sequences packed along L of `u [1,T,d_model]` (sequence s on tokens
    /// `cu_seqlens[s]..cu_seqlens[s+1]`), each from its row of `state` (`S` rows), and leaves
    /// each one's state after its last token there. The projections and the norm run once over
    /// the packed row; on CUDA the conv and the scan too, one launch each for every sequence
    /// (`causal_conv1d_split_packed`, `ssd_packed`); on the CPU once per group of sequences of
    /// similar lengths, each group a batch padded at its rows' ends (`crate::packing`), or, when a
    /// dt_limit above 0 would make a pad's dt nonzero, once per sequence.
    pub fn forward_packed(
        &self,
        u: &Tensor,
        cu_seqlens: &[usize],
        state: &mut LayerState,
    ) -> Result<Tensor> {
        let packing = self.packing(cu_seqlens, GROUP_COST, u.device())?;
        self.forward_packing(u, cu_seqlens, packing.as_ref(), state)
    }

    /// The groups of `cu_seqlens` at `cost` padded tokens per group (`crate::packing`), or `None`
    /// where the packed row runs as it is: on CUDA, and where a pad's dt would not be 0 (a
    /// dt_limit above 0 clamps it up). The offsets are checked first.
    pub(crate) fn packing(
        &self,
        cu_seqlens: &[usize],
        cost: usize,
        device: &Device,
    ) -> Result<Option<Packing>> {
        let total = cu_seqlens.last().copied().unwrap_or(0);
        check_cu_seqlens("packed mixer", cu_seqlens, total)?;
        if device.is_cuda() || self.dt_limit.0 > 0.0 {
            return Ok(None);
        }
        let (d_conv, dtype) = (self.conv_weight.dim(1)?, self.conv_weight.dtype());
        Packing::new(cu_seqlens, d_conv, cost, dtype, device).map(Some)
    }

    /// [`Mixer::forward_packed`] in the groups of `packing` (from [`Mixer::packing`] for the same
    /// offsets), or each sequence alone when `packing` is `None`.
    pub(crate) fn forward_packing(
        &self,
        u: &Tensor,
        cu_seqlens: &[usize],
        packing: Option<&Packing>,
        state: &mut LayerState,
    ) -> Result<Tensor> {
        let (total, seqs) = (cu_seqlens[cu_seqlens.len() - 1], cu_seqlens.len() - 1);
        let (rows, t, _) = u.dims3()?;
        if rows != 1 || t != total {
            candle_core::bail!(
                "packed mixer: u must be [1, {total}, d_model] for cu_seqlens ending at {total}, \
                 got {:?}",
                u.dims()
            )
        }
        for (name, s) in [("conv", &state.conv), ("ssm", &state.ssm)] {
            if s.dim(0)? != seqs {
                candle_core::bail!(
                    "packed mixer: {} {name} states for {seqs} sequences",
                    s.dim(0)?
                )
            }
        }
        let states = (&state.conv, &state.ssm);
        match packing {
            Some(packing) => self.run_groups(u, packing, states),
            None => {
                let (out, conv, ssm) = self.run_packed(u, cu_seqlens, Some(states))?;
                state.conv.slice_set(&conv, 0, 0)?;
                state.ssm.slice_set(&ssm, 0, 0)?;
                Ok(out)
            }
        }
    }

    /// The output of the packed sequences of `u [1,T,d_model]` from the `(conv, ssm)` states, one
    /// batched conv and scan per group of `packing` (its module doc); each group's states after
    /// its sequences' last tokens are written over their rows of those states as it ends (a
    /// group reads only its own rows, before it writes them).
    fn run_groups(
        &self,
        u: &Tensor,
        packing: &Packing,
        states: (&Tensor, &Tensor),
    ) -> Result<Tensor> {
        let (di, h, _, gn) = self.sizes();
        let conv_dim = di + 2 * gn;
        let k = self.conv_weight.dim(1)?;
        // Contiguous pieces: the gathers below need contiguous sources, and candle copies a
        // strided slice of in_proj's output element by element.
        let (z, xbc, dt) = self.project_pieces(u)?;
        let dev = u.device();
        // Row T of the packed inputs is every pad's: zero inputs, dt PAD_DT.
        let xbc = Tensor::cat(
            &[
                &xbc.squeeze(0)?,
                &Tensor::zeros((1, conv_dim), xbc.dtype(), dev)?,
            ],
            0,
        )?;
        let pad_dt = Tensor::full(PAD_DT, (1, h), dev)?.to_dtype(dt.dtype())?;
        let dt = Tensor::cat(&[&dt.squeeze(0)?, &pad_dt], 0)?;
        let (split, conv_opts) = ([di, gn, gn], self.conv_options());
        let mut ys = Vec::new();
        for g in &packing.groups {
            let (rows, len) = (g.rows, g.len);
            let xbc = xbc
                .index_select(&g.gather, 0)?
                .reshape((rows, len, conv_dim))?;
            let dt = dt.index_select(&g.gather, 0)?.reshape((rows, len, h))?;
            let conv0 = states.0.index_select(g.members.ids(), 0)?;
            let ssm0 = states.1.index_select(g.members.ids(), 0)?;
            let (parts, _) =
                causal_conv1d_split(&xbc, &self.conv_weight, Some(&conv0), &conv_opts, &split)?;
            // Each sequence's conv state: its last k inputs, after its initial state (the row's
            // own state would end in pads). Both pieces contiguous, so that candle's cat is one
            // block copy rather than strided copies of the whole group.
            let window = Tensor::cat(&[&conv0.transpose(1, 2)?.contiguous()?, &xbc], 1)?
                .reshape((rows * (k + len), conv_dim))?;
            let conv = window
                .index_select(&g.conv_last, 0)?
                .reshape((rows, k, conv_dim))?
                .transpose(1, 2)?
                .contiguous()?;
            let (y, ssm) = self.scan(&parts, &dt, &self.ssd_options(u, Some(&ssm0)))?;
            scatter_rows(states.0, &conv, &g.members)?;
            scatter_rows(states.1, &ssm, &g.members)?;
            ys.push(y.reshape((rows * len, di))?);
        }
        let y = Tensor::cat(&ys, 0)?.index_select(&packing.tokens_back, 0)?;
        self.output(&y, &z)
    }

    /// `(out, conv states, SSM states)` of the rows of `u [rows, len, d_model]`, one group of
    /// `crate::packing` run through the whole model: each row a sequence from zero states followed
    /// by pads (their dt made an exact 0 by the group's `pads`), its states those after its last
    /// token.
    pub(crate) fn forward_rows(&self, u: &Tensor, g: &Group) -> Result<(Tensor, Tensor, Tensor)> {
        let (rows, len, _) = u.dims3()?;
        let (di, _, _, gn) = self.sizes();
        let (conv_dim, k) = (di + 2 * gn, self.conv_weight.dim(1)?);
        let zxbcdt = rows_linear(&self.in_proj, u)?;
        let (z, xbc, dt) = self.split(&zxbcdt)?;
        let dt = dt.broadcast_add(&g.pads)?;
        let (parts, _) = causal_conv1d_split(
            &xbc,
            &self.conv_weight,
            None,
            &self.conv_options(),
            &[di, gn, gn],
        )?;
        // Each sequence's conv state: its last k inputs, zeros before its first token, gathered
        // as whole rows of in_proj's output (contiguous, as candle's gather needs).
        let conv = zxbcdt
            .reshape((rows * len, zxbcdt.dim(2)?))?
            .index_select(&g.conv_taps, 0)?
            .narrow(1, di, conv_dim)?
            .broadcast_mul(&g.conv_mask)?
            .reshape((rows, k, conv_dim))?
            .transpose(1, 2)?
            .contiguous()?;
        let (y, ssm) = self.scan(&parts, &dt, &self.ssd_options(u, None))?;
        Ok((self.output(&y, &z)?, conv, ssm))
    }

    /// [`Mixer::forward_packed`] from zero states, as training on packed documents does: every
    /// op on the way records its gradient when the weights or `u` take part in one.
    pub fn forward_train_packed(&self, u: &Tensor, cu_seqlens: &[usize]) -> Result<Tensor> {
        Ok(self.run_packed(u, cu_seqlens, None)?.0)
    }

    /// `(out, conv states, SSM states)` of the packed sequences of `u`, from the given
    /// `(conv, ssm)` states (zeros when absent).
    fn run_packed(
        &self,
        u: &Tensor,
        cu_seqlens: &[usize],
        states: Option<(&Tensor, &Tensor)>,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (_, t, _) = u.dims3()?;
        let (di, h, p, gn) = self.sizes();
        let (z, xbc, dt) = self.project(u)?;
        let (xbc, conv) = causal_conv1d_split_packed(
            &xbc,
            &self.conv_weight,
            states.map(|s| s.0),
            &self.conv_options(),
            &[di, gn, gn],
            cu_seqlens,
        )?;
        let groups = (1, t, self.ngroups, self.d_state);
        let x = xbc[0].reshape((1, t, h, p))?;
        let bm = xbc[1].reshape(groups)?;
        let cm = xbc[2].reshape(groups)?;
        // Chunks count from each sequence's start: at most 128 tokens (the CUDA kernels' tuned
        // chunk), so that a short sequence's one chunk is not mostly empty rows.
        let opts = SsdOptions {
            chunk_size: self.chunk_for(u).min(128),
            ..self.ssd_options(u, states.map(|s| s.1))
        };
        let (y, ssm) = ssd_packed(&x, &dt, &self.a, &bm, &cm, cu_seqlens, &opts)?;
        Ok((self.output(&y, &z)?, conv, ssm))
    }

    /// Runs whole sequences `u [B,L,d_model]` from zero states, as training does: every op on the
    /// way records its gradient when the weights or `u` take part in one.
    pub fn forward_train(&self, u: &Tensor) -> Result<Tensor> {
        // On CUDA the mixer is one recorded op (`grad.rs`): candle's backward would otherwise
        // add a dozen activation-sized gradients per layer into zeroed buffers, which costs more
        // than the kernels. On the CPU the composed ops keep the scan's states for the backward.
        if u.device().is_cuda() && (u.track_op() || self.in_proj.weight().track_op()) {
            return self.forward_train_fused(u);
        }
        Ok(self.run(u, None, None)?.0)
    }

    /// `(out, conv state, SSM state after the last token)` from the given states (zeros when
    /// absent).
    fn run(
        &self,
        u: &Tensor,
        conv_state: Option<&Tensor>,
        ssm_state: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (di, _, _, gn) = self.sizes();
        let (z, xbc, dt) = self.project(u)?;
        let opts = self.ssd_options(u, ssm_state);
        let conv_opts = self.conv_options();
        let (y, conv, ssm) = if xbc.track_op() {
            // Training: the conv's output goes to the scan whole, so that its gradient comes back
            // whole.
            let (xbc, conv) = causal_conv1d(&xbc, &self.conv_weight, conv_state, &conv_opts)?;
            let groups_state = (self.ngroups, self.d_state);
            let (y, ssm) = ssd_xbc(&xbc, &dt, &self.a, groups_state, &opts)?;
            (y, conv, ssm)
        } else {
            let split = [di, gn, gn];
            let (xbc, conv) =
                causal_conv1d_split(&xbc, &self.conv_weight, conv_state, &conv_opts, &split)?;
            let (y, ssm) = self.scan(&xbc, &dt, &opts)?;
            (y, conv, ssm)
        };
        Ok((self.output(&y, &z)?, conv, ssm))
    }

    /// Runs one token `u [B,d_model]`, updating `state` in place.
    pub fn step(&self, u: &Tensor, state: &mut LayerState) -> Result<Tensor> {
        let (b, _) = u.dims2()?;
        let (di, h, p, gn) = self.sizes();
        let (z, xbc, dt) = self.split(&decode_linear(&self.in_proj, u)?)?;
        let xbc = causal_conv1d_step_split(
            &state.conv,
            &xbc,
            &self.conv_weight,
            &self.conv_options(),
            &[di, gn, gn],
        )?;
        let groups = (b, self.ngroups, self.d_state);
        let x = xbc[0].reshape((b, h, p))?;
        let bm = xbc[1].reshape(groups)?;
        let cm = xbc[2].reshape(groups)?;
        let opts = StepOptions {
            dt: self.dt_options(),
            d: Some(&self.d),
            z: None,
        };
        let y = ssd_step(&state.ssm, &x, &dt, &self.a, &bm, &cm, &opts)?;
        let y = gated_rms_norm(
            &y.reshape((b, di))?,
            &z,
            &self.norm,
            self.group_size,
            self.eps,
        )?;
        decode_linear(&self.out_proj, &y)
    }
}

/// `linear` on `x [.., K]` as one product over all its rows: candle's `Linear` broadcasts the
/// weight over a batch dim instead, and the weight's gradient is then one product per batch
/// entry, summed.
pub(crate) fn rows_linear(linear: &Linear, x: &Tensor) -> Result<Tensor> {
    let dims = x.dims();
    let (lead, k) = dims.split_at(dims.len().saturating_sub(1));
    let rows: usize = lead.iter().product();
    let y = linear.forward(&x.reshape((rows, k.iter().product::<usize>()))?)?;
    let mut out = lead.to_vec();
    out.push(y.dim(1)?);
    y.reshape(out)
}

/// `linear` on the rows `x [R,K]` of a decode step: the few-row kernel on CUDA for R ≤ 8, where
/// reading the weight is the whole cost; candle's matmul otherwise.
pub(crate) fn decode_linear(linear: &Linear, x: &Tensor) -> Result<Tensor> {
    if x.device().is_cuda() && x.dim(0)? <= 8 {
        matvec(x, linear.weight(), linear.bias())
    } else {
        linear.forward(x)
    }
}
