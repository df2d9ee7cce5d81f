//! How the norms are launched, as pure functions of the rows: the CUDA launchers follow them, and
//! the tests below check them on the CPU.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use crate::instances::RowKind;

/// Values a thread holds in registers in the `Vec` and `Reg` kernels.
const PER_THREAD: usize = 8;
/// Threads an SM holds at once (sm_80 and sm_90), and programs at most.
const SM_THREADS: usize = 2048;
const SM_PROGRAMS: usize = 32;
/// Programs of the backward per group, in full loads of every SM: enough to keep the GPU busy,
/// few enough that their rows of dweight sums stay small beside the inputs.
const BWD_WAVES: usize = 2;

/// Threads per row program and the kernel variant: `Vec` (8 consecutive values per thread in
/// registers, 16-byte accesses) when the rows allow it (`aligned`, a length that is a multiple of
/// 8), else `Reg` (8 strided values per thread) for rows up to 1024·8 values, `Loop` beyond.
pub(super) fn row_program(len: usize, aligned: bool) -> (usize, RowKind) {
    let threads = (len.div_ceil(PER_THREAD).div_ceil(32) * 32).clamp(32, 1024);
    let in_registers = len <= threads * PER_THREAD;
    let kind = match (in_registers, aligned && len % PER_THREAD == 0) {
        (true, true) => RowKind::Vec,
        (true, false) => RowKind::Reg,
        (false, _) => RowKind::Loop,
    };
    (threads, kind)
}

/// The backward's threads per program and kernel variant for groups of `len` values: as
/// [`row_program`] with scalar accesses (`Reg`, or `Loop` past 1024·8 values).
pub(super) fn bwd_row_program(len: usize) -> (usize, RowKind) {
    row_program(len, false)
}

/// Programs of the backward per group (each takes every `programs`-th row) for `rows` rows of
/// `groups` groups, `threads` threads per program, on `sms` SMs: [`BWD_WAVES`] full loads of the
/// GPU, at most one per row.
pub(super) fn bwd_programs(rows: usize, groups: usize, threads: usize, sms: usize) -> usize {
    let resident = (SM_THREADS / threads.max(1)).clamp(1, SM_PROGRAMS);
    (sms * resident * BWD_WAVES)
        .div_ceil(groups.max(1))
        .clamp(1, rows.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::instances::{self, instances, VALUES};

    #[test]
    fn rows_in_registers_up_to_8192_values() {
        assert_eq!(row_program(768, true), (96, RowKind::Vec));
        assert_eq!(row_program(768, false), (96, RowKind::Reg));
        assert_eq!(row_program(770, true), (128, RowKind::Reg));
        assert_eq!(row_program(5, true), (32, RowKind::Reg));
        assert_eq!(row_program(8192, true), (1024, RowKind::Vec));
        assert_eq!(row_program(8200, true), (1024, RowKind::Loop));
    }

    #[test]
    fn backward_programs_fill_the_gpu() {
        assert_eq!(bwd_row_program(1536), (192, RowKind::Reg));
        assert_eq!(bwd_row_program(13), (32, RowKind::Reg));
        assert_eq!(bwd_row_program(8200), (1024, RowKind::Loop));
        // 192 threads: 10 programs per SM, 2 · 132 · 10 in all.
        assert_eq!(bwd_programs(16_384, 1, 192, 132), 2640);
        assert_eq!(bwd_programs(16_384, 8, 192, 132), 330);
        // Never more programs than rows.
        assert_eq!(bwd_programs(3, 1, 32, 132), 3);
        assert_eq!(bwd_programs(1, 4, 1024, 132), 1);
    }

    #[test]
    fn every_norm_kernel_is_instantiated() {
        let names: Vec<String> = instances().into_iter().map(|k| k.name).collect();
        for t in VALUES {
            for (len, aligned) in [(768, true), (768, false), (9000, true)] {
                let kind = row_program(len, aligned).1;
                for name in [
                    instances::gated_rms_norm(t, kind),
                    instances::add_rms_norm(t, true, kind),
                    instances::add_rms_norm(t, false, kind),
                ] {
                    assert!(names.contains(&name), "{name}");
                }
            }
            for len in [13, 768, 9000] {
                let kind = bwd_row_program(len).1;
                for name in [
                    instances::gated_rms_norm_bwd(t, kind),
                    instances::rms_norm_bwd(t, kind),
                ] {
                    assert!(names.contains(&name), "{name}");
                }
            }
        }
    }
}
