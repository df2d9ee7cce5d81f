//! Property test: `ssd` agrees with the f64 recurrence on random shapes, options and dtypes.

mod common;

use candle_core::{DType, Device};
use common::{rel_err, tolerance, Problem, Rng, Spec};
use mamba2::kernels::{self as k, reference};
use proptest::prelude::*;

fn spec_strategy() -> impl Strategy<Value = (Spec, u64)> {
    let shape = (
        1usize..=3,
        1usize..=100,
        0usize..6,
        1usize..=20,
        1usize..=40,
        0usize..3,
    );
    let options = (
        any::<bool>(),
        0u8..3,
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        0usize..3,
        any::<bool>(),
    );
    (shape, options, any::<bool>(), any::<u64>()).prop_map(
        |((batch, seqlen, heads_ix, headdim, dstate, chunk_ix), opts, fast_decay, seed)| {
            let (nheads, ngroups) = [(1, 1), (2, 1), (4, 2), (6, 3), (8, 4), (8, 2)][heads_ix];
            let (init_state, d, z, dt_bias, limit, dtype_ix, bf16_state) = opts;
            let mut spec = Spec::new(seqlen, nheads, ngroups, [16, 32, 64][chunk_ix]);
            spec.batch = batch;
            spec.headdim = headdim;
            spec.dstate = dstate;
            spec.init_state = init_state;
            spec.d = d;
            spec.z = z;
            spec.dt_bias = dt_bias;
            spec.dt_limit = limit.then_some((0.002, 0.2));
            spec.dtype = [DType::F32, DType::BF16, DType::F16][dtype_ix];
            spec.state_dtype = if bf16_state { DType::BF16 } else { DType::F32 };
            spec.fast_decay = fast_decay;
            (spec, seed)
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn ssd_matches_recurrence((spec, seed) in spec_strategy()) {
        let pb = Problem::new(&spec, &mut Rng::new(seed), &Device::Cpu).expect("problem");
        let opts = pb.options();
        let want = reference::ssd(&pb.x, &pb.dt, &pb.a, &pb.b, &pb.c, &opts).expect("reference");
        let (y, state) = k::ssd(&pb.x, &pb.dt, &pb.a, &pb.b, &pb.c, &opts).expect("ssd");
        let floor = if spec.fast_decay { 1e-4 } else { 0.0 };
        let tol = tolerance(spec.dtype).max(tolerance(spec.state_dtype)).max(floor);
        let ey = rel_err(&y, &want.y).expect("err");
        let es = rel_err(&state, &want.final_state).expect("err");
        prop_assert!(ey <= tol, "y rel err {:e} > {:e}", ey, tol);
        prop_assert!(es <= tol, "state rel err {:e} > {:e}", es, tol);
    }
}
