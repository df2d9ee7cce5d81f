//! The CUDA SSD kernels against the f64 recurrence and the CPU ops (run on a GPU machine:
//! `cargo test --release --features cuda --test ssd_cuda`). Outputs are poisoned with NaN before
//! every kernel (`set_poison`), so an element a kernel fails to write fails the test.
#![cfg(feature = "cuda")]

mod common;

use candle_core::{DType, Device, IndexOp, Result, Tensor};
use common::{rel_err, Problem, Rng, Spec};
use mamba2::kernels::{self as k, reference};

fn gpu() -> Device {
    k::set_poison(true);
    Device::new_cuda(0).expect("a CUDA device")
}

/// f32 runs on the SIMT kernels (f32 arithmetic); bf16/f16 on tensor cores where the shape fits.
fn tolerance(spec: &Spec) -> f64 {
    let base: f64 = if spec.dtype == DType::F32 && spec.state_dtype == DType::F32 {
        1e-4
    } else {
        1e-2
    };
    if spec.fast_decay {
        base.max(2e-4)
    } else {
        base
    }
}

/// Every stage and `ssd` on the GPU against the recurrence; returns the worst error seen.
fn check(spec: &Spec, seed: u64) -> Result<f64> {
    let dev = gpu();
    let cpu = Problem::new(spec, &mut Rng::new(seed), &Device::Cpu)?;
    let want = reference::ssd(&cpu.x, &cpu.dt, &cpu.a, &cpu.b, &cpu.c, &cpu.options())?;
    let pb = cpu.to_device(&dev)?;
    let opts = pb.options();
    let tol = tolerance(spec);
    let ctx = format!("{spec:?} seed {seed}");
    let mut worst = 0f64;
    let mut expect = |what: &str, got: &Tensor, want: &Tensor, tol: f64| -> Result<()> {
        let e = rel_err(got, want)?;
        worst = worst.max(e);
        assert!(e <= tol, "{what} rel err {e:e} > {tol:e} for {ctx}");
        Ok(())
    };

    let (dt_out, da, states) = stages(&pb, spec)?;
    expect("chunk_cumsum dt_out", &dt_out, &want.dt_out, 1e-5)?;
    expect("chunk_cumsum da_cumsum", &da, &want.da_cumsum, 1e-5)?;
    expect("fwd_pass_state", &states, &want.chunk_states, tol)?;
    let ref_states = want
        .chunk_states
        .to_dtype(spec.state_dtype)?
        .to_device(&dev)?;
    let y = k::compute_out(
        &pb.x,
        &pb.b,
        &pb.c,
        &dt_out,
        &da,
        &ref_states,
        opts.d,
        opts.z,
        spec.chunk,
    )?;
    expect("compute_out", &y, &want.y, tol)?;
    let (y, state) = k::ssd(&pb.x, &pb.dt, &pb.a, &pb.b, &pb.c, &opts)?;
    expect("ssd y", &y, &want.y, tol)?;
    expect("ssd final state", &state, &want.final_state, tol)?;

    // The CPU ops on the same inputs agree too.
    let (y_cpu, s_cpu) = k::ssd(&cpu.x, &cpu.dt, &cpu.a, &cpu.b, &cpu.c, &cpu.options())?;
    expect("ssd y vs cpu", &y, &y_cpu, tol)?;
    expect("ssd state vs cpu", &state, &s_cpu, tol)?;
    Ok(worst)
}

/// The public stages 1 and 2 on `pb`: (dt_out, da_cumsum, chunk states).
fn stages(pb: &Problem, spec: &Spec) -> Result<(Tensor, Tensor, Tensor)> {
    let (dt_out, da) = k::chunk_cumsum(&pb.dt, &pb.a, &pb.options().dt, spec.chunk)?;
    let states = k::fwd_pass_state(
        &pb.x,
        &pb.b,
        &dt_out,
        &da,
        pb.init.as_ref(),
        spec.chunk,
        spec.state_dtype,
    )?;
    Ok((dt_out, da, states))
}

fn spec(
    seqlen: usize,
    nheads: usize,
    ngroups: usize,
    headdim: usize,
    dstate: usize,
    chunk: usize,
    dtype: DType,
) -> Spec {
    let mut s = Spec::new(seqlen, nheads, ngroups, chunk);
    s.headdim = headdim;
    s.dstate = dstate;
    s.dtype = dtype;
    s.init_state = true;
    s.d = 1;
    s.z = true;
    s.dt_bias = true;
    s
}

/// The worst relative error over every value dtype × (P, N) × (L, chunk) × state dtype f32 / bf16,
/// in that order, with seeds counting up from `seed` and the D term cycling through none, per
/// head and per channel.
fn sweep(
    dtypes: &[DType],
    shapes: &[(usize, usize)],
    lengths: &[(usize, usize)],
    mut seed: u64,
) -> Result<f64> {
    let mut worst = 0f64;
    for &dtype in dtypes {
        for &(headdim, dstate) in shapes {
            for &(seqlen, chunk) in lengths {
                for state_dtype in [DType::F32, DType::BF16] {
                    let mut s = spec(seqlen, 4, 2, headdim, dstate, chunk, dtype);
                    s.state_dtype = state_dtype;
                    s.d = (seed % 3) as u8;
                    worst = worst.max(check(&s, seed)?);
                    seed += 1;
                }
            }
        }
    }
    Ok(worst)
}

/// The tensor-core kernels: fwd_pass_state's chunk-parallel pair (N-tiles of 16–128, two or four
/// warps), compute_out's P-tiles (P = 96 takes the P-tile of 32).
#[test]
fn tensor_core_shapes_match_reference() -> Result<()> {
    let worst = sweep(
        &[DType::BF16, DType::F16],
        &[(64, 128), (32, 64), (128, 16), (64, 256), (96, 32)],
        &[(3 * 128 + 5, 128), (200, 64), (600, 256), (1, 128)],
        1000,
    )?;
    println!("tensor-core paths: worst rel err {worst:e}");
    Ok(())
}

/// Sequences of many chunks (33 and 41, the last one partial): the scan carries the initial state
/// through every chunk's slot, whose ring of prefetched chunks wraps several times.
#[test]
fn many_chunks_match_reference() -> Result<()> {
    let worst = sweep(
        &[DType::BF16],
        &[(64, 128), (32, 64)],
        &[(41 * 64 - 57, 64), (33 * 128, 128)],
        1500,
    )?;
    println!("many chunks: worst rel err {worst:e}");
    Ok(())
}

#[test]
fn simt_shapes_match_reference() -> Result<()> {
    let mut worst = 0f64;
    let mut seed = 2000;
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        // P = 48 and N = 24 fall outside the tensor-core tiling; chunk 16 and 32 too.
        for (headdim, dstate, chunk, seqlen) in [
            (48, 16, 64, 150),
            (64, 24, 128, 130),
            (16, 16, 16, 77),
            (64, 64, 32, 100),
            (8, 16, 256, 300),
        ] {
            let mut s = spec(seqlen, 6, 3, headdim, dstate, chunk, dtype);
            s.d = 2;
            worst = worst.max(check(&s, seed)?);
            seed += 1;
        }
    }
    println!("SIMT paths: worst rel err {worst:e}");
    Ok(())
}

#[test]
fn fast_decay_and_groups_match_reference() -> Result<()> {
    for (i, (ngroups, dtype)) in [(1, DType::BF16), (4, DType::BF16), (2, DType::F32)]
        .into_iter()
        .enumerate()
    {
        let mut s = spec(1000, 8, ngroups, 64, 128, 128, dtype);
        s.fast_decay = true;
        s.dt_limit = Some((0.001, 2.0));
        check(&s, 3000 + i as u64)?;
    }
    Ok(())
}

#[test]
fn ssd_step_matches_reference() -> Result<()> {
    let dev = gpu();
    for (i, (dtype, state_dtype, dstate)) in [
        (DType::F32, DType::F32, 128),
        (DType::BF16, DType::F32, 128),
        (DType::BF16, DType::BF16, 64),
        (DType::F16, DType::F32, 13),
    ]
    .into_iter()
    .enumerate()
    {
        let mut s = spec(1, 8, 2, 64, dstate, 16, dtype);
        s.state_dtype = state_dtype;
        s.d = 2;
        s.dt_limit = Some((0.01, 0.5));
        let cpu = Problem::new(&s, &mut Rng::new(4000 + i as u64), &Device::Cpu)?;
        let want = reference::ssd(&cpu.x, &cpu.dt, &cpu.a, &cpu.b, &cpu.c, &cpu.options())?;
        let pb = cpu.to_device(&dev)?;
        let state = pb.init.as_ref().expect("init_state set").copy()?;
        let y = pb.step(&state, 0)?;
        let tol = if dtype == DType::F32 && state_dtype == DType::F32 {
            1e-5
        } else {
            1e-2
        };
        let e = rel_err(&y, &want.y.i((.., 0))?)?;
        assert!(e <= tol, "{dtype:?}/{state_dtype:?}: step y rel err {e:e}");
        let e = rel_err(&state, &want.final_state)?;
        assert!(
            e <= tol,
            "{dtype:?}/{state_dtype:?}: step state rel err {e:e}"
        );
    }
    Ok(())
}

/// `ssd` over L tokens equals L calls of `ssd_step` on the GPU.
#[test]
fn ssd_equals_repeated_steps() -> Result<()> {
    let dev = gpu();
    let s = spec(70, 4, 2, 64, 64, 64, DType::F32);
    let pb = Problem::new(&s, &mut Rng::new(5000), &Device::Cpu)?.to_device(&dev)?;
    let (y_full, s_full) = k::ssd(&pb.x, &pb.dt, &pb.a, &pb.b, &pb.c, &pb.options())?;
    let state = pb.init.as_ref().expect("init_state set").copy()?;
    let mut ys = Vec::new();
    for t in 0..s.seqlen {
        ys.push(pb.step(&state, t)?.unsqueeze(1)?);
    }
    let e = rel_err(&Tensor::cat(&ys, 1)?, &y_full)?;
    assert!(e <= 1e-4, "steps vs ssd y rel err {e:e}");
    let e = rel_err(&state, &s_full)?;
    assert!(e <= 1e-4, "steps vs ssd state rel err {e:e}");
    Ok(())
}

/// Whether `a` and `b` hold the same values, bit for bit (through f32, which holds bf16 exactly).
fn same_bits(a: &Tensor, b: &Tensor) -> Result<bool> {
    Ok(a.to_dtype(DType::F32)?
        .ne(&b.to_dtype(DType::F32)?)?
        .to_dtype(DType::F32)?
        .sum_all()?
        .to_scalar::<f32>()?
        == 0.0)
}

/// Two runs on the same inputs give the same bits (no races between programs).
#[test]
fn repeated_runs_are_bit_identical() -> Result<()> {
    let dev = gpu();
    for (i, dtype) in [DType::BF16, DType::F32].into_iter().enumerate() {
        let s = spec(2000, 8, 1, 64, 128, 128, dtype);
        let pb = Problem::new(&s, &mut Rng::new(6000 + i as u64), &Device::Cpu)?.to_device(&dev)?;
        let (y1, s1) = k::ssd(&pb.x, &pb.dt, &pb.a, &pb.b, &pb.c, &pb.options())?;
        let (y2, s2) = k::ssd(&pb.x, &pb.dt, &pb.a, &pb.b, &pb.c, &pb.options())?;
        assert!(same_bits(&y1, &y2)?, "{dtype:?}: y differs between runs");
        assert!(
            same_bits(&s1, &s2)?,
            "{dtype:?}: state differs between runs"
        );
    }
    Ok(())
}

/// `ssd` keeps its intermediates in scratch memory per stream, reused by the next call: calls of
/// different sizes issued back to back (no synchronisation between them; the scratch buffer grows
/// on the way) give the bits of the same calls run one at a time, and so does a call captured
/// into a CUDA graph (which takes memory of its own) and replayed.
#[test]
fn back_to_back_and_graph_calls_match_single_calls() -> Result<()> {
    use candle_core::cuda_backend::cudarc::driver::sys::{
        CUgraphInstantiate_flags, CUstreamCaptureMode,
    };
    use candle_core::cuda_backend::WrapErr;

    let dev = gpu();
    let problems = [(2000, 128), (300, 64), (5000, 128)]
        .into_iter()
        .enumerate()
        .map(|(i, (seqlen, dstate))| {
            let mut s = spec(seqlen, 8, 1, 64, dstate, 128, DType::BF16);
            s.state_dtype = DType::BF16;
            Problem::new(&s, &mut Rng::new(9000 + i as u64), &Device::Cpu)?.to_device(&dev)
        })
        .collect::<Result<Vec<_>>>()?;
    let run = |pb: &Problem| k::ssd(&pb.x, &pb.dt, &pb.a, &pb.b, &pb.c, &pb.options());
    let mut alone = Vec::new();
    for pb in &problems {
        alone.push(run(pb)?);
        dev.synchronize()?;
    }
    let order = [0, 1, 2, 0, 1, 2, 1, 0];
    let outs = order
        .iter()
        .map(|&i| run(&problems[i]))
        .collect::<Result<Vec<_>>>()?;
    for (&i, (y, s)) in order.iter().zip(&outs) {
        assert!(
            same_bits(y, &alone[i].0)?,
            "problem {i}: y differs back to back"
        );
        assert!(
            same_bits(s, &alone[i].1)?,
            "problem {i}: state differs back to back"
        );
    }

    let cuda = dev.as_cuda_device()?;
    let stream = cuda.cuda_stream();
    let (y_dst, s_dst) = (alone[2].0.zeros_like()?, alone[2].1.zeros_like()?);
    dev.synchronize()?;
    let _htod = cuda.enable_cuda_graph_htod_cache();
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .w()?;
    let captured = run(&problems[2]).and_then(|(y, s)| {
        y_dst.slice_set(&y, 0, 0)?;
        s_dst.slice_set(&s, 0, 0)
    });
    let graph = stream.end_capture(CUgraphInstantiate_flags(0)).w()?;
    captured?;
    let graph = graph.ok_or_else(|| candle_core::Error::Msg("empty graph".into()))?;
    for _ in 0..2 {
        y_dst.slice_set(&y_dst.zeros_like()?, 0, 0)?;
        s_dst.slice_set(&s_dst.zeros_like()?, 0, 0)?;
        graph.launch().w()?;
        dev.synchronize()?;
        assert!(same_bits(&y_dst, &alone[2].0)?, "graph: y differs");
        assert!(same_bits(&s_dst, &alone[2].1)?, "graph: state differs");
    }
    Ok(())
}

/// cudarc orders work across streams by events on every buffer (candle's default): `ssd`'s
/// outputs carry the write event of the kernels that produce them, so a copy on another stream
/// issued right after the call (L = 65,536: hundreds of µs of kernels still to run) waits for
/// them instead of reading the NaN poison of a fresh buffer.
#[test]
fn outputs_are_ordered_for_other_streams() -> Result<()> {
    use candle_core::cuda_backend::WrapErr;
    use candle_core::Storage;

    let dev = gpu();
    let mut s = spec(65536, 8, 1, 64, 128, 128, DType::BF16);
    s.state_dtype = DType::BF16;
    let pb = Problem::new(&s, &mut Rng::new(9500), &Device::Cpu)?.to_device(&dev)?;
    let run = || k::ssd(&pb.x, &pb.dt, &pb.a, &pb.b, &pb.c, &pb.options());
    let (y_ref, s_ref) = run()?;
    let want = [
        y_ref.flatten_all()?.to_vec1::<half::bf16>()?,
        s_ref.flatten_all()?.to_vec1::<half::bf16>()?,
    ];
    let other = dev
        .as_cuda_device()?
        .cuda_stream()
        .context()
        .new_stream()
        .w()?;
    for round in 0..3 {
        let (y, st) = run()?;
        for ((t, want), what) in [&y, &st].into_iter().zip(&want).zip(["y", "final state"]) {
            let (storage, _) = t.storage_and_layout();
            let Storage::Cuda(cuda) = &*storage else {
                panic!("{what} is not on the GPU")
            };
            let got = other.clone_dtoh(cuda.as_cuda_slice::<half::bf16>()?).w()?;
            other.synchronize().w()?;
            let same = got.len() == want.len()
                && got
                    .iter()
                    .zip(want)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same,
                "round {round}: {what} copied on another stream differs"
            );
        }
    }
    Ok(())
}

/// L = 1,048,576 tokens: finite outputs, and the final state agrees with the CPU ops.
#[test]
fn million_token_sequence_stays_finite() -> Result<()> {
    let dev = gpu();
    let mut s = spec(1 << 20, 2, 1, 64, 16, 256, DType::BF16);
    s.batch = 1;
    let cpu = Problem::new(&s, &mut Rng::new(7000), &Device::Cpu)?;
    let pb = cpu.to_device(&dev)?;
    let (y, state) = k::ssd(&pb.x, &pb.dt, &pb.a, &pb.b, &pb.c, &pb.options())?;
    let finite = |t: &Tensor| -> Result<bool> {
        let v = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        Ok(v.iter().all(|x| x.is_finite()))
    };
    assert!(finite(&y)?, "y has non-finite values");
    assert!(finite(&state)?, "final state has non-finite values");
    let (_, s_cpu) = k::ssd(&cpu.x, &cpu.dt, &cpu.a, &cpu.b, &cpu.c, &cpu.options())?;
    let e = rel_err(&state, &s_cpu)?;
    assert!(e <= 1e-2, "final state vs cpu rel err {e:e}");
    Ok(())
}

/// `ssd` runs stage 1 inside the state pass on small grids and as its own kernel on large ones
/// (more than 32 chunk programs per SM); on both sides of that line it gives what the public
/// stages give in sequence, the large grid the same kernels' results exactly.
#[test]
fn ssd_matches_its_stages_on_small_and_large_grids() -> Result<()> {
    let dev = gpu();
    for (i, (batch, seqlen)) in [(1, 2048), (4, 144 * 128)].into_iter().enumerate() {
        let mut s = spec(seqlen, 8, 1, 64, 128, 128, DType::BF16);
        s.batch = batch;
        s.state_dtype = DType::BF16;
        let pb = Problem::new(&s, &mut Rng::new(8000 + i as u64), &Device::Cpu)?.to_device(&dev)?;
        let opts = pb.options();
        let (y, state) = k::ssd(&pb.x, &pb.dt, &pb.a, &pb.b, &pb.c, &opts)?;
        let (dt_out, da, states) = stages(&pb, &s)?;
        let y_stages = k::compute_out(
            &pb.x, &pb.b, &pb.c, &dt_out, &da, &states, opts.d, opts.z, s.chunk,
        )?;
        let last = states.i((.., .., states.dim(2)? - 1))?;
        let tol = if i == 0 { 1e-2 } else { 0.0 };
        let (ey, es) = (rel_err(&y, &y_stages)?, rel_err(&state, &last)?);
        assert!(
            ey <= tol && es <= tol,
            "B={batch} L={seqlen}: y {ey:e}, state {es:e}"
        );
    }
    Ok(())
}

/// Sizes past the launch limits get errors before any kernel runs on them — a chunk past the cap,
/// a grid past CUDA's 65,535 programs along y, a conv longer than its grid allows — and the same
/// process then runs correct kernels: nothing poisoned the context.
#[test]
fn launches_past_the_limits_are_refused_and_the_context_lives() -> Result<()> {
    let dev = gpu();
    let pb = Problem::new(
        &spec(100, 4, 2, 16, 16, 32, DType::BF16),
        &mut Rng::new(9000),
        &Device::Cpu,
    )?
    .to_device(&dev)?;
    let opts = k::SsdOptions {
        chunk_size: 1 << 30,
        ..pb.options()
    };
    common::expect_err(
        k::ssd(&pb.x, &pb.dt, &pb.a, &pb.b, &pb.c, &opts),
        "chunk_size must be a power of two from 16 to",
    );
    // 65,536 (batch, head) pairs: the f32 state pass puts them along the grid's y axis.
    let heads = 65_536;
    let x = Tensor::zeros((1, 16, heads, 1), DType::F32, &dev)?;
    let dt = Tensor::zeros((1, 16, heads), DType::F32, &dev)?;
    let a = Tensor::zeros(heads, DType::F32, &dev)?;
    let bm = Tensor::zeros((1, 16, 1, 1), DType::F32, &dev)?;
    let small = k::SsdOptions {
        chunk_size: 16,
        ..Default::default()
    };
    common::expect_err(
        k::ssd(&x, &dt, &a, &bm, &bm, &small),
        "65536 programs along the grid's y axis, outside 1..=65535",
    );
    // 2²¹ + 32 tokens: the conv's 32-token programs along y pass 65,535.
    let xc = Tensor::zeros((1, (1 << 21) + 32, 1), DType::BF16, &dev)?;
    let w = Tensor::zeros((1, 4), DType::BF16, &dev)?;
    common::expect_err(
        k::causal_conv1d(&xc, &w, None, &k::ConvOptions::default()),
        "programs along the grid's y axis",
    );
    dev.synchronize()?;
    // The context still runs the kernels correctly.
    check(&spec(300, 4, 2, 64, 64, 128, DType::BF16), 9001)?;
    Ok(())
}
