// Depthwise causal conv1d with fused bias + SiLU, and its one-token update (channels last):
//   y[b,t,d] = act(bias[d] + Σ_{k<K} w[d,k] · u[b, t−K+1+k, d]),  u = state (K values) ++ x
// x rows (tokens) may be strided (a slice of in_proj's output): row r of batch b starts at
// x + (b·L + r)·x_stride. weight [D,K], bias [D], state [B,D,K] (the last K inputs, oldest
// first); all of type T, f32 accumulation. The output is cut by channels into up to three
// contiguous pieces (x, B and C of the mixer): channel d < s0 goes to y0 [rows, s0], the next s1
// to y1 [rows, s1], the rest to y2 [rows, D − s0 − s1].
#include "params.cuh"

namespace {

using m2::ConvParams;

template <typename T>
__device__ __forceinline__ void put(const ConvParams& o, long row, int d, int D, float v) {
  T* p;
  if (d < o.s0) {
    p = static_cast<T*>(o.y0) + row * o.s0 + d;
  } else if (d < o.s0 + o.s1) {
    p = static_cast<T*>(o.y1) + row * o.s1 + (d - o.s0);
  } else {
    p = static_cast<T*>(o.y2) + row * (D - o.s0 - o.s1) + (d - o.s0 - o.s1);
  }
  *p = m2::from_f<T>(v);
}

constexpr int TOKENS = 32;  // tokens per thread in the prefill kernel

template <typename T>
__device__ __forceinline__ float input(const T* x, const T* st, int b, int t, int d, int L, int D,
                                       int K, long x_stride) {
  // t may be negative: then it reads the incoming state.
  return t >= 0 ? m2::to_f(x[(static_cast<long>(b) * L + t) * x_stride + d])
                : m2::to_f(st[(static_cast<long>(b) * D + d) * K + K + t]);
}

template <typename T>
__device__ void conv_prefill(const T* __restrict__ x, const T* __restrict__ w,
                             const T* __restrict__ bias, const T* __restrict__ st_in,
                             T* __restrict__ st_out, const ConvParams& p) {
  const int L = p.seqlen, D = p.dim, K = p.width;
  const long x_stride = p.x_stride;
  const int d = blockIdx.x * blockDim.x + threadIdx.x;
  const int t0 = blockIdx.y * TOKENS, b = blockIdx.z;
  if (d >= D) return;
  // Up to 8 taps stay in registers (static indices); wider kernels read w from cache.
  float wk[8];
  const bool small = K <= 8;
#pragma unroll
  for (int k = 0; k < 8; ++k) wk[k] = small && k < K ? m2::to_f(w[d * K + k]) : 0.f;
  const float bv = bias ? m2::to_f(bias[d]) : 0.f;
  const int t1 = min(L, t0 + TOKENS);
  for (int t = t0; t < t1; ++t) {
    float acc = bv;
    if (small) {
#pragma unroll
      for (int k = 0; k < 8; ++k)
        if (k < K) acc += wk[k] * input(x, st_in, b, t - K + 1 + k, d, L, D, K, x_stride);
    } else {
      for (int k = 0; k < K; ++k)
        acc += m2::to_f(w[d * K + k]) * input(x, st_in, b, t - K + 1 + k, d, L, D, K, x_stride);
    }
    if (p.silu) acc = m2::silu(acc);
    put<T>(p, static_cast<long>(b) * L + t, d, D, acc);
  }
  if (blockIdx.y == 0) {
    // The new state: the last K entries of u.
    for (int k = 0; k < K; ++k)
      st_out[(static_cast<long>(b) * D + d) * K + k] =
          m2::from_f<T>(input(x, st_in, b, L - K + k, d, L, D, K, x_stride));
  }
}

template <typename T>
__device__ void conv_step(T* __restrict__ st, const T* __restrict__ x, const T* __restrict__ w,
                          const T* __restrict__ bias, const ConvParams& p) {
  const int D = p.dim, K = p.width;
  const int d = blockIdx.x * blockDim.x + threadIdx.x, b = blockIdx.y;
  if (d >= D) return;
  T* row = st + (static_cast<long>(b) * D + d) * K;
  const float xv = m2::to_f(x[static_cast<long>(b) * p.x_stride + d]);
  float acc = bias ? m2::to_f(bias[d]) : 0.f;
  for (int k = 0; k < K; ++k) {
    const float u = k + 1 < K ? m2::to_f(row[k + 1]) : xv;
    acc += m2::to_f(w[d * K + k]) * u;
    row[k] = m2::from_f<T>(u);
  }
  if (p.silu) acc = m2::silu(acc);
  put<T>(p, b, d, D, acc);
}

}  // namespace

// The kernels, instantiated from the list in src/instances.rs (causal_conv1d.inc).
#define CONV(NAME, T)                                                                          \
  extern "C" __global__ void NAME(const T* x, const T* w, const T* bias, const T* st_in,       \
                                  T* st_out, ConvParams p) {                                   \
    m2::wait_prior_grid();                                                                     \
    conv_prefill<T>(x, w, bias, st_in, st_out, p);                                             \
  }
#define CONV_STEP(NAME, T)                                                                     \
  extern "C" __global__ void NAME(T* st, const T* x, const T* w, const T* bias, ConvParams p) { \
    m2::wait_prior_grid();                                                                     \
    conv_step<T>(st, x, w, bias, p);                                                           \
  }
#include "conv/causal_conv1d.inc"
