// The cross-entropy of logit rows against target ids, one program of 256 threads per row:
//   lse_r = log Σ_v exp(x[r,v])          nll_r = lse_r − x[r, t_r]      (NaN when t_r ∉ 0..V)
//   dx[r,v] = g_r·(exp(x[r,v] − lse_r) − [v = t_r])
// x and dx of type T with rows of V contiguous values, ids of type I (u32 or i64), g and nll
// f32, arithmetic in f32. With `vec` (V·sizeof(T) and the base 16-byte aligned) a thread moves
// 16 bytes at a time. The backward computes lse_r again from its row, whose second read hits
// L2, instead of keeping it from the forward: the op then holds nothing between the two.
#include "common.cuh"

namespace {

constexpr int THREADS = 256;

// (m, s) ← the (max, Σ exp(x − max)) of the values of (m, s) and of (m2, s2).
__device__ __forceinline__ void merge(float& m, float& s, float m2, float s2) {
  const float mx = fmaxf(m, m2);
  if (mx == -INFINITY) return;  // both empty
  s = s * __expf(m - mx) + s2 * __expf(m2 - mx);
  m = mx;
}

// Folds n values of f into (m, s).
template <int N>
__device__ __forceinline__ void fold(float& m, float& s, const float (&f)[N]) {
  float mc = f[0];
#pragma unroll
  for (int k = 1; k < N; ++k) mc = fmaxf(mc, f[k]);
  float sc = 0.f;
#pragma unroll
  for (int k = 0; k < N; ++k) sc += __expf(f[k] - mc);
  merge(m, s, mc, sc);
}

template <typename T, int N>
__device__ __forceinline__ void load16(const T* p, float (&f)[N]) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
  for (int k = 0; k < N; ++k) f[k] = m2::to_f(e[k]);
}

template <typename T, int N>
__device__ __forceinline__ void store16(T* p, const float (&f)[N]) {
  uint4 u;
  T* e = reinterpret_cast<T*>(&u);
#pragma unroll
  for (int k = 0; k < N; ++k) e[k] = m2::from_f<T>(f[k]);
  *reinterpret_cast<uint4*>(p) = u;
}

// log Σ exp of the row, in every thread of the program.
template <typename T>
__device__ float row_lse(const T* x, int V, bool vec) {
  constexpr int N = 16 / sizeof(T);
  float m = -INFINITY, s = 0.f;
  if (vec) {
    for (int v = threadIdx.x * N; v < V; v += THREADS * N) {
      float f[N];
      load16(x + v, f);
      fold(m, s, f);
    }
  } else {
    for (int v = threadIdx.x; v < V; v += THREADS) {
      const float f[1] = {m2::to_f(x[v])};
      fold(m, s, f);
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2v = __shfl_xor_sync(0xffffffffu, m, o);
    const float s2v = __shfl_xor_sync(0xffffffffu, s, o);
    merge(m, s, m2v, s2v);
  }
  __shared__ float wm[THREADS / 32], ws[THREADS / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    wm[warp] = m;
    ws[warp] = s;
  }
  __syncthreads();
  m = wm[0];
  s = ws[0];
#pragma unroll
  for (int w = 1; w < THREADS / 32; ++w) merge(m, s, wm[w], ws[w]);
  return m + __logf(s);
}

template <typename I>
__device__ __forceinline__ long target(const I* t, long r, int V) {
  const long id = static_cast<long>(t[r]);
  return id >= 0 && id < V ? id : -1;
}

template <typename T, typename I>
__device__ void nll_rows(const T* x, const I* t, float* nll, int V, bool vec) {
  m2::wait_prior_grid();
  const long r = blockIdx.x;
  const T* row = x + r * V;
  const float lse = row_lse(row, V, vec);
  if (threadIdx.x == 0) {
    const long id = target(t, r, V);
    nll[r] = id >= 0 ? lse - m2::to_f(row[id]) : NAN;
  }
}

template <typename T, typename I>
__device__ void dlogits(const T* x, const I* t, const float* g, T* dx, int V, bool vec) {
  constexpr int N = 16 / sizeof(T);
  m2::wait_prior_grid();
  const long r = blockIdx.x;
  const T* row = x + r * V;
  T* drow = dx + r * V;
  const float lse = row_lse(row, V, vec);
  const long id = target(t, r, V);
  const float gr = g[r];
  if (vec) {
    for (int v = threadIdx.x * N; v < V; v += THREADS * N) {
      float f[N];
      load16(row + v, f);
#pragma unroll
      for (int k = 0; k < N; ++k) f[k] = gr * (__expf(f[k] - lse) - (v + k == id ? 1.f : 0.f));
      store16(drow + v, f);
    }
  } else {
    for (int v = threadIdx.x; v < V; v += THREADS) {
      const float p = __expf(m2::to_f(row[v]) - lse);
      drow[v] = m2::from_f<T>(gr * (p - (v == id ? 1.f : 0.f)));
    }
  }
}

}  // namespace

#define NLL_ROWS(NAME, T, I)                                                                  \
  extern "C" __global__ void __launch_bounds__(THREADS)                                       \
      NAME(const T* x, const I* t, float* nll, int V, int vec) {                              \
    nll_rows<T, I>(x, t, nll, V, vec != 0);                                                   \
  }
#define DLOGITS(NAME, T, I)                                                                   \
  extern "C" __global__ void __launch_bounds__(THREADS)                                       \
      NAME(const T* x, const I* t, const float* g, T* dx, int V, int vec) {                   \
    dlogits<T, I>(x, t, g, dx, V, vec != 0);                                                  \
  }
#include "loss/cross_entropy.inc"
