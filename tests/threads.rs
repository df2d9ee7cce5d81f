//! One model shared by several threads, each with its own cache: the shipped model (`weights/`),
//! behind an `Arc`, run on 4 threads at once, on different prompts and on one prompt twice,
//! gives every thread the logits (full pass, then decode steps) of the same prompt run alone, bit
//! for bit; one `Generator` shared by scoped threads gives each the tokens it gives on one
//! thread.

use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device, Result, Tensor};
use mamba2::model::{load_tokenizer, GenerationConfig, Generator, Model, Tokenizer};

const PROMPTS: [&str; 4] = [
    "It was a dark and stormy night",
    "The old house at the end of the lane had stood empty for years",
    "It was a dark and stormy night",
    "\"Nonsense,\" said Mrs. Bennet, \"you must go, my dear.\"",
];

/// Decode steps after the full pass.
const STEPS: usize = 4;

fn load() -> Result<(Model, Tokenizer)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("weights");
    let model = Model::load(&dir, DType::F32, &Device::Cpu)?;
    let tokenizer = load_tokenizer(dir.join("tokenizer.json"))?;
    Ok((model, tokenizer))
}

fn encode(tokenizer: &Tokenizer, prompt: &str) -> Result<Vec<u32>> {
    Ok(tokenizer
        .encode(prompt, true)
        .map_err(candle_core::Error::msg)?
        .get_ids()
        .to_vec())
}

/// The logits of a full pass over `ids`, then of `STEPS` decode steps feeding back its argmax,
/// all on the calling thread with `cache` (fresh).
fn run(model: &Model, ids: &[u32], cache: &mut mamba2::model::Cache) -> Result<Vec<Vec<f32>>> {
    let input = Tensor::new(ids, model.device())?.unsqueeze(0)?;
    let all = model.forward(&input, cache)?.squeeze(0)?;
    let mut out: Vec<Vec<f32>> = all.to_vec2()?;
    for _ in 0..STEPS {
        let last = out.last().map(|l| argmax(l)).unwrap_or_default();
        let next = model.step(&Tensor::new(&[last], model.device())?, cache)?;
        out.push(next.squeeze(0)?.to_vec1()?);
    }
    Ok(out)
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}

#[test]
fn threads_sharing_a_model_get_the_logits_of_one_thread() -> Result<()> {
    let (model, tokenizer) = load()?;
    let prompts: Vec<Vec<u32>> = PROMPTS
        .iter()
        .map(|p| encode(&tokenizer, p))
        .collect::<Result<_>>()?;
    let alone: Vec<Vec<Vec<f32>>> = prompts
        .iter()
        .map(|ids| run(&model, ids, &mut model.new_cache(1)?))
        .collect::<Result<_>>()?;

    // One `Arc<Model>` for every thread; caches made here and moved into the threads (a new
    // cache is complete when returned).
    let model = Arc::new(model);
    let handles: Vec<_> = prompts
        .iter()
        .map(|ids| {
            let (model, ids) = (Arc::clone(&model), ids.clone());
            let mut cache = model.new_cache(1)?;
            Ok(std::thread::spawn(move || run(&model, &ids, &mut cache)))
        })
        .collect::<Result<_>>()?;
    let shared: Vec<Vec<Vec<f32>>> = handles
        .into_iter()
        .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
        .collect::<Result<_>>()?;
    for (i, (got, want)) in shared.iter().zip(&alone).enumerate() {
        assert_eq!(got.len(), want.len());
        for (t, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                g == w,
                "prompt {i}, position {t}: logits differ across threads"
            );
        }
    }
    // The repeated prompt is the same on its two threads.
    assert!(shared[0] == shared[2]);
    Ok(())
}

#[test]
fn threads_sharing_a_generator_get_the_tokens_of_one_thread() -> Result<()> {
    let (model, tokenizer) = load()?;
    let config = GenerationConfig {
        max_new_tokens: 8,
        ..GenerationConfig::default()
    };
    let generator = Generator::new(&model, &tokenizer, config)?;
    let alone: Vec<Vec<u32>> = PROMPTS
        .iter()
        .map(|p| Ok(generator.generate(p, |_| Ok(()))?.tokens))
        .collect::<Result<_>>()?;
    let shared: Vec<Vec<u32>> = std::thread::scope(|s| {
        let handles: Vec<_> = PROMPTS
            .iter()
            .map(|p| {
                let generator = &generator;
                s.spawn(move || Ok(generator.generate(p, |_| Ok(()))?.tokens))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect::<Result<_>>()
    })?;
    assert_eq!(shared, alone);
    assert!(alone.iter().all(|t| t.len() == 8));
    Ok(())
}
