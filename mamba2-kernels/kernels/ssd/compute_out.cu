// Stage 3: the outputs of every chunk, its three terms fused (d = da_cumsum, log2 space):
//   Y[t] = exp2(d_t)·(h_c C_t) + Σ_{s ≤ t} exp2(d_t − d_s)·(C_t·B_s)·dt_s·x_s + D·x_t,  · silu(z_t)
// x, z, y [B,L,H,P] and b, c [B,L,G,N] (value type T), dt/da [B,H,L] f32, chunk states
// [B,H,C+1,P,N] (S), D [H] or [H,P] f32.
//
// compute_out_mma: bf16/f16 on tensor cores, specialised on N and the P-tile PT. A program owns
//   (batch, chunk, HB heads of one group), one warp per 16-row block of the chunk.
//   0. c, b and every head's d and dt land in shared memory. Each warp keeps its rows of C as
//      MMA A-fragments in registers for the whole program, computes C·Bᵀ for its 16×16 blocks
//      (rb, kb ≤ rb) once, rounded to T in the A-fragment layout (a uint4 per lane and block,
//      read back only by the lane that wrote it), and the per-token decay factors of every head
//      are computed once (ws, es below). In the `_tma` forms compiled for sm_90a c and b come by
//      tensor map in column blocks (as the state tile) and C·Bᵀ is formed by wgmma per warpgroup
//      (its 64 rows against 64-token tiles of b) instead of per warp.
//   1. The (head, P-tile) units stream through two buffers (x tile, state tile) by cp.async, or
//      (`_tma` forms, sm_90+) by tensor-map copies from one thread completing on an mbarrier per
//      buffer: unit u+1 loads while unit u computes, one barrier per unit. In the `_tma` forms
//      unit 0's tiles load into c's area (the first buffer, where it fits there: P-tile·(chunk
//      + N) ≤ chunk·N) as soon as every warp holds its C fragments, under C·Bᵀ. Per unit and warp:
//      Y = C·hᵀ from the register fragments (mma.sync, every warp reading the whole state tile;
//      in the `_tma` forms compiled for sm_90a, wgmma per warpgroup, which reads it once per
//      four warps); then for every column block kb ≤ rb the stored C·Bᵀ block is scaled in
//      registers and becomes the A operand of Y += S·X; + D·x, · silu(z); y leaves as 16-byte
//      row pieces after a transpose within each quad of lanes.
//   Right after the state pass (`SsdParams::early`, sm_90), step 0 runs before the kernel waits
//   for the scan, which lets it start at once (programmatic launch): only the unit loads need states
//   (with unit 0 loaded early, thread 0 waits for the scan before the decay factors and C·Bᵀ, so
//   in programs that enter beside the scan warp 0 — with wgmma, its warpgroup — does that part
//   of step 0 after it).
//   In `ssd` (`SsdParams::discard_states`: the states are its intermediates) warp 0 drops each
//   unit's state tile from L2 after its epilogue (the tile has landed), so that it is never
//   written back.
//   The `_tma` forms read x and b at L2 priority evict_normal: their last reads, after `ssd`'s
//   chunk_state loaded them at evict_last.
//   Off the diagonal (kb < rb, r0 = 16·rb, e = 16·kb + 15, so s ≤ e < r0 ≤ t) the decay factors
//   as exp2(d_t − d_r0)·exp2(d_r0 − d_e)·exp2(d_e − d_s), each factor ≤ 1: the first (es) is
//   per row and scales the sum of C·hᵀ (times exp2(d_r0)) and those blocks at once, the middle
//   one (blk) per block and the last (ws, with dt_s) per token scale the stored C·Bᵀ block as
//   pairs of T (the A operand: one packed multiply per register). The diagonal
//   block uses exp2(d_t − d_s)·dt_s directly, selected by index compare. No masked exponential
//   is used. Shared tiles are XOR-swizzled (m2::swz): conflict-free cp.async and ldmatrix.
// compute_out_simt: any type and shape, for f32 and the sizes the MMA path does not cover.
// Timeline marks (m2::mark) of compute_out_mma: 0 entry, 1 step 0 done, 2 waited, 3 exit.
#include <type_traits>

#include "params.cuh"

namespace {

using m2::SsdParams;

// Copies a [ROWS, COLS] chunk-state tile (contiguous rows) into a swizzled shared tile of T
// (m2::swz): by cp.async when the state type is the value type, else converted through registers.
template <typename T, typename S, int ROWS, int COLS>
__device__ __forceinline__ void load_state_tile(T* dst, const S* src, int tid, int threads) {
  if constexpr (std::is_same<T, S>::value) {
    m2::load_tile<COLS>(dst, src, COLS, ROWS, ROWS, tid, threads);
  } else {
    using V8 = m2::Vec8<S>;
    for (int i = tid; i < ROWS * COLS / 8; i += threads) {
      float v[8];
      V8::unpack(V8::load(src + i * 8, true), v);
      m2::Vec8<T>::store(dst + m2::swz<COLS * 2>(i / (COLS / 8), i % (COLS / 8)), v);
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

// Shared memory of compute_out_mma in bytes (`mma_smem` in src/ssd/plan.rs computes the same):
// cb [W(W+1)/2 blocks][32 lanes] uint4 | sc [HB][4][chunk] f32 (d, dt, ws, es) | dk [HB][P] f32
// (D per channel, 0 without D) | from the next multiple of 1024 bytes, a region that holds
// c [chunk][N] and b [chunk][N] first (in the wgmma forms each as N / HC column blocks
// [chunk][HC], the tensor-map boxes), then two unit buffers, each x [chunk][PT] and the state
// tile (load_state_tile's layout); the tiles are swizzled (m2::swz), not padded, and start at
// multiples of 1024 bytes (the `_tma` form's swizzled copies need it; its base is aligned so).
template <int N, int PT>
struct Layout {
  int cb_bytes, sc_bytes, dk_bytes, region, buf_elems;
  __device__ Layout(int chunk, int hb, int p)
      : cb_bytes((chunk / 16) * (chunk / 16 + 1) / 2 * 512), sc_bytes(hb * 4 * chunk * 4),
        dk_bytes(hb * p * 4), region((cb_bytes + sc_bytes + dk_bytes + 1023) / 1024 * 1024),
        buf_elems(chunk * PT + PT * N) {}
};

// TMA: the unit tiles come by tensor map (x: channels, tokens, batch; the states as rows of N
// by all their other indices), issued by one thread, completing on an mbarrier per buffer.
template <typename T, typename S, int N, int PT, bool TMA, bool PACKED>
__device__ void compute_out_mma(const T* __restrict__ x, const T* __restrict__ bm,
                                const T* __restrict__ cm, const float* __restrict__ dt,
                                const float* __restrict__ da, const S* __restrict__ states,
                                const float* __restrict__ dskip, const T* __restrict__ z,
                                T* __restrict__ y, SsdParams D, const m2::TensorMap* tx,
                                const m2::TensorMap* th, const m2::TensorMap* tcm,
                                const m2::TensorMap* tbm) {
  constexpr int KS = N / 16, NJ = PT / 8, NB = N * 2, XB = PT * 2;  // NB, XB: c/b and x row bytes
  // The state tile: N / HC column blocks of HC columns, each [PT][HC] swizzled (HB2-byte rows);
  // one block (load_state_tile) or, for the tensor-map boxes, blocks of at most 64 columns.
  constexpr int HC = TMA && N > 64 ? 64 : N, HB2 = HC * 2;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  // TMA: per unit buffer, its copies have landed; [2]: step 0's c and b (wgmma forms)
  __shared__ uint64_t landed[3];
  unsigned char* smem = m2::smem_aligned<TMA ? 1024 : 128>(smem_raw);
  const int chunk = D.chunk, P = D.headdim, HB = D.heads_per_block;
  const Layout<N, PT> lay(chunk, HB, P);
  uint4* cbs = reinterpret_cast<uint4*>(smem);
  float* sc = reinterpret_cast<float*>(smem + lay.cb_bytes);
  float* dk = reinterpret_cast<float*>(smem + lay.cb_bytes + lay.sc_bytes);
  T* region = reinterpret_cast<T*>(smem + lay.region);

  const int c = blockIdx.x, b = blockIdx.z;
  const int h_first = blockIdx.y * HB;
  const int g = h_first / (D.nheads / D.ngroups);
  // Unpacked, the span comes from blockIdx and the parameters, which the compiler forms again
  // where it needs them instead of holding two registers through the kernel.
  int l0 = c * chunk, len = min(chunk, D.seqlen - l0);
  if constexpr (PACKED) m2::chunk_span(D, c, l0, len);
  const int threads = blockDim.x, tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int ptiles = P / PT, units = HB * ptiles;
  const size_t hp = static_cast<size_t>(D.nheads) * P;
  const size_t gn = static_cast<size_t>(D.ngroups) * N;
  const size_t tok0 = static_cast<size_t>(b) * D.seqlen + l0;
  const int gr = lane / 4, tc = (lane % 4) * 2;
  // Warp w takes row block rb in a snake order (0..3, 7..4, 8..11, ...): the warps that share a
  // sub-partition (w mod 4) get equal sums of causal column blocks. The chunk is a power of two
  // (the launcher's condition), so the warps come in whole groups of four or fewer than four.
  const int rb = (warp / 4) % 2 ? warp / 4 * 4 + 3 - warp % 4 : warp;
  const int r0 = rb * 16, t_lo = r0 + gr, t_hi = t_lo + 8;
  const bool rows_live = r0 < len;

  // wgmma for C·Bᵀ and C·hᵀ (the `_tma` form compiled for sm_90a; T is bf16 there) where the
  // warps make whole warpgroups; every warp of a warpgroup takes part, live rows or not.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr bool WGMMA = TMA && std::is_same<T, __nv_bfloat16>::value;
#else
  constexpr bool WGMMA = false;
#endif
  const bool wg = WGMMA && chunk >= 64;

  // 0. c, b, and d, dt of every head. For wgmma, c and b come by tensor map (one thread issues
  // the copies) in column blocks of HC, as the state tile.
  {
    T* cs = region;
    T* bs = region + chunk * N;
    if (wg) {
      if (tid == 0) {
        m2::mbar_init(&landed[2], 1);
        m2::mbar_expect(&landed[2], 2 * chunk * N * 2);
#pragma unroll
        for (int k = 0; k < N / HC; ++k) {
          m2::tma_load_3d(cs + k * chunk * HC, tcm, g * N + k * HC, l0, b, &landed[2]);
          m2::tma_load_3d(bs + k * chunk * HC, tbm, g * N + k * HC, l0, b, &landed[2],
                          m2::l2_policy(false));
        }
      }
    } else {
      const size_t at = tok0 * gn + static_cast<size_t>(g) * N;
      m2::load_tile<N>(cs, cm + at, static_cast<uint32_t>(gn), chunk, len, tid, threads);
      m2::load_tile<N>(bs, bm + at, static_cast<uint32_t>(gn), chunk, len, tid, threads);
    }
    for (int i = tid; i < HB * chunk; i += threads) {
      const int hh = i / chunk, t = i % chunk;
      const bool ok = t < len;
      const size_t at = (static_cast<size_t>(b) * D.nheads + h_first + hh) * D.seqlen + l0 + (ok ? t : 0);
      m2::cp_async4(sc + (hh * 4) * chunk + t, da + at, ok);
      m2::cp_async4(sc + (hh * 4 + 1) * chunk + t, dt + at, ok);
    }
    // D of every channel of the program's heads (per head: repeated), 0 without D.
    for (int i = tid; i < HB * P; i += threads) {
      const int h = h_first + i / P;
      m2::cp_async4(dk + i, dskip ? dskip + (D.d_per_channel ? h * P + i % P : h) : da, dskip);
    }
    m2::cp_async_commit();
    m2::cp_async_wait<0>();
    __syncthreads();
    if (wg) m2::mbar_wait(&landed[2], 0);
  }
  auto buf_of = [&](int u) { return region + (u % 2) * lay.buf_elems; };
  // Only the first half of the warps (the rows with the fewest column blocks) issue the unit
  // loads.
  const int loaders = threads / 2;
  // Unit u is (head u / ptiles, P-tile u % ptiles).
  if (TMA && tid == 0) {
    m2::mbar_init(&landed[0], 1);
    m2::mbar_init(&landed[1], 1);
  }
  // With the tensor maps, unit 0's tiles go into c's area (the first unit buffer, where it fits
  // there) as soon as every warp holds its C fragments: their copies overlap C·Bᵀ instead of
  // following step 0.
  const bool early_unit = TMA && lay.buf_elems <= chunk * N;
  auto load_unit = [&](int u) {
    T* xs = buf_of(u);
    const int h = h_first + u / ptiles, p0 = (u % ptiles) * PT;
    const size_t bh = static_cast<size_t>(b) * D.nheads + h;
    if constexpr (TMA) {
      if (tid != 0) return;
      uint64_t* bar = &landed[u % 2];
      m2::fence_proxy_async();
      m2::mbar_expect(bar, (chunk * PT + PT * N) * 2);
      m2::tma_load_3d(xs, tx, h * P + p0, l0, b, bar, m2::l2_policy(false));
      const int row = static_cast<int>((bh * (D.nchunks + 1) + c) * P + p0);
#pragma unroll
      for (int k = 0; k < N / HC; ++k)
        m2::tma_load_3d(xs + chunk * PT + k * PT * HC, th, k * HC, row, 0, bar);
    } else {
      if (tid >= loaders) return;
      m2::load_tile<PT>(xs, x + tok0 * hp + h * P + p0, static_cast<uint32_t>(hp), chunk, len, tid,
                        loaders);
      const S* st = states + ((bh * (D.nchunks + 1)) + c) * static_cast<size_t>(P) * N +
                    static_cast<size_t>(p0) * N;
      load_state_tile<T, S, PT, N>(xs + chunk * PT, st, tid, loaders);
      m2::cp_async_commit();
    }
  };

  // This warp's rows of C as A-fragments, and its blocks of C·Bᵀ.
  uint32_t cf[KS][4];
  uint4* cbw = cbs + (rb * (rb + 1) / 2) * 32 + lane;
  {
    const T* cs = region;
    const T* bs = region + chunk * N;
    const int c_row = r0 + (lane % 8) + ((lane / 8) % 2) * 8;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      if (wg)
        m2::ldsm_x4(cf[ks], cs + (ks * 16 / HC) * chunk * HC +
                                m2::swz<HB2>(c_row, ks * 2 % (HC / 8) + lane / 16));
      else
        m2::ldsm_x4(cf[ks], cs + m2::swz<NB>(c_row, ks * 2 + lane / 16));
    }
    if (early_unit) {
      __syncthreads();  // c is dead: unit 0's buffer
      if (tid == 0) {
        m2::wait_prior_grid();  // its state tile is the prior kernel's
        load_unit(0);
      }
    }
    // Per head and token: ws_s = exp2(d_e − d_s)·dt_s (e = the last token of s's 16-block) and
    // es_t = exp2(d_t − d_{16·⌊t/16⌋}); zero past the sequence.
    for (int i = tid; i < HB * chunk; i += threads) {
      const int hh = i / chunk, t = i % chunk;
      float* s4 = sc + hh * 4 * chunk;
      const float d = s4[t];
      const bool ok = t < len;
      s4[2 * chunk + t] = ok ? m2::exp2_fast(s4[min(t | 15, len - 1)] - d) * s4[chunk + t] : 0.f;
      s4[3 * chunk + t] = ok ? m2::exp2_fast(d - s4[t & ~15]) : 0.f;
    }
    // Block kb of this warp's rows kept from its two n8 accumulators (columns 0–7 and 8–15).
    auto keep_block = [&](int kb, const float (&lo)[4], const float (&hi)[4]) {
      cbw[kb * 32] = make_uint4(m2::Mma<T>::pack(lo[0], lo[1]), m2::Mma<T>::pack(lo[2], lo[3]),
                                m2::Mma<T>::pack(hi[0], hi[1]), m2::Mma<T>::pack(hi[2], hi[3]));
    };
    // Column blocks two at a time (two independent MMA chains), then the odd one out.
    auto cb_blocks = [&](int kb, auto nb) {
      constexpr int NBK = decltype(nb)::value;
      float s[NBK][2][4] = {};
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
        for (int q = 0; q < NBK; ++q) {
          uint32_t bf[4];
          m2::ldsm_x4(bf, bs + m2::swz<NB>((kb + q) * 16 + (lane / 16) * 8 + (lane % 8), ks * 2 + (lane / 8) % 2));
          m2::Mma<T>::run(s[q][0], cf[ks], bf[0], bf[1]);
          m2::Mma<T>::run(s[q][1], cf[ks], bf[2], bf[3]);
        }
      }
#pragma unroll
      for (int q = 0; q < NBK; ++q) keep_block(kb + q, s[q][0], s[q][1]);
    };
    if (wg) {
      // Per warpgroup: its 64 rows against 64-token column tiles of b, up to the diagonal of its
      // last row block (4g + 3 for warpgroup g); each warp keeps the blocks kb ≤ rb of its rows.
      const uint32_t b_a = m2::smem_addr(bs);
      for (int t = 0; t <= warp / 4; ++t) {
        float s[8][4] = {};
        m2::wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < KS; ++ks)
          m2::Wgmma<8>::template run<0>(
              s, cf[ks],
              m2::wgmma_desc<HB2>(b_a + (ks * 16 / HC) * chunk * HB2 + t * 64 * HB2 + (ks * 16 % HC) * 2));
        m2::wgmma_commit();
        m2::wgmma_wait<0>();
        m2::wgmma_hold(s);
#pragma unroll
        for (int q = 0; q < 4; ++q)
          if (rows_live && 4 * t + q <= rb) keep_block(4 * t + q, s[2 * q], s[2 * q + 1]);
      }
    } else if (rows_live) {
      int kb = 0;
      for (; kb + 1 <= rb; kb += 2) cb_blocks(kb, std::integral_constant<int, 2>{});
      if (kb <= rb) cb_blocks(kb, std::integral_constant<int, 1>{});
    }
  }
  __syncthreads();  // c and b are dead: the region holds the unit buffers from here

  // Each lane's ldmatrix row addresses (bytes, relative to a tile) in the state tile (C·hᵀ) and
  // the x tile (S·X), and its first output row t_lo in the x tile (D·x).
  const uint32_t h_lane = m2::swz<HB2>((lane / 16) * 8 + (lane % 8), (lane / 8) % 2) * 2;
  const uint32_t x_lane = m2::swz<XB>((lane % 8) + ((lane / 8) % 2) * 8, lane / 16) * 2;
  const uint32_t e_lane = m2::swz<XB>(t_lo, 0) * 2 + tc * 2;
  m2::mark(1);
  m2::wait_prior_grid();  // the states are the prior kernel's (a no-op if waited on already)
  m2::mark(2);
  if (!early_unit) load_unit(0);
  for (int u = 0; u < units; ++u) {
    if constexpr (!TMA) m2::cp_async_wait<0>();
    __syncthreads();  // every warp is done with unit u − 1's buffer (and, cp.async: u landed)
    if (u + 1 < units) load_unit(u + 1);
    if constexpr (TMA) m2::mbar_wait(&landed[u % 2], (u / 2) & 1);
    if (!rows_live && !wg) continue;
    const T* xs = buf_of(u);
    const uint32_t xs_a = m2::smem_addr(xs), hl = xs_a + chunk * XB + h_lane;
    const int hh = u / ptiles, h = h_first + hh, p0 = (u % ptiles) * PT;
    const float* ds = sc + hh * 4 * chunk;
    const float* dts = ds + chunk;
    const float* ws = ds + 2 * chunk;
    const float* es = ds + 3 * chunk;

    // Y = C·hᵀ, scaled by exp2(d_t).
    float acc[NJ][4] = {};
    if (wg) {
      // Per warpgroup (its four warps' 64 rows): KS wgmma reading the state tile once.
      const uint32_t h0 = xs_a + chunk * XB;
      m2::wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < KS; ++ks)
        m2::Wgmma<NJ>::template run<0>(
            acc, cf[ks], m2::wgmma_desc<HB2>(h0 + (ks * 16 / HC) * PT * HB2 + (ks * 16 % HC) * 2));
      m2::wgmma_commit();
      m2::wgmma_wait<0>();
      m2::wgmma_hold(acc);
    } else {
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        // 16-byte chunk ks·2 of the state rows: column block ks·2 / (HC / 8) of the tile.
        const uint32_t hk = hl + (ks * 2 / (HC / 8)) * PT * HB2;
#pragma unroll
        for (int j = 0; j < NJ; j += 2) {
          uint32_t bf[4];
          m2::ldsm_x4(bf, m2::swz_add<HB2>(hk, ks * 2 % (HC / 8)) + j * 8 * HB2);
          m2::Mma<T>::run(acc[j], cf[ks], bf[0], bf[1]);
          m2::Mma<T>::run(acc[j + 1], cf[ks], bf[2], bf[3]);
        }
      }
    }
    if (!rows_live) continue;
    // Y += S·X for column block kb, S (A operand) given.
    auto sx = [&](int kb, const uint32_t (&sa)[4]) {
      const uint32_t xl = xs_a + kb * 16 * XB + x_lane;
#pragma unroll
      for (int j = 0; j < NJ; j += 2) {
        uint32_t bf[4];
        m2::ldsm_x4_t(bf, m2::swz_add<XB>(xl, j));
        m2::Mma<T>::run(acc[j], sa, bf[0], bf[1]);
        m2::Mma<T>::run(acc[j + 1], sa, bf[2], bf[3]);
      }
    };
    // Rows t of block rb: Y_t = es_t·(exp2(d_r0)·C_t·hᵀ + Σ_{kb<rb} Σ_s C·Bᵀ_ts·blk_kb·ws_s·x_s)
    // + the diagonal block, with es_t, blk_kb = exp2(d_r0 − d_e) and ws_s all ≤ 1.
    const float d_lo = ds[t_lo], d_hi = ds[t_hi], d_r0 = ds[r0];
    const float y0 = m2::exp2_fast(d_r0);
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][e] *= y0;
    for (int kb = 0; kb < rb; ++kb) {
      const uint4 raw = cbw[kb * 32];
      const uint32_t cb[4] = {raw.x, raw.y, raw.z, raw.w};
      const float blk = m2::exp2_fast(d_r0 - ds[kb * 16 + 15]);
      // Columns tc, tc + 1 (registers 0, 1) and tc + 8, tc + 9 (2, 3): blk·ws as a pair of T.
      const float2 wl = *reinterpret_cast<const float2*>(ws + kb * 16 + tc);
      const float2 wh = *reinterpret_cast<const float2*>(ws + kb * 16 + 8 + tc);
      const uint32_t fl = m2::Mma<T>::pack(wl.x * blk, wl.y * blk);
      const uint32_t fh = m2::Mma<T>::pack(wh.x * blk, wh.y * blk);
      const uint32_t sa[4] = {m2::mul2<T>(cb[0], fl), m2::mul2<T>(cb[1], fl), m2::mul2<T>(cb[2], fh),
                              m2::mul2<T>(cb[3], fh)};
      sx(kb, sa);
    }
    const float e_lo = es[t_lo], e_hi = es[t_hi];
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      acc[j][0] *= e_lo;
      acc[j][1] *= e_lo;
      acc[j][2] *= e_hi;
      acc[j][3] *= e_hi;
    }
    {
      const uint4 raw = cbw[rb * 32];
      const uint32_t cb[4] = {raw.x, raw.y, raw.z, raw.w};
      uint32_t sa[4];
#pragma unroll
      for (int v = 0; v < 2; ++v) {
        const int s0 = r0 + v * 8 + tc;
        const float2 w = *reinterpret_cast<const float2*>(dts + s0);
        const float2 q = *reinterpret_cast<const float2*>(ds + s0);
        const float2 lo = unpack<T>(cb[v * 2]), hi = unpack<T>(cb[v * 2 + 1]);
        const bool live_lo = t_lo < len, live_hi = t_hi < len;
        const float v0 = live_lo && s0 <= t_lo ? lo.x * m2::exp2_fast(d_lo - q.x) * w.x : 0.f;
        const float v1 = live_lo && s0 + 1 <= t_lo ? lo.y * m2::exp2_fast(d_lo - q.y) * w.y : 0.f;
        const float v2 = live_hi && s0 <= t_hi ? hi.x * m2::exp2_fast(d_hi - q.x) * w.x : 0.f;
        const float v3 = live_hi && s0 + 1 <= t_hi ? hi.y * m2::exp2_fast(d_hi - q.y) * w.y : 0.f;
        sa[v * 2] = m2::Mma<T>::pack(v0, v1);
        sa[v * 2 + 1] = m2::Mma<T>::pack(v2, v3);
      }
      sx(rb, sa);
    }
    // + D·x, · silu(z), then stored as 16-byte vectors (rows past the sequence are not): lane tc/2
    // of a quad holds column pairs tc of blocks j; a quad transpose per four blocks gives it the
    // whole of block 4q + tc/2 instead.
    const float* d_cols = dk + hh * P + p0 + tc;
    const size_t o0 = tok0 * hp + static_cast<size_t>(h) * P + p0;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int t = r == 0 ? t_lo : t_hi;
      const uint32_t to = static_cast<uint32_t>(t) * static_cast<uint32_t>(hp);
      const T* zr = z && t < len ? z + o0 + to + tc : nullptr;
      T* yr = y + o0 + to + (lane % 4) * 8;
      const unsigned char* xr = reinterpret_cast<const unsigned char*>(xs);
      const uint32_t e_off = e_lane + r * 8 * XB;
#pragma unroll
      for (int q = 0; q < NJ / 4; ++q) {
        uint32_t w[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int j = 4 * q + k;
          const float2 xv = load_pair<T>(reinterpret_cast<const T*>(xr + m2::swz_add<XB>(e_off, j)));
          const float2 dd = *reinterpret_cast<const float2*>(d_cols + j * 8);
          float v0 = acc[j][2 * r] + dd.x * xv.x, v1 = acc[j][2 * r + 1] + dd.y * xv.y;
          if (zr) {
            const float2 zv = load_pair<T>(zr + j * 8);
            v0 *= m2::silu(zv.x);
            v1 *= m2::silu(zv.y);
          }
          w[k] = m2::Mma<T>::pack(v0, v1);
        }
        m2::quad_transpose(w, lane);
        if (t < len)
          *reinterpret_cast<uint4*>(yr + q * 32) = make_uint4(w[0], w[1], w[2], w[3]);
      }
    }
    // Warp 0 (row block 0, the lightest) drops the unit's state tile from L2 (it has landed). Not
    // at N = 256, whose kernel would spill more for it.
    if (N <= 128 && D.discard_states && warp == 0) {
      const size_t bh = static_cast<size_t>(b) * D.nheads + h;
      m2::discard_l2(states + ((bh * (D.nchunks + 1)) + c) * static_cast<size_t>(P) * N +
                         static_cast<size_t>(p0) * N,
                     PT * N * static_cast<int>(sizeof(S)), lane);
    }
  }
}

template <typename T, typename S>
__device__ void compute_out_simt(const T* __restrict__ x, const T* __restrict__ bm,
                                 const T* __restrict__ cm, const float* __restrict__ dt,
                                 const float* __restrict__ da, const S* __restrict__ states,
                                 const float* __restrict__ dskip, const T* __restrict__ z,
                                 T* __restrict__ y, SsdParams D) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  constexpr int RT = 16;
  float* m = reinterpret_cast<float*>(smem_raw);  // [RT][chunk]
  const int c = blockIdx.x, bh = blockIdx.y;
  const int b = bh / D.nheads, h = bh % D.nheads, g = h / (D.nheads / D.ngroups);
  const int chunk = D.chunk, N = D.dstate, P = D.headdim;
  int l0, len;
  m2::chunk_span(D, c, l0, len);
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

// The kernels, instantiated from the list in src/instances.rs (compute_out.inc). One warp per 16
// rows of a chunk of at most 256 tokens: at most 512 threads, 128 registers. The `_tma` forms
// (sm_90+, states of the value type) take x, the states, c and b as tensor maps.
// PACKED: the chunks from the table of packed sequences (SsdParams::chunk_starts), forms of their
// own so that the common ones keep their registers.
#define CO_ARGS(T, S)                                                                          \
  const T *x, const T *b, const T *c, const float *dt, const float *da, const S *states,       \
      const float *dskip, const T *z, T *y, SsdParams d
#define CO_MMA(NAME, T, S, N, PT, PACKED)                                                      \
  extern "C" __global__ void __launch_bounds__(512) NAME(CO_ARGS(T, S)) {                      \
    m2::mark(0);                                                                               \
    if (!d.early) m2::wait_prior_grid();                                                       \
    compute_out_mma<T, S, N, PT, false, PACKED>(x, b, c, dt, da, states, dskip, z, y, d,       \
                                                nullptr, nullptr, nullptr, nullptr);           \
    m2::mark_all(3);                                                                           \
  }
#define CO_MMA_TMA(NAME, T, N, PT, PACKED)                                                     \
  extern "C" __global__ void __launch_bounds__(512)                                            \
      NAME(const __grid_constant__ m2::TensorMap tx, const __grid_constant__ m2::TensorMap th, \
           const __grid_constant__ m2::TensorMap tc, const __grid_constant__ m2::TensorMap tb, \
           const T* b, const T* c, const float* dt, const float* da, const T* states,          \
           const float* dskip, const T* z, T* y, SsdParams d) {                                \
    m2::mark(0);                                                                               \
    if (!d.early) m2::wait_prior_grid();                                                       \
    compute_out_mma<T, T, N, PT, true, PACKED>(nullptr, b, c, dt, da, states, dskip, z, y, d,  \
                                               &tx, &th, &tc, &tb);                            \
    m2::mark_all(3);                                                                           \
  }
#define CO_SIMT(NAME, T, S)                                                                    \
  extern "C" __global__ void NAME(CO_ARGS(T, S)) {                                             \
    m2::wait_prior_grid();                                                                     \
    compute_out_simt<T, S>(x, b, c, dt, da, states, dskip, z, y, d);                           \
  }
#include "ssd/compute_out.inc"
