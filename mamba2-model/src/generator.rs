//! Text generation: prefill the prompt once, then decode one token at a time through the cache.
//!
//! ```text
//! logits = prefill(prompt)                       (timed: prefill tokens/s)
//! loop:  t = sample(logits, history)             stop on EOS or after max_new_tokens
//!        stream the newly complete text          stop when a stop string appears
//!        logits = step(t)                        (timed: decode tokens/s)
//! ```
//!
//! Text reaches the callback as soon as it is complete ([`TextStream`]: never half a character).
//! A stop string ends generation and is not part of the output; text that could still become the
//! start of a stop string is held back until it cannot.
//!
//! Step `i` chooses generated token `i` (from 0) from the logits after the prompt and the `i`
//! tokens before it; an error while choosing or computing them (logits that are not finite, for
//! one) names that step.

use std::fmt;
use std::time::Instant;

use candle_core::{bail, Result, Tensor};
use tokenizers::Tokenizer;

use crate::model::check_vocab;
use crate::{Batch, Cache, Config, Model, Sampler, SamplingParams, TextStream};

/// What to generate and when to stop.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GenerationConfig {
    /// At most this many tokens are generated (0 to [`GenerationConfig::MAX_NEW_TOKENS`]).
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    /// Generation ends when the output contains one of these (non-empty) strings.
    pub stop_strings: Vec<String>,
    /// Generation ends when one of these tokens is drawn (it is not output).
    pub eos_token_ids: Vec<u32>,
    /// On CUDA, launch each decode step's kernels one by one instead of replaying the step as a
    /// captured CUDA graph (`DecodeGraph`; its capture counts as decode time).
    pub no_cuda_graph: bool,
}

impl GenerationConfig {
    /// The largest `max_new_tokens`: 16M tokens, far beyond any real generation, so that a
    /// mistyped count is an error instead of a run that never ends (the tokens and text kept grow
    /// with it).
    pub const MAX_NEW_TOKENS: usize = 1 << 24;

    /// Checks the sampling parameters ([`SamplingParams::validate`]), `max_new_tokens` and the
    /// stop strings; the error names the parameter and its value.
    pub fn validate(&self) -> Result<()> {
        self.sampling.validate()?;
        if self.max_new_tokens > Self::MAX_NEW_TOKENS {
            bail!(
                "max_new_tokens must be <= {}, got {}",
                Self::MAX_NEW_TOKENS,
                self.max_new_tokens
            )
        }
        if let Some(i) = self.stop_strings.iter().position(String::is_empty) {
            bail!("stop string {i} is empty: stop strings must not be empty")
        }
        Ok(())
    }
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    Eos,
    StopString,
    MaxNewTokens,
}

/// The result of one generation.
#[derive(Clone, Debug)]
pub struct Generation {
    /// The generated text (without the prompt, cut before a stop string).
    pub text: String,
    /// The generated tokens (without the prompt and the EOS token).
    pub tokens: Vec<u32>,
    pub stop: StopReason,
    pub prompt_tokens: usize,
    pub prefill_secs: f64,
    /// Decode steps (tokens fed back through the model) and their time.
    pub decode_steps: usize,
    pub decode_secs: f64,
}

impl Generation {
    pub fn prefill_tokens_per_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_secs.max(f64::MIN_POSITIVE)
    }

    pub fn decode_tokens_per_s(&self) -> f64 {
        self.decode_steps as f64 / self.decode_secs.max(f64::MIN_POSITIVE)
    }
}

impl fmt::Display for Generation {
    /// One stats line: prompt and prefill speed, generated tokens and decode speed.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "prompt {} tokens, prefill {:.1} tokens/s | generated {} tokens, decode {:.1} tokens/s | stop: {:?}",
            self.prompt_tokens,
            self.prefill_tokens_per_s(),
            self.tokens.len(),
            self.decode_tokens_per_s(),
            self.stop
        )
    }
}

/// The end-of-sequence tokens of a model: the config's `eos_token_id`, and `<|endoftext|>` when
/// the tokenizer has it (state-spaces configs name no EOS; their GPT-NeoX tokenizer does).
pub fn eos_token_ids(config: &Config, tokenizer: &Tokenizer) -> Vec<u32> {
    let mut ids = config.eos_token_ids.clone();
    if let Some(id) = tokenizer.token_to_id("<|endoftext|>") {
        if !ids.contains(&id) {
            ids.push(id);
        }
    }
    ids
}

/// Generates text from a model and its tokenizer (batch 1).
///
/// Greedy decoding of a few tokens with the shipped model (`weights/`); the pieces streamed to
/// the callback add up to the returned text:
///
/// ```
/// use candle_core::{DType, Device};
/// use mamba2_model::{load_tokenizer, GenerationConfig, Generator, Model, StopReason};
///
/// let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../weights");
/// let model = Model::load(dir, DType::F32, &Device::Cpu)?;
/// let tokenizer = load_tokenizer(format!("{dir}/tokenizer.json"))?;
/// // The default sampling is greedy; no EOS tokens, so exactly max_new_tokens come out.
/// let config = GenerationConfig { max_new_tokens: 6, ..Default::default() };
/// let generator = Generator::new(&model, &tokenizer, config)?;
///
/// let mut streamed = String::new();
/// let generation = generator.generate("It was a dark and stormy night", |piece| {
///     streamed.push_str(piece);
///     Ok(())
/// })?;
/// assert_eq!(generation.tokens.len(), 6);
/// assert_eq!(generation.stop, StopReason::MaxNewTokens);
/// assert_eq!(streamed, generation.text);
/// // Greedy decoding is deterministic.
/// let again = generator.generate("It was a dark and stormy night", |_| Ok(()))?;
/// assert_eq!(again.tokens, generation.tokens);
/// # Ok::<(), candle_core::Error>(())
/// ```
///
/// # Threads
///
/// A `Generator` is `Send + Sync`, and each call of [`Generator::generate`] makes its own cache
/// (and, on CUDA, its own decode graph), runs on the calling thread alone and waits for the
/// device before it returns: one generator (or one [`Model`]) may serve many threads at once.
pub struct Generator<'a> {
    model: &'a Model,
    tokenizer: &'a Tokenizer,
    config: GenerationConfig,
}

impl<'a> Generator<'a> {
    pub fn new(
        model: &'a Model,
        tokenizer: &'a Tokenizer,
        config: GenerationConfig,
    ) -> Result<Self> {
        config.validate()?;
        Ok(Self {
            model,
            tokenizer,
            config,
        })
    }

    pub fn config(&self) -> &GenerationConfig {
        &self.config
    }

    pub fn model(&self) -> &'a Model {
        self.model
    }

    pub fn tokenizer(&self) -> &'a Tokenizer {
        self.tokenizer
    }

    /// An empty [`Batch`]: prompts added to it generate together, with this generator's
    /// configuration, each stopping on its own.
    pub fn batch(&'a self) -> Batch<'a> {
        Batch::new(self)
    }

    /// Generates from every prompt together ([`Batch`]: one packed prefill, then decode steps
    /// for all), calling `on_text(i, piece)` with each
    /// newly complete piece of prompt `i`'s text; returns the generations in the prompts' order.
    pub fn generate_batch(
        &'a self,
        prompts: &[&str],
        mut on_text: impl FnMut(usize, &str) -> Result<()>,
    ) -> Result<Vec<Generation>> {
        let mut batch = self.batch();
        batch.add_many(prompts)?;
        let mut done: Vec<Option<Generation>> = vec![None; prompts.len()];
        while !batch.is_empty() {
            for (id, generation) in batch.step(&mut on_text)? {
                done[id] = Some(generation);
            }
        }
        done.into_iter()
            .enumerate()
            .map(|(i, g)| {
                g.ok_or_else(|| candle_core::Error::msg(format!("prompt {i} did not finish")))
            })
            .collect()
    }

    /// Encodes `prompt` (with the tokenizer's special tokens) and generates from it.
    pub fn generate(
        &self,
        prompt: &str,
        on_text: impl FnMut(&str) -> Result<()>,
    ) -> Result<Generation> {
        let enc = self
            .tokenizer
            .encode(prompt, true)
            .map_err(|e| candle_core::Error::msg(format!("cannot encode the prompt: {e}")))?;
        self.generate_from_ids(enc.get_ids(), on_text)
    }

    /// Generates from the token ids `prompt`, calling `on_text` with each newly complete piece.
    /// The ids are checked against the model's vocabulary before anything runs.
    pub fn generate_from_ids(
        &self,
        prompt: &[u32],
        mut on_text: impl FnMut(&str) -> Result<()>,
    ) -> Result<Generation> {
        if prompt.is_empty() {
            bail!("the prompt has no tokens")
        }
        let vocab = self.model.config().vocab_size;
        let ids = prompt.iter().map(|&t| i64::from(t));
        check_vocab(ids, &[prompt.len()], "prompt", vocab)?;
        let (model, device) = (self.model, self.model.device());
        let mut seq = Sequence::new(self.tokenizer, &self.config, prompt)?;
        let mut cache = model.new_cache(1)?;

        let start = Instant::now();
        let ids = Tensor::new(prompt, device)?.unsqueeze(0)?;
        let mut logits = model.prefill_checked(&ids, &mut cache)?.squeeze(0)?;
        device.synchronize()?;
        seq.prefill_secs = start.elapsed().as_secs_f64();

        let start = Instant::now();
        let mut decoder = Decoder::new(model, cache, self.config.no_cuda_graph)?;
        while let Some(token) = seq.next(&logits, &self.config, &mut on_text)? {
            let i = seq.tokens.len();
            logits = decoder
                .step(token)
                .map_err(|e| at_step(prompt.len(), i, e))?;
            seq.decode_steps += 1;
        }
        device.synchronize()?;
        seq.decode_secs = start.elapsed().as_secs_f64();
        Ok(seq.into_generation())
    }
}

/// An error of generation step `i` after a `prompt`-token prompt.
fn at_step(prompt: usize, i: usize, e: candle_core::Error) -> candle_core::Error {
    candle_core::Error::msg(format!(
        "generation step {i} (the logits after the {prompt}-token prompt and {i} generated \
         tokens): {e}"
    ))
}

/// One sequence being generated: its sampler, history and generated tokens, its text stream and
/// stop filter, and its timings. [`Generator::generate`] drives one; a [`Batch`] many.
pub(crate) struct Sequence<'g> {
    history: Vec<u32>,
    pub(crate) tokens: Vec<u32>,
    prompt_tokens: usize,
    sampler: Sampler,
    stream: TextStream<'g>,
    out: StopFilter<'g>,
    stop: Option<StopReason>,
    pub(crate) prefill_secs: f64,
    pub(crate) decode_steps: usize,
    pub(crate) decode_secs: f64,
}

impl<'g> Sequence<'g> {
    pub(crate) fn new(
        tokenizer: &'g Tokenizer,
        config: &'g GenerationConfig,
        prompt: &[u32],
    ) -> Result<Self> {
        Ok(Self {
            history: prompt.to_vec(),
            tokens: Vec::new(),
            prompt_tokens: prompt.len(),
            sampler: Sampler::new(config.sampling)?,
            stream: TextStream::with_context(tokenizer, prompt),
            out: StopFilter::new(&config.stop_strings),
            stop: None,
            prefill_secs: 0.0,
            decode_steps: 0,
            decode_secs: 0.0,
        })
    }

    /// One step: the next token from `logits [V]`, its newly complete text streamed to `emit`.
    /// Returns the token to feed back, or `None` once the sequence has stopped (EOS, a stop
    /// string, or `max_new_tokens` reached), its held-back text then emitted.
    pub(crate) fn next(
        &mut self,
        logits: &Tensor,
        config: &GenerationConfig,
        emit: &mut impl FnMut(&str) -> Result<()>,
    ) -> Result<Option<u32>> {
        if self.stop.is_some() {
            return Ok(None);
        }
        let i = self.tokens.len();
        let reason = if i >= config.max_new_tokens {
            StopReason::MaxNewTokens
        } else {
            let token = self
                .sampler
                .sample(logits, &self.history)
                .map_err(|e| at_step(self.prompt_tokens, i, e))?;
            if config.eos_token_ids.contains(&token) {
                StopReason::Eos
            } else {
                self.history.push(token);
                self.tokens.push(token);
                if self.out.push(&self.stream.push(token)?, emit)? {
                    self.stop = Some(StopReason::StopString);
                    return Ok(None);
                }
                if self.tokens.len() < config.max_new_tokens {
                    return Ok(Some(token));
                }
                StopReason::MaxNewTokens
            }
        };
        self.stop = Some(if self.out.push(&self.stream.flush()?, emit)? {
            StopReason::StopString
        } else {
            self.out.finish(emit)?;
            reason
        });
        Ok(None)
    }

    /// The generation of a stopped sequence.
    pub(crate) fn into_generation(self) -> Generation {
        Generation {
            text: self.out.text,
            tokens: self.tokens,
            stop: self.stop.unwrap_or(StopReason::MaxNewTokens),
            prompt_tokens: self.prompt_tokens,
            prefill_secs: self.prefill_secs,
            decode_steps: self.decode_steps,
            decode_secs: self.decode_secs,
        }
    }
}

// One generator may serve many threads (see "Threads" on `Generator`): a field that is not
// `Send + Sync` breaks the build here rather than in a user's code.
const _: fn() = || {
    fn shareable<T: Send + Sync>() {}
    shareable::<Generator<'static>>();
};

/// Decode steps one kernel at a time, or replayed from a captured CUDA graph.
enum Decoder<'m> {
    Eager {
        model: &'m Model,
        cache: Cache,
    },
    #[cfg(feature = "cuda")]
    Graph(crate::DecodeGraph<'m>),
}

impl<'m> Decoder<'m> {
    fn new(model: &'m Model, cache: Cache, eager: bool) -> Result<Self> {
        #[cfg(feature = "cuda")]
        if !eager && model.device().is_cuda() {
            return Ok(Self::Graph(crate::DecodeGraph::new(model, cache)?));
        }
        let _ = eager;
        Ok(Self::Eager { model, cache })
    }

    /// The logits `[V]` after `token`, which is checked against the vocabulary on the host.
    fn step(&mut self, token: u32) -> Result<Tensor> {
        match self {
            Self::Eager { model, cache } => {
                let vocab = model.config().vocab_size;
                check_vocab([i64::from(token)], &[1], "ids", vocab)?;
                let ids = Tensor::new(&[token], model.device())?;
                model.step_checked(&ids, cache)?.squeeze(0)
            }
            #[cfg(feature = "cuda")]
            Self::Graph(graph) => graph.step(&[token])?.squeeze(0),
        }
    }
}

/// Passes text on, cutting it before the first stop string and holding back any tail that may
/// still grow into one.
struct StopFilter<'s> {
    stops: &'s [String],
    text: String,
    emitted: usize,
}

impl<'s> StopFilter<'s> {
    fn new(stops: &'s [String]) -> Self {
        Self {
            stops,
            text: String::new(),
            emitted: 0,
        }
    }

    /// Adds `piece`, emits what is safe; returns true when a stop string appeared.
    fn push(&mut self, piece: &str, emit: &mut impl FnMut(&str) -> Result<()>) -> Result<bool> {
        if piece.is_empty() {
            return Ok(false);
        }
        self.text.push_str(piece);
        let found = self
            .stops
            .iter()
            .filter_map(|s| self.text[self.emitted..].find(s.as_str()))
            .min();
        if let Some(at) = found {
            self.text.truncate(self.emitted + at);
            self.finish(emit)?;
            return Ok(true);
        }
        let hold = self
            .stops
            .iter()
            .flat_map(|s| s.char_indices().skip(1).map(|(i, _)| &s[..i]))
            .filter(|p| self.text.ends_with(p))
            .map(str::len)
            .max()
            .unwrap_or(0);
        let end = self.text.len() - hold;
        if end > self.emitted {
            emit(&self.text[self.emitted..end])?;
            self.emitted = end;
        }
        Ok(false)
    }

    /// Emits everything still held back.
    fn finish(&mut self, emit: &mut impl FnMut(&str) -> Result<()>) -> Result<()> {
        if self.text.len() > self.emitted {
            emit(&self.text[self.emitted..])?;
            self.emitted = self.text.len();
        }
        Ok(())
    }
}
