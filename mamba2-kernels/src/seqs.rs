//! An offset table of sequences packed along L of one row (`cu_seqlens`: sequence s on tokens
//! `cu[s]..cu[s+1]`; or the SSD's tables of chunks) as an op holds it: on the host, and on a CUDA
//! device also as u32 for the kernels.

use candle_core::{Device, Result, Tensor};

#[derive(Debug)]
pub(crate) struct Seqs {
    pub cu: Vec<usize>,
    /// The offsets on the device, CUDA only.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub device: Option<Tensor>,
}

impl Seqs {
    /// The increasing offsets `cu` (checked by the caller) for ops on `device`.
    pub fn new(cu: &[usize], device: &Device) -> Result<Self> {
        let on_device = if device.is_cuda() {
            let offsets = cu
                .iter()
                .map(|&v| {
                    u32::try_from(v)
                        .ok()
                        .filter(|&v| v <= i32::MAX as u32)
                        .ok_or_else(|| {
                            candle_core::Error::Msg(format!(
                                "cu_seqlens: offset {v} does not fit the kernels' 31-bit indices"
                            ))
                        })
                })
                .collect::<Result<Vec<u32>>>()?;
            Some(Tensor::new(offsets.as_slice(), device)?)
        } else {
            None
        };
        Ok(Self {
            cu: cu.to_vec(),
            device: on_device,
        })
    }

    /// How many spans the offsets bound (sequences, or chunks).
    pub fn count(&self) -> usize {
        self.cu.len() - 1
    }

    /// Span s, `cu[s]..cu[s+1]`.
    pub fn range(&self, s: usize) -> std::ops::Range<usize> {
        self.cu[s]..self.cu[s + 1]
    }
}
