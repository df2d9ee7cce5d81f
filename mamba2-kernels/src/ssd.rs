//! The chunked SSD forward: [`crate::chunk_cumsum`] → [`crate::fwd_pass_state`] →
//! [`crate::compute_out`], the equivalent of mamba_ssm's `mamba_chunk_scan_combined` with
//! `return_final_states`. On the CPU the first two run as one op, then compute_out. On the GPU
//! the kernels of all three are launched back to back by one function (stage 1 inside the first
//! kernel where it pays), their intermediates in a scratch buffer kept per stream, so that a call
//! spends little host time before its first kernel and compute_out starts while the state pass
//! drains.

use candle_core::{DType, Result, Tensor};

use crate::check::{self, SsdDims};
use crate::chunk_cumsum::ChunkCumsum;
use crate::fwd_pass_state::steps_and_states;
use crate::DtOptions;

/// Options of [`ssd`]; `Default` is chunk 256, f32 states and mamba_ssm's defaults.
#[derive(Clone, Copy, Debug)]
pub struct SsdOptions<'a> {
    /// Tokens per chunk: a power of two ≥ 16.
    pub chunk_size: usize,
    /// How raw dt becomes the step size (bias, softplus, limit).
    pub dt: DtOptions<'a>,
    /// Skip term `D`, `[H]` or `[H,P]` f32.
    pub d: Option<&'a Tensor>,
    /// Gate `z [B,L,H,P]`: the output is `y·silu(z)`.
    pub z: Option<&'a Tensor>,
    /// State before the first token, `[B,H,P,N]` f32 or bf16 (zeros if `None`).
    pub initial_state: Option<&'a Tensor>,
    /// dtype of the chunk states and of the returned final state: f32 or bf16.
    pub state_dtype: DType,
}

impl Default for SsdOptions<'_> {
    fn default() -> Self {
        Self {
            chunk_size: 256,
            dt: DtOptions::default(),
            d: None,
            z: None,
            initial_state: None,
            state_dtype: DType::F32,
        }
    }
}

/// Runs the SSD over `x [B,L,H,P]` with `dt [B,L,H]`, `a [H]` f32, `b, c [B,L,G,N]`.
///
/// Returns `(y [B,L,H,P] in x's dtype, final_state [B,H,P,N] in opts.state_dtype)`.
///
/// On CUDA the intermediates (stage 1's step sizes and the chunk states) go to a scratch buffer
/// that the calling thread keeps for the stream and reuses on later calls when they need at most
/// 64 MiB (L = 4096 at B=4, H=8, N=128, bf16 states: 18 MiB); larger ones, and calls made while
/// the stream is being captured into a CUDA graph, allocate theirs per call.
pub fn ssd(
    x: &Tensor,
    dt: &Tensor,
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    opts: &SsdOptions,
) -> Result<(Tensor, Tensor)> {
    let op = "ssd";
    let dims = SsdDims::values(op, x, b)?;
    check::device(op, "dt", dt, x)?;
    check::float(op, "dt", dt)?;
    check::shape(
        op,
        "dt",
        dt,
        &[dims.batch, dims.seqlen, dims.nheads],
        "[B, L, H]",
    )?;
    check::head_param(op, "a", a, x, dims.nheads)?;
    dims.like_b(op, "c", c, x)?;
    opts.dt.check(op, x, dims.nheads)?;
    check::chunk_size(op, opts.chunk_size)?;
    check::state_dtype(op, "state_dtype", opts.state_dtype)?;
    if let Some(d) = opts.d {
        check::skip_param(op, d, x, dims.nheads, dims.headdim)?;
    }
    if let Some(z) = opts.z {
        dims.like_x(op, "z", z, x)?;
    }
    if let Some(s) = opts.initial_state {
        dims.state(op, "initial_state", s, x)?;
    }
    let (x, b, c) = (&x.contiguous()?, &b.contiguous()?, &c.contiguous()?);
    let d = opts.d.map(|d| d.contiguous()).transpose()?;
    let z = opts.z.map(|z| z.contiguous()).transpose()?;
    let chunk = opts.chunk_size;
    let cumsum = ChunkCumsum {
        dt_bias: opts.dt.bias.map(|b| b.contiguous()).transpose()?,
        dt_softplus: opts.dt.softplus,
        dt_limit: opts.dt.limit,
        chunk_size: chunk,
    };
    let (d, z) = (d.as_ref(), z.as_ref());
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        let init = opts
            .initial_state
            .map(|s| s.to_dtype(opts.state_dtype)?.contiguous())
            .transpose()?;
        return crate::cuda::ssd(&Call {
            x,
            b,
            c,
            dt: &check::rows_view(dt)?,
            a: &a.contiguous()?,
            d,
            z,
            init: init.as_ref(),
            stage: &cumsum,
            dims,
            state_dtype: opts.state_dtype,
        });
    }
    let args = (x, b, dt, a, opts.initial_state);
    let pass = steps_and_states(args, cumsum, opts.state_dtype)?;
    let (dt_out, da) = (&pass.dt_out, &pass.da_cumsum);
    let y = crate::compute_out(x, b, c, dt_out, da, &pass.states, d, z, chunk)?;
    Ok((y, pass.final_state))
}

/// [`ssd`]'s inputs after its checks, for the GPU path: every tensor contiguous (`dt`: its rows),
/// `init` in the state dtype.
#[cfg(feature = "cuda")]
pub(crate) struct Call<'a> {
    pub x: &'a Tensor,
    pub b: &'a Tensor,
    pub c: &'a Tensor,
    pub dt: &'a Tensor,
    pub a: &'a Tensor,
    pub d: Option<&'a Tensor>,
    pub z: Option<&'a Tensor>,
    pub init: Option<&'a Tensor>,
    pub stage: &'a ChunkCumsum,
    pub dims: SsdDims,
    pub state_dtype: DType,
}
