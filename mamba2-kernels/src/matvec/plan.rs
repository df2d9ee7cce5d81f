//! How matvec is launched, as pure functions of the shape and the device: the CUDA launcher
//! follows these, and the tests below check them on the CPU.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

/// Warps per program, splitting K (the kernel's `WARPS`).
pub(super) const WARPS: usize = 4;

/// Rows of x per program: the launch's row count rounded up to 1, 2, 4 or 8 (larger launches
/// run in blocks of 8 rows).
pub(super) fn rows_per_program(rows: usize) -> usize {
    rows.next_power_of_two().min(8)
}

/// Columns of y per program for `rows` rows of x per program: 8 (more 16-byte loads in flight per
/// lane) while that still makes ≥ 4 programs per SM, else 2; 4 and 2 at 4 and 8 rows (registers).
pub(super) fn cols_per_program(rows: usize, n: usize, sms: usize) -> usize {
    match rows {
        1 | 2 if n / 8 >= 4 * sms => 8,
        1 | 2 => 2,
        4 => 4,
        _ => 2,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::instances::{self, instances, VALUES};

    #[test]
    fn programs_take_more_columns_for_wide_outputs() {
        assert_eq!(rows_per_program(1), 1);
        assert_eq!(rows_per_program(3), 4);
        assert_eq!(rows_per_program(20), 8);
        // 130m in_proj: N = 3352 < 8 · 4 · 132 columns.
        assert_eq!(cols_per_program(1, 3352, 132), 2);
        assert_eq!(cols_per_program(1, 50_280, 132), 8);
        assert_eq!(cols_per_program(4, 50_280, 132), 4);
        assert_eq!(cols_per_program(8, 50_280, 132), 2);
    }

    #[test]
    fn every_matvec_kernel_is_instantiated() {
        let names: Vec<String> = instances().into_iter().map(|k| k.name).collect();
        for t in VALUES {
            for rows in 1..=9 {
                for n in [100, 50_280] {
                    let r = rows_per_program(rows);
                    let c = cols_per_program(r, n, 132);
                    for vec in [true, false] {
                        let name = instances::matvec(t, r, c, vec);
                        assert!(names.contains(&name), "{name}");
                    }
                }
            }
        }
    }
}
