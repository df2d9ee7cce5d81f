//! e^x and 2^x in f32 without branches or calls, so that element loops vectorise (libm's `expf`
//! is one call per element), and [`vectorised`], which compiles a loop for AVX2 where the CPU
//! has it.
//!
//! ```text
//! 2^x = 2^n · 2^f           n = round(x), f = x − n ∈ [−½, ½] (exact)
//! e^x = 2^n · e^r           n = round(x·log₂e), r = x − n·ln2 (ln2 in two parts, so r is exact
//!                           to a few ulp)
//! e^r ≈ 1 + r + r²·P(r)     Cephes' degree-5 P on |r| ≤ ln2/2: within 1 ulp (the tests)
//! ```
//!
//! 2^n is built from its exponent bits, in two factors when n = 128 (e^x just below f32::MAX).
//! Outside the finite range the result is 0 (x below it, where e^x would be subnormal) or +∞;
//! NaN stays NaN.

const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2: f32 = std::f32::consts::LN_2;
/// ln2 = LN2_HI + LN2_LO with LN2_HI exact in few bits, so n·LN2_HI is exact.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// 1.5·2²³: adding it rounds to an integer, which then sits in the low mantissa bits.
const ROUND: f32 = 12_582_912.0;
/// The range of x (in powers of two) whose 2^x is a normal finite f32.
const POW2_MIN: f32 = -126.0;
const POW2_MAX: f32 = 128.0;

/// Runs `f`, compiled for AVX2 and FMA when the CPU has them (the element loops it inlines then
/// run 8 wide), else as the build's baseline compiles it.
#[inline(always)]
pub(crate) fn vectorised<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2,fma")]
        fn avx2<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has the features `avx2` is compiled for.
            return unsafe { avx2(f) };
        }
    }
    f()
}

/// e^r − 1 − r over r², Cephes' expf polynomial.
#[inline(always)]
fn poly(r: f32) -> f32 {
    let p = 1.987_569_1e-4_f32;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 1.666_666_5e-1;
    p * r + 0.5
}

/// `m · 2^n` for an integral n in [−126, 128], from exponent bits.
#[inline(always)]
fn scale(m: f32, n: f32) -> f32 {
    let top = n > 127.5;
    let n = if top { n - 1.0 } else { n };
    let bits = ((n + ROUND).to_bits() as i32 - ROUND.to_bits() as i32 + 127) << 23;
    let m = m * f32::from_bits(bits as u32);
    if top {
        m * 2.0
    } else {
        m
    }
}

/// The result for x outside [lo, hi] (0 below, +∞ above, NaN for NaN), else `v`.
#[inline(always)]
fn edges(x: f32, v: f32, lo: f32, hi: f32) -> f32 {
    let v = if x < lo { 0.0 } else { v };
    let v = if x > hi { f32::INFINITY } else { v };
    if x.is_nan() {
        x
    } else {
        v
    }
}

/// e^x.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    let (lo, hi) = (POW2_MIN * LN2, 88.722_84);
    let xc = x.max(lo).min(hi);
    let n = (xc * LOG2E + ROUND) - ROUND;
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    let er = 1.0 + r + r * r * poly(r);
    edges(x, scale(er, n), lo, hi)
}

/// 2^x.
#[inline(always)]
pub(crate) fn exp2(x: f32) -> f32 {
    let (lo, hi) = (POW2_MIN, POW2_MAX - 1.0 / 65_536.0);
    let xc = x.max(lo).min(hi);
    let n = (xc + ROUND) - ROUND;
    let r = (xc - n) * LN2;
    let er = 1.0 + r + r * r * poly(r);
    edges(x, scale(er, n), lo, hi)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// |a − b| in units of the last place of b rounded to f32 (of the smallest normal for tiny b).
    fn ulps(a: f32, b: f64) -> f64 {
        let unit = ((b as f32).abs() as f64 * f32::EPSILON as f64).max(f32::MIN_POSITIVE as f64);
        ((a as f64) - b).abs() / unit
    }

    fn worst(f: fn(f32) -> f32, exact: fn(f64) -> f64, (lo, hi, step): (f32, f32, f32)) -> f64 {
        let mut worst: f64 = 0.0;
        let mut x = lo;
        while x < hi {
            worst = worst.max(ulps(f(x), exact(x as f64)));
            x += step;
        }
        worst
    }

    #[test]
    fn exp_and_exp2_are_within_one_and_a_half_ulp_over_the_normal_range() {
        let e = worst(exp, f64::exp, (-87.3, 88.7, 0.000_731));
        let e2 = worst(exp2, f64::exp2, (-125.9, 127.99, 0.000_977));
        assert!(e <= 1.5 && e2 <= 1.5, "exp {e} ulp, exp2 {e2} ulp");
        let v = vectorised(|| worst(exp, f64::exp, (-20.0, 20.0, 0.000_1)));
        assert!(v <= 1.5, "vectorised exp {v} ulp");
    }

    #[test]
    fn edges_are_zero_infinity_and_nan() {
        for f in [exp, exp2] {
            assert_eq!(f(-1000.0), 0.0);
            assert_eq!(f(f32::NEG_INFINITY), 0.0);
            assert_eq!(f(1000.0), f32::INFINITY);
            assert_eq!(f(f32::INFINITY), f32::INFINITY);
            assert!(f(f32::NAN).is_nan());
            assert_eq!(f(0.0), 1.0);
        }
        assert!(exp(88.72).is_finite() && exp(88.72) > 3.3e38);
        assert_eq!(exp2(127.0), 2f32.powi(127));
        assert_eq!(exp2(-126.0), f32::MIN_POSITIVE);
    }
}
