// The embedding's backward, a scatter-add of output-gradient rows into the rows of the weight
// they were read from:
//   dw[ids[r], :] += dy[r, :]        dy [R, D] of type T, ids [R] u32, dw [V, D] f32 (zeroed)
// One program per row of dy, its threads over D; f32 atomics, as rows of one id may come from
// anywhere in the batch. Ids outside 0..V are skipped: the forward refused them.
#include "common.cuh"

namespace {

constexpr int THREADS = 128;

template <typename T>
__device__ void embedding_bwd(const T* dy, const uint32_t* ids, float* dw, int V, int D) {
  m2::wait_prior_grid();
  const long r = blockIdx.x;
  const uint32_t id = ids[r];
  if (id >= static_cast<uint32_t>(V)) return;
  const T* src = dy + r * D;
  float* dst = dw + static_cast<long>(id) * D;
  for (int j = threadIdx.x; j < D; j += THREADS) atomicAdd(dst + j, m2::to_f(src[j]));
}

}  // namespace

#define EMBEDDING_BWD(NAME, T)                                                                \
  extern "C" __global__ void __launch_bounds__(THREADS)                                       \
      NAME(const T* dy, const uint32_t* ids, float* dw, int V, int D) {                       \
    embedding_bwd<T>(dy, ids, dw, V, D);                                                      \
  }
#include "embedding/embedding.inc"
