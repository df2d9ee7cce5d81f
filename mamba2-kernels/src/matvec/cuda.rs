//! Launcher of `kernels/matvec/matvec.cu`: a program of `plan::WARPS` warps (splitting K) per few
//! columns of y and 1, 2, 4 or 8 rows of x; the vector kernel when K % 8 == 0 and x and w are
//! 16-byte aligned.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::DeviceRepr;
use candle_core::{CudaStorage, Layout, Result, Shape, Tensor};

use super::plan;
use crate::cuda::{alloc, cfg, fatbin, function, i, launch, m2_layout, opt_ptr, ptr, sm_count};
use crate::cuda::{ty, written, Guards, Held, Image};
use crate::instances;

const IMAGE: Image = fatbin!("matvec_matvec");

/// `m2::MatvecParams` (`kernels/matvec/params.cuh`): x `[rows, k]`, w `[n, k]`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct MatvecParams {
    rows: i32,
    k: i32,
    n: i32,
}
m2_layout!(MatvecParams, 12, { rows: 0, k: 4, n: 8 });
// SAFETY: plain old data with the C struct's layout (asserted above).
unsafe impl DeviceRepr for MatvecParams {}

/// `y [R,N] = x [R,K] · w [N,K]ᵀ (+ bias)`.
pub(super) fn matvec(
    (x_s, x_l): (&CudaStorage, &Layout),
    (w_s, w_l): (&CudaStorage, &Layout),
    bias: Option<&Tensor>,
) -> Result<(CudaStorage, Shape)> {
    let name = "matvec";
    let (rows, k) = x_l.shape().dims2()?;
    let n = w_l.shape().dims2()?.0;
    let dev = &x_s.device;
    let stream = dev.cuda_stream();
    let mut y = alloc(dev, x_s.dtype(), rows * n)?;
    let bias = bias.map(Held::new);
    let mut guards = Guards::new();
    let (x_p, _g1) = ptr(name, "x", x_s, x_l, &stream)?;
    let (w_p, _g2) = ptr(name, "w", w_s, w_l, &stream)?;
    let bias_p = opt_ptr(name, "bias", &bias, &stream, &mut guards)?;
    let y_p = ptr(name, "y", &y, &Layout::contiguous(rows * n), &stream)?.0;
    let vec = k % 8 == 0 && x_p % 16 == 0 && w_p % 16 == 0;
    let per_program = plan::rows_per_program(rows);
    let cols = plan::cols_per_program(per_program, n, sm_count(&stream)?);
    let kernel = instances::matvec(ty(name, x_s.dtype())?, per_program, cols, vec);
    let f = function(&stream, IMAGE, &kernel)?;
    let grid = [n.div_ceil(cols), rows.div_ceil(per_program), 1];
    let params = MatvecParams {
        rows: i(rows)?,
        k: i(k)?,
        n: i(n)?,
    };
    launch(
        &stream,
        &f,
        cfg(name, &stream, grid, [32 * plan::WARPS, 1, 1], 0)?,
        &[&x_p, &w_p, &bias_p, &y_p, &params],
    )?;
    written(&mut y, &stream)?;
    Ok((y, Shape::from((rows, n))))
}
