//! The chunked SSD forward: [`crate::chunk_cumsum`] → [`crate::fwd_pass_state`] →
//! [`crate::compute_out`] (the first two as one op, one kernel launch fewer on the GPU), the
//! equivalent of mamba_ssm's `mamba_chunk_scan_combined` with `return_final_states`. On the GPU
//! the state pass also allocates compute_out's output before its last kernel, so that
//! compute_out follows that kernel directly and starts while it drains.

use candle_core::{DType, Result, Tensor};

use crate::check::{self, SsdDims};
use crate::chunk_cumsum::ChunkCumsum;
use crate::compute_out::after_state_pass;
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
    // Every input of compute_out contiguous before the state pass: nothing is launched between
    // the two (see `after_state_pass`).
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
    let args = (x, b, dt, a, opts.initial_state);
    let pass = steps_and_states(args, cumsum, opts.state_dtype)?;
    let (d, z) = (d.as_ref(), z.as_ref());
    let inputs = (x, b, c, &pass.dt_out, &pass.da_cumsum, &pass.states);
    let y = after_state_pass(inputs, d, z, chunk, pass.out_buffer)?;
    Ok((y, pass.final_state))
}
