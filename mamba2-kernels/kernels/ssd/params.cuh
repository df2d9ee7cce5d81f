// The parameters of the SSD kernels, passed by value. Mirrored by `SsdParams` and `SsdSteps` in
// src/ssd/cuda/mod.rs; both sides assert the same sizes and offsets, so a drift fails the build.
#pragma once
#include "common.cuh"

namespace m2 {

// The problem's dimensions and the launch's choices; every SSD kernel takes the whole struct.
struct SsdParams {
  int batch, seqlen, nheads, headdim, ngroups, dstate, chunk, nchunks;
  // compute_out: heads per program; D per channel (1) or per head (0).
  int heads_per_block, d_per_channel;
  // compute_out: 1 when the kernel before it on the stream is the state pass's last, which wrote
  // only the states: b, c, dt, da and D are read (and C·Bᵀ formed) before waiting on it.
  int early;
  // compute_out: 1 when the states are the SSD's own intermediates, read by this kernel only:
  // each state tile's L2 lines are dropped once it has landed, so they are never written back.
  int discard_states;
  // state_scan: the chunk from which it lets the next kernel on the stream (compute_out) start.
  int release_at;
  // The state pass over sequences packed along L (batch 1): sequence s takes the chunks
  // [seq_chunks[s], seq_chunks[s+1]), starts from row s of init and ends in row s of last (its
  // programs are rows s·nheads + h); the slot after its last chunk is not written, since it is the
  // next sequence's first. Null (seqs 0): every batch row one sequence, every slot written.
  int seqs;
  const int* seq_chunks;
  // Sequences packed along L with boundaries anywhere: chunk c covers tokens
  // [chunk_starts[c], chunk_starts[c+1]) (at most `chunk`, never across a sequence's end), so
  // that no chunk mixes two sequences. Null: chunk c covers [c·chunk, min((c+1)·chunk, seqlen)).
  const int* chunk_starts;
};
M2_SIZE(SsdParams, 72);
M2_AT(SsdParams, batch, 0);
M2_AT(SsdParams, seqlen, 4);
M2_AT(SsdParams, nheads, 8);
M2_AT(SsdParams, headdim, 12);
M2_AT(SsdParams, ngroups, 16);
M2_AT(SsdParams, dstate, 20);
M2_AT(SsdParams, chunk, 24);
M2_AT(SsdParams, nchunks, 28);
M2_AT(SsdParams, heads_per_block, 32);
M2_AT(SsdParams, d_per_channel, 36);
M2_AT(SsdParams, early, 40);
M2_AT(SsdParams, discard_states, 44);
M2_AT(SsdParams, release_at, 48);
M2_AT(SsdParams, seqs, 52);
M2_AT(SsdParams, seq_chunks, 56);
M2_AT(SsdParams, chunk_starts, 64);

// Chunk c's first token l0 and its length len (see chunk_starts).
__device__ __forceinline__ void chunk_span(const SsdParams& d, int c, int& l0, int& len) {
  if (d.chunk_starts) {
    l0 = d.chunk_starts[c];
    len = d.chunk_starts[c + 1] - l0;
  } else {
    l0 = c * d.chunk;
    len = min(d.chunk, d.seqlen - l0);
  }
}

// Stage 1's inputs and outputs (chunk_cumsum, and chunk_state_mma's `_cs` forms): raw dt of the
// value type with token rows `dt_stride` elements apart, a [H] and bias [H] (null: none) f32,
// out = [dt_out; da_cumsum], each [B,H,L] f32; dt ← clamp(softplus(dt + bias), lo, hi).
struct SsdSteps {
  const void* dt;
  const float* a;
  const float* bias;
  float* out;
  long dt_stride;
  int softplus;
  float lo, hi;
};
M2_SIZE(SsdSteps, 56);
M2_AT(SsdSteps, dt, 0);
M2_AT(SsdSteps, a, 8);
M2_AT(SsdSteps, bias, 16);
M2_AT(SsdSteps, out, 24);
M2_AT(SsdSteps, dt_stride, 32);
M2_AT(SsdSteps, softplus, 40);
M2_AT(SsdSteps, lo, 44);
M2_AT(SsdSteps, hi, 48);

}  // namespace m2
