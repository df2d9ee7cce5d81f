//! The safetensors side of a checkpoint: the shard names of an index and the checked header of
//! each safetensors file.

use std::collections::BTreeSet;
use std::fs::File;
use std::io::Read;
use std::path::Path;

use candle_core::{bail, Result};

use super::confine::plain_file_name;
use super::Checkpoint;

/// Reads `path` whole when it has at most `limit` bytes.
fn read_capped(path: &Path, shown: &str, limit: u64) -> Result<Vec<u8>> {
    let cannot =
        |e: &dyn std::fmt::Display| candle_core::Error::msg(format!("cannot read {shown}: {e}"));
    let mut bytes = Vec::new();
    File::open(path)
        .map_err(|e| cannot(&e))?
        .take(limit + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| cannot(&e))?;
    if bytes.len() as u64 > limit {
        return Err(cannot(&format!("larger than the limit of {limit} bytes")));
    }
    Ok(bytes)
}

/// The shard file names of a `model.safetensors.index.json`: the distinct values of its
/// `weight_map`, sorted, each a plain file name.
#[cfg(feature = "hub")]
pub(crate) fn shard_names(index: &Path) -> Result<Vec<String>> {
    shard_names_of(index, &index.display().to_string())
}

/// The shard file names of the index `index`, called `shown` in errors.
pub(super) fn shard_names_of(index: &Path, shown: &str) -> Result<Vec<String>> {
    let bytes = read_capped(index, shown, Checkpoint::MAX_INDEX_BYTES)?;
    let json: serde_json::Value = serde_json::from_slice(&bytes)
        .map_err(|e| candle_core::Error::msg(format!("{shown}: invalid JSON: {e}")))?;
    let Some(map) = json.get("weight_map").and_then(|m| m.as_object()) else {
        bail!("{shown}: no \"weight_map\" object")
    };
    let mut names = BTreeSet::new();
    for (tensor, file) in map {
        let Some(file) = file.as_str() else {
            bail!("{shown}: weight_map entry for {tensor} is not a file name: {file}")
        };
        plain_file_name(file)
            .map_err(|e| e.context(format!("{shown}: weight_map entry for {tensor}")))?;
        names.insert(file.to_string());
    }
    if names.is_empty() {
        bail!("{shown}: weight_map is empty")
    }
    Ok(names.into_iter().collect())
}

/// The tensor names of the safetensors file `path` (`shown` in errors), after checking that its
/// header fits the file and the limit and that every tensor's bytes lie inside the file.
pub(super) fn safetensors_names(path: &Path, shown: &str) -> Result<Vec<String>> {
    let cannot = |e: std::io::Error| candle_core::Error::msg(format!("cannot read {shown}: {e}"));
    let mut file = File::open(path).map_err(cannot)?;
    let len = file.metadata().map_err(cannot)?.len();
    let mut n = [0u8; 8];
    if len < 8 {
        bail!("{shown} is {len} bytes: too short for a safetensors file (8-byte header length)")
    }
    file.read_exact(&mut n).map_err(cannot)?;
    let n = u64::from_le_bytes(n);
    if n > Checkpoint::MAX_HEADER_BYTES {
        bail!(
            "{shown} declares a safetensors header of {n} bytes, above the limit of {}",
            Checkpoint::MAX_HEADER_BYTES
        )
    }
    let data = len - 8;
    if n > data {
        bail!("{shown} declares a safetensors header of {n} bytes but has {data} after the length")
    }
    let mut header = vec![0u8; n as usize];
    file.read_exact(&mut header).map_err(cannot)?;
    let json: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&header)
        .map_err(|e| {
            candle_core::Error::msg(format!("{shown}: invalid safetensors header: {e}"))
        })?;
    let data = data - n;
    let mut names = Vec::new();
    for (name, info) in json {
        if name == "__metadata__" {
            continue;
        }
        let offsets = info
            .get("data_offsets")
            .and_then(|o| o.as_array())
            .map(|o| o.iter().map(|v| v.as_u64()).collect::<Vec<_>>());
        match offsets.as_deref() {
            Some(&[Some(start), Some(end)]) if start <= end && end <= data => names.push(name),
            _ => bail!(
                "tensor {name} in {shown}: data_offsets must be [start, end] with start <= end \
                 <= {data} (the data bytes of the file), got {}",
                info.get("data_offsets").unwrap_or(&serde_json::Value::Null)
            ),
        }
    }
    Ok(names)
}
