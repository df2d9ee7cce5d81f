// Stage 2: the state entering every chunk, by the jump formula (d = da_cumsum, log2 space):
//   h_{c+1} = exp2(d_last)·h_c + Σ_s exp2(d_last − d_s)·dt_s · x_s B_sᵀ        h: [P, N]
// x [B,L,H,P], b [B,L,G,N] (value type T), dt/da [B,H,L] f32, init [B,H,P,N] and
// states [B,H,C+1,P,N] in the state type S (f32 or bf16). Every program walks the chunks of one
// (batch, head) in order, carrying its slice of the state in f32 registers.
//
// bf16/f16 take two kernels: chunk_state_mma computes every chunk's own contribution in
//   parallel on tensor cores (needs P % (16·WARPS) == 0, N % NT == 0), then state_scan runs the
//   cheap recurrence across chunks, streaming the slots with 16-byte accesses.
// fwd_pass_state_simt: any type and shape; one thread per state element, chunks in order.
#include "common.cuh"

namespace {

struct Dims {
  int batch, seqlen, nheads, headdim, ngroups, dstate, chunk, nchunks;
};

template <typename S>
__device__ __forceinline__ void store2(S* p, float a, float b);
template <>
__device__ __forceinline__ void store2<float>(float* p, float a, float b) {
  *reinterpret_cast<float2*>(p) = make_float2(a, b);
}
template <>
__device__ __forceinline__ void store2<__nv_bfloat16>(__nv_bfloat16* p, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
}

constexpr int PAD = 8;  // elements of padding per shared row: conflict-free ldmatrix

// One chunk's own contribution to the state, local_c = Σ_s exp2(d_last − d_s)·dt_s · x_s B_sᵀ,
// written to slot c + 1 of `states` (state_scan turns the slots into entry states in place).
// A program owns (batch·head·chunk, a [16·WARPS, NT] tile): x and b arrive by cp.async, b is
// scaled in shared memory, and xᵀ·b' is an m16n8k16 chain with ldmatrix.trans for both operands.
template <typename T, typename S, int WARPS, int NT>
__device__ void chunk_state_mma(const T* __restrict__ x, const T* __restrict__ bm,
                                const float* __restrict__ dt, const float* __restrict__ da,
                                S* __restrict__ states, Dims D) {
  constexpr int PT = 16 * WARPS, XR = PT + PAD, BR = NT + PAD, THREADS = 32 * WARPS;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int chunk = D.chunk;
  T* xs = reinterpret_cast<T*>(smem_raw);                   // [chunk][XR]
  T* bs = xs + chunk * XR;                                  // [chunk][BR]
  float* ds = reinterpret_cast<float*>(bs + chunk * BR);    // [chunk]
  float* ws = ds + chunk;                                   // [chunk]

  const int bhc = blockIdx.x, n0 = blockIdx.y * NT, p0 = blockIdx.z * PT;
  const int c = bhc % D.nchunks, bh = bhc / D.nchunks;
  const int b = bh / D.nheads, h = bh % D.nheads, g = h / (D.nheads / D.ngroups);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const size_t hp = static_cast<size_t>(D.nheads) * D.headdim;
  const size_t gn = static_cast<size_t>(D.ngroups) * D.dstate;
  const size_t row = static_cast<size_t>(bh) * D.seqlen;
  const size_t pn = static_cast<size_t>(D.headdim) * D.dstate;
  const int l0 = c * chunk, len = min(chunk, D.seqlen - l0);

  for (int i = tid; i < chunk * (PT / 8); i += THREADS) {
    const int r = i / (PT / 8), q = i % (PT / 8);
    const bool ok = r < len;
    const T* src = x + (static_cast<size_t>(b) * D.seqlen + l0 + (ok ? r : 0)) * hp +
                   static_cast<size_t>(h) * D.headdim + p0 + q * 8;
    m2::cp_async16(xs + r * XR + q * 8, src, ok);
  }
  for (int i = tid; i < chunk * (NT / 8); i += THREADS) {
    const int r = i / (NT / 8), q = i % (NT / 8);
    const bool ok = r < len;
    const T* src = bm + (static_cast<size_t>(b) * D.seqlen + l0 + (ok ? r : 0)) * gn +
                   static_cast<size_t>(g) * D.dstate + n0 + q * 8;
    m2::cp_async16(bs + r * BR + q * 8, src, ok);
  }
  m2::cp_async_commit();
  const float d_last = da[row + l0 + len - 1];
  for (int i = tid; i < chunk; i += THREADS)
    ws[i] = i < len ? m2::exp2_fast(d_last - da[row + l0 + i]) * dt[row + l0 + i] : 0.f;
  m2::cp_async_wait<0>();
  __syncthreads();
  for (int i = tid; i < chunk * (NT / 2); i += THREADS) {
    const int r = i / (NT / 2), q = (i % (NT / 2)) * 2;
    T* pv = bs + r * BR + q;
    const float w = ws[r];
    pv[0] = m2::from_f<T>(m2::to_f(pv[0]) * w);
    pv[1] = m2::from_f<T>(m2::to_f(pv[1]) * w);
  }
  __syncthreads();

  float acc[NT / 8][4];
#pragma unroll
  for (int j = 0; j < NT / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
  for (int k0 = 0; k0 < chunk; k0 += 16) {
    uint32_t a[4];
    m2::ldsm_x4_t(a, xs + (k0 + (lane % 8) + (lane / 16) * 8) * XR + warp * 16 + ((lane / 8) % 2) * 8);
#pragma unroll
    for (int j = 0; j < NT / 8; j += 2) {
      uint32_t bf[4];
      m2::ldsm_x4_t(bf, bs + (k0 + (lane % 8) + ((lane / 8) % 2) * 8) * BR + (j + lane / 16) * 8);
      m2::Mma<T>::run(acc[j], a, bf[0], bf[1]);
      m2::Mma<T>::run(acc[j + 1], a, bf[2], bf[3]);
    }
  }
  const int prow = p0 + warp * 16 + lane / 4, tc = (lane % 4) * 2;
  S* out = states + (static_cast<size_t>(bh) * (D.nchunks + 1) + c + 1) * pn;
#pragma unroll
  for (int j = 0; j < NT / 8; ++j) {
    const int n = n0 + j * 8 + tc;
    store2<S>(out + static_cast<size_t>(prow) * D.dstate + n, acc[j][0], acc[j][1]);
    store2<S>(out + static_cast<size_t>(prow + 8) * D.dstate + n, acc[j][2], acc[j][3]);
  }
}

template <typename S> struct Vec;
template <> struct Vec<float> {
  static constexpr int N = 4;
  __device__ __forceinline__ static void load(const float* p, float (&v)[4]) {
    const float4 u = *reinterpret_cast<const float4*>(p);
    v[0] = u.x; v[1] = u.y; v[2] = u.z; v[3] = u.w;
  }
  __device__ __forceinline__ static void store(float* p, const float (&v)[4]) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  }
};
template <> struct Vec<__nv_bfloat16> {
  static constexpr int N = 8;
  __device__ __forceinline__ static void load(const __nv_bfloat16* p, float (&v)[8]) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[i]));
      v[2 * i] = f.x;
      v[2 * i + 1] = f.y;
    }
  }
  __device__ __forceinline__ static void store(__nv_bfloat16* p, const float (&v)[8]) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      __nv_bfloat162 h = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
      w[i] = *reinterpret_cast<uint32_t*>(&h);
    }
    *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
  }
};

// The inter-chunk recurrence over the slots chunk_state_mma wrote, in place:
//   slot 0 ← init (or 0);  slot c+1 ← exp2(d_last_c)·slot c + local_c
// One thread per Vec<S>::N consecutive state elements of one (batch, head), carried in f32; the
// loads of the next chunks are independent of the carry, so they stay in flight.
template <typename S>
__device__ void state_scan(const float* __restrict__ da, const S* __restrict__ init,
                           S* __restrict__ states, Dims D) {
  constexpr int V = Vec<S>::N;
  const size_t pn = static_cast<size_t>(D.headdim) * D.dstate;
  const size_t e = (static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x) * V;
  const int bh = blockIdx.y;
  if (e >= pn) return;
  const float* dah = da + static_cast<size_t>(bh) * D.seqlen;
  S* base = states + static_cast<size_t>(bh) * (D.nchunks + 1) * pn + e;
  float h[V];
  if (init) {
    Vec<S>::load(init + static_cast<size_t>(bh) * pn + e, h);
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) h[i] = 0.f;
  }
  Vec<S>::store(base, h);
  // A ring of PF chunks loaded ahead: chunk c + PF is requested before chunk c is stored.
  constexpr int PF = 4;
  float buf[PF][V];
#pragma unroll
  for (int i = 0; i < PF; ++i)
    if (i < D.nchunks) Vec<S>::load(base + (i + 1) * pn, buf[i]);
  for (int c0 = 0; c0 < D.nchunks; c0 += PF) {
#pragma unroll
    for (int i = 0; i < PF; ++i) {
      const int c = c0 + i;
      if (c >= D.nchunks) break;
      const int last = min((c + 1) * D.chunk, D.seqlen) - 1;
      const float decay = m2::exp2_fast(dah[last]);
#pragma unroll
      for (int k = 0; k < V; ++k) h[k] = decay * h[k] + buf[i][k];
      if (c + PF < D.nchunks) Vec<S>::load(base + (c + PF + 1) * pn, buf[i]);
      Vec<S>::store(base + (c + 1) * pn, h);
    }
  }
}

template <typename T, typename S>
__device__ void fwd_pass_state_simt(const T* __restrict__ x, const T* __restrict__ bm,
                                    const float* __restrict__ dt, const float* __restrict__ da,
                                    const S* __restrict__ init, S* __restrict__ states, Dims D) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* w = reinterpret_cast<float*>(smem_raw);  // [chunk]
  const size_t pn = static_cast<size_t>(D.headdim) * D.dstate;
  const size_t e = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int bh = blockIdx.y;
  const int b = bh / D.nheads, h = bh % D.nheads, g = h / (D.nheads / D.ngroups);
  const bool live = e < pn;
  const int p = live ? static_cast<int>(e / D.dstate) : 0, n = live ? static_cast<int>(e % D.dstate) : 0;
  const size_t row = static_cast<size_t>(bh) * D.seqlen;
  const size_t hp = static_cast<size_t>(D.nheads) * D.headdim;
  const size_t gn = static_cast<size_t>(D.ngroups) * D.dstate;
  float state = (init && live) ? m2::to_f(init[bh * pn + e]) : 0.f;
  for (int c = 0; c < D.nchunks; ++c) {
    const int l0 = c * D.chunk, len = min(D.chunk, D.seqlen - l0);
    const float d_last = da[row + l0 + len - 1];
    __syncthreads();
    for (int i = threadIdx.x; i < len; i += blockDim.x)
      w[i] = m2::exp2_fast(d_last - da[row + l0 + i]) * dt[row + l0 + i];
    __syncthreads();
    if (live) {
      states[(static_cast<size_t>(bh) * (D.nchunks + 1) + c) * pn + e] = m2::from_f<S>(state);
      float acc = 0.f;
      for (int s = 0; s < len; ++s) {
        const size_t l = static_cast<size_t>(b) * D.seqlen + l0 + s;
        acc += m2::to_f(x[l * hp + static_cast<size_t>(h) * D.headdim + p]) * w[s] *
               m2::to_f(bm[l * gn + static_cast<size_t>(g) * D.dstate + n]);
      }
      state = m2::exp2_fast(d_last) * state + acc;
    }
  }
  if (live) states[(static_cast<size_t>(bh) * (D.nchunks + 1) + D.nchunks) * pn + e] = m2::from_f<S>(state);
}

}  // namespace

#define FPS_ARGS(T, S) \
  const T *x, const T *b, const float *dt, const float *da, const S *init, S *states, Dims d

#define CHUNK_STATE(T, TN, S, SN, W, NT)                                                     \
  extern "C" __global__ void __launch_bounds__(32 * W)                                       \
      chunk_state_mma_##TN##_##SN##_w##W##_n##NT(const T* x, const T* b, const float* dt,     \
                                                 const float* da, S* states, Dims d) {        \
    chunk_state_mma<T, S, W, NT>(x, b, dt, da, states, d);                                   \
  }
#define CHUNK_STATE_NT(T, TN, S, SN, W)                                  \
  CHUNK_STATE(T, TN, S, SN, W, 16) CHUNK_STATE(T, TN, S, SN, W, 32)      \
  CHUNK_STATE(T, TN, S, SN, W, 64) CHUNK_STATE(T, TN, S, SN, W, 128)
#define CHUNK_STATE_ALL(T, TN, S, SN) CHUNK_STATE_NT(T, TN, S, SN, 2) CHUNK_STATE_NT(T, TN, S, SN, 4)
CHUNK_STATE_ALL(__nv_bfloat16, bf16, float, f32)
CHUNK_STATE_ALL(__nv_bfloat16, bf16, __nv_bfloat16, bf16)
CHUNK_STATE_ALL(__half, f16, float, f32)
CHUNK_STATE_ALL(__half, f16, __nv_bfloat16, bf16)

#define SCAN(S, SN)                                                                          \
  extern "C" __global__ void state_scan_##SN(const float* da, const S* init, S* states,      \
                                             Dims d) {                                       \
    state_scan<S>(da, init, states, d);                                                      \
  }
SCAN(float, f32)
SCAN(__nv_bfloat16, bf16)

#define FPS_SIMT(T, TN, S, SN)                                                   \
  extern "C" __global__ void fwd_pass_state_simt_##TN##_##SN(FPS_ARGS(T, S)) {   \
    fwd_pass_state_simt<T, S>(x, b, dt, da, init, states, d);                    \
  }
FPS_SIMT(float, f32, float, f32)
FPS_SIMT(float, f32, __nv_bfloat16, bf16)
FPS_SIMT(__half, f16, float, f32)
FPS_SIMT(__half, f16, __nv_bfloat16, bf16)
FPS_SIMT(__nv_bfloat16, bf16, float, f32)
FPS_SIMT(__nv_bfloat16, bf16, __nv_bfloat16, bf16)
