//! Model directories from the Hugging Face Hub (`hf-hub`, rustls; files land in its cache, by
//! default `~/.cache/huggingface/hub`, honouring `HF_HOME` and `HF_TOKEN`).
//!
//! Downloads `config.json`, the weights in the first form the repository has (sharded
//! safetensors with their index, `model.safetensors`, or `pytorch_model.bin`) and `tokenizer.json`
//! when present; the files end up side by side in one snapshot directory, which
//! [`crate::Model::load`] reads like any local directory. state-spaces checkpoints ship no
//! tokenizer (they use GPT-NeoX's); [`download_tokenizer`] fetches one from another repository.

use std::path::PathBuf;

use candle_core::{bail, Result};
use hf_hub::api::sync::{Api, ApiRepo};
use hf_hub::{Repo, RepoType};

use crate::checkpoint::{shard_names, PYTORCH_BIN, SAFETENSORS, SHARD_INDEX};

/// A downloaded model: its snapshot directory and, when the repository has one, its tokenizer.
#[derive(Clone, Debug)]
pub struct HubModel {
    pub dir: PathBuf,
    pub tokenizer: Option<PathBuf>,
}

fn repo(model_id: &str, revision: &str) -> Result<ApiRepo> {
    let api = Api::new().map_err(|e| candle_core::Error::msg(format!("hf-hub: {e}")))?;
    Ok(api.repo(Repo::with_revision(
        model_id.to_string(),
        RepoType::Model,
        revision.to_string(),
    )))
}

fn get(repo: &ApiRepo, what: &str, file: &str) -> Result<PathBuf> {
    repo.get(file)
        .map_err(|e| candle_core::Error::msg(format!("cannot download {file} from {what}: {e}")))
}

/// Downloads the model files of `model_id` at `revision` (a branch, tag or commit).
pub fn download(model_id: &str, revision: &str) -> Result<HubModel> {
    let what = format!("{model_id}@{revision}");
    let repo = repo(model_id, revision)?;
    let info = repo
        .info()
        .map_err(|e| candle_core::Error::msg(format!("cannot list {what}: {e}")))?;
    let files: Vec<&str> = info.siblings.iter().map(|s| s.rfilename.as_str()).collect();
    let has = |f: &str| files.contains(&f);
    let config = get(&repo, &what, "config.json")?;
    if has(SHARD_INDEX) {
        let index = get(&repo, &what, SHARD_INDEX)?;
        let shards = shard_names(&index)?;
        for shard in shards {
            get(&repo, &what, &shard)?;
        }
    } else if has(SAFETENSORS) {
        get(&repo, &what, SAFETENSORS)?;
    } else if has(PYTORCH_BIN) {
        get(&repo, &what, PYTORCH_BIN)?;
    } else {
        bail!("{what} has no {SHARD_INDEX}, {SAFETENSORS} or {PYTORCH_BIN}")
    }
    let tokenizer = has("tokenizer.json")
        .then(|| get(&repo, &what, "tokenizer.json"))
        .transpose()?;
    let Some(dir) = config.parent() else {
        bail!("hf-hub returned {} without a directory", config.display())
    };
    Ok(HubModel {
        dir: dir.to_path_buf(),
        tokenizer,
    })
}

/// Downloads `tokenizer.json` from `repo_id` (e.g. `EleutherAI/gpt-neox-20b`).
pub fn download_tokenizer(repo_id: &str, revision: &str) -> Result<PathBuf> {
    get(
        &repo(repo_id, revision)?,
        &format!("{repo_id}@{revision}"),
        "tokenizer.json",
    )
}
