// Stage 2: the state entering every chunk, by the jump formula (d = da_cumsum, log2 space):
//   h_{c+1} = exp2(d_last)·h_c + Σ_s exp2(d_last − d_s)·dt_s · x_s B_sᵀ        h: [P, N]
// x [B,L,H,P], b [B,L,G,N] (value type T), dt/da [B,H,L] f32, init [B,H,P,N] and
// states [B,H,C+1,P,N] in the state type S (f32 or bf16); `last` (optional) [B,H,P,N] gets a
// contiguous copy of slot C, the final state. Sequences packed along L of one row (SsdParams'
// seq_chunks, each starting at a chunk) run from their own rows of init [S,H,P,N] to their rows
// of last, the recurrence restarting at every sequence's first chunk. Two passes for bf16/f16
// values on tensor cores, and a SIMT kernel for the rest:
//
// chunk_state_mma: every chunk's own contribution Σ_s exp2(d_last − d_s)·dt_s · x_s B_sᵀ, all
//   chunks in parallel (needs P % (16·WARPS) == 0, N % NT == 0), written to slot c + 1; its
//   `_cs` form takes raw dt instead and does stage 1 (chunk_cumsum.cu) on its chunk itself,
//   writing dt_out and da_cumsum once per chunk: one launch fewer per `ssd` call; its `_tma`
//   forms (sm_90+) get the x and b tiles by tensor map, one thread issuing the copies (in the
//   `_tma_cs` form, `ssd`'s only, at L2 priority evict_last: compute_out reads them again), and
//   compiled for sm_90a with four warps (bf16) multiply on wgmma, the b tile read once per
//   program instead of once per warp;
// state_scan: the recurrence across chunks in place, streaming the slots with 16-byte accesses;
//   from chunk `release_at` on it lets the next kernel (compute_out, see there) start.
// fwd_pass_state_simt: any type and shape; one thread per state element, chunks in order.
// Timeline marks (m2::mark): chunk_state_mma 0 entry, 1 stage 1 done (`_cs`), 2 the first half
// of the tiles landed (`_tma`), 3 its MMAs done, 4 exit; state_scan 5 entry, 6 waited, 7 exit.
#include <type_traits>

#include "params.cuh"

namespace {

using m2::SsdParams;
using m2::SsdSteps;

constexpr int PAD = 8;  // elements of padding per row of the output staging
constexpr int MAXC = 512;  // the longest chunk chunk_state_mma takes

// A state pass program's row (blockIdx.y): its chunks [c0, c1), the row of its head's slots in
// `states` and of dt/da (batch·nheads + head), and, packed, its sequence (else −1).
struct ScanRow {
  int c0, c1, bh, seq;
};
__device__ __forceinline__ ScanRow scan_row(int row, const SsdParams& D) {
  if (!D.seq_chunks) return {0, D.nchunks, row, -1};
  const int s = row / D.nheads;
  return {D.seq_chunks[s], D.seq_chunks[s + 1], row % D.nheads, s};
}

template <typename T, typename S>
__device__ void fwd_pass_state_simt(const T* __restrict__ x, const T* __restrict__ bm,
                                    const float* __restrict__ dt, const float* __restrict__ da,
                                    const S* __restrict__ init, S* __restrict__ states,
                                    S* __restrict__ last, SsdParams D) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* w = reinterpret_cast<float*>(smem_raw);  // [chunk]
  const size_t pn = static_cast<size_t>(D.headdim) * D.dstate;
  const size_t e = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const ScanRow r = scan_row(blockIdx.y, D);
  const int bh = r.bh;
  const int b = bh / D.nheads, h = bh % D.nheads, g = h / (D.nheads / D.ngroups);
  const bool live = e < pn;
  const int p = live ? static_cast<int>(e / D.dstate) : 0, n = live ? static_cast<int>(e % D.dstate) : 0;
  const size_t row = static_cast<size_t>(bh) * D.seqlen;
  const size_t hp = static_cast<size_t>(D.nheads) * D.headdim;
  const size_t gn = static_cast<size_t>(D.ngroups) * D.dstate;
  const size_t own = static_cast<size_t>(blockIdx.y) * pn + e;  // its row of init and last
  float state = (init && live) ? m2::to_f(init[own]) : 0.f;
  for (int c = r.c0; c < r.c1; ++c) {
    int l0, len;
    m2::chunk_span(D, c, l0, len);
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
  if (live && r.seq < 0)
    states[(static_cast<size_t>(bh) * (D.nchunks + 1) + D.nchunks) * pn + e] = m2::from_f<S>(state);
  if (live && last) last[own] = m2::from_f<S>(state);
}

// Stage 1 for one chunk inside chunk_state_mma (THREADS threads): thread t takes tokens
// [t·q, t·q + q), q = ⌈len / THREADS⌉. raw_steps loads their raw dt into tv (first thing, so that
// the loads do not queue behind the tile copies); chunk_steps turns tv[k] into the processed dt
// and dv[k] into its log2-space sum, and returns the chunk's last sum d_last (as stored). The
// program of the chunk's first tile stores both.
template <typename T, int THREADS, int PER>
__device__ __forceinline__ void raw_steps(const SsdSteps& st, int b, int h, int l0, int len,
                                          float (&tv)[PER], SsdParams D) {
  const int q = (len + THREADS - 1) / THREADS, t0 = threadIdx.x * q;
  const T* dt = static_cast<const T*>(st.dt);
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    const int t = t0 + k;
    tv[k] = k < q && t < len ? m2::to_f(dt[(static_cast<size_t>(b) * D.seqlen + l0 + t) * st.dt_stride + h]) : 0.f;
  }
}
template <int THREADS, int PER>
__device__ __forceinline__ float chunk_steps(const SsdSteps& st, int b, int h, int l0, int len,
                                             bool store, float ah, float bias, float (&dv)[PER],
                                             float (&tv)[PER], SsdParams D) {
  __shared__ float warp_sums[THREADS / 32], last;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int q = (len + THREADS - 1) / THREADS, t0 = tid * q;
  float run = 0.f;
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    const bool ok = k < q && t0 + k < len;
    tv[k] = ok ? m2::process_dt(tv[k], bias, st.softplus, st.lo, st.hi) : 0.f;
    run += ah * tv[k];
    dv[k] = run;
  }
  // Exclusive prefix of the threads' totals: a warp scan, then the warps before this one.
  float incl = run;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const float n = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += n;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  float before = __shfl_up_sync(0xffffffffu, incl, 1);
  if (lane == 0) before = 0.f;
#pragma unroll
  for (int w = 0; w < THREADS / 32; ++w)
    if (w < warp) before += warp_sums[w];
  const size_t row = (static_cast<size_t>(b) * D.nheads + h) * D.seqlen + l0;
  float* dt_out = st.out + row;
  float* da_out = st.out + static_cast<size_t>(D.batch) * D.nheads * D.seqlen + row;
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    dv[k] = (before + dv[k]) * 1.4426950408889634f;
    const int t = t0 + k;
    if (store && k < q && t < len) {
      dt_out[t] = tv[k];
      da_out[t] = dv[k];
    }
    if (k < q && t == len - 1) last = dv[k];
  }
  __syncthreads();
  return last;
}

// One chunk's own contribution to the state, local_c = Σ_s exp2(d_last − d_s)·dt_s · x_s B_sᵀ,
// written to slot c + 1 of `states` (state_scan turns the slots into entry states in place).
// A program owns (batch·head·chunk, a [16·WARPS, NT] tile): x and b arrive by cp.async or TMA
// into swizzled tiles (m2::swz), xᵀ·b is an m16n8k16 chain with ldmatrix.trans for both operands and
// w_s = exp2(d_last − d_s)·dt_s applied to x's fragments in registers; the tile leaves through
// shared memory as 16-byte rows.
// CS: the `_cs` form (stage 1 from `steps`; dt and da unused), else dt/da from chunk_cumsum,
// or with dt null the backward's chunk terms of dstates, Σ_s exp2(d_s)·x_s B_sᵀ (dY for x, C for
// B; see bwd_pass_state.cu).
// TMA: the `_tma` form (x and b unused): the tiles come by the tensor maps `tx`, `tb`.
template <typename T, typename S, int WARPS, int NT, bool CS, bool TMA, bool PACKED>
__device__ void chunk_state_mma(const T* __restrict__ x, const T* __restrict__ bm,
                                const float* __restrict__ dt, const float* __restrict__ da,
                                S* __restrict__ states, SsdParams D, const SsdSteps& steps,
                                const m2::TensorMap* tx, const m2::TensorMap* tb, int box_rows) {
  constexpr int PT = 16 * WARPS, THREADS = 32 * WARPS;
  // b's tile is NT / CB column blocks of CB columns, each [chunk][CB]: one block, or for the
  // tensor-map boxes blocks of at most 64 columns (rows of at most 128 bytes).
  constexpr int CB = TMA && NT > 64 ? 64 : NT;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ uint64_t bars[2];  // TMA: the chunk's two halves
  unsigned char* smem = m2::smem_aligned<TMA ? 1024 : 128>(smem_raw);
  const int chunk = D.chunk;
  T* xs = reinterpret_cast<T*>(smem);      // [chunk][PT], swizzled (m2::swz)
  T* bs = xs + chunk * PT;                 // [NT / CB][chunk][CB], swizzled
  T* ws = bs + chunk * NT;                 // [chunk]

  // Program i takes tile (n, p) = (i mod NY, ⌊i / NY⌋ mod PZ) of (batch·head, chunk): the chunks
  // from the last down, every tile of every (batch, head) of one chunk together. The lowest
  // chunks' states, which state_scan reads first, are written last (still in L2), and the tiles
  // that share an x or b tile run side by side.
  const int ny = D.dstate / NT, pz = D.headdim / PT, nbh = D.batch * D.nheads;
  const int i = blockIdx.x, n0 = i % ny * NT, p0 = i / ny % pz * PT;
  const int bh = i / (ny * pz) % nbh, c = D.nchunks - 1 - i / (ny * pz * nbh);
  const int b = bh / D.nheads, h = bh % D.nheads, g = h / (D.nheads / D.ngroups);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const size_t hp = static_cast<size_t>(D.nheads) * D.headdim;
  const size_t gn = static_cast<size_t>(D.ngroups) * D.dstate;
  const size_t row = static_cast<size_t>(bh) * D.seqlen;
  const size_t pn = static_cast<size_t>(D.headdim) * D.dstate;
  // Unpacked, the span comes from blockIdx and the parameters, which the compiler forms again
  // where it needs them instead of holding two registers through the kernel.
  int l0 = c * chunk, len = min(chunk, D.seqlen - l0);
  if constexpr (PACKED) m2::chunk_span(D, c, l0, len);

  const size_t tok0 = static_cast<size_t>(b) * D.seqlen + l0;
  // The per-token scalars are loaded first, so that their latency overlaps the tile copies
  // instead of queueing behind them (chunk ≤ MAXC, the launcher's bound). Token i of the chunk
  // is (dv, tv)[k] of thread tid with i = tid + k·THREADS (loaded), or i = tid·q + k (CS).
  constexpr int PER = MAXC / THREADS;
  float dv[PER], tv[PER], d_last = 0.f, ah = 0.f, bias = 0.f;
  if constexpr (CS) {
    raw_steps<T, THREADS, PER>(steps, b, h, l0, len, tv, D);
    ah = steps.a[h];
    bias = steps.bias ? steps.bias[h] : 0.f;
  } else if (dt) {
    d_last = da[row + l0 + len - 1];
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      const int i = tid + k * THREADS;
      dv[k] = i < len ? da[row + l0 + i] : 0.f;
      tv[k] = i < len ? dt[row + l0 + i] : 0.f;
    }
  } else {
    // The chunk terms' weights exp2(d_s): d_last = 0, −d_s for d_s, 1 for dt_s.
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      const int i = tid + k * THREADS;
      dv[k] = i < len ? -da[row + l0 + i] : 0.f;
      tv[k] = i < len ? 1.f : 0.f;
    }
  }
  // The tiles arrive in two halves of the chunk (two cp.async groups, or two mbarriers of
  // tensor-map copies issued by one thread): the MMAs on the first half run while the second is
  // in flight.
  const int half = chunk / 32 * 16;
  if constexpr (TMA) {
    if (tid == 0) {
      m2::mbar_init(&bars[0], 1);
      m2::mbar_init(&bars[1], 1);
      const int xc = h * D.headdim + p0, bc = g * D.dstate + n0;
      // The `_cs` form runs only inside `ssd`, whose compute_out reads x and b again: their lines
      // stay in L2 at evict_last priority until then (compute_out reads them back to normal).
      auto copy = [&](T* dst, const m2::TensorMap* map, int col, int tok, uint64_t* bar) {
        if constexpr (CS)
          m2::tma_load_3d(dst, map, col, tok, b, bar, m2::l2_policy(true));
        else
          m2::tma_load_3d(dst, map, col, tok, b, bar);
      };
      for (int part = 0; part < 2; ++part) {
        const int r0 = part ? half : 0, rows = part ? chunk - half : half;
        m2::mbar_expect(&bars[part], rows * (PT + NT) * 2);
        for (int r = r0; r < r0 + rows; r += box_rows) {
          copy(xs + r * PT, tx, xc, l0 + r, &bars[part]);
#pragma unroll
          for (int k = 0; k < NT / CB; ++k)
            copy(bs + k * chunk * CB + r * CB, tb, bc + k * CB, l0 + r, &bars[part]);
        }
      }
    }
  } else {
    const T* xg = x + tok0 * hp + static_cast<size_t>(h) * D.headdim + p0;
    const T* bg = bm + tok0 * gn + static_cast<size_t>(g) * D.dstate + n0;
    const uint32_t hp32 = static_cast<uint32_t>(hp), gn32 = static_cast<uint32_t>(gn);
    const bool rest = len > half;  // else the second half is all zero-fill (from valid addresses)
#pragma unroll
    for (int part = 0; part < 2; ++part) {
      const int r0 = part ? half : 0, rows = part ? chunk - half : half;
      const size_t skip = part && rest ? half : 0;
      m2::load_tile<PT>(xs + r0 * PT, xg + skip * hp, hp32, rows, len - r0, tid, THREADS);
#pragma unroll
      for (int k = 0; k < NT / CB; ++k)
        m2::load_tile<CB>(bs + k * chunk * CB + r0 * CB, bg + skip * gn + k * CB, gn32, rows, len - r0,
                          tid, THREADS);
      m2::cp_async_commit();
    }
  }
  if constexpr (CS) {
    const bool store = n0 == 0 && p0 == 0;
    d_last = chunk_steps<THREADS, PER>(steps, b, h, l0, len, store, ah, bias, dv, tv, D);
    m2::mark(1);
    const int q = (len + THREADS - 1) / THREADS;
#pragma unroll
    for (int k = 0; k < PER; ++k)
      if (k < q && tid * q + k < len) ws[tid * q + k] = m2::from_f<T>(m2::exp2_fast(d_last - dv[k]) * tv[k]);
    for (int i = len + tid; i < chunk; i += THREADS) ws[i] = m2::from_f<T>(0.f);
  } else {
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      const int i = tid + k * THREADS;
      if (i < chunk) ws[i] = m2::from_f<T>(i < len ? m2::exp2_fast(d_last - dv[k]) * tv[k] : 0.f);
    }
  }
  if constexpr (TMA) {
    __syncthreads();
    m2::mbar_wait(&bars[0], 0);
    m2::mark(2);
  } else {
    m2::cp_async_wait<1>();
    __syncthreads();
  }

  float acc[NT / 8][4];
#pragma unroll
  for (int j = 0; j < NT / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
  const int tc = (lane % 4) * 2;
  // Each lane's ldmatrix row addresses in the x and b tiles at k0 = 0.
  const uint32_t a_lane =
      m2::smem_addr(xs) + m2::swz<PT * 2>((lane % 8) + (lane / 16) * 8, warp * 2 + (lane / 8) % 2) * 2;
  // x's fragment holds tokens k0 + tc + {0, 1} (registers 0, 1) and k0 + tc + 8 + {0, 1}
  // (registers 2, 3): w scales them there, in registers.
  auto x_frag = [&](uint32_t (&a)[4], int k0) {
    if (k0 == half) {
      if constexpr (TMA) {
        m2::mbar_wait(&bars[1], 0);
      } else {
        m2::cp_async_wait<0>();
        __syncthreads();
      }
    }
    m2::ldsm_x4_t(a, a_lane + k0 * PT * 2);
    const uint32_t w0 = *reinterpret_cast<const uint32_t*>(ws + k0 + tc);
    const uint32_t w8 = *reinterpret_cast<const uint32_t*>(ws + k0 + tc + 8);
    a[0] = m2::mul2<T>(a[0], w0);
    a[1] = m2::mul2<T>(a[1], w0);
    a[2] = m2::mul2<T>(a[2], w8);
    a[3] = m2::mul2<T>(a[3], w8);
  };
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr bool WGMMA = TMA && WARPS == 4 && std::is_same<T, __nv_bfloat16>::value;
#else
  constexpr bool WGMMA = false;
#endif
  if constexpr (WGMMA) {
    // One warpgroup: per 16 tokens a wgmma m64nNTk16 with the scaled x fragments as A and the
    // b tile (N-major, column blocks chunk·CB apart) read once per program. Each step is retired
    // before the next fragment is built: ptxas serialises wgmmas whose A registers are written
    // while another is in flight anyway, and unbroken groups of four measured no faster.
    const uint32_t b0 = m2::smem_addr(bs), lbo = chunk * CB * 2;
    m2::wgmma_hold(acc);
    for (int k0 = 0; k0 < len; k0 += 16) {
      uint32_t a[4];
      x_frag(a, k0);
      m2::wgmma_fence();
      m2::Wgmma<NT / 8>::template run<1>(acc, a, m2::wgmma_desc<CB * 2>(b0 + k0 * CB * 2, lbo));
      m2::wgmma_commit();
      m2::wgmma_wait<0>();
    }
    m2::wgmma_hold(acc);
  } else {
    const uint32_t b_lane =
        m2::smem_addr(bs) + m2::swz<CB * 2>((lane % 8) + ((lane / 8) % 2) * 8, lane / 16) * 2;
    for (int k0 = 0; k0 < len; k0 += 16) {
      uint32_t a[4];
      x_frag(a, k0);
#pragma unroll
      for (int j = 0; j < NT / 8; j += 2) {
        uint32_t bf[4];
        const int k = j / (CB / 8);  // the column block of n8 block j
        m2::ldsm_x4_t(bf, m2::swz_add<CB * 2>(b_lane + (k * chunk + k0) * CB * 2, j % (CB / 8)));
        m2::Mma<T>::run(acc[j], a, bf[0], bf[1]);
        m2::Mma<T>::run(acc[j + 1], a, bf[2], bf[3]);
      }
    }
  }
  m2::mark(3);
  // The warp's 16 × NT block through shared memory (the x and b tiles' space, free once every warp
  // is done with them and every copy has landed), then out as 16-byte vectors: whole 32-byte
  // sectors of every row.
  if constexpr (TMA) {
    m2::mbar_wait(&bars[1], 0);
  } else {
    m2::cp_async_wait<0>();
  }
  __syncthreads();
  constexpr int SR = NT + PAD, V = 16 / sizeof(S);
  S* hs = reinterpret_cast<S*>(smem) + warp * 16 * SR;
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

// The inter-chunk recurrence over the slots chunk_state_mma wrote, in place:
//   slot 0 ← init (or 0);  slot c+1 ← exp2(d_last_c)·slot c + local_c
// One thread per 8 consecutive state elements of one (batch, head), carried in f32. The loads do
// not depend on the carry: a ring of PF chunks stays in flight (raw, unpacked at use), enough
// bytes per SM to cover the memory latency with the few threads a (batch, head) gives.
// Packed, the slot between sequences s and s + 1 holds local_{c1−1} until s's program has read
// it; that program then writes the next sequence's initial state there (no other program reads
// or writes it, so there is no race), and sequence s + 1's program starts from init directly.
template <typename S, int PF, bool PACKED>
__device__ void state_scan(const float* __restrict__ da, const S* __restrict__ init,
                           S* __restrict__ states, S* __restrict__ last, SsdParams D) {
  using V8 = m2::Vec8<S>;
  const size_t pn = static_cast<size_t>(D.headdim) * D.dstate;
  const size_t e = (static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
  if (e >= pn) return;
  // PACKED: the rows of packed sequences (a form of its own: the common one keeps its registers).
  const ScanRow r = PACKED ? scan_row(blockIdx.y, D)
                           : ScanRow{0, D.nchunks, static_cast<int>(blockIdx.y), -1};
  const size_t own = static_cast<size_t>(blockIdx.y) * pn + e;  // its row of init and last
  const float* dah = da + static_cast<size_t>(r.bh) * D.seqlen;
  S* base = states + static_cast<size_t>(r.bh) * (D.nchunks + 1) * pn + e;
  float h[8];
  auto initial = [&](size_t at, float (&v)[8]) {
    if (init) {
      V8::unpack(V8::load(init + at, false), v);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = 0.f;
    }
  };
  initial(own, h);
  if (r.seq <= 0) V8::store(base + static_cast<size_t>(r.c0) * pn, h);
  // Chunk c's local state and d_last_c are loaded PF chunks ahead of their use.
  typename V8::Raw ring[PF];
  float d_last[PF];
  auto fetch = [&](int c, int i) {
    ring[i] = V8::load(base + static_cast<size_t>(c + 1) * pn, true);
    int l0, len;
    m2::chunk_span(D, c, l0, len);
    d_last[i] = dah[l0 + len - 1];
  };
#pragma unroll
  for (int i = 0; i < PF; ++i)
    if (r.c0 + i < r.c1) fetch(r.c0 + i, i);
  for (int c0 = r.c0; c0 < r.c1; c0 += PF) {
#pragma unroll
    for (int i = 0; i < PF; ++i) {
      const int c = c0 + i;
      if (c >= r.c1) break;
      if (c == D.release_at) m2::launch_dependents();
      float local[8];
      V8::unpack(ring[i], local);
      const float a = m2::exp2_fast(d_last[i]);
      if (c + PF < r.c1) fetch(c + PF, i);
#pragma unroll
      for (int k = 0; k < 8; ++k) h[k] = a * h[k] + local[k];
      if (c + 1 < r.c1 || r.seq < 0) V8::store(base + static_cast<size_t>(c + 1) * pn, h);
    }
  }
  if (last) V8::store(last + own, h);
  if (r.seq >= 0 && r.seq + 1 < D.seqs) {
    initial(own + static_cast<size_t>(D.nheads) * pn, h);
    V8::store(base + static_cast<size_t>(r.c1) * pn, h);
  }
}

}  // namespace

// The kernels, instantiated from the list in src/instances.rs (fwd_pass_state.inc). Every form
// takes the SsdParams (chunk_state_mma's PACKED forms: the chunks of packed sequences, from
// SsdParams::chunk_starts, forms of their own so that the common ones keep their registers); the `_cs` forms also take stage 1's SsdSteps, the `_tma` forms x and b as
// tensor maps (3-D: channels, tokens, batch; boxes of `box_rows` tokens, sm_90+).
#define FPS_SIMT(NAME, T, S)                                                                   \
  extern "C" __global__ void NAME(const T* x, const T* b, const float* dt, const float* da,    \
                                  const S* init, S* states, S* last, SsdParams d) {            \
    m2::wait_prior_grid();                                                                     \
    fwd_pass_state_simt<T, S>(x, b, dt, da, init, states, last, d);                            \
  }
#define CHUNK_STATE(NAME, T, S, W, NT, PACKED)                                                         \
  extern "C" __global__ void __launch_bounds__(32 * W)                                         \
      NAME(const T* x, const T* b, const float* dt, const float* da, S* states, SsdParams d) { \
    m2::mark(0);                                                                               \
    m2::wait_prior_grid();                                                                     \
    chunk_state_mma<T, S, W, NT, false, false, PACKED>(x, b, dt, da, states, d, SsdSteps{}, nullptr,   \
                                               nullptr, 0);                                    \
    m2::mark_all(4);                                                                           \
  }
#define CHUNK_STATE_CS(NAME, T, S, W, NT, PACKED)                                                      \
  extern "C" __global__ void __launch_bounds__(32 * W)                                         \
      NAME(const T* x, const T* b, S* states, SsdParams d, SsdSteps steps) {                   \
    m2::mark(0);                                                                               \
    m2::wait_prior_grid();                                                                     \
    chunk_state_mma<T, S, W, NT, true, false, PACKED>(x, b, nullptr, nullptr, states, d, steps,        \
                                              nullptr, nullptr, 0);                            \
    m2::mark_all(4);                                                                           \
  }
#define CHUNK_STATE_TMA(NAME, T, S, W, NT, PACKED)                                                     \
  extern "C" __global__ void __launch_bounds__(32 * W)                                         \
      NAME(const __grid_constant__ m2::TensorMap tx, const __grid_constant__ m2::TensorMap tb, \
           int box_rows, const float* dt, const float* da, S* states, SsdParams d) {           \
    m2::mark(0);                                                                               \
    m2::wait_prior_grid();                                                                     \
    chunk_state_mma<T, S, W, NT, false, true, PACKED>(nullptr, nullptr, dt, da, states, d, SsdSteps{}, \
                                              &tx, &tb, box_rows);                             \
    m2::mark_all(4);                                                                           \
  }
#define CHUNK_STATE_TMA_CS(NAME, T, S, W, NT, PACKED)                                                  \
  extern "C" __global__ void __launch_bounds__(32 * W)                                         \
      NAME(const __grid_constant__ m2::TensorMap tx, const __grid_constant__ m2::TensorMap tb, \
           int box_rows, S* states, SsdParams d, SsdSteps steps) {                             \
    m2::mark(0);                                                                               \
    m2::wait_prior_grid();                                                                     \
    chunk_state_mma<T, S, W, NT, true, true, PACKED>(nullptr, nullptr, nullptr, nullptr, states, d,    \
                                             steps, &tx, &tb, box_rows);                       \
    m2::mark_all(4);                                                                           \
  }
// PF chunks of 8 elements in flight per thread: 128 bytes, or 256 in the `_deep` ring (for grids
// with few threads; the launcher's choice).
#define SCAN(NAME, S, PF, PACKED)                                                              \
  extern "C" __global__ void NAME(const float* da, const S* init, S* states, S* last,          \
                                  SsdParams d) {                                               \
    m2::mark(5);                                                                               \
    m2::wait_prior_grid();                                                                     \
    m2::mark(6);                                                                               \
    state_scan<S, PF, PACKED>(da, init, states, last, d);                                      \
    m2::mark_all(7);                                                                           \
  }
#include "ssd/fwd_pass_state.inc"
