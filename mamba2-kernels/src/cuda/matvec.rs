//! Launcher of the few-row linear layer: a program of 4 warps (splitting K) per few columns of y
//! and 1, 2, 4 or 8 rows of x (the launch's row count rounded up); the vector kernel when
//! K % 8 == 0 and x and w are 16-byte aligned.

use candle_core::backend::BackendStorage;
use candle_core::{CudaStorage, Layout, Result, Shape};

use super::{
    alloc, cfg, dtype_name, function, i, launch, opt_ptr, ptr, sm_count, written, Guards, Held,
    MATVEC,
};
use crate::matvec::Matvec;

const WARPS: usize = 4;

/// Columns of y per program for `rows` rows of x per program: 8 (more 16-byte loads in flight per
/// lane) while that still makes ≥ 4 programs per SM, else 2; 4 and 2 at 4 and 8 rows (registers).
fn cols_per_program(rows: usize, n: usize, sms: usize) -> usize {
    match rows {
        1 | 2 if n / 8 >= 4 * sms => 8,
        1 | 2 => 2,
        4 => 4,
        _ => 2,
    }
}

pub(crate) fn matvec(
    op: &Matvec,
    x_s: &CudaStorage,
    x_l: &Layout,
    w_s: &CudaStorage,
    w_l: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let name = "matvec";
    let (rows, k) = x_l.shape().dims2()?;
    let n = w_l.shape().dims2()?.0;
    let dev = &x_s.device;
    let stream = dev.cuda_stream();
    let mut y = alloc(dev, x_s.dtype(), rows * n)?;
    let bias = op.bias.as_ref().map(Held::new);
    let mut guards = Guards::new();
    let (x_p, _g1) = ptr(name, "x", x_s, x_l, &stream)?;
    let (w_p, _g2) = ptr(name, "w", w_s, w_l, &stream)?;
    let bias_p = opt_ptr(name, "bias", &bias, &stream, &mut guards)?;
    let y_p = ptr(name, "y", &y, &Layout::contiguous(rows * n), &stream)?.0;
    let vec = k % 8 == 0 && x_p % 16 == 0 && w_p % 16 == 0;
    let per_program = rows.next_power_of_two().min(8);
    let cols = cols_per_program(per_program, n, sm_count(&stream)?);
    let f = function(
        &stream,
        MATVEC,
        &format!(
            "matvec_{}_r{per_program}_c{cols}_{}",
            dtype_name(name, x_s.dtype())?,
            if vec { "vec" } else { "scalar" }
        ),
    )?;
    let grid = (
        n.div_ceil(cols) as u32,
        rows.div_ceil(per_program) as u32,
        1,
    );
    let (r, kk, nn) = (i(rows)?, i(k)?, i(n)?);
    launch(
        &stream,
        &f,
        cfg(grid, (32 * WARPS as u32, 1, 1), 0),
        &[&x_p, &w_p, &bias_p, &y_p, &r, &kk, &nn],
    )?;
    written(&mut y, &stream)?;
    Ok((y, Shape::from((rows, n))))
}
