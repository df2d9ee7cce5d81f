//! How the norms are launched, as a pure function of the row: the CUDA launchers follow it, and
//! the tests below check it on the CPU.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use crate::instances::RowKind;

/// Values a thread holds in registers in the `Vec` and `Reg` kernels.
const PER_THREAD: usize = 8;

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
        }
    }
}
