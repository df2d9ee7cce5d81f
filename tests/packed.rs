//! Sequences packed along L (`cu_seqlens`): `ssd_packed`, `causal_conv1d_split_packed` and
//! `Model::prefill_packed` give every sequence what it gets alone (CPU, f32: the ops bit for bit,
//! the model within 5e-6 of the largest value, see `bound`), with boundaries anywhere — mid-chunk, sequences of one
//! token and sequences shorter than the conv kernel — with per-sequence initial states, through
//! the backward, and over random length mixes (a property test); bad offsets are errors. Training
//! on packed documents (`Model::loss_packed`) gives each document's loss and gradients.

mod common;

use std::collections::HashMap;

use candle_core::{DType, Device, Result, Tensor, Var};
use candle_nn::VarBuilder;
use common::fixture::{case_names, root};
use common::{rel_err, Rng};
use mamba2::kernels::{
    causal_conv1d_split, causal_conv1d_split_packed, ssd, ssd_packed, ConvOptions, DtOptions,
    SsdOptions,
};
use mamba2::model::{Config, LayerState, Mixer, Model, TrainableModel};
use proptest::prelude::*;

/// `[0, l_0, l_0 + l_1, …]`.
fn offsets(lens: &[usize]) -> Vec<usize> {
    let mut cu = vec![0];
    for l in lens {
        cu.push(cu[cu.len() - 1] + l);
    }
    cu
}

fn bits(t: &Tensor) -> Result<Vec<u32>> {
    Ok(t.flatten_all()?
        .to_dtype(DType::F32)?
        .to_vec1::<f32>()?
        .iter()
        .map(|v| v.to_bits())
        .collect())
}

struct SsdCase {
    x: Tensor,
    dt: Tensor,
    a: Tensor,
    b: Tensor,
    c: Tensor,
    z: Tensor,
    d: Tensor,
    bias: Tensor,
    init: Tensor,
}

fn ssd_case(total: usize, seqs: usize, seed: u64) -> Result<SsdCase> {
    let (h, p, g, n) = (4, 8, 2, 16);
    let dev = Device::Cpu;
    let mut rng = Rng::new(seed);
    Ok(SsdCase {
        x: rng.tensor(&[1, total, h, p], 1.0, &dev)?,
        dt: rng.tensor(&[1, total, h], 1.0, &dev)?,
        a: Tensor::new(&[-0.5f32, -1.0, -2.0, -4.0], &dev)?,
        b: rng.tensor(&[1, total, g, n], 1.0, &dev)?,
        c: rng.tensor(&[1, total, g, n], 1.0, &dev)?,
        z: rng.tensor(&[1, total, h, p], 1.0, &dev)?,
        d: rng.tensor(&[h], 1.0, &dev)?,
        bias: rng.tensor(&[h], 0.5, &dev)?,
        init: rng.tensor(&[seqs, h, p, n], 1.0, &dev)?,
    })
}

fn opts<'a>(s: &'a SsdCase, z: Option<&'a Tensor>, init: Option<&'a Tensor>) -> SsdOptions<'a> {
    SsdOptions {
        chunk_size: 16,
        dt: DtOptions {
            bias: Some(&s.bias),
            softplus: true,
            limit: (0.0, f32::INFINITY),
        },
        d: Some(&s.d),
        z,
        initial_state: init,
        state_dtype: DType::F32,
    }
}

/// `ssd_packed` over `cu` (from each sequence's row of `s.init` when `init`, else zeros), checked
/// bit for bit against each sequence run alone; returns the packed y.
fn each_sequence_alone(s: &SsdCase, cu: &[usize], init: bool) -> Result<Tensor> {
    let packed = opts(s, Some(&s.z), init.then_some(&s.init));
    let (y, states) = ssd_packed(&s.x, &s.dt, &s.a, &s.b, &s.c, cu, &packed)?;
    for (i, w) in cu.windows(2).enumerate() {
        let piece = |t: &Tensor| t.narrow(1, w[0], w[1] - w[0]);
        let z = piece(&s.z)?;
        let one_init = init.then(|| s.init.narrow(0, i, 1)).transpose()?;
        let one = opts(s, Some(&z), one_init.as_ref());
        let (y1, s1) = ssd(
            &piece(&s.x)?,
            &piece(&s.dt)?,
            &s.a,
            &piece(&s.b)?,
            &piece(&s.c)?,
            &one,
        )?;
        assert_eq!(bits(&piece(&y)?)?, bits(&y1)?, "sequence {i}: y");
        let state = states.narrow(0, i, 1)?;
        assert_eq!(bits(&state)?, bits(&s1)?, "sequence {i}: state");
    }
    Ok(y)
}

#[test]
fn ssd_packed_gives_each_sequence_what_it_gets_alone() -> Result<()> {
    // Boundaries mid-chunk (chunk 16), sequences of one token, one longer than several chunks.
    let lens = [5, 1, 40, 16, 1, 23];
    let cu = offsets(&lens);
    let s = ssd_case(cu[lens.len()], lens.len(), 1)?;
    let y = each_sequence_alone(&s, &cu, true)?;
    // And the packed result is not the unpacked one: the states do not flow across boundaries.
    let (whole, _) = ssd(&s.x, &s.dt, &s.a, &s.b, &s.c, &opts(&s, Some(&s.z), None))?;
    assert!(
        rel_err(
            &y.narrow(1, 5, 1)?,
            &whole.narrow(1, 5, 1)?.to_dtype(DType::F64)?
        )? > 1e-3
    );
    // Sequences of whole chunks and parts of one, from zero states and from their own.
    let lens = [16, 48, 32, 16, 7];
    let cu = offsets(&lens);
    let s = ssd_case(cu[lens.len()], lens.len(), 6)?;
    for init in [false, true] {
        each_sequence_alone(&s, &cu, init)?;
    }
    Ok(())
}

#[test]
fn ssd_packed_backward_equals_each_sequences_backward() -> Result<()> {
    let lens = [7, 1, 20];
    let cu = offsets(&lens);
    let s = ssd_case(cu[lens.len()], lens.len(), 2)?;
    let w = Rng::new(3).tensor(&[1, cu[lens.len()], 4, 8], 1.0, &Device::Cpu)?;
    let grads = |packed: bool| -> Result<Vec<Tensor>> {
        let (x, b, c) = (
            Var::from_tensor(&s.x)?,
            Var::from_tensor(&s.b)?,
            Var::from_tensor(&s.c)?,
        );
        let y = if packed {
            ssd_packed(
                x.as_tensor(),
                &s.dt,
                &s.a,
                b.as_tensor(),
                c.as_tensor(),
                &cu,
                &opts(&s, None, None),
            )?
            .0
        } else {
            let mut ys = Vec::new();
            for w in cu.windows(2) {
                let piece = |t: &Tensor| t.narrow(1, w[0], w[1] - w[0]);
                let o = opts(&s, None, None);
                let (y, _) = ssd(
                    &piece(x.as_tensor())?,
                    &piece(&s.dt)?,
                    &s.a,
                    &piece(b.as_tensor())?,
                    &piece(c.as_tensor())?,
                    &o,
                )?;
                ys.push(y);
            }
            Tensor::cat(&ys, 1)?
        };
        let g = y.mul(&w)?.sum_all()?.backward()?;
        [x, b, c]
            .iter()
            .map(|v| {
                g.get(v.as_tensor())
                    .cloned()
                    .ok_or_else(|| candle_core::Error::msg("no gradient"))
            })
            .collect()
    };
    for (i, (got, want)) in grads(true)?.iter().zip(grads(false)?).enumerate() {
        let e = rel_err(got, &want.to_dtype(DType::F64)?)?;
        assert!(e <= 1e-6, "input {i}: packed gradient rel err {e:e}");
    }
    Ok(())
}

#[test]
fn conv_packed_gives_each_sequence_what_it_gets_alone() -> Result<()> {
    // Sequences shorter than the kernel (4 taps) and of one token, from their own states.
    let lens = [2, 1, 9, 3, 12];
    let cu = offsets(&lens);
    let (total, dim, width) = (cu[lens.len()], 10, 4);
    let mut rng = Rng::new(4);
    let dev = Device::Cpu;
    let x = rng.tensor(&[1, total, dim], 1.0, &dev)?;
    let w = rng.tensor(&[dim, width], 1.0, &dev)?;
    let bias = rng.tensor(&[dim], 1.0, &dev)?;
    let init = rng.tensor(&[lens.len(), dim, width], 1.0, &dev)?;
    let opts = ConvOptions {
        bias: Some(&bias),
        silu: true,
    };
    let split = [6, 2, 2];
    let (ys, states) = causal_conv1d_split_packed(&x, &w, Some(&init), &opts, &split, &cu)?;
    for (i, win) in cu.windows(2).enumerate() {
        let (start, len) = (win[0], win[1] - win[0]);
        let one = init.narrow(0, i, 1)?;
        let (y1, s1) =
            causal_conv1d_split(&x.narrow(1, start, len)?, &w, Some(&one), &opts, &split)?;
        for (j, (y, y1)) in ys.iter().zip(&y1).enumerate() {
            assert_eq!(
                bits(&y.narrow(1, start, len)?)?,
                bits(y1)?,
                "sequence {i}, piece {j}"
            );
        }
        assert_eq!(
            bits(&states.narrow(0, i, 1)?)?,
            bits(&s1)?,
            "sequence {i}: state"
        );
    }
    Ok(())
}

#[test]
fn bad_offsets_and_states_are_errors() -> Result<()> {
    let s = ssd_case(10, 2, 5)?;
    let o = opts(&s, None, None);
    for (cu, needle) in [
        (vec![1, 10], "cu_seqlens must run from 0"),
        (vec![0, 9], "cu_seqlens must run from 0"),
        (vec![0], "cu_seqlens must run from 0"),
        (vec![0, 4, 4, 10], "must increase"),
        (vec![0, 6, 3, 10], "must increase"),
    ] {
        let err = ssd_packed(&s.x, &s.dt, &s.a, &s.b, &s.c, &cu, &o).expect_err(needle);
        assert!(err.to_string().contains(needle), "{cu:?}: {err}");
        let x = Tensor::ones((1, 10, 4), DType::F32, &Device::Cpu)?;
        let w = Tensor::ones((4, 4), DType::F32, &Device::Cpu)?;
        let err = causal_conv1d_split_packed(&x, &w, None, &ConvOptions::default(), &[4], &cu)
            .expect_err(needle);
        assert!(err.to_string().contains(needle), "conv {cu:?}: {err}");
    }
    let three = s.init.narrow(0, 0, 1)?.repeat((3, 1, 1, 1))?;
    let err = ssd_packed(
        &s.x,
        &s.dt,
        &s.a,
        &s.b,
        &s.c,
        &[0, 4, 10],
        &opts(&s, None, Some(&three)),
    )
    .expect_err("3 states for 2 sequences");
    assert!(
        err.to_string().contains("3 states for 2 sequences"),
        "{err}"
    );
    let two_rows = Tensor::cat(&[&s.x, &s.x], 0)?;
    let err = ssd_packed(&two_rows, &s.dt, &s.a, &s.b, &s.c, &[0, 10], &o).expect_err("two rows");
    assert!(err.to_string().contains("one row"), "{err}");
    Ok(())
}

/// Each prompt prefilled alone: its last logits `[1,V]` and its states, per layer.
fn alone(model: &Model, prompt: &[u32]) -> Result<(Tensor, Vec<(Tensor, Tensor)>)> {
    let mut cache = model.new_cache(1)?;
    let ids = Tensor::new(prompt, &Device::Cpu)?.unsqueeze(0)?;
    let logits = model.prefill(&ids, &mut cache)?;
    let states = cache
        .layers()
        .iter()
        .map(|l| (l.ssm.clone(), l.conv.clone()))
        .collect();
    Ok((logits, states))
}

/// The largest error of any prompt's packed logits and states against its own prefill, relative
/// to `bound(prompt length)`, and the largest error itself.
fn check_packed(
    model: &Model,
    prompts: &[Vec<u32>],
    bound: impl Fn(usize) -> f64,
) -> Result<(f64, f64)> {
    let refs: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
    let (logits, cache) = model.prefill_packed(&refs)?;
    let lens: Vec<usize> = prompts.iter().map(Vec::len).collect();
    assert_eq!(cache.row_tokens(), lens.as_slice());
    let (mut ratio, mut worst) = (0f64, 0f64);
    for (i, prompt) in prompts.iter().enumerate() {
        let (want, states) = alone(model, prompt)?;
        let mut e = rel_err(&logits.narrow(0, i, 1)?, &want.to_dtype(DType::F64)?)?;
        for (layer, (ssm, conv)) in cache.layers().iter().zip(states) {
            e = e.max(rel_err(
                &layer.ssm.narrow(0, i, 1)?,
                &ssm.to_dtype(DType::F64)?,
            )?);
            e = e.max(rel_err(
                &layer.conv.narrow(0, i, 1)?,
                &conv.to_dtype(DType::F64)?,
            )?);
        }
        ratio = ratio.max(e / bound(prompt.len()));
        worst = worst.max(e);
    }
    Ok((ratio, worst))
}

/// 5e-6. The ops above are bit for bit; the model's products are not: a prompt alone runs the
/// LM head (and a one-token prompt every projection) on one row, which candle's CPU matmul sums
/// on its matrix-vector path, rounding differently from the matrix product over the packed rows
/// (about 1e-6 of the largest value per product, compounding over the layers).
fn bound(_len: usize) -> f64 {
    5e-6
}

#[test]
fn prefill_packed_gives_each_prompt_its_own_logits_and_states() -> Result<()> {
    let weights = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("weights");
    let model = Model::load(weights, DType::F32, &Device::Cpu)?;
    let mut rng = Rng::new(6);
    // Lengths around the CPU scan's chunk (64) and the conv's window, and a one-token prompt.
    let prompts: Vec<Vec<u32>> = [1usize, 3, 64, 65, 130, 7]
        .iter()
        .map(|&l| (0..l).map(|_| (rng.next_u64() % 8192) as u32).collect())
        .collect();
    let (ratio, worst) = check_packed(&model, &prompts, bound)?;
    eprintln!("shipped model, 6 prompts: worst rel err {worst:e} ({ratio:.2} of its bound)");
    assert!(
        ratio <= 1.0,
        "worst rel err {worst:e}, {ratio:.2} of its bound"
    );
    let err = model
        .prefill_packed(&[&[1, 2], &[]])
        .expect_err("an empty prompt");
    assert!(err.to_string().contains("prompt 1 has no tokens"), "{err}");
    let err = model
        .prefill_packed(&[&[1, 8192]])
        .expect_err("an id outside the vocabulary");
    assert!(err.to_string().contains("8192"), "{err}");
    Ok(())
}

/// The shipped model in bf16: the pads' dt offsets and the conv mask take the model's dtype, and
/// each prompt still gets its own logits and states (within bf16's 2e-2 of the largest value:
/// a prompt alone and its padded row round differently).
#[test]
fn bf16_prefill_packed_gives_each_prompt_its_own_logits_and_states() -> Result<()> {
    let weights = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("weights");
    let model = Model::load(weights, DType::BF16, &Device::Cpu)?;
    let mut rng = Rng::new(16);
    let prompts: Vec<Vec<u32>> = [2usize, 70, 33, 1]
        .iter()
        .map(|&l| (0..l).map(|_| (rng.next_u64() % 8192) as u32).collect())
        .collect();
    let (ratio, worst) = check_packed(&model, &prompts, |_| 2e-2)?;
    eprintln!("shipped model in bf16, 4 prompts: worst rel err {worst:e}");
    assert!(ratio <= 1.0, "worst rel err {worst:e}");
    Ok(())
}

/// A mixer of random weights (the config's shapes, G = 2 groups, `limit` its dt_limit).
fn random_mixer(limit: &str) -> Result<(Mixer, Config)> {
    let cfg = Config::from_json(&format!(
        r#"{{"hidden_size": 64, "expand": 2, "num_heads": 8, "head_dim": 16, "state_size": 16,
            "n_groups": 2, "conv_kernel": 4, "chunk_size": 32, "time_step_limit": {limit},
            "num_hidden_layers": 1, "vocab_size": 16}}"#
    ))?;
    let (dm, di, h, cd) = (cfg.d_model, cfg.d_inner(), cfg.nheads, cfg.conv_dim());
    let dev = Device::Cpu;
    let randn = |shape: &[usize], std: f32| Tensor::randn(0f32, std, shape, &dev);
    let weights = [
        ("in_proj.weight", randn(&[cfg.in_proj_dim(), dm], 0.125)),
        ("conv1d.weight", randn(&[cd, 1, cfg.d_conv], 0.5)),
        ("conv1d.bias", randn(&[cd], 0.1)),
        ("A_log", Tensor::rand(0f32, 2.5, h, &dev)),
        ("D", randn(&[h], 1.0)),
        ("dt_bias", Tensor::rand(-4f32, -2., h, &dev)),
        ("norm.weight", Tensor::rand(0.5f32, 1.5, di, &dev)),
        ("out_proj.weight", randn(&[dm, di], 0.09)),
    ];
    let weights = weights
        .into_iter()
        .map(|(name, t)| Ok((name.to_string(), t?)))
        .collect::<Result<HashMap<_, _>>>()?;
    let vb = VarBuilder::from_tensors(weights, DType::F32, &dev);
    Ok((Mixer::new(&cfg, vb)?, cfg))
}

#[test]
fn mixer_packed_from_given_states_is_each_sequence_from_its_own() -> Result<()> {
    // Lengths that group (2 and 3, 64 and 70) and that do not, shorter than the conv's 4 taps and
    // of one token; the states are not zeros, so the conv state's window includes the initial one.
    // dt_limit [0, ∞) runs the groups, [0.001, ∞) each sequence alone (a pad's dt would not be 0).
    for limit in ["[0.0, 1e9]", "[0.001, 1e9]"] {
        let (mixer, cfg) = random_mixer(limit)?;
        let dev = Device::Cpu;
        let lens = [2usize, 70, 1, 3, 64, 9];
        let cu = offsets(&lens);
        let (seqs, total) = (lens.len(), cu[lens.len()]);
        let (cd, k, h) = (cfg.conv_dim(), cfg.d_conv, cfg.nheads);
        let u = Tensor::randn(0f32, 1., (1, total, cfg.d_model), &dev)?;
        let conv0 = Tensor::randn(0f32, 1., (seqs, cd, k), &dev)?;
        let ssm0 = Tensor::randn(0f32, 0.1, (seqs, h, cfg.headdim, cfg.d_state), &dev)?;
        let mut packed = LayerState {
            conv: conv0.copy()?,
            ssm: ssm0.copy()?,
        };
        let out = mixer.forward_packed(&u, &cu, &mut packed)?;
        let mut worst = 0f64;
        for (s, &len) in lens.iter().enumerate() {
            let mut alone = LayerState {
                conv: conv0.narrow(0, s, 1)?.copy()?,
                ssm: ssm0.narrow(0, s, 1)?.copy()?,
            };
            let want = mixer.forward(&u.narrow(1, cu[s], len)?, &mut alone)?;
            // Within `bound`, not bit for bit: a sequence alone runs in_proj on its own rows.
            worst = worst
                .max(rel_err(&out.narrow(1, cu[s], len)?, &want)?)
                .max(rel_err(&packed.ssm.narrow(0, s, 1)?, &alone.ssm)?)
                .max(rel_err(&packed.conv.narrow(0, s, 1)?, &alone.conv)?);
        }
        eprintln!("dt_limit {limit}: worst rel err {worst:e}");
        assert!(worst <= bound(0), "{limit}: worst rel err {worst:e}");
        let err = mixer
            .forward_packed(&u, &[0, 5, total - 1], &mut packed)
            .expect_err("offsets short of the packed length");
        assert!(err.to_string().contains("cu_seqlens"), "{err}");
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn any_length_mix_prefills_packed_as_alone(
        case in 0usize..7,
        lens in prop::collection::vec(1usize..=70, 1..=5),
        seed in any::<u64>(),
    ) {
        let names = case_names();
        let name = &names[case % names.len()];
        let model = Model::load(root().join(name), DType::F32, &Device::Cpu).expect("fixture model");
        let vocab = model.config().vocab_size as u64;
        let mut rng = Rng::new(seed);
        let prompts: Vec<Vec<u32>> = lens
            .iter()
            .map(|&l| (0..l).map(|_| (rng.next_u64() % vocab) as u32).collect())
            .collect();
        let (ratio, worst) = check_packed(&model, &prompts, |l| 10.0 * bound(l))
            .expect("packed prefill");
        prop_assert!(ratio <= 1.0, "{name}, lengths {lens:?}: worst rel err {worst:e}");
    }
}

#[test]
fn loss_packed_is_each_documents_loss_weighted_by_its_tokens_with_the_same_gradients() -> Result<()>
{
    for name in [
        "g2_p32_n32_c32_k4_bias_tied",
        "g4_p16_n16_c8_k3_noconvbias_untied",
    ] {
        let trainable = TrainableModel::load(root().join(name), DType::F32, &Device::Cpu)?;
        let model = trainable.model()?;
        let vocab = model.config().vocab_size as u64;
        let mut rng = Rng::new(8);
        // Documents of 2 tokens (one prediction), mid-chunk lengths and one over several chunks.
        let docs: Vec<Vec<u32>> = [2usize, 9, 40, 17, 3]
            .iter()
            .map(|&l| (0..l).map(|_| (rng.next_u64() % vocab) as u32).collect())
            .collect();
        let refs: Vec<&[u32]> = docs.iter().map(Vec::as_slice).collect();
        let packed = model.loss_packed(&refs)?;
        let predicted: usize = docs.iter().map(|d| d.len() - 1).sum();
        let mut parts = Vec::new();
        for d in &docs {
            let ids = Tensor::new(d.as_slice(), &Device::Cpu)?.unsqueeze(0)?;
            parts.push((model.loss(&ids)? * ((d.len() - 1) as f64 / predicted as f64))?);
        }
        let want = Tensor::stack(&parts, 0)?.sum_all()?;
        let (p, w) = (packed.to_scalar::<f32>()?, want.to_scalar::<f32>()?);
        assert!(
            (p - w).abs() <= 1e-6 * w.abs(),
            "{name}: loss {p} packed, {w} apart"
        );
        let (gp, gw) = (packed.backward()?, want.backward()?);
        let mut worst = 0f64;
        for (param, var) in trainable.vars() {
            let (Some(a), Some(b)) = (gp.get(var.as_tensor()), gw.get(var.as_tensor())) else {
                panic!("{name}: no gradient for {param}")
            };
            let e = rel_err(a, &b.to_dtype(DType::F64)?)?;
            assert!(e <= 1e-5, "{name} {param}: packed gradient rel err {e:e}");
            worst = worst.max(e);
        }
        eprintln!("{name}: loss {p}, worst gradient rel err {worst:e}");
    }
    let trainable = TrainableModel::load(
        root().join("g2_p32_n32_c32_k4_bias_tied"),
        DType::F32,
        &Device::Cpu,
    )?;
    let err = trainable
        .model()?
        .loss_packed(&[&[1, 2], &[3]])
        .expect_err("a 1-token document");
    assert!(err.to_string().contains("document 1 has 1 token"), "{err}");
    Ok(())
}
