//! The CPU SSD ops against the sequential f64 recurrence (`mamba2::kernels::reference`).

mod common;

use candle_core::{DType, Device, IndexOp, Result, Tensor};
use common::{rel_err, tolerance, Problem, Rng, Spec};
use mamba2::kernels::{self as k, reference};

/// Runs every stage and `ssd` on `spec` and checks each against the reference.
fn check_spec(spec: &Spec, seed: u64) -> Result<()> {
    let dev = Device::Cpu;
    let pb = Problem::new(spec, &mut Rng::new(seed), &dev)?;
    let opts = pb.options();
    let want = reference::ssd(&pb.x, &pb.dt, &pb.a, &pb.b, &pb.c, &opts)?;
    // Fast decay puts |da_cumsum| in the hundreds within a chunk; exponent differences of two
    // such f32 sums lose |d|·2⁻²⁴ absolute, the inherent limit of the log-space cumsum.
    let floor = if spec.fast_decay { 1e-4 } else { 0.0 };
    let tol = tolerance(spec.dtype)
        .max(tolerance(spec.state_dtype))
        .max(floor);
    let state_tol = tol;
    let ctx = format!("{spec:?} seed {seed}");

    let (dt_out, da_cumsum) = k::chunk_cumsum(&pb.dt, &pb.a, &opts.dt, spec.chunk)?;
    let e = rel_err(&dt_out, &want.dt_out)?;
    assert!(e <= 1e-6, "chunk_cumsum dt_out rel err {e:e} for {ctx}");
    let e = rel_err(&da_cumsum, &want.da_cumsum)?;
    assert!(e <= 1e-5, "chunk_cumsum da_cumsum rel err {e:e} for {ctx}");

    let states = k::fwd_pass_state(
        &pb.x,
        &pb.b,
        &dt_out,
        &da_cumsum,
        pb.init.as_ref(),
        spec.chunk,
        spec.state_dtype,
    )?;
    assert_eq!(states.dtype(), spec.state_dtype);
    let e = rel_err(&states, &want.chunk_states)?;
    assert!(e <= state_tol, "fwd_pass_state rel err {e:e} for {ctx}");

    let ref_states = want.chunk_states.to_dtype(DType::F32)?;
    let y = k::compute_out(
        &pb.x,
        &pb.b,
        &pb.c,
        &dt_out,
        &da_cumsum,
        &ref_states,
        opts.d,
        opts.z,
        spec.chunk,
    )?;
    assert_eq!(y.dtype(), spec.dtype);
    let e = rel_err(&y, &want.y)?;
    assert!(e <= tol, "compute_out rel err {e:e} for {ctx}");

    let (y, final_state) = k::ssd(&pb.x, &pb.dt, &pb.a, &pb.b, &pb.c, &opts)?;
    let e = rel_err(&y, &want.y)?;
    assert!(e <= tol, "ssd y rel err {e:e} for {ctx}");
    let e = rel_err(&final_state, &want.final_state)?;
    assert!(e <= state_tol, "ssd final state rel err {e:e} for {ctx}");
    Ok(())
}

/// The four option sets the shape matrix cycles through.
fn with_options(mut spec: Spec, variant: usize) -> Spec {
    match variant % 4 {
        0 => {}
        1 => {
            spec.init_state = true;
            spec.d = 1;
        }
        2 => {
            spec.z = true;
            spec.dt_bias = true;
            spec.d = 2;
        }
        _ => {
            spec.init_state = true;
            spec.z = true;
            spec.dt_bias = true;
            spec.d = 1;
            spec.dt_limit = Some((0.05, 0.5));
        }
    }
    spec
}

#[test]
fn shape_matrix_f32_matches_reference() -> Result<()> {
    let mut case = 0;
    for chunk in [16, 64, 128, 256] {
        for seqlen in [1, chunk - 1, 3 * chunk + 5] {
            for ngroups in [1, 2, 4] {
                for variant in 0..4 {
                    let spec = with_options(Spec::new(seqlen, 4, ngroups, chunk), variant);
                    check_spec(&spec, case)?;
                    case += 1;
                }
            }
        }
    }
    Ok(())
}

#[test]
fn half_precision_inputs_match_reference() -> Result<()> {
    let mut case = 100;
    for dtype in [DType::BF16, DType::F16] {
        for (seqlen, chunk) in [(1, 16), (63, 64), (3 * 128 + 5, 128), (300, 256)] {
            for variant in 0..4 {
                let mut spec = with_options(Spec::new(seqlen, 4, 2, chunk), variant);
                spec.dtype = dtype;
                check_spec(&spec, case)?;
                case += 1;
            }
        }
    }
    Ok(())
}

#[test]
fn fast_decay_matches_reference() -> Result<()> {
    for (i, (seqlen, chunk)) in [(255, 256), (3 * 128 + 5, 128), (100, 16)]
        .into_iter()
        .enumerate()
    {
        let mut spec = with_options(Spec::new(seqlen, 4, 2, chunk), i + 1);
        spec.fast_decay = true;
        check_spec(&spec, 250 + i as u64)?;
    }
    Ok(())
}

#[test]
fn bf16_chunk_states_match_reference() -> Result<()> {
    for (i, (seqlen, ngroups)) in [(77, 1), (200, 2), (16, 4)].into_iter().enumerate() {
        let mut spec = with_options(Spec::new(seqlen, 4, ngroups, 16), i + 1);
        spec.state_dtype = DType::BF16;
        check_spec(&spec, 200 + i as u64)?;
    }
    Ok(())
}

#[test]
fn odd_head_and_state_sizes_match_reference() -> Result<()> {
    for (i, (headdim, dstate, nheads, ngroups)) in
        [(1, 1, 1, 1), (5, 3, 6, 3), (48, 16, 2, 1), (16, 130, 4, 2)]
            .into_iter()
            .enumerate()
    {
        let mut spec = with_options(Spec::new(53, nheads, ngroups, 16), i);
        spec.headdim = headdim;
        spec.dstate = dstate;
        spec.batch = 1 + i % 2;
        check_spec(&spec, 300 + i as u64)?;
    }
    Ok(())
}

#[test]
fn ssd_without_softplus_matches_reference() -> Result<()> {
    let mut spec = with_options(Spec::new(70, 4, 2, 32), 3);
    spec.dt_softplus = false;
    check_spec(&spec, 400)
}

/// `ssd` over L tokens equals `ssd` over the first k, then over the rest from the returned state.
#[test]
fn split_sequence_continues_from_final_state() -> Result<()> {
    let dev = Device::Cpu;
    for (i, (seqlen, split, chunk)) in [(100, 37, 16), (129, 64, 64), (300, 1, 128), (50, 49, 16)]
        .into_iter()
        .enumerate()
    {
        let spec = with_options(Spec::new(seqlen, 4, 2, chunk), i);
        let pb = Problem::new(&spec, &mut Rng::new(500 + i as u64), &dev)?;
        let opts = pb.options();
        let (y_full, s_full) = k::ssd(&pb.x, &pb.dt, &pb.a, &pb.b, &pb.c, &opts)?;
        let part = |t: &Tensor, r: std::ops::Range<usize>| t.i((.., r));
        let first = (
            part(&pb.x, 0..split)?,
            part(&pb.dt, 0..split)?,
            part(&pb.b, 0..split)?,
            part(&pb.c, 0..split)?,
        );
        let z1 = pb.z.as_ref().map(|z| part(z, 0..split)).transpose()?;
        let (y1, s1) = k::ssd(
            &first.0,
            &first.1,
            &pb.a,
            &first.2,
            &first.3,
            &k::SsdOptions {
                z: z1.as_ref(),
                ..opts
            },
        )?;
        let rest = (
            part(&pb.x, split..seqlen)?,
            part(&pb.dt, split..seqlen)?,
            part(&pb.b, split..seqlen)?,
            part(&pb.c, split..seqlen)?,
        );
        let z2 = pb.z.as_ref().map(|z| part(z, split..seqlen)).transpose()?;
        let opts2 = k::SsdOptions {
            z: z2.as_ref(),
            initial_state: Some(&s1),
            ..opts
        };
        let (y2, s2) = k::ssd(&rest.0, &rest.1, &pb.a, &rest.2, &rest.3, &opts2)?;
        let y_split = Tensor::cat(&[&y1, &y2], 1)?;
        let e = rel_err(&y_split, &y_full)?;
        assert!(e <= 1e-5, "split at {split}: y rel err {e:e}");
        let e = rel_err(&s2, &s_full)?;
        assert!(e <= 1e-5, "split at {split}: state rel err {e:e}");
    }
    Ok(())
}

/// `ssd` over L tokens equals L calls of `ssd_step`, for f32 and bf16 states.
#[test]
fn ssd_equals_repeated_steps() -> Result<()> {
    let dev = Device::Cpu;
    for (i, state_dtype) in [DType::F32, DType::BF16].into_iter().enumerate() {
        let mut spec = with_options(Spec::new(45, 6, 3, 16), 3);
        spec.state_dtype = state_dtype;
        let pb = Problem::new(&spec, &mut Rng::new(600 + i as u64), &dev)?;
        let opts = pb.options();
        let (y_full, s_full) = k::ssd(&pb.x, &pb.dt, &pb.a, &pb.b, &pb.c, &opts)?;
        let state = match &pb.init {
            Some(s) => s.copy()?,
            None => Tensor::zeros((2, 6, 8, 16), state_dtype, &dev)?,
        };
        let mut ys = Vec::new();
        for t in 0..spec.seqlen {
            ys.push(pb.step(&state, t)?.unsqueeze(1)?);
        }
        // bf16 states are rounded after every step here but only at chunk ends in `ssd`.
        let tol = if state_dtype == DType::F32 {
            1e-5
        } else {
            3e-2
        };
        let e = rel_err(&Tensor::cat(&ys, 1)?, &y_full)?;
        assert!(
            e <= tol,
            "{state_dtype:?} states: steps vs ssd y rel err {e:e}"
        );
        let e = rel_err(&state, &s_full)?;
        assert!(
            e <= tol,
            "{state_dtype:?} states: steps vs ssd state rel err {e:e}"
        );
    }
    Ok(())
}

/// One `ssd_step` against the recurrence, with a gate and a per-channel D, in half precision.
#[test]
fn ssd_step_matches_reference() -> Result<()> {
    let dev = Device::Cpu;
    for (i, dtype) in [DType::F32, DType::BF16, DType::F16]
        .into_iter()
        .enumerate()
    {
        let mut spec = with_options(Spec::new(1, 4, 2, 16), 2);
        spec.init_state = true;
        spec.dtype = dtype;
        let pb = Problem::new(&spec, &mut Rng::new(700 + i as u64), &dev)?;
        let want = reference::ssd(&pb.x, &pb.dt, &pb.a, &pb.b, &pb.c, &pb.options())?;
        let state = pb
            .init
            .as_ref()
            .map(|s| s.copy())
            .transpose()?
            .expect("init_state is set");
        let y = pb.step(&state, 0)?;
        assert_eq!(y.dtype(), dtype);
        let e = rel_err(&y, &want.y.i((.., 0))?)?;
        assert!(e <= tolerance(dtype), "{dtype:?}: y rel err {e:e}");
        let e = rel_err(&state, &want.final_state)?;
        assert!(e <= tolerance(dtype), "{dtype:?}: state rel err {e:e}");
    }
    Ok(())
}

/// a = −1e4 drives every exponential far below f32's range: outputs stay finite and right.
#[test]
fn strongly_negative_decay_stays_finite() -> Result<()> {
    let dev = Device::Cpu;
    let mut spec = with_options(Spec::new(4000, 4, 2, 128), 3);
    spec.batch = 1;
    spec.fast_decay = true;
    spec.dt_limit = None;
    let mut pb = Problem::new(&spec, &mut Rng::new(800), &dev)?;
    pb.a = Tensor::full(-1e4f32, 4, &dev)?;
    let (y, state) = k::ssd(&pb.x, &pb.dt, &pb.a, &pb.b, &pb.c, &pb.options())?;
    let want = reference::ssd(&pb.x, &pb.dt, &pb.a, &pb.b, &pb.c, &pb.options())?;
    let e = rel_err(&y, &want.y)?;
    assert!(e <= 1e-5, "y rel err {e:e}");
    let e = rel_err(&state, &want.final_state)?;
    assert!(e <= 1e-5, "state rel err {e:e}");
    Ok(())
}

/// Non-contiguous inputs (a transposed view) give the same result as contiguous ones.
#[test]
fn non_contiguous_inputs_are_accepted() -> Result<()> {
    let dev = Device::Cpu;
    let spec = with_options(Spec::new(40, 4, 2, 16), 2);
    let pb = Problem::new(&spec, &mut Rng::new(900), &dev)?;
    let (y, s) = k::ssd(&pb.x, &pb.dt, &pb.a, &pb.b, &pb.c, &pb.options())?;
    let x_t = pb.x.transpose(1, 2)?.contiguous()?.transpose(1, 2)?;
    assert!(!x_t.is_contiguous());
    let (y2, s2) = k::ssd(&x_t, &pb.dt, &pb.a, &pb.b, &pb.c, &pb.options())?;
    assert_eq!(rel_err(&y2, &y)?, 0.0);
    assert_eq!(rel_err(&s2, &s)?, 0.0);
    Ok(())
}

/// f64 values (with f64 parameters and states) are computed in f64: every stage and `ssd` agree
/// with the f64 recurrence to rounding, which the gradient checks against finite differences
/// rely on.
#[test]
fn f64_values_compute_in_f64() -> Result<()> {
    let mut spec = with_options(Spec::new(45, 4, 2, 16), 3);
    spec.dtype = DType::F64;
    spec.state_dtype = DType::F64;
    let dev = Device::Cpu;
    let pb = Problem::new(&spec, &mut Rng::new(64), &dev)?;
    let wide = |t: &Tensor| t.to_dtype(DType::F64);
    let (a, bias) = (wide(&pb.a)?, pb.dt_bias.as_ref().map(wide).transpose()?);
    let d = pb.d.as_ref().map(wide).transpose()?;
    let mut opts = pb.options();
    opts.dt.bias = bias.as_ref();
    opts.d = d.as_ref();
    let want = reference::ssd(&pb.x, &pb.dt, &a, &pb.b, &pb.c, &opts)?;
    let (y, last) = k::ssd(&pb.x, &pb.dt, &a, &pb.b, &pb.c, &opts)?;
    assert_eq!((y.dtype(), last.dtype()), (DType::F64, DType::F64));
    for (what, got, want) in [
        ("y", &y, &want.y),
        ("final state", &last, &want.final_state),
    ] {
        let e = rel_err(got, want)?;
        assert!(e <= 1e-12, "f64 {what} rel err {e:e}");
    }
    let (dt_out, da) = k::chunk_cumsum(&pb.dt, &a, &opts.dt, spec.chunk)?;
    assert_eq!(da.dtype(), DType::F64);
    let states = k::fwd_pass_state(
        &pb.x,
        &pb.b,
        &dt_out,
        &da,
        pb.init.as_ref(),
        spec.chunk,
        DType::F64,
    )?;
    let e = rel_err(&states, &want.chunk_states)?;
    assert!(e <= 1e-12, "f64 chunk states rel err {e:e}");
    Ok(())
}
