//! The `--cuda` part of `bench_ssd`: the SSD ops and the decode step timed on the GPU with CUDA
//! events, from a replayed CUDA graph and as one host call, and the host floor of one kernel.

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
fn timeline(dev: &Device, shape: &str, mut f: impl FnMut(usize) -> Result<()>) -> Result<String> {
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
    if args.backward {
        return backward(args, &dev, &ballast);
    }
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
            name: "130m layer B1 L64",
            batch: 1,
            seqlen: 64,
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
            .map(|(s, (dt, da))| k::fwd_pass_state(&s.x, &s.b, dt, da, None, chunk, DType::BF16))
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
            let state = Tensor::randn(0f32, 1., (batch, h, p, 128), &dev)?.to_dtype(state_dtype)?;
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

/// The most memory the device's default pool has held since the last reset (bytes), and a reset
/// of that mark to what it holds now.
fn pool_high(dev: &Device, reset: bool) -> Result<u64> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let cuda = dev.as_cuda_device()?;
    cuda.cuda_stream().synchronize()?;
    let ordinal = cuda.cuda_stream().context().ordinal() as i32;
    let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH;
    // SAFETY: plain driver queries of the default pool of a live device; the value is a u64.
    unsafe {
        let mut device = 0;
        sys::cuDeviceGet(&mut device, ordinal).result()?;
        let mut pool = std::ptr::null_mut();
        sys::cuDeviceGetDefaultMemPool(&mut pool, device).result()?;
        let mut v: u64 = 0;
        if reset {
            sys::cuMemPoolSetAttribute(pool, attr, (&mut v as *mut u64).cast()).result()?;
        }
        sys::cuMemPoolGetAttribute(pool, attr, (&mut v as *mut u64).cast()).result()?;
        Ok(v)
    }
}

/// Forward + backward of `ssd` on the seed shapes: every input a `Var` (x, B, C bf16; dt, A, D
/// and the initial state f32, dt already processed), `y.backward()`.
fn backward(args: &Args, dev: &Device, ballast: &Tensor) -> Result<()> {
    use candle_core::Var;
    let (p, g, chunk) = (64, 1, 128);
    println!("bench_ssd cuda --backward: P=64 G=1 chunk=128, x/B/C bf16, bf16 chunk states; µs = GPU time per forward + backward (events: median of {} runs; graph: per call in a replayed graph of {GRAPH_CALLS}); call = one synchronised host call; peak = the memory pool's high mark during one call above the inputs; direct = `ssd` + `ssd_backward` on a dy made before the call; kept = `ssd_saving` + `ssd_backward_saved` (the forward's chunk states kept for the backward), the same dy; autograd = `y.backward()` on `Var`s, y's gradient (ones) made by candle inside the call", args.gpu_reps);
    println!(
        "| B, H, N, L | forward GPU | direct GPU | direct graph | direct peak MiB | kept graph | kept peak MiB | autograd GPU | autograd graph | autograd call | autograd peak MiB |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    let shapes = [
        (4, 8, 128, 4096),
        (4, 8, 128, 16384),
        (4, 8, 64, 16384),
        (4, 8, 256, 16384),
    ];
    for (bsz, h, n, l) in shapes {
        let name = format!("{bsz}, {h}, {n}, {l}");
        if args
            .only
            .as_ref()
            .is_some_and(|o| !name.contains(o.as_str()))
        {
            continue;
        }
        let bf = |t: Tensor| -> Result<Var> { Ok(Var::from_tensor(&t.to_dtype(DType::BF16)?)?) };
        let x = bf(Tensor::randn(0f32, 1., (bsz, l, h, p), dev)?)?;
        let b = bf(Tensor::randn(0f32, 1., (bsz, l, g, n), dev)?)?;
        let c = bf(Tensor::randn(0f32, 1., (bsz, l, g, n), dev)?)?;
        let raw = ((Tensor::randn(0f32, 1., (bsz, l, h), dev)? * 0.5)? - 3.0)?;
        let dt = Var::from_tensor(&((raw.exp()? + 1.0)?.log()?))?;
        let a = Var::from_tensor(&Tensor::rand(-16f32, -1., h, dev)?)?;
        let dskip = Var::from_tensor(&Tensor::randn(0f32, 1., h, dev)?)?;
        let h0 = Var::from_tensor(&Tensor::zeros((bsz, h, p, n), DType::F32, dev)?)?;
        let opts = SsdOptions {
            chunk_size: chunk,
            dt: DtOptions::default(),
            d: Some(dskip.as_tensor()),
            z: None,
            initial_state: Some(h0.as_tensor()),
            state_dtype: DType::BF16,
        };
        let fwd = |_: usize| -> Result<Tensor> {
            let (y, _) = k::ssd(
                x.as_tensor(),
                dt.as_tensor(),
                a.as_tensor(),
                b.as_tensor(),
                c.as_tensor(),
                &opts,
            )?;
            Ok(y)
        };
        let fb = |i: usize| -> Result<()> {
            let grads = fwd(i)?.backward()?;
            for v in [&x, &b, &c, &dt, &a, &dskip, &h0] {
                if grads.get(v.as_tensor()).is_none() {
                    anyhow::bail!("no gradient for an input");
                }
            }
            Ok(())
        };
        let (xd, dtd, ad, bd, cd) = (
            x.as_tensor().detach(),
            dt.as_tensor().detach(),
            a.as_tensor().detach(),
            b.as_tensor().detach(),
            c.as_tensor().detach(),
        );
        let (dd, h0d) = (dskip.as_tensor().detach(), h0.as_tensor().detach());
        let opts_d = SsdOptions {
            d: Some(&dd),
            initial_state: Some(&h0d),
            ..opts
        };
        let gy = Tensor::randn(0f32, 1., (bsz, l, h, p), dev)?.to_dtype(DType::BF16)?;
        let plain = |_: usize| -> Result<()> {
            k::ssd(&xd, &dtd, &ad, &bd, &cd, &opts_d)?;
            Ok(())
        };
        let direct = |_: usize| -> Result<()> {
            k::ssd(&xd, &dtd, &ad, &bd, &cd, &opts_d)?;
            k::ssd_backward(&xd, &dtd, &ad, &bd, &cd, &opts_d, &gy, None)?;
            Ok(())
        };
        let kept = |_: usize| -> Result<()> {
            let (_, _, saved) = k::ssd_saving(&xd, &dtd, &ad, &bd, &cd, &opts_d)?;
            k::ssd_backward_saved(saved, &xd, &dtd, &ad, &bd, &cd, &opts_d, &gy, None)?;
            Ok(())
        };
        if args.once {
            direct(0)?;
            kept(0)?;
            fb(0)?;
            dev.synchronize()?;
            continue;
        }
        let t_fwd = gpu_us(dev, args.gpu_reps, ballast, plain)?;
        let t_direct = gpu_us(dev, args.gpu_reps, ballast, direct)?;
        let t_direct_graph = match graph_us(dev, direct) {
            Ok(t) => format!("{t:.1}"),
            Err(e) => format!("n/a ({e})"),
        };
        let base = pool_high(dev, true)?;
        direct(0)?;
        let peak_direct = pool_high(dev, false)?.saturating_sub(base) as f64 / (1 << 20) as f64;
        let t_kept_graph = match graph_us(dev, kept) {
            Ok(t) => format!("{t:.1}"),
            Err(e) => format!("n/a ({e})"),
        };
        let base = pool_high(dev, true)?;
        kept(0)?;
        let peak_kept = pool_high(dev, false)?.saturating_sub(base) as f64 / (1 << 20) as f64;
        let t_fb = gpu_us(dev, args.gpu_reps, ballast, fb)?;
        let t_graph = match graph_us(dev, fb) {
            Ok(t) => format!("{t:.1}"),
            Err(e) => format!("n/a ({e})"),
        };
        let (t_call, _) = host_us(dev, args.gpu_reps.min(50), fb)?;
        let base = pool_high(dev, true)?;
        fb(0)?;
        let peak = pool_high(dev, false)?.saturating_sub(base) as f64 / (1 << 20) as f64;
        println!("| {name} | {t_fwd:.1} | {t_direct:.1} | {t_direct_graph} | {peak_direct:.0} | {t_kept_graph} | {peak_kept:.0} | {t_fb:.1} | {t_graph} | {t_call:.1} | {peak:.0} |");
    }
    Ok(())
}
