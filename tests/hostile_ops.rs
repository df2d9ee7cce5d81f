//! Hostile inputs to the ops, on the CPU: sizes past the ops' limits (chunk lengths, dimensions
//! past the kernels' i32 index space), empty dimensions, non-finite or out-of-range options — each
//! an error naming the value and the limit — and 10,000 random shapes and options, zero and huge
//! ones among them, none of which may panic.

mod common;

use std::panic::{catch_unwind, AssertUnwindSafe};

use candle_core::{DType, Device, Result, Tensor};
use common::{expect_err, Problem, Rng, Spec};
use mamba2::kernels::{self as k, ConvOptions, DtOptions, SsdOptions, MAX_CHUNK_SIZE, MAX_DIM};

fn problem() -> Problem {
    let spec = Spec::new(20, 4, 2, 16);
    Problem::new(&spec, &mut Rng::new(3), &Device::Cpu).expect("a valid problem")
}

/// A tensor of `shape` that allocates nothing: one zero broadcast (dimensions may be huge).
fn view(shape: &[usize]) -> Result<Tensor> {
    Tensor::zeros(1, DType::F32, &Device::Cpu)?.broadcast_as(shape)
}

#[test]
fn chunk_lengths_past_the_cap_are_refused() {
    let pb = problem();
    for chunk in [MAX_CHUNK_SIZE * 2, 1 << 30, usize::MAX / 2 + 1] {
        let opts = SsdOptions {
            chunk_size: chunk,
            ..pb.options()
        };
        let msg = format!("chunk_size must be a power of two from 16 to {MAX_CHUNK_SIZE}");
        expect_err(k::ssd(&pb.x, &pb.dt, &pb.a, &pb.b, &pb.c, &opts), &msg);
        expect_err(
            k::chunk_cumsum(&pb.dt, &pb.a, &pb.dt_options(), chunk),
            &msg,
        );
        let (dt_out, da) = k::chunk_cumsum(&pb.dt, &pb.a, &pb.dt_options(), 16).expect("steps");
        expect_err(
            k::fwd_pass_state(&pb.x, &pb.b, &dt_out, &da, None, chunk, DType::F32),
            &msg,
        );
        let states = view(&[2, 4, 2, 8, 16]).expect("view");
        expect_err(
            k::compute_out(
                &pb.x, &pb.b, &pb.c, &dt_out, &da, &states, None, None, chunk,
            ),
            &msg,
        );
    }
}

#[test]
fn dimensions_past_the_index_space_are_refused() {
    let huge = MAX_DIM + 1;
    let needle = format!("over the limit of {MAX_DIM}");
    let x = view(&[1, huge, 1, 1]).expect("view");
    let b = view(&[1, huge, 1, 1]).expect("view");
    let dt = view(&[1, huge, 1]).expect("view");
    let a = Tensor::new(&[-1f32], &Device::Cpu).expect("a");
    let opts = SsdOptions {
        chunk_size: 16,
        ..Default::default()
    };
    expect_err(k::ssd(&x, &dt, &a, &b, &b, &opts), &needle);
    expect_err(k::chunk_cumsum(&dt, &a, &DtOptions::default(), 16), &needle);
    let w = view(&[huge, 4]).expect("view");
    expect_err(k::matvec(&view(&[1, 4]).expect("x"), &w, None), &needle);
    let xc = view(&[1, 3, huge]).expect("view");
    expect_err(
        k::causal_conv1d(
            &xc,
            &view(&[huge, 4]).expect("w"),
            None,
            &ConvOptions::default(),
        ),
        &needle,
    );
    let xn = view(&[huge, 8]).expect("view");
    let wn = view(&[8]).expect("view");
    expect_err(k::add_rms_norm(&xn, None, &wn, 1e-5, true), &needle);
    expect_err(k::gated_rms_norm(&xn, &xn, &wn, 8, 1e-5), &needle);
}

#[test]
fn empty_dimensions_are_refused() {
    let pb = problem();
    let empty = |shape: &[usize]| Tensor::zeros(shape, DType::F32, &Device::Cpu).expect("empty");
    let (x0, dt0, b0) = (
        empty(&[2, 0, 4, 8]),
        empty(&[2, 0, 4]),
        empty(&[2, 0, 2, 16]),
    );
    expect_err(
        k::ssd(&x0, &dt0, &pb.a, &b0, &b0, &pb.options()),
        "ssd: empty dimension",
    );
    expect_err(
        k::chunk_cumsum(&dt0, &pb.a, &pb.dt_options(), 16),
        "chunk_cumsum: dt has an empty dimension",
    );
    let steps = empty(&[2, 4, 0]);
    let states = empty(&[2, 4, 1, 8, 16]);
    expect_err(
        k::compute_out(&x0, &b0, &b0, &steps, &steps, &states, None, None, 16),
        "compute_out: empty dimension",
    );
    for (x, w) in [
        (empty(&[0, 8]), empty(&[4, 8])),
        (empty(&[2, 0]), empty(&[4, 0])),
        (empty(&[2, 8]), empty(&[0, 8])),
    ] {
        expect_err(k::matvec(&x, &w, None), "matvec: empty dimension");
    }
}

#[test]
fn non_finite_and_out_of_range_options_are_refused() {
    let pb = problem();
    for limit in [
        (f32::INFINITY, f32::INFINITY),
        (f32::NAN, 1.0),
        (0.0, f32::NAN),
        (-1.0, 1.0),
        (0.5, 0.1),
    ] {
        let dt = DtOptions {
            limit,
            ..pb.dt_options()
        };
        let opts = SsdOptions { dt, ..pb.options() };
        expect_err(
            k::ssd(&pb.x, &pb.dt, &pb.a, &pb.b, &pb.c, &opts),
            "dt_limit must be (lo, hi) with 0 <= lo <= hi",
        );
    }
    let x = Tensor::ones((3, 8), DType::F32, &Device::Cpu).expect("x");
    let w = Tensor::ones(8, DType::F32, &Device::Cpu).expect("w");
    for eps in [f64::NAN, f64::INFINITY, -1e-5, 1e30] {
        expect_err(
            k::add_rms_norm(&x, None, &w, eps, true),
            "eps must be finite and in [0, 1]",
        );
        expect_err(
            k::gated_rms_norm(&x, &x, &w, 8, eps),
            "eps must be finite and in [0, 1]",
        );
    }
}

/// A dimension for the random shapes: small, zero, or past the index space (views only).
fn dim(rng: &mut Rng) -> usize {
    match rng.below(10) {
        0 => 0,
        1 => MAX_DIM + 1 + rng.below(1000),
        _ => [1, 2, 3, 5, 8, 16, 17, 32][rng.below(8)],
    }
}

/// A tensor of `shape`: random values when small, a broadcast view when large.
fn tensor(rng: &mut Rng, shape: &[usize]) -> Result<Tensor> {
    let n = shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
    match n {
        Some(n) if n <= 1 << 16 => rng.tensor(shape, 1.0, &Device::Cpu),
        _ => view(shape),
    }
}

/// One random call of one op; any `Result` is fine, a panic is not.
fn random_call(rng: &mut Rng) -> Result<()> {
    let (b, l, h, p, g, n) = (dim(rng), dim(rng), dim(rng), dim(rng), dim(rng), dim(rng));
    let chunk = [0, 8, 16, 48, 64, 2048, 4096, 1 << 40][rng.below(8)];
    let eps = [1e-5, 0.0, f64::NAN, 1e9][rng.below(4)];
    let limit = [(0.0, f32::INFINITY), (0.001, 0.1), (f32::INFINITY, 1.0)][rng.below(3)];
    let dt_opts = DtOptions {
        bias: None,
        softplus: rng.below(2) == 0,
        limit,
    };
    let a = tensor(rng, &[h])?;
    match rng.below(8) {
        0 => {
            let opts = SsdOptions {
                chunk_size: chunk,
                dt: dt_opts,
                ..Default::default()
            };
            let (x, dt) = (tensor(rng, &[b, l, h, p])?, tensor(rng, &[b, l, h])?);
            let (bm, cm) = (tensor(rng, &[b, l, g, n])?, tensor(rng, &[b, l, g, n])?);
            k::ssd(&x, &dt, &a, &bm, &cm, &opts).map(drop)
        }
        1 => k::chunk_cumsum(&tensor(rng, &[b, l, h])?, &a, &dt_opts, chunk).map(drop),
        2 => {
            let x = tensor(rng, &[b, l, h, p])?;
            let bm = tensor(rng, &[b, l, g, n])?;
            let steps = tensor(rng, &[b, h, l])?;
            k::fwd_pass_state(&x, &bm, &steps, &steps, None, chunk, DType::F32).map(drop)
        }
        3 => {
            let state = tensor(rng, &[b, h, p, n])?;
            let (x, dt) = (tensor(rng, &[b, h, p])?, tensor(rng, &[b, h])?);
            let (bm, cm) = (tensor(rng, &[b, g, n])?, tensor(rng, &[b, g, n])?);
            let opts = k::StepOptions {
                dt: dt_opts,
                ..Default::default()
            };
            k::ssd_step(&state, &x, &dt, &a, &bm, &cm, &opts).map(drop)
        }
        4 => {
            let x = tensor(rng, &[b, l, p])?;
            let w = tensor(rng, &[p, n])?;
            k::causal_conv1d(&x, &w, None, &ConvOptions::default()).map(drop)
        }
        5 => k::matvec(&tensor(rng, &[b, p])?, &tensor(rng, &[n, p])?, None).map(drop),
        6 => {
            let (x, w) = (tensor(rng, &[b, p])?, tensor(rng, &[p])?);
            k::gated_rms_norm(&x, &x, &w, n, eps).map(drop)
        }
        _ => {
            let (x, w) = (tensor(rng, &[b, l, p])?, tensor(rng, &[p])?);
            k::add_rms_norm(&x, None, &w, eps, rng.below(2) == 0).map(drop)
        }
    }
}

#[test]
fn ten_thousand_random_calls_never_panic() {
    let mut rng = Rng::new(33);
    let mut ok = 0;
    for case in 0..10_000 {
        match catch_unwind(AssertUnwindSafe(|| random_call(&mut rng))) {
            Ok(Ok(())) => ok += 1,
            Ok(Err(_)) => {}
            Err(_) => panic!("random call {case} panicked"),
        }
    }
    // The valid draws ran; the rest returned errors.
    assert!(ok > 100, "only {ok} of the random calls were valid");
}
