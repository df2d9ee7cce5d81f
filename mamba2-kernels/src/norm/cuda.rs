//! Launchers of `kernels/norm/rms_norm.cu`: the gated RMSNorm (one program per row and group)
//! and residual add + RMSNorm (one program per row), each row held in registers when it fits
//! (`plan::row_program`), and the backwards of the gated norm and of the plain RMSNorm (one
//! program per group and set of rows, `plan::bwd_programs`), which give the input gradients and
//! one row of f32 partial sums of dweight per program. The gate z may be a slice of in_proj's
//! output: its row stride is passed.

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaStream, DeviceRepr};
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result, Tensor};

use super::plan::{bwd_programs, bwd_row_program, row_program};
use crate::cuda::{alloc, cfg, fatbin, function, i, launch, m2_layout, opt_ptr, ptr, rows_ptr};
use crate::cuda::{sm_count, ty, written, Dest, Guards, Held, Image};
use crate::instances;

const IMAGE: Image = fatbin!("norm_rms_norm");

/// `m2::NormParams` (`kernels/norm/params.cuh`): z's row stride, the row length, the channels
/// per normalised group, eps.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct NormParams {
    z_stride: i64,
    dim: i32,
    group: i32,
    eps: f32,
}
m2_layout!(NormParams, 24, { z_stride: 0, dim: 8, group: 12, eps: 16 });
// SAFETY: plain old data with the C struct's layout (asserted above).
unsafe impl DeviceRepr for NormParams {}

/// `m2::NormBwdParams` (`kernels/norm/params.cuh`): z's row stride, the row count, the row
/// length, the channels per normalised group, eps, the row stride of dz.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct NormBwdParams {
    z_stride: i64,
    rows: i64,
    dim: i32,
    group: i32,
    eps: f32,
    dz_stride: i64,
}
m2_layout!(NormBwdParams, 40, {
    z_stride: 0, rows: 8, dim: 16, group: 20, eps: 24, dz_stride: 32,
});
// SAFETY: plain old data with the C struct's layout (asserted above).
unsafe impl DeviceRepr for NormBwdParams {}

/// Whether every address is 16-byte aligned.
fn aligned16(addrs: &[u64]) -> bool {
    addrs.iter().all(|a| a % 16 == 0)
}

type Input<'a> = (&'a CudaStorage, &'a Layout);

/// The gated norm: `y` of x's shape.
pub(super) fn gated_rms_norm(
    (x_s, x_l): Input,
    (z_s, z_l): Input,
    (w_s, w_l): Input,
    group: usize,
    eps: f32,
) -> Result<CudaStorage> {
    let op = "gated_rms_norm";
    let dim = w_l.shape().elem_count();
    let rows = x_l.shape().elem_count() / dim;
    let dev = &x_s.device;
    let stream = dev.cuda_stream();
    let mut y = alloc(dev, x_s.dtype(), rows * dim)?;
    let (x_p, _g1) = ptr(op, "x", x_s, x_l, &stream)?;
    let (z_p, z_stride, _g2) = rows_ptr(op, "z", z_s, z_l, &stream)?;
    let (w_p, _g3) = ptr(op, "weight", w_s, w_l, &stream)?;
    let y_p = ptr(op, "y", &y, &Layout::contiguous(rows * dim), &stream)?.0;
    let esize = x_s.dtype().size_in_bytes() as u64;
    let rows_aligned = [z_stride as u64 * esize, dim as u64 * esize];
    let aligned = aligned16(&[x_p, z_p, w_p, y_p]) && aligned16(&rows_aligned);
    let (threads, kind) = row_program(group, aligned);
    let kernel = instances::gated_rms_norm(ty(op, x_s.dtype())?, kind);
    let f = function(&stream, IMAGE, &kernel)?;
    let params = NormParams {
        z_stride,
        dim: i(dim)?,
        group: i(group)?,
        eps,
    };
    let grid = [rows, dim / group, 1];
    launch(
        &stream,
        &f,
        cfg(op, &stream, grid, [threads, 1, 1], 0)?,
        &[&x_p, &z_p, &w_p, &y_p, &params],
    )?;
    written(&mut y, &stream)?;
    Ok(y)
}

/// Residual add + RMSNorm with the incoming residual (if any) and the new residual's dtype:
/// returns `(y, new residual)`, both of x's shape.
pub(super) fn add_rms_norm(
    (x_s, x_l): Input,
    (w_s, w_l): Input,
    (residual, residual_dtype): (Option<&Tensor>, DType),
    eps: f32,
) -> Result<(CudaStorage, CudaStorage)> {
    let op = "add_rms_norm";
    let dim = w_l.shape().elem_count();
    let rows = x_l.shape().elem_count() / dim;
    let len = rows * dim;
    let dev = &x_s.device;
    let stream = dev.cuda_stream();
    let mut y = alloc(dev, x_s.dtype(), len)?;
    let mut res_out = alloc(dev, residual_dtype, len)?;
    let residual = residual.map(Held::new);
    let mut guards = Guards::new();
    let (x_p, _g1) = ptr(op, "x", x_s, x_l, &stream)?;
    let (w_p, _g2) = ptr(op, "weight", w_s, w_l, &stream)?;
    let res_p = opt_ptr(op, "residual", &residual, &stream, &mut guards)?;
    let y_p = ptr(op, "y", &y, &Layout::contiguous(len), &stream)?.0;
    let ro_p = ptr(op, "residual", &res_out, &Layout::contiguous(len), &stream)?.0;
    let res_f32 = match residual_dtype {
        DType::F32 => true,
        dt if dt == x_s.dtype() => false,
        dt => bail!("{op}: residual must be f32 or x's dtype, got {dt:?}"),
    };
    let aligned = aligned16(&[x_p, w_p, y_p, res_p, ro_p]);
    let (threads, kind) = row_program(dim, aligned);
    let kernel = instances::add_rms_norm(ty(op, x_s.dtype())?, res_f32, kind);
    let f = function(&stream, IMAGE, &kernel)?;
    let params = NormParams {
        z_stride: 0,
        dim: i(dim)?,
        group: i(dim)?,
        eps,
    };
    launch(
        &stream,
        &f,
        cfg(op, &stream, [rows, 1, 1], [threads, 1, 1], 0)?,
        &[&x_p, &res_p, &w_p, &y_p, &ro_p, &params],
    )?;
    written(&mut y, &stream)?;
    written(&mut res_out, &stream)?;
    Ok((y, res_out))
}

/// The backward of a norm: the gradient of its input (x, or v), of the gate (the gated norm),
/// and the partial sums of dweight, one f32 row `[D]` per program, with their row count.
pub(super) struct NormGrads {
    pub dx: CudaStorage,
    pub dz: Option<CudaStorage>,
    pub parts: CudaStorage,
    pub programs: usize,
}

/// How a norm backward runs on `rows` rows of `dim` values in groups of `group`: threads per
/// program, kernel variant, programs per group, and the f32 partial sums of dweight they leave,
/// `[programs, dim]`, with its address.
struct BwdPlan {
    threads: usize,
    kind: instances::RowKind,
    programs: usize,
    parts: CudaStorage,
    parts_p: u64,
}

impl BwdPlan {
    fn new(
        op: &str,
        dev: &CudaDevice,
        stream: &Arc<CudaStream>,
        (rows, dim): (usize, usize),
        group: usize,
    ) -> Result<Self> {
        let (threads, kind) = bwd_row_program(group);
        let programs = bwd_programs(rows, dim / group, threads, sm_count(stream)?);
        let len = programs * dim;
        let parts = alloc(dev, DType::F32, len)?;
        let parts_p = ptr(op, "partial sums", &parts, &Layout::contiguous(len), stream)?.0;
        Ok(Self {
            threads,
            kind,
            programs,
            parts,
            parts_p,
        })
    }
}

/// The backward of the gated norm (`gate` its z) or of the plain RMSNorm of whole rows (`None`)
/// for the output gradient `dy` (contiguous) from the forward's input and weight; dz goes to
/// `dz_into` when given (the result's dz is then `None`).
pub(super) fn rms_norm_bwd(
    (x_s, x_l): Input,
    gate: Option<Input>,
    (w_s, w_l): Input,
    (dy_s, dy_l): Input,
    (group, eps): (usize, f32),
    dz_into: Option<Dest>,
) -> Result<NormGrads> {
    let op = if gate.is_some() {
        "gated_rms_norm backward"
    } else {
        "add_rms_norm backward"
    };
    let dtype = x_s.dtype();
    let others = [("weight", w_s), ("output gradient", dy_s)];
    for (name, s) in others.into_iter().chain(gate.map(|(z, _)| ("z", z))) {
        if s.dtype() != dtype {
            bail!("{op}: {name} is {:?}, x is {dtype:?}", s.dtype())
        }
    }
    let dim = w_l.shape().elem_count();
    if dim == 0 || group == 0 || dim % group != 0 {
        bail!("{op}: group size {group} must divide the row length {dim}")
    }
    let len = x_l.shape().elem_count();
    if len % dim != 0 || dy_l.shape().elem_count() != len {
        bail!(
            "{op}: x {:?} and the output gradient {:?} must be rows of the weight's {dim} values",
            x_l.dims(),
            dy_l.dims()
        )
    }
    let rows = len / dim;
    let dev = &x_s.device;
    let stream = dev.cuda_stream();
    let groups = dim / group;
    let BwdPlan {
        threads,
        kind,
        programs,
        mut parts,
        parts_p,
    } = BwdPlan::new(op, dev, &stream, (rows, dim), group)?;
    let mut dx = alloc(dev, dtype, len)?;
    let mut dz = match dz_into {
        Some(_) => None,
        None => gate.map(|_| alloc(dev, dtype, len)).transpose()?,
    };
    let (x_p, _g1) = ptr(op, "x", x_s, x_l, &stream)?;
    let (w_p, _g2) = ptr(op, "weight", w_s, w_l, &stream)?;
    let (dy_p, _g3) = ptr(op, "output gradient", dy_s, dy_l, &stream)?;
    let (z_p, z_stride, _g4) = match gate {
        Some((z_s, z_l)) => {
            let (p, stride, g) = rows_ptr(op, "z", z_s, z_l, &stream)?;
            (p, stride, Some(g))
        }
        None => (0, 0, None),
    };
    let out = Layout::contiguous(len);
    let dx_p = ptr(op, "dx", &dx, &out, &stream)?.0;
    let (dz_p, dz_stride) = match (&dz, dz_into) {
        (_, Some((p, stride))) => (p, stride),
        (Some(s), None) => (ptr(op, "dz", s, &out, &stream)?.0, dim as i64),
        (None, None) => (0, dim as i64),
    };
    let params = NormBwdParams {
        z_stride,
        rows: rows as i64,
        dim: i(dim)?,
        group: i(group)?,
        eps,
        dz_stride,
    };
    let t = ty(op, dtype)?;
    let config = cfg(op, &stream, [programs, groups, 1], [threads, 1, 1], 0)?;
    if gate.is_some() {
        let f = function(&stream, IMAGE, &instances::gated_rms_norm_bwd(t, kind))?;
        launch(
            &stream,
            &f,
            config,
            &[&x_p, &z_p, &w_p, &dy_p, &dx_p, &dz_p, &parts_p, &params],
        )?;
    } else {
        let f = function(&stream, IMAGE, &instances::rms_norm_bwd(t, kind))?;
        launch(
            &stream,
            &f,
            config,
            &[&x_p, &w_p, &dy_p, &dx_p, &parts_p, &params],
        )?;
    }
    written(&mut dx, &stream)?;
    if let Some(s) = dz.as_mut() {
        written(s, &stream)?;
    }
    written(&mut parts, &stream)?;
    Ok(NormGrads {
        dx,
        dz,
        parts,
        programs,
    })
}

/// The add norm's backward along the residual stream: the carried gradient plus d sum, in f32
/// (`dx` of the result) and rounded to dy's dtype (`dz` of the result), with the partial sums of
/// dweight.
pub(super) fn add_norm_bwd(
    (s_s, s_l): Input,
    (w_s, w_l): Input,
    (dy_s, dy_l): Input,
    carried: Option<Input>,
    eps: f32,
) -> Result<NormGrads> {
    let op = "add_rms_norm backward";
    let dtype = dy_s.dtype();
    if w_s.dtype() != dtype {
        bail!("{op}: weight is {:?}, dy is {dtype:?}", w_s.dtype())
    }
    for (name, s) in [
        ("sum", Some(s_s)),
        ("carried gradient", carried.map(|c| c.0)),
    ] {
        match s {
            Some(s) if s.dtype() != DType::F32 => bail!("{op}: {name} is {:?}, not f32", s.dtype()),
            _ => {}
        }
    }
    let dim = w_l.shape().elem_count();
    let len = s_l.shape().elem_count();
    let same = dy_l.shape().elem_count() == len
        && carried.is_none_or(|(_, l)| l.shape().elem_count() == len);
    if dim == 0 || len % dim != 0 || !same {
        bail!(
            "{op}: the sum {:?}, dy {:?} and the carried gradient must be rows of the weight's {dim} values",
            s_l.dims(),
            dy_l.dims()
        )
    }
    let rows = len / dim;
    let dev = &s_s.device;
    let stream = dev.cuda_stream();
    let BwdPlan {
        threads,
        kind,
        programs,
        mut parts,
        parts_p,
    } = BwdPlan::new(op, dev, &stream, (rows, dim), dim)?;
    let mut g_out = alloc(dev, DType::F32, len)?;
    let mut h = alloc(dev, dtype, len)?;
    let (s_p, _g1) = ptr(op, "sum", s_s, s_l, &stream)?;
    let (w_p, _g2) = ptr(op, "weight", w_s, w_l, &stream)?;
    let (dy_p, _g3) = ptr(op, "output gradient", dy_s, dy_l, &stream)?;
    let (c_p, _g4) = match carried {
        Some((c_s, c_l)) => {
            let (p, g) = ptr(op, "carried gradient", c_s, c_l, &stream)?;
            (p, Some(g))
        }
        None => (0, None),
    };
    let out = Layout::contiguous(len);
    let g_p = ptr(op, "gradient", &g_out, &out, &stream)?.0;
    let h_p = ptr(op, "rounded gradient", &h, &out, &stream)?.0;
    let params = NormBwdParams {
        z_stride: 0,
        rows: rows as i64,
        dim: i(dim)?,
        group: i(dim)?,
        eps,
        dz_stride: dim as i64,
    };
    let kernel = instances::add_norm_bwd(ty(op, dtype)?, instances::Ty::F32, kind);
    let f = function(&stream, IMAGE, &kernel)?;
    launch(
        &stream,
        &f,
        cfg(op, &stream, [programs, 1, 1], [threads, 1, 1], 0)?,
        &[&s_p, &w_p, &dy_p, &c_p, &g_p, &h_p, &parts_p, &params],
    )?;
    written(&mut g_out, &stream)?;
    written(&mut h, &stream)?;
    written(&mut parts, &stream)?;
    Ok(NormGrads {
        dx: g_out,
        dz: Some(h),
        parts,
        programs,
    })
}
