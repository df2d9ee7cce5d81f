// Rows of a batch written, in place, to the rows an index names:
//   dst[rows[r], :] = src[r, :]        src [R, words], dst [S, words] of W-byte words, rows [R] u32
// The rows are distinct (checked on the host), so no two writes meet. Program (x, y) moves words
// x·THREADS·PER .. of rows y, y + gridDim.y, …; each thread PER words THREADS apart, all loaded
// before the first store (coalesced, PER loads in flight).
#include "common.cuh"

namespace {

constexpr int THREADS = 256, PER = 4;

template <typename W>
__device__ void scatter_rows(W* dst, const W* src, const uint32_t* rows, int n, long words) {
  m2::wait_prior_grid();
  const long w0 = static_cast<long>(blockIdx.x) * THREADS * PER + threadIdx.x;
  for (int r = blockIdx.y; r < n; r += gridDim.y) {
    const W* s = src + r * words;
    W* d = dst + static_cast<long>(rows[r]) * words;
    W v[PER];
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      const long w = w0 + k * THREADS;
      if (w < words) v[k] = s[w];
    }
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      const long w = w0 + k * THREADS;
      if (w < words) d[w] = v[k];
    }
  }
}

}  // namespace

#define SCATTER_ROWS(NAME, W)                                                                  \
  extern "C" __global__ void __launch_bounds__(THREADS)                                        \
      NAME(W* dst, const W* src, const uint32_t* rows, int n, long words) {                    \
    scatter_rows<W>(dst, src, rows, n, words);                                                 \
  }
#include "rows/rows.inc"
