// Stage 1: dt processing and per-chunk cumulative sums of a·dt (log2 space; chunks as
// m2::chunk_span places them).
//   dt_out[b,h,l] = clamp(softplus(dt[b,l,h] + bias[h]))
//   da[b,h,l]     = log2(e)·Σ_{s = chunk start..l} a[h]·dt_out[b,h,s]
// One warp per (batch, chunk, head): lanes own consecutive tokens, a warp scan joins them.
// dt rows (tokens) may be strided (a slice of in_proj's output): token l of batch b starts at
// dt + (b·L + l)·dt_stride. Outputs are [B,H,L] f32: out = dt_out, out + B·H·L = da.
#include "params.cuh"

template <typename T>
__device__ void chunk_cumsum(const T* __restrict__ dt, const float* __restrict__ a,
                             const float* __restrict__ bias, float* __restrict__ out,
                             const m2::SsdParams& d, int softplus, float lo, float hi,
                             long dt_stride) {
  const int batch = d.batch, seqlen = d.seqlen, nheads = d.nheads;
  const int h = blockIdx.z * blockDim.y + threadIdx.y;
  const int c = blockIdx.x, b = blockIdx.y, lane = threadIdx.x;
  if (h >= nheads) return;
  int l0, len;
  m2::chunk_span(d, c, l0, len);
  const float ah = a[h], bh = bias ? bias[h] : 0.f;
  const size_t row = (static_cast<size_t>(b) * nheads + h) * seqlen;
  float* dt_out = out + row;
  float* da_out = out + static_cast<size_t>(batch) * nheads * seqlen + row;
  // Four tokens per lane are loaded before any is processed: their latencies overlap instead of
  // adding up along the scan.
  constexpr int U = 4;
  float carry = 0.f;
  for (int base = 0; base < len; base += 32 * U) {
    float raw[U];
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const int t = base + k * 32 + lane;
      const size_t src = (static_cast<size_t>(b) * seqlen + l0 + t) * dt_stride + h;
      raw[k] = t < len ? m2::to_f(dt[src]) : 0.f;
    }
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const int t = base + k * 32 + lane;
      const float v = t < len ? m2::process_dt(raw[k], bh, softplus, lo, hi) : 0.f;
      float s = ah * v;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        float n = __shfl_up_sync(0xffffffffu, s, o);
        if (lane >= o) s += n;
      }
      s += carry;
      if (t < len) {
        dt_out[l0 + t] = v;
        da_out[l0 + t] = s * 1.4426950408889634f;
      }
      carry = __shfl_sync(0xffffffffu, s, 31);
    }
  }
}

#define CHUNK_CUMSUM(NAME, T)                                                             \
  extern "C" __global__ void NAME(m2::SsdSteps st, m2::SsdParams d) {                         \
    m2::wait_prior_grid();                                                                    \
    chunk_cumsum<T>(static_cast<const T*>(st.dt), st.a, st.bias, st.out, d, st.softplus, st.lo, \
                    st.hi, st.dt_stride);                                                       \
  }
#include "ssd/chunk_cumsum.inc"
