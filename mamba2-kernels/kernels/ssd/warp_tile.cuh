// Warp-level products of shared-memory tiles for the SSD backward: one warp accumulates a
// [16, 8·NJ] block of A·B in the m16n8 accumulator layout (lane l holds rows l/4 and l/4 + 8,
// columns 2·(l%4) and 2·(l%4) + 1 of every 8-column tile). Tiles are row-major with a padded
// row length `ld` (elements; a multiple of 8, so every row starts 16-byte aligned). A, logically
// [M, K], is stored as rows of M (`AK = false`: A[m][k]) or of K (`AK = true`: A[k][m]); B,
// logically [K, N], as rows of K (`BK = true`: B[k][n]) or of N (`BK = false`: B[n][k]).
// bf16/f16 tiles go through ldmatrix and mma.sync; f32 tiles through the same layout in f32 FMAs
// (exact f32 products, for the f32 path).
#pragma once
#include "common.cuh"

namespace m2 {

// Element (r, c) of the m16n8 accumulator of lane `lane` for e = 0..3.
__device__ __forceinline__ int acc_row(int lane, int e) { return (lane >> 2) + ((e >> 1) << 3); }
__device__ __forceinline__ int acc_col(int lane, int e) { return ((lane & 3) << 1) + (e & 1); }

template <typename T, bool AK, bool BK, int NJ>
struct WarpTile {
  // acc[j] += A[m0 .. m0+16, 0..K) · B[0..K, n0 + 8j .. n0 + 8j + 8), K a multiple of 16.
  __device__ __forceinline__ static void mma(float (&acc)[NJ][4], const T* a, int lda, const T* b,
                                             int ldb, int m0, int n0, int k_len, int lane) {
    static_assert(NJ % 2 == 0, "tiles come in pairs");
    for (int k0 = 0; k0 < k_len; k0 += 16) {
      uint32_t af[4];
      if (AK) {
        const int k = k0 + ((lane >> 4) << 3) + (lane & 7), m = m0 + (((lane >> 3) & 1) << 3);
        ldsm_x4_t(af, a + k * lda + m);
      } else {
        ldsm_x4(af, a + (m0 + (lane & 15)) * lda + k0 + ((lane >> 4) << 3));
      }
#pragma unroll
      for (int j = 0; j < NJ; j += 2) {
        uint32_t bf[4];
        const int i = lane >> 3;
        if (BK) {
          const int k = k0 + ((i & 1) << 3) + (lane & 7), n = n0 + 8 * j + ((i >> 1) << 3);
          ldsm_x4_t(bf, b + k * ldb + n);
        } else {
          const int n = n0 + 8 * j + ((i >> 1) << 3) + (lane & 7), k = k0 + ((i & 1) << 3);
          ldsm_x4(bf, b + n * ldb + k);
        }
        Mma<T>::run(acc[j], af, bf[0], bf[1]);
        Mma<T>::run(acc[j + 1], af, bf[2], bf[3]);
      }
    }
  }
};

template <bool AK, bool BK, int NJ>
struct WarpTile<float, AK, BK, NJ> {
  __device__ __forceinline__ static void mma(float (&acc)[NJ][4], const float* a, int lda,
                                             const float* b, int ldb, int m0, int n0, int k_len,
                                             int lane) {
    const int r0 = m0 + (lane >> 2), c0 = n0 + ((lane & 3) << 1);
    for (int k = 0; k < k_len; ++k) {
      const float a0 = AK ? a[k * lda + r0] : a[r0 * lda + k];
      const float a1 = AK ? a[k * lda + r0 + 8] : a[(r0 + 8) * lda + k];
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        const int c = c0 + 8 * j;
        const float b0 = BK ? b[k * ldb + c] : b[c * ldb + k];
        const float b1 = BK ? b[k * ldb + c + 1] : b[(c + 1) * ldb + k];
        acc[j][0] = fmaf(a0, b0, acc[j][0]);
        acc[j][1] = fmaf(a0, b1, acc[j][1]);
        acc[j][2] = fmaf(a1, b0, acc[j][2]);
        acc[j][3] = fmaf(a1, b1, acc[j][3]);
      }
    }
  }
};

template <int NJ>
__device__ __forceinline__ void zero(float (&acc)[NJ][4]) {
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
}

// Lane l's place after the pair swap of an m16n8 accumulator tile (`swap_quad`): four
// consecutive columns of one row, row quad_row(l) and columns from quad_col(l) of the tile.
__device__ __forceinline__ int quad_row(int lane) { return (lane >> 2) + ((lane & 1) << 3); }
__device__ __forceinline__ int quad_col(int lane) { return ((lane & 3) << 1) - ((lane & 1) << 1); }

// Lane pairs swap halves of their accumulator values v, so that each lane holds the four
// consecutive columns of one row (quad_row, quad_col) that a 16-byte access writes at once (as
// add_tile does).
__device__ __forceinline__ float4 swap_quad(const float (&v)[4], int lane) {
  const bool odd = lane & 1;
  const float s0 = odd ? v[0] : v[2], s1 = odd ? v[1] : v[3];
  const float q0 = __shfl_xor_sync(0xffffffffu, s0, 1), q1 = __shfl_xor_sync(0xffffffffu, s1, 1);
  return odd ? make_float4(q0, q1, v[2], v[3]) : make_float4(v[0], v[1], q0, q1);
}

// Adds (or, `!accumulate`, stores) one m16n8 accumulator tile at rows r0, r0 + 8 (of `ld`
// floats) from column c0 into f32 memory at `out`, rows from `rows` and columns from `cols` left
// out: lane pairs swap halves so that each lane holds four consecutive columns of one row, one
// 16-byte access (an atomic float4 on sm_90) where the columns and the row stride allow it.
__device__ __forceinline__ void add_tile(float* out, size_t ld, const float (&v)[4], int r0, int c0,
                                         int rows, int cols, bool accumulate, int lane) {
  const bool odd = lane & 1;
  const float s0 = odd ? v[0] : v[2], s1 = odd ? v[1] : v[3];
  const float q0 = __shfl_xor_sync(0xffffffffu, s0, 1), q1 = __shfl_xor_sync(0xffffffffu, s1, 1);
  const int r = r0 + (lane >> 2) + (odd ? 8 : 0);
  const int c = c0 + ((lane & 3) << 1) - (odd ? 2 : 0);
  const float w[4] = {odd ? q0 : v[0], odd ? q1 : v[1], odd ? v[2] : q0, odd ? v[3] : q1};
  if (r >= rows) return;
  float* p = out + r * ld + c;
  if (c + 3 < cols && ld % 4 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0) {
    const float4 f = make_float4(w[0], w[1], w[2], w[3]);
    if (!accumulate) {
      *reinterpret_cast<float4*>(p) = f;
      return;
    }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    atomicAdd(reinterpret_cast<float4*>(p), f);
    return;
#endif
  }
#pragma unroll
  for (int k = 0; k < 4; ++k)
    if (c + k < cols) {
      if (accumulate)
        atomicAdd(p + k, w[k]);
      else
        p[k] = w[k];
    }
}

// Sum over the four lanes of a quad (one accumulator row's lanes).
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Sum over the eight quads of a warp (one accumulator column's lanes).
__device__ __forceinline__ float column_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 4);
  v += __shfl_xor_sync(0xffffffffu, v, 8);
  return v + __shfl_xor_sync(0xffffffffu, v, 16);
}

// Rows [0, rows) × columns [0, cols) of a row-major global matrix (row stride `stride`
// elements) into a shared tile of row length `ld` (a multiple of 8), converted to T; the rest of
// the tile's `tile_rows` × `tile_cols` (a multiple of 8) is zero-filled. Where S is T and the
// width, the stride and the address allow 16-byte copies, they are cp.async copies left in flight
// (the caller's `stage_wait` completes them); else 16-byte or single-element loads through
// registers, a batch of U per thread before its first store (the stores could alias the loads as
// far as the compiler knows, which would otherwise serialise every load's latency). Each thread
// steps through the tile by (row, column) increments: no division per element.
template <typename T, typename S>
__device__ __forceinline__ void stage(T* dst, int ld, const S* src, size_t stride, int rows, int cols,
                                      int tile_rows, int tile_cols, int tid, int threads) {
  constexpr int V = 16 / sizeof(S), U = 8;
  const bool wide = cols % V == 0 && stride % V == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0;
  // Element i of the walk is (r, c) = (i / per_row, i % per_row) · (1, w): the thread's first, and
  // the step of `threads` elements.
  const int w = wide ? V : 1, per_row = tile_cols / w;
  const int dr = threads / per_row, dc = threads % per_row;
  int r = tid / per_row, c = tid % per_row;
  auto next = [&](int& rr, int& cc) {
    rr += dr;
    cc += dc;
    if (cc >= per_row) {
      cc -= per_row;
      ++rr;
    }
  };
  if constexpr (std::is_same<T, S>::value) {
    if (wide) {
      for (; r < tile_rows; next(r, c)) {
        const bool in = r < rows && c * V < cols;
        cp_async16(dst + r * ld + c * V, in ? src + r * stride + c * V : src, in);
      }
      return;
    }
  }
  while (r < tile_rows) {
    int rs[U], cs[U];
    if (wide) {
      uint4 raw[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        rs[u] = r;
        cs[u] = c * V;
        raw[u] = r < rows && c * V < cols
                     ? __ldg(reinterpret_cast<const uint4*>(src + r * stride + c * V))
                     : make_uint4(0, 0, 0, 0);
        next(r, c);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (rs[u] >= tile_rows) break;
        const S* v = reinterpret_cast<const S*>(&raw[u]);
        T* out = dst + rs[u] * ld + cs[u];
#pragma unroll
        for (int k = 0; k < V; ++k) out[k] = from_f<T>(to_f(v[k]));
      }
    } else {
      float v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        rs[u] = r;
        cs[u] = c;
        v[u] = r < rows && c < cols ? to_f(src[r * stride + c]) : 0.f;
        next(r, c);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (rs[u] >= tile_rows) break;
        dst[rs[u] * ld + cs[u]] = from_f<T>(v[u]);
      }
    }
  }
}

// Completes this thread's `stage` copies still in flight (the caller then synchronises the
// program before reading the tiles).
__device__ __forceinline__ void stage_wait() {
  cp_async_commit();
  cp_async_wait<0>();
}

// Scales row r of a shared [rows, cols] tile (row length `ld`, cols and ld multiples of 8, the
// tile 16-byte aligned) by scale[r], eight elements per step in 16-byte accesses: consecutive
// threads take consecutive 16 bytes of a row, so no two lanes of a quarter warp share a bank.
template <typename T>
__device__ __forceinline__ void scale_rows(T* tile, int ld, int rows, int cols, const float* scale,
                                           int tid, int threads) {
  constexpr int PER = 16 / sizeof(T);
  const int per_row = cols / 8;
  for (int i = tid; i < rows * per_row; i += threads) {
    const int r = i / per_row;
    uint4* p = reinterpret_cast<uint4*>(tile + r * ld + (i - r * per_row) * 8);
    const float f = scale[r];
#pragma unroll
    for (int h = 0; h < 8 / PER; ++h) {
      uint4 v = p[h];
      T* e = reinterpret_cast<T*>(&v);
#pragma unroll
      for (int k = 0; k < PER; ++k) e[k] = from_f<T>(to_f(e[k]) * f);
      p[h] = v;
    }
  }
}

}  // namespace m2
