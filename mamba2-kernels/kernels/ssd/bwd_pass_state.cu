// The backward state pass: the gradient of the state entering every chunk, in two kernels.
// With d the chunk's log2-space cumulative sums, dY = dy, and dH' the gradient of the state
// leaving chunk c (the final state's gradient for the last chunk):
//   bwd_chunk_state:  U_c = Σ_t exp2(d_t)·dy_t C_tᵀ          (every chunk in parallel, [P, N])
//   bwd_state_scan:   dH'_{c−1} = exp2(d_last(c))·dH'_c + U_c  (chunks last to first)
// bwd_state_scan overwrites U_c with dH'_c (what bwd_compute_out reads for chunk c) and writes
// the initial state's gradient dH'_{−1}. Layouts: dy [B,L,H,P], c [B,L,G,N] contiguous, da
// [B,H,L] f32, dlast and dinit [B,H,P,N] f32 (dlast null: zero), dstates [B,H,C,P,N] of S.
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
  const int ci = blockIdx.x, bh = blockIdx.y, b = bh / H, h = bh % H;
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
  __syncthreads();
  // exp2(d_t) folded into C's rows.
  for (int i = tid; i < TOKENS * np; i += blockDim.x) {
    T* v = cs + (i / np) * ldn + i % np;
    *v = m2::from_f<T>(m2::to_f(*v) * scale[i / np]);
  }
  __syncthreads();
  const int nch = d.nchunks;
  S* out = dstates + (static_cast<size_t>(bh) * nch + ci) * P * N;
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

// One thread per V consecutive state elements of one (batch, head) (16 bytes of S where the
// row allows it, else one), chunks last to first; the next AHEAD chunks' contributions are
// loaded ahead of the running sums that need them.
template <typename S>
__device__ void bwd_state_scan(const float* __restrict__ da, const float* __restrict__ dlast,
                               S* __restrict__ dstates, float* __restrict__ dinit,
                               const m2::SsdParams& d) {
  constexpr int V = 16 / sizeof(S), AHEAD = 4;
  const int pn = d.headdim * d.dstate, L = d.seqlen, nch = d.nchunks;
  const int bh = blockIdx.y;
  const bool wide = pn % V == 0;
  const int e0 = (blockIdx.x * blockDim.x + threadIdx.x) * (wide ? V : 1);
  m2::wait_prior_grid();
  if (e0 >= pn) return;
  const int count = wide ? V : 1;
  const float* g = da + static_cast<size_t>(bh) * L;
  S* u = dstates + static_cast<size_t>(bh) * nch * pn + e0;
  auto load = [&](int ci, float (&v)[V]) {
#pragma unroll
    for (int k = 0; k < V; ++k) v[k] = 0.f;
    if (ci < 0) return;
    const S* p = u + static_cast<size_t>(ci) * pn;
    if (wide) {
      const uint4 raw = *reinterpret_cast<const uint4*>(p);
      const S* s = reinterpret_cast<const S*>(&raw);
#pragma unroll
      for (int k = 0; k < V; ++k) v[k] = m2::to_f(s[k]);
    } else {
      v[0] = m2::to_f(p[0]);
    }
  };
  float carry[V];
#pragma unroll
  for (int k = 0; k < V; ++k)
    carry[k] = dlast && k < count ? dlast[static_cast<size_t>(bh) * pn + e0 + k] : 0.f;
  float next[AHEAD][V];
#pragma unroll
  for (int a = 0; a < AHEAD; ++a) load(nch - 1 - a, next[a]);
  for (int base = nch - 1; base >= 0; base -= AHEAD) {
    float cur[AHEAD][V];
#pragma unroll
    for (int a = 0; a < AHEAD; ++a) {
#pragma unroll
      for (int k = 0; k < V; ++k) cur[a][k] = next[a][k];
      load(base - AHEAD - a, next[a]);
    }
#pragma unroll
    for (int a = 0; a < AHEAD; ++a) {
      const int ci = base - a;
      if (ci < 0) break;
      S* p = u + static_cast<size_t>(ci) * pn;
      if (wide) {
        uint4 raw;
        S* s = reinterpret_cast<S*>(&raw);
#pragma unroll
        for (int k = 0; k < V; ++k) s[k] = m2::from_f<S>(carry[k]);
        *reinterpret_cast<uint4*>(p) = raw;
      } else {
        p[0] = m2::from_f<S>(carry[0]);
      }
      const float decay = m2::exp2_fast(g[min(L, (ci + 1) * TOKENS) - 1]);
#pragma unroll
      for (int k = 0; k < V; ++k) carry[k] = decay * carry[k] + cur[a][k];
    }
  }
  if (dinit)
    for (int k = 0; k < count; ++k) dinit[static_cast<size_t>(bh) * pn + e0 + k] = carry[k];
}

}  // namespace

#define BWD_CHUNK_STATE(NAME, T, S)                                                           \
  extern "C" __global__ void __launch_bounds__(128) NAME(const T* dy, const T* c,             \
                                                         const float* da, S* dstates,         \
                                                         m2::SsdParams d) {                   \
    bwd_chunk_state<T, S>(dy, c, da, dstates, d);                                             \
  }
#define BWD_STATE_SCAN(NAME, S)                                                               \
  extern "C" __global__ void NAME(const float* da, const float* dlast, S* dstates,            \
                                  float* dinit, m2::SsdParams d) {                            \
    bwd_state_scan<S>(da, dlast, dstates, dinit, d);                                          \
  }
#include "ssd/bwd_pass_state.inc"
