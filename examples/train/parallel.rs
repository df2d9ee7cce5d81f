//! Data parallelism of the train example (`--gpus N`): what the ranks exchange, and how.
//!
//! Every rank holds the same weights and optimizer state and draws the same global micro-batch
//! of B rows; rank r computes the loss and gradient of its B/N contiguous rows
//! (`data::shard`). With `g_r` the gradient of rank r's mean loss, the step's gradient is
//!
//! ```text
//! g = (1/N) · Σ_r g_r      (= the gradient of the mean loss over all B rows: equal row counts
//!                           and row lengths give every rank the same number of predicted tokens)
//! ```
//!
//! summed over the ranks by NCCL's all-reduce in f32, then scaled by 1/N on each rank (skipped
//! at N = 1, where the sum is the gradient itself). The gradients go in buckets: consecutive
//! weights (in the optimizer's order, by name) are copied into one flat f32 buffer of at most
//! `--bucket-mib` MiB (a larger weight alone in its bucket), one all-reduce per bucket, and cut
//! back into the weights' shapes — a few large transfers instead of one per weight. Every rank
//! then clips by the norm of the same averaged gradient and takes the same AdamW step, so the
//! weights stay identical; a checkpoint checks that they are ([`check_weights_agree`]).
//!
//! No overlap with the backward: candle's `backward` returns all the gradients at once and has
//! no per-gradient hooks, so a bucket cannot be sent while the backward still runs; the
//! all-reduces follow it on the device's stream (queued without a host wait, before the
//! optimizer's kernels).
//!
//! A [`Collective`] sums a tensor over the ranks; with the `nccl` feature, [`nccl::Nccl`] is
//! NCCL's all-reduce on the device's own stream (ordered after the step's kernels without a
//! host wait).

use std::ops::Range;

use anyhow::{bail, Result};
use candle_core::{DType, Device, Shape, Tensor, Var};

/// The sum of tensors over the ranks of a data-parallel run.
pub trait Collective {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    /// The element-wise sum over all ranks of `t` (1-D, f32 or f64, on this rank's device);
    /// every rank calls it with the same length and dtype, in the same order.
    fn sum(&self, t: &Tensor) -> Result<Tensor>;
}

/// The default `--bucket-mib`: PyTorch DDP's bucket size, large enough that each all-reduce
/// runs at the links' bandwidth, small enough that the flat copy costs little memory.
pub const BUCKET_MIB: u64 = 25;

/// Consecutive runs of the weights of `sizes` elements, each run at most `cap` elements in all
/// unless it is one weight larger than `cap`; in order, covering every index once.
pub fn buckets(sizes: &[usize], cap: usize) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut filled) = (0, 0usize);
    for (i, &n) in sizes.iter().enumerate() {
        if i > start && filled + n > cap {
            out.push(start..i);
            (start, filled) = (i, 0);
        }
        filled += n;
    }
    if start < sizes.len() {
        out.push(start..sizes.len());
    }
    out
}

/// The tensors' elements in f32, one after another, as one 1-D tensor.
pub fn flatten(tensors: &[Tensor]) -> Result<Tensor> {
    let flat = tensors
        .iter()
        .map(|t| t.to_dtype(DType::F32)?.flatten_all())
        .collect::<candle_core::Result<Vec<_>>>()?;
    Ok(Tensor::cat(&flat, 0)?)
}

/// Cuts a tensor made by [`flatten`] back into tensors of `shapes`.
pub fn unflatten(flat: &Tensor, shapes: &[Shape]) -> Result<Vec<Tensor>> {
    let total: usize = shapes.iter().map(Shape::elem_count).sum();
    if flat.dims() != [total] {
        bail!(
            "a flat buffer of {:?} elements for shapes of {total} in all",
            flat.dims()
        )
    }
    let mut at = 0;
    shapes
        .iter()
        .map(|shape| {
            let n = shape.elem_count();
            let t = flat.narrow(0, at, n)?.reshape(shape)?;
            at += n;
            Ok(t)
        })
        .collect()
}

/// The gradients averaged over the ranks (see the module doc), in buckets of at most `cap`
/// elements; f32, in the order and shapes of `grads`.
pub fn average_grads(c: &dyn Collective, grads: Vec<Tensor>, cap: usize) -> Result<Vec<Tensor>> {
    let sizes: Vec<usize> = grads.iter().map(Tensor::elem_count).collect();
    let mut out = Vec::with_capacity(grads.len());
    for range in buckets(&sizes, cap) {
        let part = &grads[range];
        let summed = c.sum(&flatten(part)?)?;
        let shapes: Vec<Shape> = part.iter().map(|g| g.shape().clone()).collect();
        out.extend(unflatten(&scale(c, summed)?, &shapes)?);
    }
    Ok(out)
}

/// A sum over the ranks divided by their number (exactly the sum at N = 1).
fn scale(c: &dyn Collective, summed: Tensor) -> Result<Tensor> {
    Ok(match c.world() {
        1 => summed,
        n => (summed * (1.0 / n as f64))?,
    })
}

/// The mean over the ranks of `t` (1-D f32), e.g. each micro-batch's loss.
pub fn mean(c: &dyn Collective, t: &Tensor) -> Result<Tensor> {
    scale(c, c.sum(&t.to_dtype(DType::F32)?)?)
}

/// Rank 0's `values` on every rank (the others pass anything of the same length), through a
/// sum on `device`: each value goes as two 32-bit halves in f64, which a sum of one value and
/// zeros keeps exactly.
pub fn from_rank0(c: &dyn Collective, values: &[u64], device: &Device) -> Result<Vec<u64>> {
    let halves: Vec<f64> = values
        .iter()
        .flat_map(|&v| [(v >> 32) as f64, (v & 0xffff_ffff) as f64])
        .map(|h| if c.rank() == 0 { h } else { 0.0 })
        .collect();
    let summed = c
        .sum(&Tensor::from_vec(halves, values.len() * 2, device)?)?
        .to_vec1::<f64>()?;
    Ok(summed
        .chunks(2)
        .map(|h| ((h[0] as u64) << 32) | h[1] as u64)
        .collect())
}

/// An error unless every rank's weights are bit for bit rank 0's: each rank's per-weight sums
/// and sums of squares (f32, reduced on its device in the same order on every rank) go in its
/// own block of a zero vector, and the sum over the ranks lays all of them side by side.
pub fn check_weights_agree(c: &dyn Collective, vars: &[(String, Var)], step: usize) -> Result<()> {
    let sums = vars
        .iter()
        .flat_map(|(_, v)| {
            let w = v.as_tensor();
            [w.sum_all(), w.sqr().and_then(|q| q.sum_all())]
        })
        .collect::<candle_core::Result<Vec<_>>>()?;
    let mine = Tensor::stack(&sums, 0)?.to_dtype(DType::F32)?;
    let (n, world, rank) = (mine.elem_count(), c.world(), c.rank());
    let device = mine.device().clone();
    let mut blocks = Vec::with_capacity(3);
    if rank > 0 {
        blocks.push(Tensor::zeros(rank * n, DType::F32, &device)?);
    }
    blocks.push(mine);
    if rank + 1 < world {
        blocks.push(Tensor::zeros((world - rank - 1) * n, DType::F32, &device)?);
    }
    let all = c.sum(&Tensor::cat(&blocks, 0)?)?.to_vec1::<f32>()?;
    let (first, rest) = all.split_at(n);
    for (other, block) in rest.chunks(n).enumerate() {
        let differs = first
            .iter()
            .zip(block)
            .position(|(a, b)| a.to_bits() != b.to_bits());
        if let Some(i) = differs {
            bail!(
                "step {step}: the weights of rank {} differ from rank 0's ({}): the ranks \
                 diverged, and the checkpoint was not written",
                other + 1,
                vars[i / 2].0
            )
        }
    }
    Ok(())
}

/// NCCL's all-reduce as the [`Collective`] of one rank per GPU (with the `nccl` feature).
#[cfg(feature = "nccl")]
pub mod nccl {
    use anyhow::{anyhow, bail, Result};
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{CudaContext, DeviceRepr, ValidAsZeroBits};
    use candle_core::cuda_backend::cudarc::nccl::{Comm, Id, NcclType, ReduceOp};
    use candle_core::cuda_backend::CudaDType;
    use candle_core::op::BackpropOp;
    use candle_core::{CudaDevice, CudaStorage, DType, Device, Storage, Tensor};

    use super::Collective;

    /// Turns NVLink multicast (NVLS) off for every communicator this process creates; NCCL
    /// reads its environment when it first initialises, so this runs before [`unique_id`].
    /// It is forced, whatever the environment says: the GPU machines this is run on require
    /// NVLink multicast off.
    pub fn disable_nvls() {
        std::env::set_var("NCCL_NVLS_ENABLE", "0");
    }

    /// The NCCL id that the ranks of one run share (made once, copied to every rank).
    pub fn unique_id() -> Result<Id> {
        Id::new().map_err(|e| anyhow!("NCCL: cannot make a communicator id ({:?})", e.0))
    }

    /// The number of CUDA devices the driver sees.
    pub fn device_count() -> Result<usize> {
        let n = CudaContext::device_count()
            .map_err(|e| anyhow!("cannot count the CUDA devices: {e:?}"))?;
        Ok(usize::try_from(n)?)
    }

    /// One rank's communicator, on its device's stream.
    pub struct Nccl {
        comm: Comm,
        dev: CudaDevice,
    }

    impl Nccl {
        /// Joins the communicator `id` as `rank` of `world` on `device` (a CUDA device); waits
        /// until every rank has joined.
        pub fn connect(id: Id, rank: usize, world: usize, device: &Device) -> Result<Self> {
            let Device::Cuda(dev) = device else {
                bail!("rank {rank}: NCCL needs a CUDA device, got {device:?}")
            };
            let stream = dev.cuda_stream();
            // NCCL takes the device from the thread's current context.
            stream
                .context()
                .bind_to_thread()
                .map_err(|e| anyhow!("rank {rank}: binding the CUDA context: {e:?}"))?;
            let comm = Comm::from_rank(stream, rank, world, id).map_err(|e| {
                anyhow!(
                    "NCCL: rank {rank} of {world} cannot join the communicator ({:?})",
                    e.0
                )
            })?;
            Ok(Self {
                comm,
                dev: dev.clone(),
            })
        }

        fn all_reduce<T: CudaDType + NcclType + DeviceRepr + ValidAsZeroBits>(
            &self,
            storage: &CudaStorage,
            range: std::ops::Range<usize>,
        ) -> Result<Tensor> {
            let src = storage.as_cuda_slice::<T>()?.slice(range.clone());
            let mut dst = self.dev.alloc_zeros::<T>(range.len())?;
            self.comm
                .all_reduce(&src, &mut dst, &ReduceOp::Sum)
                .map_err(|e| {
                    anyhow!(
                        "NCCL: all-reduce on rank {} failed ({:?})",
                        self.comm.rank(),
                        e.0
                    )
                })?;
            let storage = CudaStorage::wrap_cuda_slice(dst, self.dev.clone());
            Ok(Tensor::from_storage(
                Storage::Cuda(storage),
                range.len(),
                BackpropOp::none(),
                false,
            ))
        }
    }

    impl Collective for Nccl {
        fn rank(&self) -> usize {
            self.comm.rank()
        }

        fn world(&self) -> usize {
            self.comm.world_size()
        }

        fn sum(&self, t: &Tensor) -> Result<Tensor> {
            if t.rank() != 1 {
                bail!("NCCL: all-reduce of a {:?} tensor (1-D only)", t.dims())
            }
            let t = t.contiguous()?;
            let (guard, layout) = t.storage_and_layout();
            let Storage::Cuda(storage) = &*guard else {
                bail!("NCCL: all-reduce of a tensor on {:?}", t.device())
            };
            let Some((start, end)) = layout.contiguous_offsets() else {
                bail!("NCCL: all-reduce of a non-contiguous tensor")
            };
            match storage.dtype() {
                DType::F32 => self.all_reduce::<f32>(storage, start..end),
                DType::F64 => self.all_reduce::<f64>(storage, start..end),
                other => bail!("NCCL: all-reduce of {other:?} (f32 or f64 only)"),
            }
        }
    }
}
