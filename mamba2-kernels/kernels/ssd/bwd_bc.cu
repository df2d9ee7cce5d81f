// The gradients of B and C, summed over each group's heads inside one program: a program per
// (state chunk of Q = 128 tokens, batch, group). Tokens t, s of the chunk, d_h the log2-space
// cumulative sums of head h (from the chunk's start), decay_ts = exp2(d_t − d_s) for s ≤ t (0
// above), r_s = exp2(d_last − d_s)·dt_s, e_t = exp2(d_t):
//   Σ = Σ_h decay∘(dY_h·X_hᵀ)·dt_s          (one [Q, Q] matrix for the group)
//   dB = Σᵀ·C + Σ_h diag(r_h)·X_h·dH'_h      dC = Σ·B + Σ_h diag(e_h)·dY_h·H_h
// with H_h the state entering the chunk (slot c of the states) and dH'_h the gradient of the one
// leaving it (slot c + 1 of their gradients). The program steps through (column block of 64 of
// N, head): each step adds the head's state terms to the block's dB and dC (their A operand from
// registers, X's and dY's rows scaled there by r and e); the first block's steps also sum Σ in
// registers, left in shared memory as bf16 after them; each block ends with Σ's two products and
// writes its dB and dC once, in the value type. So no atomics, no zeroed f32 sums, no rounding
// pass, and Σ is formed once per chunk and group, not once per head. bf16 values, P = 64 and N
// compiled in, sm_90a (wgmma); warpgroup g owns rows 64·g.. of every product, tiles swizzled as
// wgmma reads them. Each step's x, dY, per-token sums and states (f32 ones into a staging area,
// converted in shared memory) arrive by cp.async while the step before is formed.
#include <type_traits>

#include "params.cuh"
#include "ssd/warp_tile.cuh"

namespace {

constexpr int Q = 128, P = 64, THREADS = 256;
// Elements of a [Q, 64] tile of tokens and of a [P, 64] block of a state.
constexpr int TILE = Q * 64, BLOCK = P * 64;

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
using bf16 = __nv_bfloat16;

__device__ __forceinline__ uint32_t scale_pair(uint32_t v, float f) {
  const float2 x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
  return m2::Mma<bf16>::pack(x.x * f, x.y * f);
}

// This warp's A fragments of a [Q, 64] tile at rows r0.. (all four K steps), row r0 + l/4 scaled
// by f[0] and row r0 + l/4 + 8 by f[1].
__device__ __forceinline__ void scaled_rows(uint32_t (&a)[4][4], const bf16* tile, int r0,
                                            const float (&f)[2], int lane) {
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    m2::ldsm_x4(a[ks], tile + m2::swz<128>(r0 + (lane & 15), 2 * ks + (lane >> 4)));
    a[ks][0] = scale_pair(a[ks][0], f[0]);
    a[ks][1] = scale_pair(a[ks][1], f[1]);
    a[ks][2] = scale_pair(a[ks][2], f[0]);
    a[ks][3] = scale_pair(a[ks][3], f[1]);
  }
}

// Where one program's tiles sit: B's and C's block of the step's columns, Σ as bf16 (two blocks
// of 64 columns), then two slots of a head's x and dY (the step formed and the next arriving),
// the states of a head as bf16 blocks (one per slot for bf16 states, copied as they are; one for
// f32 states, whose rows arrive in `stage`, a slot each), and per slot the cumulative sums and
// steps of the chunk's tokens. Buffers by offset from one base (no arrays of pointers: their
// runtime index would put them on the stack).
template <typename S>
struct Smem {
  static constexpr bool WIDE = std::is_same<S, float>::value;
  static constexpr int STATES = 8 * TILE;
  bf16* v;
  __device__ __forceinline__ explicit Smem(unsigned char* raw)
      : v(reinterpret_cast<bf16*>(m2::smem_aligned<1024>(raw))) {}
  __device__ __forceinline__ bf16* bs() const { return v; }
  __device__ __forceinline__ bf16* cs() const { return v + TILE; }
  __device__ __forceinline__ bf16* sig() const { return v + 2 * TILE; }
  __device__ __forceinline__ bf16* xs(int j) const { return v + (4 + 2 * j) * TILE; }
  __device__ __forceinline__ bf16* dys(int j) const { return xs(j) + TILE; }
  __device__ __forceinline__ bf16* hs(int j) const {
    return v + STATES + (WIDE ? 0 : 2 * j * BLOCK);
  }
  __device__ __forceinline__ bf16* dhs(int j) const { return hs(j) + BLOCK; }
  __device__ __forceinline__ float* stage(int j) const {
    return reinterpret_cast<float*>(v + STATES + 2 * BLOCK) + 2 * j * BLOCK;
  }
  __device__ __forceinline__ float* gs(int j) const {
    const int sums = WIDE ? 2 * BLOCK + 8 * BLOCK : 4 * BLOCK;
    return reinterpret_cast<float*>(v + STATES + sums) + 2 * j * Q;
  }
  __device__ __forceinline__ float* dts(int j) const { return gs(j) + Q; }
};

// A program's chunk, batch and group, and its offsets.
struct Place {
  int b, grp, l0, tc, hpg;
  size_t bo;
  __device__ __forceinline__ explicit Place(const m2::SsdParams& d) {
    int i = blockIdx.x;
    grp = i % d.ngroups;
    i /= d.ngroups;
    b = i % d.batch;
    l0 = i / d.batch * Q;
    tc = min(Q, d.seqlen - l0);
    hpg = d.nheads / d.ngroups;
    bo = ((static_cast<size_t>(b) * d.seqlen + l0) * d.ngroups + grp) * d.dstate;
  }
};

// Step i into slot j (head k = i mod hpg of column block nb = ⌊i / hpg⌋): the head's x, dY,
// cumulative sums and steps (rows past the sequence zero), its state's and state gradient's
// block, and with the group's last head B's and C's block.
template <typename S, int N>
__device__ __forceinline__ void step_in(const Smem<S>& sm, int j, int i, const bf16* x,
                                        const bf16* dy, const bf16* bm, const bf16* cm,
                                        const float* dt_out, const float* da, const S* states,
                                        const S* dstates, const Place& at, const m2::SsdParams& d,
                                        int tid) {
  const int k = i % at.hpg, n0 = i / at.hpg * 64;
  const int h = at.grp * at.hpg + k, H = d.nheads, L = d.seqlen;
  const size_t xo = ((static_cast<size_t>(at.b) * L + at.l0) * H + h) * P;
  const uint32_t xstride = static_cast<uint32_t>(H) * P;
  m2::load_tile<64>(sm.xs(j), x + xo, xstride, Q, at.tc, tid, THREADS);
  m2::load_tile<64>(sm.dys(j), dy + xo, xstride, Q, at.tc, tid, THREADS);
  const size_t bh = static_cast<size_t>(at.b) * H + h;
  const size_t bhl = bh * L + at.l0;
  for (int t = tid; t < Q; t += THREADS) {
    const bool in = t < at.tc;
    m2::cp_async4(sm.gs(j) + t, da + bhl + (in ? t : 0), in);
    m2::cp_async4(sm.dts(j) + t, dt_out + bhl + (in ? t : 0), in);
  }
  if (k == at.hpg - 1) {
    const uint32_t bstride = static_cast<uint32_t>(d.ngroups) * N;
    m2::load_tile<64>(sm.bs(), bm + at.bo + n0, bstride, Q, at.tc, tid, THREADS);
    m2::load_tile<64>(sm.cs(), cm + at.bo + n0, bstride, Q, at.tc, tid, THREADS);
  }
  const size_t h_at = (bh * (d.nchunks + 1) + at.l0 / Q) * P * N + n0;
  const S* hsrc = states + h_at;
  const S* dhsrc = dstates + h_at + static_cast<size_t>(P) * N;
  if constexpr (Smem<S>::WIDE) {
    // 16 chunks of 16 bytes per row of 64 f32, two blocks.
    for (int e = tid; e < 2 * P * 16; e += THREADS) {
      const int which = e / (P * 16), r = (e / 16) % P, c = e % 16;
      m2::cp_async16(sm.stage(j) + which * BLOCK + r * 64 + c * 4,
                     (which ? dhsrc : hsrc) + static_cast<size_t>(r) * N + c * 4, true);
    }
  } else {
    m2::load_tile<64>(sm.hs(j), hsrc, N, P, P, tid, THREADS);
    m2::load_tile<64>(sm.dhs(j), dhsrc, N, P, P, tid, THREADS);
  }
}

// f32 state blocks from `stage` into the bf16 tiles, eight values per thread and step.
__device__ __forceinline__ void convert_states(const float* stage, bf16* hs, bf16* dhs, int tid) {
  for (int i = tid; i < 2 * P * 8; i += THREADS) {
    const int which = i / (P * 8), r = (i / 8) % P, ch = i % 8;
    const float4* src = reinterpret_cast<const float4*>(stage + which * BLOCK + r * 64 + ch * 8);
    const float4 u = src[0], v = src[1];
    using M = m2::Mma<bf16>;
    *reinterpret_cast<uint4*>((which ? dhs : hs) + m2::swz<128>(r, ch)) =
        make_uint4(M::pack(u.x, u.y), M::pack(u.z, u.w), M::pack(v.x, v.y), M::pack(v.z, v.w));
  }
}

// Σ += decay∘M·dt_s for this warp's rows (t0 = its first) and the columns of m (from column c0):
// masked elements (s > t, or t past the sequence) take exponent −∞, so add nothing.
__device__ __forceinline__ void add_weights(float (&sig)[8][4], const float (&m)[8][4], int t0,
                                            int c0, int tc, const float* gs, const float* dts,
                                            int lane) {
  float gt[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int t = t0 + m2::acc_row(lane, 2 * half);
    gt[half] = t < tc ? gs[t] : -INFINITY;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int s = c0 + 8 * j + m2::acc_col(lane, 0);
    const float2 gc = *reinterpret_cast<const float2*>(gs + s);
    const float2 dc = *reinterpret_cast<const float2*>(dts + s);
    const float gcs[2] = {gc.x, gc.y}, dcs[2] = {dc.x, dc.y};
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int t = t0 + m2::acc_row(lane, 2 * half);
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const float decay = m2::exp2_fast(s + k <= t ? gt[half] - gcs[k] : -INFINITY);
        sig[j][2 * half + k] = fmaf(decay * dcs[k], m[j][2 * half + k], sig[j][2 * half + k]);
      }
    }
  }
}

// The same for a block wholly below the diagonal (columns c0.. before every row of the warp):
// decay_ts = exp2(d_t − d_a)·exp2(d_a − d_s) with d_a the sum at the block's last column (or the
// chunk's last token, if earlier), both factors at most 1, so one exponent per row and per column
// instead of one per element; rows past the sequence take 0.
__device__ __forceinline__ void add_weights_below(float (&sig)[8][4], const float (&m)[8][4],
                                                  int t0, int c0, int tc, const float* gs,
                                                  const float* dts, int lane) {
  const float ga = gs[min(c0 + 63, tc - 1)];
  float ft[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int t = t0 + m2::acc_row(lane, 2 * half);
    ft[half] = t < tc ? m2::exp2_fast(gs[t] - ga) : 0.f;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int s = c0 + 8 * j + m2::acc_col(lane, 0);
    const float2 gc = *reinterpret_cast<const float2*>(gs + s);
    const float2 dc = *reinterpret_cast<const float2*>(dts + s);
    const float fs[2] = {m2::exp2_fast(ga - gc.x) * dc.x, m2::exp2_fast(ga - gc.y) * dc.y};
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int k = 0; k < 2; ++k)
        sig[j][2 * half + k] = fmaf(ft[half] * fs[k], m[j][2 * half + k], sig[j][2 * half + k]);
  }
}

// Σ's part in this warp's registers (rows t0.., columns c0..) into its bf16 tile.
__device__ __forceinline__ void store_weights(bf16* as, const float (&sig)[8][4], int t0, int c0,
                                              int lane) {
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int t = t0 + m2::acc_row(lane, 2 * half), s = c0 + 8 * j + m2::acc_col(lane, 0);
      m2::store2<bf16>(as + m2::swz_blocks<Q>(t, s), sig[j][2 * half], sig[j][2 * half + 1]);
    }
}

// This warp's rows (t0..) of a gradient block, rows past the sequence left out.
__device__ __forceinline__ void store_rows(bf16* out, size_t stride, const float (&acc)[8][4],
                                           int t0, int tc, int lane) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int t = t0 + m2::acc_row(lane, 2 * half);
    if (t >= tc) continue;
    bf16* row = out + static_cast<size_t>(t) * stride + m2::acc_col(lane, 0);
#pragma unroll
    for (int j = 0; j < 8; ++j) m2::store2<bf16>(row + 8 * j, acc[j][2 * half], acc[j][2 * half + 1]);
  }
}

// Σ's products for warpgroup G's rows: dB += Σᵀ·C over t ≥ 64·G, dC += Σ·B over s < 64·(G + 1)
// (the K ranges where Σ is not zero), each loop's bounds fixed at compile time (a product under a
// runtime condition would serialise every wgmma of the program).
template <int G>
__device__ __forceinline__ void sigma_products(float (&dbacc)[8][4], float (&dcacc)[8][4],
                                               uint64_t sa, uint64_t ba, uint64_t ca) {
#pragma unroll
  for (int ks = 4 * G; ks < 8; ++ks)
    m2::WgmmaSS<8>::run<1, 1>(dbacc, m2::desc_at<Q>(sa, 16 * ks, 64 * G),
                              m2::desc_at<Q>(ca, 16 * ks, 0), 1);
#pragma unroll
  for (int ks = 0; ks < 4 * (G + 1); ++ks)
    m2::WgmmaSS<8>::run<0, 1>(dcacc, m2::desc_at<Q>(sa, 64 * G, 16 * ks),
                              m2::desc_at<Q>(ba, 16 * ks, 0), 1);
}

// Waits for step i's copies (slot j) and makes them, and for the second pass the bf16 states
// (f32 ones converted from their staging), visible to wgmma; every warp is then done with step
// i − 1, whose slot takes step i + 1 (`last`: the number of steps).
template <typename S, int N>
__device__ __forceinline__ void step_ready(const Smem<S>& sm, int j, int i, int last,
                                           const bf16* x, const bf16* dy, const bf16* bm,
                                           const bf16* cm, const float* dt_out, const float* da,
                                           const S* states, const S* dstates, const Place& at,
                                           const m2::SsdParams& d, int tid) {
  m2::cp_async_wait<0>();
  if constexpr (Smem<S>::WIDE) {
    __syncthreads();
    if (i + 1 < last)
      step_in<S, N>(sm, j ^ 1, i + 1, x, dy, bm, cm, dt_out, da, states, dstates, at, d, tid);
    m2::cp_async_commit();
    convert_states(sm.stage(j), sm.hs(j), sm.dhs(j), tid);
    m2::fence_proxy_async();  // the tiles' writes, before wgmma reads them
    __syncthreads();
  } else {
    m2::fence_proxy_async();  // the tiles' writes, before wgmma reads them
    __syncthreads();
    if (i + 1 < last)
      step_in<S, N>(sm, j ^ 1, i + 1, x, dy, bm, cm, dt_out, da, states, dstates, at, d, tid);
    m2::cp_async_commit();
  }
}

// This warp's state terms of a step: diag(r)·X·dH' into dB and diag(e)·dY·H into dC, its A
// operands' rows scaled in registers (r and e from the slot's sums), issued and committed.
template <typename S>
__device__ __forceinline__ void state_terms(const Smem<S>& sm, int j, int t0, int tc,
                                            float (&dbacc)[8][4], float (&dcacc)[8][4],
                                            int lane) {
  const float* gs = sm.gs(j);
  const float* dts = sm.dts(j);
  const float g_last = gs[tc - 1];
  float rs[2], es[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int t = t0 + m2::acc_row(lane, 2 * half);
    rs[half] = m2::exp2_fast(g_last - gs[t]) * dts[t];
    es[half] = m2::exp2_fast(gs[t]);
  }
  const uint64_t ha = m2::wgmma_desc<128>(m2::smem_addr(sm.hs(j)));
  const uint64_t dha = m2::wgmma_desc<128>(m2::smem_addr(sm.dhs(j)));
  uint32_t ax[4][4], ady[4][4];
  scaled_rows(ax, sm.xs(j), t0, rs, lane);
  scaled_rows(ady, sm.dys(j), t0, es, lane);
  m2::wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    m2::Wgmma<8>::run<1>(dbacc, ax[ks], m2::desc_at<P>(dha, 16 * ks, 0));
    m2::Wgmma<8>::run<1>(dcacc, ady[ks], m2::desc_at<P>(ha, 16 * ks, 0));
  }
  m2::wgmma_commit();
}

// A column block's end, after its last head's state terms: Σ's products (B's and C's block came
// with that head), then the block of dB and dC out, and the accumulators zeroed for the next.
// dB += Σᵀ·C at rows s = 64·g.. (Σᵀ by the M-major descriptor; only t ≥ s adds anything) and
// dC += Σ·B at rows t = 64·g.. (only s ≤ t).
template <typename S, int N>
__device__ __forceinline__ void block_out(const Smem<S>& sm, int g, int t0, int n0,
                                          const Place& at, const m2::SsdParams& d,
                                          float (&dbacc)[8][4], float (&dcacc)[8][4], bf16* db,
                                          bf16* dc, int lane) {
  auto tile = [](const bf16* t) { return m2::wgmma_desc<128>(m2::smem_addr(t)); };
  const uint64_t sa = tile(sm.sig()), ba = tile(sm.bs()), ca = tile(sm.cs());
  m2::wgmma_fence();
  if (g == 0)
    sigma_products<0>(dbacc, dcacc, sa, ba, ca);
  else
    sigma_products<1>(dbacc, dcacc, sa, ba, ca);
  m2::wgmma_commit();
  m2::wgmma_wait<0>();
  m2::wgmma_hold(dbacc);
  m2::wgmma_hold(dcacc);
  const size_t stride = static_cast<size_t>(d.ngroups) * N;
  store_rows(db + at.bo + n0, stride, dbacc, t0, at.tc, lane);
  store_rows(dc + at.bo + n0, stride, dcacc, t0, at.tc, lane);
  m2::zero(dbacc);
  m2::zero(dcacc);
}

template <typename S, int N>
__device__ void bwd_bc(const bf16* __restrict__ x, const bf16* __restrict__ dy,
                       const bf16* __restrict__ bm, const bf16* __restrict__ cm,
                       const float* __restrict__ dt_out, const float* __restrict__ da,
                       const S* __restrict__ states, const S* __restrict__ dstates,
                       bf16* __restrict__ db, bf16* __restrict__ dc, const m2::SsdParams& d) {
  extern __shared__ unsigned char smem_raw[];
  const Smem<S> sm(smem_raw);
  const Place at(d);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // The warpgroup by a shuffle from lane 0: uniform across the warp, so its descriptors' offsets
  // stay in uniform registers.
  const int g = __shfl_sync(0xffffffffu, warp / 4, 0), t0 = 64 * g + 16 * (warp % 4);
  const int hpg = at.hpg, last = N / 64 * hpg;
  auto tile = [](const bf16* t) { return m2::wgmma_desc<128>(m2::smem_addr(t)); };
  m2::wait_prior_grid();
  step_in<S, N>(sm, 0, 0, x, dy, bm, cm, dt_out, da, states, dstates, at, d, tid);
  m2::cp_async_commit();

  float dbacc[8][4], dcacc[8][4];
  m2::zero(dbacc);
  m2::zero(dcacc);
  int i = 0, j = 0;
  // The first column block's pass also sums Σ: rows t0.., columns 0..63 (lo) and, for the second
  // warpgroup, 64..127 (hi). The first warpgroup forms the diagonal block of rows and columns
  // 0..63, the second the block below it (one exponent per row and column), then the diagonal
  // block of 64..127 once nothing else is in flight.
  {
    float sig_lo[8][4], sig_hi[8][4];
    m2::zero(sig_lo);
    m2::zero(sig_hi);
#pragma unroll 1
    for (; i < hpg; ++i, j ^= 1) {
      step_ready<S, N>(sm, j, i, last, x, dy, bm, cm, dt_out, da, states, dstates, at, d, tid);
      const uint64_t xa = tile(sm.xs(j)), dya = tile(sm.dys(j));
      const float* gs = sm.gs(j);
      const float* dts = sm.dts(j);
      float m[8][4];
      m2::wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < 4; ++ks)
        m2::WgmmaSS<8>::run<0, 0>(m, m2::desc_at<Q>(dya, 64 * g, 16 * ks),
                                  m2::desc_at<Q>(xa, 0, 16 * ks), ks > 0);
      m2::wgmma_commit();
      state_terms(sm, j, t0, at.tc, dbacc, dcacc, lane);
      m2::wgmma_wait<1>();
      m2::wgmma_hold(m);
      if (g == 0)
        add_weights(sig_lo, m, t0, 0, at.tc, gs, dts, lane);
      else
        add_weights_below(sig_lo, m, t0, 0, at.tc, gs, dts, lane);
      m2::wgmma_wait<0>();
      m2::wgmma_hold(dbacc);
      m2::wgmma_hold(dcacc);
      if (g == 1) {
        m2::wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < 4; ++ks)
          m2::WgmmaSS<8>::run<0, 0>(m, m2::desc_at<Q>(dya, 64, 16 * ks),
                                    m2::desc_at<Q>(xa, 64, 16 * ks), ks > 0);
        m2::wgmma_commit();
        m2::wgmma_wait<0>();
        m2::wgmma_hold(m);
        add_weights(sig_hi, m, t0, 64, at.tc, gs, dts, lane);
      }
    }
    // Σ as bf16, for every warp's products once all have stored their part.
    store_weights(sm.sig(), sig_lo, t0, 0, lane);
    if (g == 1) store_weights(sm.sig(), sig_hi, t0, 64, lane);
    m2::fence_proxy_async();
    __syncthreads();
  }
  block_out<S, N>(sm, g, t0, 0, at, d, dbacc, dcacc, db, dc, lane);

  // The other column blocks: the heads' state terms, then Σ's products.
#pragma unroll 1
  for (int k = 0, n0 = 64; i < last; ++i, j ^= 1) {
    step_ready<S, N>(sm, j, i, last, x, dy, bm, cm, dt_out, da, states, dstates, at, d, tid);
    state_terms(sm, j, t0, at.tc, dbacc, dcacc, lane);
    m2::wgmma_wait<0>();
    m2::wgmma_hold(dbacc);
    m2::wgmma_hold(dcacc);
    if (++k < hpg) continue;
    block_out<S, N>(sm, g, t0, n0, at, d, dbacc, dcacc, db, dc, lane);
    k = 0;
    n0 += 64;
  }
}
#endif

}  // namespace

// sm_90a only: the launcher picks these kernels where the device runs that code.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define BWD_BC_BODY(S, NF)                                                                      \
  bwd_bc<S, NF>(x, dy, b, c, dt_out, da, states, dstates, db, dc, d);
#else
#define BWD_BC_BODY(S, NF) __trap();
#endif
#define BWD_BC(NAME, S, NF)                                                                     \
  extern "C" __global__ void __launch_bounds__(THREADS, 1)                                     \
      NAME(const __nv_bfloat16* x, const __nv_bfloat16* dy, const __nv_bfloat16* b,            \
           const __nv_bfloat16* c, const float* dt_out, const float* da, const S* states,      \
           const S* dstates, __nv_bfloat16* db, __nv_bfloat16* dc, m2::SsdParams d) {          \
    BWD_BC_BODY(S, NF)                                                                          \
  }
#include "ssd/bwd_bc.inc"
