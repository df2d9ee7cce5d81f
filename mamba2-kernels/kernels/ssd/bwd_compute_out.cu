// The backward of compute_out: every chunk's gradients, given the states H entering it and the
// gradients dH' of the states leaving it (bwd_pass_state). One program per (chunk of 64 tokens,
// batch·head); tokens t, s of the chunk, d the log2-space cumulative sums, decay_ts =
// exp2(d_t − d_s) for s ≤ t (0 above), S = C·Bᵀ, M = dY·Xᵀ, W = decay∘S·dt_s, A = decay∘M·dt_s,
// r_s = exp2(d_last − d_s)·dt_s:
//   dX = Wᵀ·dY + D·dY + diag(r)·B·dH'ᵀ        dB = Aᵀ·C + diag(r)·X·dH'
//   dC = A·B + diag(exp2(d))·dY·H
//   ddt_s = Σ_t decay_ts·S_ts·M_ts + exp2(d_last − d_s)·x_s·(dH' B_s) + a·q_s,   da = Σ_s dt_s·q_s
//   q_r = Σ_{t≥r} exp2(d_t)·dy_t·(H C_t) + exp2(d_last)·⟨dH', H⟩ + Σ_{j<r} (col_j − row_j)
//         + Σ_{s<r} r_s·x_s·(dH' B_s)
// with col_j = dt_j·Σ_t decay_tj S_tj M_tj and row_t = Σ_s decay_ts S_ts M_ts dt_s: the pairs
// (t ≥ r > s) that cross r, as an exclusive prefix sum whose diagonal terms cancel exactly.
// Eight warps, all tiles in shared memory. The states and their gradients (both [B,H,C+1,P,N] of
// S, chunk c's H in slot c, its dH' in slot c + 1) come at chunks of d.chunk: 64 tokens, or 128
// with P ≤ 64, where the program of a chunk's second half forms its H = exp2(d_63)·H0 +
// Σ_{s<64} exp2(d_63 − d_s)·dt_s·x_s B_sᵀ from the first half's rows, and that of a first half its
// dH' = exp2(d_last − d_63)·dH'_end + Σ_{t≥64} exp2(d_t − d_63)·dy_t C_tᵀ from the second's (one
// more [P, 64]·[64, N] product, in place of a state pass at 64-token chunks). Outputs: dx
// [B,L,H,P] of T; db, dc [B,L,G,N] f32 (summed over the group's heads by atomics when it has
// several); ddt [B,H,L] f32 (processed dt); da_part [B,H,⌈L/64⌉] f32; dd [H,P] f32 (atomics; null
// without D). The common shapes have P and N compiled in (BWD_COMPUTE_OUT_FIXED), the rest read
// them at run time. For 16-bit T, bwd_compute_out_round then rounds db and dc to T in one launch
// (BWD_COMPUTE_OUT_ROUND). The `_tma` form can leave dB and dC to bwd_bc (BC false), which sums
// the group's heads in one program; it then forms dy·(H C) from C·Hᵀ instead of dC's epilogue.
// mma.sync form (any type and shape): warp w owns rows 16·(w mod 4) and, of every block of 64
// columns, the 32 from 32·⌊w / 4⌋ of every [64, ·] product; tiles row-major, zero-padded to
// multiples of 64 columns plus 8 (conflict-free ldmatrix).
// wgmma form (bf16 values, P = 64 and N compiled in, sm_90a): both operands of every product by
// descriptor from tiles of 64-column blocks swizzled as wgmma reads them, transposed operands by
// the descriptor's major-ness (no copies); warpgroup g takes the 32 columns from 32·g of S, M and
// dX and of each block of 64 of dB and dC. Warp w's accumulator rows are again 16·(w mod 4), so
// both forms share every epilogue. Its `_tma` kernels (bf16 states too) take the tiles by tensor
// map, one thread issuing every copy at the start, each of the three groups completing on an
// mbarrier; the others copy them by cp.async, every thread computing addresses.
#include <type_traits>

#include "params.cuh"
#include "ssd/warp_tile.cuh"

namespace {

constexpr int TOKENS = 64, WARPS = 8, LDT = TOKENS + 8;
// What a program forms of its state tiles itself: nothing, H (a second half), dH' (a first half).
constexpr int MID_NONE = 0, MID_STATE = 1, MID_GRAD = 2;

struct Grads {
  void* dx;
  float* db;
  float* dc;
  float* ddt;
  float* da_part;
  float* dd;
};

// Programs per SM the kernel's registers are bounded for, as many as the tiles leave room for in
// the wgmma form of bf16 values (sm_90a): three at N = 64 (70 KB), one at N = 256 (176 KB); else
// two.
template <typename T> __host__ __device__ constexpr int min_programs(int n) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  return !std::is_same<T, __nv_bfloat16>::value ? 2 : n == 64 ? 3 : n == 256 ? 1 : 2;
#else
  return 2;
#endif
}

// Where element (r, c) of an mma.sync-form tile sits: rows of `ld` elements.
struct Padded {
  int ld;
  __device__ __forceinline__ int operator()(int r, int c) const { return r * ld + c; }
};

// A program's per-token and per-channel f32 sums in shared memory: dt and the cumulative sums d
// per token; D's value per channel (pp); one partial ⟨dH', H⟩ per warp; and partial sums, one row
// per warp that shares their index, each element stored once by one lane (no atomics: shared f32
// atomics are compare-and-swap loops, contended here): per token col and row (the cross pairs'
// sums), x·(dH' B) and dy·(H C); D's gradient per channel. Warp w's accumulators cover rows
// 16·(w mod 4) and columns from 32·⌊w / 4⌋, so a column's sums have four parts (by w mod 4) and
// a row's two (by ⌊w / 4⌋).
struct Sums {
  float *dts, *gs, *col, *row, *xdhb, *dyhc, *ddsum, *dsk, *red;
  int pp;
  __device__ __forceinline__ Sums(float* f, int pp_)
      : dts(f), gs(f + TOKENS), col(f + 2 * TOKENS), row(f + 6 * TOKENS), xdhb(f + 8 * TOKENS),
        dyhc(f + 10 * TOKENS), ddsum(f + 12 * TOKENS), dsk(f + 12 * TOKENS + 4 * pp_),
        red(f + 12 * TOKENS + 5 * pp_), pp(pp_) {}
  __device__ __forceinline__ float col_at(int t) const {
    return col[t] + col[TOKENS + t] + col[2 * TOKENS + t] + col[3 * TOKENS + t];
  }
  __device__ __forceinline__ float row_at(int t) const { return row[t] + row[TOKENS + t]; }
  __device__ __forceinline__ float xdhb_at(int t) const { return xdhb[t] + xdhb[TOKENS + t]; }
  __device__ __forceinline__ float dyhc_at(int t) const { return dyhc[t] + dyhc[TOKENS + t]; }
  __device__ __forceinline__ float dd_at(int j) const {
    return ddsum[j] + ddsum[pp + j] + ddsum[2 * pp + j] + ddsum[3 * pp + j];
  }
};

// A program's chunk and head, and its offsets into the inputs. Program i takes (batch·head,
// chunk) = (i mod B·H, ⌊i / B·H⌋): the heads of a chunk side by side, so that a group's heads
// share its B and C tiles and their dB, dC atomics in L2. The states and their gradients come at
// chunks of d.chunk = TOKENS or 2·TOKENS tokens (state chunk sc): H is slot sc of the states, dH'
// slot sc + 1 of their gradients (`h_at` and `h_at` + P·N), except at the half-way point of a
// state chunk of 2·TOKENS, which the program forms itself (`mid`, from the chunk's other half:
// rows `l_mid`.. of the inputs, `tc_mid` of them).
struct Place {
  int bh, ci, b, h, hpg, grp, l0, tc, nch, second, mid, tc_mid;
  size_t bhl, xo, xstride, bo, bstride, h_at, l_mid, xo_mid, bo_mid;
  __device__ __forceinline__ Place(const m2::SsdParams& d, int P, int N) {
    const int H = d.nheads, L = d.seqlen, G = d.ngroups, nbh = d.batch * H;
    bh = blockIdx.x % nbh;
    ci = blockIdx.x / nbh;
    b = bh / H;
    h = bh % H;
    hpg = H / G;
    grp = h / hpg;
    l0 = ci * TOKENS;
    tc = min(TOKENS, L - l0);
    nch = (L + TOKENS - 1) / TOKENS;
    bhl = static_cast<size_t>(bh) * L;
    const size_t tok = static_cast<size_t>(b) * L + l0;
    xo = (tok * H + h) * P;
    xstride = static_cast<size_t>(H) * P;
    bo = (tok * G + grp) * N;
    bstride = static_cast<size_t>(G) * N;
    const int per = d.chunk / TOKENS;
    second = ci % per;
    h_at = (static_cast<size_t>(bh) * (d.nchunks + 1) + ci / per) * P * N;
    // The second half forms H from the first; the first, where a second half follows, forms dH'.
    mid = per == 1 ? MID_NONE : second ? MID_STATE : l0 + TOKENS < L ? MID_GRAD : MID_NONE;
    tc_mid = second ? TOKENS : min(TOKENS, L - l0 - TOKENS);
    l_mid = second ? l0 - TOKENS : l0 + TOKENS;
    xo_mid = second ? xo - TOKENS * xstride : xo + TOKENS * xstride;
    bo_mid = second ? bo - TOKENS * bstride : bo + TOKENS * bstride;
  }
};

// The per-token and per-channel values (the caller synchronises before reading them); every
// partial sum is stored before it is read. A second half's cumulative sums start from its own
// first token. With `mid`, col holds the other half's row weights until W and A are formed:
// exp2(d_63 − d_s)·dt_s for H, exp2(d_t − d_63) for dH' (d_63 the first half's last sum).
__device__ __forceinline__ void start_sums(const Sums& s, const float* dt_out, const float* da,
                                           const float* dskip, const Place& at, int P,
                                           bool per_channel, int tid, int threads) {
  const float* g = da + at.bhl;
  const float base = at.second ? g[at.l0 - 1] : 0.f;
  for (int t = tid; t < TOKENS; t += threads) {
    s.dts[t] = t < at.tc ? dt_out[at.bhl + at.l0 + t] : 0.f;
    s.gs[t] = g[at.l0 + min(t, at.tc - 1)] - base;
    if (at.mid != MID_NONE) {
      float w = 0.f;
      if (t < at.tc_mid) {
        const size_t i = at.l_mid + t;
        w = at.mid == MID_STATE ? m2::exp2_fast(base - g[i]) * dt_out[at.bhl + i]
                                : m2::exp2_fast(g[i] - g[at.l0 + TOKENS - 1]);
      }
      s.col[t] = w;
    }
  }
  for (int j = tid; j < s.pp; j += threads) {
    s.dsk[j] = !dskip || j >= P ? 0.f : per_channel ? dskip[at.h * P + j] : dskip[at.h];
  }
}

// The factor of the mid-chunk tile's other term: exp2(d_63) of H0 (slot sc of the states) for
// H, exp2(d_last − d_63) of dH'_end (slot sc + 1 of their gradients) for dH'.
__device__ __forceinline__ float mid_factor(const float* da, const Place& at) {
  const float* g = da + at.bhl;
  return at.mid == MID_STATE ? m2::exp2_fast(g[at.l0 - 1])
                             : m2::exp2_fast(g[at.l_mid + at.tc_mid - 1] - g[at.l0 + TOKENS - 1]);
}

// This warp's part (rows m0.., columns n1..) of src [P, N] as f32 pairs, zero outside.
template <int NJ, typename S>
__device__ __forceinline__ void mid_load(float2 (&sv)[NJ][2], const S* src, int m0, int n1, int P,
                                         int N, int lane) {
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = m0 + m2::acc_row(lane, 2 * half), n = n1 + 8 * j + m2::acc_col(lane, 0);
      const S* row = src + static_cast<size_t>(r) * N;
      if (r < P && n + 1 < N && N % 2 == 0)
        sv[j][half] = m2::load2(row + n);
      else
        sv[j][half] = make_float2(r < P && n < N ? m2::to_f(row[n]) : 0.f,
                                  r < P && n + 1 < N ? m2::to_f(row[n + 1]) : 0.f);
    }
  }
}

// Two consecutive values of S as they sit in memory, and as f32 (a pair already in f32 as it is).
template <typename S> struct Pair {
  using Raw = uint32_t;
};
template <> struct Pair<float> {
  using Raw = float2;
};
template <typename S> __device__ __forceinline__ float2 pair_f(float2 v) { return v; }
template <typename S> __device__ __forceinline__ float2 pair_f(uint32_t v) {
  return m2::load2(reinterpret_cast<const S*>(&v));
}

// The same part of the mid-chunk tile: acc + f·sv, stored as T (zero outside [P, N], where the
// product's operands and sv are). sv: f32 pairs, or S pairs converted here.
template <typename S, int NJ, typename V, typename T, typename Idx>
__device__ __forceinline__ void mid_store(const float (&acc)[NJ][4], float f, const V (&sv)[NJ][2],
                                          int m0, int n1, T* tile, Idx at, int lane) {
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = m0 + m2::acc_row(lane, 2 * half), n = n1 + 8 * j + m2::acc_col(lane, 0);
      const float2 v = pair_f<S>(sv[j][half]);
      m2::store2<T>(tile + at(r, n), acc[j][2 * half] + f * v.x, acc[j][2 * half + 1] + f * v.y);
    }
  }
}

// From this warp's S and M accumulators (rows m0.., columns cw..): W and A into their tiles
// (zero above the diagonal and past the sequence), decay∘S∘M summed into col and row. Without
// branches: a masked element's exponent is −∞, so its decay, W, A and sums are 0.
template <typename T, typename Idx>
__device__ __forceinline__ void w_and_a(const float (&sacc)[4][4], const float (&macc)[4][4],
                                        int m0, int cw, int tc, const Sums& s, T* ws, T* as,
                                        Idx at, int lane) {
  float rz[2] = {0.f, 0.f}, gt[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int t = m0 + m2::acc_row(lane, 2 * half);
    gt[half] = t < tc ? s.gs[t] : -INFINITY;
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    float cz[2] = {0.f, 0.f};
    const int c0 = cw + 8 * j + m2::acc_col(lane, 0);
    const float2 gc = *reinterpret_cast<const float2*>(s.gs + c0);
    const float2 dc = *reinterpret_cast<const float2*>(s.dts + c0);
    const float gcs[2] = {gc.x, gc.y}, dcs[2] = {dc.x, dc.y};
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int t = m0 + m2::acc_row(lane, 2 * half);
      float wv[2], av[2];
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const int e = 2 * half + k;
        const float decay = m2::exp2_fast(c0 + k <= t ? gt[half] - gcs[k] : -INFINITY);
        const float v = decay * sacc[j][e] * macc[j][e];
        const float ed = decay * dcs[k];
        wv[k] = ed * sacc[j][e];
        av[k] = ed * macc[j][e];
        rz[half] += v * dcs[k];
        cz[k] += v;
      }
      m2::store2<T>(ws + at(t, c0), wv[0], wv[1]);
      m2::store2<T>(as + at(t, c0), av[0], av[1]);
    }
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const float v = m2::column_sum(cz[k]);
      if (lane < 4) s.col[(m0 >> 4) * TOKENS + c0 + k] = v;
    }
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const float v = m2::quad_sum(rz[half]);
    if ((lane & 3) == 0) s.row[(cw >> 5) * TOKENS + m0 + m2::acc_row(lane, 2 * half)] = v;
  }
}

// dX at rows m0.. and the columns from c1 of this warp's accumulators: acc = (Wᵀ·dY), st =
// (B·dH'ᵀ); dx = acc + r·st + D·dy. Adds x·st to xb (x_s·(dH' B_s)) and, with D, x·dy to D's
// gradient.
template <typename T, typename Idx>
__device__ __forceinline__ void dx_cols(const float (&acc)[4][4], const float (&st)[4][4], int m0,
                                        int c1, int tc, int P, const T* xs, const T* dys, Idx at,
                                        const float (&rs)[2], const Sums& s, float (&xb)[2],
                                        T* dx, size_t xstride, bool dd, int lane) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    float dsum[2] = {0.f, 0.f};
    const int c0 = c1 + 8 * j + m2::acc_col(lane, 0);
    const float2 skip = *reinterpret_cast<const float2*>(s.dsk + c0);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = m0 + m2::acc_row(lane, 2 * half), e = 2 * half;
      const float2 xv = m2::load2(xs + at(r, c0)), dv = m2::load2(dys + at(r, c0));
      xb[half] += xv.x * st[j][e] + xv.y * st[j][e + 1];
      dsum[0] += xv.x * dv.x;
      dsum[1] += xv.y * dv.y;
      const float v[2] = {acc[j][e] + rs[half] * st[j][e] + skip.x * dv.x,
                          acc[j][e + 1] + rs[half] * st[j][e + 1] + skip.y * dv.y};
      if (r < tc) {
        T* dst = dx + static_cast<size_t>(r) * xstride + c0;
        if (c0 + 1 < P && (P & 1) == 0) {
          m2::store2<T>(dst, v[0], v[1]);
        } else {
          if (c0 < P) dst[0] = m2::from_f<T>(v[0]);
          if (c0 + 1 < P) dst[1] = m2::from_f<T>(v[1]);
        }
      }
    }
    if (dd) {
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const float v = m2::column_sum(dsum[k]);
        if (lane < 4) s.ddsum[(m0 >> 4) * s.pp + c0 + k] = v;
      }
    }
  }
}

// A per-row sum of this warp's accumulator rows (rows m0.., columns from cw) into its part of
// `sums` (one lane of each quad stores).
__device__ __forceinline__ void add_rows(float* sums, const float (&v)[2], int m0, int cw,
                                         int lane) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const float q = m2::quad_sum(v[half]);
    if ((lane & 3) == 0) sums[(cw >> 5) * TOKENS + m0 + m2::acc_row(lane, 2 * half)] = q;
  }
}

// The row scales of this lane's two accumulator rows from m0: r = exp2(d_last − d_t)·dt_t (dX's
// and dB's dH' terms) and e = exp2(d_t) (dC's H term).
__device__ __forceinline__ void row_scales(const Sums& s, float g_last, int m0, int lane,
                                           float (&r)[2], float (&e)[2]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int t = m0 + m2::acc_row(lane, 2 * half);
    r[half] = m2::exp2_fast(g_last - s.gs[t]) * s.dts[t];
    e[half] = m2::exp2_fast(s.gs[t]);
  }
}

// One lane's quad of dB or dC into f32 memory at p: a 16-byte atomic add (`shared`: the group's
// heads add into it) or store, nothing where its row lies past the sequence.
__device__ __forceinline__ void quad_out(const float4& f, float* p, bool row_in, bool shared) {
  if (!row_in) return;
  float4* q = reinterpret_cast<float4*>(p);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (shared) {
    atomicAdd(q, f);
    return;
  }
#endif
  *q = f;
}

// Tile j of dB (or, `ctile`, dC) at rows m0.. and the columns from n1: acc + scale·st, where for
// dB acc = Aᵀ·C, st = X·dH', scale = r; for dC acc = A·B, st = dY·H, scale = exp2(d) and st·c is
// added to yc (dy·(H C) per token).
template <int NJ, typename T, typename Idx>
__device__ __forceinline__ void grad_tile(float (&v)[4], const float (&acc)[NJ][4],
                                          const float (&st)[NJ][4], const float (&scale)[2], int j,
                                          int m0, int n1, const T* ctile, Idx at, float (&yc)[2],
                                          int lane) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int e = 2 * half;
    if (ctile) {
      const int t = m0 + m2::acc_row(lane, e), n = n1 + 8 * j + m2::acc_col(lane, 0);
      const float2 cv = m2::load2(ctile + at(t, n));
      yc[half] += st[j][e] * cv.x + st[j][e + 1] * cv.y;
    }
    v[e] = acc[j][e] + scale[half] * st[j][e];
    v[e + 1] = acc[j][e + 1] + scale[half] * st[j][e + 1];
  }
}

// Every tile of dB or dC (grad_tile) added into `out` (rows `stride` apart), rows from tc and
// columns from N left out.
template <int NJ, typename T, typename Idx>
__device__ __forceinline__ void grad_cols(const float (&acc)[NJ][4], const float (&st)[NJ][4],
                                          const float (&scale)[2], int m0, int n1, int tc, int N,
                                          const T* ctile, Idx at, float (&yc)[2], float* out,
                                          size_t stride, bool shared, int lane) {
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    float v[4];
    grad_tile(v, acc, st, scale, j, m0, n1, ctile, at, yc, lane);
    m2::add_tile(out, stride, v, m0, n1 + 8 * j, tc, N, shared, lane);
  }
}

// The same where every tile's columns lie inside N and each lane's four start 16-byte aligned (N
// compiled in, a multiple of 64): the lane's quad of tile j goes to `row` + 8·j, `row` its row
// of the output from column n1 + quad_col, one 16-byte store or atomic add, none where that row
// lies past the sequence (`row_in`). No bounds or alignment tests per tile, and one row pointer
// per output instead of one address per tile. With LATE, every tile's values and pair swap come
// before the first store: a store through a generic pointer may alias the C tile's shared
// memory, so otherwise each tile's loads and shuffles start only once the tile before is stored.
template <bool LATE, int NJ, typename T, typename Idx>
__device__ __forceinline__ void grad_quads(const float (&acc)[NJ][4], const float (&st)[NJ][4],
                                           const float (&scale)[2], int m0, int n1,
                                           const T* ctile, Idx at, float (&yc)[2], float* row,
                                           bool row_in, bool shared, int lane) {
  float4 f[NJ];
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    float v[4];
    grad_tile(v, acc, st, scale, j, m0, n1, ctile, at, yc, lane);
    f[j] = m2::swap_quad(v, lane);
    if constexpr (!LATE) quad_out(f[j], row + 8 * j, row_in, shared);
  }
  if constexpr (LATE)
#pragma unroll
    for (int j = 0; j < NJ; ++j) quad_out(f[j], row + 8 * j, row_in, shared);
}

// This thread's part of ⟨dH', H⟩ over [rows, cols] of two tiles of equal layout (rows `ld`
// apart; zero padding adds nothing), 16 bytes a step.
template <typename T>
__device__ __forceinline__ float tile_dot(const T* hs, const T* dhs, int rows, int cols, int ld,
                                          int tid, int threads) {
  constexpr int V = 16 / sizeof(T);
  const int per_row = cols / V;
  float dot = 0.f;
  for (int i = tid; i < rows * per_row; i += threads) {
    const int r = i / per_row, col = (i - r * per_row) * V;
    const uint4 hr = *reinterpret_cast<const uint4*>(hs + r * ld + col);
    const uint4 gr = *reinterpret_cast<const uint4*>(dhs + r * ld + col);
    const T* hv = reinterpret_cast<const T*>(&hr);
    const T* gv = reinterpret_cast<const T*>(&gr);
#pragma unroll
    for (int k = 0; k < V; ++k) dot = fmaf(m2::to_f(hv[k]), m2::to_f(gv[k]), dot);
  }
  return dot;
}

// The program's end: ⟨dH', H⟩ summed, D's gradient out, then warp 0 forms q, ddt and da (two
// tokens per lane, prefix sums across the warp).
__device__ __forceinline__ void finish(float dot, const Sums& s, const float* a, const Grads& out,
                                       const Place& at, int P, int tid, int threads) {
  const int lane = tid & 31, warp = tid >> 5;
  dot = m2::warp_sum(dot);
  if (lane == 0) s.red[warp] = dot;
  __syncthreads();
  if (out.dd)
    for (int j = tid; j < P; j += threads) atomicAdd(&out.dd[at.h * P + j], s.dd_at(j));
  if (warp != 0) return;

  float state_dot = 0.f;
  for (int w = 0; w < WARPS; ++w) state_dot += s.red[w];
  const float ah = a[at.h], g_last = s.gs[TOKENS - 1];
  const int t0 = 2 * lane;
  float cross[2], before[2], tail[2];
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int t = t0 + k;
    cross[k] = s.dts[t] * s.col_at(t) - s.row_at(t);
    before[k] = m2::exp2_fast(g_last - s.gs[t]) * s.dts[t] * s.xdhb_at(t);
    tail[k] = m2::exp2_fast(s.gs[t]) * s.dyhc_at(t);
  }
  // Inclusive scans over lanes of the pair sums.
  float sc = cross[0] + cross[1], sb = before[0] + before[1], stl = tail[0] + tail[1];
  float ic = sc, ib = sb, it = stl;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const float nc = __shfl_up_sync(0xffffffffu, ic, o);
    const float nb = __shfl_up_sync(0xffffffffu, ib, o);
    const float nt = __shfl_up_sync(0xffffffffu, it, o);
    if (lane >= o) {
      ic += nc;
      ib += nb;
      it += nt;
    }
  }
  const float total_tail = __shfl_sync(0xffffffffu, it, 31);
  const float state_term = m2::exp2_fast(g_last) * state_dot;
  // Exclusive prefixes at this lane's first token.
  float pc = ic - sc, pb = ib - sb, pt = it - stl;
  float part = 0.f;
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int t = t0 + k;
    const float q = (total_tail - pt) + state_term + pc + pb;
    const float ddt = s.col_at(t) + m2::exp2_fast(g_last - s.gs[t]) * s.xdhb_at(t) + ah * q;
    if (t < at.tc) out.ddt[at.bhl + at.l0 + t] = ddt;
    part += s.dts[t] * q;
    pc += cross[k];
    pb += before[k];
    pt += tail[k];
  }
  part = m2::warp_sum(part);
  if (lane == 0) out.da_part[static_cast<size_t>(at.bh) * at.nch + at.ci] = part;
}

// PF, NF: P and N fixed at compile time (0: read from `d`), so that the tile walks unroll and
// their column bounds fold away.
template <typename T, typename S, int PF, int NF>
__device__ void bwd_compute_out_mma(const T* __restrict__ x, const T* __restrict__ dy,
                                    const T* __restrict__ bm, const T* __restrict__ cm,
                                    const float* __restrict__ dt_out, const float* __restrict__ da,
                                    const S* __restrict__ states, const S* __restrict__ dstates,
                                    const float* __restrict__ dskip, const float* __restrict__ a,
                                    const Grads& out, const m2::SsdParams& d) {
  extern __shared__ unsigned char smem_raw[];
  const int P = PF ? PF : d.headdim, N = NF ? NF : d.dstate;
  const int pp = (P + 63) / 64 * 64, np = (N + 63) / 64 * 64;
  const int ldp = pp + 8, ldn = np + 8;
  T* xs = reinterpret_cast<T*>(m2::smem_aligned(smem_raw));
  T* dys = xs + TOKENS * ldp;
  T* bs = dys + TOKENS * ldp;
  T* cs = bs + TOKENS * ldn;
  T* hs = cs + TOKENS * ldn;
  T* dhs = hs + pp * ldn;
  T* ws = dhs + pp * ldn;
  T* as = ws + TOKENS * LDT;
  const Sums sums(reinterpret_cast<float*>(as + TOKENS * LDT), pp);
  const Place at(d, P, N);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, threads = blockDim.x;
  const int tc = at.tc;
  const size_t xo = at.xo, xstride = at.xstride, bo = at.bo, bstride = at.bstride;
  m2::wait_prior_grid();

  start_sums(sums, dt_out, da, dskip, at, P, d.d_per_channel, tid, threads);
  // This warp's rows m0.. and its columns cw.. of each block of 64.
  const int m0 = warp % 4 * 16, cw = warp / 4 * 32;
  const S* hsrc = states + at.h_at;
  const S* dhsrc = dstates + at.h_at + static_cast<size_t>(P) * N;
  // The mid-chunk tile (P ≤ 64, one block of rows): the other half's rows weighted in W's tile,
  // its B or C rows in the tile's own place, their product written over them 64 columns at a time.
  if (at.mid != MID_NONE) {
    const bool state = at.mid == MID_STATE;
    T* mt = state ? hs : dhs;
    m2::stage(ws, LDT, (state ? x : dy) + at.xo_mid, xstride, at.tc_mid, P, TOKENS, pp, tid,
              threads);
    m2::stage(mt, ldn, (state ? bm : cm) + at.bo_mid, bstride, at.tc_mid, N, TOKENS, np, tid,
              threads);
    const S* src = state ? hsrc : dhsrc;
    float2 sv[4][2];
    mid_load(sv, src, m0, cw, P, N, lane);
    m2::stage_wait();
    __syncthreads();
    m2::scale_rows(ws, LDT, TOKENS, pp, sums.col, tid, threads);
    __syncthreads();
    const float f = mid_factor(da, at);
    for (int n0 = 0; n0 < np; n0 += 64) {
      if (n0 > 0) mid_load(sv, src, m0, n0 + cw, P, N, lane);
      float acc[4][4];
      m2::zero(acc);
      m2::WarpTile<T, true, true, 4>::mma(acc, ws, LDT, mt, ldn, m0, n0 + cw, TOKENS, lane);
      __syncthreads();
      mid_store<S>(acc, f, sv, m0, n0 + cw, mt, Padded{ldn}, lane);
    }
  }
  m2::stage(xs, ldp, x + xo, xstride, tc, P, TOKENS, pp, tid, threads);
  m2::stage(dys, ldp, dy + xo, xstride, tc, P, TOKENS, pp, tid, threads);
  m2::stage(bs, ldn, bm + bo, bstride, tc, N, TOKENS, np, tid, threads);
  m2::stage(cs, ldn, cm + bo, bstride, tc, N, TOKENS, np, tid, threads);
  if (at.mid != MID_STATE) m2::stage(hs, ldn, hsrc, N, P, N, pp, np, tid, threads);
  if (at.mid != MID_GRAD) m2::stage(dhs, ldn, dhsrc, N, P, N, pp, np, tid, threads);
  m2::stage_wait();
  __syncthreads();

  const float g_last = sums.gs[TOKENS - 1];
  // S = C·Bᵀ and M = dY·Xᵀ, then W, A and the sums of decay∘S∘M.
  {
    float sacc[4][4], macc[4][4];
    m2::zero(sacc);
    m2::zero(macc);
    m2::WarpTile<T, false, false, 4>::mma(sacc, cs, ldn, bs, ldn, m0, cw, np, lane);
    m2::WarpTile<T, false, false, 4>::mma(macc, dys, ldp, xs, ldp, m0, cw, pp, lane);
    w_and_a(sacc, macc, m0, cw, tc, sums, ws, as, Padded{LDT}, lane);
  }
  __syncthreads();

  // dX = Wᵀ·dY + D·dY + diag(r)·(B·dH'ᵀ); x_s·(dH' B_s) and D's gradient on the way.
  {
    float xb[2] = {0.f, 0.f}, rs[2], eg[2];
    row_scales(sums, g_last, m0, lane, rs, eg);
    for (int p0 = 0; p0 < pp; p0 += 64) {
      float acc[4][4], st[4][4];
      m2::zero(acc);
      m2::zero(st);
      m2::WarpTile<T, true, true, 4>::mma(acc, ws, LDT, dys, ldp, m0, p0 + cw, TOKENS, lane);
      m2::WarpTile<T, false, false, 4>::mma(st, bs, ldn, dhs, ldn, m0, p0 + cw, np, lane);
      dx_cols(acc, st, m0, p0 + cw, tc, P, xs, dys, Padded{ldp}, rs, sums, xb,
              static_cast<T*>(out.dx) + xo, xstride, out.dd, lane);
    }
    add_rows(sums.xdhb, xb, m0, cw, lane);
  }

  // dB = Aᵀ·C + diag(r)·(X·dH') and dC = A·B + diag(exp2(d))·(dY·H), 64 columns at a time.
  {
    float yc[2] = {0.f, 0.f}, unused[2] = {0.f, 0.f};
    float rs[2], eg[2];
    row_scales(sums, g_last, m0, lane, rs, eg);
    const bool shared = at.hpg > 1;
#pragma unroll 1
    for (int n0 = 0; n0 < np; n0 += 64) {
      const int nw = n0 + cw;
      float acc[4][4], st[4][4];
      m2::zero(acc);
      m2::zero(st);
      m2::WarpTile<T, true, true, 4>::mma(acc, as, LDT, cs, ldn, m0, nw, TOKENS, lane);
      m2::WarpTile<T, false, true, 4>::mma(st, xs, ldp, dhs, ldn, m0, nw, pp, lane);
      grad_cols(acc, st, rs, m0, nw, tc, N, static_cast<const T*>(nullptr), Padded{ldn}, unused,
                out.db + bo, bstride, shared, lane);
      m2::zero(acc);
      m2::zero(st);
      m2::WarpTile<T, false, true, 4>::mma(acc, as, LDT, bs, ldn, m0, nw, TOKENS, lane);
      m2::WarpTile<T, false, true, 4>::mma(st, dys, ldp, hs, ldn, m0, nw, pp, lane);
      grad_cols(acc, st, eg, m0, nw, tc, N, static_cast<const T*>(cs), Padded{ldn}, yc,
                out.dc + bo, bstride, shared, lane);
    }
    add_rows(sums.dyhc, yc, m0, cw, lane);
  }

  finish(tile_dot(hs, dhs, pp, np, ldn, tid, threads), sums, a, out, at, P, tid, threads);
}

// The tensor maps of the `_tma` form: x and dY as (channels, tokens, batch), B and C as (the
// groups' channels, tokens, batch), the states and their gradients as rows of N by all their
// other indices; every box 64 columns by 64 rows, landing as a Swizzled block.
struct Maps {
  const m2::TensorMap *x, *dy, *b, *c, *h, *dh;
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
using bf16 = __nv_bfloat16;

// Where element (r, c) of a wgmma-form tile sits: blocks of 64 columns of TOKENS rows each
// (every wgmma-form tile has TOKENS = P rows), swizzled as wgmma reads them.
struct Swizzled {
  __device__ __forceinline__ int operator()(int r, int c) const {
    return m2::swz_blocks<TOKENS>(r, c);
  }
};

// Rows [0, len) of a [TOKENS, 64] block of S (global rows `stride` elements apart) into a
// Swizzled block of bf16, the rest zero: by cp.async when S is bf16 and `wide` (16-byte aligned
// rows), else converted through registers.
template <typename S>
__device__ __forceinline__ void block_in(bf16* dst, const S* src, size_t stride, int len, bool wide,
                                         int tid, int threads) {
  if constexpr (std::is_same<S, bf16>::value) {
    if (wide) {
      m2::load_tile<64>(dst, src, static_cast<uint32_t>(stride), TOKENS, len, tid, threads);
      return;
    }
  }
  for (int i = tid; i < TOKENS * 8; i += threads) {
    const int r = i >> 3, ch = i & 7;
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const S* p = src + r * stride + ch * 8 + 2 * k;
      w[k] = r < len ? m2::Mma<bf16>::pack(m2::to_f(p[0]), m2::to_f(p[1])) : 0u;
    }
    *reinterpret_cast<uint4*>(dst + m2::swz<128>(r, ch)) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// One warpgroup's D (+)= A·B over K = 16·KS, A and B from the tiles of descriptors a and b at
// (ra, ca) and (rb, cb), with the K offset 16·ks added to the K-major operand's column or the
// MN-major operand's row.
template <int NJ, int TA, int TB, int KS>
__device__ __forceinline__ void product(float (&acc)[NJ][4], uint64_t a, int ra, int ca, uint64_t b,
                                        int rb, int cb) {
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    const int k = 16 * ks;
    m2::WgmmaSS<NJ>::template run<TA, TB>(
        acc, m2::desc_at<TOKENS>(a, TA ? ra + k : ra, TA ? ca : ca + k),
        m2::desc_at<TOKENS>(b, TB ? rb + k : rb, TB ? cb : cb + k), ks > 0);
  }
}

// Waits for this warpgroup's products issued since its last wait, into acc and st.
template <int NJ>
__device__ __forceinline__ void products_done(float (&acc)[NJ][4], float (&st)[NJ][4]) {
  m2::wgmma_commit();
  m2::wgmma_wait<0>();
  m2::wgmma_hold(acc);
  m2::wgmma_hold(st);
}

// One warpgroup's products of dB's block from column n1, Aᵀ·C into acc and X·dH' into st, and
// of dC's, A·B into acc and dY·H into st (descriptors of the A, C, X, dH', B, dY and H tiles).
__device__ __forceinline__ void db_products(float (&acc)[4][4], float (&st)[4][4], uint64_t aa,
                                            uint64_t ca, uint64_t xa, uint64_t dha, int n1) {
  product<4, 1, 1, TOKENS / 16>(acc, aa, 0, 0, ca, 0, n1);
  product<4, 0, 1, 64 / 16>(st, xa, 0, 0, dha, 0, n1);
}
__device__ __forceinline__ void dc_products(float (&acc)[4][4], float (&st)[4][4], uint64_t aa,
                                            uint64_t ba, uint64_t dya, uint64_t ha, int n1) {
  product<4, 0, 1, TOKENS / 16>(acc, aa, 0, 0, ba, 0, n1);
  product<4, 0, 1, 64 / 16>(st, dya, 0, 0, ha, 0, n1);
}

// Waits, after a barrier of the whole program, for a copy group: by its mbarrier in the `_tma`
// form (the barrier makes the mbarriers' initialisation visible), else for all but the `LEFT`
// cp.async groups committed after it.
template <bool TMA, int LEFT>
__device__ __forceinline__ void copies_landed(uint64_t& landed) {
  if constexpr (TMA) {
    __syncthreads();
    m2::mbar_wait(&landed, 0);
  } else {
    m2::cp_async_wait<LEFT>();
    __syncthreads();
  }
}

// The `_tma` form's copies, issued by one thread, each group completing on its own mbarrier of
// `landed`: [0] the mid-chunk tile's operands (the other half's rows of x or dY into W's tile, of B
// or C into the tile being formed), [1] x, dY, B and C, [2] with bf16 states H and dH' (those not
// formed here; f32 states are converted through registers instead). Rows past the sequence
// arrive as zeros.
template <typename S, int NB>
__device__ __forceinline__ void tiles_by_map(const Maps& m, const Place& at, bf16* xs, bf16* dys,
                                             bf16* bs, bf16* cs, bf16* hs, bf16* dhs, bf16* ws,
                                             uint64_t* landed) {
  constexpr int P = 64, BLOCK = TOKENS * 64;
  constexpr unsigned BYTES = BLOCK * sizeof(bf16);
  const int xc = at.h * P, bc = at.grp * NB * 64, b = at.b;
  // The state tile's first row among the rows of N (slot sc of (batch·head)).
  const int row = static_cast<int>(at.h_at / (NB * 64));
#pragma unroll
  for (int k = 0; k < 3; ++k) m2::mbar_init(&landed[k], 1);
  if (at.mid != MID_NONE) {
    const bool state = at.mid == MID_STATE;
    const int l = static_cast<int>(at.l_mid);
    bf16* mt = state ? hs : dhs;
    m2::mbar_expect(&landed[0], (1 + NB) * BYTES);
    m2::tma_load_3d(ws, state ? m.x : m.dy, xc, l, b, &landed[0]);
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
      m2::tma_load_3d(mt + nb * BLOCK, state ? m.b : m.c, bc + 64 * nb, l, b, &landed[0]);
  }
  m2::mbar_expect(&landed[1], (2 + 2 * NB) * BYTES);
  m2::tma_load_3d(xs, m.x, xc, at.l0, b, &landed[1]);
  m2::tma_load_3d(dys, m.dy, xc, at.l0, b, &landed[1]);
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    m2::tma_load_3d(bs + nb * BLOCK, m.b, bc + 64 * nb, at.l0, b, &landed[1]);
    m2::tma_load_3d(cs + nb * BLOCK, m.c, bc + 64 * nb, at.l0, b, &landed[1]);
  }
  if constexpr (!std::is_same<S, bf16>::value) return;
  const int states = (at.mid != MID_STATE) + (at.mid != MID_GRAD);
  m2::mbar_expect(&landed[2], states * NB * BYTES);
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    if (at.mid != MID_STATE) m2::tma_load_3d(hs + nb * BLOCK, m.h, 64 * nb, row, 0, &landed[2]);
    if (at.mid != MID_GRAD)
      m2::tma_load_3d(dhs + nb * BLOCK, m.dh, 64 * nb, row + P, 0, &landed[2]);
  }
}

template <typename S, int N, bool TMA, bool BC = true>
__device__ void bwd_compute_out_wgmma(const bf16* __restrict__ x, const bf16* __restrict__ dy,
                                      const bf16* __restrict__ bm, const bf16* __restrict__ cm,
                                      const float* __restrict__ dt_out,
                                      const float* __restrict__ da, const S* __restrict__ states,
                                      const S* __restrict__ dstates,
                                      const float* __restrict__ dskip,
                                      const float* __restrict__ a, const Grads& out,
                                      const m2::SsdParams& d, const Maps& maps) {
  constexpr int P = 64, NB = N / 64, BLOCK = TOKENS * 64;
  // TMA: the three copy groups have landed (tiles_by_map).
  __shared__ uint64_t landed[3];
  extern __shared__ unsigned char smem_raw[];
  bf16* xs = reinterpret_cast<bf16*>(m2::smem_aligned<1024>(smem_raw));
  bf16* dys = xs + BLOCK;
  bf16* bs = dys + BLOCK;
  bf16* cs = bs + NB * BLOCK;
  bf16* hs = cs + NB * BLOCK;
  bf16* dhs = hs + NB * BLOCK;
  bf16* ws = dhs + NB * BLOCK;
  bf16* as = ws + BLOCK;
  const Sums sums(reinterpret_cast<float*>(as + BLOCK), P);
  const Place at(d, P, N);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, threads = blockDim.x;
  m2::wait_prior_grid();
  // The tensor-map copies first, their latency under everything up to the first wait.
  if constexpr (TMA)
    if (tid == 0) tiles_by_map<S, NB>(maps, at, xs, dys, bs, cs, hs, dhs, ws, landed);

  start_sums(sums, dt_out, da, dskip, at, P, d.d_per_channel, tid, threads);
  const S* hsrc = states + at.h_at;
  const S* dhsrc = dstates + at.h_at + static_cast<size_t>(P) * N;
  const bool state = at.mid == MID_STATE;
  bf16* mt = state ? hs : dhs;
  // The warpgroup by a shuffle from lane 0: the compiler then knows it uniform across the warp and
  // keeps the descriptors' offsets in uniform registers.
  const int g = __shfl_sync(0xffffffffu, warp / 4, 0), m0 = warp % 4 * 16, cw = g * 32;
  // The mid-chunk tile's other term, this thread's pairs of it in every block, loaded ahead of
  // everything (their latency under the copies).
  typename Pair<S>::Raw sv[NB][4][2];
  if (at.mid != MID_NONE) {
    const S* src = state ? hsrc : dhsrc;
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = m0 + m2::acc_row(lane, 2 * half);
          const int n = 64 * nb + cw + 8 * j + m2::acc_col(lane, 0);
          sv[nb][j][half] = *reinterpret_cast<const typename Pair<S>::Raw*>(src + r * N + n);
        }
  }
  // Else the copies by cp.async, in the same three groups: the mid-chunk tile's operands (the
  // other half's rows of x or dY into W's tile, of B or C into the tile's own place), then what S
  // and M read, then H and dH' (first read by dX) under S and M; f32 states are converted through
  // registers in either form.
  constexpr bool states_by_map = TMA && std::is_same<S, bf16>::value;
  bool wide = true;
  if constexpr (!TMA) {
    auto al = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
    wide = al(x + at.xo) && al(dy + at.xo) && al(bm + at.bo) && al(cm + at.bo) && al(hsrc) &&
           al(dhsrc);
    if (at.mid != MID_NONE) {
      block_in(ws, (state ? x : dy) + at.xo_mid, at.xstride, at.tc_mid, wide, tid, threads);
#pragma unroll
      for (int nb = 0; nb < NB; ++nb)
        block_in(mt + nb * BLOCK, (state ? bm : cm) + at.bo_mid + 64 * nb, at.bstride, at.tc_mid,
                 wide, tid, threads);
      m2::cp_async_commit();
    }
    block_in(xs, x + at.xo, at.xstride, at.tc, wide, tid, threads);
    block_in(dys, dy + at.xo, at.xstride, at.tc, wide, tid, threads);
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      block_in(bs + nb * BLOCK, bm + at.bo + 64 * nb, at.bstride, at.tc, wide, tid, threads);
      block_in(cs + nb * BLOCK, cm + at.bo + 64 * nb, at.bstride, at.tc, wide, tid, threads);
    }
    m2::cp_async_commit();
  }
  if constexpr (!states_by_map) {
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      if (at.mid != MID_STATE) block_in(hs + nb * BLOCK, hsrc + 64 * nb, N, P, wide, tid, threads);
      if (at.mid != MID_GRAD) block_in(dhs + nb * BLOCK, dhsrc + 64 * nb, N, P, wide, tid, threads);
    }
    m2::cp_async_commit();
  }

  // Each tile's descriptor, once.
  auto tile = [](const bf16* t) { return m2::wgmma_desc<128>(m2::smem_addr(t)); };
  const uint64_t xa = tile(xs), dya = tile(dys), ba = tile(bs), ca = tile(cs), ha = tile(hs),
                 dha = tile(dhs), wa = tile(ws), aa = tile(as);
  // The mid-chunk tile: the weighted rows' product over the other half, written over its B or C
  // rows one block of 64 columns at a time, once both warpgroups have read that block.
  if (at.mid != MID_NONE) {
    copies_landed<TMA, 2>(landed[0]);
    m2::scale_rows(ws, 64, TOKENS, 64, sums.col, tid, threads);
    m2::fence_proxy_async();  // the weighted rows, before wgmma reads them
    __syncthreads();
    const float f = mid_factor(da, at);
    const uint64_t mta = state ? ha : dha;
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      const int n1 = 64 * nb + cw;
      float acc[4][4];
      m2::wgmma_fence();
      product<4, 1, 1, TOKENS / 16>(acc, wa, 0, 0, mta, 0, n1);
      m2::wgmma_commit();
      m2::wgmma_wait<0>();
      m2::wgmma_hold(acc);
      __syncthreads();
      mid_store<S>(acc, f, sv[nb], m0, n1, mt, Swizzled{}, lane);
    }
  }
  copies_landed<TMA, 1>(landed[1]);
  m2::fence_proxy_async();  // the tiles' writes, before wgmma reads them

  const float g_last = sums.gs[TOKENS - 1];
  // S = C·Bᵀ and M = dY·Xᵀ at columns cw.. (B's and X's rows), then W, A and their sums.
  {
    float sacc[4][4], macc[4][4];
    m2::wgmma_fence();
    product<4, 0, 0, N / 16>(sacc, ca, 0, 0, ba, cw, 0);
    product<4, 0, 0, P / 16>(macc, dya, 0, 0, xa, cw, 0);
    products_done(sacc, macc);
    w_and_a(sacc, macc, m0, cw, at.tc, sums, ws, as, Swizzled{}, lane);
  }
  copies_landed<states_by_map, 0>(landed[2]);
  m2::fence_proxy_async();  // W's, A's, H's and dH''s writes, before wgmma reads them
  __syncthreads();

  // dX = Wᵀ·dY + D·dY + diag(r)·(B·dH'ᵀ) at columns cw..; Wᵀ is W's tile read M-major.
  {
    float xb[2] = {0.f, 0.f}, rs[2], eg[2];
    row_scales(sums, g_last, m0, lane, rs, eg);
    float acc[4][4], st[4][4];
    m2::wgmma_fence();
    product<4, 1, 1, TOKENS / 16>(acc, wa, 0, 0, dya, 0, cw);
    product<4, 0, 0, N / 16>(st, ba, 0, 0, dha, cw, 0);
    products_done(acc, st);
    dx_cols(acc, st, m0, cw, at.tc, P, xs, dys, Swizzled{}, rs, sums, xb,
            static_cast<bf16*>(out.dx) + at.xo, at.xstride, out.dd, lane);
    add_rows(sums.xdhb, xb, m0, cw, lane);
  }

  // dB = Aᵀ·C + diag(r)·(X·dH') and dC = A·B + diag(exp2(d))·(dY·H) at columns 64·nb + cw.., both
  // warpgroups issuing the same products (a branch around wgmma would serialise them): dB's into
  // (ab, sb), dC's into (ac, sc), and after the last block ⟨dH', H⟩ as the trace of dH'·Hᵀ into
  // ab (each warpgroup its 32 columns of the [P, P] product, the lanes summing the diagonal
  // entries among their accumulators). Where the registers allow (`ahead`), each epilogue runs
  // with the next products already issued, the tensor cores working under it.
  constexpr bool ahead = min_programs<bf16>(N) < 3;
  // Each epilogue's stores after all its tiles where two programs share an SM; with three (N =
  // 64) all tiles' values do not fit the registers, and with one (N = 256) it measured slower.
  constexpr bool late = min_programs<bf16>(N) == 2;
  float dot = 0.f;
  if constexpr (!BC) {
    // dB and dC left to bwd_bc: dy·(H C_t) per token as Σ_p dY_tp·(C·Hᵀ)_tp, and ⟨dH', H⟩ as the
    // trace of dH'·Hᵀ, at columns cw...
    float ch[4][4], tr[4][4], yc[2] = {0.f, 0.f};
    m2::wgmma_fence();
    product<4, 0, 0, N / 16>(ch, ca, 0, 0, ha, cw, 0);
    product<4, 0, 0, N / 16>(tr, dha, 0, 0, ha, cw, 0);
    products_done(ch, tr);
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int t = m0 + m2::acc_row(lane, 2 * half), c = cw + 8 * j + m2::acc_col(lane, 0);
        const float2 dv = m2::load2(dys + Swizzled{}(t, c));
        yc[half] += ch[j][2 * half] * dv.x + ch[j][2 * half + 1] * dv.y;
      }
    add_rows(sums.dyhc, yc, m0, cw, lane);
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (m0 + m2::acc_row(lane, e) == cw + 8 * j + m2::acc_col(lane, e)) dot += tr[j][e];
  } else {
    float yc[2] = {0.f, 0.f}, rs[2], eg[2];
    row_scales(sums, g_last, m0, lane, rs, eg);
    const bool shared = at.hpg > 1;
    // This lane's row of dB and dC (after the pair swap) from column cw of the first block.
    const int qr = m0 + m2::quad_row(lane);
    const bool q_in = qr < at.tc;
    const size_t q_at = at.bo + static_cast<size_t>(qr) * at.bstride + cw + m2::quad_col(lane);
    float* db_row = out.db + q_at;
    float* dc_row = out.dc + q_at;
    float ab[4][4], sb[4][4], ac[4][4], sc[4][4];
    // Block k of this program is block (k + h) mod NB of the output: of a group's heads, which
    // run side by side, fewer add into the same lines of dB and dC at a time.
    const int rot = at.h % NB;
    auto block_col = [&](int k) { return 64 * ((k + rot) % NB); };
    m2::wgmma_fence();
    db_products(ab, sb, aa, ca, xa, dha, block_col(0) + cw);
    m2::wgmma_commit();
#pragma unroll 1
    for (int nb = 0; nb < NB; ++nb) {
      const int n0 = block_col(nb), n1 = n0 + cw;
      // dC's block (ahead: before dB's epilogue).
      if constexpr (ahead) {
        m2::wgmma_fence();
        dc_products(ac, sc, aa, ba, dya, ha, n1);
        m2::wgmma_commit();
      }
      m2::wgmma_wait<ahead ? 1 : 0>();
      m2::wgmma_hold(ab);
      m2::wgmma_hold(sb);
      grad_quads<late>(ab, sb, rs, m0, n1, static_cast<const bf16*>(nullptr), Swizzled{}, yc,
                 db_row + n0, q_in, shared, lane);
      m2::wgmma_fence();
      if constexpr (!ahead) {
        dc_products(ac, sc, aa, ba, dya, ha, n1);
        m2::wgmma_commit();
        m2::wgmma_wait<0>();
        m2::wgmma_hold(ac);
        m2::wgmma_hold(sc);
        m2::wgmma_fence();
      }
      // dB's next block, or after the last the trace (ahead: before dC's epilogue).
      if (nb + 1 < NB) {
        db_products(ab, sb, aa, ca, xa, dha, block_col(nb + 1) + cw);
      } else {
        product<4, 0, 0, N / 16>(ab, dha, 0, 0, ha, cw, 0);
      }
      m2::wgmma_commit();
      if constexpr (ahead) {
        m2::wgmma_wait<1>();
        m2::wgmma_hold(ac);
        m2::wgmma_hold(sc);
      }
      grad_quads<late>(ac, sc, eg, m0, n1, static_cast<const bf16*>(cs), Swizzled{}, yc,
                 dc_row + n0, q_in, shared, lane);
    }
    add_rows(sums.dyhc, yc, m0, cw, lane);
    m2::wgmma_wait<0>();
    m2::wgmma_hold(ab);
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (m0 + m2::acc_row(lane, e) == cw + 8 * j + m2::acc_col(lane, e)) dot += ab[j][e];
  }
  finish(dot, sums, a, out, at, P, tid, threads);
}
#endif

// The wgmma form where it is compiled (sm_90a) and takes the shape, else the mma.sync form.
template <typename T, typename S, int PF, int NF>
__device__ __forceinline__ void bwd_compute_out(const T* x, const T* dy, const T* bm, const T* cm,
                                                const float* dt_out, const float* da,
                                                const S* states, const S* dstates,
                                                const float* dskip, const float* a,
                                                const Grads& out, const m2::SsdParams& d) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  if constexpr (std::is_same<T, bf16>::value && PF == 64 && NF > 0 && NF % 64 == 0) {
    bwd_compute_out_wgmma<S, NF, false>(x, dy, bm, cm, dt_out, da, states, dstates, dskip, a, out,
                                        d, Maps{});
    return;
  }
#endif
  bwd_compute_out_mma<T, S, PF, NF>(x, dy, bm, cm, dt_out, da, states, dstates, dskip, a, out, d);
}

// The `_tma` form: the wgmma form with its tiles copied by tensor map (bf16 values, P = 64, N
// compiled in; sm_90a, where the launcher alone picks it), the states too where they are bf16.
template <typename S, int NF, bool BC>
__device__ __forceinline__ void bwd_compute_out_tma(const float* dt_out, const float* da,
                                                    const S* states, const S* dstates,
                                                    const float* dskip, const float* a,
                                                    const Grads& out, const m2::SsdParams& d,
                                                    const Maps& maps) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  bwd_compute_out_wgmma<S, NF, true, BC>(nullptr, nullptr, nullptr, nullptr, dt_out, da, states,
                                     dstates, dskip, a, out, d, maps);
#else
  __trap();
#endif
}

// db's and dc's f32 sums (`len` values each) rounded into db_out and dc_out of T: eight values
// per thread and step, 32-byte loads and 16-byte stores (every buffer is 256-byte aligned); the
// last len mod 8 of each one at a time.
template <typename T>
__device__ void bwd_compute_out_round(const float* __restrict__ db, const float* __restrict__ dc,
                                      T* __restrict__ db_out, T* __restrict__ dc_out, size_t len) {
  m2::wait_prior_grid();
  const size_t octets = len / 8, step = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t first = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (size_t i = first; i < 2 * octets; i += step) {
    const bool second = i >= octets;
    const size_t e = (second ? i - octets : i) * 8;
    const float4* src = reinterpret_cast<const float4*>((second ? dc : db) + e);
    const float4 u = src[0], v = src[1];
    const uint4 out = make_uint4(m2::Mma<T>::pack(u.x, u.y), m2::Mma<T>::pack(u.z, u.w),
                                 m2::Mma<T>::pack(v.x, v.y), m2::Mma<T>::pack(v.z, v.w));
    *reinterpret_cast<uint4*>((second ? dc_out : db_out) + e) = out;
  }
  for (size_t i = 8 * octets + first; i < len; i += step) {
    db_out[i] = m2::from_f<T>(db[i]);
    dc_out[i] = m2::from_f<T>(dc[i]);
  }
}

}  // namespace

#define BWD_COMPUTE_OUT_ROUND(NAME, T)                                                          \
  extern "C" __global__ void NAME(const float* db, const float* dc, T* db_out, T* dc_out,       \
                                  size_t len) {                                                 \
    bwd_compute_out_round<T>(db, dc, db_out, dc_out, len);                                      \
  }
#define BWD_COMPUTE_OUT_FIXED(NAME, T, S, PF, NF)                                               \
  extern "C" __global__ void __launch_bounds__(256, min_programs<T>(NF))                           \
      NAME(const T* x, const T* dy, const T* b, const T* c, const float* dt_out, const float* da, \
           const S* states, const S* dstates, const float* dskip, const float* a, void* dx,       \
           float* db, float* dc, float* ddt, float* da_part, float* dd, m2::SsdParams d) {       \
    const Grads out{dx, db, dc, ddt, da_part, dd};                                              \
    bwd_compute_out<T, S, PF, NF>(x, dy, b, c, dt_out, da, states, dstates, dskip, a, out, d);  \
  }
#define BWD_COMPUTE_OUT(NAME, T, S) BWD_COMPUTE_OUT_FIXED(NAME, T, S, 0, 0)
// The `_tma` kernels: x's, dY's, B's and C's tensor maps, then (BWD_COMPUTE_OUT_TMA, bf16
// states) the states' and their gradients' (STATE_MAPS) or (BWD_COMPUTE_OUT_TMA_F32, f32 states)
// none (NO_STATE_MAPS); BC false: dB and dC left to bwd_bc (db and dc unused).
#define STATE_MAPS                                                                              \
  , const __grid_constant__ m2::TensorMap th, const __grid_constant__ m2::TensorMap tdh
#define NO_STATE_MAPS
#define BWD_COMPUTE_OUT_TMA_KERNEL(NAME, S, NF, BC, MAPS, H, DH)                                \
  extern "C" __global__ void __launch_bounds__(256, min_programs<__nv_bfloat16>(NF))             \
      NAME(const __grid_constant__ m2::TensorMap tx, const __grid_constant__ m2::TensorMap tdy,   \
           const __grid_constant__ m2::TensorMap tb, const __grid_constant__ m2::TensorMap tc MAPS, \
           const float* dt_out, const float* da, const S* states, const S* dstates,             \
           const float* dskip, const float* a, void* dx, float* db, float* dc, float* ddt,       \
           float* da_part, float* dd, m2::SsdParams d) {                                        \
    const Grads out{dx, db, dc, ddt, da_part, dd};                                              \
    const Maps maps{&tx, &tdy, &tb, &tc, H, DH};                                                \
    bwd_compute_out_tma<S, NF, BC>(dt_out, da, states, dstates, dskip, a, out, d, maps);        \
  }
#define BWD_COMPUTE_OUT_TMA(NAME, NF, BC)                                                       \
  BWD_COMPUTE_OUT_TMA_KERNEL(NAME, __nv_bfloat16, NF, BC, STATE_MAPS, &th, &tdh)
#define BWD_COMPUTE_OUT_TMA_F32(NAME, NF, BC)                                                   \
  BWD_COMPUTE_OUT_TMA_KERNEL(NAME, float, NF, BC, NO_STATE_MAPS, nullptr, nullptr)
#include "ssd/bwd_compute_out.inc"
