//! The Mamba-2 language model (mamba_ssm's `MambaLMHeadModel`, HF's `Mamba2ForCausalLM`):
//!
//! ```text
//! h = embedding(ids);  r = none
//! for each layer:  (n, r) = add_rms_norm(h, r, norm);  h = mixer(n)
//! logits = lm_head(add_rms_norm(h, r, norm_f))          lm_head = embedding when tied
//! ```
//!
//! The residual stream `r` is f32 when `residual_in_fp32`, else the model dtype; logits are
//! returned in f32. Keys: HF `backbone.embeddings.weight` or state-spaces `backbone.embedding.weight`,
//! `backbone.layers.{i}.norm.weight`, `backbone.layers.{i}.mixer.*`, `backbone.norm_f.weight`,
//! `lm_head.weight` (read only when untied). Prompts are run in pieces of at most
//! [`Model::prefill_piece_len`] tokens, carrying the state from piece to piece, so activation
//! memory does not grow with the prompt.

use std::path::Path;

use candle_core::{bail, DType, Device, IndexOp, Module, Result, Tensor};
use candle_nn::{Embedding, Linear, VarBuilder};
use mamba2_kernels::add_rms_norm;

use crate::cache::Cache;
use crate::checkpoint::Checkpoint;
use crate::mixer::{decode_linear, Mixer};
use crate::Config;

/// Prompt tokens per piece unless set otherwise.
pub const DEFAULT_PREFILL_PIECE_LEN: usize = 2048;

const EMBEDDING_HF: &str = "backbone.embeddings.weight";
const EMBEDDING_ORIGINAL: &str = "backbone.embedding.weight";

/// One block: pre-norm weight and mixer.
#[derive(Debug)]
struct Block {
    norm: Tensor,
    mixer: Mixer,
}

/// A Mamba-2 language model with its weights on one device in one dtype.
///
/// A prompt prefilled and then continued by a decode step gives the logits of one pass over the
/// whole sequence; here with the small model shipped in the repository's `weights/`:
///
/// ```
/// use candle_core::{DType, Device, IndexOp, Tensor};
/// use mamba2_model::Model;
///
/// let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../weights");
/// let model = Model::load(dir, DType::F32, &Device::Cpu)?;
/// let ids = Tensor::new(&[[5u32, 17, 260, 31]], model.device())?;
///
/// // Every position at once: logits [B, L, V].
/// let all = model.forward(&ids, &mut model.new_cache(1)?)?;
/// assert_eq!(all.dims(), [1, 4, model.config().vocab_size]);
///
/// // The first three tokens as the prompt, then the fourth as one decode step.
/// let mut cache = model.new_cache(1)?;
/// model.prefill(&ids.i((.., ..3))?, &mut cache)?;
/// let next = model.step(&ids.i((.., 3))?, &mut cache)?;
/// assert_eq!(cache.tokens(), 4);
/// let diff: f32 = (next - all.i((.., 3))?)?.abs()?.max_all()?.to_scalar()?;
/// assert!(diff < 1e-3, "decode departs from the full pass by {diff}");
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug)]
pub struct Model {
    config: Config,
    embedding: Embedding,
    blocks: Vec<Block>,
    norm_f: Tensor,
    lm_head: Linear,
    dtype: DType,
    device: Device,
    piece_len: usize,
}

impl Model {
    /// Builds the model of `config` from `vb` (whose dtype and device the model takes).
    pub fn new(config: &Config, vb: VarBuilder) -> Result<Self> {
        config.validate()?;
        match vb.dtype() {
            DType::F32 | DType::F16 | DType::BF16 => {}
            dt => bail!("model dtype must be f32, f16 or bf16, got {dt:?}"),
        }
        let (v, d) = (config.vocab_size, config.d_model);
        let name = if vb.contains_tensor(EMBEDDING_HF) || !vb.contains_tensor(EMBEDDING_ORIGINAL) {
            EMBEDDING_HF
        } else {
            EMBEDDING_ORIGINAL
        };
        let embedding = vb.get((v, d), name).map_err(|e| {
            if vb.contains_tensor(name) {
                e
            } else {
                candle_core::Error::msg(format!(
                    "missing embedding: neither {EMBEDDING_HF} (HF) nor {EMBEDDING_ORIGINAL} \
                     (state-spaces) is in the checkpoint"
                ))
            }
        })?;
        let lm_head = if config.tie_embeddings {
            embedding.clone()
        } else {
            vb.get((v, d), "lm_head.weight")?
        };
        let layers = vb.pp("backbone.layers");
        let blocks = (0..config.n_layer)
            .map(|i| {
                let vb = layers.pp(i);
                Ok(Block {
                    norm: vb.get(d, "norm.weight")?,
                    mixer: Mixer::new(config, vb.pp("mixer"))?,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            config: config.clone(),
            embedding: Embedding::new(embedding, d),
            blocks,
            norm_f: vb.get(d, "backbone.norm_f.weight")?,
            lm_head: Linear::new(lm_head, None),
            dtype: vb.dtype(),
            device: vb.device().clone(),
            piece_len: DEFAULT_PREFILL_PIECE_LEN,
        })
    }

    /// Loads `dir/config.json` and the checkpoint of `dir` (see [`Checkpoint`]) in `dtype` on
    /// `device`. Every stored tensor must be used (a tied `lm_head.weight` may be stored too), so
    /// that a config that does not describe the weights is an error, not a silently wrong model.
    pub fn load(dir: impl AsRef<Path>, dtype: DType, device: &Device) -> Result<Self> {
        let dir = dir.as_ref();
        if !dir.is_dir() {
            bail!("model directory {} does not exist", dir.display())
        }
        let config = Config::from_file(dir.join("config.json"))?;
        let checkpoint = Checkpoint::open(dir)?;
        let model = Self::new(&config, checkpoint.var_builder(dtype, device))?;
        let unread: Vec<String> = checkpoint
            .unread()?
            .into_iter()
            .filter(|n| !(config.tie_embeddings && n == "lm_head.weight"))
            .collect();
        if !unread.is_empty() {
            let more = if unread.len() > 8 { ", ..." } else { "" };
            bail!(
                "{} has {} tensors that the config does not use (n_layer {}, use_bias {}, \
                 use_conv_bias {}, tied embeddings {}): {}{more}",
                checkpoint.source(),
                unread.len(),
                config.n_layer,
                config.bias,
                config.conv_bias,
                config.tie_embeddings,
                unread[..unread.len().min(8)].join(", ")
            )
        }
        Ok(model)
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The longest run of prompt tokens processed at once.
    pub fn prefill_piece_len(&self) -> usize {
        self.piece_len
    }

    /// Sets the longest run of prompt tokens processed at once (≥ 1); results do not depend on it.
    pub fn set_prefill_piece_len(&mut self, len: usize) -> Result<()> {
        if len == 0 {
            bail!("prefill piece length must be >= 1")
        }
        self.piece_len = len;
        Ok(())
    }

    /// An empty cache for `batch` sequences.
    pub fn new_cache(&self, batch: usize) -> Result<Cache> {
        Cache::new(&self.config, batch, self.dtype, &self.device)
    }

    /// The logits `[B,L,V]` (f32) of every position of `ids [B,L]`, continuing from `cache`.
    pub fn forward(&self, ids: &Tensor, cache: &mut Cache) -> Result<Tensor> {
        let mut logits = Vec::new();
        self.pieces(ids, cache, |h| {
            logits.push(self.logits(h)?);
            Ok(())
        })?;
        Tensor::cat(&logits, 1)
    }

    /// Feeds the prompt `ids [B,L]` through `cache` and returns the logits `[B,V]` (f32) after its
    /// last token.
    pub fn prefill(&self, ids: &Tensor, cache: &mut Cache) -> Result<Tensor> {
        let mut last = None;
        self.pieces(ids, cache, |h| {
            let l = h.dim(1)?;
            last = Some(h.i((.., l - 1))?.contiguous()?);
            Ok(())
        })?;
        match last {
            Some(h) => self.logits(&h),
            None => bail!("prefill needs at least one token"),
        }
    }

    /// Feeds one token per sequence, `ids [B]`, and returns the next-token logits `[B,V]` (f32).
    pub fn step(&self, ids: &Tensor, cache: &mut Cache) -> Result<Tensor> {
        let logits = self.step_logits(ids, cache)?;
        cache.advance(1);
        Ok(logits)
    }

    /// [`Model::step`] without counting the token in `cache` (a captured step counts per replay).
    pub(crate) fn step_logits(&self, ids: &Tensor, cache: &mut Cache) -> Result<Tensor> {
        let batch = match ids.dims() {
            &[b] => b,
            d => bail!("step: ids must have shape [B], got {d:?}"),
        };
        cache.check(&self.config, batch, self.dtype, &self.device)?;
        let mut h = self.embedding.forward(ids)?;
        let mut residual = None;
        for (block, state) in self.blocks.iter().zip(cache.layers_mut()) {
            let (normed, r) = self.norm(&h, residual.as_ref(), &block.norm)?;
            residual = Some(r);
            h = block.mixer.step(&normed, state)?;
        }
        let (h, _) = self.norm(&h, residual.as_ref(), &self.norm_f)?;
        decode_linear(&self.lm_head, &h)?.to_dtype(DType::F32)
    }

    fn norm(
        &self,
        x: &Tensor,
        residual: Option<&Tensor>,
        weight: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        add_rms_norm(
            x,
            residual,
            weight,
            self.config.norm_eps,
            self.config.residual_in_fp32,
        )
    }

    /// Runs `ids [B,L]` in pieces through the blocks and calls `f` with the final normalised
    /// hidden states `[B,l,d_model]` of each piece.
    fn pieces(
        &self,
        ids: &Tensor,
        cache: &mut Cache,
        mut f: impl FnMut(&Tensor) -> Result<()>,
    ) -> Result<()> {
        let (batch, len) = match ids.dims() {
            &[b, l] if l > 0 => (b, l),
            d => bail!("ids must have shape [B, L] with L >= 1, got {d:?}"),
        };
        cache.check(&self.config, batch, self.dtype, &self.device)?;
        for start in (0..len).step_by(self.piece_len) {
            let n = self.piece_len.min(len - start);
            let mut h = self.embedding.forward(&ids.narrow(1, start, n)?)?;
            let mut residual = None;
            for (block, state) in self.blocks.iter().zip(cache.layers_mut()) {
                let (normed, r) = self.norm(&h, residual.as_ref(), &block.norm)?;
                residual = Some(r);
                h = block.mixer.forward(&normed, state)?;
            }
            let (h, _) = self.norm(&h, residual.as_ref(), &self.norm_f)?;
            cache.advance(n);
            f(&h)?;
        }
        Ok(())
    }

    fn logits(&self, h: &Tensor) -> Result<Tensor> {
        self.lm_head.forward(h)?.to_dtype(DType::F32)
    }
}
