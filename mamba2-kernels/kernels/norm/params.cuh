// The parameters of the norm kernels, passed by value. Mirrored by `NormParams` and
// `NormBwdParams` in src/norm/cuda.rs; both sides assert the same size and offsets, so a drift
// fails the build.
#pragma once
#include "common.cuh"

namespace m2 {

// Row length D, channels per normalised group (the gated norm; D for the add norm), the row
// stride of z (elements; the gated norm, whose z may be a slice of a wider tensor), and eps.
struct NormParams {
  long z_stride;
  int dim, group;
  float eps;
};
M2_SIZE(NormParams, 24);
M2_AT(NormParams, z_stride, 0);
M2_AT(NormParams, dim, 8);
M2_AT(NormParams, group, 12);
M2_AT(NormParams, eps, 16);

// The backward's: the row stride of z (the gated norm; x, dy and dx are contiguous), the row
// count, the row length, the channels per normalised group (D for the plain norm), eps, and the
// row stride of dz (the gated norm; D, or wider when dz lands in a slice of a wider tensor).
struct NormBwdParams {
  long z_stride;
  long rows;
  int dim, group;
  float eps;
  long dz_stride;
};
M2_SIZE(NormBwdParams, 40);
M2_AT(NormBwdParams, z_stride, 0);
M2_AT(NormBwdParams, rows, 8);
M2_AT(NormBwdParams, dim, 16);
M2_AT(NormBwdParams, group, 20);
M2_AT(NormBwdParams, eps, 24);
M2_AT(NormBwdParams, dz_stride, 32);

}  // namespace m2
