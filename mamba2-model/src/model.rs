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
//!
//! Token ids are checked against the vocabulary before any kernel runs: an id outside
//! `0..vocab_size` is an error naming it and its position, never an index into the embedding
//! (on CUDA an out-of-range index is a device-side assert that ends every later CUDA call of the
//! process; on the CPU candle embeds the largest id of each index type as zeros).

mod grad;

use std::path::Path;

use candle_core::{bail, DType, Device, IndexOp, Module, Result, Tensor, D};
use candle_nn::{Linear, VarBuilder};
use mamba2_kernels::{add_rms_norm, cross_entropy, embedding, linear_cross_entropy, scatter_rows};

use crate::cache::Cache;
use crate::checkpoint::{Checkpoint, ModelDir};
use crate::mixer::{decode_linear, rows_linear, Mixer};
use crate::packing::{Packing, GROUP_COST};
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
/// # Threads
///
/// `Model` is `Send + Sync`, and running it changes nothing in it (every run takes `&self`): one
/// model may serve many threads at once (`&Model` in scoped threads, or `Arc<Model>`), each
/// thread with its own [`Cache`] (a cache is `&mut` in every call, so two threads cannot step one
/// cache). [`Model::new`] and [`Model::load`] synchronise the device before returning, so the
/// uploaded weights are complete whichever thread uses them first. On CUDA (a device from
/// `Device::new_cuda`) candle queues each thread's work on that thread's own default stream, and
/// nothing orders one thread's stream after another's: a tensor or cache that one thread has
/// written must be synchronised by that thread (reading a result back does it, as do
/// [`Cache::synchronize`] and `Device::synchronize`) before another thread uses or drops it, and
/// each thread synchronises before it lets go of a shared model, whose last owner frees it.
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
    /// `[V, d_model]`.
    embedding: Tensor,
    blocks: Vec<Block>,
    norm_f: Tensor,
    lm_head: Linear,
    dtype: DType,
    device: Device,
    piece_len: usize,
}

impl Model {
    /// Builds the model of `config` from `vb` (whose dtype and device the model takes); the device
    /// is synchronised before the model is returned (see the thread rules on [`Model`]).
    pub fn new(config: &Config, vb: VarBuilder) -> Result<Self> {
        let model = Self::new_unsynchronized(config, vb)?;
        // Weights are uploaded and A = −exp(A_log) computed on this thread's stream: waiting for
        // them lets any other thread use the model at once.
        model.device.synchronize()?;
        Ok(model)
    }

    /// [`Model::new`] without the wait for the device, for a model that the thread which built it
    /// uses (its work is ordered after the building on that thread's stream).
    pub(crate) fn new_unsynchronized(config: &Config, vb: VarBuilder) -> Result<Self> {
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
            embedding,
            blocks,
            norm_f: vb.get(d, "backbone.norm_f.weight")?,
            lm_head: Linear::new(lm_head, None),
            dtype: vb.dtype(),
            device: vb.device().clone(),
            piece_len: DEFAULT_PREFILL_PIECE_LEN,
        })
    }

    /// Loads `dir/config.json` and the checkpoint of `dir` (see [`Checkpoint`]) in `dtype` on
    /// `device`; config.json, like the weight files, must lie inside `dir` once symlinks are
    /// resolved. Every stored tensor must be used (a tied `lm_head.weight` may be stored too), so
    /// that a config that does not describe the weights is an error, not a silently wrong model.
    /// The device is synchronised before the model is returned, as by [`Model::new`].
    pub fn load(dir: impl AsRef<Path>, dtype: DType, device: &Device) -> Result<Self> {
        let dir = dir.as_ref();
        if !dir.is_dir() {
            bail!("model directory {} does not exist", dir.display())
        }
        // config.json obeys the checkpoint's rule for its files: inside the model directory once
        // symlinks are resolved, so that a link cannot make the model read a file from elsewhere.
        let config_file = ModelDir::new(dir)?.resolve("config.json", "config", "")?;
        let config = Config::read(&config_file, &dir.join("config.json"))?;
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
    ///
    /// `ids` are u8, u32 or i64 on the model's device, each in `0..vocab_size` (checked first, on
    /// the host; see [`Model::step`] for what that costs on CUDA).
    pub fn forward(&self, ids: &Tensor, cache: &mut Cache) -> Result<Tensor> {
        self.forward_checked(&self.checked_ids(ids)?, cache)
    }

    /// [`Model::forward`] of ids already known to be u32 or i64 and inside the vocabulary.
    fn forward_checked(&self, ids: &Tensor, cache: &mut Cache) -> Result<Tensor> {
        let mut logits = Vec::new();
        self.pieces(ids, cache, |h| {
            logits.push(self.logits(h)?);
            Ok(())
        })?;
        Tensor::cat(&logits, 1)
    }

    /// Feeds the prompt `ids [B,L]` through `cache` and returns the logits `[B,V]` (f32) after its
    /// last token. `ids` are checked as by [`Model::forward`].
    pub fn prefill(&self, ids: &Tensor, cache: &mut Cache) -> Result<Tensor> {
        let ids = self.checked_ids(ids)?;
        self.prefill_checked(&ids, cache)
    }

    /// [`Model::prefill`] of ids already known to be u32 or i64 and inside the vocabulary.
    pub(crate) fn prefill_checked(&self, ids: &Tensor, cache: &mut Cache) -> Result<Tensor> {
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

    /// Prefills the prompts from empty states, all at once: on CUDA packed back to back in one row
    /// (each layer's conv and scan one launch for every prompt, restarting at each); on the CPU in
    /// groups of similar lengths, each group one batch through the whole model whose shorter rows
    /// are padded at their ends with steps that change nothing (a dt of exactly 0; a model with a
    /// dt_limit above 0, where that cannot be, runs the packed row there too). Returns the logits
    /// `[S,V]` (f32) after each prompt's last token and a cache
    /// of S rows, each prompt's state, as if each were prefilled alone. Every id is checked
    /// against the vocabulary first. The whole pack runs at once (no bounded pieces): split a
    /// very large set of prompts into several calls and [`Cache::join`] their caches.
    ///
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// use mamba2_model::Model;
    ///
    /// let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../weights");
    /// let model = Model::load(dir, DType::F32, &Device::Cpu)?;
    /// let prompts: [&[u32]; 2] = [&[5, 17, 260], &[31]];
    /// let (logits, cache) = model.prefill_packed(&prompts)?;
    /// assert_eq!((logits.dims(), cache.row_tokens()), (&[2, 8192][..], &[3, 1][..]));
    /// // The first prompt alone.
    /// let mut alone = model.new_cache(1)?;
    /// let first = model.prefill(&Tensor::new(&[[5u32, 17, 260]], &Device::Cpu)?, &mut alone)?;
    /// let diff = (logits.narrow(0, 0, 1)? - first)?.abs()?.max_all()?.to_scalar::<f32>()?;
    /// assert!(diff < 1e-4, "{diff}");
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn prefill_packed(&self, prompts: &[&[u32]]) -> Result<(Tensor, Cache)> {
        if prompts.is_empty() {
            bail!("prefill_packed: no prompts")
        }
        let mut cu = Vec::with_capacity(prompts.len() + 1);
        cu.push(0);
        for (i, p) in prompts.iter().enumerate() {
            if p.is_empty() {
                bail!("prefill_packed: prompt {i} has no tokens")
            }
            let ids = p.iter().map(|&t| i64::from(t));
            check_vocab(
                ids,
                &[p.len()],
                &format!("prompts[{i}]"),
                self.config.vocab_size,
            )?;
            cu.push(cu[i] + p.len());
        }
        let mut flat: Vec<u32> = prompts.iter().flat_map(|p| p.iter().copied()).collect();
        let mut cache = self.new_cache(prompts.len())?;
        let packing = match self.blocks.first() {
            Some(block) => block.mixer.packing(&cu, GROUP_COST, &self.device)?,
            None => None,
        };
        let h = match packing {
            Some(packing) => {
                // Every pad reads token 0 (one past the packed tokens): its values are never used.
                flat.push(0);
                let ids = Tensor::new(flat.as_slice(), &self.device)?;
                self.prefill_groups(&ids, &packing, &mut cache)?
            }
            None => {
                let ids = Tensor::new(flat.as_slice(), &self.device)?.unsqueeze(0)?;
                self.prefill_row(&ids, &cu, &mut cache)?
            }
        };
        let lengths: Vec<usize> = prompts.iter().map(|p| p.len()).collect();
        cache.advance_rows(&lengths);
        Ok((self.logits(&h)?, cache))
    }

    /// The final norm's output at each sequence's last token, `[S, d_model]`, of the groups of
    /// `packing` run through the whole model one after the other, each a `[rows, longest]` batch
    /// of its sequences padded at their ends (`crate::packing`); every layer's states after each
    /// sequence's last token are written to its row of `cache` as the group's layer ends. `ids`
    /// holds the packed tokens and, last, the pads' token.
    fn prefill_groups(&self, ids: &Tensor, packing: &Packing, cache: &mut Cache) -> Result<Tensor> {
        let (mut lasts, mut residuals) = (Vec::new(), Vec::new());
        for g in &packing.groups {
            let rows_ids = ids.index_select(&g.gather, 0)?.reshape((g.rows, g.len))?;
            let mut h = self.embed(&rows_ids)?;
            let mut residual = None;
            for (block, state) in self.blocks.iter().zip(cache.layers_mut()) {
                let (normed, r) = self.norm(&h, residual.as_ref(), &block.norm)?;
                residual = Some(r);
                let (out, conv, ssm) = block.mixer.forward_rows(&normed, g)?;
                scatter_rows(&state.conv, &conv, &g.members)?;
                scatter_rows(&state.ssm, &ssm, &g.members)?;
                h = out;
            }
            let pick = |t: &Tensor| {
                let d = t.dim(2)?;
                t.reshape((g.rows * g.len, d))?.index_select(&g.last, 0)
            };
            lasts.push(pick(&h)?);
            residuals.push(residual.as_ref().map(pick).transpose()?);
        }
        // The last rows back from the groups' order to the sequences'.
        let back = |parts: &[Tensor]| Tensor::cat(parts, 0)?.index_select(&packing.states_back, 0);
        let residual = residuals
            .into_iter()
            .collect::<Option<Vec<_>>>()
            .map(|r| back(&r))
            .transpose()?;
        Ok(self
            .norm(&back(&lasts)?, residual.as_ref(), &self.norm_f)?
            .0)
    }

    /// The packed row `ids [1, T]` through every layer, the conv and the scan restarting at every
    /// sequence (CUDA, and a model whose pads cannot be made inert: a dt_limit above 0).
    fn prefill_row(&self, ids: &Tensor, cu: &[usize], cache: &mut Cache) -> Result<Tensor> {
        let mut h = self.embed(ids)?;
        let mut residual = None;
        for (block, state) in self.blocks.iter().zip(cache.layers_mut()) {
            let (normed, r) = self.norm(&h, residual.as_ref(), &block.norm)?;
            residual = Some(r);
            h = block.mixer.forward_packing(&normed, cu, None, state)?;
        }
        let last: Vec<u32> = cu[1..].iter().map(|&e| (e - 1) as u32).collect();
        let last = Tensor::new(last.as_slice(), &self.device)?;
        let pick = |t: &Tensor| t.squeeze(0)?.index_select(&last, 0);
        let residual = residual.as_ref().map(pick).transpose()?;
        Ok(self.norm(&pick(&h)?, residual.as_ref(), &self.norm_f)?.0)
    }

    /// Feeds one token per sequence, `ids [B]`, and returns the next-token logits `[B,V]` (f32).
    ///
    /// The ids are checked against the vocabulary on the host before any kernel runs. On CUDA that
    /// reads the B ids back: one small copy that waits for the work this thread queued before it
    /// (next to nothing once the previous step's logits have been read). [`crate::Generator`] and
    /// `DecodeGraph` take ids from the host and check them there, at no device cost.
    pub fn step(&self, ids: &Tensor, cache: &mut Cache) -> Result<Tensor> {
        let ids = self.checked_ids(ids)?;
        self.step_checked(&ids, cache)
    }

    /// [`Model::step`] of ids already known to be u32 or i64 and inside the vocabulary.
    pub(crate) fn step_checked(&self, ids: &Tensor, cache: &mut Cache) -> Result<Tensor> {
        let logits = self.step_logits(ids, cache)?;
        cache.advance(1);
        Ok(logits)
    }

    /// [`Model::step_checked`] without counting the token in `cache` (a captured step counts per
    /// replay). The ids are not checked: a captured step cannot read them back, so the graph
    /// checks them on the host before it writes them to its buffer.
    pub(crate) fn step_logits(&self, ids: &Tensor, cache: &mut Cache) -> Result<Tensor> {
        let batch = match ids.dims() {
            &[b] => b,
            d => bail!("step: ids must have shape [B], got {d:?}"),
        };
        cache.check(&self.config, batch, self.dtype, &self.device)?;
        let mut h = self.embed(ids)?;
        let mut residual = None;
        for (block, state) in self.blocks.iter().zip(cache.layers_mut()) {
            let (normed, r) = self.norm(&h, residual.as_ref(), &block.norm)?;
            residual = Some(r);
            h = block.mixer.step(&normed, state)?;
        }
        let (h, _) = self.norm(&h, residual.as_ref(), &self.norm_f)?;
        decode_linear(&self.lm_head, &h)?.to_dtype(DType::F32)
    }

    /// `ids` ([B] or [B,L]) after checking its dtype, device and every id against the
    /// vocabulary; u8 ids come back as u32, as candle's embedding turns the largest id of an
    /// index type (255 for u8) into a row of zeros.
    fn checked_ids(&self, ids: &Tensor) -> Result<Tensor> {
        if !ids.device().same_device(&self.device) {
            bail!(
                "ids are on {:?} but the model is on {:?}",
                ids.device(),
                self.device
            )
        }
        let host = ids.to_device(&Device::Cpu)?.flatten_all()?;
        let vocab = self.config.vocab_size;
        match ids.dtype() {
            DType::U8 => {
                let v = host.to_vec1::<u8>()?;
                check_vocab(v.iter().map(|&t| i64::from(t)), ids.dims(), "ids", vocab)?;
                ids.to_dtype(DType::U32)
            }
            DType::U32 => {
                let v = host.to_vec1::<u32>()?;
                check_vocab(v.iter().map(|&t| i64::from(t)), ids.dims(), "ids", vocab)?;
                Ok(ids.clone())
            }
            DType::I64 => {
                let v = host.to_vec1::<i64>()?;
                check_vocab(v.iter().copied(), ids.dims(), "ids", vocab)?;
                Ok(ids.clone())
            }
            dt => bail!("ids must be u8, u32 or i64, got {dt:?}"),
        }
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
            let mut h = self.embed(&ids.narrow(1, start, n)?)?;
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

    /// The logits `[B,L,V]` (f32) of every position of `ids [B,L]`, from empty states, without a
    /// cache: the training forward. With weights that are `Var`s (or depend on them, as in a
    /// [`crate::TrainableModel`]'s view) every op records its gradient.
    pub fn forward_train(&self, ids: &Tensor) -> Result<Tensor> {
        self.forward_train_checked(&self.checked_ids(ids)?)
    }

    /// [`Model::forward_train`] of ids already known to be u32 or i64 and inside the vocabulary.
    fn forward_train_checked(&self, ids: &Tensor) -> Result<Tensor> {
        self.logits(&self.hidden_train(ids)?)
    }

    /// The final norm's output `[B,L,d_model]` of the training forward, before the LM head.
    fn hidden_train(&self, ids: &Tensor) -> Result<Tensor> {
        match ids.dims() {
            &[_, l] if l > 0 => {}
            d => bail!("ids must have shape [B, L] with L >= 1, got {d:?}"),
        }
        let h = self.embed(ids)?;
        // On CUDA the blocks are one recorded op (`model/grad.rs`): recorded one by one, candle
        // would add the residual stream's gradients into zeroed buffers, block by block.
        if h.device().is_cuda() && (h.track_op() || self.norm_f.track_op()) {
            return self.blocks_train_fused(&h);
        }
        self.blocks_train_composed(&h)
    }

    /// The final norm's output from the embedding's rows `h [B,L,d_model]`, each block recorded
    /// on its own.
    fn blocks_train_composed(&self, h: &Tensor) -> Result<Tensor> {
        let mut h = h.clone();
        let mut residual = None;
        for block in &self.blocks {
            let (normed, r) = self.norm(&h, residual.as_ref(), &block.norm)?;
            residual = Some(r);
            h = block.mixer.forward_train(&normed)?;
        }
        Ok(self.norm(&h, residual.as_ref(), &self.norm_f)?.0)
    }

    /// The mean next-token cross-entropy of `ids [B,L]` (L ≥ 2): the logits at positions
    /// 0..L−1 against the ids at 1..L, in f32, differentiable as [`Model::forward_train`].
    ///
    /// The ids are checked on the host first, as by [`Model::forward`]; [`Model::loss_from_host`]
    /// takes them from the host, where the check waits for nothing.
    pub fn loss(&self, ids: &Tensor) -> Result<Tensor> {
        self.loss_checked(&self.checked_ids(ids)?)
    }

    /// [`Model::loss`] of `ids` held on the host, `batch` rows of `ids.len() / batch` tokens:
    /// checked there and copied to the model's device, so that the check reads nothing back from
    /// the device (on CUDA such a read waits for all the work queued before it).
    pub fn loss_from_host(&self, ids: &[u32], batch: usize) -> Result<Tensor> {
        self.loss_checked(&self.host_ids(ids, batch)?)
    }

    /// `ids` from the host as `batch` rows of equal length on the model's device, after checking
    /// every id against the vocabulary there.
    fn host_ids(&self, ids: &[u32], batch: usize) -> Result<Tensor> {
        if batch == 0 || ids.len() % batch != 0 {
            bail!("{} ids do not make {batch} rows of equal length", ids.len())
        }
        let dims = [batch, ids.len() / batch];
        let vocab = self.config.vocab_size;
        check_vocab(ids.iter().map(|&t| i64::from(t)), &dims, "ids", vocab)?;
        Tensor::from_slice(ids, (dims[0], dims[1]), &self.device)
    }

    /// [`Model::loss`] of ids already known to be u32 or i64 and inside the vocabulary.
    fn loss_checked(&self, ids: &Tensor) -> Result<Tensor> {
        let (b, l) = match ids.dims() {
            &[b, l] if l >= 2 => (b, l),
            d => bail!("the loss needs ids of shape [B, L] with L >= 2, got {d:?}"),
        };
        let h = self.hidden_train(&ids.narrow(1, 0, l - 1)?)?;
        let rows = h.reshape((b * (l - 1), self.config.d_model))?;
        let targets = ids.narrow(1, 1, l - 1)?.to_dtype(DType::U32)?;
        self.loss_of_rows(&rows, &targets.flatten_all()?)
    }

    /// The mean cross-entropy of the LM head's logits of the final hidden rows `[R, d]` against
    /// `targets [R]`. The logits stay in the model's dtype (the loss computes in f32: an f32
    /// copy of the step's largest tensor would cost a pass each way), and the head's product and
    /// the loss are one op, so that candle never adds up the logits' gradient.
    fn loss_of_rows(&self, rows: &Tensor, targets: &Tensor) -> Result<Tensor> {
        match self.lm_head.bias() {
            None => linear_cross_entropy(rows, self.lm_head.weight(), targets),
            Some(_) => cross_entropy(&self.lm_head.forward(rows)?, targets),
        }
    }

    /// The mean next-token cross-entropy of documents of any lengths packed into one row (no
    /// padding): every document from an empty state, no state or conv window crossing into the
    /// next, each predicting its tokens 1..len−1. Equal to the token-weighted mean of
    /// [`Model::loss`] of each document alone, and differentiable as it. Every document needs at
    /// least 2 tokens; ids are checked against the vocabulary first.
    pub fn loss_packed(&self, docs: &[&[u32]]) -> Result<Tensor> {
        if docs.is_empty() {
            bail!("loss_packed: no documents")
        }
        let mut cu = Vec::with_capacity(docs.len() + 1);
        cu.push(0);
        let (mut inputs, mut targets) = (Vec::new(), Vec::new());
        for (i, d) in docs.iter().enumerate() {
            if d.len() < 2 {
                bail!(
                    "loss_packed: document {i} has {} token(s); a loss needs at least 2",
                    d.len()
                )
            }
            let ids = d.iter().map(|&t| i64::from(t));
            check_vocab(
                ids,
                &[d.len()],
                &format!("docs[{i}]"),
                self.config.vocab_size,
            )?;
            // The last token predicts nothing: it is not fed, as in `Model::loss`.
            inputs.extend_from_slice(&d[..d.len() - 1]);
            targets.extend_from_slice(&d[1..]);
            cu.push(inputs.len());
        }
        let ids = Tensor::new(inputs.as_slice(), &self.device)?.unsqueeze(0)?;
        let mut h = self.embed(&ids)?;
        let mut residual = None;
        for block in &self.blocks {
            let (normed, r) = self.norm(&h, residual.as_ref(), &block.norm)?;
            residual = Some(r);
            h = block.mixer.forward_train_packed(&normed, &cu)?;
        }
        let (h, _) = self.norm(&h, residual.as_ref(), &self.norm_f)?;
        self.loss_of_rows(
            &h.squeeze(0)?,
            &Tensor::new(targets.as_slice(), &self.device)?,
        )
    }

    /// `Σ −log p(ids[b,t] | ids[b,<t])` over t = 1..L−1 of every row of `ids [B, L]` (L ≥ 2),
    /// each row from an empty state, in f64: the held-out score of the `perplexity` and `train`
    /// examples (perplexity = exp of the sum over the count of predicted tokens).
    ///
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// use mamba2_model::Model;
    ///
    /// let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../weights");
    /// let model = Model::load(dir, DType::F32, &Device::Cpu)?;
    /// let ids = Tensor::new(&[[5u32, 17, 260, 31, 9]], &Device::Cpu)?;
    /// // The mean loss of the same 4 predictions, times 4.
    /// let mean = f64::from(model.loss(&ids)?.to_scalar::<f32>()?);
    /// assert!((model.nll_sum(&ids)? - 4.0 * mean).abs() < 1e-3);
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn nll_sum(&self, ids: &Tensor) -> Result<f64> {
        self.nll_sum_checked(&self.checked_ids(ids)?)
    }

    /// [`Model::nll_sum`] of `ids` held on the host, `batch` rows of equal length: checked there,
    /// so that the sum is the one value read back from the device.
    pub fn nll_sum_from_host(&self, ids: &[u32], batch: usize) -> Result<f64> {
        self.nll_sum_checked(&self.host_ids(ids, batch)?)
    }

    /// [`Model::nll_sum`] of ids already known to be u32 or i64 and inside the vocabulary.
    fn nll_sum_checked(&self, ids: &Tensor) -> Result<f64> {
        let (batch, len) = match ids.dims() {
            &[b, l] if l >= 2 => (b, l),
            d => bail!("nll_sum needs ids of shape [B, L] with L >= 2, got {d:?}"),
        };
        let mut cache = self.new_cache(batch)?;
        let logits = self.forward_checked(&ids.narrow(1, 0, len - 1)?, &mut cache)?;
        let logp = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
        let targets = ids
            .narrow(1, 1, len - 1)?
            .to_dtype(DType::U32)?
            .unsqueeze(2)?;
        let picked = logp.gather(&targets.contiguous()?, 2)?;
        Ok(-picked.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?)
    }

    /// The embedding rows of `ids`.
    fn embed(&self, ids: &Tensor) -> Result<Tensor> {
        embedding(&self.embedding, ids)
    }

    fn logits(&self, h: &Tensor) -> Result<Tensor> {
        rows_linear(&self.lm_head, h)?.to_dtype(DType::F32)
    }
}

// `Model` must stay shareable between threads (see "Threads" on it): a field that is not
// `Send + Sync` breaks the build here rather than in a user's code.
const _: fn() = || {
    fn shareable<T: Send + Sync>() {}
    shareable::<Model>();
};

/// An error for the first id of `ids` (row-major over `dims`) outside `0..vocab`, naming the id,
/// its index in `name` and the vocabulary size.
pub(crate) fn check_vocab(
    ids: impl IntoIterator<Item = i64>,
    dims: &[usize],
    name: &str,
    vocab: usize,
) -> Result<()> {
    let bad = ids
        .into_iter()
        .enumerate()
        .find(|&(_, id)| !usize::try_from(id).is_ok_and(|id| id < vocab));
    if let Some((flat, id)) = bad {
        let mut index = vec![0; dims.len()];
        let mut rest = flat;
        for (i, &d) in index.iter_mut().zip(dims).rev() {
            *i = rest % d.max(1);
            rest /= d.max(1);
        }
        let index: Vec<String> = index.iter().map(usize::to_string).collect();
        bail!(
            "token id {id} at {name}[{}] is out of the model's vocabulary ({vocab} tokens: ids 0 to {})",
            index.join(", "),
            vocab.saturating_sub(1)
        )
    }
    Ok(())
}
