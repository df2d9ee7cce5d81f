// Depthwise causal conv1d with fused bias + SiLU, its one-token update (channels last), and the
// prefill's backward:
//   y[b,t,d] = act(bias[d] + Σ_{k<K} w[d,k] · u[b, t−K+1+k, d]),  u = state (K values) ++ x
// The prefill also takes sequences packed along L of one row (ConvParams' cu): each sequence's
// window starts from its own row of the state [S,D,K], and its new state goes to its row.
// x rows (tokens) may be strided (a slice of in_proj's output): row r of batch b starts at
// x + (b·L + r)·x_stride. weight [D,K], bias [D], state [B,D,K] (the last K inputs, oldest
// first); all of type T, f32 accumulation. The output is cut by channels into up to three
// contiguous pieces (x, B and C of the mixer): channel d < s0 goes to y0 [rows, s0], the next s1
// to y1 [rows, s1], the rest to y2 [rows, D − s0 − s1].
// The backward, with a the pre-activation (recomputed), dy [B,L,D] given whole or as the
// forward's three pieces, and dx [B,L,D] with rows dx_stride apart:
//   da = dy · act'(a)      dx[b,s,d] = Σ_k w[d,k] · da[b, s+K−1−k, d]   (positions < L)
//   dw[d,k] = Σ_{b,t} da[b,t,d] · u[b, t−K+1+k, d]      dbias[d] = Σ_{b,t} da[b,t,d]
// Each program leaves its sums of dw and dbias as one f32 row [K+1, D] (tap-major, then the
// bias) of `part`; the rows are summed after the kernel.
// The `_lanes` variants (K <= 4) give each thread V adjacent channels, moved V·sizeof(T) bytes
// at a time (the launcher checks the alignment), and hold every input in a register window: one
// load per value, and the loads of several tokens issued together, since a thread that waits on
// one token's loads at a time leaves the memory system idle.
#include "params.cuh"

namespace {

using m2::ConvBwdParams;
using m2::ConvParams;

template <typename T>
__device__ __forceinline__ void put(const ConvParams& o, long row, int d, int D, float v) {
  T* p;
  if (d < o.s0) {
    p = static_cast<T*>(o.y0) + row * o.s0 + d;
  } else if (d < o.s0 + o.s1) {
    p = static_cast<T*>(o.y1) + row * o.s1 + (d - o.s0);
  } else {
    p = static_cast<T*>(o.y2) + row * (D - o.s0 - o.s1) + (d - o.s0 - o.s1);
  }
  *p = m2::from_f<T>(v);
}

constexpr int TOKENS = 32;  // tokens per thread in the prefill kernel

// V adjacent channels, moved as one load or store.
template <typename T, int V>
struct alignas(sizeof(T) * V) Lanes {
  T v[V];
};

// The piece of channel d among p0 [rows, s0], p1 [rows, s1], p2 [rows, D − s0 − s1]: its column
// pointer (row 0) and row stride.
template <typename P>
__device__ __forceinline__ P* piece(P* p0, P* p1, P* p2, int s0, int s1, int D, int d,
                                    long* stride) {
  if (d < s0) {
    *stride = s0;
    return p0 + d;
  }
  if (d < s0 + s1) {
    *stride = s1;
    return p1 + (d - s0);
  }
  *stride = D - s0 - s1;
  return p2 + (d - s0 - s1);
}

template <typename T>
__device__ __forceinline__ float input(const T* x, const T* st, int b, int t, int d, int L, int D,
                                       int K, long x_stride) {
  // t may be negative: then it reads the incoming state.
  return t >= 0 ? m2::to_f(x[(static_cast<long>(b) * L + t) * x_stride + d])
                : m2::to_f(st[(static_cast<long>(b) * D + d) * K + K + t]);
}

// The sequence a prefill program's tokens belong to: `seq` its index (the batch row b when not
// packed), [start, end) its tokens in the row. `at(t)` moves it to the sequence of token t >= the
// current one's start (packed rows only advance).
struct Seq {
  const int* cu;
  int seqs, seq, start, end;
  __device__ Seq(const ConvParams& p, int b, int t) : cu(p.cu), seqs(p.seqs) {
    if (!cu) {
      seq = b, start = 0, end = p.seqlen;
      return;
    }
    int lo = 0, hi = seqs - 1;  // the last s with cu[s] <= t
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (cu[mid] <= t) lo = mid; else hi = mid - 1;
    }
    seq = lo, start = cu[lo], end = cu[lo + 1];
  }
  __device__ __forceinline__ bool at(int t) {
    if (t < end) return false;
    while (t >= cu[seq + 1]) ++seq;
    start = cu[seq], end = cu[seq + 1];
    return true;
  }
};

// Input position t of sequence `q` (of batch row b): a token of the sequence, or before its start
// its state row.
template <typename T>
__device__ __forceinline__ float input_of(const T* x, const T* st, int b, const Seq& q, int t,
                                          int d, int L, int D, int K, long x_stride) {
  return t >= q.start ? m2::to_f(x[(static_cast<long>(b) * L + t) * x_stride + d])
                      : m2::to_f(st[(static_cast<long>(q.seq) * D + d) * K + K + t - q.start]);
}

// Writes the new state of every sequence whose last token lies in [t0, t1) (the program's tokens)
// for channels [d0, d0 + V): the sequence's last K inputs.
template <typename T, int V>
__device__ void conv_state_out(const T* x, const T* st_in, T* st_out, int b, int t0, int t1,
                               int d0, const ConvParams& p) {
  const int L = p.seqlen, D = p.dim, K = p.width;
  if (!p.cu) {
    if (t0 != 0) return;
    for (int c = 0; c < V; ++c)
      for (int k = 0; k < K; ++k)
        st_out[(static_cast<long>(b) * D + d0 + c) * K + k] =
            m2::from_f<T>(input(x, st_in, b, L - K + k, d0 + c, L, D, K, p.x_stride));
    return;
  }
  Seq q(p, b, t0);
  for (;;) {
    if (q.end > t1) return;
    for (int c = 0; c < V; ++c)
      for (int k = 0; k < K; ++k)
        st_out[(static_cast<long>(q.seq) * D + d0 + c) * K + k] = m2::from_f<T>(
            input_of(x, st_in, b, q, q.end - K + k, d0 + c, L, D, K, p.x_stride));
    if (q.seq + 1 == q.seqs) return;
    q.at(q.end);
  }
}

template <typename T>
__device__ void conv_prefill(const T* __restrict__ x, const T* __restrict__ w,
                             const T* __restrict__ bias, const T* __restrict__ st_in,
                             T* __restrict__ st_out, const ConvParams& p) {
  const int L = p.seqlen, D = p.dim, K = p.width;
  const long x_stride = p.x_stride;
  const int d = blockIdx.x * blockDim.x + threadIdx.x;
  const int t0 = blockIdx.y * TOKENS, b = blockIdx.z;
  if (d >= D) return;
  // Up to 8 taps stay in registers (static indices); wider kernels read w from cache.
  float wk[8];
  const bool small = K <= 8;
#pragma unroll
  for (int k = 0; k < 8; ++k) wk[k] = small && k < K ? m2::to_f(w[d * K + k]) : 0.f;
  const float bv = bias ? m2::to_f(bias[d]) : 0.f;
  const int t1 = min(L, t0 + TOKENS);
  Seq q(p, b, t0);
  for (int t = t0; t < t1; ++t) {
    q.at(t);
    float acc = bv;
    if (small) {
#pragma unroll
      for (int k = 0; k < 8; ++k)
        if (k < K) acc += wk[k] * input_of(x, st_in, b, q, t - K + 1 + k, d, L, D, K, x_stride);
    } else {
      for (int k = 0; k < K; ++k)
        acc += m2::to_f(w[d * K + k]) * input_of(x, st_in, b, q, t - K + 1 + k, d, L, D, K, x_stride);
    }
    if (p.silu) acc = m2::silu(acc);
    put<T>(p, static_cast<long>(b) * L + t, d, D, acc);
  }
  conv_state_out<T, 1>(x, st_in, st_out, b, t0, t1, d, p);
}

constexpr int GROUP = 8;  // tokens whose loads the lanes prefill issues together

// The prefill for K <= 4, V channels per thread: the last three inputs of each channel stay in
// registers, slot j holding position t − 3 + j before token t comes in.
template <typename T, int V>
__device__ void conv_prefill_lanes(const T* __restrict__ x, const T* __restrict__ w,
                                   const T* __restrict__ bias, const T* __restrict__ st_in,
                                   T* __restrict__ st_out, const ConvParams& p) {
  constexpr int W = 4;
  const int L = p.seqlen, D = p.dim, K = p.width;
  const long x_stride = p.x_stride;
  const int d0 = (blockIdx.x * blockDim.x + threadIdx.x) * V;
  const int t0 = blockIdx.y * TOKENS, b = blockIdx.z;
  if (d0 >= D) return;
  const int lo = W - K;  // taps j >= lo are live: tap j reads position t − (W−1) + j
  float wk[V][W], bv[V], u[V][W - 1];
#pragma unroll
  for (int c = 0; c < V; ++c) {
    bv[c] = bias ? m2::to_f(bias[d0 + c]) : 0.f;
#pragma unroll
    for (int j = 0; j < W; ++j) wk[c][j] = j >= lo ? m2::to_f(w[(d0 + c) * K + j - lo]) : 0.f;
  }
  Seq q(p, b, t0);
  // Slot j before token t: position t − (W−1) + j of t's sequence (its state before its start).
  auto window = [&](int t) {
#pragma unroll
    for (int c = 0; c < V; ++c)
#pragma unroll
      for (int j = 0; j < W - 1; ++j)
        u[c][j] = j >= lo ? input_of(x, st_in, b, q, t - (W - 1) + j, d0 + c, L, D, K, x_stride)
                          : 0.f;
  };
  window(t0);
  long ostride;
  T* out = piece(static_cast<T*>(p.y0), static_cast<T*>(p.y1), static_cast<T*>(p.y2), p.s0,
                 p.s1, D, d0, &ostride);
  const long row0 = static_cast<long>(b) * L;
  const int t1 = min(L, t0 + TOKENS);
  for (int g = t0; g < t1; g += GROUP) {
    Lanes<T, V> xv[GROUP];
#pragma unroll
    for (int i = 0; i < GROUP; ++i)
      if (g + i < t1)
        xv[i] = *reinterpret_cast<const Lanes<T, V>*>(x + (row0 + g + i) * x_stride + d0);
#pragma unroll
    for (int i = 0; i < GROUP; ++i) {
      if (g + i >= t1) break;
      if (q.at(g + i)) window(g + i);
      Lanes<T, V> o;
#pragma unroll
      for (int c = 0; c < V; ++c) {
        const float xc = m2::to_f(xv[i].v[c]);
        float a = bv[c] + wk[c][W - 1] * xc;
#pragma unroll
        for (int j = 0; j < W - 1; ++j) a += wk[c][j] * u[c][j];
        if (p.silu) a = m2::silu(a);
        o.v[c] = m2::from_f<T>(a);
#pragma unroll
        for (int j = 0; j < W - 2; ++j) u[c][j] = u[c][j + 1];
        u[c][W - 2] = xc;
      }
      *reinterpret_cast<Lanes<T, V>*>(out + (row0 + g + i) * ostride) = o;
    }
  }
  conv_state_out<T, V>(x, st_in, st_out, b, t0, t1, d0, p);
}

template <typename T>
__device__ void conv_step(T* __restrict__ st, const T* __restrict__ x, const T* __restrict__ w,
                          const T* __restrict__ bias, const ConvParams& p) {
  const int D = p.dim, K = p.width;
  const int d = blockIdx.x * blockDim.x + threadIdx.x, b = blockIdx.y;
  if (d >= D) return;
  T* row = st + (static_cast<long>(b) * D + d) * K;
  const float xv = m2::to_f(x[static_cast<long>(b) * p.x_stride + d]);
  float acc = bias ? m2::to_f(bias[d]) : 0.f;
  for (int k = 0; k < K; ++k) {
    const float u = k + 1 < K ? m2::to_f(row[k + 1]) : xv;
    acc += m2::to_f(w[d * K + k]) * u;
    row[k] = m2::from_f<T>(u);
  }
  if (p.silu) acc = m2::silu(acc);
  put<T>(p, b, d, D, acc);
}

// silu'(a) = σ(a)·(1 + a·(1 − σ(a))).
__device__ __forceinline__ float silu_grad(float a) {
  const float s = __fdividef(1.f, 1.f + __expf(-a));
  return s * (1.f + a * (1.f - s));
}

constexpr int AHEAD = 4;  // tokens whose loads the backward issues together

// One thread per channel d and one program per span of tokens [ts, te) of batch b: dx of those
// tokens, and their terms of dw and dbias. dx[s] needs da up to s + K − 1, so the thread runs on
// K − 1 tokens past te (recomputing their da) and starts from the K − 1 inputs before ts.
// W > 0: the taps and the last W inputs and da values stay in registers (K <= W), slot j of a
// window holding position t − (W−1) + j once token t is in; W = 0: any K, read from memory.
template <typename T, int W>
__device__ void conv_bwd(const T* __restrict__ x, const T* __restrict__ dy,
                         const T* __restrict__ w, const T* __restrict__ bias,
                         const T* __restrict__ st, T* __restrict__ dx, float* __restrict__ part,
                         const ConvBwdParams& p) {
  const int L = p.seqlen, D = p.dim, K = p.width;
  const long x_stride = p.x_stride;
  const int d = blockIdx.x * blockDim.x + threadIdx.x, b = blockIdx.z;
  if (d >= D) return;
  const int ts = blockIdx.y * p.span, te = ts + min(p.span, L - ts);
  const long row0 = static_cast<long>(b) * L;
  long dys;
  const T* dyc = piece(dy, static_cast<const T*>(p.dy1), static_cast<const T*>(p.dy2), p.s0, p.s1,
                       D, d, &dys);
  dyc += row0 * dys;
  T* dxc = dx + row0 * p.dx_stride + d;
  float* pc = part + (static_cast<long>(b) * gridDim.y + blockIdx.y) * (K + 1) * D + d;
  const float bv = bias ? m2::to_f(bias[d]) : 0.f;
  const T* wd = w + static_cast<long>(d) * K;
  float db = 0.f;
  if constexpr (W > 0) {
    const int lo = W - K;  // the live slots: lo..W−1
    float wa[W], wb[W], u[W], da[W], gw[W];
#pragma unroll
    for (int j = 0; j < W; ++j) {
      // wa: the taps against the inputs (slot j is tap j − lo); wb: against da (tap W−1−j).
      wa[j] = j >= lo ? m2::to_f(wd[j - lo]) : 0.f;
      wb[j] = j >= lo ? m2::to_f(wd[W - 1 - j]) : 0.f;
      // Before token ts comes in, slot j holds position ts − W + j.
      u[j] = j > lo ? input(x, st, b, ts - W + j, d, L, D, K, x_stride) : 0.f;
      da[j] = 0.f;
      gw[j] = 0.f;
    }
    const int tend = te + K - 1;
    for (int t0 = ts; t0 < tend; t0 += AHEAD) {
      float xv[AHEAD], gv[AHEAD];
#pragma unroll
      for (int i = 0; i < AHEAD; ++i) {
        const int t = t0 + i;
        const bool in = t < tend && t < L;
        xv[i] = in ? m2::to_f(x[(row0 + t) * x_stride + d]) : 0.f;
        gv[i] = in ? m2::to_f(dyc[static_cast<long>(t) * dys]) : 0.f;
      }
#pragma unroll
      for (int i = 0; i < AHEAD; ++i) {
        const int t = t0 + i;
        if (t >= tend) break;
        float a = bv;
#pragma unroll
        for (int j = 0; j < W; ++j) {
          u[j] = j + 1 < W ? u[j + 1] : xv[i];
          if (j >= lo) a += wa[j] * u[j];
        }
        // Past L, dy is 0 and so is da.
        const float g = p.silu ? gv[i] * silu_grad(a) : gv[i];
        if (t < te) {
          db += g;
#pragma unroll
          for (int j = 0; j < W; ++j)
            if (j >= lo) gw[j] += g * u[j];
        }
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < W; ++j) {
          da[j] = j + 1 < W ? da[j + 1] : g;
          if (j >= lo) s += wb[j] * da[j];
        }
        // With token t in, the window holds all of dx[t − K + 1]'s terms.
        const int so = t - K + 1;
        if (so >= ts) dxc[static_cast<long>(so) * p.dx_stride] = m2::from_f<T>(s);
      }
    }
#pragma unroll
    for (int j = 0; j < W; ++j)
      if (j >= lo) pc[static_cast<long>(j - lo) * D] = gw[j];
  } else {
    auto u_at = [&](int t) { return input(x, st, b, t, d, L, D, K, x_stride); };
    auto da_at = [&](int t) {
      if (t >= L) return 0.f;
      const float g = m2::to_f(dyc[static_cast<long>(t) * dys]);
      if (!p.silu) return g;
      float a = bv;
      for (int k = 0; k < K; ++k) a += m2::to_f(wd[k]) * u_at(t - K + 1 + k);
      return g * silu_grad(a);
    };
    // The thread alone writes its entries of the row: they accumulate in place.
    for (int k = 0; k < K; ++k) pc[static_cast<long>(k) * D] = 0.f;
    for (int t = ts; t < te; ++t) {
      const float g = da_at(t);
      db += g;
      for (int k = 0; k < K; ++k) pc[static_cast<long>(k) * D] += g * u_at(t - K + 1 + k);
      float s = 0.f;
      for (int k = 0; k < K; ++k) s += m2::to_f(wd[k]) * da_at(t + K - 1 - k);
      dxc[static_cast<long>(t) * p.dx_stride] = m2::from_f<T>(s);
    }
  }
  pc[static_cast<long>(K) * D] = db;
}

// conv_bwd for K <= 4 with V channels per thread (the window W = 4 of conv_bwd<T, 4>).
template <typename T, int V>
__device__ void conv_bwd_lanes(const T* __restrict__ x, const T* __restrict__ dy,
                               const T* __restrict__ w, const T* __restrict__ bias,
                               const T* __restrict__ st, T* __restrict__ dx,
                               float* __restrict__ part, const ConvBwdParams& p) {
  constexpr int W = 4;
  const int L = p.seqlen, D = p.dim, K = p.width;
  const long x_stride = p.x_stride;
  const int d0 = (blockIdx.x * blockDim.x + threadIdx.x) * V, b = blockIdx.z;
  if (d0 >= D) return;
  const int ts = blockIdx.y * p.span, te = ts + min(p.span, L - ts);
  const long row0 = static_cast<long>(b) * L;
  long dys;
  const T* dyc = piece(dy, static_cast<const T*>(p.dy1), static_cast<const T*>(p.dy2), p.s0, p.s1,
                       D, d0, &dys);
  dyc += row0 * dys;
  T* dxc = dx + row0 * p.dx_stride + d0;
  float* pc = part + (static_cast<long>(b) * gridDim.y + blockIdx.y) * (K + 1) * D + d0;
  const int lo = W - K;
  float wa[V][W], wb[V][W], u[V][W], da[V][W], gw[V][W], bv[V], db[V];
#pragma unroll
  for (int c = 0; c < V; ++c) {
    const T* wd = w + static_cast<long>(d0 + c) * K;
    bv[c] = bias ? m2::to_f(bias[d0 + c]) : 0.f;
    db[c] = 0.f;
#pragma unroll
    for (int j = 0; j < W; ++j) {
      wa[c][j] = j >= lo ? m2::to_f(wd[j - lo]) : 0.f;
      wb[c][j] = j >= lo ? m2::to_f(wd[W - 1 - j]) : 0.f;
      u[c][j] = j > lo ? input(x, st, b, ts - W + j, d0 + c, L, D, K, x_stride) : 0.f;
      da[c][j] = 0.f;
      gw[c][j] = 0.f;
    }
  }
  const int tend = te + K - 1;
  for (int t0 = ts; t0 < tend; t0 += AHEAD) {
    Lanes<T, V> xv[AHEAD], gv[AHEAD];
#pragma unroll
    for (int i = 0; i < AHEAD; ++i) {
      const int t = t0 + i;
      if (t < tend && t < L) {
        xv[i] = *reinterpret_cast<const Lanes<T, V>*>(x + (row0 + t) * x_stride + d0);
        gv[i] = *reinterpret_cast<const Lanes<T, V>*>(dyc + static_cast<long>(t) * dys);
      } else {
#pragma unroll
        for (int c = 0; c < V; ++c) {
          xv[i].v[c] = m2::from_f<T>(0.f);
          gv[i].v[c] = m2::from_f<T>(0.f);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < AHEAD; ++i) {
      const int t = t0 + i;
      if (t >= tend) break;
      Lanes<T, V> o;
#pragma unroll
      for (int c = 0; c < V; ++c) {
        float a = bv[c];
#pragma unroll
        for (int j = 0; j < W; ++j) {
          u[c][j] = j + 1 < W ? u[c][j + 1] : m2::to_f(xv[i].v[c]);
          if (j >= lo) a += wa[c][j] * u[c][j];
        }
        const float gy = m2::to_f(gv[i].v[c]);
        const float g = p.silu ? gy * silu_grad(a) : gy;
        if (t < te) {
          db[c] += g;
#pragma unroll
          for (int j = 0; j < W; ++j)
            if (j >= lo) gw[c][j] += g * u[c][j];
        }
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < W; ++j) {
          da[c][j] = j + 1 < W ? da[c][j + 1] : g;
          if (j >= lo) s += wb[c][j] * da[c][j];
        }
        o.v[c] = m2::from_f<T>(s);
      }
      const int so = t - K + 1;
      if (so >= ts) *reinterpret_cast<Lanes<T, V>*>(dxc + static_cast<long>(so) * p.dx_stride) = o;
    }
  }
#pragma unroll
  for (int c = 0; c < V; ++c) {
#pragma unroll
    for (int j = 0; j < W; ++j)
      if (j >= lo) pc[static_cast<long>(j - lo) * D + c] = gw[c][j];
    pc[static_cast<long>(K) * D + c] = db[c];
  }
}

}  // namespace

// The kernels, instantiated from the list in src/instances.rs (causal_conv1d.inc).
#define CONV(NAME, T)                                                                          \
  extern "C" __global__ void NAME(const T* x, const T* w, const T* bias, const T* st_in,       \
                                  T* st_out, ConvParams p) {                                   \
    m2::wait_prior_grid();                                                                     \
    conv_prefill<T>(x, w, bias, st_in, st_out, p);                                             \
  }
#define CONV_LANES(NAME, T, V)                                                                 \
  extern "C" __global__ void NAME(const T* x, const T* w, const T* bias, const T* st_in,       \
                                  T* st_out, ConvParams p) {                                   \
    m2::wait_prior_grid();                                                                     \
    conv_prefill_lanes<T, V>(x, w, bias, st_in, st_out, p);                                    \
  }
#define CONV_STEP(NAME, T)                                                                     \
  extern "C" __global__ void NAME(T* st, const T* x, const T* w, const T* bias, ConvParams p) { \
    m2::wait_prior_grid();                                                                     \
    conv_step<T>(st, x, w, bias, p);                                                           \
  }
#define CONV_BWD(NAME, T, W)                                                                   \
  extern "C" __global__ void NAME(const T* x, const T* dy, const T* w, const T* bias,          \
                                  const T* st, T* dx, float* part, ConvBwdParams p) {          \
    m2::wait_prior_grid();                                                                     \
    conv_bwd<T, W>(x, dy, w, bias, st, dx, part, p);                                           \
  }
#define CONV_BWD_LANES(NAME, T, V)                                                             \
  extern "C" __global__ void NAME(const T* x, const T* dy, const T* w, const T* bias,          \
                                  const T* st, T* dx, float* part, ConvBwdParams p) {          \
    m2::wait_prior_grid();                                                                     \
    conv_bwd_lanes<T, V>(x, dy, w, bias, st, dx, part, p);                                     \
  }
#include "conv/causal_conv1d.inc"
