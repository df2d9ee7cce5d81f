//! Shared test helpers: a seeded generator of SSD problems and the error measure.
#![allow(dead_code)]

use candle_core::{DType, Device, IndexOp, Result, Tensor};
use mamba2::kernels::{ssd_step, DtOptions, SsdOptions, StepOptions};

pub mod fixture;
pub mod grad;
pub mod hostile;

/// SplitMix64: a small seeded generator, so every failure can be replayed.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    pub fn range(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * self.uniform()
    }

    pub fn normal(&mut self) -> f32 {
        let u1 = self.uniform().max(1e-7);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f32::consts::PI * u2).cos()
    }

    pub fn tensor(&mut self, shape: &[usize], scale: f32, dev: &Device) -> Result<Tensor> {
        let n = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| self.normal() * scale).collect();
        Tensor::from_vec(v, shape, dev)
    }

    pub fn tensor_in(&mut self, shape: &[usize], lo: f32, hi: f32, dev: &Device) -> Result<Tensor> {
        let n = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| self.range(lo, hi)).collect();
        Tensor::from_vec(v, shape, dev)
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// The shape of an SSD problem and which optional inputs it has.
#[derive(Clone, Debug)]
pub struct Spec {
    pub batch: usize,
    pub seqlen: usize,
    pub nheads: usize,
    pub headdim: usize,
    pub ngroups: usize,
    pub dstate: usize,
    pub chunk: usize,
    pub init_state: bool,
    /// 0: no D, 1: D per head, 2: D per channel.
    pub d: u8,
    pub z: bool,
    pub dt_bias: bool,
    pub dt_softplus: bool,
    pub dt_limit: Option<(f32, f32)>,
    pub dtype: DType,
    pub state_dtype: DType,
    /// Draw a·dt from a fast-decay range instead of Mamba-2's initialisation ranges.
    pub fast_decay: bool,
}

impl Spec {
    pub fn new(seqlen: usize, nheads: usize, ngroups: usize, chunk: usize) -> Self {
        Self {
            batch: 2,
            seqlen,
            nheads,
            headdim: 8,
            ngroups,
            dstate: 16,
            chunk,
            init_state: false,
            d: 0,
            z: false,
            dt_bias: false,
            dt_softplus: true,
            dt_limit: None,
            dtype: DType::F32,
            state_dtype: DType::F32,
            fast_decay: false,
        }
    }
}

/// Random inputs for a [`Spec`]; values are already rounded to `spec.dtype`.
pub struct Problem {
    pub spec: Spec,
    pub x: Tensor,
    pub dt: Tensor,
    pub a: Tensor,
    pub b: Tensor,
    pub c: Tensor,
    pub dt_bias: Option<Tensor>,
    pub d: Option<Tensor>,
    pub z: Option<Tensor>,
    pub init: Option<Tensor>,
}

impl Problem {
    pub fn new(spec: &Spec, rng: &mut Rng, dev: &Device) -> Result<Self> {
        let s = spec;
        let (bl, h, p, g, n) = (
            [s.batch, s.seqlen],
            s.nheads,
            s.headdim,
            s.ngroups,
            s.dstate,
        );
        let v = |t: Tensor| t.to_dtype(s.dtype);
        let x = v(rng.tensor(&[bl[0], bl[1], h, p], 1.0, dev)?)?;
        // Mamba-2's initialisation: a = −U(1, 16), dt = softplus(raw + bias) with the bias placing
        // dt log-uniformly in [0.001, 0.1]; raw varies around 0. Fast decay: a·dt ≈ −10 per token.
        let (a, dt_offset, noise) = if s.fast_decay {
            let a = rng.tensor_in(&[h], -4.0, 2.0, dev)?.exp()?.neg()?;
            (a, rng.tensor_in(&[h], -2.0, 0.0, dev)?, 1.0)
        } else {
            let a = rng.tensor_in(&[h], -16.0, -1.0, dev)?;
            let dt0 = rng
                .tensor_in(&[h], 0.001f32.ln(), 0.1f32.ln(), dev)?
                .exp()?;
            let inv_softplus = dt0.exp()?.affine(1.0, -1.0)?.log()?;
            (a, inv_softplus, 0.5)
        };
        let raw = rng.tensor(&[bl[0], bl[1], h], noise, dev)?;
        let (dt, dt_bias) = if s.dt_bias {
            (raw, Some(dt_offset))
        } else {
            (raw.broadcast_add(&dt_offset)?, None)
        };
        let dt = v(dt)?;
        let bn = 1.0 / (n as f32).sqrt();
        let b = v(rng.tensor(&[bl[0], bl[1], g, n], bn, dev)?)?;
        let c = v(rng.tensor(&[bl[0], bl[1], g, n], bn, dev)?)?;
        let d = match s.d {
            0 => None,
            1 => Some(rng.tensor(&[h], 1.0, dev)?),
            _ => Some(rng.tensor(&[h, p], 1.0, dev)?),
        };
        let z =
            s.z.then(|| rng.tensor(&[bl[0], bl[1], h, p], 1.0, dev))
                .transpose()?
                .map(v)
                .transpose()?;
        let init = s
            .init_state
            .then(|| rng.tensor(&[bl[0], h, p, n], 1.0, dev))
            .transpose()?
            .map(|t| t.to_dtype(s.state_dtype))
            .transpose()?;
        Ok(Self {
            spec: spec.clone(),
            x,
            dt,
            a,
            b,
            c,
            dt_bias,
            d,
            z,
            init,
        })
    }

    /// The same problem with every tensor moved to `dev`.
    pub fn to_device(&self, dev: &Device) -> Result<Self> {
        let mv = |t: &Tensor| t.to_device(dev);
        let opt = |t: &Option<Tensor>| t.as_ref().map(mv).transpose();
        Ok(Self {
            spec: self.spec.clone(),
            x: mv(&self.x)?,
            dt: mv(&self.dt)?,
            a: mv(&self.a)?,
            b: mv(&self.b)?,
            c: mv(&self.c)?,
            dt_bias: opt(&self.dt_bias)?,
            d: opt(&self.d)?,
            z: opt(&self.z)?,
            init: opt(&self.init)?,
        })
    }

    pub fn dt_options(&self) -> DtOptions<'_> {
        DtOptions {
            bias: self.dt_bias.as_ref(),
            softplus: self.spec.dt_softplus,
            limit: self.spec.dt_limit.unwrap_or((0.0, f32::INFINITY)),
        }
    }

    pub fn options(&self) -> SsdOptions<'_> {
        SsdOptions {
            chunk_size: self.spec.chunk,
            dt: self.dt_options(),
            d: self.d.as_ref(),
            z: self.z.as_ref(),
            initial_state: self.init.as_ref(),
            state_dtype: self.spec.state_dtype,
        }
    }

    pub fn step_options(&self) -> StepOptions<'_> {
        StepOptions {
            dt: self.dt_options(),
            d: self.d.as_ref(),
            z: None,
        }
    }

    /// `ssd_step` on token `t` of the problem (its gate too, when it has one): updates `state` in
    /// place and returns y `[B,H,P]`.
    pub fn step(&self, state: &Tensor, t: usize) -> Result<Tensor> {
        let z = self.z.as_ref().map(|z| z.i((.., t))).transpose()?;
        let opts = StepOptions {
            z: z.as_ref(),
            ..self.step_options()
        };
        ssd_step(
            state,
            &self.x.i((.., t))?,
            &self.dt.i((.., t))?,
            &self.a,
            &self.b.i((.., t))?,
            &self.c.i((.., t))?,
            &opts,
        )
    }
}

/// Asserts that `r` is an error whose message contains `needle`.
pub fn expect_err<T: std::fmt::Debug>(r: Result<T>, needle: &str) {
    match r {
        Ok(v) => panic!("expected an error containing {needle:?}, got Ok({v:?})"),
        Err(e) => {
            let msg = e.to_string();
            assert!(
                msg.contains(needle),
                "error {msg:?} does not contain {needle:?}"
            );
        }
    }
}

/// max |got − want| / max |want|, in f64; infinite when got has a NaN or inf.
pub fn rel_err(got: &Tensor, want: &Tensor) -> Result<f64> {
    assert_eq!(got.dims(), want.dims(), "shapes differ");
    let g = got.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    let w = want.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    if g.iter().any(|v| !v.is_finite()) {
        return Ok(f64::INFINITY);
    }
    let scale = w.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
    let diff = g
        .iter()
        .zip(&w)
        .fold(0f64, |m, (a, b)| m.max((a - b).abs()));
    Ok(diff / scale)
}

/// The tolerance of the issue for a value dtype: 1e-5 for f32, 1e-2 for f16 and bf16.
pub fn tolerance(dtype: DType) -> f64 {
    if dtype == DType::F32 {
        1e-5
    } else {
        1e-2
    }
}
