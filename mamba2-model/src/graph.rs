//! One decode step captured as a CUDA graph and replayed: the step's ~6·n_layer + 4 kernels and
//! cuBLAS calls are launched by one `cuGraphLaunch` instead of one host call each.
//!
//! ```text
//! capture:  warm up on a copy of the cache (loads modules, fills candle's parameter cache)
//!           begin_capture;  logits ← step(ids, cache);  end_capture
//! replay:   ids ← the new tokens (host → device);  launch;  return a copy of logits
//! ```
//!
//! The graph holds the device addresses of the model's weights, of the cache's state tensors and
//! of two buffers it owns (`ids [B]` u32, `logits [B,V]` f32). The borrow of the model and the
//! ownership of the cache keep all of them alive and in place: the cache's tensors are updated in
//! place by prefill, decode and `reset`, and are never replaced.
//!
//! A captured step cannot check its ids (reading them back would break the capture), so
//! [`DecodeGraph::step`] checks the host ids against the vocabulary before writing them to the
//! graph's buffer.

use candle_core::cuda_backend::cudarc::driver::sys::{
    CUgraphInstantiate_flags, CUstreamCaptureMode,
};
use candle_core::cuda_backend::cudarc::driver::CudaGraph;
use candle_core::{
    bail, CpuStorage, CudaStorage, DType, Device, InplaceOp1, Layout, Result, Tensor,
};

use crate::model::check_vocab;
use crate::{Cache, Model};

/// A model's decode step over one cache, captured once and replayed per token.
///
/// # Threads
///
/// A `DecodeGraph` is neither `Send` nor `Sync` (cudarc's graph handle is not): it stays on the
/// thread that captured it. That is also what keeps it sound: the small kernel parameters the
/// capture uploaded live in candle's upload cache of that thread, and the replays run on that
/// thread's stream, in order after the prefills and resets it ran on the same cache. Other
/// threads may capture graphs of their own over the same [`Model`].
pub struct DecodeGraph<'m> {
    model: &'m Model,
    cache: Cache,
    graph: CudaGraph,
    ids: Tensor,
    logits: Tensor,
}

impl<'m> DecodeGraph<'m> {
    /// Captures `model`'s decode step over `cache` (which the graph then owns). The model must be
    /// on a CUDA device; the cache's contents are not changed. The warm-up step runs on a copy of
    /// the cache, so capturing briefly needs the memory of a second cache.
    pub fn new(model: &'m Model, mut cache: Cache) -> Result<Self> {
        let dev = match model.device() {
            Device::Cuda(d) => d.clone(),
            d => bail!("a decode graph needs a model on a CUDA device, this one is on {d:?}"),
        };
        let batch = cache.batch_size();
        let device = model.device();
        let ids = Tensor::zeros(batch, DType::U32, device)?;
        let logits = Tensor::zeros((batch, model.config().vocab_size), DType::F32, device)?;
        let step = |cache: &mut Cache| -> Result<()> {
            let out = model.step_logits(&ids, cache)?;
            logits.slice_set(&out, 0, 0)
        };
        let _htod_cache = dev.enable_cuda_graph_htod_cache();
        step(&mut cache.try_clone()?)?;
        device.synchronize()?;
        let stream = dev.cuda_stream();
        stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| {
                candle_core::Error::msg(format!("cannot begin a CUDA graph capture: {e}"))
            })?;
        let captured = step(&mut cache);
        let graph = stream.end_capture(CUgraphInstantiate_flags(0));
        if let Err(e) = captured {
            bail!("the decode step cannot be captured as a CUDA graph: {e}")
        }
        let graph = match graph {
            Ok(Some(g)) => g,
            Ok(None) => bail!("the captured decode step is an empty CUDA graph"),
            Err(e) => bail!("cannot instantiate the captured decode step: {e}"),
        };
        graph
            .upload()
            .map_err(|e| candle_core::Error::msg(format!("cannot upload the decode graph: {e}")))?;
        Ok(Self {
            model,
            cache,
            graph,
            ids,
            logits,
        })
    }

    /// Feeds one token per sequence and returns the next-token logits `[B,V]` (f32). Every id is
    /// checked against the vocabulary on the host before the graph is launched.
    pub fn step(&mut self, ids: &[u32]) -> Result<Tensor> {
        let batch = self.cache.batch_size();
        if ids.len() != batch {
            bail!(
                "decode graph: {} ids given for a batch of {batch} sequences",
                ids.len()
            )
        }
        let vocab = self.model.config().vocab_size;
        check_vocab(ids.iter().map(|&t| i64::from(t)), &[batch], "ids", vocab)?;
        self.ids.inplace_op1(&WriteIds(ids))?;
        self.graph
            .launch()
            .map_err(|e| candle_core::Error::msg(format!("cannot launch the decode graph: {e}")))?;
        self.cache.advance(1);
        self.logits.copy()
    }

    /// The cache the graph steps.
    pub fn cache(&self) -> &Cache {
        &self.cache
    }

    /// The cache, to prefill or reset it in place (its tensors keep their storage).
    pub fn cache_mut(&mut self) -> &mut Cache {
        &mut self.cache
    }

    /// Releases the graph and returns its cache.
    pub fn into_cache(self) -> Cache {
        self.cache
    }
}

/// Writes host token ids into a contiguous u32 tensor in place.
struct WriteIds<'a>(&'a [u32]);

impl InplaceOp1 for WriteIds<'_> {
    fn name(&self) -> &'static str {
        "write-ids"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> Result<()> {
        match s {
            CpuStorage::U32(v) => {
                let start = l.start_offset();
                v[start..start + self.0.len()].copy_from_slice(self.0);
                Ok(())
            }
            _ => bail!("write-ids: the ids tensor must be u32"),
        }
    }

    fn cuda_fwd(&self, s: &mut CudaStorage, l: &Layout) -> Result<()> {
        let dev = s.device.clone();
        let dst = s.as_cuda_slice_mut::<u32>()?;
        let mut dst = dst.slice_mut(l.start_offset()..l.start_offset() + self.0.len());
        dev.memcpy_htod(self.0, &mut dst)
    }
}
