//! Benchmarks the SSD ops: `ssd` and its three stages, and (on the CPU) candle-transformers
//! 0.11.1's chunked SSD path on the same shape, timed in the same run.
//!
//! `cargo run --release --example bench_ssd` (CPU, the shape: B=1, L=4096, H=24, P=64,
//! N=128, chunk 128, f32). With `--features cuda`, `bench_ssd --cuda` times the CUDA kernels on
//! the seed shapes with CUDA events (median of `--gpu-reps` runs after warm-up, three input sets
//! in rotation), replayed from a CUDA graph of 20 calls (GPU time per call without launch gaps)
//! and one host call per run (synchronised, and the host's own time up to its return), plus the
//! decode step and the host floor of one kernel on the machine (an empty kernel's launch, and its
//! launch and synchronisation): a call costs about its GPU time, that floor and the host's work
//! before its first launch. Built with `--features timeline`, `bench_ssd --cuda --timeline` also
//! prints each shape's kernel timeline inside one call (`mamba2::kernels::ssd_timeline`).
//! `bench_ssd --cuda --backward` times forward + backward (every input's gradient through
//! candle's autograd) on the seed shapes, as mamba_ssm's benchmark runs its Triton kernels.

use std::collections::HashMap;
use std::time::Instant;

use anyhow::Result;
use candle_core::{DType, Device, Module, Tensor};
use clap::Parser;
use mamba2::kernels::{self as k, DtOptions, SsdOptions};

#[derive(Parser, Debug)]
struct Args {
    #[arg(long, default_value_t = 1)]
    batch: usize,
    #[arg(long, default_value_t = 4096)]
    seqlen: usize,
    #[arg(long, default_value_t = 24)]
    nheads: usize,
    #[arg(long, default_value_t = 64)]
    headdim: usize,
    #[arg(long, default_value_t = 1)]
    ngroups: usize,
    #[arg(long, default_value_t = 128)]
    dstate: usize,
    #[arg(long, default_value_t = 128)]
    chunk: usize,
    /// Timed runs per measurement (the median is reported).
    #[arg(long, default_value_t = 10)]
    reps: usize,
    /// Timed runs of the candle-transformers layer (slow: seconds each).
    #[arg(long, default_value_t = 3)]
    peer_reps: usize,
    /// Skip candle-transformers.
    #[arg(long)]
    no_peer: bool,
    /// Benchmark the CUDA kernels instead (needs `--features cuda`).
    #[arg(long)]
    cuda: bool,
    /// Timed runs per CUDA measurement.
    #[arg(long, default_value_t = 200)]
    gpu_reps: usize,
    /// Only the CUDA shapes whose name contains this (and no decode step).
    #[arg(long)]
    only: Option<String>,
    /// With --cuda: the kernels' timeline inside single `ssd` calls at each shape (median over
    /// calls of when the first and the last block passed each mark); needs `--features timeline`.
    #[arg(long)]
    timeline: bool,
    /// With --cuda: forward + backward through candle's autograd on the seed shapes instead
    /// (mamba_ssm's benchmark inputs: processed f32 dt, f32 A, D and initial state), with the
    /// peak memory of one call.
    #[arg(long)]
    backward: bool,
    /// With --backward: one forward + backward per shape and nothing timed (for a profiler).
    #[arg(long)]
    once: bool,
}

/// Median wall time in milliseconds of `reps` runs after one warm-up run.
fn median_ms(reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t = Instant::now();
        f()?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

struct Inputs {
    x: Tensor,
    dt: Tensor,
    a: Tensor,
    b: Tensor,
    c: Tensor,
    z: Tensor,
    d: Tensor,
    dt_bias: Tensor,
}

fn inputs(a: &Args, dev: &Device) -> Result<Inputs> {
    let (bl, h, p, g, n) = (
        (a.batch, a.seqlen),
        a.nheads,
        a.headdim,
        a.ngroups,
        a.dstate,
    );
    Ok(Inputs {
        x: Tensor::randn(0f32, 1., (bl.0, bl.1, h, p), dev)?,
        dt: Tensor::randn(0f32, 0.5, (bl.0, bl.1, h), dev)?,
        a: Tensor::rand(-8f32, -1., h, dev)?,
        b: Tensor::randn(0f32, 0.1, (bl.0, bl.1, g, n), dev)?,
        c: Tensor::randn(0f32, 0.1, (bl.0, bl.1, g, n), dev)?,
        z: Tensor::randn(0f32, 1., (bl.0, bl.1, h, p), dev)?,
        d: Tensor::randn(0f32, 1., h, dev)?,
        dt_bias: Tensor::rand(-4f32, -2., h, dev)?,
    })
}

/// The candle-transformers config of one layer in the shapes of `args` (expand 2).
fn peer_cfg(a: &Args) -> Result<candle_transformers::models::mamba2::Config> {
    let v = serde_json::json!({
        "d_model": a.nheads * a.headdim / 2, "n_layer": 1, "vocab_size": 16, "d_state": a.dstate,
        "expand": 2, "headdim": a.headdim, "ngroups": a.ngroups, "pad_vocab_size_multiple": 16,
    });
    Ok(serde_json::from_value(v)?)
}

/// One candle-transformers Mamba-2 layer with random weights in the shapes of `args`.
fn peer_model(
    args: &Args,
    dev: &Device,
) -> Result<(candle_transformers::models::mamba2::Model, usize)> {
    use candle_transformers::models::mamba2::Model;
    let d_inner = args.nheads * args.headdim;
    let d_model = d_inner / 2;
    let cfg = peer_cfg(args)?;
    let d_xbc = d_inner + 2 * args.ngroups * args.dstate;
    let h = args.nheads;
    let mut w = HashMap::new();
    let s = 1.0 / (d_model as f64).sqrt();
    w.insert(
        "embeddings.weight".to_string(),
        Tensor::randn(0f32, 1., (16, d_model), dev)?,
    );
    w.insert(
        "norm_f.weight".into(),
        Tensor::ones(d_model, DType::F32, dev)?,
    );
    w.insert(
        "layers.0.norm.weight".into(),
        Tensor::ones(d_model, DType::F32, dev)?,
    );
    let m = "layers.0.mixer.";
    w.insert(
        format!("{m}in_proj.weight"),
        Tensor::randn(0f32, s as f32, (d_inner + d_xbc + h, d_model), dev)?,
    );
    w.insert(
        format!("{m}conv1d.weight"),
        Tensor::randn(0f32, 0.5, (d_xbc, 1, 4), dev)?,
    );
    w.insert(
        format!("{m}conv1d.bias"),
        Tensor::randn(0f32, 0.1, d_xbc, dev)?,
    );
    w.insert(format!("{m}A_log"), Tensor::rand(0f32, 2., h, dev)?);
    w.insert(format!("{m}D"), Tensor::randn(0f32, 1., h, dev)?);
    w.insert(format!("{m}dt_bias"), Tensor::rand(-4f32, -2., h, dev)?);
    w.insert(
        format!("{m}norm.weight"),
        Tensor::ones(d_inner, DType::F32, dev)?,
    );
    w.insert(
        format!("{m}out_proj.weight"),
        Tensor::randn(0f32, 0.02, (d_model, d_inner), dev)?,
    );
    let vb = candle_nn::VarBuilder::from_tensors(w, DType::F32, dev);
    Ok((Model::new(&cfg, vb)?, d_model))
}

fn main() -> Result<()> {
    let args = Args::parse();
    if (args.timeline || args.backward) && !args.cuda {
        anyhow::bail!("--timeline and --backward time the CUDA kernels: use them with --cuda");
    }
    if args.timeline && !args.cuda {
        anyhow::bail!("--timeline times the CUDA kernels: use it with --cuda");
    }
    if args.cuda {
        #[cfg(feature = "cuda")]
        return gpu::run(&args);
        #[cfg(not(feature = "cuda"))]
        anyhow::bail!("--cuda needs a build with --features cuda");
    }
    let dev = Device::Cpu;
    let inp = inputs(&args, &dev)?;
    let opts = SsdOptions {
        chunk_size: args.chunk,
        dt: DtOptions {
            bias: Some(&inp.dt_bias),
            softplus: true,
            limit: (0.0, f32::INFINITY),
        },
        d: Some(&inp.d),
        z: Some(&inp.z),
        initial_state: None,
        state_dtype: DType::F32,
    };
    let (x, b, c) = (&inp.x, &inp.b, &inp.c);
    let (dt_out, da) = k::chunk_cumsum(&inp.dt, &inp.a, &opts.dt, args.chunk)?;
    let states = k::fwd_pass_state(x, b, &dt_out, &da, None, args.chunk, DType::F32)?;
    let t_cumsum = median_ms(args.reps, || {
        k::chunk_cumsum(&inp.dt, &inp.a, &opts.dt, args.chunk)?;
        Ok(())
    })?;
    let t_state = median_ms(args.reps, || {
        k::fwd_pass_state(x, b, &dt_out, &da, None, args.chunk, DType::F32)?;
        Ok(())
    })?;
    let t_out = median_ms(args.reps, || {
        k::compute_out(x, b, c, &dt_out, &da, &states, opts.d, opts.z, args.chunk)?;
        Ok(())
    })?;
    let t_ssd = median_ms(args.reps, || {
        k::ssd(x, &inp.dt, &inp.a, b, c, &opts)?;
        Ok(())
    })?;

    let a = &args;
    println!(
        "bench_ssd cpu ({} threads): B={} L={} H={} P={} G={} N={} chunk={} f32, median of {}",
        rayon::current_num_threads(),
        a.batch,
        a.seqlen,
        a.nheads,
        a.headdim,
        a.ngroups,
        a.dstate,
        a.chunk,
        a.reps
    );
    println!("| op | ms |");
    println!("|---|---|");
    println!("| chunk_cumsum | {t_cumsum:.2} |");
    println!("| fwd_pass_state | {t_state:.2} |");
    println!("| compute_out | {t_out:.2} |");
    println!("| ssd (all three) | {t_ssd:.2} |");

    if !args.no_peer {
        let (model, d_model) = peer_model(&args, &dev)?;
        let ids = Tensor::zeros((a.batch, a.seqlen), DType::U32, &dev)?;
        let cfg = peer_cfg(a)?;
        let t_peer = median_ms(args.peer_reps, || {
            let mut st =
                candle_transformers::models::mamba2::State::new(a.batch, &cfg, DType::F32, &dev)?;
            {
                model.forward_prefill(&ids, &mut st, a.chunk)?;
                Ok(())
            }
        })?;
        // The layer's projections alone, so the peer's SSD share can be read off.
        let d_inner = a.nheads * a.headdim;
        let d_xbc = d_inner + 2 * a.ngroups * a.dstate;
        let hidden = Tensor::randn(0f32, 1., (a.batch * a.seqlen, d_model), &dev)?;
        let in_proj = candle_nn::Linear::new(
            Tensor::randn(0f32, 0.03, (d_inner + d_xbc + a.nheads, d_model), &dev)?,
            None,
        );
        let inner = Tensor::randn(0f32, 1., (a.batch * a.seqlen, d_inner), &dev)?;
        let out_proj =
            candle_nn::Linear::new(Tensor::randn(0f32, 0.03, (d_model, d_inner), &dev)?, None);
        let t_proj = median_ms(args.reps, || {
            in_proj.forward(&hidden)?;
            out_proj.forward(&inner)?;
            Ok(())
        })?;
        let peer_ssd = t_peer - t_proj;
        println!("| candle-transformers 0.11.1 Model::forward_prefill, 1 layer (median of {}) | {t_peer:.1} |", args.peer_reps);
        println!("| of which in_proj + out_proj (timed alone) | {t_proj:.1} |");
        println!("| candle-transformers SSD share (layer − projections) | {peer_ssd:.1} |");
        println!(
            "speed-up of ssd over the peer's SSD share: {:.1}x; over its whole layer: {:.1}x",
            peer_ssd / t_ssd,
            t_peer / t_ssd
        );
    }
    Ok(())
}

#[cfg(feature = "cuda")]
#[path = "bench_ssd/gpu.rs"]
mod gpu;
