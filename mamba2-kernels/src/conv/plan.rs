//! How the conv's backward is launched, as pure functions of the problem: the CUDA launcher
//! follows them, and the tests below check them on the CPU.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use crate::instances::ConvTaps;

/// Channels per backward program at most (one thread each).
const MAX_THREADS: usize = 128;
/// Tokens a backward program takes at least, so that the K − 1 tokens it recomputes past its span
/// and reads before it stay few beside its own.
const MIN_SPAN: usize = 64;
/// Threads an SM holds at once (sm_80 and sm_90), and programs at most.
const SM_THREADS: usize = 2048;
const SM_PROGRAMS: usize = 32;
/// Programs the backward aims for, in full loads of every SM: each thread walks its span in
/// order, so only many threads at once keep enough loads in flight.
const WAVES: usize = 2;
/// Programs per batch along the grid's y axis at most.
const MAX_SPANS: usize = 65_535;

/// The kernel variant for conv width `width`: taps in registers up to 8, read from memory beyond.
pub(super) fn taps(width: usize) -> ConvTaps {
    match width {
        0..=4 => ConvTaps::K4,
        5..=8 => ConvTaps::K8,
        _ => ConvTaps::Any,
    }
}

/// Threads per backward program for `dim` channels: whole warps, at most [`MAX_THREADS`].
pub(super) fn threads(dim: usize) -> usize {
    (dim.div_ceil(32) * 32).clamp(32, MAX_THREADS)
}

/// Tokens per backward program for `batch` sequences of `seqlen` tokens and `dim` channels on
/// `sms` SMs: spans short enough for [`WAVES`] full loads of the GPU, at least [`MIN_SPAN`]
/// tokens, and few enough per sequence for the grid.
pub(super) fn span(batch: usize, seqlen: usize, dim: usize, sms: usize) -> usize {
    let threads = threads(dim);
    let resident = (SM_THREADS / threads).min(SM_PROGRAMS);
    let programs = sms.max(1) * resident * WAVES;
    let per_sequence = programs.div_ceil(dim.div_ceil(threads) * batch.max(1));
    seqlen
        .div_ceil(per_sequence.max(1))
        .max(MIN_SPAN)
        .max(seqlen.div_ceil(MAX_SPANS))
}

/// Channels per thread (one load of `bytes`-byte values each) for a conv of `width` taps over
/// `dim` channels, with rows `x_stride` elements apart and channel pieces `split` (x's, or y's
/// and dy's): the most of `candidates` that keeps every load and store aligned, given the
/// buffers' addresses `addrs`; 1 (the generic kernels) when none does or `width` > 4.
pub(super) fn lanes(
    candidates: &[usize],
    bytes: usize,
    width: usize,
    (dim, split, x_stride): (usize, &[usize], usize),
    addrs: &[u64],
) -> usize {
    if width > 4 {
        return 1;
    }
    let fits = |n: usize| {
        n * bytes <= 16
            && dim % n == 0
            && x_stride % n == 0
            && split.iter().all(|s| s % n == 0)
            && addrs.iter().all(|a| a % (n * bytes) as u64 == 0)
    };
    candidates
        .iter()
        .copied()
        .filter(|&n| fits(n))
        .max()
        .unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::instances::{self, instances, VALUES};

    #[test]
    fn lanes_keep_every_access_aligned() {
        let all = [2, 4, 8];
        // The shipped mixer's xBC in bf16: a 1,680-wide row (in_proj's output, padded), pieces
        // of 768, 64 and 64.
        let split = [768, 64, 64];
        assert_eq!(lanes(&all, 2, 4, (896, &split, 1680), &[1536, 0, 256]), 8);
        // The unpadded 1,676-wide row: 8 bytes a load at most.
        assert_eq!(lanes(&all, 2, 4, (896, &split, 1676), &[1536, 0, 256]), 4);
        // f32: 16 bytes are 4 channels.
        assert_eq!(lanes(&all, 4, 4, (896, &split, 1680), &[0]), 4);
        // An odd piece, an odd address, a wide kernel: one channel.
        assert_eq!(lanes(&all, 2, 4, (896, &[767, 65, 64], 1680), &[0]), 1);
        assert_eq!(lanes(&all, 2, 4, (896, &split, 1680), &[2]), 1);
        assert_eq!(lanes(&all, 2, 5, (896, &split, 1680), &[0]), 1);
        assert_eq!(lanes(&[2, 4], 2, 4, (896, &split, 1680), &[0]), 4);
    }

    #[test]
    fn widths_pick_their_register_windows() {
        assert_eq!(taps(1), ConvTaps::K4);
        assert_eq!(taps(4), ConvTaps::K4);
        assert_eq!(taps(5), ConvTaps::K8);
        assert_eq!(taps(8), ConvTaps::K8);
        assert_eq!(taps(9), ConvTaps::Any);
        for width in 1..=8 {
            assert!(width <= taps(width).window());
        }
    }

    #[test]
    fn spans_fill_the_gpu_and_cover_every_token() {
        assert_eq!(threads(13), 32);
        assert_eq!(threads(64), 64);
        assert_eq!(threads(1792), 128);
        // One short sequence: one program.
        assert_eq!(span(1, 1, 64, 132), MIN_SPAN);
        // 1M tokens of 64 channels on 132 SMs: 2 · 132 · 32 programs of 125 tokens.
        let s = span(1, 1 << 20, 64, 132);
        assert_eq!(s, 125);
        assert_eq!((1usize << 20).div_ceil(s), 8389);
        // Many channels: programs of at least MIN_SPAN tokens.
        assert_eq!(span(8, 2048, 1792, 132), MIN_SPAN);
        // Sequences too long for the grid's y axis at the span the SMs ask for.
        let long = 1usize << 31;
        assert!(long.div_ceil(span(1, long, 4096, 132)) <= MAX_SPANS);
    }

    #[test]
    fn every_conv_backward_kernel_is_instantiated() {
        let names: Vec<String> = instances().into_iter().map(|k| k.name).collect();
        for t in VALUES {
            for width in [1, 4, 6, 8, 13] {
                let name = instances::causal_conv1d_bwd(t, taps(width));
                assert!(names.contains(&name), "{name}");
            }
        }
    }
}
