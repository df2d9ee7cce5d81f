// The two RMSNorms of a Mamba-2 block, one program per row (per group for the gated one):
//   gated:  g = x·silu(z),  y = g / sqrt(mean_group(g²) + eps) · w      (mamba_ssm RMSNormGated)
//   add:    r = x + residual, y = r / sqrt(mean(r²) + eps) · w, and r is the new residual
// x, z, y and w of type T; z rows may be strided (a slice of in_proj's output); the residual is
// f32 or T (R). Arithmetic in f32; y of the add norm comes from the f32 sum, not the rounded r.
#include "common.cuh"

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

template <typename T>
__device__ void gated_rms_norm(const T* __restrict__ x, const T* __restrict__ z,
                               const T* __restrict__ w, T* __restrict__ y, int D, int group,
                               long z_stride, float eps) {
  __shared__ float red[32];
  const long row = blockIdx.x;
  const int g0 = blockIdx.y * group;
  const T* xr = x + row * D + g0;
  const T* zr = z + row * z_stride + g0;
  float ss = 0.f;
  for (int i = threadIdx.x; i < group; i += blockDim.x) {
    const float g = m2::to_f(xr[i]) * m2::silu(m2::to_f(zr[i]));
    ss += g * g;
  }
  const float scale = rsqrtf(block_sum(ss, red) / group + eps);
  T* yr = y + row * D + g0;
  for (int i = threadIdx.x; i < group; i += blockDim.x) {
    const float g = m2::to_f(xr[i]) * m2::silu(m2::to_f(zr[i]));
    yr[i] = m2::from_f<T>(g * scale * m2::to_f(w[g0 + i]));
  }
}

template <typename T, typename R>
__device__ void add_rms_norm(const T* __restrict__ x, const R* __restrict__ res,
                             const T* __restrict__ w, T* __restrict__ y, R* __restrict__ res_out,
                             int D, float eps) {
  __shared__ float red[32];
  const long row = blockIdx.x;
  const T* xr = x + row * D;
  const R* rr = res ? res + row * D : nullptr;
  float ss = 0.f;
  for (int i = threadIdx.x; i < D; i += blockDim.x) {
    const float r = m2::to_f(xr[i]) + (rr ? m2::to_f(rr[i]) : 0.f);
    res_out[row * D + i] = m2::from_f<R>(r);
    ss += r * r;
  }
  const float scale = rsqrtf(block_sum(ss, red) / D + eps);
  for (int i = threadIdx.x; i < D; i += blockDim.x) {
    const float r = m2::to_f(xr[i]) + (rr ? m2::to_f(rr[i]) : 0.f);
    y[row * D + i] = m2::from_f<T>(r * scale * m2::to_f(w[i]));
  }
}

}  // namespace

#define NORMS(T, TN)                                                                           \
  extern "C" __global__ void gated_rms_norm_##TN(const T* x, const T* z, const T* w, T* y,     \
                                                 int D, int group, long z_stride, float eps) { \
    gated_rms_norm<T>(x, z, w, y, D, group, z_stride, eps);                                   \
  }                                                                                            \
  extern "C" __global__ void add_rms_norm_##TN##_res_f32(const T* x, const float* res,         \
                                                         const T* w, T* y, float* res_out,     \
                                                         int D, float eps) {                   \
    add_rms_norm<T, float>(x, res, w, y, res_out, D, eps);                                    \
  }                                                                                            \
  extern "C" __global__ void add_rms_norm_##TN##_res_same(const T* x, const T* res,            \
                                                          const T* w, T* y, T* res_out, int D, \
                                                          float eps) {                         \
    add_rms_norm<T, T>(x, res, w, y, res_out, D, eps);                                        \
  }
NORMS(float, f32)
NORMS(__half, f16)
NORMS(__nv_bfloat16, bf16)
