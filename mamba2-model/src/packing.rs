//! Sequences packed along L (`cu_seqlens`) run on the CPU as a few rectangular batches: sorted by
//! length and cut into groups, each group one `[rows, longest]` batch of the conv and the scan, its
//! shorter sequences padded at their ends. (On CUDA the packed conv and scan take the row as it is,
//! one launch each for every sequence: no groups, no pads.)
//!
//! ```text
//! packed  [ s0 ····· | s1 ·· | s2 ········ | s3 · ]          T tokens
//! group 0 [ s2 ········ ]                                    rows of the group's longest length
//!         [ s0 ····· ___ ]                                   ___ = pad
//! group 1 [ s1 ·· ]
//!         [ s3 · _ ]
//! ```
//!
//! [`crate::Model::prefill_packed`] runs each group through the whole model (`Model::prefill_groups`,
//! `Mixer::forward_rows`): the ids are gathered into the group's rows, so that no activation is
//! gathered or scattered between layers. [`crate::Mixer::forward_packed`], which takes one packed
//! row of activations, runs only its conv and scan in groups (`Mixer::run_groups`). Either way a
//! group's states go straight to its sequences' rows of the cache (`scatter_rows`, by the group's
//! `members`).
//!
//! A pad changes nothing of its sequence: it comes after the sequence's tokens (the conv and the
//! scan are causal), its raw dt is [`PAD_DT`] (under softplus an exact 0, so the state passes it
//! unchanged: decay exp(0) = 1 and input dt·x = 0), and the sequence's conv state is read from its
//! own last inputs, not the row's. The grouping minimises padded tokens plus a fixed cost per group
//! (a group's launches), so that equal lengths share one batch and very different ones do not pad.

use candle_core::{DType, Device, Result, Tensor};
use mamba2_kernels::RowIndex;

/// The raw dt of a pad: softplus(−10⁴ + bias) is exactly 0 in every float type for any bias the
/// scan sees, and the value is finite in f16.
pub(crate) const PAD_DT: f32 = -1e4;

/// What one more group costs, in padded tokens: on the CPU a call costs next to nothing.
pub(crate) const GROUP_COST: usize = 16;

/// One batch: its sequences (indices into the packed order) and the row of every
/// `[rows·len]` position.
pub(crate) struct Group {
    /// The sequences of its rows, `[rows]`: where each row's states go in a cache of all.
    pub members: RowIndex,
    pub rows: usize,
    /// Its longest sequence's length, every row's length.
    pub len: usize,
    /// For row r and position p: the packed token `cu[member r] + p`, or `T` (one past the last
    /// token, where the caller appends the pad values) past the sequence's end; u32 `[rows·len]`.
    pub gather: Tensor,
    /// For row r and tap j of a `d_conv`-tap window: the position `r·(d_conv + len) + len_r + j` in
    /// the rows `[conv state (d_conv) | inputs (len)]`, i.e. the sequence's last `d_conv` inputs
    /// after its state; u32 `[rows·d_conv]`.
    pub conv_last: Tensor,
    /// For row r and tap j: the position `r·len + max(len_r − d_conv + j, 0)` of the row's
    /// `[rows·len]` tokens, the sequence's last `d_conv` inputs from a zero state; u32
    /// `[rows·d_conv]`.
    pub conv_taps: Tensor,
    /// For row r and tap j: 1 where `len_r − d_conv + j ≥ 0` (a token), 0 before the sequence (the
    /// zero state); `[rows·d_conv, 1]` in the model's dtype.
    pub conv_mask: Tensor,
    /// What each position adds to its raw dt: 0 for a token, [`PAD_DT`] for a pad; `[rows, len, 1]`
    /// in the model's dtype.
    pub pads: Tensor,
    /// For row r: the position `r·len + len_r − 1` of its last token; u32 `[rows]`.
    pub last: Tensor,
}

/// The groups of one set of packed sequences, and the way back to the packed order.
pub(crate) struct Packing {
    pub groups: Vec<Group>,
    /// For every packed token, its row in the groups' `[Σ rows·len]` outputs stacked in group
    /// order; u32 `[T]`.
    pub tokens_back: Tensor,
    /// For every sequence, its row in the groups' `[Σ rows]` last positions stacked in group
    /// order; u32 `[S]`.
    pub states_back: Tensor,
}

/// The most sequences in one group: bounds the cut's work (quadratic in this) and a batch's rows.
const MAX_ROWS: usize = 1024;

/// The cut of `sorted` (lengths, longest first) into consecutive groups of at most [`MAX_ROWS`]
/// with the fewest padded tokens plus `cost` per group: `[start, end)` ranges of `sorted`.
fn cut(sorted: &[usize], cost: usize) -> Vec<(usize, usize)> {
    let n = sorted.len();
    // best[i]: the cheapest cut of sorted[..i]; from[i]: where its last group starts.
    let mut best = vec![0usize; n + 1];
    let mut from = vec![0usize; n + 1];
    for i in 1..=n {
        best[i] = usize::MAX;
        for j in i.saturating_sub(MAX_ROWS)..i {
            // Group sorted[j..i]: every row as long as sorted[j], the longest.
            let total = best[j] + cost + (i - j) * sorted[j];
            if total < best[i] {
                best[i] = total;
                from[i] = j;
            }
        }
    }
    let mut groups = Vec::new();
    let mut i = n;
    while i > 0 {
        groups.push((from[i], i));
        i = from[i];
    }
    groups.reverse();
    groups
}

impl Packing {
    /// The groups of the sequences `cu_seqlens` (`[0, l_0, l_0 + l_1, …, T]`, as
    /// `mamba2_kernels::check_cu_seqlens` accepts them) for a conv of `d_conv` taps, the per-position
    /// values in `dtype` (the model's, so that no layer converts them).
    pub fn new(
        cu_seqlens: &[usize],
        d_conv: usize,
        cost: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let seqs = cu_seqlens.len() - 1;
        let total = cu_seqlens[seqs];
        let lens: Vec<usize> = cu_seqlens.windows(2).map(|w| w[1] - w[0]).collect();
        let mut order: Vec<usize> = (0..seqs).collect();
        order.sort_by_key(|&s| std::cmp::Reverse(lens[s]));
        let sorted: Vec<usize> = order.iter().map(|&s| lens[s]).collect();
        let u32_of = |v: usize| {
            u32::try_from(v).map_err(|_| {
                candle_core::Error::Msg(format!(
                    "packed sequences: {v} rows do not fit u32 indices"
                ))
            })
        };
        let mut groups = Vec::new();
        let mut tokens_back = vec![0u32; total];
        let mut states_back = vec![0u32; seqs];
        let (mut out_row, mut state_row) = (0usize, 0usize);
        for (start, end) in cut(&sorted, cost) {
            let members = &order[start..end];
            let (rows, len) = (members.len(), sorted[start]);
            let mut gather = Vec::with_capacity(rows * len);
            let mut pads = Vec::with_capacity(rows * len);
            let mut last = Vec::with_capacity(rows);
            let mut conv_last = Vec::with_capacity(rows * d_conv);
            let (mut conv_taps, mut conv_mask) = (Vec::new(), Vec::new());
            for (r, &s) in members.iter().enumerate() {
                for p in 0..len {
                    if p < lens[s] {
                        gather.push(u32_of(cu_seqlens[s] + p)?);
                        pads.push(0f32);
                        tokens_back[cu_seqlens[s] + p] = u32_of(out_row + r * len + p)?;
                    } else {
                        gather.push(u32_of(total)?);
                        pads.push(PAD_DT);
                    }
                }
                last.push(u32_of(r * len + lens[s] - 1)?);
                for j in 0..d_conv {
                    conv_last.push(u32_of(r * (d_conv + len) + lens[s] + j)?);
                    let at = (lens[s] + j).checked_sub(d_conv);
                    conv_taps.push(u32_of(r * len + at.unwrap_or(0))?);
                    conv_mask.push(if at.is_some() { 1f32 } else { 0.0 });
                }
                states_back[s] = u32_of(state_row + r)?;
            }
            groups.push(Group {
                members: RowIndex::new(members, device)?,
                rows,
                len,
                gather: Tensor::new(gather.as_slice(), device)?,
                conv_last: Tensor::new(conv_last.as_slice(), device)?,
                conv_taps: Tensor::new(conv_taps.as_slice(), device)?,
                conv_mask: Tensor::from_vec(conv_mask, (rows * d_conv, 1), device)?
                    .to_dtype(dtype)?,
                pads: Tensor::from_vec(pads, (rows, len, 1), device)?.to_dtype(dtype)?,
                last: Tensor::new(last.as_slice(), device)?,
            });
            out_row += rows * len;
            state_row += rows;
        }
        Ok(Self {
            groups,
            tokens_back: Tensor::new(tokens_back.as_slice(), device)?,
            states_back: Tensor::new(states_back.as_slice(), device)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_lengths_share_one_group_and_far_ones_do_not_pad() {
        assert_eq!(cut(&[5, 5, 5], 16), vec![(0, 3)]);
        // 1000 and 10: padding the short one costs 990 tokens, a second group 16.
        assert_eq!(cut(&[1000, 10], 16), vec![(0, 1), (1, 2)]);
        // At a cost of 1024 per group one padded batch is cheaper.
        assert_eq!(cut(&[1000, 10], 1024), vec![(0, 2)]);
    }

    #[test]
    fn every_token_and_state_comes_back_to_its_place() -> Result<()> {
        let cu = [0, 3, 4, 9, 11];
        let p = Packing::new(&cu, 4, 16, DType::F32, &Device::Cpu)?;
        let rows: usize = p.groups.iter().map(|g| g.rows).sum();
        assert_eq!(rows, 4);
        // Stack the gathers as the mixer stacks its outputs, then map back: every token itself.
        let mut stacked = Vec::new();
        for g in &p.groups {
            stacked.extend(g.gather.to_vec1::<u32>()?);
            assert_eq!(g.conv_last.dims(), &[g.rows * 4]);
        }
        let back: Vec<u32> = p
            .tokens_back
            .to_vec1::<u32>()?
            .iter()
            .map(|&i| stacked[i as usize])
            .collect();
        assert_eq!(back, (0..11).collect::<Vec<u32>>());
        let mut members = Vec::new();
        for g in &p.groups {
            members.extend(g.members.ids().to_vec1::<u32>()?);
        }
        let states: Vec<u32> = p
            .states_back
            .to_vec1::<u32>()?
            .iter()
            .map(|&i| members[i as usize])
            .collect();
        assert_eq!(states, [0, 1, 2, 3]);
        Ok(())
    }
}
