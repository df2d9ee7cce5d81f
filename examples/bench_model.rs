//! Benchmarks the whole model on the GPU: random bf16 weights in the shapes of mamba2-130m,
//! -780m and -2.7b; prefill tokens/s and decode ms/token, ours and candle-transformers 0.11.1's
//! `mamba2::Model` on the same weights in the same run. Decode is timed both replayed from a
//! captured CUDA graph ([`DecodeGraph`]) and launched kernel by kernel.
//!
//! Ragged prompts (`--ragged N:LO-HI`: N prompts of seeded lengths uniform in LO..=HI) are
//! prefilled three ways, last logits only: packed (`Model::prefill_packed`: on CUDA one row of
//! chunk-aligned prompts, or groups of similar lengths), padded to the longest as one rectangular
//! batch (timing only: the pad tokens would change the states), and one call per prompt.
//!
//! `cargo run --release --features cuda --example bench_model -- [--models 130m,780m,2.7b]`

use std::collections::HashMap;
use std::time::Instant;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use clap::Parser;
use mamba2::model::{Config, DecodeGraph, Model};

#[derive(Parser, Debug)]
struct Args {
    /// Models to run: 130m, 780m, 2.7b.
    #[arg(long, value_delimiter = ',', default_value = "130m,780m,2.7b")]
    models: Vec<String>,
    /// Prefill shapes B x L.
    #[arg(long, value_delimiter = ',', default_value = "1x2048,1x8192,4x2048")]
    prefill: Vec<String>,
    /// Decode batch sizes.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
    decode: Vec<String>,
    /// Timed runs per prefill measurement (median).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Decode steps timed per measurement (median step).
    #[arg(long, default_value_t = 50)]
    steps: usize,
    /// candle-transformers runs: `model:BxL` prefill or `model:dB` decode entries.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "130m:1x2048,130m:4x2048,780m:1x2048,130m:d1,130m:d16,2.7b:d1"
    )]
    peer: Vec<String>,
    /// Ragged prefill: `N:LO-HI`, N prompts of lengths uniform in LO..=HI ("" for none).
    #[arg(long, default_value = "64:16-1024")]
    ragged: String,
    /// The models' scan chunk (`chunk_size` of their config).
    #[arg(long, default_value_t = 256)]
    chunk: usize,
}

/// `N:LO-HI` as N seeded lengths uniform in LO..=HI.
fn ragged_lengths(s: &str) -> Result<Vec<usize>> {
    let parse = || -> Option<(usize, usize, usize)> {
        let (n, range) = s.split_once(':')?;
        let (lo, hi) = range.split_once('-')?;
        Some((n.parse().ok()?, lo.parse().ok()?, hi.parse().ok()?))
    };
    let Some((n, lo, hi)) = parse().filter(|&(n, lo, hi)| n > 0 && lo > 0 && lo <= hi) else {
        anyhow::bail!("--ragged must be N:LO-HI with N >= 1 and 1 <= LO <= HI, got {s}")
    };
    let mut state = 12345u64;
    Ok((0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            lo + (state >> 33) as usize % (hi - lo + 1)
        })
        .collect())
}

/// Median seconds of `reps` runs of `f` after one warm-up, synchronised around each.
fn timed(dev: &Device, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let mut times = Vec::new();
    for rep in 0..=reps {
        sync(dev)?;
        let t = Instant::now();
        f()?;
        sync(dev)?;
        if rep > 0 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    Ok(median(times))
}

/// d_model, layers, heads of the three sizes (headdim 64, state 128, expand 2, 1 group).
fn dims(name: &str) -> Result<(usize, usize)> {
    Ok(match name {
        "130m" => (768, 24),
        "780m" => (1536, 48),
        "2.7b" => (2560, 64),
        n => anyhow::bail!("unknown model {n}"),
    })
}

const VOCAB: usize = 50280;

fn config(d_model: usize, layers: usize, chunk: usize) -> Result<Config> {
    let json = serde_json::json!({
        "model_type": "mamba2", "hidden_size": d_model, "num_hidden_layers": layers,
        "num_heads": 2 * d_model / 64, "head_dim": 64, "state_size": 128, "n_groups": 1,
        "expand": 2, "conv_kernel": 4, "chunk_size": chunk, "vocab_size": VOCAB,
        "residual_in_fp32": true, "rms_norm": true, "tie_word_embeddings": true,
        "use_bias": false, "use_conv_bias": true, "layer_norm_epsilon": 1e-5,
    });
    Ok(Config::from_json(&json.to_string())?)
}

/// Random weights with HF key names, on `dev` in bf16.
fn weights(d_model: usize, layers: usize, dev: &Device) -> Result<HashMap<String, Tensor>> {
    let d_inner = 2 * d_model;
    let h = d_inner / 64;
    let conv = d_inner + 2 * 128;
    let proj = 2 * d_inner + 2 * 128 + h;
    let r = |shape: &[usize], s: f32| -> Result<Tensor> {
        Ok(Tensor::randn(0f32, s, shape, dev)?.to_dtype(DType::BF16)?)
    };
    let u = |shape: &[usize], lo: f32, hi: f32| -> Result<Tensor> {
        Ok(Tensor::rand(lo, hi, shape, dev)?.to_dtype(DType::BF16)?)
    };
    let mut w = HashMap::new();
    w.insert(
        "backbone.embeddings.weight".to_string(),
        r(&[VOCAB, d_model], 1.0)?,
    );
    w.insert(
        "backbone.norm_f.weight".to_string(),
        u(&[d_model], 0.8, 1.2)?,
    );
    for l in 0..layers {
        let p = format!("backbone.layers.{l}");
        w.insert(format!("{p}.norm.weight"), u(&[d_model], 0.8, 1.2)?);
        w.insert(
            format!("{p}.mixer.in_proj.weight"),
            r(&[proj, d_model], 1.0 / (d_model as f32).sqrt())?,
        );
        w.insert(format!("{p}.mixer.conv1d.weight"), r(&[conv, 1, 4], 0.5)?);
        w.insert(format!("{p}.mixer.conv1d.bias"), r(&[conv], 0.1)?);
        w.insert(format!("{p}.mixer.dt_bias"), u(&[h], -4.0, -2.0)?);
        w.insert(format!("{p}.mixer.A_log"), u(&[h], 0.0, 2.7)?);
        w.insert(format!("{p}.mixer.D"), r(&[h], 1.0)?);
        w.insert(format!("{p}.mixer.norm.weight"), u(&[d_inner], 0.8, 1.2)?);
        w.insert(
            format!("{p}.mixer.out_proj.weight"),
            r(&[d_model, d_inner], 0.5 / (d_inner as f32).sqrt())?,
        );
    }
    Ok(w)
}

fn sync(dev: &Device) -> Result<()> {
    Ok(dev.synchronize()?)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn parse_bl(s: &str) -> Result<(usize, usize)> {
    let (b, l) = s
        .split_once('x')
        .ok_or_else(|| anyhow::anyhow!("shape {s} is not BxL"))?;
    Ok((b.parse()?, l.parse()?))
}

fn ids(b: usize, l: usize, dev: &Device) -> Result<Tensor> {
    Ok(Tensor::rand(0f32, (VOCAB - 1) as f32, (b, l), dev)?.to_dtype(DType::U32)?)
}

fn main() -> Result<()> {
    let args = Args::parse();
    let dev = Device::new_cuda(0)?;
    let start = Instant::now();
    let progress = |what: &str| eprintln!("[{:7.1}s] {what}", start.elapsed().as_secs_f64());
    println!("bench_model: random bf16 weights, vocab {VOCAB}, headdim 64, state 128; prefill = median of {} runs, decode = median step of {} (synchronised per step), replayed from a captured CUDA graph and launched eagerly", args.reps, args.steps);
    println!("| model | run | ours | candle-transformers 0.11.1 |");
    println!("|---|---|---|---|");
    for name in &args.models {
        progress(&format!("{name}: weights"));
        let (d_model, layers) = dims(name)?;
        let cfg = config(d_model, layers, args.chunk)?;
        let w = weights(d_model, layers, &dev)?;
        let model = Model::new(
            &cfg,
            candle_nn::VarBuilder::from_tensors(w.clone(), DType::BF16, &dev),
        )?;
        let peer_cfg: candle_transformers::models::mamba2::Config = serde_json::from_value(
            serde_json::json!({
                "d_model": d_model, "n_layer": layers, "vocab_size": VOCAB, "d_state": 128, "expand": 2,
                "headdim": 64, "ngroups": 1, "pad_vocab_size_multiple": 8,
            }),
        )?;
        let peer = candle_transformers::models::mamba2::Model::new(
            &peer_cfg,
            candle_nn::VarBuilder::from_tensors(w, DType::BF16, &dev).pp("backbone"),
        )?;
        for shape in args.prefill.iter().filter(|s| !s.is_empty()) {
            let (b, l) = parse_bl(shape)?;
            progress(&format!("{name}: prefill {shape}"));
            let input = ids(b, l, &dev)?;
            let mut times = Vec::new();
            for rep in 0..=args.reps {
                let mut cache = model.new_cache(b)?;
                sync(&dev)?;
                let t = Instant::now();
                model.forward(&input, &mut cache)?;
                sync(&dev)?;
                if rep > 0 {
                    times.push(t.elapsed().as_secs_f64());
                }
            }
            let ours = median(times);
            let peer_s = if args.peer.iter().any(|p| p == &format!("{name}:{shape}")) {
                progress(&format!("{name}: candle-transformers prefill {shape}"));
                let mut st = candle_transformers::models::mamba2::State::new(
                    b,
                    &peer_cfg,
                    DType::BF16,
                    &dev,
                )?;
                sync(&dev)?;
                let t = Instant::now();
                match peer.forward_prefill(&input, &mut st, 256) {
                    Ok(_) => {
                        sync(&dev)?;
                        let s = t.elapsed().as_secs_f64();
                        format!("{:.1} ms, {:.0} tok/s (1 run)", s * 1e3, (b * l) as f64 / s)
                    }
                    Err(e) => format!("fails: {}", e.to_string().lines().next().unwrap_or("")),
                }
            } else {
                "not run".to_string()
            };
            println!(
                "| {name} | prefill B={b} L={l} (all logits) | {:.2} ms, {:.0} tok/s | {peer_s} |",
                ours * 1e3,
                (b * l) as f64 / ours
            );
        }
        if !args.ragged.is_empty() {
            let lens = ragged_lengths(&args.ragged)?;
            progress(&format!("{name}: ragged prefill {}", args.ragged));
            let prompts: Vec<Vec<u32>> = lens
                .iter()
                .map(|&l| Ok(ids(1, l, &dev)?.squeeze(0)?.to_vec1::<u32>()?))
                .collect::<Result<_>>()?;
            let refs: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
            let packed = timed(&dev, args.reps, || {
                model.prefill_packed(&refs)?;
                Ok(())
            })?;
            let longest = lens.iter().copied().max().unwrap_or(1);
            let padded_ids = ids(lens.len(), longest, &dev)?;
            let padded = timed(&dev, args.reps, || {
                let mut cache = model.new_cache(lens.len())?;
                model.prefill(&padded_ids, &mut cache)?;
                Ok(())
            })?;
            let singles: Vec<Tensor> = prompts
                .iter()
                .map(|p| Ok(Tensor::new(p.as_slice(), &dev)?.unsqueeze(0)?))
                .collect::<Result<_>>()?;
            let each = timed(&dev, args.reps, || {
                for input in &singles {
                    let mut cache = model.new_cache(1)?;
                    model.prefill(input, &mut cache)?;
                }
                Ok(())
            })?;
            let tokens: usize = lens.iter().sum();
            println!(
                "| {name} | ragged prefill, {} prompts of {} tokens ({tokens} in all, longest {longest}) | packed {:.2} ms; padded {:.2} ms ({:.2}×); one call each {:.2} ms ({:.2}×) | — |",
                lens.len(),
                args.ragged.split_once(':').map_or("", |(_, r)| r),
                packed * 1e3,
                padded * 1e3,
                padded / packed,
                each * 1e3,
                each / packed
            );
        }
        for b in args.decode.iter().filter(|s| !s.is_empty()) {
            let b: usize = b.parse()?;
            progress(&format!("{name}: decode B={b}"));
            let mut cache = model.new_cache(b)?;
            model.prefill(&ids(b, 16, &dev)?, &mut cache)?;
            sync(&dev)?;
            progress(&format!("{name}: decode B={b}: prompt done"));
            let tok = ids(b, 1, &dev)?.squeeze(1)?;
            for i in 0..5 {
                let t = Instant::now();
                model.step(&tok, &mut cache)?;
                sync(&dev)?;
                progress(&format!(
                    "{name}: warm-up step {i}: {:.2} ms",
                    t.elapsed().as_secs_f64() * 1e3
                ));
            }
            let mut times = Vec::new();
            for _ in 0..args.steps {
                let t = Instant::now();
                model.step(&tok, &mut cache)?;
                sync(&dev)?;
                times.push(t.elapsed().as_secs_f64());
            }
            let ours = median(times);
            progress(&format!("{name}: decode B={b}: capturing a graph"));
            let t = Instant::now();
            let mut graph = DecodeGraph::new(&model, cache)?;
            sync(&dev)?;
            let capture = t.elapsed().as_secs_f64();
            let host_tok: Vec<u32> = tok.to_vec1()?;
            for _ in 0..5 {
                graph.step(&host_tok)?;
            }
            sync(&dev)?;
            let mut times = Vec::new();
            for _ in 0..args.steps {
                let t = Instant::now();
                graph.step(&host_tok)?;
                sync(&dev)?;
                times.push(t.elapsed().as_secs_f64());
            }
            let graphed = median(times);
            drop(graph);
            let peer_s = if args.peer.iter().any(|p| p == &format!("{name}:d{b}")) {
                progress(&format!("{name}: candle-transformers decode B={b}"));
                let mut st = candle_transformers::models::mamba2::State::new(
                    b,
                    &peer_cfg,
                    DType::BF16,
                    &dev,
                )?;
                let mut times = Vec::new();
                let mut err = None;
                for i in 0..20 {
                    let t = Instant::now();
                    if let Err(e) = peer.forward(&tok, &mut st) {
                        err = Some(e);
                        break;
                    }
                    sync(&dev)?;
                    if i >= 3 {
                        times.push(t.elapsed().as_secs_f64());
                    }
                }
                match err {
                    Some(e) => format!("fails: {}", e.to_string().lines().next().unwrap_or("")),
                    None => {
                        let n = times.len();
                        format!("{:.2} ms/step (median of {n})", median(times) * 1e3)
                    }
                }
            } else {
                "not run".to_string()
            };
            println!(
                "| {name} | decode B={b} | {:.3} ms/step graph, {:.3} eager (capture {:.1} ms) | {peer_s} |",
                graphed * 1e3,
                ours * 1e3,
                capture * 1e3
            );
        }
    }
    Ok(())
}
