// The backward of stage 1: the gradient of the processed step sizes back to raw dt and dt_bias.
//   v = dt + bias,  dt_out = clamp(softplus(v), lo, hi)
//   ddt_raw = ddt · (0 where the clamp is active, σ(v) under softplus for v ≤ 20, else 1)
//   dbias[h] = Σ_{b,l} ddt_raw
// One thread per token of one (batch, head), 256 tokens per program: ddt [B,H,L] f32 in, the
// raw gradient out as [B,L,H] of dt's type T (contiguous), the bias's by one atomic per program into
// dbias [H] f32 (null: no bias to differentiate).
#include "params.cuh"

template <typename T>
__device__ void bwd_chunk_cumsum(const float* __restrict__ ddt,
                                 T* __restrict__ ddt_raw, float* __restrict__ dbias,
                                 const m2::SsdSteps& st, const m2::SsdParams& d) {
  const int L = d.seqlen, H = d.nheads;
  const T* dt = static_cast<const T*>(st.dt);
  const int l = blockIdx.x * blockDim.x + threadIdx.x, h = blockIdx.y, b = blockIdx.z;
  m2::wait_prior_grid();
  float g = 0.f;
  if (l < L) {
    const float raw = m2::to_f(dt[(static_cast<size_t>(b) * L + l) * st.dt_stride + h]);
    const float v = raw + (st.bias ? st.bias[h] : 0.f);
    const float sp = st.softplus ? m2::softplus(v) : v;
    const bool clamped = sp < st.lo || sp > st.hi;
    const float slope = st.softplus && v <= 20.f ? 1.f / (1.f + __expf(-v)) : 1.f;
    g = clamped ? 0.f : ddt[(static_cast<size_t>(b) * H + h) * L + l] * slope;
    ddt_raw[(static_cast<size_t>(b) * L + l) * H + h] = m2::from_f<T>(g);
  }
  if (!dbias) return;
  __shared__ float part[32];
  g = m2::warp_sum(g);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) part[warp] = g;
  __syncthreads();
  if (warp == 0) {
    float v = lane < blockDim.x / 32 ? part[lane] : 0.f;
    v = m2::warp_sum(v);
    if (lane == 0) atomicAdd(&dbias[h], v);
  }
}

#define BWD_CHUNK_CUMSUM(NAME, T)                                                              \
  extern "C" __global__ void NAME(const float* ddt, T* ddt_raw, float* dbias, m2::SsdSteps st,   \
                                  m2::SsdParams d) {                                           \
    bwd_chunk_cumsum<T>(ddt, ddt_raw, dbias, st, d);                                       \
  }
#include "ssd/bwd_chunk_cumsum.inc"
