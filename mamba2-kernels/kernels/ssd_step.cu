// One decode token, state updated in place (mamba_ssm's selective_state_update):
//   dt = clamp(softplus(dt + bias)), h ← exp(a·dt)·h + dt·x Bᵀ, y = h C + D·x, · silu(z)
// state [B,H,P,N] (S = f32 or bf16), x/z/y [B,H,P], dt [B,H], b/c [B,G,N] (T), a/bias [H] and
// D [H] or [H,P] f32. x, dt, b, c and z may have strided batch rows (slices of in_proj's or the
// conv's output): row b starts at b·stride. One program per (batch, head); warp w owns rows p = w, w+8, ...; each lane
// owns 4 consecutive state columns (16-byte accesses when N % 4 == 0), a warp sum forms y.
#include "common.cuh"

namespace {

struct Dims {
  int batch, nheads, headdim, ngroups, dstate, softplus, d_per_channel;
  float lo, hi;
  long x_stride, dt_stride, b_stride, c_stride, z_stride;
};

template <typename S> struct Vec4;
template <> struct Vec4<float> {
  __device__ __forceinline__ static float4 load(const float* p) { return *reinterpret_cast<const float4*>(p); }
  __device__ __forceinline__ static void store(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
};
template <> struct Vec4<__nv_bfloat16> {
  __device__ __forceinline__ static float4 load(const __nv_bfloat16* p) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
    const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
    return make_float4(a.x, a.y, b.x, b.y);
  }
  __device__ __forceinline__ static void store(__nv_bfloat16* p, float4 v) {
    __nv_bfloat162 a = __floats2bfloat162_rn(v.x, v.y), b = __floats2bfloat162_rn(v.z, v.w);
    uint2 u;
    u.x = *reinterpret_cast<uint32_t*>(&a);
    u.y = *reinterpret_cast<uint32_t*>(&b);
    *reinterpret_cast<uint2*>(p) = u;
  }
};

template <typename T, typename S, bool VEC>
__device__ void ssd_step(S* __restrict__ state, const T* __restrict__ x, const T* __restrict__ dt,
                         const float* __restrict__ a, const float* __restrict__ bias,
                         const T* __restrict__ bm, const T* __restrict__ cm,
                         const float* __restrict__ dskip, const T* __restrict__ z,
                         T* __restrict__ y, Dims D) {
  const int bh = blockIdx.x, b = bh / D.nheads, h = bh % D.nheads;
  const int g = h / (D.nheads / D.ngroups);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  const int N = D.dstate, P = D.headdim;
  const float step = m2::process_dt(m2::to_f(dt[b * D.dt_stride + h]), bias ? bias[h] : 0.f,
                                    D.softplus, D.lo, D.hi);
  const float decay = __expf(a[h] * step);
  const T* bg = bm + b * D.b_stride + static_cast<size_t>(g) * N;
  const T* cg = cm + b * D.c_stride + static_cast<size_t>(g) * N;
  const T* xh = x + b * D.x_stride + static_cast<size_t>(h) * P;
  S* sh = state + static_cast<size_t>(bh) * P * N;
  for (int p = warp; p < P; p += warps) {
    const float xv = m2::to_f(xh[p]);
    const float dx = step * xv;
    S* row = sh + static_cast<size_t>(p) * N;
    float acc = 0.f;
    if constexpr (VEC) {
      for (int n = lane * 4; n < N; n += 128) {
        float4 s = Vec4<S>::load(row + n);
        const float b0 = m2::to_f(bg[n]), b1 = m2::to_f(bg[n + 1]), b2 = m2::to_f(bg[n + 2]), b3 = m2::to_f(bg[n + 3]);
        s.x = s.x * decay + dx * b0;
        s.y = s.y * decay + dx * b1;
        s.z = s.z * decay + dx * b2;
        s.w = s.w * decay + dx * b3;
        Vec4<S>::store(row + n, s);
        acc += s.x * m2::to_f(cg[n]) + s.y * m2::to_f(cg[n + 1]) + s.z * m2::to_f(cg[n + 2]) +
               s.w * m2::to_f(cg[n + 3]);
      }
    } else {
      for (int n = lane; n < N; n += 32) {
        const float s = m2::to_f(row[n]) * decay + dx * m2::to_f(bg[n]);
        row[n] = m2::from_f<S>(s);
        acc += s * m2::to_f(cg[n]);
      }
    }
    acc = m2::warp_sum(acc);
    if (lane == 0) {
      if (dskip) acc += (D.d_per_channel ? dskip[h * P + p] : dskip[h]) * xv;
      if (z) acc *= m2::silu(m2::to_f(z[b * D.z_stride + static_cast<size_t>(h) * P + p]));
      y[static_cast<size_t>(bh) * P + p] = m2::from_f<T>(acc);
    }
  }
}

}  // namespace

#define STEP(T, TN, S, SN, VEC, VN)                                                             \
  extern "C" __global__ void ssd_step_##TN##_##SN##_##VN(                                       \
      S* state, const T* x, const T* dt, const float* a, const float* bias, const T* b,        \
      const T* c, const float* dskip, const T* z, T* y, Dims d) {                              \
    ssd_step<T, S, VEC>(state, x, dt, a, bias, b, c, dskip, z, y, d);                         \
  }
#define STEP_ALL(T, TN)                                                                        \
  STEP(T, TN, float, f32, true, vec) STEP(T, TN, float, f32, false, scalar)                   \
  STEP(T, TN, __nv_bfloat16, bf16, true, vec) STEP(T, TN, __nv_bfloat16, bf16, false, scalar)
STEP_ALL(float, f32)
STEP_ALL(__half, f16)
STEP_ALL(__nv_bfloat16, bf16)
