//! Mamba-2 for Rust: the SSD and the rest of the mixer as candle custom ops ([`kernels`]), and
//! the Mamba-2 language model with checkpoint loading and generation ([`model`]).

pub use mamba2_kernels as kernels;
pub use mamba2_model as model;
