//! Property tests: randomly mutated model directories (config values, shard names, safetensors
//! headers, bytes, truncations) and randomly mutated `pytorch_model.bin` archives either load and
//! run or fail with an error, never with a panic or an abort.

mod common;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use candle_core::{Device, Result, Tensor};
use common::hostile::{fixture, g1_config, load, raw_safetensors, shard_file, sharded, Tmp, BIN};
use mamba2::model::{Checkpoint, SHARD_INDEX};
use proptest::prelude::*;

/// One random change to a model directory.
#[derive(Clone, Debug)]
enum Mutation {
    /// Set a config key to a value (indices into [`CONFIG_KEYS`] and [`CONFIG_VALUES`]).
    ConfigValue(usize, usize),
    /// Name another file for one weight_map entry ([`SHARD_NAMES`]).
    IndexShard(usize, usize),
    /// Set shard `.0`'s header length field ([`HEADER_LENGTHS`]).
    HeaderLength(usize, usize),
    /// Rename a tensor of shard `.0` to a name of shard `.1`.
    HeaderRename(usize, usize, usize),
    /// Multiply a shape dim or a data offset of shard `.0` by a factor.
    HeaderInflate(usize, usize, u64),
    /// Set byte `.1` of file `.0` to `.2` (`.1` taken modulo the length of a config or index, and
    /// modulo 1200 in a shard, to land in its header).
    Byte(usize, usize, u8),
    /// Cut file `.0` to `.1` permille of its length.
    Truncate(usize, usize),
}

const CONFIG_KEYS: &[&str] = &[
    "hidden_size",
    "num_hidden_layers",
    "vocab_size",
    "state_size",
    "conv_kernel",
    "expand",
    "head_dim",
    "num_heads",
    "n_groups",
    "chunk_size",
    "time_step_limit",
    "layer_norm_epsilon",
    "tie_word_embeddings",
    "use_bias",
    "use_conv_bias",
    "residual_in_fp32",
    "eos_token_id",
    "model_type",
    "d_model",
];

const CONFIG_VALUES: &[&str] = &[
    "0",
    "1",
    "2",
    "3",
    "4",
    "8",
    "16",
    "17",
    "32",
    "64",
    "-1",
    "1048577",
    "2147483648",
    "4294967296",
    "18446744073709551615",
    "1e300",
    "0.5",
    "NaN",
    "Infinity",
    "-Infinity",
    "\"x\"",
    "null",
    "[]",
    "{}",
    "true",
    "false",
    "[0.0, Infinity]",
    "[Infinity, Infinity]",
    "[NaN, 1.0]",
    "[0.001, 0.1]",
    "[0.0, 0.0]",
    "{\"__float__\": \"NaN\"}",
    "65537",
    "65536",
];

const SHARD_NAMES: &[&str] = &[
    "../x.safetensors",
    "/etc/passwd",
    "model-00002-of-00003.safetensors",
    "missing.safetensors",
    "",
    "a/b",
    "..",
    SHARD_INDEX,
    "config.json",
    "model-00003-of-00003.safetensors",
];

const HEADER_LENGTHS: &[u64] = &[0, 1, 7, 8, 100, 1 << 24, (1 << 24) + 1, 1 << 40, u64::MAX];

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (0..CONFIG_KEYS.len(), 0..CONFIG_VALUES.len())
            .prop_map(|(k, v)| Mutation::ConfigValue(k, v)),
        (0..64usize, 0..SHARD_NAMES.len()).prop_map(|(e, n)| Mutation::IndexShard(e, n)),
        (0..3usize, 0..HEADER_LENGTHS.len()).prop_map(|(s, l)| Mutation::HeaderLength(s, l)),
        (0..3usize, 0..3usize, 0..64usize).prop_map(|(s, t, u)| Mutation::HeaderRename(s, t, u)),
        (
            0..3usize,
            0..64usize,
            prop_oneof![Just(0u64), Just(2), Just(3), Just(1 << 20), Just(1 << 40)]
        )
            .prop_map(|(s, i, f)| Mutation::HeaderInflate(s, i, f)),
        (0..5usize, any::<usize>(), any::<u8>()).prop_map(|(f, at, b)| Mutation::Byte(f, at, b)),
        (0..5usize, 0..1000usize).prop_map(|(f, p)| Mutation::Truncate(f, p)),
    ]
}

/// The files a mutation may touch: config, index, the three shards.
fn target(tmp: &Tmp, file: usize) -> PathBuf {
    match file {
        0 => tmp.path("config.json"),
        1 => tmp.path(SHARD_INDEX),
        s => tmp.path(&shard_file(s - 2)),
    }
}

/// Shard `s`'s header as JSON and its data bytes; `None` once a mutation has broken it.
fn header(tmp: &Tmp, s: usize) -> Option<(serde_json::Map<String, serde_json::Value>, Vec<u8>)> {
    let bytes = std::fs::read(target(tmp, s + 2)).ok()?;
    let n = usize::try_from(u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?)).ok()?;
    let json = serde_json::from_slice(bytes.get(8..8usize.checked_add(n)?)?).ok()?;
    Some((json, bytes[8 + n..].to_vec()))
}

fn write_header(
    tmp: &Tmp,
    s: usize,
    json: &serde_json::Map<String, serde_json::Value>,
    data: &[u8],
) {
    let text = serde_json::to_string(json).expect("serialize header");
    raw_safetensors(
        &target(tmp, s + 2),
        text.len() as u64,
        text.as_bytes(),
        data,
    )
    .expect("write shard");
}

fn apply(tmp: &Tmp, m: &Mutation) {
    match *m {
        Mutation::ConfigValue(k, v) => {
            std::fs::write(
                tmp.path("config.json"),
                g1_config(CONFIG_KEYS[k], CONFIG_VALUES[v]),
            )
            .expect("write config");
        }
        Mutation::IndexShard(e, n) => {
            let Ok(text) = std::fs::read_to_string(tmp.path(SHARD_INDEX)) else {
                return;
            };
            let Ok(mut json) = serde_json::from_str::<serde_json::Value>(&text) else {
                return;
            };
            if let Some(map) = json.get_mut("weight_map").and_then(|m| m.as_object_mut()) {
                let len = map.len();
                if let Some(v) = map.values_mut().nth(e % len.max(1)) {
                    *v = SHARD_NAMES[n].into();
                }
            }
            std::fs::write(tmp.path(SHARD_INDEX), json.to_string()).expect("write index");
        }
        Mutation::HeaderLength(s, l) => {
            let path = target(tmp, s + 2);
            let Ok(mut bytes) = std::fs::read(&path) else {
                return;
            };
            if bytes.len() >= 8 {
                bytes[..8].copy_from_slice(&HEADER_LENGTHS[l].to_le_bytes());
                std::fs::write(path, bytes).expect("write shard");
            }
        }
        Mutation::HeaderRename(s, t, u) => {
            let (Some((mut json, data)), Some((other, _))) = (header(tmp, s), header(tmp, t))
            else {
                return;
            };
            let names: Vec<String> = json
                .keys()
                .filter(|k| *k != "__metadata__")
                .cloned()
                .collect();
            let others: Vec<&String> = other.keys().filter(|k| *k != "__metadata__").collect();
            if names.is_empty() || others.is_empty() {
                return;
            }
            let from = &names[u % names.len()];
            if let Some(info) = json.remove(from) {
                json.insert(others[u % others.len()].clone(), info);
            }
            write_header(tmp, s, &json, &data);
        }
        Mutation::HeaderInflate(s, i, factor) => {
            let Some((mut json, data)) = header(tmp, s) else {
                return;
            };
            let len = json.len();
            if let Some(info) = json.values_mut().nth(i % len.max(1)) {
                let field = if i % 2 == 0 { "shape" } else { "data_offsets" };
                if let Some(list) = info.get_mut(field).and_then(|v| v.as_array_mut()) {
                    if let Some(x) = list.last_mut().and_then(|x| x.as_u64().map(|v| (x, v))) {
                        *x.0 = x.1.saturating_mul(factor).into();
                    }
                }
            }
            write_header(tmp, s, &json, &data);
        }
        Mutation::Byte(f, at, b) => {
            let path = target(tmp, f);
            let Ok(mut bytes) = std::fs::read(&path) else {
                return;
            };
            if !bytes.is_empty() {
                // Config and index anywhere; shards inside their header, where bytes matter most.
                let span = if f >= 2 {
                    bytes.len().min(1200)
                } else {
                    bytes.len()
                };
                bytes[at % span] = b;
                std::fs::write(path, bytes).expect("write file");
            }
        }
        Mutation::Truncate(f, p) => {
            let path = target(tmp, f);
            let Ok(bytes) = std::fs::read(&path) else {
                return;
            };
            std::fs::write(path, &bytes[..bytes.len() * p / 1000]).expect("write file");
        }
    }
}

/// Opens the checkpoint of `dir` and loads the model; when loading succeeds, runs a short forward.
/// A load error is fine; a panic, or a loaded model that fails to run, is not.
fn load_and_run(dir: &Path) -> std::result::Result<(), String> {
    let outcome = catch_unwind(AssertUnwindSafe(|| -> Result<()> {
        if let Ok(checkpoint) = Checkpoint::open(dir) {
            checkpoint.names();
        }
        let Ok(model) = load(dir) else {
            return Ok(());
        };
        let vocab = model.config().vocab_size as u32;
        let ids: Vec<u32> = (0..6).map(|i| (i * 7) % vocab).collect();
        let ids = Tensor::new(ids.as_slice(), &Device::Cpu)?.unsqueeze(0)?;
        let logits = model.forward(&ids, &mut model.new_cache(1)?)?;
        assert_eq!(logits.dims(), [1, 6, vocab as usize]);
        Ok(())
    }));
    match outcome {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(format!("the model loads but does not run: {e}")),
        Err(panic) => Err(panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "a panic".to_string())),
    }
}

/// The `.bin` fixture with bytes of its pickle or zip directory set (`(position, byte)`), then
/// cut to `cut` bytes when given.
fn mutate_bin(tmp: &Tmp, edits: &[(usize, u8)], cut: Option<usize>) {
    let mut bytes = std::fs::read(fixture(BIN).join("pytorch_model.bin")).expect("fixture bin");
    let len = bytes.len();
    for &(at, byte) in edits {
        // data.pkl opens the archive and the central directory ends it.
        let i = if at % 2 == 0 {
            at % 2100
        } else {
            len - 1 - at % 1000
        };
        bytes[i] = byte;
    }
    if let Some(cut) = cut {
        bytes.truncate(cut % len);
    }
    std::fs::write(tmp.path("pytorch_model.bin"), bytes).expect("write bin");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn mutated_model_directories_load_or_fail_cleanly(
        mutations in prop::collection::vec(mutation(), 1..4),
    ) {
        let tmp = Tmp::new("prop");
        sharded(&tmp).expect("write the sharded fixture");
        for m in &mutations {
            apply(&tmp, m);
        }
        let outcome = load_and_run(&tmp.0);
        prop_assert!(outcome.is_ok(), "{:?} after {:?}", outcome, mutations);
    }

    #[test]
    fn mutated_pytorch_bins_load_or_fail_cleanly(
        edits in prop::collection::vec((any::<usize>(), any::<u8>()), 1..4),
        cut in prop::option::weighted(0.1, any::<usize>()),
    ) {
        let tmp = Tmp::new("prop_bin");
        std::fs::copy(fixture(BIN).join("config.json"), tmp.path("config.json")).expect("config");
        mutate_bin(&tmp, &edits, cut);
        let outcome = load_and_run(&tmp.0);
        prop_assert!(outcome.is_ok(), "{:?}", outcome);
    }
}
