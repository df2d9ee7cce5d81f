// Stage 2: the state entering every chunk, by the jump formula (d = da_cumsum, log2 space):
//   h_{c+1} = exp2(d_last)·h_c + Σ_s exp2(d_last − d_s)·dt_s · x_s B_sᵀ        h: [P, N]
// x [B,L,H,P], b [B,L,G,N] (value type T), dt/da [B,H,L] f32, init [B,H,P,N] and
// states [B,H,C+1,P,N] in the state type S (f32 or bf16). Every program walks the chunks of one
// (batch, head) in order, carrying its slice of the state in f32 registers.
//
// fwd_pass_state_mma: bf16/f16 on tensor cores. A program owns a [16·WARPS, NT] slice of the
//   state (warp w: rows 16w..16w+15); the x and b tiles of the next STAGES−1 chunks are in
//   flight (cp.async) while one chunk is processed; b is scaled in shared memory by exp2(d_last − d)·dt, and xᵀ·b' is one m16n8k16 MMA
//   chain (ldmatrix.trans for both operands). Needs P % (16·WARPS) == 0, N % NT == 0.
// fwd_pass_state_simt: any type and shape; one thread per state element.
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

constexpr int PAD = 8;     // elements of padding per shared row: conflict-free ldmatrix
constexpr int STAGES = 3;  // chunks in shared memory: one processed, STAGES − 1 loading

template <typename T, typename S, int WARPS, int NT>
__device__ void fwd_pass_state_mma(const T* __restrict__ x, const T* __restrict__ bm,
                                   const float* __restrict__ dt, const float* __restrict__ da,
                                   const S* __restrict__ init, S* __restrict__ states, Dims D) {
  constexpr int PT = 16 * WARPS, XR = PT + PAD, BR = NT + PAD, THREADS = 32 * WARPS;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int chunk = D.chunk;
  T* xs = reinterpret_cast<T*>(smem_raw);                          // [STAGES][chunk][XR]
  T* bs = xs + STAGES * chunk * XR;                                // [STAGES][chunk][BR]
  float* ds = reinterpret_cast<float*>(bs + STAGES * chunk * BR);  // [STAGES][chunk]
  float* dts = ds + STAGES * chunk;                                // [STAGES][chunk]

  const int n0 = blockIdx.x * NT, p0 = blockIdx.y * PT, bh = blockIdx.z;
  const int b = bh / D.nheads, h = bh % D.nheads, g = h / (D.nheads / D.ngroups);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const size_t hp = static_cast<size_t>(D.nheads) * D.headdim;
  const size_t gn = static_cast<size_t>(D.ngroups) * D.dstate;
  const size_t row = static_cast<size_t>(bh) * D.seqlen;
  const size_t pn = static_cast<size_t>(D.headdim) * D.dstate;

  auto load = [&](int stage, int c) {
    const int l0 = c * chunk, len = min(chunk, D.seqlen - l0);
    T* xst = xs + stage * chunk * XR;
    T* bst = bs + stage * chunk * BR;
    for (int i = tid; i < chunk * (PT / 8); i += THREADS) {
      const int r = i / (PT / 8), q = i % (PT / 8);
      const bool ok = r < len;
      const T* src = x + (static_cast<size_t>(b) * D.seqlen + l0 + (ok ? r : 0)) * hp +
                     static_cast<size_t>(h) * D.headdim + p0 + q * 8;
      m2::cp_async16(xst + r * XR + q * 8, src, ok);
    }
    for (int i = tid; i < chunk * (NT / 8); i += THREADS) {
      const int r = i / (NT / 8), q = i % (NT / 8);
      const bool ok = r < len;
      const T* src = bm + (static_cast<size_t>(b) * D.seqlen + l0 + (ok ? r : 0)) * gn +
                     static_cast<size_t>(g) * D.dstate + n0 + q * 8;
      m2::cp_async16(bst + r * BR + q * 8, src, ok);
    }
    for (int i = tid; i < chunk; i += THREADS) {
      const bool ok = i < len;
      const float* s1 = da + row + l0 + (ok ? i : 0);
      const float* s2 = dt + row + l0 + (ok ? i : 0);
      unsigned d1 = static_cast<unsigned>(__cvta_generic_to_shared(ds + stage * chunk + i));
      unsigned d2 = static_cast<unsigned>(__cvta_generic_to_shared(dts + stage * chunk + i));
      int n = ok ? 4 : 0;
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d1), "l"(s1), "r"(n));
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d2), "l"(s2), "r"(n));
    }
    m2::cp_async_commit();
  };

  // The state slice in the accumulator layout: st[j] covers columns n0 + 8j .. 8j+7;
  // elements 0,1: row g (cols 2t, 2t+1), elements 2,3: row g+8.
  const int gr = lane / 4, tc = (lane % 4) * 2;
  const int prow = p0 + warp * 16 + gr;
  float st[NT / 8][4];
#pragma unroll
  for (int j = 0; j < NT / 8; ++j) {
    const int n = n0 + j * 8 + tc;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int p = prow + (e >= 2 ? 8 : 0);
      st[j][e] = init ? m2::to_f(init[bh * pn + static_cast<size_t>(p) * D.dstate + n + (e & 1)])
                      : 0.f;
    }
  }

  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < D.nchunks) load(s, s);
    else m2::cp_async_commit();
  }
  for (int c = 0; c < D.nchunks; ++c) {
    const int cur = c % STAGES;
    m2::cp_async_wait<STAGES - 2>();
    __syncthreads();  // chunk c has landed; every thread is done with chunk c − 1's buffer
    if (c + STAGES - 1 < D.nchunks) load((c + STAGES - 1) % STAGES, c + STAGES - 1);
    else m2::cp_async_commit();
    const int len = min(chunk, D.seqlen - c * chunk);
    float* dcur = ds + cur * chunk;
    float* dtcur = dts + cur * chunk;
    const float d_last = dcur[len - 1];
    // w_s = exp2(d_last − d_s)·dt_s, kept in place of dt (rows past len have dt = 0).
    for (int i = tid; i < chunk; i += THREADS) dtcur[i] = m2::exp2_fast(d_last - dcur[i]) * dtcur[i];
    __syncthreads();
    T* bst = bs + cur * chunk * BR;
    for (int i = tid; i < chunk * (NT / 2); i += THREADS) {
      const int r = i / (NT / 2), q = (i % (NT / 2)) * 2;
      T* pv = bst + r * BR + q;
      const float w = dtcur[r];
      pv[0] = m2::from_f<T>(m2::to_f(pv[0]) * w);
      pv[1] = m2::from_f<T>(m2::to_f(pv[1]) * w);
    }
    // The entry state of chunk c.
    S* out = states + (static_cast<size_t>(bh) * (D.nchunks + 1) + c) * pn;
#pragma unroll
    for (int j = 0; j < NT / 8; ++j) {
      const int n = n0 + j * 8 + tc;
      store2<S>(out + static_cast<size_t>(prow) * D.dstate + n, st[j][0], st[j][1]);
      store2<S>(out + static_cast<size_t>(prow + 8) * D.dstate + n, st[j][2], st[j][3]);
    }
    __syncthreads();

    float acc[NT / 8][4];
#pragma unroll
    for (int j = 0; j < NT / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
    const T* xst = xs + cur * chunk * XR;
    for (int k0 = 0; k0 < chunk; k0 += 16) {
      uint32_t a[4];
      {
        const int s = k0 + (lane % 8) + (lane / 16) * 8;
        const int p = warp * 16 + ((lane / 8) % 2) * 8;
        m2::ldsm_x4_t(a, xst + s * XR + p);
      }
#pragma unroll
      for (int j = 0; j < NT / 8; j += 2) {
        uint32_t bf[4];
        const int s = k0 + (lane % 8) + ((lane / 8) % 2) * 8;
        const int n = (j + lane / 16) * 8;
        m2::ldsm_x4_t(bf, bst + s * BR + n);
        m2::Mma<T>::run(acc[j], a, bf[0], bf[1]);
        m2::Mma<T>::run(acc[j + 1], a, bf[2], bf[3]);
      }
    }
    const float decay = m2::exp2_fast(d_last);
#pragma unroll
    for (int j = 0; j < NT / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[j][e] = decay * st[j][e] + acc[j][e];
  }
  S* out = states + (static_cast<size_t>(bh) * (D.nchunks + 1) + D.nchunks) * pn;
#pragma unroll
  for (int j = 0; j < NT / 8; ++j) {
    const int n = n0 + j * 8 + tc;
    store2<S>(out + static_cast<size_t>(prow) * D.dstate + n, st[j][0], st[j][1]);
    store2<S>(out + static_cast<size_t>(prow + 8) * D.dstate + n, st[j][2], st[j][3]);
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

#define FPS_MMA(T, TN, S, SN, W, NT)                                                      \
  extern "C" __global__ void __launch_bounds__(32 * W)                                    \
      fwd_pass_state_mma_##TN##_##SN##_w##W##_n##NT(FPS_ARGS(T, S)) {                      \
    fwd_pass_state_mma<T, S, W, NT>(x, b, dt, da, init, states, d);                       \
  }
#define FPS_MMA_NT(T, TN, S, SN, W) \
  FPS_MMA(T, TN, S, SN, W, 16) FPS_MMA(T, TN, S, SN, W, 32) FPS_MMA(T, TN, S, SN, W, 64)
#define FPS_MMA_ALL(T, TN, S, SN) FPS_MMA_NT(T, TN, S, SN, 2) FPS_MMA_NT(T, TN, S, SN, 4)
FPS_MMA_ALL(__nv_bfloat16, bf16, float, f32)
FPS_MMA_ALL(__nv_bfloat16, bf16, __nv_bfloat16, bf16)
FPS_MMA_ALL(__half, f16, float, f32)
FPS_MMA_ALL(__half, f16, __nv_bfloat16, bf16)

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
