// Shared device helpers of the Mamba-2 kernels: value conversions, fast exp2, softplus and the
// dt processing of mamba_ssm, the wait of programmatic dependent launch, warp reductions, 8-value
// vector loads, cp.async and the m16n8k16 tensor-core primitives.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stddef.h>
#include <stdint.h>

// A parameter struct's size and field offsets as its Rust mirror asserts them (`m2_layout!` in
// src/cuda/mod.rs): a field added, moved or retyped on one side only fails the build.
#define M2_SIZE(T, BYTES) \
  static_assert(sizeof(T) == BYTES, #T ": size differs from its Rust mirror")
#define M2_AT(T, FIELD, OFFSET) \
  static_assert(offsetof(T, FIELD) == OFFSET, #T "." #FIELD ": offset differs from its Rust mirror")

namespace m2 {

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// 2^x in one MUFU instruction (relative error ~2^-22); 2^-inf = 0, never NaN for finite x.
__device__ __forceinline__ float exp2_fast(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// mamba_ssm's softplus: ln(1 + e^v) for v <= 20, else v.
__device__ __forceinline__ float softplus(float v) { return v <= 20.f ? log1pf(__expf(v)) : v; }

// dt <- clamp(softplus(dt + bias), lo, hi).
__device__ __forceinline__ float process_dt(float raw, float bias, bool sp, float lo, float hi) {
  float v = raw + bias;
  if (sp) v = softplus(v);
  return fminf(fmaxf(v, lo), hi);
}

// Programmatic dependent launch: the launchers let a kernel be scheduled while the kernel before
// it on the stream drains. Every kernel calls this before touching global memory (compute_out
// after the state pass: before reading the states): it returns once that kernel has finished and
// its writes are visible. A no-op before sm_90.
__device__ __forceinline__ void wait_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Timeline marks (the `timeline` feature; nothing without it): thread 0 of block k stores the
// global timer (ns) when the block passes mark i at m2_timeline[k·TIMELINE_MARKS + i] (blocks
// past TIMELINE_BLOCKS are not recorded); the host clears the array before a call and reads it
// after. One plain store per block and mark: no atomics, so the marks barely perturb the timing.
constexpr int TIMELINE_BLOCKS = 32768, TIMELINE_MARKS = 8;
#ifdef M2_TIMELINE
}  // namespace m2
extern "C" {
__device__ unsigned long long m2_timeline[m2::TIMELINE_BLOCKS * m2::TIMELINE_MARKS];
}
namespace m2 {
__device__ __forceinline__ void mark(int i) {
  const unsigned block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  if (threadIdx.x == 0 && block < TIMELINE_BLOCKS) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    m2_timeline[block * TIMELINE_MARKS + i] = t;
  }
}
// A mark once every thread of the block is past this point.
__device__ __forceinline__ void mark_all(int i) {
  __syncthreads();
  mark(i);
}
#else
__device__ __forceinline__ void mark(int) {}
__device__ __forceinline__ void mark_all(int) {}
#endif

// Lets the next kernel on the stream be scheduled before this one ends (sm_90+; a no-op before).
// Called only after wait_prior_grid, so that once the next kernel runs, every kernel before this
// one has finished: the next may read their outputs (not this one's) before its own wait.
__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ float silu(float z) { return z / (1.f + __expf(-z)); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// The program's sum of v, in every thread, through `red` (shared, one float per warp; blockDim.x
// a multiple of 32). Every thread of the program calls it; the first barrier lets a caller reuse
// `red` right after a previous call.
__device__ __forceinline__ float block_sum(float v, float* red) {
  v = warp_sum(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float s = lane < warps ? red[lane] : 0.f;
  return warp_sum(s);
}

// ---- cp.async: global -> shared copies, zero-filled when `valid` is false ----
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n));
}
// 4-byte variant (through L1), for runs of f32 scalars without 16-byte alignment.
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, bool valid) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  int n = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(gmem), "r"(n));
}
// Shared tiles of 2-byte values without padding, their 16-byte chunks XOR-swizzled: chunk c of
// row r (rows of ROWB bytes) sits at chunk c ^ ((r / PER) & MASK) of its row, PER rows sharing a
// 128-byte line and MASK + 1 = min(chunks per row, 8). Eight consecutive rows at one chunk (an
// ldmatrix) and each 128-byte line written by eight threads (cp.async) then touch 32 distinct
// banks. Returns the element offset of (r, chunk c).
template <int ROWB>
__device__ __forceinline__ int swz(int r, int c) {
  constexpr int CH = ROWB / 16, PER = ROWB >= 128 ? 1 : 128 / ROWB, MASK = (CH < 8 ? CH : 8) - 1;
  return (r * CH + (c ^ ((r / PER) & MASK))) * 8;
}
// The byte address of chunk c0 + k of a row of a swizzled tile (rows of ROWB bytes, the tile
// 128-byte aligned in the shared window), from `l`, the address of (row, c0): k is known at
// compile time and shares no bit with c0, so the swizzle's XOR carries over to it.
template <int ROWB>
__device__ __forceinline__ uint32_t swz_add(uint32_t l, int k) {
  constexpr int CH = ROWB / 16, MASK = (CH < 8 ? CH : 8) - 1;
  return (l ^ ((k & MASK) << 4)) + ((k & ~MASK) << 4);
}
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// The dynamic shared memory rounded up to A bytes (the launchers request A bytes more): 128, or
// 1024 where tensor-map copies swizzle into it.
template <int A = 128>
__device__ __forceinline__ unsigned char* smem_aligned(unsigned char* raw) {
  return raw + ((A - (smem_addr(raw) & (A - 1))) & (A - 1));
}
// Rows [0, rows) of a [rows, COLS] tile of 2-byte T (global row stride `stride` elements from
// `src`) into a swizzled shared tile by 16-byte cp.async from `threads` threads (a multiple of
// COLS / 8); rows from `len` on are zero-filled (read from `src`). The source offsets are 32-bit
// bytes from `src` (a tile spans less than 4 GiB): no 64-bit pointer stays live per thread.
template <int COLS, typename T>
__device__ __forceinline__ void load_tile(T* dst, const T* src, uint32_t stride, int rows, int len,
                                          int tid, int threads) {
  constexpr int Q = COLS / 8;
  const int c = tid % Q, step = threads / Q;
  const unsigned char* s = reinterpret_cast<const unsigned char*>(src);
  uint32_t off = static_cast<uint32_t>(tid / Q) * stride * 2 + c * 16;
  const uint32_t jump = static_cast<uint32_t>(step) * stride * 2;
  for (int r = tid / Q; r < rows; r += step, off += jump)
    cp_async16(dst + swz<COLS * 2>(r, c), s + (r < len ? off : 0), r < len);
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ---- TMA (sm_90+): tiles copied by tensor map, completing on an mbarrier ----
// A CUtensorMap as the driver encodes it (cuTensorMapEncodeTiled), passed by value as a
// __grid_constant__ kernel parameter. With the map's swizzle equal to the tile's row bytes (32,
// 64 or 128), a box lands exactly as `swz` lays out rows of that many bytes, provided the
// destination is 1024-byte aligned.
struct alignas(64) TensorMap {
  unsigned long long opaque[16];
};
// One-shot mbarrier (phase 0) expecting `count` arrivals; made visible to the copy engine.
__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// Drops the L2 lines of `bytes` bytes at `p` (both multiples of 128) without writing them back,
// the lanes of a warp taking every 32nd line: for an intermediate whose last reader has loaded
// it. Its contents become undefined.
__device__ __forceinline__ void discard_l2(const void* p, int bytes, int lane) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const char* q = static_cast<const char*>(p);
  for (int o = lane * 128; o < bytes; o += 32 * 128)
    asm volatile("discard.global.L2 [%0], 128;\n" ::"l"(q + o) : "memory");
#endif
}
// Orders this thread's earlier shared-memory accesses before its later tensor-map copies.
__device__ __forceinline__ void fence_proxy_async() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// Arrives on `bar`, announcing `bytes` more to come by copies that complete on it.
__device__ __forceinline__ void mbar_expect(uint64_t* bar, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
#endif
}
// Waits until phase `phase` of `bar` has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned phase) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n .reg .pred p;\n WAIT_%=:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra WAIT_%=;\n}\n" ::"r"(smem_addr(bar)), "r"(phase)
      : "memory");
#endif
}
// The box of `map` at (c0, c1, c2) (innermost first) into shared memory at `dst`; rows outside
// the tensor arrive as zeros. Before sm_90 (where the launchers never pick a tensor-map kernel)
// it traps rather than leave the tile unwritten.
__device__ __forceinline__ void tma_load_3d(void* dst, const TensorMap* map, int c0, int c1, int c2,
                                            uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
      "%3, %4}], [%5];\n" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(smem_addr(bar))
      : "memory");
#else
  __trap();
#endif
}
// An L2 eviction policy for tma_load_3d's `policy` (createpolicy): keep the lines for a later
// reader (`last`: evict_last), or back to the default priority at their last read.
__device__ __forceinline__ uint64_t l2_policy(bool last) {
  uint64_t p = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (last)
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(p));
  else
    asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;\n" : "=l"(p));
#endif
  return p;
}
// tma_load_3d with an L2 eviction priority for the lines it reads.
__device__ __forceinline__ void tma_load_3d(void* dst, const TensorMap* map, int c0, int c1, int c2,
                                            uint64_t* bar, uint64_t policy) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint "
      "[%0], [%1, {%2, %3, %4}], [%5], %6;\n" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(smem_addr(bar)), "l"(policy)
      : "memory");
#else
  __trap();
#endif
}

// ---- tensor cores: ldmatrix and mma.sync m16n8k16 (bf16/f16 in, f32 accumulate) ----
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t s) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], uint32_t s) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
}
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) { ldsm_x4(r, smem_addr(p)); }
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const void* p) {
  ldsm_x4_t(r, smem_addr(p));
}

// ---- wgmma (sm_90a; they trap elsewhere): D[64, 8·NJ] += A·B per warpgroup ----
// A (bf16) from registers, B from shared memory.
// Warp w of the warpgroup holds rows 16w.. of A and D in the m16n8k16 fragment layouts (the same
// `uint32_t[4]` A fragment and `float[NJ][4]` accumulator as Mma). B [K, 8·NJ] is described by
// `desc`, swizzled as the tensor-map copies land it (m2::swz), either K-major (TB = 0: rows of
// K) or N-major (TB = 1: rows of N, the B tile's rows being the K index).
//
// The descriptor of a B tile at shared address `addr` (the swizzle pattern 1024-byte aligned):
// rows of ROWB bytes (the swizzle width), eight-row groups ROWB·8 bytes apart, and — N-major
// with N beyond one row — `lbo` bytes between the row blocks of N.
template <int ROWB>
__device__ __forceinline__ uint64_t wgmma_desc(uint32_t addr, uint32_t lbo = 16) {
  constexpr uint64_t mode = ROWB == 128 ? 1 : ROWB == 64 ? 2 : 3;
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(lbo >> 4) << 16) |
         (static_cast<uint64_t>(ROWB * 8 >> 4) << 32) | (mode << 62);
}
// Tiles of 2-byte values in blocks of 64 columns, ROWS rows each, every row of 128 bytes swizzled
// (swz<128>, wgmma's 128-byte pattern): the element offset of (r, c), and the descriptor at
// (r, c) from `tile`, the descriptor of the tile's start (wgmma_desc<128>). For the descriptor the
// rows are M or N and c the K offset of a K-major operand, or the rows are K and c the M or N
// offset of an MN-major one (a range within one 64-column block either way). The offset, a
// multiple of 16 bytes, is added to the start's address field (its low 14 bits, 16-byte units):
// every shared address fits them, so nothing carries out, and no descriptor is built per K step.
template <int ROWS>
__device__ __forceinline__ int swz_blocks(int r, int c) {
  return (c >> 6) * ROWS * 64 + swz<128>(r, (c & 63) >> 3) + (c & 7);
}
template <int ROWS>
__device__ __forceinline__ uint64_t desc_at(uint64_t tile, int r, int c) {
  const uint32_t step = static_cast<uint32_t>(((c >> 6) * ROWS + r) * 128 + (c & 63) * 2) >> 4;
  return (tile & 0xffffffff00000000ull) | (static_cast<uint32_t>(tile) + step);
}
__device__ __forceinline__ void wgmma_fence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#else
  __trap();
#endif
}
// Waits until at most N of this warpgroup's committed wgmma groups are pending.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#else
  __trap();
#endif
}
// Keeps the compiler from moving the accumulators across the asynchronous wgmma.
template <int NJ>
__device__ __forceinline__ void wgmma_hold(float (&d)[NJ][4]) {
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e])::"memory");
}
template <int NJ>
struct Wgmma;
// Wgmma<NJ>::run<TB>: one `wgmma.mma_async m64n(8·NJ)k16` (bf16 → f32), the accumulators d as
// 4·NJ operands (DREGS), then A's four registers, the descriptor and TB (their operand numbers).
#define M2_D4(j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define M2_WGMMA(NJ, N, DREGS, AREGS, DESC, TB, ...)                                           \
  template <>                                                                                 \
  struct Wgmma<NJ> {                                                                          \
    template <int TB_>                                                                        \
    __device__ __forceinline__ static void run(float (&d)[NJ][4], const uint32_t (&a)[4],     \
                                               uint64_t desc) {                               \
      asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, 1, 0;\n"                               \
                   " wgmma.mma_async.sync.aligned.m64n" N "k16.f32.bf16.bf16 {" DREGS "},"      \
                   " {" AREGS "}, " DESC ", p, 1, 1, " TB ";\n}\n"                             \
                   : __VA_ARGS__                                                              \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(TB_));         \
    }                                                                                         \
  };
#else
#define M2_WGMMA(NJ, N, DREGS, AREGS, DESC, TB, ...)                                       \
  template <>                                                                             \
  struct Wgmma<NJ> {                                                                      \
    template <int TB_>                                                                    \
    __device__ __forceinline__ static void run(float (&)[NJ][4], const uint32_t (&)[4], uint64_t) { \
      __trap();                                                                           \
    }                                                                                     \
  };
#endif
M2_WGMMA(2, "16",
         "%0, %1, %2, %3, %4, %5, %6, %7",
         "%8, %9, %10, %11", "%12", "%13",
         M2_D4(0), M2_D4(1))
M2_WGMMA(4, "32",
         "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15",
         "%16, %17, %18, %19", "%20", "%21",
         M2_D4(0), M2_D4(1), M2_D4(2), M2_D4(3))
M2_WGMMA(8, "64",
         "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
         "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31",
         "%32, %33, %34, %35", "%36", "%37",
         M2_D4(0), M2_D4(1), M2_D4(2), M2_D4(3), M2_D4(4), M2_D4(5), M2_D4(6), M2_D4(7))
M2_WGMMA(16, "128",
         "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
         "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
         "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
         "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63",
         "%64, %65, %66, %67", "%68", "%69",
         M2_D4(0), M2_D4(1), M2_D4(2), M2_D4(3), M2_D4(4), M2_D4(5), M2_D4(6), M2_D4(7), M2_D4(8),
         M2_D4(9), M2_D4(10), M2_D4(11), M2_D4(12), M2_D4(13), M2_D4(14), M2_D4(15))
#undef M2_WGMMA

// WgmmaSS<NJ>::run<TA, TB>: one `wgmma.mma_async m64n(8·NJ)k16` (bf16 → f32) with both operands
// in shared memory, each by descriptor (wgmma_desc): A [64, K] K-major (TA = 0: rows of M) or
// M-major (TA = 1: rows of K), B as in Wgmma. `accumulate` 0 overwrites d (the first K step).
template <int NJ>
struct WgmmaSS;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define M2_WGMMA_SS(NJ, N, DREGS, A, B, ACC, TA, TB, ...)                                  \
  template <>                                                                                 \
  struct WgmmaSS<NJ> {                                                                        \
    template <int TA_, int TB_>                                                               \
    __device__ __forceinline__ static void run(float (&d)[NJ][4], uint64_t a, uint64_t b,     \
                                               int accumulate) {                              \
      asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, " ACC ", 0;\n"                         \
                   " wgmma.mma_async.sync.aligned.m64n" N "k16.f32.bf16.bf16 {" DREGS "}, " A  \
                   ", " B ", p, 1, 1, " TA ", " TB ";\n}\n"                                    \
                   : __VA_ARGS__                                                              \
                   : "l"(a), "l"(b), "r"(accumulate), "n"(TA_), "n"(TB_));                    \
    }                                                                                         \
  };
#else
#define M2_WGMMA_SS(NJ, N, DREGS, A, B, ACC, TA, TB, ...)                               \
  template <>                                                                             \
  struct WgmmaSS<NJ> {                                                                    \
    template <int TA_, int TB_>                                                           \
    __device__ __forceinline__ static void run(float (&)[NJ][4], uint64_t, uint64_t, int) { \
      __trap();                                                                           \
    }                                                                                     \
  };
#endif
M2_WGMMA_SS(4, "32",
            "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15",
            "%16", "%17", "%18", "%19", "%20",
            M2_D4(0), M2_D4(1), M2_D4(2), M2_D4(3))
M2_WGMMA_SS(8, "64",
            "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
            "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31",
            "%32", "%33", "%34", "%35", "%36",
            M2_D4(0), M2_D4(1), M2_D4(2), M2_D4(3), M2_D4(4), M2_D4(5), M2_D4(6), M2_D4(7))
#undef M2_WGMMA_SS
#undef M2_D4

// Two f32 values stored as a pair of T (one 8-, 4- or 4-byte store).
template <typename T> __device__ __forceinline__ void store2(T* p, float a, float b);
template <> __device__ __forceinline__ void store2<float>(float* p, float a, float b) {
  *reinterpret_cast<float2*>(p) = make_float2(a, b);
}
template <> __device__ __forceinline__ void store2<__nv_bfloat16>(__nv_bfloat16* p, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
}
template <> __device__ __forceinline__ void store2<__half>(__half* p, float a, float b) {
  *reinterpret_cast<__half2*>(p) = __floats2half2_rn(a, b);
}
// Two consecutive elements (p aligned to two of them) as f32.
template <typename T> __device__ __forceinline__ float2 load2(const T* p);
template <> __device__ __forceinline__ float2 load2<float>(const float* p) {
  return *reinterpret_cast<const float2*>(p);
}
template <> __device__ __forceinline__ float2 load2<__nv_bfloat16>(const __nv_bfloat16* p) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
}
template <> __device__ __forceinline__ float2 load2<__half>(const __half* p) {
  return __half22float2(*reinterpret_cast<const __half2*>(p));
}

template <typename T> struct Mma;
template <> struct Mma<__nv_bfloat16> {
  __device__ __forceinline__ static void run(float (&d)[4], const uint32_t (&a)[4],
                                             uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};
template <> struct Mma<__half> {
  __device__ __forceinline__ static void run(float (&d)[4], const uint32_t (&a)[4],
                                             uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};

// Elementwise product of two packed pairs of T.
template <typename T> __device__ __forceinline__ uint32_t mul2(uint32_t a, uint32_t b);
template <> __device__ __forceinline__ uint32_t mul2<__nv_bfloat16>(uint32_t a, uint32_t b) {
  const __nv_bfloat162 r = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&a),
                                   *reinterpret_cast<const __nv_bfloat162*>(&b));
  return *reinterpret_cast<const uint32_t*>(&r);
}
template <> __device__ __forceinline__ uint32_t mul2<__half>(uint32_t a, uint32_t b) {
  const __half2 r = __hmul2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b));
  return *reinterpret_cast<const uint32_t*>(&r);
}

// Transposes a 4×4 block of 32-bit words across the four lanes of a quad (lanes 4k..4k+3): lane s
// holds (s, 0..3) before and (0..3, s) after, in two butterfly stages (xor 1, xor 2) of two
// shuffles each.
__device__ __forceinline__ void quad_transpose(uint32_t (&a)[4], int lane) {
  const bool o1 = lane & 1, o2 = lane & 2;
  uint32_t r0 = __shfl_xor_sync(0xffffffffu, o1 ? a[0] : a[1], 1);
  uint32_t r1 = __shfl_xor_sync(0xffffffffu, o1 ? a[2] : a[3], 1);
  a[0] = o1 ? r0 : a[0];
  a[1] = o1 ? a[1] : r0;
  a[2] = o1 ? r1 : a[2];
  a[3] = o1 ? a[3] : r1;
  r0 = __shfl_xor_sync(0xffffffffu, o2 ? a[0] : a[2], 2);
  r1 = __shfl_xor_sync(0xffffffffu, o2 ? a[1] : a[3], 2);
  a[0] = o2 ? r0 : a[0];
  a[2] = o2 ? a[2] : r0;
  a[1] = o2 ? r1 : a[1];
  a[3] = o2 ? a[3] : r1;
}

// Eight consecutive values: loaded raw (16 bytes of bf16/f16, 32 of f32), unpacked to f32 at use;
// stored from f32.
template <typename T> struct Vec8;
template <> struct Vec8<float> {
  struct Raw {
    float4 a, b;
  };
  __device__ __forceinline__ static Raw load(const float* p, bool stream) {
    const float4* q = reinterpret_cast<const float4*>(p);
    return stream ? Raw{__ldcs(q), __ldcs(q + 1)} : Raw{q[0], q[1]};
  }
  __device__ __forceinline__ static void unpack(const Raw& u, float (&v)[8]) {
    v[0] = u.a.x; v[1] = u.a.y; v[2] = u.a.z; v[3] = u.a.w;
    v[4] = u.b.x; v[5] = u.b.y; v[6] = u.b.z; v[7] = u.b.w;
  }
  __device__ __forceinline__ static void store(float* p, const float (&v)[8]) {
    float4* q = reinterpret_cast<float4*>(p);
    q[0] = make_float4(v[0], v[1], v[2], v[3]);
    q[1] = make_float4(v[4], v[5], v[6], v[7]);
  }
};
template <typename H2, float2 (*TO)(H2)>
__device__ __forceinline__ void unpack8(const uint4& u, float (&v)[8]) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = TO(*reinterpret_cast<const H2*>(&w[i]));
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ float2 bf2f(__nv_bfloat162 v) { return __bfloat1622float2(v); }
__device__ __forceinline__ float2 h2f(__half2 v) { return __half22float2(v); }
template <typename T> struct Vec8Half {
  using Raw = uint4;
  __device__ __forceinline__ static Raw load(const T* p, bool stream) {
    const uint4* q = reinterpret_cast<const uint4*>(p);
    return stream ? __ldcs(q) : q[0];
  }
  __device__ __forceinline__ static void store(T* p, const float (&v)[8]) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const T lo = from_f<T>(v[2 * i]), hi = from_f<T>(v[2 * i + 1]);
      w[i] = static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&lo)) |
             (static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&hi)) << 16);
    }
    *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
  }
};
template <> struct Vec8<__nv_bfloat16> : Vec8Half<__nv_bfloat16> {
  __device__ __forceinline__ static void unpack(const Raw& u, float (&v)[8]) {
    unpack8<__nv_bfloat162, bf2f>(u, v);
  }
};
template <> struct Vec8<__half> : Vec8Half<__half> {
  __device__ __forceinline__ static void unpack(const Raw& u, float (&v)[8]) {
    unpack8<__half2, h2f>(u, v);
  }
};

}  // namespace m2
