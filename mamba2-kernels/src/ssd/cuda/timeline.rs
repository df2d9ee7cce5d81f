//! Per-kernel timelines of one `ssd` call on the GPU (the `timeline` feature): the kernels, built
//! with their marks, store the global timer per block and mark (`m2::mark` in
//! `kernels/common.cuh`); [`ssd_timeline_reset`] clears those records before a call and
//! [`ssd_timeline`] reads them after it: when the first and the last block passed each mark, in
//! µs from the first block of the state pass. Shows what ncu cannot: how the state pass, the scan
//! and compute_out overlap inside a call, where the gaps between them are and which programs end
//! last.

use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::{CudaStream, CudaViewMut};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, Device, Result};

use super::{compute_out, fwd_pass_state};
use crate::cuda::{loaded_module, Image};

/// The marks of each module by index (`kernels/ssd/fwd_pass_state.cu`,
/// `kernels/ssd/compute_out.cu`).
const MARKS: [(Image, &[&str]); 2] = [
    (
        fwd_pass_state::IMAGE,
        &[
            "chunk_state entry",
            "chunk_state stage 1 done",
            "chunk_state tiles landed",
            "chunk_state MMAs done",
            "chunk_state exit",
            "state_scan entry",
            "state_scan waited",
            "state_scan exit",
        ],
    ),
    (
        compute_out::IMAGE,
        &[
            "compute_out entry",
            "compute_out step 0 done",
            "compute_out waited",
            "compute_out exit",
        ],
    ),
];

/// When the blocks of a call passed one mark: the first and the last of them, in µs from the
/// first block of chunk_state.
#[derive(Debug, Clone, Copy)]
pub struct TimelineMark {
    pub name: &'static str,
    pub first: f64,
    pub last: f64,
}

/// Blocks and marks per block recorded (`m2::TIMELINE_BLOCKS`, `m2::TIMELINE_MARKS`).
const BLOCKS: usize = 32768;
const PER_BLOCK: usize = 8;

/// Calls `f` with each module's timeline records on `dev`'s stream.
fn slots(
    dev: &Device,
    mut f: impl FnMut(&mut CudaViewMut<u64>, &Arc<CudaStream>) -> Result<()>,
) -> Result<()> {
    let dev = dev.as_cuda_device()?;
    let stream = dev.cuda_stream();
    for (image, _) in MARKS {
        let Some(module) = loaded_module(&stream, image)? else {
            bail!(
                "ssd_timeline: the {} kernels have not run on this device yet",
                image.0
            )
        };
        let mut global = module.get_global("m2_timeline", &stream).w()?;
        // SAFETY: `m2_timeline` is `unsigned long long[BLOCKS · PER_BLOCK]` in every module built
        // with the marks.
        let Some(mut view) = (unsafe { global.transmute_mut::<u64>(BLOCKS * PER_BLOCK) }) else {
            bail!(
                "ssd_timeline: the {} kernels were built without the timeline marks",
                image.0
            )
        };
        f(&mut view, &stream)?;
    }
    Ok(())
}

/// Clears the records before a call.
pub fn ssd_timeline_reset(dev: &Device) -> Result<()> {
    slots(dev, |view, stream| stream.memset_zeros(view).w())
}

/// The marks of the calls since the last reset (the caller synchronises first); marks no block
/// passed are left out.
pub fn ssd_timeline(dev: &Device) -> Result<Vec<TimelineMark>> {
    let mut raw = Vec::new();
    slots(dev, |view, stream| {
        raw.push(stream.clone_dtoh(&*view).w()?);
        Ok(())
    })?;
    // The earliest and latest record of mark i of a module (0: not passed).
    let span = |v: &[u64], i: usize| {
        v.chunks_exact(PER_BLOCK)
            .map(|b| b[i])
            .filter(|&t| t != 0)
            .fold(None, |acc: Option<(u64, u64)>, t| {
                Some(acc.map_or((t, t), |(lo, hi)| (lo.min(t), hi.max(t))))
            })
    };
    let Some((t0, _)) = raw.first().and_then(|v| span(v, 0)) else {
        bail!("ssd_timeline: no chunk_state block ran since the reset")
    };
    let mut marks = Vec::new();
    for ((_, names), v) in MARKS.iter().zip(&raw) {
        for (i, name) in names.iter().enumerate() {
            if let Some((first, last)) = span(v, i) {
                marks.push(TimelineMark {
                    name,
                    first: (first as f64 - t0 as f64) / 1e3,
                    last: (last as f64 - t0 as f64) / 1e3,
                });
            }
        }
    }
    Ok(marks)
}
