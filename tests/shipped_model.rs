//! The shipped model in `weights/` (see `weights/MODEL_CARD.md`) against HF transformers:
//! `tests/fixtures/shipped/reference.safetensors`, made by `tests/fixtures/shipped/make_fixture.py`
//! (float64 HF logits for the prompts of `prompts.txt`, full vocabulary at 8 positions per prompt,
//! and the reference next-token NLL at every position; see `tests/fixtures/README.md`).
//!
//! - the committed tokenizer encodes each prompt to the fixture's `input_ids`;
//! - f32 CPU logits, by prefill and by token-by-token decode, within max rel err 1e-4
//!   (max |got − want| / max |want|);
//! - the perplexity of the `perplexity` example's definition (each prompt one window from an
//!   empty state, tokens 1..len−1 predicted) equals the reference's;
//! - the files keep to issue 5's size limits and hold the card's parameter count.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, IndexOp, Result, Tensor, D};
use common::rel_err;
use mamba2::model::{load_tokenizer, Model, Tokenizer};

const TOL: f64 = 1e-4;

fn weights_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("weights")
}

fn fixture_dir() -> PathBuf {
    common::fixture::root().join("shipped")
}

/// The fixture: its tensors and the prompts recorded in its metadata.
struct Fixture {
    tensors: HashMap<String, Tensor>,
    prompts: Vec<String>,
}

impl Fixture {
    fn load() -> Result<Self> {
        let path = fixture_dir().join("reference.safetensors");
        let tensors = candle_core::safetensors::load(&path, &Device::Cpu)?;
        // Header: u64 LE length, then JSON with "__metadata__": {"reference": "<JSON object>"}.
        let bytes = std::fs::read(&path)?;
        let n = u64::from_le_bytes(bytes[..8].try_into().map_err(candle_core::Error::wrap)?);
        let header: serde_json::Value =
            serde_json::from_slice(&bytes[8..8 + n as usize]).map_err(candle_core::Error::wrap)?;
        let meta: serde_json::Value = serde_json::from_str(
            header["__metadata__"]["reference"]
                .as_str()
                .expect("metadata key `reference`"),
        )
        .map_err(candle_core::Error::wrap)?;
        assert_eq!(meta["dtype"], "float64", "the reference is HF in float64");
        let prompts = serde_json::from_str(meta["prompts"].as_str().expect("prompts"))
            .map_err(candle_core::Error::wrap)?;
        Ok(Self { tensors, prompts })
    }

    fn get(&self, key: &str) -> &Tensor {
        self.tensors
            .get(key)
            .unwrap_or_else(|| panic!("shipped fixture has no {key}"))
    }

    fn ids(&self, i: usize) -> Result<Vec<u32>> {
        self.get(&format!("input_ids.{i}"))
            .squeeze(0)?
            .to_dtype(DType::U32)?
            .to_vec1()
    }

    fn positions(&self, i: usize) -> Result<Vec<usize>> {
        let p: Vec<i64> = self.get(&format!("positions.{i}")).to_vec1()?;
        Ok(p.into_iter().map(|p| p as usize).collect())
    }
}

fn load_model() -> Result<(Model, Tokenizer)> {
    let dir = weights_dir();
    let model = Model::load(&dir, DType::F32, &Device::Cpu)?;
    let tokenizer = load_tokenizer(dir.join("tokenizer.json"))?;
    Ok((model, tokenizer))
}

/// `logits [1, L, V]` at `positions` → `[1, P, V]`.
fn at(logits: &Tensor, positions: &[usize]) -> Result<Tensor> {
    let idx: Vec<u32> = positions.iter().map(|&p| p as u32).collect();
    logits.index_select(&Tensor::new(idx.as_slice(), logits.device())?, 1)
}

/// −log p(x_t | x_<t) for t = 1..L−1 of one window, as the `perplexity` example computes it:
/// a forward over tokens 0..L−2 from an empty cache, log-softmax, gather the next tokens.
fn window_nll(model: &Model, ids: &[u32]) -> Result<Vec<f64>> {
    let len = ids.len();
    let window = Tensor::new(ids, &Device::Cpu)?.unsqueeze(0)?;
    let logits = model.forward(&window.narrow(1, 0, len - 1)?, &mut model.new_cache(1)?)?;
    let logp = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
    let targets = window.narrow(1, 1, len - 1)?.unsqueeze(2)?.contiguous()?;
    let nll = logp.gather(&targets, 2)?.neg()?.flatten_all()?;
    nll.to_dtype(DType::F64)?.to_vec1()
}

#[test]
fn prompts_file_matches_fixture_and_tokenizer() -> Result<()> {
    let fixture = Fixture::load()?;
    let text = std::fs::read_to_string(fixture_dir().join("prompts.txt"))?;
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(
        lines, fixture.prompts,
        "prompts.txt differs from the fixture"
    );
    assert_eq!(fixture.prompts.len(), 3);
    let tokenizer = load_tokenizer(weights_dir().join("tokenizer.json"))?;
    assert_eq!(tokenizer.get_vocab_size(true), 8192);
    assert_eq!(tokenizer.token_to_id("<|endoftext|>"), Some(0));
    for (i, prompt) in fixture.prompts.iter().enumerate() {
        let enc = tokenizer
            .encode(prompt.as_str(), true)
            .map_err(candle_core::Error::msg)?;
        let want = fixture.ids(i)?;
        assert_eq!(enc.get_ids(), want.as_slice(), "prompt {i}: {prompt:?}");
        assert!(
            want.len() >= 20,
            "prompt {i} has only {} tokens",
            want.len()
        );
        // Byte-level BPE: decoding gives the prompt back, curly quotes, £ and ï included.
        let back = tokenizer
            .decode(enc.get_ids(), false)
            .map_err(candle_core::Error::msg)?;
        assert_eq!(&back, prompt);
    }
    Ok(())
}

#[test]
fn shipped_weights_match_hf_reference() -> Result<()> {
    let fixture = Fixture::load()?;
    let (model, _) = load_model()?;
    let config = model.config();
    assert_eq!(
        (
            config.d_model,
            config.n_layer,
            config.vocab_size,
            config.d_state
        ),
        (384, 10, 8192, 64)
    );
    assert!(config.tie_embeddings && config.ngroups == 1);
    for i in 0..fixture.prompts.len() {
        let ids = fixture.ids(i)?;
        let positions = fixture.positions(i)?;
        let want = fixture.get(&format!("logits.{i}"));
        assert_eq!(want.dims(), &[1, positions.len(), 8192]);
        let ids_t = Tensor::new(ids.as_slice(), &Device::Cpu)?.unsqueeze(0)?;

        // Prefill: all positions at once.
        let mut cache = model.new_cache(1)?;
        let logits = model.forward(&ids_t, &mut cache)?;
        let prefill = rel_err(&at(&logits, &positions)?, want)?;

        // Decode: prefill 3 tokens, then one token at a time through the cache.
        let l0 = 3;
        let mut cache = model.new_cache(1)?;
        let mut rows = vec![model.prefill(&ids_t.i((.., ..l0))?, &mut cache)?];
        for t in l0..ids.len() {
            rows.push(model.step(&ids_t.i((.., t))?.contiguous()?, &mut cache)?);
        }
        let decoded = Tensor::stack(&rows, 1)?; // positions l0−1 .. L−1
        let later: Vec<usize> = positions.iter().copied().filter(|&p| p >= l0 - 1).collect();
        let shifted: Vec<usize> = later.iter().map(|&p| p - (l0 - 1)).collect();
        let first_later = positions.len() - later.len();
        let decode = rel_err(
            &at(&decoded, &shifted)?,
            &want.narrow(1, first_later, later.len())?,
        )?;

        println!(
            "prompt {i} ({} tokens): prefill logits rel err {prefill:.2e}, decode {decode:.2e}",
            ids.len()
        );
        assert!(
            prefill <= TOL,
            "prompt {i}: prefill rel err {prefill:e} > {TOL:e}"
        );
        assert!(
            decode <= TOL,
            "prompt {i}: decode rel err {decode:e} > {TOL:e}"
        );
    }
    Ok(())
}

#[test]
fn perplexity_definition_matches_reference() -> Result<()> {
    let fixture = Fixture::load()?;
    let (model, _) = load_model()?;
    let (mut got_sum, mut want_sum, mut count) = (0f64, 0f64, 0usize);
    let mut worst_all = 0f64;
    for i in 0..fixture.prompts.len() {
        let ids = fixture.ids(i)?;
        let got = window_nll(&model, &ids)?;
        let want: Vec<f64> = fixture.get(&format!("nll.{i}")).squeeze(0)?.to_vec1()?;
        assert_eq!(got.len(), ids.len() - 1);
        assert_eq!(got.len(), want.len());
        let worst = got
            .iter()
            .zip(&want)
            .map(|(g, w)| (g - w).abs())
            .fold(0f64, f64::max);
        assert!(worst <= 1e-3, "prompt {i}: per-token NLL off by {worst:e}");
        worst_all = worst_all.max(worst);
        got_sum += got.iter().sum::<f64>();
        want_sum += want.iter().sum::<f64>();
        count += got.len();
    }
    let (got, want) = (
        (got_sum / count as f64).exp(),
        (want_sum / count as f64).exp(),
    );
    println!(
        "perplexity over {count} predicted tokens: {got:.6} (HF f64 reference {want:.6}, rel diff \
         {:.1e}); worst per-token NLL diff {worst_all:.1e}",
        (got / want - 1.0).abs()
    );
    assert!(
        (got / want - 1.0).abs() <= 1e-5,
        "perplexity {got} vs reference {want}"
    );
    // A trained model, not a uniform one (ppl 8192) nor a broken one.
    assert!(want > 5.0 && want < 200.0, "reference perplexity {want}");
    Ok(())
}

#[test]
fn weight_files_keep_to_the_limits() -> Result<()> {
    const MIB: u64 = 1 << 20;
    let mut total_bytes = 0;
    let mut params = 0;
    let mut shards = 0;
    for entry in std::fs::read_dir(weights_dir())? {
        let path = entry?.path();
        let size = std::fs::metadata(&path)?.len();
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        assert!(size <= 16 * MIB, "{name} is {size} bytes (> 16 MiB)");
        if name.ends_with(".safetensors") {
            shards += 1;
            total_bytes += size;
            for (key, t) in candle_core::safetensors::load(&path, &Device::Cpu)? {
                assert_eq!(t.dtype(), DType::F32, "{key}");
                params += t.elem_count();
            }
        }
    }
    assert_eq!(shards, 4);
    assert!(total_bytes <= 60_000_000, "weights are {total_bytes} bytes");
    assert_eq!(params, 12_587_752, "the model card's parameter count");
    Ok(())
}
