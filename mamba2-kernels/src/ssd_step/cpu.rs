//! The decode step on the CPU: every (batch, head) in parallel, its state rows updated in place
//! in the compute type (states of another type are read and rounded back per element).

use rayon::prelude::*;

use crate::check::SsdDims;
use crate::cpu::Real;
use crate::dt::{self, DtRule};

/// One step's inputs as f32 slices: `x [B,H,P]`, raw `dt [B,H]`, `a`, `bias [H]`, `b, c [B,G,N]`,
/// `z [B,H,P]`, `d [H]` or `[H,P]`.
pub(super) struct Step<'a, T> {
    pub x: &'a [T],
    pub dt: &'a [T],
    pub a: &'a [T],
    pub bias: &'a [T],
    pub b: &'a [T],
    pub c: &'a [T],
    pub z: Option<&'a [T]>,
    pub d: Option<&'a [T]>,
    pub rule: DtRule,
    pub dims: SsdDims,
}

impl<T: Real> Step<'_, T> {
    /// Updates the state of (batch, head) `bh` in place and writes its output row `yh [P]`.
    fn head<S: Copy>(
        &self,
        bh: usize,
        st: &mut [S],
        yh: &mut [T],
        load: impl Fn(S) -> T,
        store: impl Fn(T) -> S,
    ) {
        let SsdDims {
            nheads,
            headdim,
            ngroups,
            dstate,
            ..
        } = self.dims;
        let (bi, h) = (bh / nheads, bh % nheads);
        let g = h / self.dims.heads_per_group();
        let dtv = dt::process(self.dt[bh], self.bias[h], self.rule);
        let decay = (self.a[h] * dtv).exp();
        let bn = &self.b[(bi * ngroups + g) * dstate..][..dstate];
        let cn = &self.c[(bi * ngroups + g) * dstate..][..dstate];
        for (p, (yv, row)) in yh.iter_mut().zip(st.chunks_exact_mut(dstate)).enumerate() {
            let xv = self.x[bh * headdim + p];
            let mut acc = T::zero();
            for ((s, &bv), &cv) in row.iter_mut().zip(bn).zip(cn) {
                let v = load(*s) * decay + dtv * xv * bv;
                *s = store(v);
                acc += v * cv;
            }
            if let Some(d) = self.d {
                acc += xv
                    * if d.len() == nheads {
                        d[h]
                    } else {
                        d[h * headdim + p]
                    };
            }
            if let Some(z) = self.z {
                let zv = z[bh * headdim + p];
                acc *= zv / (T::one() + (-zv).exp());
            }
            *yv = acc;
        }
    }

    /// Advances the states `[B,H,P,N]` (f32 here, or bf16 through `load`/`store`) in place and
    /// returns `y [B,H,P]`.
    pub fn run<S: Copy + Send>(
        &self,
        states: &mut [S],
        load: impl Fn(S) -> T + Sync,
        store: impl Fn(T) -> S + Sync,
    ) -> Vec<T> {
        let (pn, headdim) = (self.dims.headdim * self.dims.dstate, self.dims.headdim);
        let mut y = vec![T::zero(); self.x.len()];
        states
            .par_chunks_mut(pn)
            .zip(y.par_chunks_mut(headdim))
            .enumerate()
            .for_each(|(bh, (st, yh))| self.head(bh, st, yh, &load, &store));
        y
    }
}
