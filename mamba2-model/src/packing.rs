//! Sequences packed along L (`cu_seqlens`) run as a few rectangular batches: sorted by length and
//! cut into groups, each group one `[rows, longest]` batch of the conv and the scan, its shorter
//! sequences padded at their ends.
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
//! On CUDA [`crate::Model::prefill_packed`] may instead lay every sequence out in one row, each
//! starting at a chunk of the scan and padded up to the next sequence's start
//! ([`Packing::aligned`]): the conv and `ssd_packed` restart at every sequence within the row, so
//! the whole batch is one pass of every layer's launches, with fewer pads than any grouping.
//!
//! ```text
//! aligned [ s0 ····· ___ | s1 ·· _____ | s2 ········ | s3 · ]   chunk starts at every |
//! ```
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

/// What one more group costs, in padded tokens: on CUDA a group's conv and scan launches take
/// about as long as the 130m model's work on ~1K tokens; on the CPU a call costs next to nothing.
pub(crate) fn group_cost(device: &Device) -> usize {
    if device.is_cpu() {
        16
    } else {
        1024
    }
}

/// What one more group costs when each group runs the whole model, in padded tokens: on CUDA a
/// model pass's launches and per-group copies take about as long as the 130m model's work on ~4K
/// tokens (the prefill of 64 prompts of 16..1024 tokens was fastest there).
pub(crate) fn model_group_cost(device: &Device) -> usize {
    if device.is_cpu() {
        16
    } else {
        4096
    }
}

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
    /// after its state; u32 `[rows·d_conv]`. `None` for an aligned row ([`Packing::aligned`]),
    /// which runs only from zero states.
    pub conv_last: Option<Tensor>,
    /// For sequence i of the group and tap j: the position `at_i + max(len_i − d_conv + j, 0)` of
    /// the group's `[rows·len]` positions (`at_i` where the sequence starts), its last `d_conv`
    /// inputs from a zero state; u32 `[seqs·d_conv]`.
    pub conv_taps: Tensor,
    /// For sequence i and tap j: 1 where `len_i − d_conv + j ≥ 0` (a token), 0 before the
    /// sequence (the zero state); `[seqs·d_conv, 1]` in the model's dtype.
    pub conv_mask: Tensor,
    /// What each position adds to its raw dt: 0 for a token, [`PAD_DT`] for a pad; `[rows, len, 1]`
    /// in the model's dtype.
    pub pads: Tensor,
    /// For sequence i: the position `at_i + len_i − 1` of its last token; u32 `[seqs]`.
    pub last: Tensor,
    /// An aligned row's sequences: where each starts in the row, and last the row's length (the
    /// offsets the packed conv and scan take); `None` for a rectangular group.
    pub seqs: Option<Vec<usize>>,
}

/// A group's per-position and per-sequence tables as they are built.
#[derive(Default)]
struct Tables {
    gather: Vec<u32>,
    pads: Vec<f32>,
    last: Vec<u32>,
    conv_taps: Vec<u32>,
    conv_mask: Vec<f32>,
}

impl Tables {
    /// Places the sequence of packed tokens `first..first + len` at position `at` of the group,
    /// `pads` pads after it (positions `at + len..`, reading token `total`).
    fn place(
        &mut self,
        (first, len): (usize, usize),
        at: usize,
        pads: usize,
        total: usize,
        d_conv: usize,
    ) -> Result<()> {
        for p in 0..len {
            self.gather.push(u32_of(first + p)?);
        }
        self.gather
            .extend(std::iter::repeat_n(u32_of(total)?, pads));
        self.pads.extend(std::iter::repeat_n(0f32, len));
        self.pads.extend(std::iter::repeat_n(PAD_DT, pads));
        self.last.push(u32_of(at + len - 1)?);
        for j in 0..d_conv {
            let tap = (len + j).checked_sub(d_conv);
            self.conv_taps.push(u32_of(at + tap.unwrap_or(0))?);
            self.conv_mask.push(if tap.is_some() { 1.0 } else { 0.0 });
        }
        Ok(())
    }
}

fn u32_of(v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| {
        candle_core::Error::Msg(format!("packed sequences: {v} rows do not fit u32 indices"))
    })
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
        let mut groups = Vec::new();
        let mut tokens_back = vec![0u32; total];
        let mut states_back = vec![0u32; seqs];
        let (mut out_row, mut state_row) = (0usize, 0usize);
        for (start, end) in cut(&sorted, cost) {
            let members = &order[start..end];
            let (rows, len) = (members.len(), sorted[start]);
            let mut t = Tables::default();
            let mut conv_last = Vec::with_capacity(rows * d_conv);
            for (r, &s) in members.iter().enumerate() {
                t.place(
                    (cu_seqlens[s], lens[s]),
                    r * len,
                    len - lens[s],
                    total,
                    d_conv,
                )?;
                for p in 0..lens[s] {
                    tokens_back[cu_seqlens[s] + p] = u32_of(out_row + r * len + p)?;
                }
                for j in 0..d_conv {
                    conv_last.push(u32_of(r * (d_conv + len) + lens[s] + j)?);
                }
                states_back[s] = u32_of(state_row + r)?;
            }
            let conv_last = Some(Tensor::new(conv_last.as_slice(), device)?);
            groups.push(t.group(members, (rows, len), conv_last, None, dtype, device)?);
            out_row += rows * len;
            state_row += rows;
        }
        Ok(Self {
            groups,
            tokens_back: Tensor::new(tokens_back.as_slice(), device)?,
            states_back: Tensor::new(states_back.as_slice(), device)?,
        })
    }

    /// The sequences `cu_seqlens` in one row, in their order, each starting at a multiple of
    /// `chunk` and padded up to the next one's start (the last one not padded): one group whose
    /// conv and scan restart at every sequence (`Group::seqs`).
    pub fn aligned(
        cu_seqlens: &[usize],
        d_conv: usize,
        chunk: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let seqs = cu_seqlens.len() - 1;
        let total = cu_seqlens[seqs];
        let mut t = Tables::default();
        let mut starts = Vec::with_capacity(seqs + 1);
        let mut at = 0;
        for (s, w) in cu_seqlens.windows(2).enumerate() {
            let len = w[1] - w[0];
            let span = if s + 1 < seqs {
                len.next_multiple_of(chunk)
            } else {
                len
            };
            t.place((w[0], len), at, span - len, total, d_conv)?;
            starts.push(at);
            at += span;
        }
        starts.push(at);
        let members: Vec<usize> = (0..seqs).collect();
        let group = t.group(&members, (1, at), None, Some(starts), dtype, device)?;
        Ok(Self {
            groups: vec![group],
            tokens_back: Tensor::new(&t_u32(0..total)?[..], device)?,
            states_back: Tensor::new(&t_u32(0..seqs)?[..], device)?,
        })
    }

    /// The positions one aligned row of `cu_seqlens` takes at `chunk` ([`Packing::aligned`]).
    pub fn aligned_len(cu_seqlens: &[usize], chunk: usize) -> usize {
        let seqs = cu_seqlens.len() - 1;
        cu_seqlens
            .windows(2)
            .enumerate()
            .map(|(s, w)| {
                let len = w[1] - w[0];
                if s + 1 < seqs {
                    len.next_multiple_of(chunk)
                } else {
                    len
                }
            })
            .sum()
    }

    /// The positions the groups of `cu_seqlens` at `cost` take, plus `cost` per group (what
    /// [`Packing::new`] minimises).
    pub fn grouped_cost(cu_seqlens: &[usize], cost: usize) -> usize {
        let mut sorted: Vec<usize> = cu_seqlens.windows(2).map(|w| w[1] - w[0]).collect();
        sorted.sort_by_key(|&l| std::cmp::Reverse(l));
        cut(&sorted, cost)
            .iter()
            .map(|&(start, end)| cost + (end - start) * sorted[start])
            .sum()
    }
}

fn t_u32(r: std::ops::Range<usize>) -> Result<Vec<u32>> {
    r.map(u32_of).collect()
}

impl Tables {
    /// The group of `members` as `(rows, len)` from these tables.
    fn group(
        self,
        members: &[usize],
        (rows, len): (usize, usize),
        conv_last: Option<Tensor>,
        seqs: Option<Vec<usize>>,
        dtype: DType,
        device: &Device,
    ) -> Result<Group> {
        let taps = self.conv_taps.len();
        Ok(Group {
            members: RowIndex::new(members, device)?,
            rows,
            len,
            gather: Tensor::new(self.gather.as_slice(), device)?,
            conv_last,
            conv_taps: Tensor::new(self.conv_taps.as_slice(), device)?,
            conv_mask: Tensor::from_vec(self.conv_mask, (taps, 1), device)?.to_dtype(dtype)?,
            pads: Tensor::from_vec(self.pads, (rows, len, 1), device)?.to_dtype(dtype)?,
            last: Tensor::new(self.last.as_slice(), device)?,
            seqs,
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
            assert_eq!(
                g.conv_last.as_ref().map(|t| t.dims()),
                Some(&[g.rows * 4][..])
            );
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
