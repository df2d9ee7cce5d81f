//! Next-token choice from logits, in HF's order of processors:
//!
//! ```text
//! repetition penalty   l_i ← l_i / p if l_i > 0 else l_i · p,  for tokens i among the last n
//! greedy               argmax_i l_i    (temperature 0)
//! temperature          q = softmax(l / T)
//! top-k                keep the k most likely tokens
//! top-p                keep the smallest most-likely set whose mass reaches p
//! draw                 from the kept q, renormalised, with a seeded SplitMix64 generator
//! ```
//!
//! The same seed, logits and history give the same token on every run and platform. Every logit
//! must be finite: a NaN or an infinity means the model's numbers broke down (an overflow in a
//! half-precision model, broken weights), and choosing a token from them would hide it, so the
//! sampler returns an error naming the first such logit instead. To forbid a token, give it a
//! large finite negative logit (e.g. `f32::MIN`), not −inf.

use candle_core::{bail, DType, Result, Tensor};

/// How the next token is chosen.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 for greedy decoding, else the softmax temperature (> 0).
    pub temperature: f64,
    /// Keep only the k most likely tokens (≥ 1); `None` keeps all.
    pub top_k: Option<usize>,
    /// Keep the smallest set of most likely tokens with probability mass ≥ p, p ∈ (0, 1].
    pub top_p: Option<f64>,
    /// Repetition penalty (> 0; 1 is none), applied to the tokens of the last `repeat_last_n`.
    pub repetition_penalty: f32,
    pub repeat_last_n: usize,
    pub seed: u64,
}

impl Default for SamplingParams {
    /// Greedy decoding without penalty.
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: None,
            top_p: None,
            repetition_penalty: 1.0,
            repeat_last_n: 64,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Checks every value's range; the error names the parameter and its value. `repeat_last_n`
    /// and `seed` may be anything.
    pub fn validate(&self) -> Result<()> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            bail!(
                "temperature must be finite and >= 0 (0 = greedy), got {}",
                self.temperature
            )
        }
        if self.top_k == Some(0) {
            bail!("top_k must be >= 1 (None keeps every token), got 0")
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                bail!("top_p must be in (0, 1], got {p}")
            }
        }
        if !self.repetition_penalty.is_finite() || self.repetition_penalty <= 0.0 {
            bail!(
                "repetition_penalty must be finite and > 0 (1 = none), got {}",
                self.repetition_penalty
            )
        }
        Ok(())
    }
}

/// Chooses tokens by [`SamplingParams`] with its own seeded random stream.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use mamba2_model::{Sampler, SamplingParams};
///
/// let logits = Tensor::new(&[1.0f32, 3.0, 2.0, -1.0], &Device::Cpu)?;
/// // Greedy (the default): the most likely token.
/// assert_eq!(Sampler::new(SamplingParams::default())?.sample(&logits, &[])?, 1);
/// // Token 1 is in the history: a penalty of 4 takes its logit to 3/4 < 2, so token 2 wins.
/// let penalised = SamplingParams { repetition_penalty: 4.0, ..Default::default() };
/// assert_eq!(Sampler::new(penalised)?.sample(&logits, &[1])?, 2);
///
/// // Top-k 2 keeps tokens 1 and 2 only; the same seed draws the same tokens.
/// let params = SamplingParams { temperature: 1.0, top_k: Some(2), seed: 7, ..Default::default() };
/// let draw = |p| -> candle_core::Result<Vec<u32>> {
///     let mut sampler = Sampler::new(p)?;
///     (0..32).map(|_| sampler.sample(&logits, &[])).collect()
/// };
/// let tokens = draw(params)?;
/// assert!(tokens.contains(&1) && tokens.contains(&2));
/// assert!(tokens.iter().all(|&t| t == 1 || t == 2));
/// assert_eq!(tokens, draw(params)?);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: u64,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        Ok(Self {
            params,
            rng: params.seed,
        })
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// SplitMix64, uniform in [0, 1).
    fn uniform(&mut self) -> f64 {
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// The next token from `logits [V]` (any float dtype), `history` being the tokens so far.
    /// Logits that are not all finite are an error naming the first NaN or infinity.
    pub fn sample(&mut self, logits: &Tensor, history: &[u32]) -> Result<u32> {
        let mut l = logits.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        if l.is_empty() {
            bail!("sample: empty logits")
        }
        if let Some((i, v)) = l.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            bail!(
                "the logits are not finite: logit {i} of {} is {v} (the model's numbers broke down)",
                l.len()
            )
        }
        let p = self.params;
        if p.repetition_penalty != 1.0 {
            let start = history.len().saturating_sub(p.repeat_last_n);
            for &t in &history[start..] {
                if let Some(v) = l.get_mut(t as usize) {
                    let penalised = if *v > 0.0 {
                        *v / p.repetition_penalty
                    } else {
                        *v * p.repetition_penalty
                    };
                    // Saturate: a penalty below 1 must not overflow a huge logit into ±inf.
                    *v = penalised.clamp(f32::MIN, f32::MAX);
                }
            }
        }
        if p.temperature == 0.0 {
            return Ok(argmax(&l));
        }
        let max = l.iter().copied().fold(f32::MIN, f32::max);
        // (probability, token), most likely first, unnormalised.
        let mut probs: Vec<(f64, u32)> = l
            .iter()
            .enumerate()
            .map(|(i, &v)| (((v - max) as f64 / p.temperature).exp(), i as u32))
            .collect();
        let by_prob = |a: &(f64, u32), b: &(f64, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
        if let Some(k) = p.top_k.filter(|&k| k < probs.len()) {
            probs.select_nth_unstable_by(k - 1, by_prob);
            probs.truncate(k);
        }
        probs.sort_unstable_by(by_prob);
        if let Some(top_p) = p.top_p {
            let total: f64 = probs.iter().map(|x| x.0).sum();
            let mut mass = 0.0;
            let keep = probs
                .iter()
                .position(|x| {
                    mass += x.0;
                    mass >= top_p * total
                })
                .map_or(probs.len(), |i| i + 1);
            probs.truncate(keep);
        }
        let total: f64 = probs.iter().map(|x| x.0).sum();
        let mut u = self.uniform() * total;
        for &(q, t) in &probs {
            if u < q {
                return Ok(t);
            }
            u -= q;
        }
        Ok(probs[probs.len() - 1].1)
    }
}

/// The index of the largest value, the first one on ties.
fn argmax(l: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in l.iter().enumerate() {
        if *v > l[best] {
            best = i;
        }
    }
    best as u32
}
