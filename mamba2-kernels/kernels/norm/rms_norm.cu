// The two RMSNorms of a Mamba-2 block, one program per row (per group for the gated one), up to
// 1024 threads each:
//   gated:  g = x·silu(z),  y = g / sqrt(mean_group(g²) + eps) · w      (mamba_ssm RMSNormGated)
//   add:    r = x + residual, y = r / sqrt(mean(r²) + eps) · w, and r is the new residual
// x, z, y and w of type T; z rows may be strided (a slice of in_proj's output); the residual is
// f32 or T (R). Arithmetic in f32; y of the add norm comes from the f32 sum, not the rounded r.
// The backwards of the gated norm and of the plain RMSNorm (g = v; add_rms_norm's recorded half),
// with r = 1/sqrt(mean_group(g²) + eps):
//   dg = r·w·dy − g·r³·mean_group(g·w·dy)      dw = Σ_rows dy·g·r
//   dx = dg·silu(z)      dz = dg·x·silu'(z),   silu'(z) = σ(z)·(1 + z·(1 − σ(z)))
// Program (i, j) takes group j of rows i, i + gridDim.x, …: it leaves its sums of dw as row i
// of `part` [gridDim.x, D] (f32); the rows are summed after the kernel.
#include "params.cuh"

namespace {

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
    const float scale = rsqrtf(m2::block_sum(ss, red) / group + eps);
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
    const float scale = rsqrtf(m2::block_sum(ss, red) / group + eps);
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
    const float scale = rsqrtf(m2::block_sum(ss, red) / D + eps);
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
    const float scale = rsqrtf(m2::block_sum(ss, red) / D + eps);
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
  const float scale = rsqrtf(m2::block_sum(ss, red) / group + eps);
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
  const float scale = rsqrtf(m2::block_sum(ss, red) / D + eps);
  if (live) {
#pragma unroll
    for (int e = 0; e < 8; ++e) r[e] *= scale * wv[e];
    m2::Vec8<T>::store(y + row * D + i, r);
  }
}

// Two block-wide sums at once.
__device__ __forceinline__ float2 block_sum2(float a, float b, float2* red) {
  a = m2::warp_sum(a);
  b = m2::warp_sum(b);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  __syncthreads();
  if (lane == 0) red[warp] = make_float2(a, b);
  __syncthreads();
  const float2 s = lane < warps ? red[lane] : make_float2(0.f, 0.f);
  return make_float2(m2::warp_sum(s.x), m2::warp_sum(s.y));
}

// The gradients of one element from its input x (and gate z when GATED), output gradient dy,
// weight wv and the group's r and c = r³·mean(g·w·dy): dx (and dz) written at i of the rows dxr
// (dzr); returns its term of dw.
template <typename T, bool GATED>
__device__ __forceinline__ float norm_grad(float x, float z, float dy, float wv, float r, float c,
                                           T* dxr, T* dzr, int i) {
  if constexpr (GATED) {
    const float s = __fdividef(1.f, 1.f + __expf(-z)), g = x * z * s;
    const float dg = r * wv * dy - g * c;
    dxr[i] = m2::from_f<T>(dg * z * s);
    dzr[i] = m2::from_f<T>(dg * x * s * (1.f + z * (1.f - s)));
    return dy * g * r;
  } else {
    dxr[i] = m2::from_f<T>(r * wv * dy - x * c);
    return dy * x * r;
  }
}

// The backward of one group per program over the program's rows (see the top). V > 0: element i
// at thread i % blockDim, slot i / blockDim, the group's values held in registers between the
// sums and the gradients (the weights are read again, from cache), its dw sums for all rows;
// V = 0: the row is re-read and the dw sums accumulate in the program's row of `part` (any
// length).
template <typename T, int V, bool GATED>
__device__ void rms_norm_bwd(const T* __restrict__ x, const T* __restrict__ z,
                             const T* __restrict__ w, const T* __restrict__ dy, T* __restrict__ dx,
                             T* __restrict__ dz, float* __restrict__ part,
                             const m2::NormBwdParams& p) {
  __shared__ float2 red[32];
  const int D = p.dim, group = p.group, g0 = blockIdx.y * group;
  const float inv = 1.f / group;
  float* pr = part + static_cast<long>(blockIdx.x) * D + g0;
  const T* wg = w + g0;
  // x·silu(z) with the sigmoid as norm_grad takes it (a fast reciprocal, no division).
  auto gate = [](float xv, float zv) {
    return GATED ? xv * zv * __fdividef(1.f, 1.f + __expf(-zv)) : xv;
  };
  if constexpr (V > 0) {
    float acc[V];
#pragma unroll
    for (int j = 0; j < V; ++j) acc[j] = 0.f;
    for (long row = blockIdx.x; row < p.rows; row += gridDim.x) {
      const T* xr = x + row * D + g0;
      const T* zr = GATED ? z + row * p.z_stride + g0 : nullptr;
      const T* dyr = dy + row * D + g0;
      float xv[V], zv[V], dv[V], ss = 0.f, sd = 0.f;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        const bool live = i < group;
        xv[j] = live ? m2::to_f(xr[i]) : 0.f;
        zv[j] = GATED && live ? m2::to_f(zr[i]) : 0.f;
        dv[j] = live ? m2::to_f(dyr[i]) : 0.f;
        const float g = gate(xv[j], zv[j]);
        ss += g * g;
        sd += live ? g * m2::to_f(wg[i]) * dv[j] : 0.f;
      }
      const float2 s = block_sum2(ss, sd, red);
      const float r = rsqrtf(s.x * inv + p.eps), c = r * r * r * s.y * inv;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i < group)
          acc[j] += norm_grad<T, GATED>(xv[j], zv[j], dv[j], m2::to_f(wg[i]), r, c,
                                        dx + row * D + g0, GATED ? dz + row * p.dz_stride + g0 : nullptr, i);
      }
    }
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int i = threadIdx.x + j * blockDim.x;
      if (i < group) pr[i] = acc[j];
    }
  } else {
    // The thread alone writes its elements of the row: they accumulate in place.
    for (int i = threadIdx.x; i < group; i += blockDim.x) pr[i] = 0.f;
    for (long row = blockIdx.x; row < p.rows; row += gridDim.x) {
      const T* xr = x + row * D + g0;
      const T* zr = GATED ? z + row * p.z_stride + g0 : nullptr;
      const T* dyr = dy + row * D + g0;
      auto zv = [&](int i) { return GATED ? m2::to_f(zr[i]) : 0.f; };
      float ss = 0.f, sd = 0.f;
      for (int i = threadIdx.x; i < group; i += blockDim.x) {
        const float g = gate(m2::to_f(xr[i]), zv(i));
        ss += g * g;
        sd += g * m2::to_f(wg[i]) * m2::to_f(dyr[i]);
      }
      const float2 s = block_sum2(ss, sd, red);
      const float r = rsqrtf(s.x * inv + p.eps), c = r * r * r * s.y * inv;
      for (int i = threadIdx.x; i < group; i += blockDim.x)
        pr[i] += norm_grad<T, GATED>(m2::to_f(xr[i]), zv(i), m2::to_f(dyr[i]), m2::to_f(wg[i]), r,
                                     c, dx + row * D + g0, GATED ? dz + row * p.dz_stride + g0 : nullptr, i);
    }
  }
}

// The backward of the add norm along the residual stream: for a row's sum s (type R), the output
// gradient dy and the gradient g that s already carries from later blocks (none when null),
//   g' = g + r·w·dy − s·c        r = rsqrt(mean(s²) + eps),  c = r³·mean(s·w·dy)
// written in R to g_out and, when h is not null, rounded to T in h (the next mixer backward's
// input); the dw sums as rms_norm_bwd's (rows of the program, one row of `part`). One program
// per row set of the whole row (the group is the row), V as in rms_norm_bwd.
template <typename T, typename R, int V>
__device__ void add_norm_bwd(const R* __restrict__ s, const T* __restrict__ w,
                             const T* __restrict__ dy, const R* __restrict__ g,
                             R* __restrict__ g_out, T* __restrict__ h, float* __restrict__ part,
                             const m2::NormBwdParams& p) {
  __shared__ float2 red[32];
  const int D = p.dim;
  const float inv = 1.f / D;
  float* pr = part + static_cast<long>(blockIdx.x) * D;
  auto put = [&](long at, float v) {
    g_out[at] = static_cast<R>(v);
    if (h) h[at] = m2::from_f<T>(v);
  };
  if constexpr (V > 0) {
    float acc[V];
#pragma unroll
    for (int j = 0; j < V; ++j) acc[j] = 0.f;
    for (long row = blockIdx.x; row < p.rows; row += gridDim.x) {
      const long r0 = row * D;
      float sv[V], dv[V], gv[V], ss = 0.f, sd = 0.f;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        const bool live = i < D;
        sv[j] = live ? static_cast<float>(s[r0 + i]) : 0.f;
        dv[j] = live ? m2::to_f(dy[r0 + i]) : 0.f;
        gv[j] = live && g ? static_cast<float>(g[r0 + i]) : 0.f;
        ss += sv[j] * sv[j];
        sd += live ? sv[j] * m2::to_f(w[i]) * dv[j] : 0.f;
      }
      const float2 t = block_sum2(ss, sd, red);
      const float r = rsqrtf(t.x * inv + p.eps), c = r * r * r * t.y * inv;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i < D) {
          put(r0 + i, gv[j] + r * m2::to_f(w[i]) * dv[j] - sv[j] * c);
          acc[j] += dv[j] * sv[j] * r;
        }
      }
    }
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int i = threadIdx.x + j * blockDim.x;
      if (i < D) pr[i] = acc[j];
    }
  } else {
    // The thread alone writes its elements of the row: they accumulate in place.
    for (int i = threadIdx.x; i < D; i += blockDim.x) pr[i] = 0.f;
    for (long row = blockIdx.x; row < p.rows; row += gridDim.x) {
      const long r0 = row * D;
      float ss = 0.f, sd = 0.f;
      for (int i = threadIdx.x; i < D; i += blockDim.x) {
        const float sv = static_cast<float>(s[r0 + i]);
        ss += sv * sv;
        sd += sv * m2::to_f(w[i]) * m2::to_f(dy[r0 + i]);
      }
      const float2 t = block_sum2(ss, sd, red);
      const float r = rsqrtf(t.x * inv + p.eps), c = r * r * r * t.y * inv;
      for (int i = threadIdx.x; i < D; i += blockDim.x) {
        const float sv = static_cast<float>(s[r0 + i]), dv = m2::to_f(dy[r0 + i]);
        const float gv = g ? static_cast<float>(g[r0 + i]) : 0.f;
        put(r0 + i, gv + r * m2::to_f(w[i]) * dv - sv * c);
        pr[i] += dv * sv * r;
      }
    }
  }
}

}  // namespace

// The kernels, instantiated from the list in src/instances.rs (rms_norm.inc); R is the
// residual's type, V the values per thread held in registers (0: the row is re-read). The
// backwards are bounded to registers for 1024 threads, the most a row program takes.
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
#define GATED_NORM_BWD(NAME, T, V)                                                             \
  extern "C" __global__ void __launch_bounds__(1024)                                           \
      NAME(const T* x, const T* z, const T* w, const T* dy, T* dx, T* dz, float* part,         \
           m2::NormBwdParams p) {                                                              \
    m2::wait_prior_grid();                                                                     \
    rms_norm_bwd<T, V, true>(x, z, w, dy, dx, dz, part, p);                                    \
  }
#define RMS_NORM_BWD(NAME, T, V)                                                               \
  extern "C" __global__ void __launch_bounds__(1024)                                           \
      NAME(const T* x, const T* w, const T* dy, T* dx, float* part, m2::NormBwdParams p) {     \
    m2::wait_prior_grid();                                                                     \
    rms_norm_bwd<T, V, false>(x, nullptr, w, dy, dx, nullptr, part, p);                        \
  }
#define ADD_NORM_BWD(NAME, T, R, V)                                                            \
  extern "C" __global__ void __launch_bounds__(1024)                                           \
      NAME(const R* s, const T* w, const T* dy, const R* g, R* g_out, T* h, float* part,        \
           m2::NormBwdParams p) {                                                              \
    m2::wait_prior_grid();                                                                     \
    add_norm_bwd<T, R, V>(s, w, dy, g, g_out, h, part, p);                                     \
  }
#include "norm/rms_norm.inc"
