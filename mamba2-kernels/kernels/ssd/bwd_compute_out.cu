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
// Eight warps: warp w owns rows 16·(w mod 4) and, of every block of 64 columns, the 32 from
// 32·⌊w / 4⌋ of every [64, ·] product; all tiles sit in shared memory, zero-padded to multiples of
// 64 columns. Chunk c reads H from slot c of states and dH' from slot c + 1 of dstates (both
// [B,H,C+1,P,N] of S). Outputs: dx [B,L,H,P] of T; db, dc [B,L,G,N] f32
// (summed over the group's heads by atomics when it has several); ddt [B,H,L] f32 (processed
// dt); da_part [B,H,C] f32; dd [H,P] f32 (atomics; null without D). The common shapes have P and
// N compiled in (BWD_COMPUTE_OUT_FIXED), the rest read them at run time.
#include "params.cuh"
#include "ssd/warp_tile.cuh"

namespace {

constexpr int TOKENS = 64, WARPS = 8, LDT = TOKENS + 8;

struct Grads {
  void* dx;
  float* db;
  float* dc;
  float* ddt;
  float* da_part;
  float* dd;
};

// PF, NF: P and N fixed at compile time (0: read from `d`), so that the tile walks unroll and
// their column bounds fold away.
template <typename T, typename S, int PF, int NF>
__device__ void bwd_compute_out(const T* __restrict__ x, const T* __restrict__ dy,
                                const T* __restrict__ bm, const T* __restrict__ cm,
                                const float* __restrict__ dt_out, const float* __restrict__ da,
                                const S* __restrict__ states, const S* __restrict__ dstates,
                                const float* __restrict__ dskip, const float* __restrict__ a,
                                const Grads& out, const m2::SsdParams& d) {
  extern __shared__ unsigned char smem_raw[];
  const int P = PF ? PF : d.headdim, N = NF ? NF : d.dstate;
  const int H = d.nheads, L = d.seqlen, G = d.ngroups;
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
  float* dts = reinterpret_cast<float*>(as + TOKENS * LDT);
  float* gs = dts + TOKENS;
  float* col = gs + TOKENS;
  float* row = col + TOKENS;
  float* xdhb = row + TOKENS;
  float* dyhc = xdhb + TOKENS;
  float* ddsum = dyhc + TOKENS;
  float* dsk = ddsum + pp;
  float* red = dsk + pp;

  // Program i takes (batch·head, chunk) = (i mod B·H, ⌊i / B·H⌋): the heads of a chunk side by
  // side, so that a group's heads share its B and C tiles and their dB, dC atomics in L2.
  const int nbh = d.batch * H, bh = blockIdx.x % nbh, ci = blockIdx.x / nbh;
  const int b = bh / H, h = bh % H;
  const int hpg = H / G, grp = h / hpg;
  const int l0 = ci * TOKENS, tc = min(TOKENS, L - l0);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, threads = blockDim.x;
  const int nch = d.nchunks;
  m2::wait_prior_grid();

  const size_t bhl = static_cast<size_t>(bh) * L;
  for (int t = tid; t < TOKENS; t += threads) {
    dts[t] = t < tc ? dt_out[bhl + l0 + t] : 0.f;
    gs[t] = da[bhl + l0 + min(t, tc - 1)];
    col[t] = 0.f;
    row[t] = 0.f;
    xdhb[t] = 0.f;
    dyhc[t] = 0.f;
  }
  for (int j = tid; j < pp; j += threads) {
    ddsum[j] = 0.f;
    dsk[j] = !dskip || j >= P ? 0.f : d.d_per_channel ? dskip[h * P + j] : dskip[h];
  }
  const size_t tok = static_cast<size_t>(b) * L + l0;
  const size_t xo = (tok * H + h) * P, xstride = static_cast<size_t>(H) * P;
  const size_t bo = (tok * G + grp) * N, bstride = static_cast<size_t>(G) * N;
  const size_t pn = static_cast<size_t>(P) * N;
  m2::stage(xs, ldp, x + xo, xstride, tc, P, TOKENS, pp, tid, threads);
  m2::stage(dys, ldp, dy + xo, xstride, tc, P, TOKENS, pp, tid, threads);
  m2::stage(bs, ldn, bm + bo, bstride, tc, N, TOKENS, np, tid, threads);
  m2::stage(cs, ldn, cm + bo, bstride, tc, N, TOKENS, np, tid, threads);
  m2::stage(hs, ldn, states + (static_cast<size_t>(bh) * (nch + 1) + ci) * pn, N, P, N, pp, np,
            tid, threads);
  m2::stage(dhs, ldn, dstates + (static_cast<size_t>(bh) * (nch + 1) + ci + 1) * pn, N, P, N, pp,
            np, tid, threads);
  m2::stage_wait();
  __syncthreads();

  // This warp's rows m0.. and its columns cw.. of each block of 64.
  const int m0 = warp % 4 * 16, cw = warp / 4 * 32;
  const float g_last = gs[TOKENS - 1];
  // S = C·Bᵀ and M = dY·Xᵀ, then W, A and the sums of decay∘S∘M.
  {
    float sacc[4][4], macc[4][4];
    m2::zero(sacc);
    m2::zero(macc);
    m2::WarpTile<T, false, false, 4>::mma(sacc, cs, ldn, bs, ldn, m0, cw, np, lane);
    m2::WarpTile<T, false, false, 4>::mma(macc, dys, ldp, xs, ldp, m0, cw, pp, lane);
    float rz[2] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float cz[2] = {0.f, 0.f};
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int t = m0 + m2::acc_row(lane, 2 * half);
        float wv[2], av[2];
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          const int e = 2 * half + k, s = cw + 8 * j + m2::acc_col(lane, e);
          wv[k] = 0.f;
          av[k] = 0.f;
          if (s <= t && t < tc) {
            const float decay = m2::exp2_fast(gs[t] - gs[s]);
            const float v = decay * sacc[j][e] * macc[j][e];
            const float ed = decay * dts[s];
            wv[k] = ed * sacc[j][e];
            av[k] = ed * macc[j][e];
            rz[half] += v * dts[s];
            cz[k] += v;
          }
        }
        m2::store2<T>(ws + t * LDT + cw + 8 * j + m2::acc_col(lane, 0), wv[0], wv[1]);
        m2::store2<T>(as + t * LDT + cw + 8 * j + m2::acc_col(lane, 0), av[0], av[1]);
      }
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const float v = m2::column_sum(cz[k]);
        if (lane < 4) atomicAdd(&col[cw + 8 * j + m2::acc_col(lane, k)], v);
      }
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float v = m2::quad_sum(rz[half]);
      if ((lane & 3) == 0) atomicAdd(&row[m0 + m2::acc_row(lane, 2 * half)], v);
    }
  }
  __syncthreads();

  // dX = Wᵀ·dY + D·dY + diag(r)·(B·dH'ᵀ); x_s·(dH' B_s) and D's gradient on the way.
  {
    float xb[2] = {0.f, 0.f};
    float rs[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int s = m0 + m2::acc_row(lane, 2 * half);
      rs[half] = m2::exp2_fast(g_last - gs[s]) * dts[s];
    }
    for (int p0 = 0; p0 < pp; p0 += 64) {
      float acc[4][4], st[4][4];
      m2::zero(acc);
      m2::zero(st);
      m2::WarpTile<T, true, true, 4>::mma(acc, ws, LDT, dys, ldp, m0, p0 + cw, TOKENS, lane);
      m2::WarpTile<T, false, false, 4>::mma(st, bs, ldn, dhs, ldn, m0, p0 + cw, np, lane);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float dsum[2] = {0.f, 0.f};
        const int c0 = p0 + cw + 8 * j + m2::acc_col(lane, 0);
        const float2 skip = *reinterpret_cast<const float2*>(dsk + c0);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int s = m0 + m2::acc_row(lane, 2 * half), e = 2 * half;
          const float2 xv = m2::load2(xs + s * ldp + c0), dv = m2::load2(dys + s * ldp + c0);
          xb[half] += xv.x * st[j][e] + xv.y * st[j][e + 1];
          dsum[0] += xv.x * dv.x;
          dsum[1] += xv.y * dv.y;
          const float v[2] = {acc[j][e] + rs[half] * st[j][e] + skip.x * dv.x,
                              acc[j][e + 1] + rs[half] * st[j][e + 1] + skip.y * dv.y};
          if (s < tc) {
            T* dst = static_cast<T*>(out.dx) + xo + static_cast<size_t>(s) * xstride + c0;
            if (c0 + 1 < P && (P & 1) == 0) {
              m2::store2<T>(dst, v[0], v[1]);
            } else {
              if (c0 < P) dst[0] = m2::from_f<T>(v[0]);
              if (c0 + 1 < P) dst[1] = m2::from_f<T>(v[1]);
            }
          }
        }
        if (out.dd) {
#pragma unroll
          for (int k = 0; k < 2; ++k) {
            const float v = m2::column_sum(dsum[k]);
            if (lane < 4) atomicAdd(&ddsum[c0 + k], v);
          }
        }
      }
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float v = m2::quad_sum(xb[half]);
      if ((lane & 3) == 0) atomicAdd(&xdhb[m0 + m2::acc_row(lane, 2 * half)], v);
    }
  }

  // dB = Aᵀ·C + diag(r)·(X·dH') and dC = A·B + diag(exp2(d))·(dY·H), 64 columns at a time.
  {
    float yc[2] = {0.f, 0.f};
    float rs[2], eg[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int t = m0 + m2::acc_row(lane, 2 * half);
      rs[half] = m2::exp2_fast(g_last - gs[t]) * dts[t];
      eg[half] = m2::exp2_fast(gs[t]);
    }
    const bool shared = hpg > 1;
#pragma unroll 1
    for (int n0 = 0; n0 < np; n0 += 64) {
      const int nw = n0 + cw;
      float acc[4][4], st[4][4];
      m2::zero(acc);
      m2::zero(st);
      m2::WarpTile<T, true, true, 4>::mma(acc, as, LDT, cs, ldn, m0, nw, TOKENS, lane);
      m2::WarpTile<T, false, true, 4>::mma(st, xs, ldp, dhs, ldn, m0, nw, pp, lane);
      float* db = out.db + bo;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float v[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) v[e] = acc[j][e] + rs[e >> 1] * st[j][e];
        m2::add_tile(db, bstride, v, m0, nw + 8 * j, tc, N, shared, lane);
      }
      m2::zero(acc);
      m2::zero(st);
      m2::WarpTile<T, false, true, 4>::mma(acc, as, LDT, bs, ldn, m0, nw, TOKENS, lane);
      m2::WarpTile<T, false, true, 4>::mma(st, dys, ldp, hs, ldn, m0, nw, pp, lane);
      float* dc = out.dc + bo;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float v[4];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int t = m0 + m2::acc_row(lane, 2 * half), n = nw + 8 * j + m2::acc_col(lane, 0);
          const float2 cv = m2::load2(cs + t * ldn + n);
          const int e = 2 * half;
          yc[half] += st[j][e] * cv.x + st[j][e + 1] * cv.y;
          v[e] = acc[j][e] + eg[half] * st[j][e];
          v[e + 1] = acc[j][e + 1] + eg[half] * st[j][e + 1];
        }
        m2::add_tile(dc, bstride, v, m0, nw + 8 * j, tc, N, shared, lane);
      }
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float v = m2::quad_sum(yc[half]);
      if ((lane & 3) == 0) atomicAdd(&dyhc[m0 + m2::acc_row(lane, 2 * half)], v);
    }
  }

  // ⟨dH', H⟩ over the tile, 16 bytes a step (zero padding adds nothing).
  float dot = 0.f;
  {
    constexpr int V = 16 / sizeof(T);
    const int per_row = np / V;
    for (int i = tid; i < pp * per_row; i += threads) {
      const int r = i / per_row, col = (i - r * per_row) * V;
      const uint4 hr = *reinterpret_cast<const uint4*>(hs + r * ldn + col);
      const uint4 gr = *reinterpret_cast<const uint4*>(dhs + r * ldn + col);
      const T* hv = reinterpret_cast<const T*>(&hr);
      const T* gv = reinterpret_cast<const T*>(&gr);
#pragma unroll
      for (int k = 0; k < V; ++k) dot = fmaf(m2::to_f(hv[k]), m2::to_f(gv[k]), dot);
    }
  }
  dot = m2::warp_sum(dot);
  if (lane == 0) red[warp] = dot;
  __syncthreads();
  if (out.dd)
    for (int j = tid; j < P; j += threads) atomicAdd(&out.dd[h * P + j], ddsum[j]);
  if (warp != 0) return;

  // q, ddt and da: two tokens per lane, prefix sums across the warp.
  float state_dot = 0.f;
  for (int w = 0; w < WARPS; ++w) state_dot += red[w];
  const float ah = a[h];
  const int t0 = 2 * lane;
  float cross[2], before[2], tail[2];
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int t = t0 + k;
    cross[k] = dts[t] * col[t] - row[t];
    before[k] = m2::exp2_fast(g_last - gs[t]) * dts[t] * xdhb[t];
    tail[k] = m2::exp2_fast(gs[t]) * dyhc[t];
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
    const float ddt = col[t] + m2::exp2_fast(g_last - gs[t]) * xdhb[t] + ah * q;
    if (t < tc) out.ddt[bhl + l0 + t] = ddt;
    part += dts[t] * q;
    pc += cross[k];
    pb += before[k];
    pt += tail[k];
  }
  part = m2::warp_sum(part);
  if (lane == 0) out.da_part[static_cast<size_t>(bh) * nch + ci] = part;
}

}  // namespace

#define BWD_COMPUTE_OUT_FIXED(NAME, T, S, PF, NF)                                               \
  extern "C" __global__ void __launch_bounds__(256, 2)                                             \
      NAME(const T* x, const T* dy, const T* b, const T* c, const float* dt_out, const float* da, \
           const S* states, const S* dstates, const float* dskip, const float* a, void* dx,       \
           float* db, float* dc, float* ddt, float* da_part, float* dd, m2::SsdParams d) {       \
    const Grads out{dx, db, dc, ddt, da_part, dd};                                              \
    bwd_compute_out<T, S, PF, NF>(x, dy, b, c, dt_out, da, states, dstates, dskip, a, out, d);  \
  }
#define BWD_COMPUTE_OUT(NAME, T, S) BWD_COMPUTE_OUT_FIXED(NAME, T, S, 0, 0)
#include "ssd/bwd_compute_out.inc"
