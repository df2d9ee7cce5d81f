//! The gradients of `ssd` (through candle's autograd) against central finite differences of the
//! forward in f64: every input — x, dt (through dt_bias, softplus and the dt_limit clamp),
//! A_log (through a = −exp(A_log)), B, C, D, z and the initial state — from a loss that reads
//! both outputs (y and the final state), on lengths that are not multiples of the chunk, with
//! groups; a property test over random shapes and options; f32 gradients against f64 ones.

mod common;

use candle_core::{DType, Device, Result, Tensor, Var};
use common::Rng;
use mamba2::kernels::{ssd, DtOptions, SsdOptions};
use proptest::prelude::*;
use proptest::test_runner::RngSeed;

/// The shape and options of one gradient check.
#[derive(Clone, Debug)]
struct Case {
    batch: usize,
    seqlen: usize,
    nheads: usize,
    headdim: usize,
    ngroups: usize,
    dstate: usize,
    chunk: usize,
    /// 0: no D, 1: per head, 2: per channel.
    d: u8,
    z: bool,
    init: bool,
    bias: bool,
    softplus: bool,
    limit: (f32, f32),
}

/// Every input of a case as a leaf.
struct Inputs {
    x: Var,
    dt: Var,
    a_log: Var,
    b: Var,
    c: Var,
    d: Option<Var>,
    z: Option<Var>,
    init: Option<Var>,
    bias: Option<Var>,
    /// Fixed weights of y and of the final state in the loss.
    wy: Tensor,
    ws: Tensor,
}

impl Inputs {
    fn new(k: &Case, rng: &mut Rng, dtype: DType) -> Result<Self> {
        let dev = &Device::Cpu;
        let (bl, h, p, g, n) = (
            [k.batch, k.seqlen],
            k.nheads,
            k.headdim,
            k.ngroups,
            k.dstate,
        );
        let var = |t: Tensor| Var::from_tensor(&t.to_dtype(dtype)?);
        let d_shape = if k.d == 1 { vec![h] } else { vec![h, p] };
        let opt = |on: bool, t: Result<Tensor>| {
            if on {
                t.and_then(var).map(Some)
            } else {
                Ok(None)
            }
        };
        Ok(Self {
            x: var(rng.tensor(&[bl[0], bl[1], h, p], 1.0, dev)?)?,
            dt: var(rng.tensor_in(&[bl[0], bl[1], h], -1.5, 0.5, dev)?)?,
            a_log: var(rng.tensor_in(&[h], -0.5, 1.5, dev)?)?,
            b: var(rng.tensor(&[bl[0], bl[1], g, n], 1.0, dev)?)?,
            c: var(rng.tensor(&[bl[0], bl[1], g, n], 1.0, dev)?)?,
            d: opt(k.d > 0, rng.tensor(&d_shape, 1.0, dev))?,
            z: opt(k.z, rng.tensor(&[bl[0], bl[1], h, p], 1.0, dev))?,
            init: opt(k.init, rng.tensor(&[bl[0], h, p, n], 0.5, dev))?,
            bias: opt(k.bias, rng.tensor_in(&[h], -0.5, 0.5, dev))?,
            wy: rng
                .tensor(&[bl[0], bl[1], h, p], 1.0, dev)?
                .to_dtype(dtype)?,
            ws: rng.tensor(&[bl[0], h, p, n], 1.0, dev)?.to_dtype(dtype)?,
        })
    }

    /// The leaves in a fixed order, with names.
    fn leaves(&self) -> Vec<(&'static str, &Var)> {
        let mut v = vec![
            ("x", &self.x),
            ("dt", &self.dt),
            ("A_log", &self.a_log),
            ("B", &self.b),
            ("C", &self.c),
        ];
        let optional = [
            ("D", &self.d),
            ("z", &self.z),
            ("init", &self.init),
            ("dt_bias", &self.bias),
        ];
        v.extend(
            optional
                .into_iter()
                .filter_map(|(n, t)| t.as_ref().map(|t| (n, t))),
        );
        v
    }
}

/// `(y, final state)` of the case on the given leaf values.
fn outputs(k: &Case, inp: &Inputs, values: &[Tensor]) -> Result<(Tensor, Tensor)> {
    let names: Vec<&str> = inp.leaves().into_iter().map(|(n, _)| n).collect();
    let get = |name: &str| names.iter().position(|n| *n == name).map(|i| &values[i]);
    let a = get("A_log").expect("A_log").exp()?.neg()?;
    let opts = SsdOptions {
        chunk_size: k.chunk,
        dt: DtOptions {
            bias: get("dt_bias"),
            softplus: k.softplus,
            limit: k.limit,
        },
        d: get("D"),
        z: get("z"),
        initial_state: get("init"),
        state_dtype: values[0].dtype(),
    };
    let (x, dt, b, c) = (
        get("x").expect("x"),
        get("dt").expect("dt"),
        get("B").expect("B"),
        get("C").expect("C"),
    );
    ssd(x, dt, &a, b, c, &opts)
}

/// The loss Σ y·wy + Σ final·ws of the case on the given leaf values.
fn loss(k: &Case, inp: &Inputs, values: &[Tensor]) -> Result<Tensor> {
    let (y, last) = outputs(k, inp, values)?;
    (y * &inp.wy)?.sum_all()? + (last * &inp.ws)?.sum_all()?
}

/// Autograd's gradient of every leaf, and the finite-difference one of `probe(leaf)` elements
/// (all when `None`); returns the worst relative error max|g − fd| / max|fd| over the leaves.
fn check(k: &Case, seed: u64, probe: Option<usize>) -> Result<f64> {
    let mut rng = Rng::new(seed);
    let inp = Inputs::new(k, &mut rng, DType::F64)?;
    let leaves: Vec<Tensor> = inp
        .leaves()
        .iter()
        .map(|(_, v)| v.as_tensor().clone())
        .collect();
    let grads = loss(k, &inp, &leaves)?.backward()?;
    let plain: Vec<Tensor> = leaves.iter().map(|t| t.detach()).collect();
    let mut worst = 0f64;
    for (i, (name, var)) in inp.leaves().into_iter().enumerate() {
        let g = grads
            .get(var.as_tensor())
            .unwrap_or_else(|| panic!("no gradient for {name}"))
            .flatten_all()?
            .to_vec1::<f64>()?;
        let base = plain[i].flatten_all()?.to_vec1::<f64>()?;
        let picks: Vec<usize> = match probe {
            None => (0..base.len()).collect(),
            Some(m) => (0..m.min(base.len()))
                .map(|_| rng.below(base.len()))
                .collect(),
        };
        let (mut err, mut scale) = (0f64, 0f64);
        for j in picks {
            let h = 1e-6 * base[j].abs().max(1.0);
            let at = |delta: f64| -> Result<f64> {
                let mut v = base.clone();
                v[j] += delta;
                let mut vals = plain.clone();
                vals[i] = Tensor::from_vec(v, plain[i].shape(), &Device::Cpu)?;
                loss(k, &inp, &vals)?.to_scalar::<f64>()
            };
            let fd = (at(h)? - at(-h)?) / (2.0 * h);
            err = err.max((g[j] - fd).abs());
            scale = scale.max(fd.abs());
        }
        let rel = err / scale.max(1e-12);
        assert!(
            rel <= 1e-6,
            "{name}: gradient rel err {rel:e} for {k:?} seed {seed}"
        );
        worst = worst.max(rel);
    }
    Ok(worst)
}

fn case() -> Case {
    Case {
        batch: 2,
        seqlen: 21,
        nheads: 4,
        headdim: 3,
        ngroups: 2,
        dstate: 5,
        chunk: 16,
        d: 1,
        z: true,
        init: true,
        bias: true,
        softplus: true,
        limit: (0.05, 0.4),
    }
}

#[test]
fn every_gradient_matches_finite_differences() -> Result<()> {
    let worst = check(&case(), 1, None)?;
    println!("ssd gradients vs finite differences: worst rel err {worst:e}");
    Ok(())
}

#[test]
fn per_channel_d_several_chunks_and_no_options() -> Result<()> {
    let mut k = case();
    k.d = 2;
    k.seqlen = 40;
    k.limit = (0.0, f32::INFINITY);
    check(&k, 2, None)?;
    let bare = Case {
        d: 0,
        z: false,
        init: false,
        bias: false,
        softplus: false,
        ngroups: 1,
        ..case()
    };
    check(&bare, 3, None)?;
    Ok(())
}

/// f32 gradients (the f32 forward and backward) agree with the f64 ones.
#[test]
fn f32_gradients_agree_with_f64() -> Result<()> {
    let k = case();
    let mut grads = Vec::new();
    for dtype in [DType::F64, DType::F32] {
        let inp = Inputs::new(&k, &mut Rng::new(4), dtype)?;
        let leaves: Vec<Tensor> = inp
            .leaves()
            .iter()
            .map(|(_, v)| v.as_tensor().clone())
            .collect();
        let store = loss(&k, &inp, &leaves)?.backward()?;
        let g = inp
            .leaves()
            .iter()
            .map(|(_, v)| {
                store
                    .get(v.as_tensor())
                    .expect("a gradient")
                    .to_dtype(DType::F64)
            })
            .collect::<Result<Vec<_>>>()?;
        grads.push(g);
    }
    for (g64, g32) in grads[0].iter().zip(&grads[1]) {
        let e = common::rel_err(g32, g64)?;
        assert!(e <= 1e-4, "f32 gradient rel err {e:e}");
    }
    Ok(())
}

/// Each output alone gets its own gradients (the loss reading only y, or only the final state),
/// and they add up to those of the loss on both; a broadcast gradient of y (Σ y, not contiguous)
/// gives the gradients of Σ y·1.
#[test]
fn each_output_alone_and_a_broadcast_gradient() -> Result<()> {
    let k = case();
    let inp = Inputs::new(&k, &mut Rng::new(9), DType::F64)?;
    let leaves: Vec<Tensor> = inp
        .leaves()
        .iter()
        .map(|(_, v)| v.as_tensor().clone())
        .collect();
    let names: Vec<&str> = inp.leaves().into_iter().map(|(n, _)| n).collect();
    let outputs = || outputs(&k, &inp, &leaves);
    let grads = |loss: Tensor| -> Result<Vec<Tensor>> {
        let store = loss.backward()?;
        inp.leaves()
            .iter()
            .map(|(_, v)| match store.get(v.as_tensor()) {
                Some(g) => Ok(g.clone()),
                None => v.as_tensor().zeros_like(),
            })
            .collect()
    };
    let (y, last) = outputs()?;
    let both = grads(((&y * &inp.wy)?.sum_all()? + (&last * &inp.ws)?.sum_all()?)?)?;
    let (y, _) = outputs()?;
    let of_y = grads((&y * &inp.wy)?.sum_all()?)?;
    let (_, last) = outputs()?;
    let of_last = grads((&last * &inp.ws)?.sum_all()?)?;
    for ((name, b), (gy, gl)) in names.iter().zip(&both).zip(of_y.iter().zip(&of_last)) {
        let e = common::rel_err(&(gy + gl)?, b)?;
        assert!(
            e <= 1e-12,
            "{name}: y's and the final state's gradients add up to within {e:e}"
        );
    }
    let (y, _) = outputs()?;
    let broadcast = grads(y.sum_all()?)?;
    let (y, _) = outputs()?;
    let ones = grads((&y * y.ones_like()?)?.sum_all()?)?;
    for ((name, g), want) in names.iter().zip(&broadcast).zip(&ones) {
        let e = common::rel_err(g, want)?;
        assert!(e <= 1e-12, "{name}: Σ y's gradient off by {e:e}");
    }
    Ok(())
}

proptest! {
    // Fixed draws. The check's difference quotient (h = 1e-6) resolves a gradient only to its
    // rounding, ≈ 1e-10 of the loss's scale, so a draw where one leaf's whole gradient is far
    // below that scale (seen: A_log at L = 1, B of small heads) fails on the reference, not on the
    // backward: random draws hit one in several hundred cases.
    #![proptest_config(ProptestConfig {
        cases: 24,
        rng_seed: RngSeed::Fixed(2026),
        ..ProptestConfig::default()
    })]

    #[test]
    fn random_shapes_and_options(
        batch in 1usize..3, seqlen in 1usize..50, nheads in 1usize..4, groups in 1usize..3,
        headdim in 1usize..5, dstate in 1usize..6, chunk_log in 4u32..6, d in 0u8..3,
        z: bool, init: bool, bias: bool, softplus: bool, clamp: bool, seed in 0u64..1000,
    ) {
        let k = Case {
            batch,
            seqlen,
            nheads: nheads * groups,
            headdim,
            ngroups: groups,
            dstate,
            chunk: 1 << chunk_log,
            d,
            z,
            init,
            bias,
            softplus,
            limit: if clamp { (0.05, 0.4) } else { (0.0, f32::INFINITY) },
        };
        check(&k, seed, Some(6)).map_err(|e| TestCaseError::fail(e.to_string()))?;
    }
}
