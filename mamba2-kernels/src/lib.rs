//! The Mamba-2 SSD (state-space duality) as candle custom ops.
//!
//! Recurrence, per batch `b` and head `h` (state `h_t ∈ R^{P×N}`):
//!
//! ```text
//! h_t = exp(a·dt_t)·h_{t-1} + dt_t · x_t B_tᵀ        y_t = h_t C_t + D·x_t   (· silu(z_t))
//! ```
//!
//! Prefill runs the chunked (SSD) form: [`ssd`] is one op, and its three stages are ops too —
//! [`chunk_cumsum`] (dt processing and per-chunk cumulative sums of `a·dt`, in log2 space),
//! [`fwd_pass_state`] (the state entering every chunk, by the jump formula) and
//! [`compute_out`] (the three terms of the output, fused). Decoding one token is [`ssd_step`],
//! which updates the state in place.
//!
//! Layouts: `x [B,L,H,P]`, `dt [B,L,H]`, `a [H]` (f32), `b, c [B,L,G,N]` (head `h` reads group
//! `h / (H/G)`), `z [B,L,H,P]`, `D [H]` or `[H,P]`, states `[B,H,P,N]`, chunk states
//! `[B,H,C+1,P,N]`. Values are f32, f16 or bf16; arithmetic accumulates in f32. On the CPU the
//! ops also take f64 values (and f64 states) and compute in f64, for gradient checks.
//! [`reference`](mod@reference) holds the sequential f64 recurrence that every implementation is tested against.
//!
//! The rest of the mixer and block has ops of its own: [`causal_conv1d`] / [`causal_conv1d_step`]
//! (depthwise causal conv with its rolling state, fused SiLU), [`gated_rms_norm`] (the per-group
//! `norm(y·silu(z))`), [`add_rms_norm`] (residual add + RMSNorm) and [`matvec`] (a linear layer on
//! a few rows: the projections of a decode step, at close to copy bandwidth on CUDA). Training
//! adds [`cross_entropy`] (the loss, one pass over the logits each way), [`linear_cross_entropy`]
//! (the output layer's product and the loss as one op) and [`embedding`] (the lookup, whose CUDA
//! backward is a scatter-add).
//!
//! With the `timeline` feature the CUDA kernels record when their blocks pass a few marks, and
//! `ssd_timeline` gives one call's timeline (`bench_ssd --cuda --timeline`).
//!
//! Every op family has one name at every level: its module here (`ssd`, `ssd_step`, `conv`,
//! `norm`, `matvec`, `loss`, `embedding`: the op structs, the public functions and their docs), its CPU code
//! (`<family>/cpu.rs`), its CUDA launcher (`<family>/cuda.rs`, or `ssd/cuda/<stage>.rs`), the
//! launch choices it makes as pure, unit-tested functions (`<family>/plan.rs`) and its kernels
//! (`kernels/<family>/*.cu`, with the kernel parameter structs in `kernels/<family>/params.cuh`). `instances.rs` lists every
//! kernel for build.rs and the launchers alike; `cuda/` is the CUDA plumbing the families share.

mod check;
mod conv;
mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
mod dt;
mod embedding;
mod fastexp;
// The list itself serves build.rs and the tests; the launchers take only the names.
#[cfg_attr(not(test), allow(dead_code))]
mod instances;
mod loss;
mod matvec;
mod norm;
pub mod reference;
mod rows;
mod seqs;
mod slot;
mod ssd;
mod ssd_step;

pub use check::{cu_seqlens as check_cu_seqlens, MAX_CHUNK_SIZE, MAX_DIM};
pub use conv::{
    causal_conv1d, causal_conv1d_backward, causal_conv1d_split, causal_conv1d_split_backward,
    causal_conv1d_split_backward_into, causal_conv1d_split_packed, causal_conv1d_step,
    causal_conv1d_step_split, ConvGrads, ConvOptions,
};
#[cfg(feature = "cuda")]
pub use cuda::set_poison;
pub use dt::DtOptions;
pub use embedding::embedding;
pub use loss::{cross_entropy, linear_cross_entropy};
pub use matvec::matvec;
pub use norm::{
    add_rms_norm, add_rms_norm_backward, gated_rms_norm, gated_rms_norm_backward,
    gated_rms_norm_backward_into, AddNormGrads,
};
pub use rows::{scatter_rows, RowIndex};
pub use ssd::{
    chunk_cumsum, compute_out, fwd_pass_state, ssd, ssd_backward, ssd_backward_saved, ssd_packed,
    ssd_saving, ssd_xbc, SsdGrads, SsdOptions, SsdSaved,
};
#[cfg(feature = "timeline")]
pub use ssd::{ssd_timeline, ssd_timeline_reset, TimelineMark};
pub use ssd_step::{ssd_step, StepOptions};
