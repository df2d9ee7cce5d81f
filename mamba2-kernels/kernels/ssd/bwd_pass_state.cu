// The backward state pass: the gradient of the state entering every chunk, in two kernels.
// With d the chunk's log2-space cumulative sums, dY = dy, and dH' the gradient of the state
// leaving chunk c (the final state's gradient for the last chunk):
//   bwd_chunk_state:  U_c = Σ_t exp2(d_t)·dy_t C_tᵀ          (every chunk in parallel, [P, N])
//   bwd_state_scan:   dH'_{c−1} = exp2(d_last(c))·dH'_c + U_c  (chunks last to first)
// bwd_state_scan overwrites U_c with dH'_c (what bwd_compute_out reads for chunk c) and writes
// the initial state's gradient dH'_{−1}. Layouts: dy [B,L,H,P], c [B,L,G,N] contiguous, da
// [B,H,L] f32, dlast and dinit [B,H,P,N] f32 (dlast null: zero), dstates [B,H,C+1,P,N] of S,
// chunk c in slot c + 1 as the forward's chunk states (slot 0 unused): U_c can then come from
// the forward's chunk_state_mma instead (dY for x, C for B, and dt null: weights exp2(d_s)), as
// the launcher does wherever that kernel takes the shape; bwd_chunk_state is the rest's. Its chunks
// are 64 tokens; the scan's are d.chunk (64, or 128 after chunk_state_mma).
#include "params.cuh"
#include "ssd/warp_tile.cuh"

namespace {

constexpr int TOKENS = 64, WARPS = 4;

// One program per (chunk, batch·head): U_c = (dY)ᵀ·(exp2(d)∘C) on a [P, N] tile, 64 columns
// of N at a time per warp row block.
template <typename T, typename S>
__device__ void bwd_chunk_state(const T* __restrict__ dy, const T* __restrict__ c,
                                const float* __restrict__ da, S* __restrict__ dstates,
                                const m2::SsdParams& d) {
  extern __shared__ unsigned char smem_raw[];
  const int P = d.headdim, N = d.dstate, H = d.nheads, L = d.seqlen;
  const int pp = (P + 63) / 64 * 64, np = (N + 63) / 64 * 64;
  const int ldp = pp + 8, ldn = np + 8;
  T* dys = reinterpret_cast<T*>(m2::smem_aligned(smem_raw));
  T* cs = dys + TOKENS * ldp;
  float* scale = reinterpret_cast<float*>(cs + TOKENS * ldn);
  // Program i takes (batch·head, chunk) = (i mod B·H, ⌊i / B·H⌋): a group's heads read a chunk's C
  // tile side by side (from L2), and the last chunks, which bwd_state_scan reads first, come last.
  const int nbh = d.batch * H, bh = blockIdx.x % nbh, ci = blockIdx.x / nbh;
  const int b = bh / H, h = bh % H;
  const int grp = h / (H / d.ngroups);
  const int l0 = ci * TOKENS, tc = min(TOKENS, L - l0);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  m2::wait_prior_grid();
  const size_t bhl = static_cast<size_t>(bh) * L;
  for (int t = tid; t < TOKENS; t += blockDim.x)
    scale[t] = t < tc ? m2::exp2_fast(da[bhl + l0 + t]) : 0.f;
  const size_t tok = static_cast<size_t>(b) * L + l0;
  m2::stage(dys, ldp, dy + (tok * H + h) * P, static_cast<size_t>(H) * P, tc, P, TOKENS, pp, tid,
            blockDim.x);
  const size_t cstride = static_cast<size_t>(d.ngroups) * N;
  m2::stage(cs, ldn, c + (tok * d.ngroups + grp) * N, cstride, tc, N, TOKENS, np, tid, blockDim.x);
  m2::stage_wait();
  __syncthreads();
  // exp2(d_t) folded into the narrower tile's rows: dYᵀ·diag(s)·C either way.
  if (pp <= np)
    m2::scale_rows(dys, ldp, TOKENS, pp, scale, tid, blockDim.x);
  else
    m2::scale_rows(cs, ldn, TOKENS, np, scale, tid, blockDim.x);
  __syncthreads();
  const int nch = d.nchunks;
  S* out = dstates + (static_cast<size_t>(bh) * (nch + 1) + ci + 1) * P * N;
  for (int m0 = warp * 16; m0 < pp; m0 += WARPS * 16) {
    for (int n0 = 0; n0 < np; n0 += 64) {
      float acc[8][4];
      m2::zero(acc);
      m2::WarpTile<T, true, true, 8>::mma(acc, dys, ldp, cs, ldn, m0, n0, TOKENS, lane);
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = m0 + m2::acc_row(lane, 2 * half), col = n0 + 8 * j + m2::acc_col(lane, 0);
          if (r >= P) continue;
          S* dst = out + static_cast<size_t>(r) * N + col;
          if (col + 1 < N && N % 2 == 0) {
            m2::store2<S>(dst, acc[j][2 * half], acc[j][2 * half + 1]);
          } else {
            if (col < N) dst[0] = m2::from_f<S>(acc[j][2 * half]);
            if (col + 1 < N) dst[1] = m2::from_f<S>(acc[j][2 * half + 1]);
          }
        }
    }
  }
}

// One element of S, as bwd_state_scan's ring holds it where a state's row is not a multiple of 8.
template <typename S> struct One {
  using Raw = S;
  __device__ __forceinline__ static Raw load(const S* p, bool) { return *p; }
  __device__ __forceinline__ static void unpack(const Raw& r, float (&v)[1]) { v[0] = m2::to_f(r); }
  __device__ __forceinline__ static void store(S* p, const float (&v)[1]) {
    *p = m2::from_f<S>(v[0]);
  }
};

// One thread per W consecutive state elements of one (batch, head) (W = 8 where a state's row
// allows it, else 1), chunks last to first, in place: slot c ← dH'_c, carried in f32. The loads
// do not depend on the carry: a ring of PF chunks (256 bytes per thread where W = 8) and their
// decays stays in flight, enough to cover the memory latency with the few threads a (batch,
// head) gives.
template <typename S, typename V, int W, int PF>
__device__ void bwd_state_scan(const float* __restrict__ da, const float* __restrict__ dlast,
                               S* __restrict__ dstates, float* __restrict__ dinit,
                               const m2::SsdParams& d) {
  const size_t pn = static_cast<size_t>(d.headdim) * d.dstate;
  const int L = d.seqlen, nch = d.nchunks, bh = blockIdx.y;
  const size_t e0 = (static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x) * W;
  m2::wait_prior_grid();
  if (e0 >= pn) return;
  const float* g = da + static_cast<size_t>(bh) * L;
  S* u = dstates + (static_cast<size_t>(bh) * (nch + 1) + 1) * pn + e0;
  float carry[W];
#pragma unroll
  for (int k = 0; k < W; ++k) carry[k] = dlast ? dlast[static_cast<size_t>(bh) * pn + e0 + k] : 0.f;
  typename V::Raw ring[PF];
  float d_last[PF];
  // Step k visits chunk nch − 1 − k.
  auto fetch = [&](int k, int i) {
    const int ci = nch - 1 - k;
    ring[i] = V::load(u + static_cast<size_t>(ci) * pn, true);
    d_last[i] = g[min(L, (ci + 1) * d.chunk) - 1];
  };
#pragma unroll
  for (int i = 0; i < PF; ++i)
    if (i < nch) fetch(i, i);
  for (int k0 = 0; k0 < nch; k0 += PF) {
#pragma unroll
    for (int i = 0; i < PF; ++i) {
      const int k = k0 + i;
      if (k >= nch) break;
      float local[W];
      V::unpack(ring[i], local);
      const float decay = m2::exp2_fast(d_last[i]);
      if (k + PF < nch) fetch(k + PF, i);
      V::store(u + static_cast<size_t>(nch - 1 - k) * pn, carry);
#pragma unroll
      for (int j = 0; j < W; ++j) carry[j] = decay * carry[j] + local[j];
    }
  }
  if (dinit)
#pragma unroll
    for (int j = 0; j < W; ++j) dinit[static_cast<size_t>(bh) * pn + e0 + j] = carry[j];
}

}  // namespace

#define BWD_CHUNK_STATE(NAME, T, S)                                                           \
  extern "C" __global__ void __launch_bounds__(128) NAME(const T* dy, const T* c,             \
                                                         const float* da, S* dstates,         \
                                                         m2::SsdParams d) {                   \
    bwd_chunk_state<T, S>(dy, c, da, dstates, d);                                             \
  }
// `_v8`: 8 elements per thread, a ring of 256 bytes; else one element, a ring of 16.
#define BWD_STATE_SCAN(NAME, S, WIDE)                                                         \
  extern "C" __global__ void NAME(const float* da, const float* dlast, S* dstates,            \
                                  float* dinit, m2::SsdParams d) {                            \
    if constexpr (WIDE)                                                                       \
      bwd_state_scan<S, m2::Vec8<S>, 8, 256 / (8 * sizeof(S))>(da, dlast, dstates, dinit, d); \
    else                                                                                      \
      bwd_state_scan<S, One<S>, 1, 16>(da, dlast, dstates, dinit, d);                         \
  }
#include "ssd/bwd_pass_state.inc"
