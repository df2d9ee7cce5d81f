//! Ragged batches on the shipped model (CPU, f32): many prompts generating together
//! ([`Batch`], `Generator::generate_batch`) give each prompt what it gives alone, sequences join
//! and leave between steps, caches join and select rows; and a prompt prefilled in pieces split
//! anywhere (not at multiples of the chunk) gives the states and logits of one call.

use std::path::PathBuf;

use candle_core::{DType, Device, Result, Tensor};
use mamba2::model::{
    load_tokenizer, Cache, Generation, GenerationConfig, Generator, Model, SamplingParams,
    StopReason, Tokenizer,
};

fn weights() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("weights")
}

fn load() -> Result<(Model, Tokenizer)> {
    let model = Model::load(weights(), DType::F32, &Device::Cpu)?;
    let tokenizer = load_tokenizer(weights().join("tokenizer.json"))?;
    Ok((model, tokenizer))
}

const PROMPTS: [&str; 5] = [
    "It was a dark and stormy night",
    "Elizabeth said",
    "The",
    "The old man looked at the sea and said that he would not go back to the village before",
    "“Come in,” she said, and",
];

fn config(max_new_tokens: usize, stops: &[&str], eos: Vec<u32>) -> GenerationConfig {
    GenerationConfig {
        max_new_tokens,
        sampling: SamplingParams::default(),
        stop_strings: stops.iter().map(|s| s.to_string()).collect(),
        eos_token_ids: eos,
        no_cuda_graph: false,
    }
}

fn assert_same(what: &str, got: &Generation, want: &Generation) {
    assert_eq!(got.tokens, want.tokens, "{what}: tokens");
    assert_eq!(got.text, want.text, "{what}: text");
    assert_eq!(got.stop, want.stop, "{what}: stop reason");
    assert_eq!(
        got.prompt_tokens, want.prompt_tokens,
        "{what}: prompt tokens"
    );
    assert_eq!(got.decode_steps, want.decode_steps, "{what}: decode steps");
}

#[test]
fn a_batch_generates_what_each_prompt_generates_alone() -> Result<()> {
    let (model, tokenizer) = load()?;
    // Greedy; a stop string that some prompts reach and others not, and EOS on a frequent
    // token, so that sequences leave the batch at different steps for all three reasons.
    let comma = tokenizer.token_to_id(",").expect("a comma token");
    for cfg in [
        config(24, &[], vec![]),
        config(40, &["\n\n", " the"], vec![]),
        config(30, &[], vec![comma]),
    ] {
        let generator = Generator::new(&model, &tokenizer, cfg.clone())?;
        let mut streamed = vec![String::new(); PROMPTS.len()];
        let together = generator.generate_batch(&PROMPTS, |i, piece| {
            streamed[i].push_str(piece);
            Ok(())
        })?;
        let mut reasons = Vec::new();
        for (i, prompt) in PROMPTS.iter().enumerate() {
            let alone = generator.generate(prompt, |_| Ok(()))?;
            assert_same(&format!("prompt {i}, {cfg:?}"), &together[i], &alone);
            assert_eq!(streamed[i], together[i].text, "prompt {i}: streamed text");
            reasons.push(together[i].stop);
        }
        eprintln!("stop reasons {reasons:?}");
    }
    Ok(())
}

#[test]
fn sequences_join_and_leave_between_steps() -> Result<()> {
    let (model, tokenizer) = load()?;
    let generator = Generator::new(&model, &tokenizer, config(12, &[], vec![]))?;
    let mut batch = generator.batch();
    let mut done: Vec<Option<Generation>> = vec![None; PROMPTS.len()];
    let mut record = |finished: Vec<(usize, Generation)>| {
        for (id, g) in finished {
            assert!(done[id].is_none(), "sequence {id} finished twice");
            done[id] = Some(g);
        }
    };
    // Two sequences, then one more every 5 steps: each joins a batch whose other sequences are
    // further along, and the first ones leave while later ones still run.
    assert_eq!(batch.add(PROMPTS[0])?, 0);
    assert_eq!(batch.add(PROMPTS[1])?, 1);
    let mut next = 2;
    let mut steps = 0;
    while !batch.is_empty() {
        if steps % 5 == 4 && next < PROMPTS.len() {
            assert_eq!(batch.add(PROMPTS[next])?, next);
            next += 1;
        }
        record(batch.step(|_, _| Ok(()))?);
        steps += 1;
    }
    assert_eq!(next, PROMPTS.len(), "every prompt joined");
    for (i, prompt) in PROMPTS.iter().enumerate() {
        let alone = generator.generate(prompt, |_| Ok(()))?;
        let got = done[i].as_ref().expect("every sequence finished");
        assert_same(&format!("prompt {i}"), got, &alone);
        assert_eq!(got.stop, StopReason::MaxNewTokens);
    }
    assert!(
        batch.step(|_, _| Ok(()))?.is_empty(),
        "an empty batch steps to nothing"
    );
    Ok(())
}

#[test]
fn bad_prompts_and_rows_are_errors() -> Result<()> {
    let (model, tokenizer) = load()?;
    let generator = Generator::new(&model, &tokenizer, config(4, &[], vec![]))?;
    let mut batch = generator.batch();
    let err = batch.add_ids(&[]).expect_err("an empty prompt");
    assert!(err.to_string().contains("no tokens"), "{err}");
    let err = batch
        .add_ids(&[5, 8192])
        .expect_err("an id outside the vocabulary");
    assert!(err.to_string().contains("8192"), "{err}");
    assert!(batch.is_empty(), "a refused prompt does not join");
    let zero = Generator::new(&model, &tokenizer, config(0, &[], vec![]))?;
    let out = zero.generate_batch(&PROMPTS[..2], |_, _| Ok(()))?;
    assert!(out
        .iter()
        .all(|g| g.tokens.is_empty() && g.stop == StopReason::MaxNewTokens));

    let cache = model.new_cache(3)?;
    for (rows, msg) in [
        (&[][..], "no rows"),
        (&[0, 3][..], "row 3 is out of range"),
        (&[1, 1][..], "row 1 is given twice"),
    ] {
        let err = cache.select(rows).expect_err(msg);
        assert!(err.to_string().contains(msg), "{err}");
    }
    let other = Model::load(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mamba2-130m-hf"),
        DType::F32,
        &Device::Cpu,
    )?;
    let err = Cache::join(&[cache, other.new_cache(1)?]).expect_err("caches of two models");
    assert!(err.to_string().contains("another model"), "{err}");
    Ok(())
}

/// The largest |a − b| over the largest |b|.
fn rel(a: &Tensor, b: &Tensor) -> Result<f64> {
    let diff = (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
    let scale = b.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
    Ok(f64::from(diff) / f64::from(scale.max(f32::MIN_POSITIVE)))
}

#[test]
fn prefill_in_pieces_split_anywhere_gives_the_states_and_logits_of_one_call() -> Result<()> {
    let (mut model, _) = load()?;
    // Pieces of the model's own prefill are whole chunks; make them odd too.
    model.set_prefill_piece_len(96)?;
    let mut state = 11u64;
    let ids: Vec<u32> = (0..1000)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 33) % 8192) as u32
        })
        .collect();
    let all = Tensor::new(ids.as_slice(), &Device::Cpu)?.unsqueeze(0)?;
    let mut one = model.new_cache(1)?;
    let want = model.forward(&all, &mut one)?;
    for splits in [
        vec![300, 700],
        vec![1, 999],
        vec![77, 3, 500, 420],
        vec![999, 1],
    ] {
        let mut cache = model.new_cache(1)?;
        let mut logits = Vec::new();
        let mut at = 0;
        for len in &splits {
            logits.push(model.forward(&all.narrow(1, at, *len)?, &mut cache)?);
            at += len;
        }
        let got = Tensor::cat(&logits, 1)?;
        let e = rel(&got, &want)?;
        assert!(e <= 2e-6, "splits {splits:?}: logits rel err {e:e}");
        assert_eq!(cache.tokens(), 1000);
        let mut worst = (0f64, 0f64);
        for (l, (a, b)) in cache.layers().iter().zip(one.layers()).enumerate() {
            let (es, ec) = (rel(&a.ssm, &b.ssm)?, rel(&a.conv, &b.conv)?);
            worst = (worst.0.max(es), worst.1.max(ec));
            // The states sum a thousand tokens' f32 updates along other chunk boundaries, in an
            // order that also depends on the CPU's vector width (the matmul kernels candle picks
            // for it): about 32 ulps.
            assert!(
                es <= 4e-6 && ec <= 4e-6,
                "splits {splits:?}, layer {l}: ssm {es:e}, conv {ec:e}"
            );
        }
        eprintln!(
            "splits {splits:?}: logits rel err {e:e}, ssm {:e}, conv {:e}",
            worst.0, worst.1
        );
    }
    Ok(())
}
