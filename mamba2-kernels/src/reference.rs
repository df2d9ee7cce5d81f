//! Ground truth: the SSD as the sequential recurrence, in f64 on the CPU (slow; for tests).
//!
//! ```text
//! dt_t = clamp(softplus(dt_t + dt_bias), lo, hi)
//! h_t  = exp(a·dt_t)·h_{t-1} + dt_t · x_t B_tᵀ        y_t = h_t C_t + D·x_t   (· silu(z_t))
//! ```

use candle_core::{DType, Device, Result, Tensor};

use crate::SsdOptions;

/// Everything the chunked implementation computes, from the recurrence, as f64 tensors.
#[derive(Debug)]
pub struct Reference {
    /// `[B,L,H,P]`, gated by z when given.
    pub y: Tensor,
    /// `[B,H,P,N]`, the state after the last token.
    pub final_state: Tensor,
    /// `[B,H,C+1,P,N]`: entry c is the state before token c·chunk_size; entry C the final one.
    pub chunk_states: Tensor,
    /// `[B,H,L]`, processed dt.
    pub dt_out: Tensor,
    /// `[B,H,L]`, per-chunk cumulative sums of a·dt times log2(e).
    pub da_cumsum: Tensor,
}

fn f64s(t: &Tensor) -> Result<Vec<f64>> {
    t.to_device(&Device::Cpu)?
        .to_dtype(DType::F64)?
        .flatten_all()?
        .to_vec1::<f64>()
}

/// Processes one raw dt value in f64, with mamba_ssm's softplus threshold of 20.
pub fn process_dt(raw: f64, bias: f64, softplus: bool, (lo, hi): (f64, f64)) -> f64 {
    let v = raw + bias;
    let v = if softplus && v <= 20.0 {
        v.exp().ln_1p()
    } else {
        v
    };
    v.max(lo).min(hi)
}

/// Runs the recurrence over `x [B,L,H,P]`, `dt [B,L,H]`, `a [H]`, `b, c [B,L,G,N]` with the
/// options of the chunked [`crate::ssd`] (`chunk_size` places the chunk states).
pub fn ssd(
    x: &Tensor,
    dt: &Tensor,
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    opts: &SsdOptions,
) -> Result<Reference> {
    let (batch, seqlen, nheads, headdim) = x.dims4()?;
    let (_, _, ngroups, dstate) = b.dims4()?;
    let (hpg, pn, t) = (nheads / ngroups, headdim * dstate, opts.chunk_size);
    let nchunks = seqlen.div_ceil(t);
    let (xv, dtv, av, bv, cv) = (f64s(x)?, f64s(dt)?, f64s(a)?, f64s(b)?, f64s(c)?);
    let bias = match opts.dt.bias {
        Some(t) => f64s(t)?,
        None => vec![0.0; nheads],
    };
    let d = opts.d.map(f64s).transpose()?;
    let z = opts.z.map(f64s).transpose()?;
    let init = opts.initial_state.map(f64s).transpose()?;
    let limit = (opts.dt.limit.0 as f64, opts.dt.limit.1 as f64);

    let mut y = vec![0f64; batch * seqlen * nheads * headdim];
    let mut chunk_states = vec![0f64; batch * nheads * (nchunks + 1) * pn];
    let mut dt_out = vec![0f64; batch * nheads * seqlen];
    let mut da_cumsum = vec![0f64; batch * nheads * seqlen];
    for bi in 0..batch {
        for h in 0..nheads {
            let bh = bi * nheads + h;
            let g = h / hpg;
            let mut state = match &init {
                Some(s) => s[bh * pn..(bh + 1) * pn].to_vec(),
                None => vec![0f64; pn],
            };
            let mut acc = 0f64;
            for l in 0..seqlen {
                if l % t == 0 {
                    let slot = (bh * (nchunks + 1) + l / t) * pn;
                    chunk_states[slot..slot + pn].copy_from_slice(&state);
                    acc = 0.0;
                }
                let step = process_dt(
                    dtv[(bi * seqlen + l) * nheads + h],
                    bias[h],
                    opts.dt.softplus,
                    limit,
                );
                acc += av[h] * step;
                dt_out[bh * seqlen + l] = step;
                da_cumsum[bh * seqlen + l] = acc * std::f64::consts::LOG2_E;
                let decay = (av[h] * step).exp();
                let bc = ((bi * seqlen + l) * ngroups + g) * dstate;
                let xo = ((bi * seqlen + l) * nheads + h) * headdim;
                for p in 0..headdim {
                    let mut out = 0f64;
                    for n in 0..dstate {
                        let s = &mut state[p * dstate + n];
                        *s = decay * *s + step * xv[xo + p] * bv[bc + n];
                        out += *s * cv[bc + n];
                    }
                    if let Some(d) = &d {
                        out += xv[xo + p]
                            * if d.len() == nheads {
                                d[h]
                            } else {
                                d[h * headdim + p]
                            };
                    }
                    if let Some(z) = &z {
                        let zv = z[xo + p];
                        out *= zv / (1.0 + (-zv).exp());
                    }
                    y[xo + p] = out;
                }
            }
            let slot = (bh * (nchunks + 1) + nchunks) * pn;
            chunk_states[slot..slot + pn].copy_from_slice(&state);
        }
    }
    let cpu = Device::Cpu;
    let chunk_states = Tensor::from_vec(
        chunk_states,
        (batch, nheads, nchunks + 1, headdim, dstate),
        &cpu,
    )?;
    Ok(Reference {
        y: Tensor::from_vec(y, (batch, seqlen, nheads, headdim), &cpu)?,
        final_state: chunk_states
            .narrow(2, nchunks, 1)?
            .squeeze(2)?
            .contiguous()?,
        chunk_states,
        dt_out: Tensor::from_vec(dt_out, (batch, nheads, seqlen), &cpu)?,
        da_cumsum: Tensor::from_vec(da_cumsum, (batch, nheads, seqlen), &cpu)?,
    })
}
