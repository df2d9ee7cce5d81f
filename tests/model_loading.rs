//! Config parsing (both formats), sharded checkpoints, and every loading error with its message.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Result, Tensor};
use common::fixture::{root, Case};
use common::rel_err;
use mamba2::model::{Config, ConfigFormat, Model};

/// A fresh, empty directory under cargo's per-target temp dir.
fn temp_dir(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("model_loading")
        .join(name);
    if dir.exists() {
        std::fs::remove_dir_all(&dir).expect("clear temp dir");
    }
    std::fs::create_dir_all(&dir).expect("create temp dir");
    dir
}

/// A copy of a fixture's config.json with the weights rewritten by `edit`.
fn edited_copy(
    case: &str,
    name: &str,
    edit: impl FnOnce(&mut HashMap<String, Tensor>) -> Result<()>,
) -> Result<PathBuf> {
    let src = root().join(case);
    let dir = temp_dir(name);
    std::fs::copy(src.join("config.json"), dir.join("config.json"))?;
    let mut tensors = candle_core::safetensors::load(src.join("model.safetensors"), &Device::Cpu)?;
    edit(&mut tensors)?;
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors"))?;
    Ok(dir)
}

fn load_err(dir: &Path) -> String {
    match Model::load(dir, DType::F32, &Device::Cpu) {
        Ok(_) => panic!("loading {} should fail", dir.display()),
        Err(e) => e.to_string(),
    }
}

fn assert_contains(msg: &str, needle: &str) {
    assert!(
        msg.contains(needle),
        "error {msg:?} does not contain {needle:?}"
    );
}

fn config_err(json: &str) -> String {
    match Config::from_json(json) {
        Ok(c) => panic!("config should be refused, got {c:?}"),
        Err(e) => e.to_string(),
    }
}

const G1: &str = "g1_p16_n16_c8_k4_fp32res_tied";

#[test]
fn sharded_checkpoint_loads_like_a_single_file() -> Result<()> {
    for case_name in [G1, "g2_p16_n16_c8_k4_nofp32res_untied_v77_original"] {
        let case = Case::load(case_name)?;
        let dir = temp_dir(&format!("sharded_{case_name}"));
        std::fs::copy(case.dir.join("config.json"), dir.join("config.json"))?;
        let tensors =
            candle_core::safetensors::load(case.dir.join("model.safetensors"), &Device::Cpu)?;
        let mut names: Vec<&String> = tensors.keys().collect();
        names.sort();
        let mut weight_map = serde_json::Map::new();
        for (i, chunk) in names.chunks(names.len().div_ceil(3)).enumerate() {
            let file = format!("model-{:05}-of-00003.safetensors", i + 1);
            let shard: HashMap<&str, Tensor> = chunk
                .iter()
                .map(|n| (n.as_str(), tensors[*n].clone()))
                .collect();
            candle_core::safetensors::save(&shard, dir.join(&file))?;
            for n in chunk {
                weight_map.insert(n.to_string(), file.clone().into());
            }
        }
        let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
        std::fs::write(dir.join("model.safetensors.index.json"), index.to_string())?;

        let ids = case.input_ids()?;
        let model = Model::load(&dir, DType::F32, &Device::Cpu)?;
        let logits = model.forward(&ids, &mut model.new_cache(ids.dim(0)?)?)?;
        let e = rel_err(&logits, case.get("logits_prefill"))?;
        assert!(e <= 1e-4, "{case_name} sharded: rel err {e:e}");

        // A shard named by the index but absent.
        std::fs::remove_file(dir.join("model-00002-of-00003.safetensors"))?;
        assert_contains(
            &load_err(&dir),
            "model-00002-of-00003.safetensors listed in",
        );
    }
    Ok(())
}

#[test]
fn weights_stored_in_half_precision_load_in_any_dtype() -> Result<()> {
    let dir = edited_copy(G1, "bf16_weights", |t| {
        for v in t.values_mut() {
            *v = v.to_dtype(DType::BF16)?;
        }
        Ok(())
    })?;
    let case = Case::load(G1)?;
    let ids = case.input_ids()?;
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let model = Model::load(&dir, dtype, &Device::Cpu)?;
        assert_eq!(model.dtype(), dtype);
        let logits = model.forward(&ids, &mut model.new_cache(ids.dim(0)?)?)?;
        let e = rel_err(&logits, case.get("logits_prefill"))?;
        assert!(e <= 5e-2, "bf16 checkpoint as {dtype:?}: rel err {e:e}");
    }
    Ok(())
}

#[test]
fn missing_files_are_named() -> Result<()> {
    let nowhere = Path::new(env!("CARGO_TARGET_TMPDIR")).join("no_such_model_dir");
    assert_contains(&load_err(&nowhere), "model directory");
    assert_contains(&load_err(&nowhere), "does not exist");

    let dir = temp_dir("no_config");
    assert_contains(
        &load_err(&dir),
        &format!(
            "config {} does not exist",
            dir.join("config.json").display()
        ),
    );

    std::fs::copy(root().join(G1).join("config.json"), dir.join("config.json"))?;
    assert_contains(
        &load_err(&dir),
        "expected model.safetensors.index.json, model.safetensors or pytorch_model.bin",
    );
    match Model::load(root().join(G1), DType::U32, &Device::Cpu) {
        Ok(_) => panic!("u32 model"),
        Err(e) => assert_contains(
            &e.to_string(),
            "model dtype must be f32, f16 or bf16, got U32",
        ),
    }
    Ok(())
}

#[test]
fn missing_and_misshaped_tensors_are_named() -> Result<()> {
    let dir = edited_copy(G1, "missing_tensor", |t| {
        t.remove("backbone.layers.1.mixer.D");
        Ok(())
    })?;
    let msg = load_err(&dir);
    assert_contains(&msg, "missing tensor backbone.layers.1.mixer.D in ");
    assert_contains(&msg, "model.safetensors");

    let dir = edited_copy(G1, "wrong_shape", |t| {
        t.insert(
            "backbone.layers.0.mixer.A_log".into(),
            Tensor::zeros(5, DType::F32, &Device::Cpu)?,
        );
        Ok(())
    })?;
    assert_contains(&load_err(&dir), "tensor backbone.layers.0.mixer.A_log in ");
    assert_contains(&load_err(&dir), "has shape [5], the config expects [4]");

    let dir = edited_copy(G1, "wrong_conv_shape", |t| {
        let w = t["backbone.layers.1.mixer.conv1d.weight"].squeeze(1)?;
        t.insert("backbone.layers.1.mixer.conv1d.weight".into(), w);
        Ok(())
    })?;
    assert_contains(&load_err(&dir), "backbone.layers.1.mixer.conv1d.weight in ");
    assert_contains(
        &load_err(&dir),
        "has shape [96, 4], the config expects [96, 1, 4]",
    );

    let dir = edited_copy(G1, "no_embedding", |t| {
        t.remove("backbone.embeddings.weight");
        Ok(())
    })?;
    assert_contains(
        &load_err(&dir),
        "missing embedding: neither backbone.embeddings.weight (HF) nor backbone.embedding.weight (state-spaces)",
    );

    let dir = edited_copy("g1_p32_n64_c32_k4_fp32res_untied", "no_lm_head", |t| {
        t.remove("lm_head.weight");
        Ok(())
    })?;
    assert_contains(&load_err(&dir), "missing tensor lm_head.weight in ");
    Ok(())
}

/// Tensors the config leaves unread mean the config does not describe the weights.
#[test]
fn unused_tensors_are_named() -> Result<()> {
    let dir = edited_copy(G1, "extra_layer", |t| {
        t.insert(
            "backbone.layers.2.norm.weight".into(),
            Tensor::ones(32, DType::F32, &Device::Cpu)?,
        );
        Ok(())
    })?;
    let msg = load_err(&dir);
    assert_contains(
        &msg,
        "has 1 tensors that the config does not use (n_layer 2, use_bias false",
    );
    assert_contains(&msg, "backbone.layers.2.norm.weight");

    let dir = edited_copy(G1, "unexpected_bias", |t| {
        t.insert(
            "backbone.layers.0.mixer.out_proj.bias".into(),
            Tensor::zeros(32, DType::F32, &Device::Cpu)?,
        );
        Ok(())
    })?;
    assert_contains(&load_err(&dir), "backbone.layers.0.mixer.out_proj.bias");
    Ok(())
}

#[test]
fn bad_config_files_are_named() -> Result<()> {
    let dir = temp_dir("bad_config");
    std::fs::copy(
        root().join(G1).join("model.safetensors"),
        dir.join("model.safetensors"),
    )?;
    let base = std::fs::read_to_string(root().join(G1).join("config.json"))?;
    for (from, to, needle) in [
        (
            "\"hidden_size\": 32",
            "\"hidden_size\": \"32\"",
            "hidden_size must be a non-negative integer, got \"32\"",
        ),
        (
            "\"num_heads\": 4",
            "\"num_heads\": 5",
            "num_heads·head_dim (5·16 = 80) must equal expand·hidden_size (2·32 = 64)",
        ),
        (
            "\"n_groups\": 1",
            "\"n_groups\": 3",
            "n_groups (3) must divide num_heads (4)",
        ),
        (
            "\"use_bias\": false",
            "\"use_bias\": 0",
            "use_bias must be true or false, got 0",
        ),
        (
            "\"model_type\": \"mamba2\"",
            "\"model_type\": \"mamba\"",
            "model_type is \"mamba\"",
        ),
    ] {
        std::fs::write(dir.join("config.json"), base.replacen(from, to, 1))?;
        let msg = load_err(&dir);
        assert_contains(&msg, needle);
        assert_contains(&msg, "config.json");
    }
    // A valid config that does not fit the weights: the tensors say so.
    let edited = base.replacen("\"state_size\": 16", "\"state_size\": 17", 1);
    std::fs::write(dir.join("config.json"), edited)?;
    assert_contains(&load_err(&dir), "in_proj.weight in ");
    assert_contains(
        &load_err(&dir),
        "has shape [164, 32], the config expects [166, 32]",
    );
    Ok(())
}

#[test]
fn config_values_are_checked() {
    assert_contains(&config_err("{"), "config is not valid JSON");
    assert_contains(&config_err("[1]"), "config must be a JSON object");
    assert_contains(
        &config_err(r#"{"vocab_size": 10}"#),
        "config has neither hidden_size (HF Mamba2Config) nor d_model (state-spaces MambaConfig)",
    );
    assert_contains(
        &config_err(r#"{"hidden_size": 64, "d_model": 64}"#),
        "config has both hidden_size (HF format) and d_model (state-spaces format)",
    );
    assert_contains(
        &config_err(
            r#"{"hidden_size": 64, "num_heads": 2, "n_groups": 1, "time_step_limit": [0.5, 0.1]}"#,
        ),
        "time_step_limit must be [lo, hi] with lo finite and >= 0, hi > 0 and >= lo (hi may be \
         Infinity), got [0.5, 0.1]",
    );
    assert_contains(
        &config_err(
            r#"{"hidden_size": 64, "num_heads": 2, "n_groups": 1, "time_step_limit": [0.0]}"#,
        ),
        "time_step_limit must be a pair [lo, hi] of numbers, got [0.0]",
    );
    assert_contains(
        &config_err(r#"{"hidden_size": 64, "num_heads": 2, "n_groups": 1, "hidden_act": "gelu"}"#),
        "hidden_act \"gelu\" is not supported",
    );
    let original = |ssm: &str| {
        format!(r#"{{"d_model": 64, "n_layer": 2, "vocab_size": 10, "ssm_cfg": {ssm}}}"#)
    };
    assert_contains(&config_err(&original("{}")), "ssm_cfg.layer is \"Mamba1\"");
    assert_contains(
        &config_err(&original(r#"{"layer": "Mamba2", "ngroup": 2}"#)),
        "unknown key ssm_cfg.ngroup",
    );
    assert_contains(
        &config_err(&original(r#"{"layer": "Mamba2", "headdim": 48}"#)),
        "ssm_cfg.headdim (48) must divide d_inner = expand·d_model (2·64 = 128)",
    );
    assert_contains(
        &config_err(&original(
            r#"{"layer": "Mamba2", "headdim": 16, "ngroups": 3}"#,
        )),
        "ssm_cfg.ngroups (3) must divide nheads = expand·d_model/headdim (8)",
    );
    assert_contains(
        &config_err(&original(
            r#"{"layer": "Mamba2", "norm_before_gate": true}"#,
        )),
        "ssm_cfg.norm_before_gate = true is not supported",
    );
    assert_contains(
        &config_err(&original(r#"{"layer": "Mamba2", "d_ssm": 64}"#)),
        "ssm_cfg.d_ssm = 64 is not supported: only d_ssm = d_inner = 128",
    );
    assert_contains(
        &config_err(r#"{"d_model": 64, "attn_layer_idx": [1], "ssm_cfg": {"layer": "Mamba2"}}"#),
        "attn_layer_idx is not empty",
    );
    assert_contains(
        &config_err(r#"{"d_model": 64, "d_modle": 1, "ssm_cfg": {"layer": "Mamba2"}}"#),
        "unknown key d_modle",
    );
}

#[test]
fn both_config_formats_describe_the_same_model() -> Result<()> {
    let hf = Config::from_file(root().join("g2_p16_n16_c8_k4_nofp32res_untied_v77/config.json"))?;
    let original = Config::from_file(
        root().join("g2_p16_n16_c8_k4_nofp32res_untied_v77_original/config.json"),
    )?;
    assert_eq!(hf.format, ConfigFormat::Hf);
    assert_eq!(original.format, ConfigFormat::Original);
    assert_eq!(hf.eos_token_ids, vec![0]);
    assert!(original.eos_token_ids.is_empty());
    // 77 rows padded to a multiple of 16 = HF's 80.
    assert_eq!(original.vocab_size, 80);
    let same = Config {
        format: hf.format,
        eos_token_ids: hf.eos_token_ids.clone(),
        ..original
    };
    assert_eq!(same, hf);
    Ok(())
}

#[test]
fn infinite_time_step_limits_in_both_spellings() -> Result<()> {
    // transformers 5.x and the bare Python `Infinity` of older files / hub checkpoints.
    for name in [G1, "mamba2-130m-hf"] {
        let c = Config::from_file(root().join(name).join("config.json"))?;
        assert_eq!(c.dt_limit, (0.0, f32::INFINITY), "{name}");
    }
    let c = Config::from_json(
        r#"{"hidden_size": 64, "num_heads": 2, "n_groups": 1, "time_step_limit": [0.0, Infinity], "note": "Infinity, NaN"}"#,
    )?;
    assert_eq!(c.dt_limit, (0.0, f32::INFINITY));
    let c = Config::from_json(
        r#"{"hidden_size": 64, "num_heads": 2, "n_groups": 1, "time_step_limit": [0.001, {"__float__": "Infinity"}]}"#,
    )?;
    assert_eq!(c.dt_limit, (0.001, f32::INFINITY));
    Ok(())
}

#[test]
fn each_format_takes_its_own_defaults() -> Result<()> {
    // state-spaces/mamba2-130m's config: ssm_cfg names only the layer, so the Mamba2 module's
    // defaults apply, not HF's Codestral-sized ones.
    let c = Config::from_file(root().join("mamba2-130m-original-bin/config.json"))?;
    assert_eq!(
        (
            c.d_state,
            c.d_conv,
            c.expand,
            c.headdim,
            c.ngroups,
            c.chunk_size
        ),
        (128, 4, 2, 64, 1, 256)
    );
    assert_eq!((c.nheads, c.vocab_size), (2, 288));
    assert_eq!(c.dt_limit, (0.0, f32::INFINITY));
    assert!(!c.bias && c.conv_bias && c.tie_embeddings && c.residual_in_fp32);
    let c = Config::from_json(r#"{"d_model": 768, "ssm_cfg": {"layer": "Mamba2"}}"#)?;
    assert_eq!((c.n_layer, c.ngroups, c.nheads), (64, 1, 24));
    // MambaConfig's defaults: vocab 50277 padded to a multiple of 8.
    assert_eq!(c.vocab_size, 50280);
    let c = Config::from_json(r#"{"hidden_size": 4096}"#)?;
    assert_eq!(
        (
            c.n_layer,
            c.nheads,
            c.headdim,
            c.d_state,
            c.ngroups,
            c.vocab_size
        ),
        (64, 128, 64, 128, 8, 32768)
    );
    assert!(!c.tie_embeddings);
    assert_eq!(c.eos_token_ids, vec![2]);
    Ok(())
}
