//! The recurrent state of a batch of sequences: per layer, the conv state and the SSM state.
//!
//! ```text
//! conv [B, conv_dim, d_conv]   the last d_conv pre-conv xBC inputs, oldest first (model dtype)
//! ssm  [B, nheads, headdim, d_state]   the SSM state h (f32)
//! ```
//!
//! Both layouts are those of HF's cache and mamba_ssm's `inference_params`, so states can be
//! compared with theirs directly. The tensors keep their storage for the cache's whole life:
//! prefill copies the new states in, decode updates them in place, `reset` zeroes them. Hence a
//! cache is duplicated with [`Cache::try_clone`] (a deep copy), never by sharing its tensors.
//!
//! A cache is `Send + Sync`: it may move to another thread. On CUDA candle queues each thread's
//! work on that thread's own stream, and nothing orders one thread's stream after another's, so
//! a cache moves only once the work written into it has finished: [`Cache::new`] waits for its
//! zeroed states before returning, and after prefill, decode, `reset` or `try_clone` the thread
//! that ran them calls [`Cache::synchronize`] (or reads a result back, which waits too) before
//! handing the cache on.

use candle_core::{bail, DType, Device, Result, Tensor};

use crate::Config;

/// The state of one layer.
#[derive(Debug)]
pub struct LayerState {
    /// `[B, conv_dim, d_conv]` in the model's dtype.
    pub conv: Tensor,
    /// `[B, nheads, headdim, d_state]` f32.
    pub ssm: Tensor,
}

/// The state of every layer for `batch` sequences, and how many tokens each has consumed. Rows
/// may come from different caches ([`Cache::join`]) and leave one ([`Cache::select`]): the
/// sequences of a batch need not be equally long.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use mamba2_model::{Cache, Config};
///
/// let config = Config::from_json(
///     r#"{"hidden_size": 64, "num_heads": 2, "n_groups": 1, "state_size": 16,
///         "num_hidden_layers": 3}"#,
/// )?;
/// let cache = Cache::new(&config, 2, DType::F32, &Device::Cpu)?;
/// assert_eq!(cache.layers().len(), 3);
/// // conv [B, conv_dim, d_conv] with conv_dim = d_inner + 2·ngroups·d_state = 128 + 2·16.
/// assert_eq!(cache.layers()[0].conv.dims(), [2, 160, 4]);
/// // ssm [B, nheads, headdim, d_state].
/// assert_eq!(cache.layers()[0].ssm.dims(), [2, 2, 64, 16]);
///
/// // A deep copy evolves on its own; reset zeroes it again.
/// let mut copy = cache.try_clone()?;
/// let ones = Tensor::ones((2, 2, 64, 16), DType::F32, &Device::Cpu)?;
/// copy.layers()[0].ssm.slice_set(&ones, 0, 0)?;
/// let total = |c: &Cache| c.layers()[0].ssm.sum_all()?.to_scalar::<f32>();
/// assert_eq!((total(&cache)?, total(&copy)?), (0.0, 4096.0));
/// copy.reset()?;
/// assert_eq!(total(&copy)?, 0.0);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug)]
pub struct Cache {
    layers: Vec<LayerState>,
    /// Tokens consumed, per row.
    tokens: Vec<usize>,
}

impl Cache {
    /// A zero state (an empty prefix) for `batch` sequences of a `config` model in `dtype`. The
    /// device is synchronised before the cache is returned, so it may move to another thread at
    /// once.
    pub fn new(config: &Config, batch: usize, dtype: DType, device: &Device) -> Result<Self> {
        if batch == 0 {
            bail!("cache: batch size must be >= 1")
        }
        let layers = (0..config.n_layer)
            .map(|_| {
                Ok(LayerState {
                    conv: Tensor::zeros((batch, config.conv_dim(), config.d_conv), dtype, device)?,
                    ssm: Tensor::zeros(
                        (batch, config.nheads, config.headdim, config.d_state),
                        DType::F32,
                        device,
                    )?,
                })
            })
            .collect::<Result<_>>()?;
        // The zeroing is queued on this thread's stream: waiting here lets the cache be handed to
        // another thread as soon as it is returned.
        device.synchronize()?;
        Ok(Self {
            layers,
            tokens: vec![0; batch],
        })
    }

    /// Waits until the work this thread queued on the cache's device has finished (on the CPU,
    /// nothing to wait for). Call it before moving the cache to another thread: on CUDA each
    /// thread has its own stream, and the other thread's kernels would not wait for this one's.
    pub fn synchronize(&self) -> Result<()> {
        match self.layers.first() {
            Some(l) => l.ssm.device().synchronize(),
            None => Ok(()),
        }
    }

    /// The number of sequences.
    pub fn batch_size(&self) -> usize {
        self.tokens.len()
    }

    /// Tokens consumed per sequence since creation or the last [`Cache::reset`]: the most any
    /// row has consumed when rows of different lengths were joined ([`Cache::row_tokens`]).
    pub fn tokens(&self) -> usize {
        self.tokens.iter().copied().max().unwrap_or(0)
    }

    /// Tokens consumed by each row.
    pub fn row_tokens(&self) -> &[usize] {
        &self.tokens
    }

    /// The per-layer states.
    pub fn layers(&self) -> &[LayerState] {
        &self.layers
    }

    pub(crate) fn layers_mut(&mut self) -> &mut [LayerState] {
        &mut self.layers
    }

    /// Counts `tokens[r]` more tokens for row r.
    pub(crate) fn advance_rows(&mut self, tokens: &[usize]) {
        for (t, n) in self.tokens.iter_mut().zip(tokens) {
            *t += n;
        }
    }

    pub(crate) fn advance(&mut self, tokens: usize) {
        for t in &mut self.tokens {
            *t += tokens;
        }
    }

    /// Zeroes every state in place: the cache then holds an empty prefix again.
    pub fn reset(&mut self) -> Result<()> {
        for l in &self.layers {
            l.conv.zero_set()?;
            l.ssm.zero_set()?;
        }
        self.tokens.fill(0);
        Ok(())
    }

    /// A deep copy: the copy and the original then evolve independently.
    pub fn try_clone(&self) -> Result<Self> {
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok(LayerState {
                    conv: l.conv.copy()?,
                    ssm: l.ssm.copy()?,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            layers,
            tokens: self.tokens.clone(),
        })
    }

    /// The rows of `parts`, in order, as one cache: sequences prefilled apart (of any lengths)
    /// decode together. The parts must be of one model, dtype and device.
    ///
    /// ```
    /// use candle_core::{DType, Device};
    /// use mamba2_model::{Cache, Config};
    ///
    /// let config = Config::from_json(
    ///     r#"{"hidden_size": 64, "num_heads": 2, "n_groups": 1, "state_size": 16,
    ///         "num_hidden_layers": 1}"#,
    /// )?;
    /// let one = Cache::new(&config, 1, DType::F32, &Device::Cpu)?;
    /// let two = Cache::new(&config, 2, DType::F32, &Device::Cpu)?;
    /// let all = Cache::join(&[one, two])?;
    /// assert_eq!(all.batch_size(), 3);
    /// // Rows leave in any order: here the third, then the first.
    /// let kept = all.select(&[2, 0])?;
    /// assert_eq!(kept.layers()[0].ssm.dims(), [2, 2, 64, 16]);
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn join(parts: &[Cache]) -> Result<Self> {
        let Some(first) = parts.first() else {
            bail!("cache join: no caches to join")
        };
        let n = first.layers.len();
        for (i, part) in parts.iter().enumerate() {
            let fits = part.layers.len() == n
                && part.layers.iter().zip(&first.layers).all(|(a, b)| {
                    a.conv.dims()[1..] == b.conv.dims()[1..]
                        && a.ssm.dims()[1..] == b.ssm.dims()[1..]
                        && a.conv.dtype() == b.conv.dtype()
                        && a.conv.device().same_device(b.conv.device())
                });
            if !fits {
                bail!(
                    "cache join: cache {i} was made for another model than cache 0 (layers, state \
                     shapes, dtype or device differ)"
                )
            }
        }
        let layers = (0..n)
            .map(|l| {
                let cat = |f: fn(&LayerState) -> &Tensor| {
                    let ts: Vec<&Tensor> = parts.iter().map(|p| f(&p.layers[l])).collect();
                    Tensor::cat(&ts, 0)
                };
                Ok(LayerState {
                    conv: cat(|s| &s.conv)?,
                    ssm: cat(|s| &s.ssm)?,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            layers,
            tokens: parts
                .iter()
                .flat_map(|p| p.tokens.iter().copied())
                .collect(),
        })
    }

    /// A cache of the rows `rows` of this one, in that order (each at most once).
    pub fn select(&self, rows: &[usize]) -> Result<Self> {
        let batch = self.batch_size();
        if rows.is_empty() {
            bail!("cache select: no rows given (a cache holds at least one sequence)")
        }
        let mut seen = vec![false; batch];
        for &r in rows {
            match seen.get_mut(r) {
                Some(s) if !*s => *s = true,
                Some(_) => bail!("cache select: row {r} is given twice"),
                None => bail!("cache select: row {r} is out of range for {batch} rows"),
            }
        }
        let device = match self.layers.first() {
            Some(l) => l.ssm.device().clone(),
            None => bail!("cache select: the cache has no layers"),
        };
        let index: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        let index = Tensor::new(index.as_slice(), &device)?;
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok(LayerState {
                    conv: l.conv.index_select(&index, 0)?,
                    ssm: l.ssm.index_select(&index, 0)?,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            layers,
            tokens: rows.iter().map(|&r| self.tokens[r]).collect(),
        })
    }

    /// Checks that this cache fits a `config` model in `dtype` on `device`, fed `batch` sequences.
    pub(crate) fn check(
        &self,
        config: &Config,
        batch: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<()> {
        if batch != self.batch_size() {
            bail!(
                "the input has batch size {batch} but the cache was made for {}",
                self.batch_size()
            )
        }
        let conv = [batch, config.conv_dim(), config.d_conv];
        let ssm = [batch, config.nheads, config.headdim, config.d_state];
        let fits = self.layers.len() == config.n_layer
            && self.layers.iter().all(|l| {
                l.conv.dims() == conv
                    && l.ssm.dims() == ssm
                    && l.conv.dtype() == dtype
                    && l.conv.device().same_device(device)
                    && l.ssm.device().same_device(device)
            });
        if !fits {
            bail!("the cache was made for another model (layers, state shapes, dtype or device differ)")
        }
        Ok(())
    }
}

// A cache must be able to move between threads (see the module doc): a field that is not
// `Send + Sync` breaks the build here rather than in a user's code.
const _: fn() = || {
    fn movable<T: Send + Sync>() {}
    movable::<Cache>();
};
