//! Writing a model directory in the HF layout, atomically: `config.json`, the weights as
//! `model.safetensors` or as shards with `model.safetensors.index.json`, and `tokenizer.json`.
//! Everything is written to a staging directory beside the target and synced, then swapped in
//! by renames, so that at every moment the target is either the old checkpoint or the new one:
//! an interrupted save leaves the staging directory behind, never a half-written checkpoint.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use candle_core::{bail, Result, Tensor};

use super::{SAFETENSORS, SHARD_INDEX};
use crate::Config;

fn io(what: &str, path: &Path, e: std::io::Error) -> candle_core::Error {
    candle_core::Error::msg(format!("cannot {what} {}: {e}", path.display()))
}

/// Writes `bytes` to `path` and flushes them to the disk.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    fs::write(path, bytes).map_err(|e| io("write", path, e))?;
    sync(path)
}

fn sync(path: &Path) -> Result<()> {
    fs::File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(|e| io("sync", path, e))
}

/// The tensors cut into shards of at most `max_bytes` each (a larger tensor alone in its shard).
fn shards(tensors: &[(String, Tensor)], max_bytes: usize) -> Vec<&[(String, Tensor)]> {
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, (_, t)) in tensors.iter().enumerate() {
        let size = t.elem_count() * t.dtype().size_in_bytes();
        if i > start && bytes + size > max_bytes {
            out.push(&tensors[start..i]);
            (start, bytes) = (i, 0);
        }
        bytes += size;
    }
    out.push(&tensors[start..]);
    out
}

/// Writes the checkpoint to `dir` (see the module doc); shards above `shard_bytes`.
pub(crate) fn save_hf(
    dir: &Path,
    config: &Config,
    tensors: &[(String, Tensor)],
    tokenizer: Option<&Path>,
    shard_bytes: usize,
) -> Result<()> {
    let Some(name) = dir.file_name().and_then(|n| n.to_str()) else {
        bail!(
            "cannot save a checkpoint to {}: no directory name",
            dir.display()
        )
    };
    if dir.exists() && !dir.is_dir() {
        bail!(
            "cannot save a checkpoint to {}: it is not a directory",
            dir.display()
        )
    }
    let parent = dir.parent().map_or(PathBuf::from("."), Path::to_path_buf);
    let parent = if parent.as_os_str().is_empty() {
        PathBuf::from(".")
    } else {
        parent
    };
    fs::create_dir_all(&parent).map_err(|e| io("create", &parent, e))?;
    let staging = parent.join(format!(".{name}.partial"));
    if staging.exists() {
        fs::remove_dir_all(&staging).map_err(|e| io("remove", &staging, e))?;
    }
    fs::create_dir(&staging).map_err(|e| io("create", &staging, e))?;

    let config_json = serde_json::to_string_pretty(&config.to_hf_json())
        .map_err(|e| candle_core::Error::msg(format!("cannot write config.json: {e}")))?;
    write_synced(&staging.join("config.json"), config_json.as_bytes())?;
    let parts = shards(tensors, shard_bytes.max(1));
    if parts.len() == 1 {
        let file = staging.join(SAFETENSORS);
        let map: HashMap<&str, Tensor> = tensors
            .iter()
            .map(|(n, t)| (n.as_str(), t.clone()))
            .collect();
        candle_core::safetensors::save(&map, &file)?;
        sync(&file)?;
    } else {
        let mut weight_map = serde_json::Map::new();
        let total: usize = tensors
            .iter()
            .map(|(_, t)| t.elem_count() * t.dtype().size_in_bytes())
            .sum();
        for (i, part) in parts.iter().enumerate() {
            let shard = format!("model-{:05}-of-{:05}.safetensors", i + 1, parts.len());
            let file = staging.join(&shard);
            let map: HashMap<&str, Tensor> =
                part.iter().map(|(n, t)| (n.as_str(), t.clone())).collect();
            candle_core::safetensors::save(&map, &file)?;
            sync(&file)?;
            for (n, _) in part.iter() {
                weight_map.insert(n.clone(), serde_json::Value::String(shard.clone()));
            }
        }
        let index =
            serde_json::json!({ "metadata": { "total_size": total }, "weight_map": weight_map });
        let text = serde_json::to_string_pretty(&index)
            .map_err(|e| candle_core::Error::msg(format!("cannot write the index: {e}")))?;
        write_synced(&staging.join(SHARD_INDEX), text.as_bytes())?;
    }
    if let Some(tok) = tokenizer {
        let bytes = fs::read(tok).map_err(|e| io("read the tokenizer", tok, e))?;
        write_synced(&staging.join("tokenizer.json"), &bytes)?;
    }

    // The swap: the old checkpoint moves aside, the new one into its place, the old one goes.
    let old = parent.join(format!(".{name}.old"));
    if old.exists() {
        fs::remove_dir_all(&old).map_err(|e| io("remove", &old, e))?;
    }
    if dir.exists() {
        fs::rename(dir, &old).map_err(|e| io("move aside", dir, e))?;
    }
    fs::rename(&staging, dir).map_err(|e| io("move into place", dir, e))?;
    if old.exists() {
        fs::remove_dir_all(&old).map_err(|e| io("remove", &old, e))?;
    }
    Ok(())
}
