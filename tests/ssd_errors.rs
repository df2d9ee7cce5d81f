//! Every bad input to the SSD ops gets an error that names the op, the tensor and the problem.

mod common;

use candle_core::{DType, Device, IndexOp, Tensor};
use common::{expect_err, Problem, Rng, Spec};
use mamba2::kernels::{self as k, SsdOptions, StepOptions};

fn problem() -> Problem {
    let spec = Spec::new(20, 4, 2, 16);
    Problem::new(&spec, &mut Rng::new(1), &Device::Cpu).expect("a valid problem")
}

#[test]
fn wrong_rank_is_named() {
    let pb = problem();
    let x3 = pb.x.i((.., .., 0)).expect("slice");
    expect_err(
        k::ssd(&x3, &pb.dt, &pb.a, &pb.b, &pb.c, &pb.options()),
        "ssd: x must have rank 4 [B, L, H, P], got shape [2, 20, 8]",
    );
    let b3 = pb.b.i((.., .., 0)).expect("slice");
    expect_err(
        k::ssd(&pb.x, &pb.dt, &pb.a, &b3, &pb.c, &pb.options()),
        "ssd: b must have rank 4 [B, L, G, N]",
    );
    expect_err(
        k::chunk_cumsum(&pb.x, &pb.a, &pb.dt_options(), 16),
        "chunk_cumsum: dt must have rank 3 [B, L, H]",
    );
}

#[test]
fn mismatched_dimensions_are_named() {
    let pb = problem();
    let b_short = pb.b.i((.., 0..19)).expect("slice");
    expect_err(
        k::ssd(&pb.x, &pb.dt, &pb.a, &b_short, &pb.c, &pb.options()),
        "ssd: b has shape [2, 19, 2, 16] but x has batch 2 and length 20",
    );
    let b_batch = pb.b.i(0..1).expect("slice");
    expect_err(
        k::ssd(&pb.x, &pb.dt, &pb.a, &b_batch, &pb.c, &pb.options()),
        "ssd: b has shape [1, 20, 2, 16]",
    );
    let dt_h = Tensor::zeros((2, 20, 5), DType::F32, &Device::Cpu).expect("zeros");
    expect_err(
        k::ssd(&pb.x, &dt_h, &pb.a, &pb.b, &pb.c, &pb.options()),
        "ssd: dt must have shape [B, L, H] = [2, 20, 4], got [2, 20, 5]",
    );
    let c_g = pb.c.i((.., .., 0..1)).expect("slice");
    expect_err(
        k::ssd(&pb.x, &pb.dt, &pb.a, &pb.b, &c_g, &pb.options()),
        "ssd: c must have shape [B, L, G, N] = [2, 20, 2, 16], got [2, 20, 1, 16]",
    );
    let c_n = pb.c.i((.., .., .., 0..8)).expect("slice");
    expect_err(
        k::ssd(&pb.x, &pb.dt, &pb.a, &pb.b, &c_n, &pb.options()),
        "ssd: c must have shape [B, L, G, N] = [2, 20, 2, 16], got [2, 20, 2, 8]",
    );
    let z_p = Tensor::zeros((2, 20, 4, 7), DType::F32, &Device::Cpu).expect("zeros");
    let opts = SsdOptions {
        z: Some(&z_p),
        ..pb.options()
    };
    expect_err(
        k::ssd(&pb.x, &pb.dt, &pb.a, &pb.b, &pb.c, &opts),
        "ssd: z must have shape [B, L, H, P] = [2, 20, 4, 8], got [2, 20, 4, 7]",
    );
    let init = Tensor::zeros((2, 4, 8, 15), DType::F32, &Device::Cpu).expect("zeros");
    let opts = SsdOptions {
        initial_state: Some(&init),
        ..pb.options()
    };
    expect_err(
        k::ssd(&pb.x, &pb.dt, &pb.a, &pb.b, &pb.c, &opts),
        "ssd: initial_state must have shape [B, H, P, N] = [2, 4, 8, 16], got [2, 4, 8, 15]",
    );
    let d = Tensor::zeros((4, 3), DType::F32, &Device::Cpu).expect("zeros");
    let opts = SsdOptions {
        d: Some(&d),
        ..pb.options()
    };
    expect_err(
        k::ssd(&pb.x, &pb.dt, &pb.a, &pb.b, &pb.c, &opts),
        "ssd: D must have shape [H] = [4] or [H, P] = [4, 8], got [4, 3]",
    );
    let a5 = Tensor::zeros(5, DType::F32, &Device::Cpu).expect("zeros");
    expect_err(
        k::ssd(&pb.x, &pb.dt, &a5, &pb.b, &pb.c, &pb.options()),
        "ssd: a must have shape [H] = [4], got [5]",
    );
}

#[test]
fn heads_not_divisible_by_groups_is_named() {
    let spec = Spec::new(20, 6, 4, 16);
    let pb = Problem::new(
        &Spec {
            ngroups: 2,
            ..spec.clone()
        },
        &mut Rng::new(2),
        &Device::Cpu,
    )
    .expect("problem");
    let b4 = Tensor::zeros((2, 20, 4, 16), DType::F32, &Device::Cpu).expect("zeros");
    expect_err(
        k::ssd(&pb.x, &pb.dt, &pb.a, &b4, &b4, &pb.options()),
        "ssd: nheads (6) is not divisible by ngroups (4)",
    );
}

#[test]
fn wrong_dtypes_are_named() {
    let pb = problem();
    let a16 = pb.a.to_dtype(DType::BF16).expect("cast");
    expect_err(
        k::ssd(&pb.x, &pb.dt, &a16, &pb.b, &pb.c, &pb.options()),
        "ssd: a must be F32, got BF16",
    );
    let xi = pb.x.to_dtype(DType::U32).expect("cast");
    expect_err(
        k::ssd(&xi, &pb.dt, &pb.a, &pb.b, &pb.c, &pb.options()),
        "ssd: x must be f32, f16 or bf16, got U32",
    );
    let b16 = pb.b.to_dtype(DType::BF16).expect("cast");
    expect_err(
        k::ssd(&pb.x, &pb.dt, &pb.a, &b16, &pb.c, &pb.options()),
        "ssd: b must have the dtype of x (F32), got BF16",
    );
    let opts = SsdOptions {
        state_dtype: DType::F16,
        ..pb.options()
    };
    expect_err(
        k::ssd(&pb.x, &pb.dt, &pb.a, &pb.b, &pb.c, &opts),
        "ssd: state_dtype must be f32 or bf16, got F16",
    );
    let bias16 = pb.a.to_dtype(DType::F16).expect("cast");
    let mut opts = pb.options();
    opts.dt.bias = Some(&bias16);
    expect_err(
        k::ssd(&pb.x, &pb.dt, &pb.a, &pb.b, &pb.c, &opts),
        "ssd: dt_bias must be F32, got F16",
    );
}

#[test]
fn bad_chunk_size_is_named() {
    let pb = problem();
    for chunk in [0, 8, 48, 100] {
        let opts = SsdOptions {
            chunk_size: chunk,
            ..pb.options()
        };
        expect_err(
            k::ssd(&pb.x, &pb.dt, &pb.a, &pb.b, &pb.c, &opts),
            &format!("ssd: chunk_size must be a power of two from 16 to 2048, got {chunk}"),
        );
    }
    expect_err(
        k::chunk_cumsum(&pb.dt, &pb.a, &pb.dt_options(), 0),
        "chunk_cumsum: chunk_size must be a power of two from 16 to 2048, got 0",
    );
}

#[test]
fn bad_dt_limit_is_named() {
    let pb = problem();
    let mut opts = pb.options();
    opts.dt.limit = (1.0, 0.5);
    expect_err(
        k::ssd(&pb.x, &pb.dt, &pb.a, &pb.b, &pb.c, &opts),
        "ssd: dt_limit must be (lo, hi) with 0 <= lo <= hi, lo finite, got (1, 0.5)",
    );
}

#[test]
fn stage_inputs_are_checked() {
    let pb = problem();
    let (dt_out, da) = k::chunk_cumsum(&pb.dt, &pb.a, &pb.dt_options(), 16).expect("stage 1");
    expect_err(
        k::fwd_pass_state(
            &pb.x,
            &pb.b,
            &da.i((.., .., 0..19)).expect("slice"),
            &da,
            None,
            16,
            DType::F32,
        ),
        "fwd_pass_state: dt_out must have shape [B, H, L] = [2, 4, 20], got [2, 4, 19]",
    );
    let states =
        k::fwd_pass_state(&pb.x, &pb.b, &dt_out, &da, None, 16, DType::F32).expect("stage 2");
    expect_err(k::compute_out(&pb.x, &pb.b, &pb.c, &dt_out, &da, &states, None, None, 32), "compute_out: states must have shape [B, H, C+1, P, N] = [2, 4, 2, 8, 16], got [2, 4, 3, 8, 16]");
    let da16 = da.to_dtype(DType::BF16).expect("cast");
    expect_err(
        k::compute_out(&pb.x, &pb.b, &pb.c, &dt_out, &da16, &states, None, None, 16),
        "compute_out: da_cumsum must be F32, got BF16",
    );
}

#[test]
fn ssd_step_inputs_are_checked() {
    let pb = problem();
    let state = Tensor::zeros((2, 4, 8, 16), DType::F32, &Device::Cpu).expect("zeros");
    let (x, dt, b, c) = (
        pb.x.i((.., 0)).expect("x"),
        pb.dt.i((.., 0)).expect("dt"),
        pb.b.i((.., 0)).expect("b"),
        pb.c.i((.., 0)).expect("c"),
    );
    let opts = StepOptions::default();
    let bad_state = Tensor::zeros((2, 4, 8, 15), DType::F32, &Device::Cpu).expect("zeros");
    expect_err(
        k::ssd_step(&bad_state, &x, &dt, &pb.a, &b, &c, &opts),
        "ssd_step: state must have shape [B, H, P, N] = [2, 4, 8, 16], got [2, 4, 8, 15]",
    );
    let f16_state = state.to_dtype(DType::F16).expect("cast");
    expect_err(
        k::ssd_step(&f16_state, &x, &dt, &pb.a, &b, &c, &opts),
        "ssd_step: state must be f32 or bf16, got F16",
    );
    let strided = Tensor::zeros((2, 4, 16, 8), DType::F32, &Device::Cpu)
        .expect("zeros")
        .transpose(2, 3)
        .expect("t");
    expect_err(
        k::ssd_step(&strided, &x, &dt, &pb.a, &b, &c, &opts),
        "ssd_step: state must be contiguous to be updated in place",
    );
    expect_err(
        k::ssd_step(&state, &pb.x, &dt, &pb.a, &b, &c, &opts),
        "ssd_step: x must have rank 3 [B, H, P], got shape [2, 20, 4, 8]",
    );
    expect_err(
        k::ssd_step(&state, &x, &pb.dt, &pb.a, &b, &c, &opts),
        "ssd_step: dt must have shape [B, H] = [2, 4], got [2, 20, 4]",
    );
    let c1 = c.i((.., 0..1)).expect("slice");
    expect_err(
        k::ssd_step(&state, &x, &dt, &pb.a, &b, &c1, &opts),
        "ssd_step: c must have shape [B, G, N] = [2, 2, 16], got [2, 1, 16]",
    );
    let b3 = Tensor::zeros((2, 3, 16), DType::F32, &Device::Cpu).expect("zeros");
    expect_err(
        k::ssd_step(&state, &x, &dt, &pb.a, &b3, &b3, &opts),
        "ssd_step: nheads (4) is not divisible by ngroups (3)",
    );
    let a64 = pb.a.to_dtype(DType::F64).expect("cast");
    expect_err(
        k::ssd_step(&state, &x, &dt, &a64, &b, &c, &opts),
        "ssd_step: a must be F32, got F64",
    );
}

#[cfg(feature = "cuda")]
#[test]
fn inputs_on_different_devices_are_named() {
    let pb = problem();
    let gpu = Device::new_cuda(0).expect("a CUDA device");
    let b_gpu = pb.b.to_device(&gpu).expect("copy");
    expect_err(
        k::ssd(&pb.x, &pb.dt, &pb.a, &b_gpu, &pb.c, &pb.options()),
        "ssd: b is on Cuda",
    );
    let a_gpu = pb.a.to_device(&gpu).expect("copy");
    expect_err(
        k::ssd(&pb.x, &pb.dt, &a_gpu, &pb.b, &pb.c, &pb.options()),
        "ssd: a is on Cuda",
    );
}
