//! Checkpoints of a training run: a model directory in the HF layout that `generate` and
//! `perplexity` load (`config.json`, `model.safetensors`, `tokenizer.json`), plus what a resumed
//! run needs — `trainer_state.json` (step, tokens, the sampler's state, the settings, the data's
//! fingerprint), `trainer_state.safetensors` (AdamW's moments), `train_log.csv` and `loss.svg`.
//!
//! Atomicity: `TrainableModel::save` writes the HF files into a staging directory `.OUT.saving`
//! beside `OUT` (itself atomically); the trainer's files are then written into that staging
//! directory and synced, `trainer_state.json` last, and the staging directory replaces `OUT` by
//! renames (`OUT` → `.OUT.old`, `.OUT.saving` → `OUT`, `.OUT.old` removed). Weights and trainer
//! state therefore move together: `OUT` is always the previous complete checkpoint or the new
//! one; a crash leaves at most a stale `.OUT.saving` (removed by the next save) or, between the
//! two renames, the previous checkpoint as `.OUT.old`, which `--resume OUT` points to.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use candle_core::{Device, Tensor};
use mamba2::model::{Config, TrainableModel};
use serde::{Deserialize, Serialize};

use crate::adamw::AdamW;
use crate::cli::Settings;
use crate::curve::{self, Row};

pub const STATE: &str = "trainer_state.json";
pub const MOMENTS: &str = "trainer_state.safetensors";
pub const LOG: &str = "train_log.csv";
pub const PLOT: &str = "loss.svg";
pub const TOKENIZER: &str = "tokenizer.json";

/// The `format` of `trainer_state.json`: a file of another format is not resumed.
const FORMAT: &str = "mamba2 train checkpoint 1";

/// Where a run stands, saved with every checkpoint.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TrainerState {
    pub format: String,
    /// Optimizer steps done.
    pub step: usize,
    /// Training tokens seen.
    pub tokens: u64,
    /// The batch sampler's state after the last step.
    pub sampler: u64,
    pub settings: Settings,
    pub data: DataRecord,
    /// The ranks (GPUs) of the run that wrote this checkpoint, for information only: the data
    /// position and the optimizer state are global, so any number of ranks continues it.
    #[serde(default = "one")]
    pub world_size: usize,
}

/// The world size of checkpoints written before runs had several ranks.
fn one() -> usize {
    1
}

/// The text a run trains on.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DataRecord {
    pub path: PathBuf,
    pub train_tokens: usize,
    pub heldout_tokens: usize,
    pub fingerprint: String,
}

impl TrainerState {
    pub fn new(
        step: usize,
        tokens: u64,
        sampler: u64,
        settings: Settings,
        data: DataRecord,
        world_size: usize,
    ) -> Self {
        Self {
            format: FORMAT.into(),
            step,
            tokens,
            sampler,
            settings,
            data,
            world_size,
        }
    }
}

/// The parent directory of `dir` and its name (an error when it has none, as `.` or `/`).
fn split(dir: &Path) -> Result<(PathBuf, String)> {
    let Some(name) = dir.file_name().and_then(|n| n.to_str()) else {
        bail!(
            "{} has no directory name: name the checkpoint directory, e.g. runs/model",
            dir.display()
        )
    };
    let parent = match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    Ok((parent, name.to_string()))
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))?;
    sync(path)
}

fn sync(path: &Path) -> Result<()> {
    fs::File::open(path)
        .and_then(|f| f.sync_all())
        .with_context(|| format!("syncing {}", path.display()))
}

/// Checks, before the first step, that checkpoints can be written to `out`: it is a directory
/// (created if missing) that is empty, the one being resumed, or a checkpoint of this program
/// that `overwrite` lets go; a probe file can be written and removed in it and beside it (where
/// the staging directory goes).
pub fn prepare_out(out: &Path, resume: Option<&Path>, overwrite: bool) -> Result<()> {
    let (parent, name) = split(out).map_err(|e| anyhow!("--out {e}"))?;
    if out.exists() && !out.is_dir() {
        bail!("--out {} is a file, not a directory", out.display())
    }
    let resuming_here = match (resume, out.canonicalize()) {
        (Some(r), Ok(o)) => r.canonicalize().is_ok_and(|r| r == o),
        _ => false,
    };
    let occupied = fs::read_dir(out).is_ok_and(|mut d| d.next().is_some());
    // A save replaces the whole directory: only a checkpoint of this program may be replaced.
    if occupied && !resuming_here && !out.join(STATE).is_file() {
        bail!(
            "--out {} holds files that are not a checkpoint of the train example, and a save \
             replaces the whole directory: choose a new or empty --out",
            out.display()
        )
    }
    if occupied && !resuming_here && !overwrite {
        bail!(
            "--out {} already holds a checkpoint: continue it with --resume {0}, or pass \
             --overwrite to replace it at the first save, or choose another --out",
            out.display()
        )
    }
    fs::create_dir_all(out)
        .map_err(|e| anyhow!("--out {} cannot be created: {e}", out.display()))?;
    for probe in [
        out.join(".write-probe"),
        parent.join(format!(".{name}.probe")),
    ] {
        fs::write(&probe, b"probe")
            .and_then(|_| fs::remove_file(&probe))
            .map_err(|e| {
                anyhow!(
                    "--out {} cannot be written ({}): {e}",
                    out.display(),
                    probe.display()
                )
            })?;
    }
    Ok(())
}

/// Everything a checkpoint holds.
pub struct Checkpoint<'a> {
    pub trainable: &'a TrainableModel,
    pub optimizer: &'a AdamW,
    pub state: &'a TrainerState,
    pub tokenizer_json: &'a [u8],
    pub rows: &'a [Row],
    pub title: &'a str,
    /// The largest weight file (`--max-shard-mib`).
    pub shard_bytes: usize,
}

/// Writes `c` to `out` atomically (see the module doc).
pub fn save(out: &Path, c: &Checkpoint) -> Result<()> {
    let (parent, name) = split(out)?;
    let staging = parent.join(format!(".{name}.saving"));
    if staging.exists() {
        fs::remove_dir_all(&staging).with_context(|| format!("removing {}", staging.display()))?;
    }
    c.trainable
        .save(&staging, None, c.shard_bytes)
        .with_context(|| format!("saving the weights to {}", staging.display()))?;
    write_synced(&staging.join(TOKENIZER), c.tokenizer_json)?;
    let moments: HashMap<String, Tensor> = c.optimizer.state().into_iter().collect();
    let file = staging.join(MOMENTS);
    candle_core::safetensors::save(&moments, &file)
        .with_context(|| format!("writing {}", file.display()))?;
    sync(&file)?;
    write_synced(&staging.join(LOG), curve::to_csv(c.rows).as_bytes())?;
    write_synced(
        &staging.join(PLOT),
        curve::plot(c.rows, c.title)?.as_bytes(),
    )?;
    let state = serde_json::to_string_pretty(c.state)?;
    // Last: a staging directory with trainer_state.json is complete.
    write_synced(&staging.join(STATE), state.as_bytes())?;

    let old = parent.join(format!(".{name}.old"));
    if old.exists() {
        fs::remove_dir_all(&old).with_context(|| format!("removing {}", old.display()))?;
    }
    if out.exists() {
        fs::rename(out, &old).with_context(|| format!("moving {} aside", out.display()))?;
    }
    fs::rename(&staging, out)
        .with_context(|| format!("moving the checkpoint to {}", out.display()))?;
    if old.exists() {
        fs::remove_dir_all(&old).with_context(|| format!("removing {}", old.display()))?;
    }
    // The renames are durable once the directory holding them is synced.
    sync(&parent)
}

/// Reads `dir/trainer_state.json`: an error saying what `dir` is when it is no checkpoint of
/// this program.
pub fn read_state(dir: &Path) -> Result<TrainerState> {
    if !dir.is_dir() {
        let old = split(dir).ok().map(|(p, n)| p.join(format!(".{n}.old")));
        if let Some(old) = old.filter(|o| o.join(STATE).is_file()) {
            bail!(
                "--resume {} does not exist, but {} does: a save was interrupted between its two \
                 renames, and that is the last complete checkpoint (rename it to {0} to resume)",
                dir.display(),
                old.display()
            )
        }
        let what = if dir.exists() {
            "is not a directory"
        } else {
            "does not exist"
        };
        bail!("--resume {} {what}", dir.display())
    }
    let file = dir.join(STATE);
    if !file.is_file() {
        bail!(
            "--resume {} is not a checkpoint of the train example (it has no {STATE}); to \
             fine-tune the model in it, pass --weights {0}",
            dir.display()
        )
    }
    let text = fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
    let state: TrainerState =
        serde_json::from_str(&text).map_err(|e| anyhow!("{}: {e}", file.display()))?;
    if state.format != FORMAT {
        bail!(
            "{}: format {:?}, expected {FORMAT:?}",
            file.display(),
            state.format
        )
    }
    Ok(state)
}

/// What `--resume DIR` continues from, besides its [`TrainerState`].
pub struct Resumed {
    pub trainable: TrainableModel,
    pub moments: HashMap<String, Tensor>,
    pub rows: Vec<Row>,
    pub tokenizer_json: Vec<u8>,
}

/// Loads the weights (in the run's dtype), moments, log and tokenizer of checkpoint `dir`.
pub fn load(dir: &Path, state: &TrainerState, device: &Device) -> Result<Resumed> {
    let trainable = TrainableModel::load(dir, state.settings.dtype()?, device)
        .with_context(|| format!("loading the weights of {}", dir.display()))?;
    let file = dir.join(MOMENTS);
    let moments = candle_core::safetensors::load(&file, device)
        .with_context(|| format!("reading the optimizer state {}", file.display()))?;
    let file = dir.join(LOG);
    let log = fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
    let rows = curve::from_csv(&log).with_context(|| format!("reading {}", file.display()))?;
    if rows.last().is_some_and(|r| r.step != state.step) {
        bail!(
            "{} ends at another step than {STATE}'s {}",
            file.display(),
            state.step
        )
    }
    let file = dir.join(TOKENIZER);
    let tokenizer_json = fs::read(&file).with_context(|| format!("reading {}", file.display()))?;
    Ok(Resumed {
        trainable,
        moments,
        rows,
        tokenizer_json,
    })
}

/// An error naming every field in which `theirs` (from `what`) differs from `ours`.
pub fn same_config(ours: &Config, theirs: &Config, what: &str) -> Result<()> {
    let (a, b) = (ours.to_hf_json(), theirs.to_hf_json());
    let (Some(a), Some(b)) = (a.as_object(), b.as_object()) else {
        bail!("a config did not serialise to a JSON object")
    };
    let diffs: Vec<String> = a
        .iter()
        .filter(|(k, v)| b.get(*k) != Some(*v))
        .map(|(k, v)| {
            format!(
                "{k} {v} in the checkpoint, {} in {what}",
                b.get(k).unwrap_or(&serde_json::Value::Null)
            )
        })
        .collect();
    if !diffs.is_empty() {
        bail!(
            "the checkpoint is another model than {what}: {}",
            diffs.join("; ")
        )
    }
    Ok(())
}
