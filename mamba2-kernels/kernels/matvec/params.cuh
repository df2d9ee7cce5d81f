// The parameters of the matvec kernels, passed by value. Mirrored by `MatvecParams` in
// src/matvec/cuda.rs; both sides assert the same size and offsets, so a drift fails the build.
#pragma once
#include "common.cuh"

namespace m2 {

// x [rows, k], w [n, k], y [rows, n].
struct MatvecParams {
  int rows, k, n;
};
M2_SIZE(MatvecParams, 12);
M2_AT(MatvecParams, rows, 0);
M2_AT(MatvecParams, k, 4);
M2_AT(MatvecParams, n, 8);

}  // namespace m2
