//! A second output of a custom op: candle ops return one storage, so an op that produces two
//! (a new state, a new residual) or whose output is not its in-place destination leaves the other
//! storage here, and the caller wraps it in a tensor of the shape it knows.

use std::sync::Mutex;

use candle_core::op::BackpropOp;
use candle_core::{bail, Result, Shape, Storage, Tensor};

/// A value written by the op's forward and taken by the caller once it has run: a storage, or
/// what else a forward leaves for later (the SSD's kept chunk states).
#[derive(Debug)]
pub(crate) struct Slot<T = Storage>(Mutex<Option<T>>);

impl<T> Default for Slot<T> {
    fn default() -> Self {
        Self(Mutex::new(None))
    }
}

impl<T> Slot<T> {
    /// Stores `s`; an op calls this once per forward.
    pub fn put(&self, op: &str, s: T) -> Result<()> {
        match self.0.lock() {
            Ok(mut slot) => {
                *slot = Some(s);
                Ok(())
            }
            Err(_) => bail!("{op}: output slot poisoned"),
        }
    }

    /// The stored value (once), `None` when the op stored none.
    pub fn take_any(&self, op: &str) -> Result<Option<T>> {
        match self.0.lock().map(|mut slot| slot.take()) {
            Ok(s) => Ok(s),
            Err(_) => bail!("{op}: output slot poisoned"),
        }
    }
}

impl Slot {
    /// The stored storage itself (once), for an op whose output it becomes; an error when the op
    /// stored none.
    pub fn take_storage(&self, op: &str, name: &str) -> Result<Storage> {
        match self.take_any(op)? {
            Some(s) => Ok(s),
            None => bail!("{op}: the op produced no {name}"),
        }
    }

    /// The stored storage as a tensor of `shape`, or an error when the op stored none.
    pub fn take(&self, op: &str, name: &str, shape: impl Into<Shape>) -> Result<Tensor> {
        let s = self.take_storage(op, name)?;
        Ok(Tensor::from_storage(s, shape, BackpropOp::none(), false))
    }
}
