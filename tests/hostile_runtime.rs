//! Hostile input at run time is an error naming the problem, never a panic nor silently wrong
//! numbers: token ids outside the vocabulary (too large, negative, the index types' largest
//! values, which candle's embedding would turn into zero rows) on every entry point, logits that
//! are not finite (the sampler's error, and the generator's naming the step, from a model whose
//! weights hold a NaN), and sampling or generation parameters out of range.

mod common;

use std::collections::HashMap;

use candle_core::{DType, Device, Result, Tensor};
use candle_nn::VarBuilder;
use common::expect_err;
use common::fixture::root;
use mamba2::model::{
    id_tokenizer, Config, GenerationConfig, Generator, Model, Sampler, SamplingParams,
};

/// An untied fixture model (vocabulary 80, below 256, so u8 ids can be out of range too).
const UNTIED: &str = "g2_p16_n16_c8_k4_nofp32res_untied_v77";

/// The `UNTIED` model with its tensors edited by `edit` first.
fn untied_model(edit: impl FnOnce(&mut HashMap<String, Tensor>) -> Result<()>) -> Result<Model> {
    let dir = root().join(UNTIED);
    let config = Config::from_file(dir.join("config.json"))?;
    let mut tensors = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu)?;
    edit(&mut tensors)?;
    Model::new(
        &config,
        VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu),
    )
}

/// Sets `[row, 0]` of the matrix `name` to NaN.
fn poison(tensors: &mut HashMap<String, Tensor>, name: &str, row: usize) -> Result<()> {
    let Some(w) = tensors.get(name) else {
        candle_core::bail!("the fixture has no {name}")
    };
    let mut rows = w.to_vec2::<f32>()?;
    rows[row][0] = f32::NAN;
    let poisoned = Tensor::new(rows, &Device::Cpu)?;
    tensors.insert(name.to_string(), poisoned);
    Ok(())
}

/// Every id entry point refuses ids outside `0..80`, naming the id, its position and the
/// vocabulary, before touching the cache; the same calls with good ids then run.
#[test]
fn out_of_vocab_ids_are_refused_on_every_entry_point() -> Result<()> {
    let model = untied_model(|_| Ok(()))?;
    let dev = Device::Cpu;
    let vocab = "out of the model's vocabulary (80 tokens: ids 0 to 79)";
    let mut cache = model.new_cache(2)?;
    let ids = |v: &[u32]| Tensor::from_vec(v.to_vec(), (2, 3), &dev);

    let bad = ids(&[1, 2, 3, 4, 80, 6])?;
    expect_err(
        model.forward(&bad, &mut cache),
        &format!("token id 80 at ids[1, 1] is {vocab}"),
    );
    expect_err(
        model.prefill(&bad, &mut cache),
        &format!("token id 80 at ids[1, 1] is {vocab}"),
    );
    let huge = ids(&[1, 2, 3, 4, 5, u32::MAX])?;
    expect_err(
        model.forward(&huge, &mut cache),
        &format!("token id {} at ids[1, 2] is {vocab}", u32::MAX),
    );
    let negative = Tensor::from_vec(vec![1i64, -1, 3, 4, 5, 6], (2, 3), &dev)?;
    expect_err(
        model.prefill(&negative, &mut cache),
        &format!("token id -1 at ids[0, 1] is {vocab}"),
    );
    let largest = Tensor::from_vec(vec![1i64, 2, 3, 4, 5, i64::MAX], (2, 3), &dev)?;
    expect_err(
        model.forward(&largest, &mut cache),
        &format!("token id {} at ids[1, 2] is {vocab}", i64::MAX),
    );
    let bytes = Tensor::from_vec(vec![1u8, 2, 3, 4, 5, 255], (2, 3), &dev)?;
    expect_err(
        model.forward(&bytes, &mut cache),
        &format!("token id 255 at ids[1, 2] is {vocab}"),
    );
    expect_err(
        model.step(&Tensor::new(&[7u32, 81], &dev)?, &mut cache),
        &format!("token id 81 at ids[1] is {vocab}"),
    );
    expect_err(
        model.step(&Tensor::new(&[-3i64, 7], &dev)?, &mut cache),
        &format!("token id -3 at ids[0] is {vocab}"),
    );
    expect_err(
        model.forward(&Tensor::new(&[[1f32, 2.0]], &dev)?, &mut cache),
        "ids must be u8, u32 or i64, got F32",
    );
    assert_eq!(cache.tokens(), 0, "a refused call left the cache alone");

    let good = ids(&[1, 2, 3, 4, 79, 6])?;
    let all = model.forward(&good, &mut cache)?;
    assert_eq!(all.dims(), [2, 3, 80]);
    model.step(&Tensor::new(&[0u32, 79], &dev)?, &mut cache)?;
    assert_eq!(cache.tokens(), 4);
    Ok(())
}

/// Candle's embedding turns the largest id of an index type into a row of zeros; a u8 id 255 is
/// a real token of a model with more than 255 tokens, and must give the logits of a u32 255.
#[test]
fn u8_id_255_is_a_token_not_padding() -> Result<()> {
    let model = Model::load(root().join("mamba2-130m-hf"), DType::F32, &Device::Cpu)?;
    assert!(model.config().vocab_size > 255);
    let bytes = Tensor::new(&[[3u8, 255, 17]], &Device::Cpu)?;
    let got = model.forward(&bytes, &mut model.new_cache(1)?)?;
    let want = model.forward(&bytes.to_dtype(DType::U32)?, &mut model.new_cache(1)?)?;
    let diff: f32 = (got - want)?.abs()?.max_all()?.to_scalar()?;
    assert_eq!(diff, 0.0);
    Ok(())
}

#[test]
fn generator_refuses_out_of_vocab_prompts() -> Result<()> {
    let model = untied_model(|_| Ok(()))?;
    let ids = id_tokenizer(80)?;
    let config = GenerationConfig {
        max_new_tokens: 4,
        ..GenerationConfig::default()
    };
    let generator = Generator::new(&model, &ids, config.clone())?;
    expect_err(
        generator.generate_from_ids(&[3, 5, 80], |_| Ok(())),
        "token id 80 at prompt[2] is out of the model's vocabulary (80 tokens",
    );
    expect_err(
        generator.generate_from_ids(&[u32::MAX], |_| Ok(())),
        &format!("token id {} at prompt[0] is out", u32::MAX),
    );
    // A tokenizer larger than the model: its ids reach the same check.
    let wide = id_tokenizer(1000)?;
    let generator = Generator::new(&model, &wide, config)?;
    expect_err(
        generator.generate("3 500 7", |_| Ok(())),
        "token id 500 at prompt[1] is out of the model's vocabulary (80 tokens",
    );
    Ok(())
}

/// Any NaN or infinity among the logits is an error naming it, greedy or sampling; a finite
/// logit as large as f32 allows stays finite under a penalty below 1.
#[test]
fn sampler_refuses_logits_that_are_not_finite() -> Result<()> {
    let greedy = SamplingParams::default();
    let sampling = SamplingParams {
        temperature: 1.0,
        top_p: Some(0.9),
        seed: 1,
        ..SamplingParams::default()
    };
    for params in [greedy, sampling] {
        let mut sampler = Sampler::new(params)?;
        for (v, shown) in [
            (f32::NAN, "NaN"),
            (f32::INFINITY, "inf"),
            (f32::NEG_INFINITY, "-inf"),
        ] {
            let logits = Tensor::new(&[0.5f32, 2.0, v, 1.0], &Device::Cpu)?;
            expect_err(
                sampler.sample(&logits, &[]),
                &format!("the logits are not finite: logit 2 of 4 is {shown}"),
            );
        }
        let half = Tensor::new(&[0.5f32, f32::NAN], &Device::Cpu)?.to_dtype(DType::BF16)?;
        expect_err(sampler.sample(&half, &[]), "logit 1 of 2 is NaN");
    }
    let mut penalised = Sampler::new(SamplingParams {
        temperature: 1.0,
        repetition_penalty: 0.5,
        ..SamplingParams::default()
    })?;
    let logits = Tensor::new(&[f32::MAX, 1.0, -f32::MAX], &Device::Cpu)?;
    for _ in 0..8 {
        assert_eq!(penalised.sample(&logits, &[0, 2])?, 0);
    }
    Ok(())
}

/// A NaN in the untied head makes the first logits NaN: step 0. A NaN in the embedding row of a
/// token the model generates at step k makes the logits after it NaN: step k + 1, with the
/// tokens before it exactly those of the clean model.
#[test]
fn nan_logits_stop_generation_at_their_step() -> Result<()> {
    let tok = id_tokenizer(80)?;
    let prompt = [3u32, 14, 15, 9, 2];
    let config = GenerationConfig {
        max_new_tokens: 24,
        sampling: SamplingParams {
            temperature: 1.0,
            seed: 5,
            ..SamplingParams::default()
        },
        ..GenerationConfig::default()
    };
    let generate = |model: &Model| {
        Generator::new(model, &tok, config.clone())?.generate_from_ids(&prompt, |_| Ok(()))
    };

    let head = untied_model(|t| poison(t, "lm_head.weight", 11))?;
    expect_err(
        generate(&head),
        "generation step 0 (the logits after the 5-token prompt and 0 generated tokens): the \
         logits are not finite: logit 11 of 80 is NaN",
    );

    let clean = generate(&untied_model(|_| Ok(()))?)?;
    let k = (0..clean.tokens.len())
        .find(|&k| {
            let t = clean.tokens[k];
            !prompt.contains(&t) && !clean.tokens[..k].contains(&t)
        })
        .filter(|&k| k + 1 < config.max_new_tokens)
        .expect("a generated token that is not in the prompt nor generated before");
    let row = clean.tokens[k] as usize;
    let embedding = untied_model(|t| poison(t, "backbone.embeddings.weight", row))?;
    let mut streamed = Vec::new();
    let err = Generator::new(&embedding, &tok, config.clone())?
        .generate_from_ids(&prompt, |s| {
            streamed.push(s.to_string());
            Ok(())
        })
        .expect_err("NaN logits after the poisoned token");
    let msg = err.to_string();
    let step = k + 1;
    assert!(
        msg.contains(&format!(
            "generation step {step} (the logits after the 5-token prompt and {step} generated \
             tokens): the logits are not finite: logit 0 of 80 is NaN"
        )),
        "{msg}"
    );
    assert!(
        !streamed.is_empty(),
        "the tokens before the NaN were streamed"
    );
    Ok(())
}

#[test]
fn bad_sampling_parameters_are_named() -> Result<()> {
    let base = SamplingParams {
        temperature: 1.0,
        ..SamplingParams::default()
    };
    let bad = [
        (
            SamplingParams {
                temperature: f64::NAN,
                ..base
            },
            "temperature must be finite and >= 0 (0 = greedy), got NaN",
        ),
        (
            SamplingParams {
                temperature: -1.0,
                ..base
            },
            "temperature must be finite and >= 0 (0 = greedy), got -1",
        ),
        (
            SamplingParams {
                temperature: f64::INFINITY,
                ..base
            },
            "temperature must be finite and >= 0 (0 = greedy), got inf",
        ),
        (
            SamplingParams {
                top_p: Some(f64::NAN),
                ..base
            },
            "top_p must be in (0, 1], got NaN",
        ),
        (
            SamplingParams {
                top_p: Some(0.0),
                ..base
            },
            "top_p must be in (0, 1], got 0",
        ),
        (
            SamplingParams {
                top_p: Some(1.5),
                ..base
            },
            "top_p must be in (0, 1], got 1.5",
        ),
        (
            SamplingParams {
                top_p: Some(-0.25),
                ..base
            },
            "top_p must be in (0, 1], got -0.25",
        ),
        (
            SamplingParams {
                top_k: Some(0),
                ..base
            },
            "top_k must be >= 1 (None keeps every token), got 0",
        ),
        (
            SamplingParams {
                repetition_penalty: f32::NAN,
                ..base
            },
            "repetition_penalty must be finite and > 0 (1 = none), got NaN",
        ),
        (
            SamplingParams {
                repetition_penalty: 0.0,
                ..base
            },
            "repetition_penalty must be finite and > 0 (1 = none), got 0",
        ),
        (
            SamplingParams {
                repetition_penalty: -2.0,
                ..base
            },
            "repetition_penalty must be finite and > 0 (1 = none), got -2",
        ),
        (
            SamplingParams {
                repetition_penalty: f32::INFINITY,
                ..base
            },
            "repetition_penalty must be finite and > 0 (1 = none), got inf",
        ),
    ];
    for (params, needle) in bad {
        expect_err(Sampler::new(params), needle);
        let config = GenerationConfig {
            sampling: params,
            ..GenerationConfig::default()
        };
        expect_err(config.validate(), needle);
    }
    // The extremes of the valid ranges, and any seed and history length.
    for params in [
        SamplingParams {
            temperature: 0.0,
            top_p: Some(1.0),
            top_k: Some(1),
            repeat_last_n: usize::MAX,
            seed: u64::MAX,
            ..base
        },
        SamplingParams {
            temperature: f64::MIN_POSITIVE,
            top_p: Some(f64::MIN_POSITIVE),
            top_k: Some(usize::MAX),
            repetition_penalty: f32::MIN_POSITIVE,
            ..base
        },
    ] {
        let mut sampler = Sampler::new(params)?;
        let logits = Tensor::new(&[0.5f32, 2.0, 1.0], &Device::Cpu)?;
        assert!(sampler.sample(&logits, &[1])? < 3);
    }
    Ok(())
}

#[test]
fn bad_generation_parameters_are_named() -> Result<()> {
    let model = untied_model(|_| Ok(()))?;
    let tok = id_tokenizer(80)?;
    let too_many = GenerationConfig::MAX_NEW_TOKENS + 1;
    let config = GenerationConfig {
        max_new_tokens: too_many,
        ..GenerationConfig::default()
    };
    let needle = format!(
        "max_new_tokens must be <= {}, got {too_many}",
        GenerationConfig::MAX_NEW_TOKENS
    );
    expect_err(config.validate(), &needle);
    expect_err(Generator::new(&model, &tok, config).map(|_| ()), &needle);
    let config = GenerationConfig {
        max_new_tokens: usize::MAX,
        ..GenerationConfig::default()
    };
    expect_err(
        Generator::new(&model, &tok, config).map(|_| ()),
        "max_new_tokens",
    );
    let config = GenerationConfig {
        stop_strings: vec!["end".into(), String::new()],
        ..GenerationConfig::default()
    };
    expect_err(
        Generator::new(&model, &tok, config).map(|_| ()),
        "stop string 1 is empty",
    );
    let config = GenerationConfig {
        sampling: SamplingParams {
            top_p: Some(f64::NAN),
            ..SamplingParams::default()
        },
        ..GenerationConfig::default()
    };
    expect_err(
        Generator::new(&model, &tok, config).map(|_| ()),
        "top_p must be in (0, 1], got NaN",
    );
    // No tokens asked for is no tokens made.
    let none = Generator::new(&model, &tok, GenerationConfig::default())?
        .generate_from_ids(&[1, 2], |_| Ok(()))?;
    assert!(none.tokens.is_empty());
    Ok(())
}
