//! How the decode step is launched, as pure functions of the problem and the device: the CUDA
//! launcher follows these, and the tests below check them on the CPU.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use crate::instances::StepPath;

/// Warps per program (one state row each at a time) and state rows per program: one warp per
/// state row while the (batch, head) pairs alone cannot fill the GPU (fewer than 4 per SM), a
/// whole head per program once they can (fewer, longer programs stream better at large batch).
pub(super) fn rows(batch_heads: usize, headdim: usize, sms: usize) -> (usize, usize) {
    let warps = headdim.clamp(1, 8);
    let rows = if batch_heads < 4 * sms {
        warps
    } else {
        headdim
    };
    (warps, rows)
}

/// The state-row kernel: 4 columns per lane (16-byte f32 or 8-byte 2-byte accesses) when N is a
/// multiple of 4 up to 256 and `aligned` (B, C and the state rows at vector boundaries), in
/// registers for up to 128 columns (`Vec1`) or 256 (`Vec2`); else one column at a time.
pub(super) fn path(dstate: usize, aligned: bool) -> StepPath {
    match (dstate % 4 == 0 && dstate <= 256 && aligned, dstate <= 128) {
        (false, _) => StepPath::Scalar,
        (true, true) => StepPath::Vec1,
        (true, false) => StepPath::Vec2,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::instances::{self, instances, STATES, VALUES};

    #[test]
    fn small_batches_spread_rows_over_programs() {
        assert_eq!(rows(24, 64, 132), (8, 8));
        assert_eq!(rows(64 * 24, 64, 132), (8, 64));
        assert_eq!(rows(1, 4, 132), (4, 4));
    }

    #[test]
    fn vector_paths_need_aligned_rows_of_at_most_256() {
        assert_eq!(path(128, true), StepPath::Vec1);
        assert_eq!(path(256, true), StepPath::Vec2);
        assert_eq!(path(512, true), StepPath::Scalar);
        assert_eq!(path(130, true), StepPath::Scalar);
        assert_eq!(path(64, false), StepPath::Scalar);
    }

    #[test]
    fn every_step_kernel_is_instantiated() {
        let names: Vec<String> = instances().into_iter().map(|k| k.name).collect();
        for t in VALUES {
            for s in STATES {
                for n in [16, 128, 200, 256, 300] {
                    for aligned in [true, false] {
                        let name = instances::ssd_step(t, s, path(n, aligned));
                        assert!(names.contains(&name), "{name}");
                    }
                }
            }
        }
    }
}
