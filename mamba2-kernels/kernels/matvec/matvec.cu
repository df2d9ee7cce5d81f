// y[r, n] = Σ_k x[r, k]·w[n, k] (+ bias[n]) for a few rows r: x [R,K], w [N,K], bias [N], y [R,N]
// (value type T), f32 accumulation. Program (column block, row block) owns columns n0 .. n0+COLS−1
// of y for rows r0 .. r0+ROWS−1 of x (ROWS = 1, 2, 4 or 8, the launch's row count rounded up;
// COLS = 8 or 2 for 1 and 2 rows, 4 and 2 for 4 and 8);
// its WARPS warps split K (warp w, lane l take the 8
// consecutive k at (w·32 + l)·8 + i·WARPS·256), so even a layer with few output columns (out_proj)
// has thousands of warps streaming w. Per step a lane loads 8 k of its COLS rows of w (16 bytes
// each, streamed past L1) and of its x rows; warp sums and a shared-memory sum over the warps form
// y. VEC needs K % 8 == 0 and 16-byte aligned x and w; the scalar kernel takes any K.
#include "params.cuh"

namespace {

constexpr int WARPS = 4;

template <typename T, int ROWS, int COLS, bool VEC>
__device__ void matvec(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ bias,
                       T* __restrict__ y, int rows, int K, int N) {
  __shared__ float part[WARPS][ROWS][COLS];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int n0 = blockIdx.x * COLS;
  const int r0 = blockIdx.y * ROWS, nr = min(ROWS, rows - r0);
  const T* xr = x + static_cast<size_t>(r0) * K;
  float acc[ROWS][COLS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int j = 0; j < COLS; ++j) acc[r][j] = 0.f;
  if constexpr (VEC) {
    for (int k = (warp * 32 + lane) * 8; k < K; k += WARPS * 256) {
      typename m2::Vec8<T>::Raw wr[COLS], xr8[ROWS];
#pragma unroll
      for (int j = 0; j < COLS; ++j)
        if (n0 + j < N) wr[j] = m2::Vec8<T>::load(w + static_cast<size_t>(n0 + j) * K + k, true);
#pragma unroll
      for (int r = 0; r < ROWS; ++r)
        if (r < nr) xr8[r] = m2::Vec8<T>::load(xr + static_cast<size_t>(r) * K + k, false);
#pragma unroll
      for (int j = 0; j < COLS; ++j) {
        if (n0 + j >= N) break;
        float wv[8];
        m2::Vec8<T>::unpack(wr[j], wv);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          if (r >= nr) break;
          float xv[8];
          m2::Vec8<T>::unpack(xr8[r], xv);
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[r][j] += xv[e] * wv[e];
        }
      }
    }
  } else {
    for (int k = warp * 32 + lane; k < K; k += WARPS * 32) {
      float wv[COLS];
#pragma unroll
      for (int j = 0; j < COLS; ++j)
        wv[j] = n0 + j < N ? m2::to_f(w[static_cast<size_t>(n0 + j) * K + k]) : 0.f;
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        if (r >= nr) break;
        const float xv = m2::to_f(xr[static_cast<size_t>(r) * K + k]);
#pragma unroll
        for (int j = 0; j < COLS; ++j) acc[r][j] += xv * wv[j];
      }
    }
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    if (r >= nr) break;
#pragma unroll
    for (int j = 0; j < COLS; ++j) {
      const float v = m2::warp_sum(acc[r][j]);
      if (lane == 0) part[warp][r][j] = v;
    }
  }
  __syncthreads();
  const int r = threadIdx.x / COLS, j = threadIdx.x % COLS;
  if (r < nr && n0 + j < N) {
    float v = bias ? m2::to_f(bias[n0 + j]) : 0.f;
#pragma unroll
    for (int q = 0; q < WARPS; ++q) v += part[q][r][j];
    y[static_cast<size_t>(r0 + r) * N + n0 + j] = m2::from_f<T>(v);
  }
}

}  // namespace

// The kernels, instantiated from the list in src/instances.rs (matvec.inc).
#define MATVEC(NAME, T, R, C, VEC)                                                             \
  extern "C" __global__ void NAME(const T* x, const T* w, const T* bias, T* y,                 \
                                  m2::MatvecParams p) {                                        \
    m2::wait_prior_grid();                                                                     \
    matvec<T, R, C, VEC>(x, w, bias, y, p.rows, p.k, p.n);                                     \
  }
#include "matvec/matvec.inc"
