// One decode token, state updated in place (mamba_ssm's selective_state_update):
//   dt = clamp(softplus(dt + bias)), h ← exp(a·dt)·h + dt·x Bᵀ, y = h C + D·x, · silu(z)
// state [B,H,P,N] (S = f32 or bf16), x/z/y [B,H,P], dt [B,H], b/c [B,G,N] (T), a/bias [H] and
// D [H] or [H,P] f32. x, dt, b, c and z may have strided batch rows (slices of in_proj's or the
// conv's output): row b starts at b·stride. Program (bh, r) owns state rows [r·R, (r+1)·R) of
// (batch, head) bh, R = rows_per_block; warp w owns rows w, w + warps, ... of them (R = warps at
// small batch, so that even B = 1 spreads over B·H·P/warps programs); each lane owns 4
// consecutive state columns (16-byte accesses when N % 4 == 0), a warp sum forms y.
#include "params.cuh"

namespace {

using m2::StepParams;

// Four consecutive values as a float4 (16-byte f32 or 8-byte bf16/f16 accesses).
template <typename S> struct Vec4;
template <> struct Vec4<float> {
  __device__ __forceinline__ static float4 load(const float* p) { return *reinterpret_cast<const float4*>(p); }
  __device__ __forceinline__ static void store(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
};
template <typename H2, float2 (*TO)(H2)> struct Vec4Half {
  __device__ __forceinline__ static float4 unpack(uint2 u) {
    const float2 a = TO(*reinterpret_cast<const H2*>(&u.x));
    const float2 b = TO(*reinterpret_cast<const H2*>(&u.y));
    return make_float4(a.x, a.y, b.x, b.y);
  }
};
template <> struct Vec4<__nv_bfloat16> {
  __device__ __forceinline__ static float4 load(const __nv_bfloat16* p) {
    return Vec4Half<__nv_bfloat162, m2::bf2f>::unpack(*reinterpret_cast<const uint2*>(p));
  }
  __device__ __forceinline__ static void store(__nv_bfloat16* p, float4 v) {
    __nv_bfloat162 a = __floats2bfloat162_rn(v.x, v.y), b = __floats2bfloat162_rn(v.z, v.w);
    uint2 u;
    u.x = *reinterpret_cast<uint32_t*>(&a);
    u.y = *reinterpret_cast<uint32_t*>(&b);
    *reinterpret_cast<uint2*>(p) = u;
  }
};
template <> struct Vec4<__half> {
  __device__ __forceinline__ static float4 load(const __half* p) {
    return Vec4Half<__half2, m2::h2f>::unpack(*reinterpret_cast<const uint2*>(p));
  }
};

// y[b, h, p] from row p's warp sum h·C: + D·x, · silu(z), stored by lane 0.
template <typename T>
__device__ __forceinline__ void finish_row(float acc, float xv, int b, int h, int bh, int p, int lane,
                                           const float* __restrict__ dskip,
                                           const T* __restrict__ z, T* __restrict__ y,
                                           const StepParams& D) {
  const int P = D.headdim;
  if (lane != 0) return;
  if (dskip) acc += (D.d_per_channel ? dskip[h * P + p] : dskip[h]) * xv;
  if (z) acc *= m2::silu(m2::to_f(z[b * D.z_stride + static_cast<size_t>(h) * P + p]));
  y[static_cast<size_t>(bh) * P + p] = m2::from_f<T>(acc);
}

// The (batch, head) bh a program serves, this warp's rows of it (p = p_first, p_first + warps, …
// below p_end) and where its B, C, x and state rows start.
template <typename T, typename S>
struct Head {
  int bh, b, h, lane, warps, p_first, p_end;
  const T *bg, *cg, *xh;
  S* sh;
  __device__ Head(S* state, const T* x, const T* bm, const T* cm, const StepParams& D)
      : bh(blockIdx.x), b(bh / D.nheads), h(bh % D.nheads), lane(threadIdx.x % 32),
        warps(blockDim.x / 32),
        p_first(static_cast<int>(blockIdx.y) * D.rows_per_block + static_cast<int>(threadIdx.x) / 32),
        p_end(min(D.headdim, (static_cast<int>(blockIdx.y) + 1) * D.rows_per_block)) {
    const int g = h / (D.nheads / D.ngroups), N = D.dstate, P = D.headdim;
    bg = bm + b * D.b_stride + static_cast<size_t>(g) * N;
    cg = cm + b * D.c_stride + static_cast<size_t>(g) * N;
    xh = x + b * D.x_stride + static_cast<size_t>(h) * P;
    sh = state + static_cast<size_t>(bh) * P * N;
  }
};

// The vectorised path keeps a lane's KV groups of 4 columns (N ≤ 128·KV) in registers: every
// load of a row (state, B, C, x, dt) is issued before the first one is used, so a program's
// latency is one memory round trip, not a chain of them.
template <typename T, typename S, int KV>
__device__ void ssd_step_vec(S* __restrict__ state, const T* __restrict__ x,
                             const T* __restrict__ dt, const float* __restrict__ a,
                             const float* __restrict__ bias, const T* __restrict__ bm,
                             const T* __restrict__ cm, const float* __restrict__ dskip,
                             const T* __restrict__ z, T* __restrict__ y, StepParams D) {
  const Head<T, S> r(state, x, bm, cm, D);
  const int N = D.dstate, lane = r.lane, h = r.h;
  float4 bv[KV], cv[KV];
#pragma unroll
  for (int k = 0; k < KV; ++k) {
    const int n = lane * 4 + k * 128;
    if (n < N) {
      bv[k] = Vec4<T>::load(r.bg + n);
      cv[k] = Vec4<T>::load(r.cg + n);
    }
  }
  const float raw_dt = m2::to_f(dt[r.b * D.dt_stride + h]);
  for (int p = r.p_first; p < r.p_end; p += r.warps) {
    S* row = r.sh + static_cast<size_t>(p) * N;
    float4 sv[KV];
#pragma unroll
    for (int k = 0; k < KV; ++k) {
      const int n = lane * 4 + k * 128;
      if (n < N) sv[k] = Vec4<S>::load(row + n);
    }
    const float xv = m2::to_f(r.xh[p]);
    const float step = m2::process_dt(raw_dt, bias ? bias[h] : 0.f, D.softplus, D.lo, D.hi);
    const float decay = __expf(a[h] * step), dx = step * xv;
    float acc = 0.f;
#pragma unroll
    for (int k = 0; k < KV; ++k) {
      const int n = lane * 4 + k * 128;
      if (n < N) {
        float4 s = sv[k];
        s.x = s.x * decay + dx * bv[k].x;
        s.y = s.y * decay + dx * bv[k].y;
        s.z = s.z * decay + dx * bv[k].z;
        s.w = s.w * decay + dx * bv[k].w;
        Vec4<S>::store(row + n, s);
        acc += s.x * cv[k].x + s.y * cv[k].y + s.z * cv[k].z + s.w * cv[k].w;
      }
    }
    finish_row<T>(m2::warp_sum(acc), xv, r.b, h, r.bh, p, lane, dskip, z, y, D);
  }
}

// Any N: lane n of a warp handles columns n, n + 32, ...
template <typename T, typename S>
__device__ void ssd_step_scalar(S* __restrict__ state, const T* __restrict__ x,
                                const T* __restrict__ dt, const float* __restrict__ a,
                                const float* __restrict__ bias, const T* __restrict__ bm,
                                const T* __restrict__ cm, const float* __restrict__ dskip,
                                const T* __restrict__ z, T* __restrict__ y, StepParams D) {
  const Head<T, S> r(state, x, bm, cm, D);
  const int N = D.dstate, h = r.h;
  const float step = m2::process_dt(m2::to_f(dt[r.b * D.dt_stride + h]), bias ? bias[h] : 0.f,
                                    D.softplus, D.lo, D.hi);
  const float decay = __expf(a[h] * step);
  for (int p = r.p_first; p < r.p_end; p += r.warps) {
    const float xv = m2::to_f(r.xh[p]);
    const float dx = step * xv;
    S* row = r.sh + static_cast<size_t>(p) * N;
    float acc = 0.f;
    for (int n = r.lane; n < N; n += 32) {
      const float s = m2::to_f(row[n]) * decay + dx * m2::to_f(r.bg[n]);
      row[n] = m2::from_f<S>(s);
      acc += s * m2::to_f(r.cg[n]);
    }
    finish_row<T>(m2::warp_sum(acc), xv, r.b, h, r.bh, p, r.lane, dskip, z, y, D);
  }
}

}  // namespace

// The kernels, instantiated from the list in src/instances.rs (ssd_step.inc).
#define STEP_ARGS(T, S)                                                                        \
  S *state, const T *x, const T *dt, const float *a, const float *bias, const T *b, const T *c, \
      const float *dskip, const T *z, T *y, StepParams d
#define STEP_VEC(NAME, T, S, V)                                                                \
  extern "C" __global__ void NAME(STEP_ARGS(T, S)) {                                           \
    m2::wait_prior_grid();                                                                     \
    ssd_step_vec<T, S, V>(state, x, dt, a, bias, b, c, dskip, z, y, d);                        \
  }
#define STEP_SCALAR(NAME, T, S)                                                                \
  extern "C" __global__ void NAME(STEP_ARGS(T, S)) {                                           \
    m2::wait_prior_grid();                                                                     \
    ssd_step_scalar<T, S>(state, x, dt, a, bias, b, c, dskip, z, y, d);                        \
  }
#include "ssd_step/ssd_step.inc"
