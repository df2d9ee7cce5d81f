//! Which SSD kernels run and how they are launched, as pure functions of the problem and the
//! device (SM count, shared memory): the CUDA launchers follow these plans, and the tests below
//! check them on the CPU.
//!
//! - chunk_state_mma (the state pass's first kernel, tensor cores) takes bf16/f16 values with
//!   P % 32 == 0, N % 16 == 0, 16-byte aligned tiles and a chunk of at most 512 tokens; the rest
//!   runs on the SIMT kernel.
//! - compute_out_mma takes bf16/f16 values with P % 32 == 0, N one of 16, 32, 64, 128, 256, a
//!   power-of-two chunk up to 256 and 16-byte aligned tiles; the rest runs on the SIMT kernel.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use crate::check::SsdDims;
use crate::instances::{self, ChunkStateForm, Ty};

/// Stage 1 runs inside chunk_state_mma (its `_cs` forms) while that kernel has at most this many
/// programs per SM (about eight waves): there the launch it saves outweighs the stage-1 latency
/// each program then carries.
pub(super) const FUSE_PROGRAMS_PER_SM: usize = 32;

/// The scan's threads each keep a ring of 128 bytes of chunks in flight; with fewer than this
/// many bytes per SM in all (too few (batch, head) pairs and state elements to cover the memory
/// latency) the `_deep` kernel keeps 256.
pub(super) const SCAN_BYTES_PER_SM: usize = 24 * 1024;

/// The longest chunk chunk_state_mma takes (its `MAXC`).
const CHUNK_STATE_MAX_CHUNK: usize = 512;

/// Whether the tensor-core kernels' tile loads (`m2::load_tile`: 32-bit byte offsets from a
/// chunk's first row of x, b or c) reach every row of a chunk.
pub(super) fn tile_offsets_fit(d: &SsdDims, chunk: usize) -> bool {
    let row = (d.nheads * d.headdim).max(d.ngroups * d.dstate);
    chunk * row * 2 <= u32::MAX as usize
}

/// A launch of chunk_state_mma: warps per program (16 state rows each), state columns per
/// program, shared bytes (cp.async tiles; the tensor-map forms align to 1024 instead of 128).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct ChunkStateTile {
    pub warps: usize,
    pub nt: usize,
    pub smem: usize,
}

impl ChunkStateTile {
    /// Shared bytes of the tensor-map forms, whose tiles start at multiples of 1024 bytes.
    pub fn tma_smem(&self) -> usize {
        self.smem - 128 + 1024
    }

    /// Programs of the grid: one per (batch, head, chunk, state tile).
    pub fn programs(&self, d: &SsdDims, chunk: usize) -> usize {
        let tiles = (d.dstate / self.nt) * (d.headdim / (16 * self.warps));
        d.batch * d.nheads * d.nchunks(chunk) * tiles
    }

    pub fn kernel(&self, form: ChunkStateForm, packed: bool, t: Ty, s: Ty) -> String {
        instances::chunk_state_mma(form, packed, t, s, self.warps, self.nt)
    }
}

/// chunk_state_mma's launch, if the shape suits it: bf16/f16 values `t`, states of `state_bytes`
/// per element, 16-byte aligned x, b and initial state (`aligned`), a chunk that fits in shared
/// memory (`max_smem`).
pub(super) fn chunk_state_tile(
    d: &SsdDims,
    chunk: usize,
    t: Ty,
    state_bytes: usize,
    aligned: bool,
    max_smem: usize,
) -> Option<ChunkStateTile> {
    if t == Ty::F32
        || chunk % 16 != 0
        || d.headdim % 32 != 0
        || d.dstate % 16 != 0
        || !aligned
        || chunk > CHUNK_STATE_MAX_CHUNK
        || !tile_offsets_fit(d, chunk)
    {
        return None;
    }
    let warps = if d.headdim % 64 == 0 { 4 } else { 2 };
    let nt = [128, 64, 32, 16]
        .into_iter()
        .find(|nt| d.dstate % nt == 0)?;
    // x and b tiles and w (2-byte values), or the warps' output staging if larger, and 128 bytes
    // to align the tiles.
    let tiles = chunk * 16 * warps * 2 + chunk * nt * 2 + chunk * 2;
    let staging = warps * 16 * (nt + 8) * state_bytes;
    let smem = tiles.max(staging) + 128;
    (smem <= max_smem).then_some(ChunkStateTile { warps, nt, smem })
}

/// Tokens per tensor-map box of chunk_state_mma: the largest of 128, 64, 32, 16 that divides both
/// halves of the chunk (the kernel's `half` = ⌊chunk / 32⌋·16 and the rest).
pub(super) fn box_rows(chunk: usize) -> usize {
    let half = chunk / 32 * 16;
    [128, 64, 32, 16]
        .into_iter()
        .find(|r| half % r == 0 && (chunk - half) % r == 0)
        .unwrap_or(16)
}

/// Whether the scan keeps the deep ring (256 bytes of chunks per thread): when its threads, one
/// per 8 state elements, keep fewer than [`SCAN_BYTES_PER_SM`] in flight per SM with 128 each.
pub(super) fn deep_scan(d: &SsdDims, sms: usize) -> bool {
    let threads = d.batch * d.nheads * d.headdim * d.dstate / 8;
    threads * 128 < SCAN_BYTES_PER_SM * sms
}

/// The chunk from which the scan lets the next kernel (compute_out, which loads c and b and forms
/// C·Bᵀ before it waits) be scheduled: at once after the usual ring; three quarters in for the
/// deep ring, whose few threads suffer early blocks beside them.
pub(super) fn scan_release_at(deep: bool, nchunks: usize) -> usize {
    if deep {
        3 * nchunks / 4
    } else {
        0
    }
}

/// compute_out_mma's state tile (N, channels per unit), if the shape suits the tensor-core
/// kernel (the module doc; `aligned`: 16-byte aligned x, b, c and states, z in pairs).
pub(super) fn out_tile(d: &SsdDims, chunk: usize, t: Ty, aligned: bool) -> Option<(usize, usize)> {
    let mma = t != Ty::F32
        && aligned
        && d.headdim % 32 == 0
        && matches!(d.dstate, 16 | 32 | 64 | 128 | 256)
        && chunk.is_power_of_two()
        && (16..=256).contains(&chunk)
        && tile_offsets_fit(d, chunk);
    let ptile = if d.headdim % 64 == 0 && d.dstate <= 128 {
        64
    } else {
        32
    };
    mma.then_some((d.dstate, ptile))
}

/// Shared memory of `compute_out_mma` in bytes (its `Layout`, 2-byte values): C·Bᵀ in 16×16
/// blocks at or below the diagonal, four f32 scalars per token and head, D per channel of each
/// head, and from the next multiple of 1024 bytes a region holding c and b at the start, then
/// two unit buffers (x tile and state tile); 1024 bytes more to align the base.
pub(super) fn mma_smem(
    chunk: usize,
    headdim: usize,
    dstate: usize,
    ptile: usize,
    hb: usize,
) -> usize {
    let rblocks = chunk / 16;
    let cb = rblocks * (rblocks + 1) / 2 * 512;
    let scalars = hb * 4 * chunk * 4 + hb * headdim * 4;
    let cb_tiles = 2 * chunk * dstate * 2;
    let buffers = 2 * (chunk * ptile + ptile * dstate) * 2;
    (cb + scalars).next_multiple_of(1024) + cb_tiles.max(buffers) + 1024
}

/// Heads per program for `compute_out_mma` (`threads` per program) and its shared bytes: a
/// divisor (≤ 8) of the heads per group whose shared memory fits, chosen by the time of the
/// busiest SM: ⌈programs / SMs⌉ programs, each worth its heads plus the shared c/b load and C·Bᵀ
/// (about 0.7 of a head), where two programs resident together take 1.6× one alone, not 1×
/// (a model fitted to measured times; bench/RESULTS.md).
pub(super) fn out_plan(
    head_chunks: usize,
    heads_per_group: usize,
    sms: usize,
    limit: usize,
    smem: impl Fn(usize) -> usize,
    threads: usize,
) -> Option<(usize, usize)> {
    // Programs resident per SM: the opt-in limit plus the 1 KiB reserved per program is the
    // SM's shared memory; 64 Ki registers, up to 128 per thread.
    let resident = |bytes: usize| ((limit + 1024) / (bytes + 1024)).min(65536 / (threads * 128));
    (1..=heads_per_group.min(8))
        .filter(|hb| heads_per_group % hb == 0)
        .map(|hb| (hb, smem(hb)))
        .filter(|&(_, bytes)| bytes <= limit)
        .min_by_key(|&(hb, bytes)| {
            let per_sm = head_chunks.div_ceil(hb).div_ceil(sms.max(1));
            // Tenths of one program's time alone.
            let time = if resident(bytes) >= 2 {
                16 * (per_sm / 2) + 10 * (per_sm % 2)
            } else {
                10 * per_sm
            };
            (time * (10 * hb + 7), usize::MAX - hb)
        })
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;
    use crate::instances::{instances, MMA_VALUES, STATES};

    /// The H200's SM count and opt-in shared memory per block.
    const SMS: usize = 132;
    const SMEM: usize = 232_448;

    fn dims(batch: usize, seqlen: usize, nheads: usize, headdim: usize, dstate: usize) -> SsdDims {
        SsdDims {
            batch,
            seqlen,
            nheads,
            headdim,
            ngroups: 1,
            dstate,
            chunks: None,
        }
    }

    fn kernel_names() -> HashSet<String> {
        instances().into_iter().map(|k| k.name).collect()
    }

    #[test]
    fn box_rows_divide_both_halves_of_the_chunk() {
        for (chunk, rows) in [
            (16, 16),
            (32, 16),
            (64, 32),
            (128, 64),
            (256, 128),
            (512, 128),
        ] {
            assert_eq!(box_rows(chunk), rows, "chunk {chunk}");
            let half = chunk / 32 * 16;
            assert_eq!(half % rows, 0);
            assert_eq!((chunk - half) % rows, 0);
        }
    }

    #[test]
    fn chunk_state_tiles_follow_p_and_n() {
        let d = dims(4, 4096, 8, 64, 128);
        let tile = chunk_state_tile(&d, 128, Ty::Bf16, 2, true, SMEM);
        let want = ChunkStateTile {
            warps: 4,
            nt: 128,
            smem: 128 * 16 * 4 * 2 + 128 * 128 * 2 + 128 * 2 + 128,
        };
        assert_eq!(tile, Some(want));
        assert_eq!(want.programs(&d, 128), 4 * 8 * 32);
        let tile = chunk_state_tile(&dims(1, 100, 3, 32, 48), 64, Ty::F16, 4, true, SMEM);
        assert_eq!(tile.map(|t| (t.warps, t.nt)), Some((2, 16)));
        // f32 values, odd sizes, misalignment and long chunks go to the SIMT kernel.
        assert_eq!(chunk_state_tile(&d, 128, Ty::F32, 4, true, SMEM), None);
        assert_eq!(
            chunk_state_tile(&dims(1, 64, 2, 48, 64), 64, Ty::Bf16, 2, true, SMEM),
            None
        );
        assert_eq!(
            chunk_state_tile(&dims(1, 64, 2, 64, 40), 64, Ty::Bf16, 2, true, SMEM),
            None
        );
        assert_eq!(chunk_state_tile(&d, 128, Ty::Bf16, 2, false, SMEM), None);
        assert_eq!(chunk_state_tile(&d, 1024, Ty::Bf16, 2, true, SMEM), None);
        assert_eq!(chunk_state_tile(&d, 128, Ty::Bf16, 2, true, 20_000), None);
    }

    #[test]
    fn the_scan_deepens_its_ring_for_few_threads() {
        // 4·8·64·64 / 8 threads · 128 bytes = 2 MiB, under 24 KiB · 132 SMs = 3.1 MiB.
        assert!(deep_scan(&dims(4, 16384, 8, 64, 64), SMS));
        assert!(!deep_scan(&dims(4, 4096, 8, 64, 128), SMS));
        assert_eq!(scan_release_at(true, 128), 96);
        assert_eq!(scan_release_at(false, 128), 0);
    }

    #[test]
    fn out_plans_fit_and_divide_the_group() {
        for (hpg, p, n, chunk) in [(8, 64, 128, 128), (24, 64, 128, 256), (80, 64, 128, 256)] {
            let (hb, bytes) = out_plan(
                1000,
                hpg,
                SMS,
                SMEM,
                |hb| mma_smem(chunk, p, n, 64, hb),
                2 * chunk,
            )
            .expect("a plan");
            assert_eq!(hpg % hb, 0);
            assert!(hb <= 8 && bytes <= SMEM);
        }
        // No divisor fits: no plan.
        assert_eq!(out_plan(10, 8, SMS, 1000, |hb| 2000 * hb, 256), None);
    }

    #[test]
    fn compute_out_tiles_follow_p_and_n() {
        let d = dims(1, 512, 4, 64, 128);
        assert_eq!(out_tile(&d, 128, Ty::Bf16, true), Some((128, 64)));
        assert_eq!(
            out_tile(&dims(1, 512, 4, 64, 256), 128, Ty::Bf16, true),
            Some((256, 32))
        );
        assert_eq!(
            out_tile(&dims(1, 512, 4, 96, 64), 128, Ty::F16, true),
            Some((64, 32))
        );
        assert_eq!(out_tile(&d, 128, Ty::F32, true), None);
        assert_eq!(out_tile(&d, 512, Ty::Bf16, true), None);
        assert_eq!(out_tile(&d, 128, Ty::Bf16, false), None);
        assert_eq!(
            out_tile(&dims(1, 512, 4, 64, 48), 128, Ty::Bf16, true),
            None
        );
    }

    #[test]
    fn every_planned_kernel_is_instantiated() {
        let names = kernel_names();
        let mut planned = 0;
        for p in [32, 64, 96, 128, 256] {
            for n in [16, 32, 48, 64, 128, 256] {
                for chunk in [16, 64, 128, 256, 512] {
                    let d = dims(2, 1000, 4, p, n);
                    for t in MMA_VALUES {
                        for s in STATES {
                            let bytes = if s == Ty::F32 { 4 } else { 2 };
                            if let Some(tile) = chunk_state_tile(&d, chunk, t, bytes, true, SMEM) {
                                for form in ChunkStateForm::ALL {
                                    for packed in [false, true] {
                                        let name = tile.kernel(form, packed, t, s);
                                        assert!(names.contains(&name), "{name}");
                                    }
                                    planned += 1;
                                }
                            }
                            if let Some((n, pt)) = out_tile(&d, chunk, t, true) {
                                // The tensor-map forms run when the states have the values'
                                // type.
                                for tma in [false, s == t] {
                                    for packed in [false, true] {
                                        let name =
                                            instances::compute_out_mma(tma, packed, t, s, n, pt);
                                        assert!(names.contains(&name), "{name}");
                                    }
                                }
                                planned += 1;
                            }
                        }
                    }
                }
            }
        }
        assert!(planned > 100, "{planned}");
        for t in crate::instances::VALUES {
            for s in STATES {
                for name in [
                    instances::chunk_cumsum(t),
                    instances::fwd_pass_state_simt(t, s),
                    instances::compute_out_simt(t, s),
                    instances::state_scan(false, false, s),
                    instances::state_scan(true, false, s),
                    instances::state_scan(false, true, s),
                    instances::state_scan(true, true, s),
                ] {
                    assert!(names.contains(&name), "{name}");
                }
            }
        }
    }
}
