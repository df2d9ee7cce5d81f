//! Checks of gradients against central finite differences in f64, shared by the gradient tests:
//! `loss = Σ out·W` for fixed random weights W, every input a `Var`, each element stepped by
//! `h = 1e-6·max(1, |v|)` (for an input stored in a narrower type, the power of two at or below
//! it, so that `v ± h` is exact), `(L(v+h) − L(v−h)) / 2h` from the unrecorded forward. The error
//! of one input's gradient is `max |grad − fd| / max |fd|`.

use candle_core::{bail, DType, Device, Result, Tensor, Var};

use super::rel_err;

/// The largest relative error of a gradient against finite differences.
pub const FD_TOL: f64 = 1e-6;

pub fn f64s(t: &Tensor) -> Result<Vec<f64>> {
    t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()
}

/// The finite-difference step for a value `v` stored in `dtype`.
pub fn step(v: f64, dtype: DType) -> f64 {
    let h = 1e-6 * v.abs().max(1.0);
    if dtype == DType::F64 {
        h
    } else {
        2f64.powi(h.log2().floor() as i32)
    }
}

/// `d loss / d inputs[i]` by central differences, the inputs plain tensors (nothing recorded).
pub fn fd_grad(
    inputs: &[Tensor],
    i: usize,
    loss: &dyn Fn(&[Tensor]) -> Result<f64>,
) -> Result<Tensor> {
    let t = &inputs[i];
    let base = f64s(t)?;
    let mut grad = vec![0f64; base.len()];
    for (j, g) in grad.iter_mut().enumerate() {
        let h = step(base[j], t.dtype());
        let at = |v: f64| -> Result<f64> {
            let mut vals = base.clone();
            vals[j] = v;
            let mut ins = inputs.to_vec();
            ins[i] = Tensor::from_vec(vals, t.shape(), &Device::Cpu)?.to_dtype(t.dtype())?;
            loss(&ins)
        };
        *g = (at(base[j] + h)? - at(base[j] - h)?) / (2.0 * h);
    }
    Tensor::from_vec(grad, t.shape(), &Device::Cpu)
}

/// Every input made a `Var`, `loss(inputs)` differentiated by `backward`: returns the gradients.
pub fn backward_grads(
    inputs: &[Tensor],
    loss: &dyn Fn(&[Tensor]) -> Result<Tensor>,
) -> Result<Vec<Tensor>> {
    let vars = inputs
        .iter()
        .map(Var::from_tensor)
        .collect::<Result<Vec<_>>>()?;
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let grads = loss(&ts)?.backward()?;
    ts.iter()
        .enumerate()
        .map(|(i, t)| match grads.get(t) {
            Some(g) => Ok(g.clone()),
            None => bail!("no gradient for input {i}"),
        })
        .collect()
}

/// The gradient of every input against finite differences: returns the errors, in input order.
pub fn check_grads(
    name: &str,
    inputs: &[Tensor],
    loss: &dyn Fn(&[Tensor]) -> Result<Tensor>,
) -> Result<Vec<f64>> {
    let grads = backward_grads(inputs, loss)?;
    let plain = |ins: &[Tensor]| loss(ins)?.to_scalar::<f64>();
    let mut errs = Vec::new();
    for (i, (g, t)) in grads.iter().zip(inputs).enumerate() {
        assert_eq!(g.dims(), t.dims(), "{name}: gradient {i} shape");
        assert_eq!(g.dtype(), t.dtype(), "{name}: gradient {i} dtype");
        let e = rel_err(g, &fd_grad(inputs, i, &plain)?)?;
        assert!(e <= FD_TOL, "{name}: gradient {i} rel err {e:e}");
        errs.push(e);
    }
    let shown: Vec<String> = errs.iter().map(|e| format!("{e:.1e}")).collect();
    println!("{name}: fd rel errs {}", shown.join(", "));
    Ok(errs)
}

/// `Σ out·w` in f64.
pub fn weighted(out: &Tensor, w: &Tensor) -> Result<Tensor> {
    out.to_dtype(DType::F64)?.mul(w)?.sum_all()
}
