// The parameters of the conv kernels, passed by value. Mirrored by `ConvParams` and
// `ConvBwdParams` in src/conv/cuda.rs; both sides assert the same size and offsets, so a drift
// fails the build.
#pragma once
#include "common.cuh"

namespace m2 {

// The output pieces y0 [rows, s0], y1 [rows, s1] and y2 [rows, D − s0 − s1] (null when unused),
// the token-row stride of x (elements), the dimensions, whether SiLU is applied and, for
// sequences packed along L of one row, their count and offsets cu [seqs + 1] (null: none).
struct ConvParams {
  void* y0;
  void* y1;
  void* y2;
  long x_stride;
  int s0, s1;
  int batch, seqlen, dim, width;
  int silu;
  int seqs;
  const int* cu;
};
M2_SIZE(ConvParams, 72);
M2_AT(ConvParams, y0, 0);
M2_AT(ConvParams, y1, 8);
M2_AT(ConvParams, y2, 16);
M2_AT(ConvParams, x_stride, 24);
M2_AT(ConvParams, s0, 32);
M2_AT(ConvParams, s1, 36);
M2_AT(ConvParams, batch, 40);
M2_AT(ConvParams, seqlen, 44);
M2_AT(ConvParams, dim, 48);
M2_AT(ConvParams, width, 52);
M2_AT(ConvParams, silu, 56);
M2_AT(ConvParams, seqs, 60);
M2_AT(ConvParams, cu, 64);

// The backward's: the token-row stride of x (elements), the output gradient's
// pieces dy1 [rows, s1] and dy2 [rows, D − s0 − s1] beside dy0 [rows, s0] (the kernel's dy
// argument; s0 = D and no others when dy is whole), the dimensions, the tokens of one program
// (program y of batch b takes tokens [y·span, (y+1)·span) of it), whether SiLU is applied, and
// the token-row stride of dx (D, or wider when dx lands in a slice of a wider tensor).
struct ConvBwdParams {
  long x_stride;
  const void* dy1;
  const void* dy2;
  int batch, seqlen, dim, width;
  int span;
  int silu;
  int s0, s1;
  long dx_stride;
};
M2_SIZE(ConvBwdParams, 64);
M2_AT(ConvBwdParams, x_stride, 0);
M2_AT(ConvBwdParams, dy1, 8);
M2_AT(ConvBwdParams, dy2, 16);
M2_AT(ConvBwdParams, batch, 24);
M2_AT(ConvBwdParams, seqlen, 28);
M2_AT(ConvBwdParams, dim, 32);
M2_AT(ConvBwdParams, width, 36);
M2_AT(ConvBwdParams, span, 40);
M2_AT(ConvBwdParams, silu, 44);
M2_AT(ConvBwdParams, s0, 48);
M2_AT(ConvBwdParams, s1, 52);
M2_AT(ConvBwdParams, dx_stride, 56);

}  // namespace m2
