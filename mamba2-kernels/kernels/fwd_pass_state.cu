// Stage 2: the state entering every chunk, by the jump formula (d = da_cumsum, log2 space):
//   h_{c+1} = exp2(d_last)·h_c + Σ_s exp2(d_last − d_s)·dt_s · x_s B_sᵀ        h: [P, N]
// x [B,L,H,P], b [B,L,G,N] (value type T), dt/da [B,H,L] f32, init [B,H,P,N] and
// states [B,H,C+1,P,N] in the state type S (f32 or bf16). Two tensor-core paths for bf16/f16
// (the launcher picks by shape: the walk when its programs fill the GPU over a short walk, or
// N ≥ 256; the pair otherwise) and a SIMT one:
//
// fwd_pass_state_mma (the walk): a program owns one [PT, NT] tile of one
//   (batch, head)'s state as the f32 accumulators of m16n8k16 MMAs (4 warps, each a block of
//   it). Per chunk: store the carried state as the entry state (each warp stages its block in
//   shared memory and writes 16-byte vectors), h ← exp2(d_last)·h, then h += xᵀ·(w∘b) with
//   w_s = exp2(d_last − d_s)·dt_s applied to the x fragments in registers (w depends only on the
//   token, the MMA's k). x, b, dt and d of the next `stages − 1` chunks are in flight by cp.async.
//   Needs P % PT == 0, N % NT == 0, chunk % 16 == 0.
// chunk_state_mma + state_scan (the pair): every chunk's own contribution in parallel on tensor
//   cores (needs P % (16·WARPS) == 0, N % NT == 0), written to slot c + 1, then the cheap
//   recurrence across chunks in place, streaming the slots with 16-byte accesses.
// fwd_pass_state_simt: any type and shape; one thread per state element, chunks in order.
#include "common.cuh"

namespace {

struct Dims {
  int batch, seqlen, nheads, headdim, ngroups, dstate, chunk, nchunks;
};

constexpr int PAD = 8;    // elements of padding per shared row: conflict-free ldmatrix and staging
constexpr int WARPS = 4;  // per fwd_pass_state_mma program

// Wait until at most `n` (0, 1 or 2) cp.async groups are pending.
__device__ __forceinline__ void cp_async_wait_pending(int n) {
  if (n >= 2) m2::cp_async_wait<2>();
  else if (n == 1) m2::cp_async_wait<1>();
  else m2::cp_async_wait<0>();
}

// Elementwise product of two packed pairs of T.
template <typename T> __device__ __forceinline__ uint32_t mul2(uint32_t a, uint32_t b);
template <> __device__ __forceinline__ uint32_t mul2<__nv_bfloat16>(uint32_t a, uint32_t b) {
  const __nv_bfloat162 r = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&a),
                                   *reinterpret_cast<const __nv_bfloat162*>(&b));
  return *reinterpret_cast<const uint32_t*>(&r);
}
template <> __device__ __forceinline__ uint32_t mul2<__half>(uint32_t a, uint32_t b) {
  const __half2 r = __hmul2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b));
  return *reinterpret_cast<const uint32_t*>(&r);
}

// Grid (N / NT, P / PT, B·H), WARPS·32 threads; `stages` (2–4) chunk buffers in shared memory.
// The warps tile [PT, NT] as WM × WN blocks of [MW, NW]; a warp's accumulators acc[i][j] cover
// rows 16i.. of its block and columns 8j.. (elements 0,1: row lane/4, columns (lane%4)·2 + {0,1};
// elements 2,3: row lane/4 + 8).
template <typename T, typename S, int PT, int NT>
__device__ void fwd_pass_state_mma(const T* __restrict__ x, const T* __restrict__ bm,
                                   const float* __restrict__ dt, const float* __restrict__ da,
                                   const S* __restrict__ init, S* __restrict__ states, Dims D,
                                   int stages) {
  constexpr int WM = (PT == 64 && NT <= 32) ? 4 : 2, WN = WARPS / WM;
  constexpr int MW = PT / WM, NW = NT / WN, MI = MW / 16, NJ = NW / 8;
  static_assert(MW % 16 == 0 && NW % 16 == 0, "warp blocks of whole 16x16 tiles");
  constexpr int XR = PT + PAD, BR = NT + PAD, SR = NW + PAD, THREADS = 32 * WARPS;
  constexpr int V = 16 / sizeof(S);  // state elements per 16-byte store
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int chunk = D.chunk;
  T* xs = reinterpret_cast<T*>(smem_raw);                          // [stages][chunk][XR]
  T* bs = xs + stages * chunk * XR;                                // [stages][chunk][BR]
  float* ds = reinterpret_cast<float*>(bs + stages * chunk * BR);  // [stages][chunk]
  float* dts = ds + stages * chunk;                                // [stages][chunk]
  S* hs = reinterpret_cast<S*>(dts + stages * chunk);              // [WARPS][16][SR]
  T* ws = reinterpret_cast<T*>(hs + WARPS * 16 * SR);              // [WARPS][chunk]

  const int n0 = blockIdx.x * NT, p0 = blockIdx.y * PT, bh = blockIdx.z;
  const int b = bh / D.nheads, h = bh % D.nheads, g = h / (D.nheads / D.ngroups);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int wp = (warp % WM) * MW, wn = (warp / WM) * NW;  // the warp's block in the tile
  const int gr = lane / 4, tc = (lane % 4) * 2;
  const size_t hp = static_cast<size_t>(D.nheads) * D.headdim;
  const size_t gn = static_cast<size_t>(D.ngroups) * D.dstate;
  const size_t pn = static_cast<size_t>(D.headdim) * D.dstate;
  const T* xh = x + static_cast<size_t>(b) * D.seqlen * hp + static_cast<size_t>(h) * D.headdim + p0;
  const T* bg = bm + static_cast<size_t>(b) * D.seqlen * gn + static_cast<size_t>(g) * D.dstate + n0;
  const float* dth = dt + static_cast<size_t>(bh) * D.seqlen;
  const float* dah = da + static_cast<size_t>(bh) * D.seqlen;
  S* hout = states + static_cast<size_t>(bh) * (D.nchunks + 1) * pn +
            static_cast<size_t>(p0 + wp) * D.dstate + n0 + wn;
  S* hsw = hs + warp * 16 * SR;
  T* wsw = ws + warp * chunk;

  // Chunk c's x, b, dt and d into buffer c % stages (rows past the sequence zero-filled); one
  // cp.async group per call, empty past the last chunk.
  auto load = [&](int c) {
    if (c < D.nchunks) {
      const int l0 = c * chunk, len = min(chunk, D.seqlen - l0), buf = c % stages;
      T* xd = xs + buf * chunk * XR;
      T* bd = bs + buf * chunk * BR;
      for (int i = tid; i < chunk * (PT / 8); i += THREADS) {
        const int r = i / (PT / 8), q = i % (PT / 8) * 8;
        const bool ok = r < len;
        m2::cp_async16(xd + r * XR + q, xh + static_cast<size_t>(l0 + (ok ? r : 0)) * hp + q, ok);
      }
      for (int i = tid; i < chunk * (NT / 8); i += THREADS) {
        const int r = i / (NT / 8), q = i % (NT / 8) * 8;
        const bool ok = r < len;
        m2::cp_async16(bd + r * BR + q, bg + static_cast<size_t>(l0 + (ok ? r : 0)) * gn + q, ok);
      }
      for (int i = tid; i < chunk; i += THREADS) {
        const bool ok = i < len;
        m2::cp_async4(ds + buf * chunk + i, dah + l0 + (ok ? i : 0), ok);
        m2::cp_async4(dts + buf * chunk + i, dth + l0 + (ok ? i : 0), ok);
      }
    }
    m2::cp_async_commit();
  };

  float acc[MI][NJ][4];
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const size_t p = p0 + wp + i * 16 + gr + (e / 2) * 8;
        const int n = n0 + wn + j * 8 + tc + e % 2;
        acc[i][j][e] = init ? m2::to_f(init[bh * pn + p * D.dstate + n]) : 0.f;
      }

  // The carried state as slot `slot`: each warp stages 16 rows of its block at a time and writes
  // them as 16-byte vectors (whole 32-byte sectors of every row).
  auto store = [&](int slot) {
    S* dst = hout + static_cast<size_t>(slot) * pn;
#pragma unroll
    for (int i = 0; i < MI; ++i) {
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        m2::store2<S>(hsw + gr * SR + j * 8 + tc, acc[i][j][0], acc[i][j][1]);
        m2::store2<S>(hsw + (gr + 8) * SR + j * 8 + tc, acc[i][j][2], acc[i][j][3]);
      }
      __syncwarp();
#pragma unroll
      for (int v = lane; v < 16 * (NW / V); v += 32) {
        const int r = v / (NW / V), q = v % (NW / V) * V;
        *reinterpret_cast<uint4*>(dst + static_cast<size_t>(i * 16 + r) * D.dstate + q) =
            *reinterpret_cast<const uint4*>(hsw + r * SR + q);
      }
      __syncwarp();
    }
  };

  for (int c = 0; c < stages - 1; ++c) load(c);
  for (int c = 0; c < D.nchunks; ++c) {
    store(c);
    cp_async_wait_pending(stages - 2);
    __syncthreads();  // chunk c has landed for all; every warp is done with chunk c − 1's buffer
    load(c + stages - 1);
    const int buf = c % stages, len = min(chunk, D.seqlen - c * chunk);
    const T* xc = xs + buf * chunk * XR;
    const T* bc = bs + buf * chunk * BR;
    const float* dc = ds + buf * chunk;
    const float* dtc = dts + buf * chunk;
    const float d_last = dc[len - 1];
    for (int s = lane; s < chunk; s += 32)
      wsw[s] = m2::from_f<T>(s < len ? m2::exp2_fast(d_last - dc[s]) * dtc[s] : 0.f);
    __syncwarp();
    const float decay = m2::exp2_fast(d_last);
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
      for (int j = 0; j < NJ; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][j][e] *= decay;
    for (int k0 = 0; k0 < len; k0 += 16) {
      // This thread's tokens: k0 + (lane%4)·2 + {0, 1} (fragment registers 0, 1) and + 8 (2, 3).
      const uint32_t w0 = *reinterpret_cast<const uint32_t*>(wsw + k0 + tc);
      const uint32_t w8 = *reinterpret_cast<const uint32_t*>(wsw + k0 + tc + 8);
      uint32_t a[MI][4];
#pragma unroll
      for (int i = 0; i < MI; ++i) {
        m2::ldsm_x4_t(a[i], xc + (k0 + lane % 8 + lane / 16 * 8) * XR + wp + i * 16 + lane / 8 % 2 * 8);
        a[i][0] = mul2<T>(a[i][0], w0);
        a[i][1] = mul2<T>(a[i][1], w0);
        a[i][2] = mul2<T>(a[i][2], w8);
        a[i][3] = mul2<T>(a[i][3], w8);
      }
#pragma unroll
      for (int j = 0; j < NJ; j += 2) {
        uint32_t bf[4];
        m2::ldsm_x4_t(bf, bc + (k0 + lane % 8 + lane / 8 % 2 * 8) * BR + wn + (j + lane / 16) * 8);
#pragma unroll
        for (int i = 0; i < MI; ++i) {
          m2::Mma<T>::run(acc[i][j], a[i], bf[0], bf[1]);
          m2::Mma<T>::run(acc[i][j + 1], a[i], bf[2], bf[3]);
        }
      }
    }
  }
  store(D.nchunks);
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

// One chunk's own contribution to the state, local_c = Σ_s exp2(d_last − d_s)·dt_s · x_s B_sᵀ,
// written to slot c + 1 of `states` (state_scan turns the slots into entry states in place).
// A program owns (batch·head·chunk, a [16·WARPS, NT] tile): x and b arrive by cp.async, xᵀ·b is
// an m16n8k16 chain with ldmatrix.trans for both operands and w_s = exp2(d_last − d_s)·dt_s
// applied to x's fragments in registers; the tile leaves through shared memory as 16-byte rows.
template <typename T, typename S, int WARPS, int NT>
__device__ void chunk_state_mma(const T* __restrict__ x, const T* __restrict__ bm,
                                const float* __restrict__ dt, const float* __restrict__ da,
                                S* __restrict__ states, Dims D) {
  constexpr int PT = 16 * WARPS, XR = PT + PAD, BR = NT + PAD, THREADS = 32 * WARPS;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int chunk = D.chunk;
  T* xs = reinterpret_cast<T*>(smem_raw);                   // [chunk][XR]
  T* bs = xs + chunk * XR;                                  // [chunk][BR]
  T* ws = bs + chunk * BR;                                  // [chunk]

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
    ws[i] = m2::from_f<T>(i < len ? m2::exp2_fast(d_last - da[row + l0 + i]) * dt[row + l0 + i] : 0.f);
  m2::cp_async_wait<0>();
  __syncthreads();

  float acc[NT / 8][4];
#pragma unroll
  for (int j = 0; j < NT / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
  const int tc = (lane % 4) * 2;
  for (int k0 = 0; k0 < len; k0 += 16) {
    // x's fragment holds tokens k0 + tc + {0, 1} (registers 0, 1) and k0 + tc + 8 + {0, 1}
    // (registers 2, 3): w scales them there, in registers.
    uint32_t a[4];
    m2::ldsm_x4_t(a, xs + (k0 + (lane % 8) + (lane / 16) * 8) * XR + warp * 16 + ((lane / 8) % 2) * 8);
    const uint32_t w0 = *reinterpret_cast<const uint32_t*>(ws + k0 + tc);
    const uint32_t w8 = *reinterpret_cast<const uint32_t*>(ws + k0 + tc + 8);
    a[0] = mul2<T>(a[0], w0);
    a[1] = mul2<T>(a[1], w0);
    a[2] = mul2<T>(a[2], w8);
    a[3] = mul2<T>(a[3], w8);
#pragma unroll
    for (int j = 0; j < NT / 8; j += 2) {
      uint32_t bf[4];
      m2::ldsm_x4_t(bf, bs + (k0 + (lane % 8) + ((lane / 8) % 2) * 8) * BR + (j + lane / 16) * 8);
      m2::Mma<T>::run(acc[j], a, bf[0], bf[1]);
      m2::Mma<T>::run(acc[j + 1], a, bf[2], bf[3]);
    }
  }
  // The warp's 16 × NT block through shared memory (the x and b tiles' space, free once every warp
  // is done with them), then out as 16-byte vectors: whole 32-byte sectors of every row.
  __syncthreads();
  constexpr int SR = NT + PAD, V = 16 / sizeof(S);
  S* hs = reinterpret_cast<S*>(smem_raw) + warp * 16 * SR;
  const int gr = lane / 4;
#pragma unroll
  for (int j = 0; j < NT / 8; ++j) {
    m2::store2<S>(hs + gr * SR + j * 8 + tc, acc[j][0], acc[j][1]);
    m2::store2<S>(hs + (gr + 8) * SR + j * 8 + tc, acc[j][2], acc[j][3]);
  }
  __syncwarp();
  S* out = states + (static_cast<size_t>(bh) * (D.nchunks + 1) + c + 1) * pn +
           static_cast<size_t>(p0 + warp * 16) * D.dstate + n0;
#pragma unroll
  for (int v = lane; v < 16 * (NT / V); v += 32) {
    const int r = v / (NT / V), q = v % (NT / V) * V;
    *reinterpret_cast<uint4*>(out + static_cast<size_t>(r) * D.dstate + q) =
        *reinterpret_cast<const uint4*>(hs + r * SR + q);
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

}  // namespace

#define FPS_ARGS(T, S) \
  const T *x, const T *b, const float *dt, const float *da, const S *init, S *states, Dims d

#define FPS_MMA(T, TN, S, SN, PT, NT)                                                      \
  extern "C" __global__ void __launch_bounds__(32 * WARPS)                                  \
      fwd_pass_state_mma_##TN##_##SN##_p##PT##_n##NT(FPS_ARGS(T, S), int stages) {        \
    m2::wait_prior_grid();                                                                \
    fwd_pass_state_mma<T, S, PT, NT>(x, b, dt, da, init, states, d, stages);              \
  }
#define FPS_MMA_TILES(T, TN, S, SN)                                               \
  FPS_MMA(T, TN, S, SN, 64, 64) FPS_MMA(T, TN, S, SN, 64, 32)                     \
  FPS_MMA(T, TN, S, SN, 32, 64) FPS_MMA(T, TN, S, SN, 32, 32) FPS_MMA(T, TN, S, SN, 64, 16)
FPS_MMA_TILES(__nv_bfloat16, bf16, float, f32)
FPS_MMA_TILES(__nv_bfloat16, bf16, __nv_bfloat16, bf16)
FPS_MMA_TILES(__half, f16, float, f32)
FPS_MMA_TILES(__half, f16, __nv_bfloat16, bf16)

#define FPS_SIMT(T, TN, S, SN)                                                   \
  extern "C" __global__ void fwd_pass_state_simt_##TN##_##SN(FPS_ARGS(T, S)) {   \
    m2::wait_prior_grid();                                                       \
    fwd_pass_state_simt<T, S>(x, b, dt, da, init, states, d);                    \
  }
FPS_SIMT(float, f32, float, f32)
FPS_SIMT(float, f32, __nv_bfloat16, bf16)
FPS_SIMT(__half, f16, float, f32)
FPS_SIMT(__half, f16, __nv_bfloat16, bf16)
FPS_SIMT(__nv_bfloat16, bf16, float, f32)
FPS_SIMT(__nv_bfloat16, bf16, __nv_bfloat16, bf16)

#define CHUNK_STATE(T, TN, S, SN, W, NT)                                                     \
  extern "C" __global__ void __launch_bounds__(32 * W)                                       \
      chunk_state_mma_##TN##_##SN##_w##W##_n##NT(const T* x, const T* b, const float* dt,     \
                                                 const float* da, S* states, Dims d) {       \
    m2::wait_prior_grid();                                                                   \
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
    m2::wait_prior_grid();                                                                   \
    state_scan<S>(da, init, states, d);                                                      \
  }
SCAN(float, f32)
SCAN(__nv_bfloat16, bf16)

