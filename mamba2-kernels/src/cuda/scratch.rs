//! Scratch memory for `ssd`'s intermediates on the GPU: stage 1's step sizes and the chunk
//! states live only from the state pass to compute_out, so each thread keeps one buffer per
//! (context, stream) for them instead of allocating per call: a stream-ordered allocation is host
//! time spent before the first kernel can start.
//!
//! Reuse is safe in stream order: the next call's kernels write the buffer only after every
//! kernel before them on the stream has finished (each of ours waits for its predecessor before
//! it writes). Buffers larger than [`KEPT_BYTES`] (calls long enough that an allocation is
//! noise, and whose memory a thread should not hold on to) and those needed while the stream is
//! being captured into a graph (the graph keeps memory of its own) are allocated for the call and
//! freed after it, in stream order, as any output is.

use std::cell::RefCell;
use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::sys::CUstreamCaptureStatus;
use candle_core::cuda_backend::cudarc::driver::{result, CudaStream};
use candle_core::cuda_backend::WrapErr;
use candle_core::Result;

use super::{poison, poisoning};

/// The largest buffer a thread keeps for a stream between calls: room for the intermediates of
/// a 2.7b-model layer at L = 2048 (22 MiB) and of L = 4096 at B=4, H=8, N=128 (18 MiB).
pub(crate) const KEPT_BYTES: usize = 64 << 20;

/// A buffer's (context, stream).
type Owner = (usize, usize);

/// Device memory of one stream's, used by that stream alone: a raw allocation, without the
/// read and write events cudarc keeps for a `CudaSlice` (none is needed in one stream's order,
/// and each would cost driver calls before the first kernel).
struct Buffer {
    ptr: u64,
    bytes: usize,
    stream: Arc<CudaStream>,
}

impl Buffer {
    fn new(stream: &Arc<CudaStream>, bytes: usize) -> Result<Self> {
        let ctx = stream.context();
        ctx.bind_to_thread().w()?;
        // SAFETY: a plain allocation of `bytes` on the stream's (bound) context.
        let ptr = unsafe {
            if ctx.has_async_alloc() {
                result::malloc_async(stream.cu_stream(), bytes)
            } else {
                result::malloc_sync(bytes)
            }
        }
        .w()?;
        Ok(Self {
            ptr,
            bytes,
            stream: stream.clone(),
        })
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        let ctx = self.stream.context();
        // Freed in stream order after the kernels that use it (synchronously where the device
        // has no stream-ordered allocator); errors cannot be reported from a drop.
        let _ = ctx.bind_to_thread();
        // SAFETY: `ptr` was allocated by `Buffer::new` on this context and is freed once.
        let _ = unsafe {
            if ctx.has_async_alloc() {
                result::free_async(self.ptr, self.stream.cu_stream())
            } else {
                self.stream
                    .synchronize()
                    .and_then(|_| result::free_sync(self.ptr))
            }
        };
    }
}

thread_local! {
    /// The thread's idle buffers.
    static KEPT: RefCell<Vec<(Owner, Buffer)>> = const { RefCell::new(Vec::new()) };
}

/// A scratch buffer of at least the bytes asked for, given back to the thread's cache on drop
/// when it is one to keep.
pub(crate) struct Scratch {
    key: Owner,
    buf: Option<Buffer>,
    keep: bool,
}

/// Scratch of `bytes` for work on `stream`.
pub(crate) fn take(stream: &Arc<CudaStream>, bytes: usize) -> Result<Scratch> {
    let key = (
        stream.context().cu_ctx() as usize,
        stream.cu_stream() as usize,
    );
    let capturing =
        stream.capture_status().w()? != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let keep = bytes <= KEPT_BYTES && !capturing;
    let held = if keep {
        KEPT.with(|k| {
            let mut k = k.borrow_mut();
            let at = k.iter().position(|(owner, _)| *owner == key)?;
            Some(k.swap_remove(at).1)
        })
    } else {
        None
    };
    // A kept buffer too small for this call is freed (in stream order) and replaced.
    let buf = match held {
        Some(buf) if buf.bytes >= bytes => buf,
        _ => Buffer::new(stream, bytes.max(1))?,
    };
    let scratch = Scratch {
        key,
        buf: Some(buf),
        keep,
    };
    if poisoning() {
        poison(stream, scratch.ptr(), bytes)?;
    }
    Ok(scratch)
}

impl Scratch {
    /// The buffer's device address.
    pub fn ptr(&self) -> u64 {
        self.buf.as_ref().map_or(0, |b| b.ptr)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if let (true, Some(buf)) = (self.keep, self.buf.take()) {
            // At thread exit the cache is gone and the buffer is freed instead.
            let _ = KEPT.try_with(|k| k.borrow_mut().push((self.key, buf)));
        }
    }
}
