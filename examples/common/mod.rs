//! What the examples share: where the model comes from (a directory, the repo's `weights/`, or
//! the Hugging Face Hub), its device and dtype, and where its tokenizer comes from.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use mamba2::model::{hub, load_tokenizer, Model, Tokenizer};

/// The model flags of every example.
#[derive(clap::Args, Debug)]
pub struct ModelArgs {
    /// A model directory: config.json + model.safetensors (or sharded with
    /// model.safetensors.index.json, or pytorch_model.bin) [default: the repo's weights/]
    #[arg(long, conflicts_with = "model_id")]
    pub weights: Option<PathBuf>,
    /// Download this model from the Hugging Face Hub instead (e.g. state-spaces/mamba2-130m)
    #[arg(long)]
    pub model_id: Option<String>,
    /// The Hub revision (branch, tag or commit) of --model-id
    #[arg(long, default_value = "main")]
    pub revision: String,
    /// A tokenizer.json to use instead of the model's
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Hub repository of the tokenizer when --model-id has none (state-spaces models use GPT-NeoX's)
    #[arg(long, default_value = "EleutherAI/gpt-neox-20b")]
    pub tokenizer_id: String,
    /// cpu, cuda or cuda:N
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Weights and activations: f32, f16 or bf16
    #[arg(long, default_value = "f32")]
    pub dtype: String,
}

/// A loaded model, the directory it came from and its tokenizer (`None` when none was found).
pub struct Loaded {
    pub model: Model,
    pub dir: PathBuf,
    pub tokenizer: Option<Tokenizer>,
}

fn device(spec: &str) -> Result<Device> {
    Ok(match spec {
        "cpu" => Device::Cpu,
        "cuda" => Device::new_cuda(0)?,
        s => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(n)) => Device::new_cuda(n)?,
            _ => bail!("--device must be cpu, cuda or cuda:N, got {s:?}"),
        },
    })
}

fn dtype(spec: &str) -> Result<DType> {
    Ok(match spec {
        "f32" => DType::F32,
        "f16" => DType::F16,
        "bf16" => DType::BF16,
        s => bail!("--dtype must be f32, f16 or bf16, got {s:?}"),
    })
}

impl ModelArgs {
    /// Finds the model directory and tokenizer, and loads the model.
    pub fn load(&self) -> Result<Loaded> {
        let (dir, hub_tokenizer) = match (&self.weights, &self.model_id) {
            (_, Some(id)) => {
                eprintln!(
                    "downloading {id}@{} from the Hugging Face Hub",
                    self.revision
                );
                let m = hub::download(id, &self.revision)?;
                let tokenizer = match (m.tokenizer, &self.tokenizer) {
                    (_, Some(_)) => None,
                    (Some(t), None) => Some(t),
                    (None, None) => {
                        eprintln!("{id} has no tokenizer.json; using {}'s", self.tokenizer_id);
                        Some(hub::download_tokenizer(&self.tokenizer_id, "main")?)
                    }
                };
                (m.dir, tokenizer)
            }
            (Some(dir), None) => (dir.clone(), None),
            (None, None) => {
                let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("weights");
                if !dir.join("config.json").is_file() {
                    bail!(
                        "the repo's default model directory {} has no model yet (no config.json); \
                         pass --weights DIR or --model-id ID",
                        dir.display()
                    )
                }
                (dir, None)
            }
        };
        let tokenizer_file = self
            .tokenizer
            .clone()
            .or(hub_tokenizer)
            .or_else(|| Some(dir.join("tokenizer.json")).filter(|p| p.is_file()));
        let tokenizer = tokenizer_file.map(load_tokenizer).transpose()?;
        let model = Model::load(&dir, dtype(&self.dtype)?, &device(&self.device)?)
            .with_context(|| format!("loading the model in {}", dir.display()))?;
        Ok(Loaded {
            model,
            dir,
            tokenizer,
        })
    }
}
