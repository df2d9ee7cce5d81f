//! The Mamba-2 language model on the `mamba2-kernels` ops: configuration ([`Config`], both
//! `config.json` formats), checkpoint loading ([`Checkpoint`]: safetensors, sharded or not, and
//! PyTorch pickles), the model ([`Model`]: prefill in bounded pieces and one-token decode over a
//! [`Cache`]; with `cuda`, `DecodeGraph` replays a decode step as a CUDA graph) and text
//! generation ([`Generator`]; [`Batch`] for many prompts at once, with continuous batching; with
//! [`Sampler`] and the UTF-8-safe [`TextStream`]); [`hub`] downloads model directories from the
//! Hugging Face Hub.
//!
//! Bad input is an error, not a panic nor wrong numbers: token ids are checked against the
//! vocabulary before any kernel runs, sampling parameters when a [`Sampler`] or [`Generator`] is
//! made, and logits that are not finite stop generation with an error naming the step. One
//! [`Model`] may serve many threads, each with its own [`Cache`]; the rules for moving work
//! between threads on CUDA are under "Threads" on [`Model`].

mod batch;
mod cache;
mod checkpoint;
mod config;
mod generator;
#[cfg(feature = "cuda")]
mod graph;
#[cfg(feature = "hub")]
pub mod hub;
mod mixer;
mod model;
mod packing;
mod sampler;
mod text_stream;
mod tokenizer;
mod train;

pub use batch::Batch;
pub use cache::{Cache, LayerState};
pub use checkpoint::{Checkpoint, PYTORCH_BIN, SAFETENSORS, SHARD_INDEX};
pub use config::{Config, ConfigFormat};
pub use generator::{eos_token_ids, Generation, GenerationConfig, Generator, StopReason};
#[cfg(feature = "cuda")]
pub use graph::DecodeGraph;
pub use mixer::Mixer;
pub use model::{Model, DEFAULT_PREFILL_PIECE_LEN};
pub use sampler::{Sampler, SamplingParams};
pub use text_stream::TextStream;
pub use tokenizer::{byte_tokenizer, id_tokenizer, load_tokenizer, BYTE_VOCAB};
pub use tokenizers::Tokenizer;
pub use train::TrainableModel;
