//! Model directories from the Hugging Face Hub (`hf-hub`, rustls; files land in its cache, by
//! default `~/.cache/huggingface/hub`, honouring `HF_HOME` and `HF_TOKEN`).
//!
//! Downloads `config.json`, the weights in the first form the repository has (sharded
//! safetensors with their index, `model.safetensors`, or `pytorch_model.bin`) and `tokenizer.json`
//! when present; the files end up side by side in one snapshot directory, which
//! [`crate::Model::load`] reads like any local directory. state-spaces checkpoints ship no
//! tokenizer (they use GPT-NeoX's); [`download_tokenizer`] fetches one from another repository.
//!
//! Only files that the repository lists are downloaded, and only plain file names: the shard
//! names come from the repository's index, and a name with a path in it would land outside the
//! snapshot directory, so an index naming anything else is an error.

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
    if !has("config.json") {
        bail!("{what} has no config.json")
    }
    let config = get(&repo, &what, "config.json")?;
    if has(SHARD_INDEX) {
        let index = get(&repo, &what, SHARD_INDEX)?;
        for shard in listed_shards(&files, shard_names(&index)?, &what)? {
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

/// `shards` (plain file names, as [`shard_names`] returns them) when `files`, the repository's
/// listing, has every one of them.
fn listed_shards(files: &[&str], shards: Vec<String>, what: &str) -> Result<Vec<String>> {
    match shards.iter().find(|s| !files.contains(&s.as_str())) {
        Some(missing) => {
            bail!("{what}: {SHARD_INDEX} names {missing:?}, which the repository does not list")
        }
        None => Ok(shards),
    }
}

/// Downloads `tokenizer.json` from `repo_id` (e.g. `EleutherAI/gpt-neox-20b`).
pub fn download_tokenizer(repo_id: &str, revision: &str) -> Result<PathBuf> {
    get(
        &repo(repo_id, revision)?,
        &format!("{repo_id}@{revision}"),
        "tokenizer.json",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_listed_plain_shards_are_downloaded() -> Result<()> {
        let files = [
            "config.json",
            SHARD_INDEX,
            "a.safetensors",
            "sub/b.safetensors",
        ];
        let shards = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<Vec<_>>();
        let listed = listed_shards(&files, shards(&["a.safetensors"]), "r@main");
        assert_eq!(listed.ok(), Some(shards(&["a.safetensors"])));
        let err = listed_shards(
            &files,
            shards(&["a.safetensors", "c.safetensors"]),
            "r@main",
        )
        .map(|_| ())
        .unwrap_err()
        .to_string();
        assert!(err.contains("names \"c.safetensors\", which the repository does not list"));

        // A listed name with a path in it is refused by `shard_names` before the listing is asked.
        let dir = std::env::temp_dir().join(format!("mamba2-hub-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let index = dir.join(SHARD_INDEX);
        for name in ["sub/b.safetensors", "../x.safetensors", "/etc/passwd"] {
            let json = format!(r#"{{"weight_map": {{"w": {name:?}}}}}"#);
            std::fs::write(&index, json)?;
            let err = shard_names(&index).map(|_| ()).unwrap_err().to_string();
            assert!(err.contains("is not a plain file name"), "{err}");
        }
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    }
}
