//! Input validation shared by the ops: every bad input becomes an error that names the op, the
//! tensor and the problem (rank, dimension, dtype, device, contiguity).

use candle_core::{bail, DType, Device, Layout, Result, Tensor};

/// The dimensions of an SSD problem, read off `x [B,L,H,P]` and `b [B,L,G,N]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SsdDims {
    pub batch: usize,
    pub seqlen: usize,
    pub nheads: usize,
    pub headdim: usize,
    pub ngroups: usize,
    pub dstate: usize,
    /// The chunk count where sequences packed along L split the row into chunks of their own
    /// (none across a boundary); `None`: ⌈L / chunk⌉.
    pub chunks: Option<usize>,
}

impl SsdDims {
    /// Reads the dimensions from `x` and `b` and checks that `ngroups` divides `nheads`.
    pub fn from_x_b(op: &str, x: &Tensor, b: &Tensor) -> Result<Self> {
        let [batch, seqlen, nheads, headdim] = rank::<4>(op, "x", x, "[B, L, H, P]")?;
        let [bb, bl, ngroups, dstate] = rank::<4>(op, "b", b, "[B, L, G, N]")?;
        if bb != batch || bl != seqlen {
            bail!(
                "{op}: b has shape {:?} but x has batch {batch} and length {seqlen} (x is {:?})",
                b.dims(),
                x.dims()
            )
        }
        let dims = Self {
            batch,
            seqlen,
            nheads,
            headdim,
            ngroups,
            dstate,
            chunks: None,
        };
        dims.check_groups(op)?;
        Ok(dims)
    }

    /// Like [`SsdDims::from_x_b`], and checks dtypes (x float, b like x) and devices.
    pub fn values(op: &str, x: &Tensor, b: &Tensor) -> Result<Self> {
        let dims = Self::from_x_b(op, x, b)?;
        float(op, "x", x)?;
        device(op, "b", b, x)?;
        same_dtype(op, "b", b, x)?;
        Ok(dims)
    }

    /// Checks a per-token f32 tensor of stage 1's layout `[B,H,L]` (dt_out, da_cumsum).
    pub fn per_token(&self, op: &str, name: &str, t: &Tensor, x: &Tensor) -> Result<()> {
        device(op, name, t, x)?;
        shape(
            op,
            name,
            t,
            &[self.batch, self.nheads, self.seqlen],
            "[B, H, L]",
        )?;
        dtype(op, name, t, param_dtype(x))
    }

    /// Checks a tensor shaped like `b`: `[B,L,G,N]` with x's dtype (the tensor c).
    pub fn like_b(&self, op: &str, name: &str, t: &Tensor, x: &Tensor) -> Result<()> {
        device(op, name, t, x)?;
        let want = [self.batch, self.seqlen, self.ngroups, self.dstate];
        shape(op, name, t, &want, "[B, L, G, N]")?;
        same_dtype(op, name, t, x)
    }

    /// Checks a tensor shaped like `x`: `[B,L,H,P]` with x's dtype (the gate z).
    pub fn like_x(&self, op: &str, name: &str, t: &Tensor, x: &Tensor) -> Result<()> {
        device(op, name, t, x)?;
        let want = [self.batch, self.seqlen, self.nheads, self.headdim];
        shape(op, name, t, &want, "[B, L, H, P]")?;
        same_dtype(op, name, t, x)
    }

    /// Checks a state `[B,H,P,N]` (f32 or bf16).
    pub fn state(&self, op: &str, name: &str, t: &Tensor, x: &Tensor) -> Result<()> {
        device(op, name, t, x)?;
        let want = [self.batch, self.nheads, self.headdim, self.dstate];
        shape(op, name, t, &want, "[B, H, P, N]")?;
        state_dtype(op, name, t.dtype(), t.device())
    }

    pub fn check_groups(&self, op: &str) -> Result<()> {
        if self.ngroups == 0 || self.nheads % self.ngroups != 0 {
            bail!(
                "{op}: nheads ({}) is not divisible by ngroups ({})",
                self.nheads,
                self.ngroups
            )
        }
        if self.nheads == 0
            || self.headdim == 0
            || self.dstate == 0
            || self.batch == 0
            || self.seqlen == 0
        {
            bail!("{op}: empty dimension in {self:?}")
        }
        Ok(())
    }

    /// Checks `chunk_size` ([`chunk_size`]) and that the chunk states `[B,H,C+1,P,N]` and stage 1's
    /// `[2,B,H,L]` have element counts that fit in memory sizes; the element counts of `x` and
    /// `b`, which exist, bound everything else the ops allocate.
    pub fn check_chunking(&self, op: &str, chunk: usize) -> Result<()> {
        chunk_size(op, chunk)?;
        let states = [
            self.nheads,
            self.nchunks(chunk) + 1,
            self.headdim,
            self.dstate,
        ];
        let steps = [2, self.nheads, self.seqlen];
        for (what, factors) in [("chunk states", &states[..]), ("step sizes", &steps[..])] {
            let count = factors
                .iter()
                .try_fold(self.batch, |acc, &f| acc.checked_mul(f));
            if count.is_none_or(|n| n > isize::MAX as usize / 4) {
                bail!("{op}: the {what} of {self:?} at chunk {chunk} have too many elements")
            }
        }
        Ok(())
    }

    pub fn heads_per_group(&self) -> usize {
        self.nheads / self.ngroups
    }

    pub fn nchunks(&self, chunk_size: usize) -> usize {
        self.chunks
            .unwrap_or_else(|| self.seqlen.div_ceil(chunk_size))
    }

    /// Elements of the chunk states `[B, H, C+1, P, N]`.
    pub fn chunk_states_len(&self, chunk_size: usize) -> usize {
        self.batch * self.nheads * (self.nchunks(chunk_size) + 1) * self.headdim * self.dstate
    }
}

/// The sizes of a conv problem: batch, length, channels, kernel width.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ConvDims {
    pub batch: usize,
    pub seqlen: usize,
    pub dim: usize,
    pub width: usize,
}

/// The largest dimension the ops take: the CUDA kernels index in i32, and both backends take the
/// same problems.
pub const MAX_DIM: usize = i32::MAX as usize;

/// Checks that every dimension of `t` is at most [`MAX_DIM`].
fn dims_fit(op: &str, name: &str, t: &Tensor) -> Result<()> {
    if let Some(d) = t.dims().iter().find(|&&d| d > MAX_DIM) {
        bail!(
            "{op}: {name} has a dimension of {d}, over the limit of {MAX_DIM}, shape {:?}",
            t.dims()
        )
    }
    Ok(())
}

/// The dims of `t`, which must have rank `R` and dimensions of at most [`MAX_DIM`]; `doc` names
/// the expected layout.
pub(crate) fn rank<const R: usize>(
    op: &str,
    name: &str,
    t: &Tensor,
    doc: &str,
) -> Result<[usize; R]> {
    let Ok(dims) = <[usize; R]>::try_from(t.dims()) else {
        bail!(
            "{op}: {name} must have rank {R} {doc}, got shape {:?}",
            t.dims()
        )
    };
    dims_fit(op, name, t)?;
    Ok(dims)
}

/// Checks that `t` has exactly the shape `expected`; `doc` names the layout.
pub(crate) fn shape(op: &str, name: &str, t: &Tensor, expected: &[usize], doc: &str) -> Result<()> {
    if t.dims() != expected {
        bail!(
            "{op}: {name} must have shape {doc} = {expected:?}, got {:?}",
            t.dims()
        )
    }
    Ok(())
}

/// Checks that `t` lives on the device of `anchor`, the op's first input.
pub(crate) fn device(op: &str, name: &str, t: &Tensor, anchor: &Tensor) -> Result<()> {
    if !t.device().same_device(anchor.device()) {
        bail!(
            "{op}: {name} is on {:?} but the other inputs are on {:?}; all inputs must be on one device",
            t.device().location(),
            anchor.device().location()
        )
    }
    Ok(())
}

/// Checks that `t` has the value dtype of `x`.
pub(crate) fn same_dtype(op: &str, name: &str, t: &Tensor, x: &Tensor) -> Result<()> {
    if t.dtype() != x.dtype() {
        bail!(
            "{op}: {name} must have the dtype of x ({:?}), got {:?}",
            x.dtype(),
            t.dtype()
        )
    }
    Ok(())
}

/// Checks that `t` has one of the value dtypes the ops read: f32, f16 or bf16, and f64 on the
/// CPU (computed in f64 there, for gradient checks).
pub(crate) fn float(op: &str, name: &str, t: &Tensor) -> Result<()> {
    match t.dtype() {
        DType::F32 | DType::F16 | DType::BF16 => Ok(()),
        DType::F64 if t.device().is_cpu() => Ok(()),
        dt => bail!(
            "{op}: {name} must be f32, f16 or bf16, got {dt:?} on {:?} (f64 is taken on the CPU)",
            t.device().location()
        ),
    }
}

/// The dtype of the per-head parameters (a, dt_bias, D) and of stage 1's outputs for values
/// like `x`: f32, or f64 when the values are f64 (the CPU's f64 compute).
pub(crate) fn param_dtype(x: &Tensor) -> DType {
    if x.dtype() == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// Checks that `t` has exactly the dtype `want`.
pub(crate) fn dtype(op: &str, name: &str, t: &Tensor, want: DType) -> Result<()> {
    if t.dtype() != want {
        bail!("{op}: {name} must be {want:?}, got {:?}", t.dtype())
    }
    Ok(())
}

/// Checks a state dtype: the chunk states and the decode state are f32 or bf16, or f64 on the
/// CPU (`device`).
pub(crate) fn state_dtype(op: &str, name: &str, dt: DType, device: &Device) -> Result<()> {
    match dt {
        DType::F32 | DType::BF16 => Ok(()),
        DType::F64 if device.is_cpu() => Ok(()),
        dt => bail!("{op}: {name} must be f32 or bf16, got {dt:?} (f64 is taken on the CPU)"),
    }
}

/// The longest chunk the SSD ops take. Results of `ssd` do not depend on the chunk length, and the
/// kernels' tensor-core paths stop at 512 (state pass) and 256 (compute_out): a longer chunk only
/// grows the per-chunk buffers (shared memory on CUDA, `chunk²` and `chunk·N` floats per task on
/// the CPU).
pub const MAX_CHUNK_SIZE: usize = 2048;

/// Checks that `chunk_size` is a power of two from 16 to [`MAX_CHUNK_SIZE`].
pub(crate) fn chunk_size(op: &str, chunk_size: usize) -> Result<()> {
    if chunk_size < 16 || !chunk_size.is_power_of_two() || chunk_size > MAX_CHUNK_SIZE {
        bail!(
            "{op}: chunk_size must be a power of two from 16 to {MAX_CHUNK_SIZE}, got {chunk_size}"
        )
    }
    Ok(())
}

/// Checks a per-head parameter `[H]` (a, dt_bias): f32 (f64 with f64 values), on the device of `x`.
pub(crate) fn head_param(
    op: &str,
    name: &str,
    t: &Tensor,
    x: &Tensor,
    nheads: usize,
) -> Result<()> {
    device(op, name, t, x)?;
    shape(op, name, t, &[nheads], "[H]")?;
    dtype(op, name, t, param_dtype(x))
}

/// Checks `D`: f32 (f64 with f64 values), `[H]` (per head) or `[H, P]` (per channel).
pub(crate) fn skip_param(
    op: &str,
    d: &Tensor,
    x: &Tensor,
    nheads: usize,
    headdim: usize,
) -> Result<()> {
    device(op, "D", d, x)?;
    dtype(op, "D", d, param_dtype(x))?;
    if d.dims() != [nheads] && d.dims() != [nheads, headdim] {
        bail!(
            "{op}: D must have shape [H] = [{nheads}] or [H, P] = [{nheads}, {headdim}], got {:?}",
            d.dims()
        )
    }
    Ok(())
}

/// The size of the last (channel) dimension of `t`, which must have rank ≥ 1 and no empty
/// dimension.
pub(crate) fn last_dim(op: &str, name: &str, t: &Tensor) -> Result<usize> {
    dims_fit(op, name, t)?;
    match t.dims().last() {
        Some(&d) if t.elem_count() > 0 => Ok(d),
        _ => bail!(
            "{op}: {name} must have rank >= 1 [..., D] and no empty dimension, got shape {:?}",
            t.dims()
        ),
    }
}

/// Checks a norm epsilon: finite, from 0 to 1 (an epsilon is a guard against dividing by zero;
/// larger ones swamp the mean square of any normalised row).
pub(crate) fn eps(op: &str, eps: f64) -> Result<()> {
    if !(0.0..=1.0).contains(&eps) {
        bail!("{op}: eps must be finite and in [0, 1], got {eps}")
    }
    Ok(())
}

/// The row stride of a layout whose rows (last dim) are contiguous and evenly spaced, as in a
/// slice of a wider tensor; `None` for any other layout.
pub(crate) fn row_stride(l: &Layout) -> Option<usize> {
    let (dims, strides) = (l.dims(), l.stride());
    let rank = dims.len();
    let row = dims.last().copied().unwrap_or(1);
    let last_ok = rank == 0 || row == 1 || strides[rank - 1] == 1;
    let even = (0..rank.saturating_sub(2))
        .all(|k| dims[k] == 1 || strides[k] == strides[k + 1] * dims[k + 1]);
    (last_ok && even).then(|| if rank >= 2 { strides[rank - 2] } else { row })
}

/// `t` itself where the CUDA kernels read it in place (rows contiguous, one row stride), else a
/// contiguous copy; the CPU implementations always get contiguous tensors.
pub(crate) fn rows_view(t: &Tensor) -> Result<Tensor> {
    if t.device().is_cuda() && row_stride(t.layout()).is_some() {
        Ok(t.clone())
    } else {
        t.contiguous()
    }
}

/// Checks sequence offsets `cu_seqlens` (`[0, l_0, l_0 + l_1, …, total]`) of sequences packed
/// along a dim of length `total`: starts at 0, ends at `total`, every sequence at least one
/// token; `op` names the caller in the error. Returns the sequence count.
pub fn cu_seqlens(op: &str, cu: &[usize], total: usize) -> Result<usize> {
    if cu.len() < 2 || cu[0] != 0 || cu[cu.len() - 1] != total {
        bail!(
            "{op}: cu_seqlens must run from 0 to the packed length {total} with one offset more \
             than there are sequences, got {cu:?}"
        )
    }
    if let Some(i) = cu.windows(2).position(|w| w[1] <= w[0]) {
        bail!(
            "{op}: cu_seqlens must increase (every sequence at least one token): offset {} is {} \
             after {}",
            i + 1,
            cu[i + 1],
            cu[i]
        )
    }
    Ok(cu.len() - 1)
}

/// Checks a buffer that a backward writes a gradient like `like [.., D]` into, at columns
/// `offset..offset + D` of its last dim: contiguous, on like's device, in its dtype, with its
/// leading dims.
pub(crate) fn into(
    op: &str,
    name: &str,
    buffer: &Tensor,
    like: &Tensor,
    offset: usize,
) -> Result<()> {
    device(op, name, buffer, like)?;
    same_dtype(op, name, buffer, like)?;
    let (dims, want) = (buffer.dims(), like.dims());
    let fits = dims.len() == want.len()
        && dims
            .split_last()
            .map(|(w, lead)| (*w, lead))
            .zip(want.split_last())
            .is_some_and(|((w, lead), (d, want_lead))| {
                lead == want_lead && offset.checked_add(*d).is_some_and(|e| e <= w)
            });
    if !fits {
        bail!(
            "{op}: {name} {dims:?} must hold a gradient {want:?} at columns {offset}.. of its last dim"
        )
    }
    if !buffer.is_contiguous() {
        bail!("{op}: {name} must be contiguous")
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};

    use super::*;

    #[test]
    fn chunk_counts_round_up() {
        let d = SsdDims {
            batch: 2,
            seqlen: 1000,
            nheads: 3,
            headdim: 4,
            ngroups: 1,
            dstate: 5,
            chunks: None,
        };
        assert_eq!(d.nchunks(256), 4);
        assert_eq!(d.nchunks(1000), 1);
        assert_eq!(d.chunk_states_len(256), 2 * 3 * 5 * 4 * 5);
        assert_eq!(d.heads_per_group(), 3);
    }

    #[test]
    fn chunk_sizes_are_powers_of_two_from_16() {
        assert!(chunk_size("op", 16).is_ok());
        assert!(chunk_size("op", 256).is_ok());
        for bad in [0, 8, 24, 100] {
            let err = chunk_size("op", bad).unwrap_err().to_string();
            assert!(err.contains("power of two"), "{err}");
        }
        for bad in [4096, 1 << 30] {
            let err = chunk_size("op", bad).unwrap_err().to_string();
            assert!(err.contains("to 2048"), "{err}");
        }
    }

    #[test]
    fn row_strides_of_slices() -> Result<()> {
        let t = Tensor::zeros((2, 3, 10), DType::F32, &Device::Cpu)?;
        assert_eq!(row_stride(t.layout()), Some(10));
        // Columns 2..6 of every row: rows of 4 values, 10 apart.
        assert_eq!(row_stride(t.narrow(2, 2, 4)?.layout()), Some(10));
        // A transpose has no contiguous rows.
        assert_eq!(row_stride(t.transpose(1, 2)?.layout()), None);
        // Rows of a middle slice are not evenly spaced across the outer dimension.
        assert_eq!(row_stride(t.narrow(1, 0, 2)?.layout()), None);
        Ok(())
    }
}
