//! Generation for many prompts at once: continuous batching at the library level.
//!
//! ```text
//! add(prompt):  prefill it → its cache row and next-token logits join the batch
//! add_many(ps):  the same for many prompts, prefilled packed in one row (Model::prefill_packed)
//! step():       for every sequence: t = sample(its logits, its history)
//!                   stop on EOS, a stop string or max_new_tokens → it leaves the batch
//!               logits = model.step(t of the sequences left)        one decode for all
//! ```
//!
//! Each sequence has its own sampler (seeded from the config, as a lone [`Generator::generate`]
//! would be), history, text stream and stop filter, so a sequence generates what it would alone:
//! the same tokens under greedy decoding, up to the last bits of the batched products. Sequences
//! may join between any two steps and leave as soon as they stop. Decode steps run eagerly (on
//! CUDA no captured graph: the batch changes shape as sequences come and go).

use std::time::Instant;

use candle_core::{bail, Result, Tensor};

use crate::generator::Sequence;
use crate::model::check_vocab;
use crate::{Cache, Generation, Generator};

/// A batch of sequences generating together (see the module doc); made by [`Generator::batch`].
///
/// Two prompts of different lengths, greedy, each as it would be alone:
///
/// ```
/// use candle_core::{DType, Device};
/// use mamba2_model::{load_tokenizer, GenerationConfig, Generator, Model};
///
/// let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../weights");
/// let model = Model::load(dir, DType::F32, &Device::Cpu)?;
/// let tokenizer = load_tokenizer(format!("{dir}/tokenizer.json"))?;
/// let config = GenerationConfig { max_new_tokens: 4, ..Default::default() };
/// let generator = Generator::new(&model, &tokenizer, config)?;
///
/// let prompts = ["It was a dark and stormy night", "Elizabeth said"];
/// let together = generator.generate_batch(&prompts, |_, _| Ok(()))?;
/// for (prompt, generation) in prompts.iter().zip(&together) {
///     assert_eq!(generation.tokens, generator.generate(prompt, |_| Ok(()))?.tokens);
/// }
/// # Ok::<(), candle_core::Error>(())
/// ```
pub struct Batch<'g> {
    generator: &'g Generator<'g>,
    /// Active sequences with their ids, in the order of the cache's rows and the logits' rows.
    seqs: Vec<(usize, Sequence<'g>)>,
    cache: Option<Cache>,
    /// `[B, V]` next-token logits of the active sequences.
    logits: Option<Tensor>,
    next_id: usize,
}

impl<'g> Batch<'g> {
    pub(crate) fn new(generator: &'g Generator<'g>) -> Self {
        Self {
            generator,
            seqs: Vec::new(),
            cache: None,
            logits: None,
            next_id: 0,
        }
    }

    /// Sequences still generating.
    pub fn len(&self) -> usize {
        self.seqs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }

    /// Encodes `prompt` (with the tokenizer's special tokens) and adds it: see
    /// [`Batch::add_ids`].
    pub fn add(&mut self, prompt: &str) -> Result<usize> {
        let enc = self
            .generator
            .tokenizer()
            .encode(prompt, true)
            .map_err(|e| candle_core::Error::msg(format!("cannot encode the prompt: {e}")))?;
        self.add_ids(enc.get_ids())
    }

    /// Prefills the prompt ids and adds the sequence, which takes part in the next
    /// [`Batch::step`]; returns its id (0, 1, … in the order of adding). The ids are checked
    /// against the vocabulary before anything runs.
    pub fn add_ids(&mut self, prompt: &[u32]) -> Result<usize> {
        if prompt.is_empty() {
            bail!("the prompt has no tokens")
        }
        let model = self.generator.model();
        let vocab = model.config().vocab_size;
        let ids = prompt.iter().map(|&t| i64::from(t));
        check_vocab(ids, &[prompt.len()], "prompt", vocab)?;
        let start = Instant::now();
        let mut cache = model.new_cache(1)?;
        let ids = Tensor::new(prompt, model.device())?.unsqueeze(0)?;
        let logits = model.prefill_checked(&ids, &mut cache)?;
        model.device().synchronize()?;
        let secs = start.elapsed().as_secs_f64();
        self.join(&[prompt], cache, logits, secs)
    }

    /// Encodes the prompts (with the tokenizer's special tokens) and adds them with one packed
    /// prefill ([`Batch::add_many_ids`]); returns the first one's id (the others follow).
    pub fn add_many(&mut self, prompts: &[&str]) -> Result<usize> {
        let encoded = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let enc = self.generator.tokenizer().encode(*p, true).map_err(|e| {
                    candle_core::Error::msg(format!("cannot encode prompt {i}: {e}"))
                })?;
                Ok(enc.get_ids().to_vec())
            })
            .collect::<Result<Vec<_>>>()?;
        let ids: Vec<&[u32]> = encoded.iter().map(Vec::as_slice).collect();
        self.add_many_ids(&ids)
    }

    /// Prefills the prompts packed into one row in one call ([`crate::Model::prefill_packed`],
    /// no padding) and adds them in order, as [`Batch::add_ids`] would one by one; returns the
    /// first one's id (the others follow). Each sequence's prefill time is the whole call's.
    pub fn add_many_ids(&mut self, prompts: &[&[u32]]) -> Result<usize> {
        let model = self.generator.model();
        let start = Instant::now();
        let (logits, cache) = model.prefill_packed(prompts)?;
        model.device().synchronize()?;
        let secs = start.elapsed().as_secs_f64();
        self.join(prompts, cache, logits, secs)
    }

    /// Adds the prefilled `prompts` (the rows of `cache` and `logits`); returns the first one's
    /// id.
    fn join(
        &mut self,
        prompts: &[&[u32]],
        cache: Cache,
        logits: Tensor,
        secs: f64,
    ) -> Result<usize> {
        let config = self.generator.config();
        let tokenizer = self.generator.tokenizer();
        let mut seqs = Vec::with_capacity(prompts.len());
        for prompt in prompts {
            let mut seq = Sequence::new(tokenizer, config, prompt)?;
            seq.prefill_secs = secs;
            seqs.push(seq);
        }
        let (cache, logits) = match (self.cache.take(), self.logits.take()) {
            (Some(c), Some(l)) => (Cache::join(&[c, cache])?, Tensor::cat(&[&l, &logits], 0)?),
            _ => (cache, logits),
        };
        self.cache = Some(cache);
        self.logits = Some(logits);
        let first = self.next_id;
        for seq in seqs {
            self.seqs.push((self.next_id, seq));
            self.next_id += 1;
        }
        Ok(first)
    }

    /// One token for every sequence: each samples from its logits, streams its newly complete
    /// text to `on_text(id, piece)` and leaves the batch if it stopped; the rest take one decode
    /// step together. Returns the sequences that finished, with their generations.
    pub fn step(
        &mut self,
        mut on_text: impl FnMut(usize, &str) -> Result<()>,
    ) -> Result<Vec<(usize, Generation)>> {
        let (Some(cache), Some(logits)) = (self.cache.take(), self.logits.take()) else {
            return Ok(Vec::new());
        };
        // One copy of all rows to the host, rather than one per sequence as each samples.
        let logits = logits.to_device(&candle_core::Device::Cpu)?;
        let config = self.generator.config();
        let mut keep = Vec::with_capacity(self.seqs.len());
        let mut next = Vec::with_capacity(self.seqs.len());
        let mut finished = Vec::new();
        for (row, (id, mut seq)) in std::mem::take(&mut self.seqs).into_iter().enumerate() {
            let mut emit = |piece: &str| on_text(id, piece);
            let token = seq
                .next(&logits.get(row)?, config, &mut emit)
                .map_err(|e| candle_core::Error::msg(format!("sequence {id}: {e}")))?;
            match token {
                Some(token) => {
                    keep.push(row);
                    next.push(token);
                    self.seqs.push((id, seq));
                }
                None => finished.push((id, seq.into_generation())),
            }
        }
        if keep.is_empty() {
            return Ok(finished);
        }
        let mut cache = if keep.len() == cache.batch_size() {
            cache
        } else {
            cache.select(&keep)?
        };
        let model = self.generator.model();
        let start = Instant::now();
        let ids = Tensor::new(next.as_slice(), model.device())?;
        let logits = model.step_checked(&ids, &mut cache)?;
        model.device().synchronize()?;
        let secs = start.elapsed().as_secs_f64();
        for (_, seq) in &mut self.seqs {
            seq.decode_steps += 1;
            seq.decode_secs += secs;
        }
        self.cache = Some(cache);
        self.logits = Some(logits);
        Ok(finished)
    }
}
