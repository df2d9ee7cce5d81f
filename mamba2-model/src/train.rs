//! A Mamba-2 model to train: its weights are candle `Var`s in a candle-nn `VarMap`, held in f32
//! (the master weights an optimizer updates), under the HF tensor names.
//!
//! Each training step builds a [`Model`] view on the current weights ([`TrainableModel::model`]):
//! every weight read from the `VarMap` in the compute dtype (f32, or bf16 with the master
//! weights staying f32), and the derived tensors (`a = −exp(A_log)`) computed anew, so that an
//! optimizer's in-place updates are seen. [`Model::loss`] on that view is differentiable with
//! respect to every `Var` through candle's autograd and the kernels crate's backward passes.
//!
//! Weights come from any checkpoint [`Model::load`] reads ([`TrainableModel::load`]: safetensors,
//! sharded or not, PyTorch pickles; HF or state-spaces names) or are initialised from a config
//! ([`TrainableModel::init`], seeded), and are saved in the HF layout
//! ([`TrainableModel::save`]).

use std::path::Path;
use std::sync::Arc;

use candle_core::{bail, DType, Device, Result, Shape, Tensor, Var};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder, VarMap};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Normal};

use crate::checkpoint::{save_hf, ModelDir};
use crate::{Checkpoint, Config, ConfigFormat, Model};

/// The embedding's name in the state-spaces layout and in the HF layout the master weights use.
const EMBEDDING_ORIGINAL: &str = "backbone.embedding.weight";
const EMBEDDING_HF: &str = "backbone.embeddings.weight";

/// The master weights of a Mamba-2 model and the dtype its steps compute in.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use mamba2_model::TrainableModel;
///
/// let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../weights");
/// let trainable = TrainableModel::load(dir, DType::F32, &Device::Cpu)?;
/// let ids = Tensor::new(&[[5u32, 17, 260, 31, 9]], &Device::Cpu)?;
/// let loss = trainable.model()?.loss(&ids)?;
/// let grads = loss.backward()?;
/// // Every weight gets a gradient.
/// assert!(trainable.vars().iter().all(|(_, v)| grads.get(v.as_tensor()).is_some()));
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Clone)]
pub struct TrainableModel {
    config: Config,
    varmap: VarMap,
    dtype: DType,
    device: Device,
}

impl TrainableModel {
    /// Loads `dir`'s config and weights (as [`Model::load`] does, every stored tensor used) into
    /// f32 master weights on `device`; steps compute in `dtype` (f32 or bf16).
    pub fn load(dir: impl AsRef<Path>, dtype: DType, device: &Device) -> Result<Self> {
        let dir = dir.as_ref();
        if !dir.is_dir() {
            bail!("model directory {} does not exist", dir.display())
        }
        let config_file = ModelDir::new(dir)?.resolve("config.json", "config", "")?;
        let mut config = Config::read(&config_file, &dir.join("config.json"))?;
        let checkpoint = Checkpoint::open(dir)?;
        let varmap = VarMap::new();
        let loader = Loader {
            checkpoint: checkpoint.clone(),
            varmap: varmap.clone(),
        };
        Model::new(
            &config,
            VarBuilder::from_backend(Box::new(loader), DType::F32, device.clone()),
        )?;
        let unread: Vec<String> = checkpoint
            .unread()?
            .into_iter()
            .filter(|n| !(config.tie_embeddings && n == "lm_head.weight"))
            .collect();
        if !unread.is_empty() {
            bail!(
                "{} has {} tensors that the config does not use: {}",
                checkpoint.source(),
                unread.len(),
                unread[..unread.len().min(8)].join(", ")
            )
        }
        // The master weights carry HF names, and the config is written in the HF format.
        config.format = ConfigFormat::Hf;
        Self::new(config, varmap, dtype, device)
    }

    /// A model of `config` with fresh weights on `device`, drawn from `seed` as HF transformers
    /// initialises `Mamba2ForCausalLM` (embeddings and projections N(0, 0.02²), biases 0, the
    /// conv like PyTorch's `Conv1d`, A_log = log(1..H), D = 1, dt_bias = softplus⁻¹ of a step
    /// log-uniform in [0.001, 0.1], norm weights 1), out_proj scaled by 1/√n_layer (the
    /// prenorm-residual rescale of GPT-2 and mamba_ssm).
    pub fn init(config: &Config, seed: u64, dtype: DType, device: &Device) -> Result<Self> {
        config.validate()?;
        let mut config = config.clone();
        config.format = ConfigFormat::Hf;
        let varmap = VarMap::new();
        let init = Initializer {
            varmap: varmap.clone(),
            rng: Arc::new(std::sync::Mutex::new(StdRng::seed_from_u64(seed))),
            config: config.clone(),
        };
        Model::new(
            &config,
            VarBuilder::from_backend(Box::new(init), DType::F32, device.clone()),
        )?;
        Self::new(config, varmap, dtype, device)
    }

    fn new(config: Config, varmap: VarMap, dtype: DType, device: &Device) -> Result<Self> {
        if !matches!(dtype, DType::F32 | DType::BF16) {
            bail!("the compute dtype of training must be f32 or bf16, got {dtype:?}")
        }
        Ok(Self {
            config,
            varmap,
            dtype,
            device: device.clone(),
        })
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

    /// The master weights, by name (sorted), for an optimizer.
    pub fn vars(&self) -> Vec<(String, Var)> {
        let data = match self.varmap.data().lock() {
            Ok(d) => d.clone(),
            Err(p) => p.into_inner().clone(),
        };
        let mut vars: Vec<(String, Var)> = data.into_iter().collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        vars
    }

    /// The number of weights (a tied lm_head counted once).
    pub fn parameter_count(&self) -> usize {
        self.vars().iter().map(|(_, v)| v.elem_count()).sum()
    }

    /// A model on the current weights, computing in the compute dtype; run it for each step (it
    /// reads the weights as they are then). Unlike [`Model::new`] it does not wait for the device
    /// (a training step builds one): use it on the thread that built it, or synchronise the
    /// device before another thread does (see the thread rules on [`Model`]).
    pub fn model(&self) -> Result<Model> {
        let master = Master(self.varmap.clone());
        let vb = VarBuilder::from_backend(Box::new(master), self.dtype, self.device.clone());
        Model::new_unsynchronized(&self.config, vb)
    }

    /// Writes the model to `dir` in the HF layout — `config.json`, `model.safetensors` (or shards
    /// of at most `shard_bytes` with `model.safetensors.index.json`) in f32, and `tokenizer` copied
    /// as `tokenizer.json` when given — atomically: the files are written to a sibling directory
    /// that replaces `dir` once complete, so a crash never leaves a half-written checkpoint.
    pub fn save(
        &self,
        dir: impl AsRef<Path>,
        tokenizer: Option<&Path>,
        shard_bytes: usize,
    ) -> Result<()> {
        let mut tensors: Vec<(String, Tensor)> = self
            .vars()
            .into_iter()
            .filter(|(name, _)| !(self.config.tie_embeddings && name == "lm_head.weight"))
            .map(|(name, v)| (name, v.as_tensor().detach()))
            .collect();
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        save_hf(dir.as_ref(), &self.config, &tensors, tokenizer, shard_bytes)
    }

    /// Copies the weights of `other` (same config) into these, e.g. after resuming.
    pub fn assign(&self, other: &TrainableModel) -> Result<()> {
        let theirs = other.vars();
        let ours = self.vars();
        if theirs.len() != ours.len() || theirs.iter().zip(&ours).any(|(a, b)| a.0 != b.0) {
            bail!("the two models do not have the same weights")
        }
        for ((name, src), (_, dst)) in theirs.iter().zip(&ours) {
            if src.shape() != dst.shape() {
                bail!("{name}: shape {:?} against {:?}", src.shape(), dst.shape())
            }
            dst.set(src.as_tensor())?;
        }
        Ok(())
    }
}

/// The `VarMap` as a backend that reads existing master weights only, in the requested dtype.
struct Master(VarMap);

impl SimpleBackend for Master {
    fn get(&self, s: Shape, name: &str, _: Init, dtype: DType, _: &Device) -> Result<Tensor> {
        let name = hf_name(name);
        let var = match self.0.data().lock() {
            Ok(d) => d.get(name).cloned(),
            Err(_) => bail!("the master weights' lock is poisoned"),
        };
        let Some(var) = var else {
            bail!("no master weight {name}")
        };
        if var.shape() != &s {
            bail!(
                "{name}: the model asks for {s:?}, the master weight is {:?}",
                var.shape()
            )
        }
        var.as_tensor().to_dtype(dtype)
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> Result<Tensor> {
        bail!("{name}: the master weights are read by shape")
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.0
            .data()
            .lock()
            .is_ok_and(|d| d.contains_key(hf_name(name)))
    }
}

/// Reads a checkpoint's tensors in f32 into new master weights under HF names.
struct Loader {
    checkpoint: Checkpoint,
    varmap: VarMap,
}

impl SimpleBackend for Loader {
    fn get(&self, s: Shape, name: &str, h: Init, _: DType, dev: &Device) -> Result<Tensor> {
        let t = self.checkpoint.get(s, name, h, DType::F32, dev)?;
        let var = Var::from_tensor(&t)?;
        match self.varmap.data().lock() {
            Ok(mut d) => d.insert(hf_name(name).to_string(), var.clone()),
            Err(_) => bail!("the master weights' lock is poisoned"),
        };
        Ok(var.as_tensor().clone())
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> Result<Tensor> {
        self.checkpoint.get_unchecked(name, dtype, dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.checkpoint.contains_tensor(name)
    }
}

fn hf_name(name: &str) -> &str {
    if name == EMBEDDING_ORIGINAL {
        EMBEDDING_HF
    } else {
        name
    }
}

/// Draws new master weights, as [`TrainableModel::init`] describes.
struct Initializer {
    varmap: VarMap,
    rng: Arc<std::sync::Mutex<StdRng>>,
    config: Config,
}

impl Initializer {
    /// The initial values of the weight `name` of `shape`.
    fn values(&self, name: &str, shape: &Shape) -> Result<Vec<f32>> {
        let n = shape.elem_count();
        let mut rng = match self.rng.lock() {
            Ok(r) => r,
            Err(_) => bail!("the initialiser's lock is poisoned"),
        };
        let normal = |rng: &mut StdRng, std: f32| -> Result<Vec<f32>> {
            let d = Normal::new(0f32, std).map_err(candle_core::Error::msg)?;
            Ok((0..n).map(|_| d.sample(rng)).collect())
        };
        let c = &self.config;
        let conv_bound = 1.0 / (c.d_conv as f32).sqrt();
        Ok(if name.ends_with("A_log") {
            (1..=n).map(|h| (h as f32).ln()).collect()
        } else if name.ends_with("mixer.D") {
            vec![1.0; n]
        } else if name.ends_with("dt_bias") {
            let (lo, hi) = (0.001f32.ln(), 0.1f32.ln());
            (0..n)
                .map(|_| {
                    let dt = (lo + (hi - lo) * rng.random::<f32>()).exp().max(1e-4);
                    // softplus⁻¹(dt) = dt + ln(1 − e^{−dt})
                    dt + (-(-dt).exp_m1()).ln()
                })
                .collect()
        } else if name.contains("conv1d.") {
            (0..n)
                .map(|_| rng.random_range(-conv_bound..conv_bound))
                .collect()
        } else if name.ends_with(".bias") {
            vec![0.0; n]
        } else if name.ends_with("out_proj.weight") {
            normal(&mut rng, 0.02 / (c.n_layer as f32).sqrt())?
        } else if name.ends_with("proj.weight")
            || name.ends_with("embeddings.weight")
            || name.ends_with("lm_head.weight")
        {
            normal(&mut rng, 0.02)?
        } else {
            // The norms' weights.
            vec![1.0; n]
        })
    }
}

impl SimpleBackend for Initializer {
    fn get(&self, s: Shape, name: &str, _: Init, _: DType, dev: &Device) -> Result<Tensor> {
        let name = hf_name(name);
        let values = self.values(name, &s)?;
        let var = Var::from_tensor(&Tensor::from_vec(values, s, dev)?)?;
        match self.varmap.data().lock() {
            Ok(mut d) => d.insert(name.to_string(), var.clone()),
            Err(_) => bail!("the master weights' lock is poisoned"),
        };
        Ok(var.as_tensor().clone())
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> Result<Tensor> {
        bail!("{name}: new weights are drawn by shape")
    }

    fn contains_tensor(&self, name: &str) -> bool {
        // The model looks for the HF embedding name first; a new model has every HF name.
        name != EMBEDDING_ORIGINAL
    }
}
