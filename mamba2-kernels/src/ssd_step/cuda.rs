//! Launcher of `kernels/ssd_step/ssd_step.cu`: a program per (batch, head) and block of state
//! rows (`plan::rows`), x, dt, b, c and z read in place from rows of wider tensors (the conv's
//! output pieces, in_proj's slices).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::DeviceRepr;
use candle_core::{CudaStorage, Layout, Result, Tensor};

use super::plan;
use crate::check::SsdDims;
use crate::cuda::{alloc, cfg, fatbin, function, i, launch, m2_layout, opt_ptr, ptr, rows_ptr};
use crate::cuda::{sm_count, ty, written, Guards, Held, Image};
use crate::dt::DtRule;
use crate::instances;

const IMAGE: Image = fatbin!("ssd_step_ssd_step");

/// `m2::StepParams` (`kernels/ssd_step/params.cuh`): dimensions, dt rule, D per channel, state
/// rows per program, and the batch strides (elements) of x, dt, b, c and z.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct StepParams {
    batch: i32,
    nheads: i32,
    headdim: i32,
    ngroups: i32,
    dstate: i32,
    softplus: i32,
    d_per_channel: i32,
    rows_per_block: i32,
    lo: f32,
    hi: f32,
    x_stride: i64,
    dt_stride: i64,
    b_stride: i64,
    c_stride: i64,
    z_stride: i64,
}
m2_layout!(StepParams, 80, {
    batch: 0, nheads: 4, headdim: 8, ngroups: 12, dstate: 16, softplus: 20, d_per_channel: 24,
    rows_per_block: 28, lo: 32, hi: 36, x_stride: 40, dt_stride: 48, b_stride: 56,
    c_stride: 64, z_stride: 72,
});
// SAFETY: plain old data with the C struct's layout (asserted above).
unsafe impl DeviceRepr for StepParams {}

/// What the step op holds besides its arguments (a, b, c, D, z, the bias: `b`, `c` and `z` rows
/// possibly spaced, the rest contiguous).
pub(super) struct Step<'a> {
    pub a: &'a Tensor,
    pub b: &'a Tensor,
    pub c: &'a Tensor,
    pub d: Option<&'a Tensor>,
    pub z: Option<&'a Tensor>,
    pub dt_bias: Option<&'a Tensor>,
    pub rule: DtRule,
    pub dims: SsdDims,
}

/// Advances the state in place from `x` and `dt` and returns `y [B,H,P]`.
pub(super) fn ssd_step(
    op: &Step,
    (st_s, st_l): (&mut CudaStorage, &Layout),
    (x_s, x_l): (&CudaStorage, &Layout),
    (dt_s, dt_l): (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    let name = "ssd_step";
    let d = op.dims;
    let dev = x_s.device.clone();
    let stream = dev.cuda_stream();
    let total = d.batch * d.nheads * d.headdim;
    let mut out = alloc(&dev, x_s.dtype(), total)?;
    let (a, b, c) = (Held::new(op.a), Held::new(op.b), Held::new(op.c));
    let bias = op.dt_bias.map(Held::new);
    let dskip = op.d.map(Held::new);
    let z = op.z.map(Held::new);
    let mut guards = Guards::new();
    let (x_p, x_stride, _g1) = rows_ptr(name, "x", x_s, x_l, &stream)?;
    let (dt_p, dt_stride, _g2) = rows_ptr(name, "dt", dt_s, dt_l, &stream)?;
    let a_p = a.ptr(name, "a", &stream, &mut guards)?;
    let (b_p, b_stride, _g4) = rows_ptr(name, "b", b.cuda(name, "b")?, b.layout, &stream)?;
    let (c_p, c_stride, _g5) = rows_ptr(name, "c", c.cuda(name, "c")?, c.layout, &stream)?;
    let bias_p = opt_ptr(name, "dt_bias", &bias, &stream, &mut guards)?;
    let d_p = opt_ptr(name, "D", &dskip, &stream, &mut guards)?;
    let (z_p, z_stride) = match &z {
        Some(h) => {
            let (p, s, g) = rows_ptr(name, "z", h.cuda(name, "z")?, h.layout, &stream)?;
            guards.push(g);
            (p, s)
        }
        None => (0, 0),
    };
    let y_p = ptr(name, "y", &out, &Layout::contiguous(total), &stream)?.0;
    let state_dtype = st_s.dtype();
    let (st_p, g7) = ptr(name, "state", st_s, st_l, &stream)?;
    let heads = d.batch * d.nheads;
    let (warps, rows_per_block) = plan::rows(heads, d.headdim, sm_count(&stream)?);
    let sp = StepParams {
        batch: i(d.batch)?,
        nheads: i(d.nheads)?,
        headdim: i(d.headdim)?,
        ngroups: i(d.ngroups)?,
        dstate: i(d.dstate)?,
        softplus: op.rule.softplus as i32,
        d_per_channel: op.d.is_some_and(|t| t.rank() == 2) as i32,
        rows_per_block: i(rows_per_block)?,
        lo: op.rule.limit.0,
        hi: op.rule.limit.1,
        // Row strides → batch strides: x and z have H rows of P per batch, b and c G rows of N.
        x_stride: x_stride * d.nheads as i64,
        dt_stride,
        b_stride: b_stride * d.ngroups as i64,
        c_stride: c_stride * d.ngroups as i64,
        z_stride: z_stride * d.nheads as i64,
    };
    // Vector accesses read 4 values of B and C at once from rows at vector boundaries, and 4
    // state values from 16-byte aligned rows.
    let quad = 4 * x_s.dtype().size_in_bytes();
    let aligned = st_p % 16 == 0
        && [b_p, c_p].iter().all(|&p| p as usize % quad == 0)
        && [sp.b_stride, sp.c_stride].iter().all(|&s| s % 4 == 0);
    let path = plan::path(d.dstate, aligned);
    let kernel = instances::ssd_step(ty(name, x_s.dtype())?, ty(name, state_dtype)?, path);
    let f = function(&stream, IMAGE, &kernel)?;
    let row_blocks = d.headdim.div_ceil(rows_per_block);
    launch(
        &stream,
        &f,
        cfg(name, &stream, [heads, row_blocks, 1], [32 * warps, 1, 1], 0)?,
        &[
            &st_p, &x_p, &dt_p, &a_p, &bias_p, &b_p, &c_p, &d_p, &z_p, &y_p, &sp,
        ],
    )?;
    drop(g7);
    written(st_s, &stream)?;
    written(&mut out, &stream)?;
    Ok(out)
}
