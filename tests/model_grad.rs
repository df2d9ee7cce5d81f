//! The whole model's training loss and the gradient of every parameter against PyTorch autograd
//! (each fixture's `gradients.safetensors`, written by `tools/hf_reference.py` in f64 on HF's
//! reference path), in f32 on the CPU: the loss within 1e-5 and every gradient within 1e-4
//! relative (max |ours − theirs| / max |theirs| per tensor).

mod common;

use std::collections::HashMap;

use candle_core::{DType, Device, Result, Tensor};
use common::fixture::{case_names, Case};
use common::rel_err;
use mamba2::model::TrainableModel;

/// The fixture's gradient key of a master weight (the state-spaces embedding name where the
/// fixture's weights use it).
fn fixture_key(name: &str, grads: &HashMap<String, Tensor>) -> String {
    let key = format!("grad.{name}");
    if !grads.contains_key(&key) && name == "backbone.embeddings.weight" {
        return "grad.backbone.embedding.weight".to_string();
    }
    key
}

#[test]
fn every_parameter_gradient_matches_pytorch() -> Result<()> {
    let mut worst = (0f64, String::new());
    for name in case_names() {
        let case = Case::load(&name)?;
        let file = case.dir.join("gradients.safetensors");
        let want = candle_core::safetensors::load(&file, &Device::Cpu)?;
        let trainable = TrainableModel::load(&case.dir, DType::F32, &Device::Cpu)?;
        let ids = case.input_ids()?;
        let loss = trainable.model()?.loss(&ids)?;
        let want_loss = want["loss"]
            .to_dtype(DType::F64)?
            .flatten_all()?
            .to_vec1::<f64>()?[0];
        let got_loss = f64::from(loss.to_scalar::<f32>()?);
        let e = (got_loss - want_loss).abs() / want_loss.abs();
        assert!(
            e <= 1e-5,
            "{name}: loss {got_loss} against {want_loss} (rel err {e:e})"
        );
        let grads = loss.backward()?;
        for (param, var) in trainable.vars() {
            let key = fixture_key(&param, &want);
            let Some(theirs) = want.get(&key) else {
                panic!("{name}: the fixture has no {key}")
            };
            let Some(ours) = grads.get(var.as_tensor()) else {
                panic!("{name}: no gradient for {param}")
            };
            let e = rel_err(ours, theirs)?;
            assert!(e <= 1e-4, "{name}: {param} gradient rel err {e:e}");
            if e > worst.0 {
                worst = (e, format!("{name} {param}"));
            }
        }
    }
    println!(
        "worst parameter gradient rel err {:e} ({})",
        worst.0, worst.1
    );
    Ok(())
}
