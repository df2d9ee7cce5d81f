//! The trainable model: master weights loaded from every checkpoint format the model reads,
//! saved in the HF layout (sharded above a size) and read back to the same logits, views that
//! follow the optimizer's in-place updates, a seeded initialisation, bf16 compute with f32
//! master weights, and a loss that falls under a few optimizer steps.

mod common;

use candle_core::{DType, Device, Result, Tensor};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use common::fixture::{case_names, root};
use common::rel_err;
use mamba2::model::{Config, Model, TrainableModel};

fn tiny_config() -> Result<Config> {
    Config::from_json(
        r#"{"hidden_size": 32, "num_hidden_layers": 2, "vocab_size": 40, "state_size": 16,
            "head_dim": 16, "num_heads": 4, "expand": 2, "n_groups": 2, "conv_kernel": 4,
            "chunk_size": 16, "tie_word_embeddings": true}"#,
    )
}

fn scratch(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("mamba2-train-model-{}-{name}", std::process::id()))
}

/// Every fixture (HF, state-spaces safetensors and pickle) loads as master weights whose view
/// gives the fixture model's logits, and saves in the HF layout that `Model::load` reads back to
/// the same logits, sharded or not.
#[test]
fn every_checkpoint_format_loads_saves_and_reloads() -> Result<()> {
    for name in case_names() {
        let dir = root().join(&name);
        let trainable = TrainableModel::load(&dir, DType::F32, &Device::Cpu)?;
        let direct = Model::load(&dir, DType::F32, &Device::Cpu)?;
        let ids = Tensor::new(&[[1u32, 5, 9, 2, 7, 3]], &Device::Cpu)?;
        let want = direct.forward(&ids, &mut direct.new_cache(1)?)?;
        let view = trainable.model()?.forward_train(&ids)?;
        let e = rel_err(&view, &want)?;
        assert!(e <= 1e-6, "{name}: the trainable view departs by {e:e}");
        for shard_bytes in [usize::MAX, 4096] {
            let out = scratch(&format!("{name}-{shard_bytes}"));
            trainable.save(&out, None, shard_bytes)?;
            let reloaded = Model::load(&out, DType::F32, &Device::Cpu)?;
            let got = reloaded.forward(&ids, &mut reloaded.new_cache(1)?)?;
            let e = rel_err(&got, &want)?;
            assert!(e <= 1e-6, "{name}: saved and reloaded departs by {e:e}");
            let sharded = out.join("model.safetensors.index.json").exists();
            assert_eq!(sharded, shard_bytes == 4096, "{name}: sharding");
            std::fs::remove_dir_all(&out)?;
        }
    }
    Ok(())
}

/// A saved checkpoint replaces the previous one whole, and no staging directory stays behind.
#[test]
fn saving_twice_replaces_the_checkpoint() -> Result<()> {
    let trainable = TrainableModel::init(&tiny_config()?, 1, DType::F32, &Device::Cpu)?;
    let out = scratch("twice");
    trainable.save(&out, None, 4096)?;
    assert!(out.join("model.safetensors.index.json").exists());
    trainable.save(&out, None, usize::MAX)?;
    assert!(!out.join("model.safetensors.index.json").exists());
    assert!(out.join("model.safetensors").exists());
    let name = out
        .file_name()
        .expect("a name")
        .to_string_lossy()
        .to_string();
    for leftover in [format!(".{name}.partial"), format!(".{name}.old")] {
        assert!(
            !out.with_file_name(&leftover).exists(),
            "{leftover} stayed behind"
        );
    }
    std::fs::remove_dir_all(&out)?;
    Ok(())
}

/// The same seed draws the same weights; another seed others. A_log = log(1..H), D = 1.
#[test]
fn initialisation_is_seeded() -> Result<()> {
    let cfg = tiny_config()?;
    let a = TrainableModel::init(&cfg, 7, DType::F32, &Device::Cpu)?;
    let b = TrainableModel::init(&cfg, 7, DType::F32, &Device::Cpu)?;
    let c = TrainableModel::init(&cfg, 8, DType::F32, &Device::Cpu)?;
    for ((name, va), ((_, vb), (_, vc))) in
        a.vars().iter().zip(b.vars().iter().zip(c.vars().iter()))
    {
        assert_eq!(rel_err(va.as_tensor(), vb.as_tensor())?, 0.0, "{name}");
        let random =
            name.ends_with("proj.weight") || name.contains("conv1d") || name.contains("embeddings");
        if random {
            assert!(rel_err(va.as_tensor(), vc.as_tensor())? > 0.0, "{name}");
        }
    }
    let a_log = a
        .vars()
        .into_iter()
        .find(|(n, _)| n.ends_with("layers.0.mixer.A_log"))
        .expect("A_log")
        .1;
    let want: Vec<f32> = (1..=4).map(|h| (h as f32).ln()).collect();
    assert_eq!(a_log.as_tensor().to_vec1::<f32>()?, want);
    Ok(())
}

/// AdamW steps on a repeated sequence lower its loss; the view built after each step sees the
/// updated weights (A_log included, through a = −exp(A_log)). bf16 compute keeps f32 masters.
#[test]
fn the_loss_falls_under_adamw_in_f32_and_bf16() -> Result<()> {
    for dtype in [DType::F32, DType::BF16] {
        let trainable = TrainableModel::init(&tiny_config()?, 3, dtype, &Device::Cpu)?;
        assert!(trainable
            .vars()
            .iter()
            .all(|(_, v)| v.dtype() == DType::F32));
        let vars = trainable.vars().into_iter().map(|(_, v)| v).collect();
        let params = ParamsAdamW {
            lr: 1e-2,
            ..Default::default()
        };
        let mut opt = AdamW::new(vars, params)?;
        let ids = Tensor::new(
            &[[1u32, 5, 9, 2, 7, 3, 1, 5, 9, 2, 7, 3, 1, 5, 9, 2, 7, 3]],
            &Device::Cpu,
        )?;
        let first = trainable.model()?.loss(&ids)?.to_scalar::<f32>()?;
        let mut last = first;
        for _ in 0..30 {
            let loss = trainable.model()?.loss(&ids)?;
            last = loss.to_scalar::<f32>()?;
            opt.backward_step(&loss)?;
        }
        assert!(last < 0.5 * first, "{dtype:?}: loss {first} → {last}");
    }
    Ok(())
}

/// The loss and the held-out score of ids from the host are those of the same ids as a tensor,
/// bit for bit; ids outside the vocabulary or rows of unequal length are errors naming them.
#[test]
fn host_ids_give_the_loss_and_score_of_a_tensor_of_them() -> Result<()> {
    let model = TrainableModel::init(&tiny_config()?, 7, DType::F32, &Device::Cpu)?.model()?;
    let ids = [1u32, 5, 9, 2, 7, 3, 30, 11, 4, 0, 39, 8];
    let tensor = Tensor::new(&ids, &Device::Cpu)?.reshape((2, 6))?;
    let (ours, theirs) = (model.loss_from_host(&ids, 2)?, model.loss(&tensor)?);
    assert_eq!(
        ours.to_scalar::<f32>()?.to_bits(),
        theirs.to_scalar::<f32>()?.to_bits()
    );
    assert_eq!(
        model.nll_sum_from_host(&ids, 2)?.to_bits(),
        model.nll_sum(&tensor)?.to_bits()
    );
    let mut bad = ids;
    bad[7] = 40;
    let err = model
        .loss_from_host(&bad, 2)
        .expect_err("id 40")
        .to_string();
    assert!(err.contains("40") && err.contains("[1, 1]"), "{err}");
    let err = model
        .nll_sum_from_host(&ids, 5)
        .expect_err("12 ids in 5 rows")
        .to_string();
    assert!(err.contains("12 ids do not make 5 rows"), "{err}");
    assert!(model.loss_from_host(&ids, 0).is_err());
    assert!(
        model.loss_from_host(&ids[..2], 2).is_err(),
        "rows of one token"
    );
    Ok(())
}
