// The two RMSNorms of a Mamba-2 block, one program per row (per group for the gated one), up to
// 1024 threads each:
//   gated:  g = x·silu(z),  y = g / sqrt(mean_group(g²) + eps) · w      (mamba_ssm RMSNormGated)
//   add:    r = x + residual, y = r / sqrt(mean(r²) + eps) · w, and r is the new residual
// x, z, y and w of type T; z rows may be strided (a slice of in_proj's output); the residual is
// f32 or T (R). Arithmetic in f32; y of the add norm comes from the f32 sum, not the rounded r.
#include "params.cuh"

namespace {

__device__ __forceinline__ float block_sum(float v, float* red) {
  v = m2::warp_sum(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float s = lane < warps ? red[lane] : 0.f;
  return m2::warp_sum(s);
}

// The values f(i) and weights w[i] of a row's elements tid + j·blockDim (j < V) into registers,
// 0 from `len` on; returns the thread's sum of squares of the values.
template <int V, typename T, typename F>
__device__ __forceinline__ float gather(F f, const T* __restrict__ w, int len, float (&v)[V],
                                        float (&wv)[V]) {
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int i = threadIdx.x + j * blockDim.x;
    v[j] = i < len ? f(i) : 0.f;
    wv[j] = i < len ? m2::to_f(w[i]) : 0.f;
    ss += v[j] * v[j];
  }
  return ss;
}

// A row of `len` values, element i at thread i % blockDim, slot i / blockDim: with V > 0 the
// blockDim·V values (and their weights) stay in registers between the sum of squares and the
// output, so every global load of the row is issued up front (one memory round trip per row, which at decode's single
// row is the kernel's whole cost); V = 0 re-reads the row (any length).
template <typename T, int V>
__device__ void gated_rms_norm(const T* __restrict__ x, const T* __restrict__ z,
                               const T* __restrict__ w, T* __restrict__ y, int D, int group,
                               long z_stride, float eps) {
  __shared__ float red[32];
  const long row = blockIdx.x;
  const int g0 = blockIdx.y * group;
  const T* xr = x + row * D + g0;
  const T* zr = z + row * z_stride + g0;
  T* yr = y + row * D + g0;
  auto gate = [&](int i) { return m2::to_f(xr[i]) * m2::silu(m2::to_f(zr[i])); };
  float ss = 0.f;
  if constexpr (V > 0) {
    float g[V], wv[V];
    ss = gather<V>(gate, w + g0, group, g, wv);
    const float scale = rsqrtf(block_sum(ss, red) / group + eps);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int i = threadIdx.x + j * blockDim.x;
      if (i < group) yr[i] = m2::from_f<T>(g[j] * scale * wv[j]);
    }
  } else {
    for (int i = threadIdx.x; i < group; i += blockDim.x) {
      const float g = gate(i);
      ss += g * g;
    }
    const float scale = rsqrtf(block_sum(ss, red) / group + eps);
    for (int i = threadIdx.x; i < group; i += blockDim.x)
      yr[i] = m2::from_f<T>(gate(i) * scale * m2::to_f(w[g0 + i]));
  }
}

template <typename T, typename R, int V>
__device__ void add_rms_norm(const T* __restrict__ x, const R* __restrict__ res,
                             const T* __restrict__ w, T* __restrict__ y, R* __restrict__ res_out,
                             int D, float eps) {
  __shared__ float red[32];
  const long row = blockIdx.x;
  const T* xr = x + row * D;
  const R* rr = res ? res + row * D : nullptr;
  auto sum = [&](int i) { return m2::to_f(xr[i]) + (rr ? m2::to_f(rr[i]) : 0.f); };
  float ss = 0.f;
  if constexpr (V > 0) {
    float r[V], wv[V];
    ss = gather<V>(sum, w, D, r, wv);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int i = threadIdx.x + j * blockDim.x;
      if (i < D) res_out[row * D + i] = m2::from_f<R>(r[j]);
    }
    const float scale = rsqrtf(block_sum(ss, red) / D + eps);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int i = threadIdx.x + j * blockDim.x;
      if (i < D) y[row * D + i] = m2::from_f<T>(r[j] * scale * wv[j]);
    }
  } else {
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
      const float r = sum(i);
      res_out[row * D + i] = m2::from_f<R>(r);
      ss += r * r;
    }
    const float scale = rsqrtf(block_sum(ss, red) / D + eps);
    for (int i = threadIdx.x; i < D; i += blockDim.x)
      y[row * D + i] = m2::from_f<T>(sum(i) * scale * m2::to_f(w[i]));
  }
}

// The row in registers as 8 consecutive values per thread (16-byte accesses; len % 8 == 0,
// len ≤ 8·blockDim, every row 16-byte aligned).
template <typename T>
__device__ void gated_rms_norm_vec(const T* __restrict__ x, const T* __restrict__ z,
                                   const T* __restrict__ w, T* __restrict__ y, int D, int group,
                                   long z_stride, float eps) {
  __shared__ float red[32];
  const long row = blockIdx.x;
  const int g0 = blockIdx.y * group, i = threadIdx.x * 8;
  const bool live = i < group;
  float g[8], wv[8], ss = 0.f;
  if (live) {
    float xv[8], zv[8];
    m2::Vec8<T>::unpack(m2::Vec8<T>::load(x + row * D + g0 + i, false), xv);
    m2::Vec8<T>::unpack(m2::Vec8<T>::load(z + row * z_stride + g0 + i, false), zv);
    m2::Vec8<T>::unpack(m2::Vec8<T>::load(w + g0 + i, false), wv);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      g[e] = xv[e] * m2::silu(zv[e]);
      ss += g[e] * g[e];
    }
  }
  const float scale = rsqrtf(block_sum(ss, red) / group + eps);
  if (live) {
#pragma unroll
    for (int e = 0; e < 8; ++e) g[e] *= scale * wv[e];
    m2::Vec8<T>::store(y + row * D + g0 + i, g);
  }
}

template <typename T, typename R>
__device__ void add_rms_norm_vec(const T* __restrict__ x, const R* __restrict__ res,
                                 const T* __restrict__ w, T* __restrict__ y,
                                 R* __restrict__ res_out, int D, float eps) {
  __shared__ float red[32];
  const long row = blockIdx.x;
  const int i = threadIdx.x * 8;
  const bool live = i < D;
  float r[8], wv[8], ss = 0.f;
  if (live) {
    m2::Vec8<T>::unpack(m2::Vec8<T>::load(x + row * D + i, false), r);
    m2::Vec8<T>::unpack(m2::Vec8<T>::load(w + i, false), wv);
    if (res) {
      float rv[8];
      m2::Vec8<R>::unpack(m2::Vec8<R>::load(res + row * D + i, false), rv);
#pragma unroll
      for (int e = 0; e < 8; ++e) r[e] += rv[e];
    }
    m2::Vec8<R>::store(res_out + row * D + i, r);
#pragma unroll
    for (int e = 0; e < 8; ++e) ss += r[e] * r[e];
  }
  const float scale = rsqrtf(block_sum(ss, red) / D + eps);
  if (live) {
#pragma unroll
    for (int e = 0; e < 8; ++e) r[e] *= scale * wv[e];
    m2::Vec8<T>::store(y + row * D + i, r);
  }
}

}  // namespace

// The kernels, instantiated from the list in src/instances.rs (rms_norm.inc); R is the
// residual's type, V the values per thread held in registers (0: the row is re-read).
#define GATED_NORM(NAME, T, V)                                                                 \
  extern "C" __global__ void NAME(const T* x, const T* z, const T* w, T* y, m2::NormParams p) { \
    m2::wait_prior_grid();                                                                     \
    gated_rms_norm<T, V>(x, z, w, y, p.dim, p.group, p.z_stride, p.eps);                       \
  }
#define GATED_NORM_VEC(NAME, T)                                                                \
  extern "C" __global__ void NAME(const T* x, const T* z, const T* w, T* y, m2::NormParams p) { \
    m2::wait_prior_grid();                                                                     \
    gated_rms_norm_vec<T>(x, z, w, y, p.dim, p.group, p.z_stride, p.eps);                      \
  }
#define ADD_NORM(NAME, T, R, V)                                                                \
  extern "C" __global__ void NAME(const T* x, const R* res, const T* w, T* y, R* res_out,      \
                                  m2::NormParams p) {                                          \
    m2::wait_prior_grid();                                                                     \
    add_rms_norm<T, R, V>(x, res, w, y, res_out, p.dim, p.eps);                                \
  }
#define ADD_NORM_VEC(NAME, T, R)                                                               \
  extern "C" __global__ void NAME(const T* x, const R* res, const T* w, T* y, R* res_out,      \
                                  m2::NormParams p) {                                          \
    m2::wait_prior_grid();                                                                     \
    add_rms_norm_vec<T, R>(x, res, w, y, res_out, p.dim, p.eps);                               \
  }
#include "norm/rms_norm.inc"
