//! Benchmarks the SSD ops: `ssd` and its three stages, and (on the CPU) candle-transformers
//! 0.11.1's chunked SSD path on the same shape, timed in the same run.
//!
//! `cargo run --release --example bench_ssd` (CPU, the issue's shape: B=1, L=4096, H=24, P=64,
//! N=128, chunk 128, f32). With `--features cuda`, `bench_ssd --cuda` times the CUDA kernels on
//! the seed shapes with CUDA events (median of `--gpu-reps` runs after warm-up, three input sets
//! in rotation), replayed from a CUDA graph of 20 calls (GPU time per call without launch gaps)
//! and one host call per run (synchronised, and the host's own time up to its return), plus the
//! decode step and the host floor of one kernel on the machine (an empty kernel's launch, and its
//! launch and synchronisation): a call costs about its GPU time, that floor and the host's work
//! before its first launch. Built with `--features timeline`, `bench_ssd --cuda --timeline` also
//! prints each shape's kernel timeline inside one call (`mamba2::kernels::ssd_timeline`).

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
mod gpu {
    use std::time::Instant;

    use anyhow::Result;
    use candle_core::cuda_backend::cudarc::driver::sys::{
        CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode,
    };
    use candle_core::cuda_backend::cudarc::driver::{CudaEvent, CudaStream, LaunchConfig};
    use candle_core::cuda_backend::cudarc::nvrtc::Ptx;
    use candle_core::{DType, Device, Tensor};
    use mamba2::kernels::{self as k, DtOptions, SsdOptions, StepOptions};

    use super::Args;

    struct Set {
        x: Tensor,
        dt: Tensor,
        b: Tensor,
        c: Tensor,
    }

    struct Shape {
        name: &'static str,
        batch: usize,
        seqlen: usize,
        nheads: usize,
        dstate: usize,
    }

    fn stream(dev: &Device) -> Result<std::sync::Arc<CudaStream>> {
        Ok(dev.as_cuda_device()?.cuda_stream())
    }

    fn event(s: &CudaStream) -> Result<CudaEvent> {
        Ok(s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?)
    }

    fn median(mut v: Vec<f64>) -> f64 {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    }

    /// Median GPU time (µs) of `f` over `reps` runs, each bracketed by events; a long copy is
    /// queued first so the host runs ahead of the GPU and no launch gap enters the brackets.
    fn gpu_us(
        dev: &Device,
        reps: usize,
        ballast: &Tensor,
        mut f: impl FnMut(usize) -> Result<()>,
    ) -> Result<f64> {
        let s = stream(dev)?;
        for i in 0..5 {
            f(i)?;
        }
        s.synchronize()?;
        let mut times = Vec::with_capacity(reps);
        let mut left = reps;
        while left > 0 {
            let n = left.min(20);
            for _ in 0..4 {
                ballast.affine(1.0, 1.0)?;
            }
            let mut ev = Vec::with_capacity(n);
            for i in 0..n {
                let a = event(&s)?;
                f(i)?;
                ev.push((a, event(&s)?));
            }
            s.synchronize()?;
            for (a, b) in &ev {
                times.push(a.elapsed_ms(b)? as f64 * 1e3);
            }
            left -= n;
        }
        Ok(median(times))
    }

    /// Calls per captured graph in [`graph_us`].
    const GRAPH_CALLS: usize = 20;

    /// GPU time (µs) per call of `f` replayed from a CUDA graph of [`GRAPH_CALLS`] calls (median
    /// of 20 event-timed replays): the kernels back to back without any host launch cost, as the
    /// peers' "gpu" figures were measured.
    fn graph_us(dev: &Device, mut f: impl FnMut(usize) -> Result<()>) -> Result<f64> {
        let cuda = dev.as_cuda_device()?;
        let s = cuda.cuda_stream();
        let _htod = cuda.enable_cuda_graph_htod_cache();
        for i in 0..3 {
            f(i)?;
        }
        s.synchronize()?;
        s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        let captured = (0..GRAPH_CALLS).try_for_each(&mut f);
        let graph = s.end_capture(CUgraphInstantiate_flags(0))?;
        captured?;
        let graph = graph.ok_or_else(|| anyhow::anyhow!("empty graph"))?;
        graph.launch()?;
        s.synchronize()?;
        let mut times = Vec::new();
        for _ in 0..20 {
            let a = event(&s)?;
            graph.launch()?;
            let b = event(&s)?;
            s.synchronize()?;
            times.push(a.elapsed_ms(&b)? as f64 * 1e3 / GRAPH_CALLS as f64);
        }
        Ok(median(times))
    }

    /// Median wall times (µs) of one call from the host: synchronised (the call as a user sees
    /// it), and up to its return only (what the host spends issuing its work).
    fn host_us(
        dev: &Device,
        reps: usize,
        mut f: impl FnMut(usize) -> Result<()>,
    ) -> Result<(f64, f64)> {
        let s = stream(dev)?;
        for i in 0..5 {
            f(i)?;
        }
        s.synchronize()?;
        let mut synced = Vec::with_capacity(reps);
        let mut issued = Vec::with_capacity(reps);
        for i in 0..reps {
            let t = Instant::now();
            f(i)?;
            issued.push(t.elapsed().as_secs_f64() * 1e6);
            s.synchronize()?;
            synced.push(t.elapsed().as_secs_f64() * 1e6);
        }
        Ok((median(synced), median(issued)))
    }

    /// An empty kernel, compiled from PTX by the driver.
    const EMPTY_PTX: &str =
        ".version 7.0\n.target sm_80\n.address_size 64\n.visible .entry empty() { ret; }\n";

    /// What one kernel costs from the host on this machine, whatever it does (median µs of 500):
    /// the launch call of an empty kernel, and that launch with a synchronisation. The call
    /// column varies between hosts by as much as this does.
    fn launch_floor(dev: &Device) -> Result<(f64, f64)> {
        let s = stream(dev)?;
        let f = s
            .context()
            .load_module(Ptx::from_src(EMPTY_PTX))?
            .load_function("empty")?;
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        let (mut issued, mut synced) = (Vec::new(), Vec::new());
        for i in 0..520 {
            let t = Instant::now();
            // SAFETY: `empty` takes no parameters and touches no memory.
            unsafe { s.launch_builder(&f).launch(cfg) }?;
            let issue = t.elapsed().as_secs_f64() * 1e6;
            s.synchronize()?;
            if i >= 20 {
                issued.push(issue);
                synced.push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
        Ok((median(issued), median(synced)))
    }

    /// Prints the median timeline of 200 single calls of `f` (each synchronised; what one kernel
    /// costs from the host is [`launch_floor`]'s line).
    #[cfg(feature = "timeline")]
    fn timeline(
        dev: &Device,
        shape: &str,
        mut f: impl FnMut(usize) -> Result<()>,
    ) -> Result<String> {
        let s = stream(dev)?;
        let mut marks: Vec<(&'static str, Vec<f64>, Vec<f64>)> = Vec::new();
        let mut calls = Vec::new();
        for i in 0..200 {
            k::ssd_timeline_reset(dev)?;
            s.synchronize()?;
            let t = Instant::now();
            f(i)?;
            s.synchronize()?;
            calls.push(t.elapsed().as_secs_f64() * 1e6);
            for m in k::ssd_timeline(dev)? {
                match marks.iter_mut().find(|(n, _, _)| *n == m.name) {
                    Some((_, first, last)) => {
                        first.push(m.first);
                        last.push(m.last);
                    }
                    None => marks.push((m.name, vec![m.first], vec![m.last])),
                }
            }
        }
        let mut out = format!(
            "timeline of one call, {shape}: call {:.1} µs; µs from the first chunk_state block\n| mark | first block | last block |\n|---|---|---|\n",
            median(calls)
        );
        for (name, first, last) in marks {
            out += &format!("| {name} | {:.2} | {:.2} |\n", median(first), median(last));
        }
        Ok(out)
    }

    #[cfg(not(feature = "timeline"))]
    fn timeline(_: &Device, _: &str, _: impl FnMut(usize) -> Result<()>) -> Result<String> {
        anyhow::bail!("--timeline needs the kernels built with their marks: --features timeline")
    }

    pub fn run(args: &Args) -> Result<()> {
        let dev = Device::new_cuda(0)?;
        let ballast = Tensor::randn(0f32, 1., 256 << 20, &dev)?;
        let shapes = [
            Shape {
                name: "seed N128 L4096",
                batch: 4,
                seqlen: 4096,
                nheads: 8,
                dstate: 128,
            },
            Shape {
                name: "seed N128 L16384",
                batch: 4,
                seqlen: 16384,
                nheads: 8,
                dstate: 128,
            },
            Shape {
                name: "seed N64 L16384",
                batch: 4,
                seqlen: 16384,
                nheads: 8,
                dstate: 64,
            },
            Shape {
                name: "seed N256 L16384",
                batch: 4,
                seqlen: 16384,
                nheads: 8,
                dstate: 256,
            },
            Shape {
                name: "seed N128 L65536",
                batch: 4,
                seqlen: 65536,
                nheads: 8,
                dstate: 128,
            },
            Shape {
                name: "130m layer B1 L2048",
                batch: 1,
                seqlen: 2048,
                nheads: 24,
                dstate: 128,
            },
            Shape {
                name: "2.7b layer B1 L2048",
                batch: 1,
                seqlen: 2048,
                nheads: 80,
                dstate: 128,
            },
        ];
        let (p, g, chunk) = (64, 1, 128);
        println!("bench_ssd cuda: P=64 G=1 chunk=128 bf16 values, bf16 chunk states; GPU µs = median of {} event-timed runs; graph = per call in a replayed graph of {GRAPH_CALLS} calls; call µs = one host call, synchronised; host issue = its host time up to its return", args.gpu_reps);
        println!("| shape | chunk_cumsum | fwd_pass_state | compute_out | stages sum | ssd GPU | ssd graph | ssd call | host issue | state GB/s | out GB/s |");
        println!("|---|---|---|---|---|---|---|---|---|---|---|");
        let picked = |sh: &&Shape| {
            args.only
                .as_ref()
                .is_none_or(|o| sh.name.contains(o.as_str()))
        };
        let mut timelines = Vec::new();
        let floor = launch_floor(&dev)?;
        for sh in shapes.iter().filter(picked) {
            let (bsz, l, h, n) = (sh.batch, sh.seqlen, sh.nheads, sh.dstate);
            let sets: Vec<Set> = (0..3)
                .map(|_| -> Result<Set> {
                    Ok(Set {
                        x: Tensor::randn(0f32, 1., (bsz, l, h, p), &dev)?.to_dtype(DType::BF16)?,
                        dt: Tensor::randn(0f32, 0.5, (bsz, l, h), &dev)?.to_dtype(DType::BF16)?,
                        b: Tensor::randn(0f32, 0.1, (bsz, l, g, n), &dev)?.to_dtype(DType::BF16)?,
                        c: Tensor::randn(0f32, 0.1, (bsz, l, g, n), &dev)?.to_dtype(DType::BF16)?,
                    })
                })
                .collect::<Result<_>>()?;
            let a = Tensor::rand(-8f32, -1., h, &dev)?;
            let bias = Tensor::rand(-4f32, -2., h, &dev)?;
            let dskip = Tensor::randn(0f32, 1., h, &dev)?;
            let dt_opts = DtOptions {
                bias: Some(&bias),
                softplus: true,
                limit: (0.0, f32::INFINITY),
            };
            let opts = SsdOptions {
                chunk_size: chunk,
                dt: dt_opts,
                d: Some(&dskip),
                z: None,
                initial_state: None,
                state_dtype: DType::BF16,
            };
            let stage1: Vec<(Tensor, Tensor)> = sets
                .iter()
                .map(|s| k::chunk_cumsum(&s.dt, &a, &dt_opts, chunk))
                .collect::<candle_core::Result<_>>()?;
            let stage2: Vec<Tensor> = sets
                .iter()
                .zip(&stage1)
                .map(|(s, (dt, da))| {
                    k::fwd_pass_state(&s.x, &s.b, dt, da, None, chunk, DType::BF16)
                })
                .collect::<candle_core::Result<_>>()?;
            let reps = args.gpu_reps;
            let t1 = gpu_us(&dev, reps, &ballast, |i| {
                k::chunk_cumsum(&sets[i % 3].dt, &a, &dt_opts, chunk)?;
                Ok(())
            })?;
            let t2 = gpu_us(&dev, reps, &ballast, |i| {
                let (dt, da) = &stage1[i % 3];
                {
                    k::fwd_pass_state(
                        &sets[i % 3].x,
                        &sets[i % 3].b,
                        dt,
                        da,
                        None,
                        chunk,
                        DType::BF16,
                    )?;
                    Ok(())
                }
            })?;
            let t3 = gpu_us(&dev, reps, &ballast, |i| {
                let (s, (dt, da)) = (&sets[i % 3], &stage1[i % 3]);
                {
                    k::compute_out(
                        &s.x,
                        &s.b,
                        &s.c,
                        dt,
                        da,
                        &stage2[i % 3],
                        Some(&dskip),
                        None,
                        chunk,
                    )?;
                    Ok(())
                }
            })?;
            let run = |i: usize| -> Result<()> {
                let s = &sets[i % 3];
                {
                    k::ssd(&s.x, &s.dt, &a, &s.b, &s.c, &opts)?;
                    Ok(())
                }
            };
            let t_ssd = gpu_us(&dev, reps, &ballast, run)?;
            let t_graph = graph_us(&dev, run)?;
            let (t_call, t_issue) = host_us(&dev, reps, run)?;
            if args.timeline {
                timelines.push(timeline(&dev, sh.name, run)?);
            }
            // Bytes: stage 2 reads x, b and writes the chunk states; stage 3 reads x, b, c, the
            // states and writes y (bf16 = 2 bytes).
            let nchunks = l.div_ceil(chunk);
            let xb = (bsz * l * h * p * 2) as f64;
            let bb = (bsz * l * g * n * 2) as f64;
            let sb = (bsz * h * (nchunks + 1) * p * n * 2) as f64;
            let bw2 = (xb + bb + sb) / (t2 * 1e3);
            let bw3 = (2.0 * xb + 2.0 * bb + sb) / (t3 * 1e3);
            println!(
                "| {} (B={bsz} H={h} N={n} L={l}) | {t1:.1} | {t2:.1} | {t3:.1} | {:.1} | {t_ssd:.1} | {t_graph:.1} | {t_call:.1} | {t_issue:.1} | {bw2:.0} | {bw3:.0} |",
                sh.name,
                t1 + t2 + t3
            );
        }
        println!(
            "\nHost floor on this machine: an empty kernel's launch call {:.1} µs, launch + synchronisation {:.1} µs.",
            floor.0, floor.1
        );
        for t in timelines {
            println!("\n{t}");
        }

        if args.only.is_some() {
            return Ok(());
        }
        println!();
        println!("| decode step (H=80 P=64 N=128, bf16 values) | state | GPU µs | graph µs | call µs | GB/s (state read+write, graph) |");
        println!("|---|---|---|---|---|---|");
        let h = 80;
        for batch in [1, 16, 64] {
            for state_dtype in [DType::F32, DType::BF16] {
                let state =
                    Tensor::randn(0f32, 1., (batch, h, p, 128), &dev)?.to_dtype(state_dtype)?;
                let x = Tensor::randn(0f32, 1., (batch, h, p), &dev)?.to_dtype(DType::BF16)?;
                let dt = Tensor::randn(0f32, 0.5, (batch, h), &dev)?.to_dtype(DType::BF16)?;
                let bm = Tensor::randn(0f32, 0.1, (batch, g, 128), &dev)?.to_dtype(DType::BF16)?;
                let cm = Tensor::randn(0f32, 0.1, (batch, g, 128), &dev)?.to_dtype(DType::BF16)?;
                let a = Tensor::rand(-8f32, -1., h, &dev)?;
                let bias = Tensor::rand(-4f32, -2., h, &dev)?;
                let dskip = Tensor::randn(0f32, 1., h, &dev)?;
                let z = Tensor::randn(0f32, 1., (batch, h, p), &dev)?.to_dtype(DType::BF16)?;
                let opts = StepOptions {
                    dt: DtOptions {
                        bias: Some(&bias),
                        softplus: true,
                        limit: (0.0, f32::INFINITY),
                    },
                    d: Some(&dskip),
                    z: Some(&z),
                };
                let step = |_: usize| -> Result<()> {
                    {
                        k::ssd_step(&state, &x, &dt, &a, &bm, &cm, &opts)?;
                        Ok(())
                    }
                };
                let t = gpu_us(&dev, args.gpu_reps, &ballast, step)?;
                let tg = graph_us(&dev, step)?;
                let (tc, _) = host_us(&dev, args.gpu_reps, step)?;
                let bytes = 2.0 * (batch * h * p * 128 * state_dtype.size_in_bytes()) as f64;
                println!(
                    "| B={batch} | {state_dtype:?} | {t:.2} | {tg:.2} | {tc:.1} | {:.0} |",
                    bytes / (tg * 1e3)
                );
            }
        }
        Ok(())
    }
}
