// The parameters of the decode step's kernels, passed by value. Mirrored by `StepParams` in
// src/ssd_step/cuda.rs; both sides assert the same size and offsets, so a drift fails the build.
#pragma once
#include "common.cuh"

namespace m2 {

// Dimensions, dt processing (softplus, clamp to [lo, hi]), D per channel (1) or per head (0),
// state rows per program, and the batch strides (elements) of x, dt, b, c and z, whose rows may
// be slices of a wider tensor.
struct StepParams {
  int batch, nheads, headdim, ngroups, dstate, softplus, d_per_channel, rows_per_block;
  float lo, hi;
  long x_stride, dt_stride, b_stride, c_stride, z_stride;
};
M2_SIZE(StepParams, 80);
M2_AT(StepParams, batch, 0);
M2_AT(StepParams, nheads, 4);
M2_AT(StepParams, headdim, 8);
M2_AT(StepParams, ngroups, 12);
M2_AT(StepParams, dstate, 16);
M2_AT(StepParams, softplus, 20);
M2_AT(StepParams, d_per_channel, 24);
M2_AT(StepParams, rows_per_block, 28);
M2_AT(StepParams, lo, 32);
M2_AT(StepParams, hi, 36);
M2_AT(StepParams, x_stride, 40);
M2_AT(StepParams, dt_stride, 48);
M2_AT(StepParams, b_stride, 56);
M2_AT(StepParams, c_stride, 64);
M2_AT(StepParams, z_stride, 72);

}  // namespace m2
