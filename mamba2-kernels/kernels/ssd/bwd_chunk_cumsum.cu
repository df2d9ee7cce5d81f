// The backward of stage 1: the gradient of the processed step sizes back to raw dt and dt_bias.
//   v = dt + bias,  dt_out = clamp(softplus(v), lo, hi)
//   ddt_raw = ddt · (0 where the clamp is active, σ(v) under softplus for v ≤ 20, else 1)
//   dbias[h] = Σ_{b,l} ddt_raw
// One thread per token of one (batch, head), 256 tokens per program: ddt [B,H,L] f32 in, the
// raw gradient out as [B,L,H] of dt's type T (contiguous), the bias's by one atomic per program into
// dbias [H] f32 (null: no bias to differentiate). The first program of each (batch, head) also
// sums bwd_compute_out's partial sums: A's, da_part [B,H,parts], by one atomic into grad_a [H];
// and with the first batch row D's per head, dd [H,P] summed over P into d_head [H] (null: D per
// channel or none). grad_a and dbias start at zero.
#include "params.cuh"

// The first program of (batch b, head h): A's partial sums of the pair, D's per head with b = 0
// (`red`: shared, one float per warp).
__device__ __forceinline__ void head_sums(const float* __restrict__ da_part, int parts,
                                          float* __restrict__ grad_a, const float* __restrict__ dd,
                                          float* __restrict__ d_head, int b, int h,
                                          const m2::SsdParams& d, float* red) {
  const float* row = da_part + (static_cast<size_t>(b) * d.nheads + h) * parts;
  float a = 0.f;
  for (int i = threadIdx.x; i < parts; i += blockDim.x) a += row[i];
  a = m2::block_sum(a, red);
  if (threadIdx.x == 0) atomicAdd(&grad_a[h], a);
  if (!d_head || b != 0) return;
  float s = 0.f;
  for (int j = threadIdx.x; j < d.headdim; j += blockDim.x) s += dd[h * d.headdim + j];
  s = m2::block_sum(s, red);
  if (threadIdx.x == 0) d_head[h] = s;
}

template <typename T>
__device__ void bwd_chunk_cumsum(const float* __restrict__ ddt, T* __restrict__ ddt_raw,
                                 float* __restrict__ dbias, const float* __restrict__ da_part,
                                 int parts, float* __restrict__ grad_a, const float* __restrict__ dd,
                                 float* __restrict__ d_head, const m2::SsdSteps& st,
                                 const m2::SsdParams& d) {
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
  __shared__ float red[32];
  if (dbias) {
    g = m2::block_sum(g, red);
    if (threadIdx.x == 0) atomicAdd(&dbias[h], g);
  }
  if (blockIdx.x == 0) head_sums(da_part, parts, grad_a, dd, d_head, b, h, d, red);
}

#define BWD_CHUNK_CUMSUM(NAME, T)                                                              \
  extern "C" __global__ void NAME(const float* ddt, T* ddt_raw, float* dbias,                  \
                                  const float* da_part, int parts, float* grad_a,              \
                                  const float* dd, float* d_head, m2::SsdSteps st,             \
                                  m2::SsdParams d) {                                           \
    bwd_chunk_cumsum<T>(ddt, ddt_raw, dbias, da_part, parts, grad_a, dd, d_head, st, d);       \
  }
#include "ssd/bwd_chunk_cumsum.inc"
