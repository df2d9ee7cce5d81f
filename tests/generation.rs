//! Sampling, UTF-8-safe streaming and the `Generator` (seeded determinism, EOS, stop strings).

mod common;

use candle_core::{DType, Device, Result, Tensor};
use common::fixture::root;
use mamba2::model::{
    byte_tokenizer, id_tokenizer, GenerationConfig, Generator, Model, Sampler, SamplingParams,
    StopReason, TextStream, Tokenizer,
};

fn logits(v: &[f32]) -> Result<Tensor> {
    Tensor::new(v, &Device::Cpu)
}

fn params(temperature: f64, top_k: Option<usize>, top_p: Option<f64>) -> SamplingParams {
    SamplingParams {
        temperature,
        top_k,
        top_p,
        seed: 7,
        ..SamplingParams::default()
    }
}

/// Draws `n` tokens from fixed logits and returns the frequency of each token.
fn frequencies(p: SamplingParams, l: &[f32], n: usize) -> Result<Vec<f64>> {
    let mut s = Sampler::new(p)?;
    let t = logits(l)?;
    let mut counts = vec![0usize; l.len()];
    for _ in 0..n {
        counts[s.sample(&t, &[])? as usize] += 1;
    }
    Ok(counts.iter().map(|&c| c as f64 / n as f64).collect())
}

fn assert_close(got: &[f64], want: &[f64], tol: f64) {
    for (g, w) in got.iter().zip(want) {
        assert!((g - w).abs() <= tol, "frequencies {got:?}, want {want:?}");
    }
}

#[test]
fn sampler_follows_temperature_top_k_and_top_p() -> Result<()> {
    // Probabilities 1/6, 2/6, 3/6.
    let l = [0.0, 2f32.ln(), 3f32.ln()];
    let n = 60_000;
    assert_close(
        &frequencies(params(1.0, None, None), &l, n)?,
        &[1.0 / 6.0, 2.0 / 6.0, 3.0 / 6.0],
        0.01,
    );
    // T = 0.5 squares the odds: 1/14, 4/14, 9/14.
    assert_close(
        &frequencies(params(0.5, None, None), &l, n)?,
        &[1.0 / 14.0, 4.0 / 14.0, 9.0 / 14.0],
        0.01,
    );
    assert_close(
        &frequencies(params(1.0, Some(2), None), &l, n)?,
        &[0.0, 0.4, 0.6],
        0.01,
    );
    // top-p 0.5: token 2 alone reaches the mass; 0.6 needs tokens 2 and 1.
    assert_close(
        &frequencies(params(1.0, None, Some(0.5)), &l, n)?,
        &[0.0, 0.0, 1.0],
        0.0,
    );
    assert_close(
        &frequencies(params(1.0, None, Some(0.6)), &l, n)?,
        &[0.0, 0.4, 0.6],
        0.01,
    );
    assert_close(
        &frequencies(params(1.0, Some(1), None), &l, 100)?,
        &[0.0, 0.0, 1.0],
        0.0,
    );
    Ok(())
}

#[test]
fn greedy_and_repetition_penalty() -> Result<()> {
    let mut greedy = Sampler::new(SamplingParams::default())?;
    assert_eq!(greedy.sample(&logits(&[0.5, 2.0, 1.9])?, &[])?, 1);
    let mut penalised = Sampler::new(SamplingParams {
        repetition_penalty: 1.5,
        ..SamplingParams::default()
    })?;
    // 2.0 / 1.5 < 1.9: the repeated token loses.
    assert_eq!(penalised.sample(&logits(&[0.5, 2.0, 1.9])?, &[1])?, 2);
    // Negative logits are multiplied: −1.0·1.5 < −1.2.
    assert_eq!(penalised.sample(&logits(&[-1.0, -1.2, -3.0])?, &[0])?, 1);
    // Only the last repeat_last_n tokens count.
    let mut short = Sampler::new(SamplingParams {
        repetition_penalty: 1.5,
        repeat_last_n: 1,
        ..SamplingParams::default()
    })?;
    assert_eq!(short.sample(&logits(&[0.5, 2.0, 1.9])?, &[1, 0])?, 1);
    Ok(())
}

#[test]
fn sampler_parameters_are_checked() {
    let bad = [
        (
            params(-1.0, None, None),
            "temperature must be finite and >= 0",
        ),
        (params(1.0, Some(0), None), "top_k must be >= 1"),
        (
            params(1.0, None, Some(0.0)),
            "top_p must be in (0, 1], got 0",
        ),
        (
            params(1.0, None, Some(1.5)),
            "top_p must be in (0, 1], got 1.5",
        ),
        (
            SamplingParams {
                repetition_penalty: 0.0,
                ..SamplingParams::default()
            },
            "repetition_penalty must be finite and > 0",
        ),
    ];
    for (p, needle) in bad {
        let msg = Sampler::new(p).expect_err("bad parameters").to_string();
        assert!(msg.contains(needle), "{msg:?} does not contain {needle:?}");
    }
}

/// A byte-level BPE whose merges end tokens in the middle of characters: "hé€!" is
/// `hÃ | ©â | \u{124}¬ | !`, i.e. h+C3, A9+E2, 82+AC, '!'.
fn splitting_tokenizer() -> Result<Tokenizer> {
    let bytes = byte_tokenizer()?;
    let ch = |b: u8| bytes.id_to_token(b as u32).expect("byte token");
    let mut vocab: serde_json::Map<String, serde_json::Value> =
        (0..=255u8).map(|b| (ch(b), b.into())).collect();
    let merges: Vec<(String, String)> = [(b'h', 0xC3), (0xA9, 0xE2), (0x82, 0xAC)]
        .iter()
        .map(|&(a, b)| (ch(a), ch(b)))
        .collect();
    for (i, (a, b)) in merges.iter().enumerate() {
        vocab.insert(format!("{a}{b}"), (256 + i).into());
    }
    let byte_level = serde_json::json!({
        "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false
    });
    let spec = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": byte_level, "post_processor": null,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "vocab": vocab, "merges": merges}
    });
    spec.to_string()
        .parse()
        .map_err(|e| candle_core::Error::msg(format!("{e}")))
}

#[test]
fn stream_never_splits_a_character() -> Result<()> {
    let tok = splitting_tokenizer()?;
    let text = "hé€!";
    let ids = tok
        .encode(text, false)
        .map_err(|e| candle_core::Error::msg(format!("{e}")))?
        .get_ids()
        .to_vec();
    assert_eq!(
        ids,
        vec![256, 257, 258, b'!' as u32],
        "the merges split é and €"
    );
    // Decoding the first token alone cuts é in half.
    let half = tok
        .decode(&ids[..1], true)
        .map_err(|e| candle_core::Error::msg(format!("{e}")))?;
    assert_eq!(half, "h\u{FFFD}");

    let mut stream = TextStream::new(&tok);
    let pieces: Vec<String> = ids.iter().map(|&t| stream.push(t)).collect::<Result<_>>()?;
    assert_eq!(pieces, ["", "", "hé€", "!"]);
    assert_eq!(stream.flush()?, "");
    assert_eq!(stream.tokens(), ids.as_slice());

    // After context tokens, only the new text comes out, with the context's help: the id
    // tokenizer separates words by spaces, so the first new id needs its space.
    let ids_tok = id_tokenizer(50)?;
    let mut stream = TextStream::with_context(&ids_tok, &[1, 2, 3]);
    assert_eq!(stream.push(42)?, " 42");
    assert_eq!(stream.tokens(), [1, 2, 3, 42]);
    let mut stream = TextStream::with_context(&tok, &ids[..1]);
    assert_eq!(stream.push(ids[1])?, "");
    assert_eq!(stream.push(ids[2])?, "é€");

    // At the end, a character cut in half is flushed lossily.
    let mut stream = TextStream::new(&tok);
    assert_eq!(stream.push(256)?, "");
    assert_eq!(stream.flush()?, "h\u{FFFD}");
    Ok(())
}

#[test]
fn stand_in_tokenizers_round_trip() -> Result<()> {
    let bytes = byte_tokenizer()?;
    let text = "naïve ☃ text";
    let enc = bytes
        .encode(text, false)
        .map_err(|e| candle_core::Error::msg(format!("{e}")))?;
    assert_eq!(
        enc.get_ids(),
        text.bytes().map(u32::from).collect::<Vec<_>>()
    );
    let ids = id_tokenizer(50)?;
    let enc = ids
        .encode("3 17 5", false)
        .map_err(|e| candle_core::Error::msg(format!("{e}")))?;
    assert_eq!(enc.get_ids(), [3, 17, 5]);
    let mut stream = TextStream::new(&ids);
    let out: String = [3, 17, 5]
        .iter()
        .map(|&t| stream.push(t))
        .collect::<Result<_>>()?;
    assert_eq!(out, "3 17 5");
    Ok(())
}

fn model() -> Result<Model> {
    // Vocabulary 288 ≥ 256: the byte tokenizer fits.
    Model::load(root().join("mamba2-130m-hf"), DType::F32, &Device::Cpu)
}

fn run(
    model: &Model,
    tok: &Tokenizer,
    config: GenerationConfig,
) -> Result<(mamba2::model::Generation, String)> {
    let generator = Generator::new(model, tok, config)?;
    let mut streamed = String::new();
    let g = generator.generate("Mamba", |s| {
        streamed.push_str(s);
        Ok(())
    })?;
    Ok((g, streamed))
}

fn sampled(seed: u64, max_new_tokens: usize) -> GenerationConfig {
    GenerationConfig {
        max_new_tokens,
        sampling: SamplingParams {
            temperature: 1.0,
            top_k: Some(100),
            top_p: Some(0.95),
            repetition_penalty: 1.1,
            repeat_last_n: 16,
            seed,
        },
        ..GenerationConfig::default()
    }
}

#[test]
fn seeded_generation_is_deterministic() -> Result<()> {
    let (model, tok) = (model()?, byte_tokenizer()?);
    let (a, sa) = run(&model, &tok, sampled(42, 40))?;
    let (b, sb) = run(&model, &tok, sampled(42, 40))?;
    let (c, _) = run(&model, &tok, sampled(43, 40))?;
    assert_eq!(a.tokens, b.tokens);
    assert_eq!((&a.text, &sa), (&b.text, &sb));
    assert_ne!(a.tokens, c.tokens, "another seed draws other tokens");
    assert_eq!(a.tokens.len(), 40);
    assert_eq!(a.stop, StopReason::MaxNewTokens);
    assert_eq!((a.prompt_tokens, a.decode_steps), (5, 39));
    assert!(a.prefill_tokens_per_s() > 0.0 && a.decode_tokens_per_s() > 0.0);
    assert!(a.to_string().contains("decode"));
    assert_eq!(sa, a.text);
    Ok(())
}

/// Greedy generation is the argmax loop over prefill and step.
#[test]
fn greedy_generation_follows_the_model() -> Result<()> {
    let (model, tok) = (model()?, byte_tokenizer()?);
    let config = GenerationConfig {
        max_new_tokens: 12,
        ..GenerationConfig::default()
    };
    let (g, _) = run(&model, &tok, config)?;
    let prompt: Vec<u32> = "Mamba".bytes().map(u32::from).collect();
    let mut cache = model.new_cache(1)?;
    let ids = Tensor::new(prompt.as_slice(), &Device::Cpu)?.unsqueeze(0)?;
    let mut logits = model.prefill(&ids, &mut cache)?;
    let mut want = Vec::new();
    for _ in 0..12 {
        let t = logits.squeeze(0)?.argmax(0)?.to_scalar::<u32>()?;
        want.push(t);
        logits = model.step(&Tensor::new(&[t], &Device::Cpu)?, &mut cache)?;
    }
    assert_eq!(g.tokens, want);
    Ok(())
}

#[test]
fn generation_stops_at_eos_and_stop_strings() -> Result<()> {
    let (model, tok) = (model()?, byte_tokenizer()?);
    let (full, _) = run(&model, &tok, sampled(5, 40))?;
    // EOS: the first token that has not appeared before it.
    let k = (1..full.tokens.len())
        .find(|&k| !full.tokens[..k].contains(&full.tokens[k]))
        .expect("a new token");
    let mut config = sampled(5, 40);
    config.eos_token_ids = vec![full.tokens[k]];
    let (g, streamed) = run(&model, &tok, config)?;
    assert_eq!(g.stop, StopReason::Eos);
    assert_eq!(g.tokens, full.tokens[..k]);
    assert_eq!(streamed, g.text);

    // A stop string taken from the middle of the text: output ends right before it.
    let chars: Vec<char> = full.text.chars().collect();
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let at = full.text.find(&stop).expect("stop string in the text");
    let mut config = sampled(5, 40);
    config.stop_strings = vec!["never appears \u{0}".into(), stop.clone()];
    let (g, streamed) = run(&model, &tok, config)?;
    assert_eq!(
        g.stop,
        StopReason::StopString,
        "stop {stop:?} in {:?}",
        full.text
    );
    assert_eq!(g.text, full.text[..at]);
    assert_eq!(streamed, g.text);
    Ok(())
}

#[test]
fn bad_generation_inputs_are_named() -> Result<()> {
    let model = model()?;
    let tok = byte_tokenizer()?;
    let generator = Generator::new(&model, &tok, GenerationConfig::default())?;
    let err = generator
        .generate_from_ids(&[], |_| Ok(()))
        .expect_err("empty prompt");
    assert!(err.to_string().contains("the prompt has no tokens"));
    let err = generator
        .generate_from_ids(&[1, 288], |_| Ok(()))
        .expect_err("id out of vocabulary");
    assert!(err
        .to_string()
        .contains("token id 288 at prompt[1] is out of the model's vocabulary (288 tokens"));
    let config = GenerationConfig {
        stop_strings: vec![String::new()],
        ..GenerationConfig::default()
    };
    assert!(Generator::new(&model, &tok, config).is_err());
    Ok(())
}
