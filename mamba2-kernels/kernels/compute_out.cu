// Stage 3: the outputs of every chunk, its three terms fused (d = da_cumsum, log2 space):
//   Y[t] = exp2(d_t)·(h_c C_t) + Σ_{s ≤ t} exp2(d_t − d_s)·(C_t·B_s)·dt_s·x_s + D·x_t,  · silu(z_t)
// x, z, y [B,L,H,P] and b, c [B,L,G,N] (value type T), dt/da [B,H,L] f32, chunk states
// [B,H,C+1,P,N] (S), D [H] or [H,P] f32.
//
// compute_out_mma: bf16/f16 on tensor cores. A program owns (batch, chunk, HB heads of one group),
//   blockDim = chunk. Warp w owns the 16-row blocks w and R−1−w (R = chunk/16), which balances
//   the causal work.
//   1. c and b of the chunk land in shared memory; each warp computes C·Bᵀ (tensor cores) for
//      the 16×16 blocks (rb, kb ≤ rb) of its rows once, rounds it to T and keeps it in shared
//      memory in the A-fragment layout of mma.m16n8k16 (a uint4 per lane and block), read back
//      only by the lane that wrote it. b is then dead; its space holds the pipeline buffers.
//   2. The (head, P-tile) units stream through two buffers (x tile, state tile, d, dt) by
//      cp.async: unit u+1 loads while unit u computes. Per unit and row block: Y = C·hᵀ scaled by
//      exp2(d_t); then for every column block kb ≤ rb the stored C·Bᵀ block is scaled in
//      registers and becomes the A operand of Y += S·X.
//   Off the diagonal (kb < rb, r0 = 16·rb, e = 16·kb + 15, so s ≤ e < r0 ≤ t) the decay factors
//   as exp2(d_t − d_r0)·exp2(d_r0 − d_e)·exp2(d_e − d_s), each factor ≤ 1: the first and last
//   are per token (es, ws, once per unit), the middle one per block. The diagonal block uses
//   exp2(d_t − d_s)·dt_s directly, masked by index compare. No masked exponential is used.
// compute_out_simt: any type and shape, for f32 and the sizes the MMA path does not cover.
#include <type_traits>

#include "common.cuh"

namespace {

struct Dims {
  int batch, seqlen, nheads, headdim, ngroups, dstate, chunk, nchunks, heads_per_block;
  int d_per_channel;
};

constexpr int PAD = 8;

__device__ __forceinline__ float4 load4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 load4(const __nv_bfloat16* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
  return make_float4(a.x, a.y, b.x, b.y);
}

// Copies a [rows, cols] chunk-state tile (row stride src_stride) into shared memory as T:
// by cp.async when the state type is the value type, else converted through registers.
template <typename T, typename S>
__device__ __forceinline__ void load_state_tile(T* dst, const S* src, int rows, int cols,
                                                int dst_stride, int src_stride, int tid,
                                                int threads) {
  if constexpr (std::is_same<T, S>::value) {
    for (int i = tid; i < rows * (cols / 8); i += threads) {
      const int r = i / (cols / 8), q = (i % (cols / 8)) * 8;
      m2::cp_async16(dst + r * dst_stride + q, src + static_cast<size_t>(r) * src_stride + q, true);
    }
  } else {
    for (int i = tid; i < rows * (cols / 4); i += threads) {
      const int r = i / (cols / 4), q = (i % (cols / 4)) * 4;
      const float4 v = load4(src + static_cast<size_t>(r) * src_stride + q);
      T* o = dst + r * dst_stride + q;
      o[0] = m2::from_f<T>(v.x);
      o[1] = m2::from_f<T>(v.y);
      o[2] = m2::from_f<T>(v.z);
      o[3] = m2::from_f<T>(v.w);
    }
  }
}

template <typename T>
__device__ __forceinline__ float2 load_pair(const T* p);
template <>
__device__ __forceinline__ float2 load_pair<__nv_bfloat16>(const __nv_bfloat16* p) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
}
template <>
__device__ __forceinline__ float2 load_pair<__half>(const __half* p) {
  return __half22float2(*reinterpret_cast<const __half2*>(p));
}

template <typename T>
__device__ __forceinline__ float2 unpack(uint32_t v) {
  return load_pair<T>(reinterpret_cast<const T*>(&v));
}

// Shared memory of compute_out_mma, in T elements (the host computes the same sizes in bytes):
// cs [chunk][N+PAD] | cb [R(R+1)/2 blocks][256] | two buffers, each
// xs [chunk][PT+PAD], hs [PT][N+PAD], ds, dts, ws, es [chunk] f32. b [chunk][N+PAD] takes the
// second buffer while C·Bᵀ is computed, or both when it does not fit in one.
template <int PT>
struct Layout {
  int NR, XR, cb, buf;
  __device__ Layout(int chunk, int N)
      : NR(N + PAD), XR(PT + PAD), cb((chunk / 16) * (chunk / 16 + 1) / 2 * 256),
        buf(chunk * (PT + PAD) + PT * (N + PAD) + 4 * chunk * 2) {}
};

template <typename T, typename S, int PT>
__device__ void compute_out_mma(const T* __restrict__ x, const T* __restrict__ bm,
                                const T* __restrict__ cm, const float* __restrict__ dt,
                                const float* __restrict__ da, const S* __restrict__ states,
                                const float* __restrict__ dskip, const T* __restrict__ z,
                                T* __restrict__ y, Dims D) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int chunk = D.chunk, N = D.dstate, P = D.headdim;
  const Layout<PT> lay(chunk, N);
  const int NR = lay.NR, XR = lay.XR;
  T* cs = reinterpret_cast<T*>(smem_raw);
  uint4* cbs = reinterpret_cast<uint4*>(cs + chunk * NR);
  T* const buf0 = cs + chunk * NR + lay.cb;
  auto buf_of = [&](int u) { return buf0 + (u % 2) * lay.buf; };
  const bool b_late = chunk * NR > lay.buf;  // b needs both buffers: unit 0 waits for C·Bᵀ
  T* bs = b_late ? buf0 : buf0 + lay.buf;

  const int c = blockIdx.x, b = blockIdx.z;
  const int h_first = blockIdx.y * D.heads_per_block;
  const int g = h_first / (D.nheads / D.ngroups);
  const int l0 = c * chunk, len = min(chunk, D.seqlen - l0);
  const int threads = blockDim.x, tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int rblocks = chunk / 16;
  const int ptiles = P / PT, units = D.heads_per_block * ptiles;
  const size_t hp = static_cast<size_t>(D.nheads) * P;
  const size_t gn = static_cast<size_t>(D.ngroups) * N;
  const size_t tok0 = static_cast<size_t>(b) * D.seqlen + l0;
  const int gr = lane / 4, tc = (lane % 4) * 2;

  // A buffer's parts: x tile (at its start), state tile, then d, dt, ws, es.
  auto hs_of = [&](T* buf) { return buf + chunk * XR; };
  auto ds_of = [&](T* buf) { return reinterpret_cast<float*>(buf + chunk * XR + PT * NR); };

  auto load_unit = [&](int u) {
    T* buf = buf_of(u);
    const int h = h_first + u / ptiles, p0 = (u % ptiles) * PT;
    const size_t bh = static_cast<size_t>(b) * D.nheads + h;
    T* xs = buf;
    for (int i = tid; i < chunk * (PT / 8); i += threads) {
      const int r = i / (PT / 8), q = (i % (PT / 8)) * 8;
      const bool ok = r < len;
      m2::cp_async16(xs + r * XR + q, x + (tok0 + (ok ? r : 0)) * hp + h * P + p0 + q, ok);
    }
    const S* st = states + ((bh * (D.nchunks + 1)) + c) * static_cast<size_t>(P) * N +
                  static_cast<size_t>(p0) * N;
    load_state_tile<T, S>(hs_of(buf), st, PT, N, NR, N, tid, threads);
    float* ds = ds_of(buf);
    const bool ok = tid < len;
    const size_t at = bh * D.seqlen + l0 + (ok ? tid : 0);
    m2::cp_async4(ds + tid, da + at, ok);
    m2::cp_async4(ds + chunk + tid, dt + at, ok);
  };

  // 1. c and b, then C·Bᵀ of this warp's blocks.
  for (int i = tid; i < chunk * (N / 8); i += threads) {
    const int r = i / (N / 8), q = (i % (N / 8)) * 8;
    const bool ok = r < len;
    const size_t src = (tok0 + (ok ? r : 0)) * gn + static_cast<size_t>(g) * N + q;
    m2::cp_async16(cs + r * NR + q, cm + src, ok);
    m2::cp_async16(bs + r * NR + q, bm + src, ok);
  }
  m2::cp_async_commit();
  if (b_late) {
    m2::cp_async_wait<0>();
  } else {
    load_unit(0);
    m2::cp_async_commit();
    m2::cp_async_wait<1>();
  }
  __syncthreads();

  uint4* cbw = cbs + warp * (rblocks + 1) * 32 + lane;  // this lane's slot of block 0
  for (int half = 0; half < 2; ++half) {
    const int rb = half == 0 ? warp : rblocks - 1 - warp;
    if (rb * 16 >= len) continue;
    for (int kb = 0; kb <= rb; ++kb) {
      float s[2][4] = {};
      for (int k0 = 0; k0 < N; k0 += 16) {
        uint32_t a[4], bf[4];
        m2::ldsm_x4(a, cs + (rb * 16 + (lane % 8) + ((lane / 8) % 2) * 8) * NR + k0 + (lane / 16) * 8);
        m2::ldsm_x4(bf, bs + (kb * 16 + (lane / 16) * 8 + (lane % 8)) * NR + k0 + ((lane / 8) % 2) * 8);
        m2::Mma<T>::run(s[0], a, bf[0], bf[1]);
        m2::Mma<T>::run(s[1], a, bf[2], bf[3]);
      }
      cbw[(half * (warp + 1) + kb) * 32] =
          make_uint4(m2::Mma<T>::pack(s[0][0], s[0][1]), m2::Mma<T>::pack(s[0][2], s[0][3]),
                     m2::Mma<T>::pack(s[1][0], s[1][1]), m2::Mma<T>::pack(s[1][2], s[1][3]));
    }
  }
  __syncthreads();  // b is dead
  if (b_late) {
    load_unit(0);
    m2::cp_async_commit();
  }

  // 2. The units, double-buffered.
  for (int u = 0; u < units; ++u) {
    if (u + 1 < units) load_unit(u + 1);
    m2::cp_async_commit();
    m2::cp_async_wait<1>();
    __syncthreads();
    T* buf = buf_of(u);
    const T* xs = buf;
    const T* hs = hs_of(buf);
    float* ds = ds_of(buf);
    float* dts = ds + chunk;
    float* ws = dts + chunk;
    float* es = ws + chunk;
    if (tid < len) {
      const float d = ds[tid];
      ws[tid] = m2::exp2_fast(ds[min(tid | 15, len - 1)] - d) * dts[tid];
      es[tid] = m2::exp2_fast(d - ds[tid & ~15]);
    } else {
      ws[tid] = 0.f;
      es[tid] = 0.f;
    }
    __syncthreads();

    const int h = h_first + u / ptiles, p0 = (u % ptiles) * PT;
    for (int half = 0; half < 2; ++half) {
      const int rb = half == 0 ? warp : rblocks - 1 - warp;
      if (rb * 16 >= len) continue;
      const int t_lo = rb * 16 + gr, t_hi = t_lo + 8;
      float acc[PT / 8][4] = {};
      // Y = C·hᵀ.
      for (int k0 = 0; k0 < N; k0 += 16) {
        uint32_t a[4];
        m2::ldsm_x4(a, cs + (rb * 16 + (lane % 8) + ((lane / 8) % 2) * 8) * NR + k0 + (lane / 16) * 8);
#pragma unroll
        for (int j = 0; j < PT / 8; j += 2) {
          uint32_t bf[4];
          m2::ldsm_x4(bf, hs + ((j + lane / 16) * 8 + (lane % 8)) * NR + k0 + ((lane / 8) % 2) * 8);
          m2::Mma<T>::run(acc[j], a, bf[0], bf[1]);
          m2::Mma<T>::run(acc[j + 1], a, bf[2], bf[3]);
        }
      }
      const float d_lo = ds[t_lo], d_hi = ds[t_hi], d_r0 = ds[rb * 16];
      const float y_lo = m2::exp2_fast(d_lo), y_hi = m2::exp2_fast(d_hi);
#pragma unroll
      for (int j = 0; j < PT / 8; ++j) {
        acc[j][0] *= y_lo;
        acc[j][1] *= y_lo;
        acc[j][2] *= y_hi;
        acc[j][3] *= y_hi;
      }
      // Y += (C·Bᵀ ∘ decay·dt ∘ causal)·X over the column blocks kb ≤ rb.
      const float e_lo = es[t_lo], e_hi = es[t_hi];
      for (int kb = 0; kb <= rb; ++kb) {
        const uint4 raw = cbw[(half * (warp + 1) + kb) * 32];
        const uint32_t cb[4] = {raw.x, raw.y, raw.z, raw.w};
        uint32_t sa[4];
        if (kb < rb) {
          const float blk = m2::exp2_fast(d_r0 - ds[kb * 16 + 15]);
          const float f_lo = e_lo * blk, f_hi = e_hi * blk;
#pragma unroll
          for (int v = 0; v < 2; ++v) {
            const float2 w = *reinterpret_cast<const float2*>(ws + kb * 16 + v * 8 + tc);
            const float2 lo = unpack<T>(cb[v * 2]), hi = unpack<T>(cb[v * 2 + 1]);
            sa[v * 2] = m2::Mma<T>::pack(lo.x * w.x * f_lo, lo.y * w.y * f_lo);
            sa[v * 2 + 1] = m2::Mma<T>::pack(hi.x * w.x * f_hi, hi.y * w.y * f_hi);
          }
        } else {
#pragma unroll
          for (int v = 0; v < 2; ++v) {
            const int s0 = kb * 16 + v * 8 + tc;
            const float w0 = dts[s0], w1 = dts[s0 + 1], q0 = ds[s0], q1 = ds[s0 + 1];
            const float2 lo = unpack<T>(cb[v * 2]), hi = unpack<T>(cb[v * 2 + 1]);
            const float v0 = s0 <= t_lo ? lo.x * m2::exp2_fast(d_lo - q0) * w0 : 0.f;
            const float v1 = s0 + 1 <= t_lo ? lo.y * m2::exp2_fast(d_lo - q1) * w1 : 0.f;
            const float v2 = s0 <= t_hi ? hi.x * m2::exp2_fast(d_hi - q0) * w0 : 0.f;
            const float v3 = s0 + 1 <= t_hi ? hi.y * m2::exp2_fast(d_hi - q1) * w1 : 0.f;
            sa[v * 2] = m2::Mma<T>::pack(v0, v1);
            sa[v * 2 + 1] = m2::Mma<T>::pack(v2, v3);
          }
        }
#pragma unroll
        for (int j = 0; j < PT / 8; j += 2) {
          uint32_t bf[4];
          m2::ldsm_x4_t(bf, xs + (kb * 16 + (lane % 8) + ((lane / 8) % 2) * 8) * XR + (j + lane / 16) * 8);
          m2::Mma<T>::run(acc[j], sa, bf[0], bf[1]);
          m2::Mma<T>::run(acc[j + 1], sa, bf[2], bf[3]);
        }
      }
      // + D·x, · silu(z), store.
#pragma unroll
      for (int j = 0; j < PT / 8; ++j) {
        const int p = j * 8 + tc;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int t = r == 0 ? t_lo : t_hi;
          if (t >= len) continue;
          float v0 = acc[j][2 * r], v1 = acc[j][2 * r + 1];
          if (dskip) {
            const float2 xv = load_pair<T>(xs + t * XR + p);
            const float d0 = D.d_per_channel ? dskip[h * P + p0 + p] : dskip[h];
            const float d1 = D.d_per_channel ? dskip[h * P + p0 + p + 1] : dskip[h];
            v0 += d0 * xv.x;
            v1 += d1 * xv.y;
          }
          const size_t o = (tok0 + t) * hp + static_cast<size_t>(h) * P + p0 + p;
          if (z) {
            const float2 zv = load_pair<T>(z + o);
            v0 *= m2::silu(zv.x);
            v1 *= m2::silu(zv.y);
          }
          m2::store2<T>(y + o, v0, v1);
        }
      }
    }
    __syncthreads();  // this buffer is free for unit u + 2
  }
}

template <typename T, typename S>
__device__ void compute_out_simt(const T* __restrict__ x, const T* __restrict__ bm,
                                 const T* __restrict__ cm, const float* __restrict__ dt,
                                 const float* __restrict__ da, const S* __restrict__ states,
                                 const float* __restrict__ dskip, const T* __restrict__ z,
                                 T* __restrict__ y, Dims D) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  constexpr int RT = 16;
  float* m = reinterpret_cast<float*>(smem_raw);  // [RT][chunk]
  const int c = blockIdx.x, bh = blockIdx.y;
  const int b = bh / D.nheads, h = bh % D.nheads, g = h / (D.nheads / D.ngroups);
  const int chunk = D.chunk, N = D.dstate, P = D.headdim;
  const int l0 = c * chunk, len = min(chunk, D.seqlen - l0);
  const size_t hp = static_cast<size_t>(D.nheads) * P, gn = static_cast<size_t>(D.ngroups) * N;
  const size_t tok0 = static_cast<size_t>(b) * D.seqlen + l0;
  const size_t row = static_cast<size_t>(bh) * D.seqlen + l0;
  const S* st = states + (static_cast<size_t>(bh) * (D.nchunks + 1) + c) * static_cast<size_t>(P) * N;
  const T* cg = cm + tok0 * gn + static_cast<size_t>(g) * N;
  const T* bg = bm + tok0 * gn + static_cast<size_t>(g) * N;
  const T* xh = x + tok0 * hp + static_cast<size_t>(h) * P;
  for (int t0 = 0; t0 < len; t0 += RT) {
    const int rows = min(RT, len - t0);
    __syncthreads();
    for (int i = threadIdx.x; i < RT * chunk; i += blockDim.x) {
      const int r = i / chunk, s = i % chunk, t = t0 + r;
      float v = 0.f;
      if (r < rows && s <= t) {
        float dot = 0.f;
        for (int n = 0; n < N; ++n)
          dot += m2::to_f(cg[t * gn + n]) * m2::to_f(bg[s * gn + n]);
        v = dot * m2::exp2_fast(da[row + t] - da[row + s]) * dt[row + s];
      }
      m[r * chunk + s] = v;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < rows * P; i += blockDim.x) {
      const int r = i / P, p = i % P, t = t0 + r;
      float acc = 0.f;
      for (int s = 0; s <= t; ++s) acc += m[r * chunk + s] * m2::to_f(xh[s * hp + p]);
      float hc = 0.f;
      for (int n = 0; n < N; ++n) hc += m2::to_f(cg[t * gn + n]) * m2::to_f(st[p * N + n]);
      float v = acc + m2::exp2_fast(da[row + t]) * hc;
      const float xv = m2::to_f(xh[t * hp + p]);
      if (dskip) v += (D.d_per_channel ? dskip[h * P + p] : dskip[h]) * xv;
      const size_t o = (tok0 + t) * hp + static_cast<size_t>(h) * P + p;
      if (z) v *= m2::silu(m2::to_f(z[o]));
      y[o] = m2::from_f<T>(v);
    }
  }
}

}  // namespace

#define CO_ARGS(T, S)                                                                        \
  const T *x, const T *b, const T *c, const float *dt, const float *da, const S *states,     \
      const float *dskip, const T *z, T *y, Dims d

#define CO_MMA(T, TN, S, SN, PT)                                                       \
  extern "C" __global__ void __launch_bounds__(256)                                    \
      compute_out_mma_##TN##_##SN##_p##PT(CO_ARGS(T, S)) {                            \
    m2::wait_prior_grid();                                                            \
    compute_out_mma<T, S, PT>(x, b, c, dt, da, states, dskip, z, y, d);               \
  }
#define CO_MMA_PT(T, TN, S, SN) CO_MMA(T, TN, S, SN, 32) CO_MMA(T, TN, S, SN, 64)
CO_MMA_PT(__nv_bfloat16, bf16, float, f32)
CO_MMA_PT(__nv_bfloat16, bf16, __nv_bfloat16, bf16)
CO_MMA_PT(__half, f16, float, f32)
CO_MMA_PT(__half, f16, __nv_bfloat16, bf16)

#define CO_SIMT(T, TN, S, SN)                                                     \
  extern "C" __global__ void compute_out_simt_##TN##_##SN(CO_ARGS(T, S)) {        \
    m2::wait_prior_grid();                                                        \
    compute_out_simt<T, S>(x, b, c, dt, da, states, dskip, z, y, d);              \
  }
CO_SIMT(float, f32, float, f32)
CO_SIMT(float, f32, __nv_bfloat16, bf16)
CO_SIMT(__half, f16, float, f32)
CO_SIMT(__half, f16, __nv_bfloat16, bf16)
CO_SIMT(__nv_bfloat16, bf16, float, f32)
CO_SIMT(__nv_bfloat16, bf16, __nv_bfloat16, bf16)
