//! The BN-apply prologue of a conv's input in vector lanes: `x = f32(f16(relu(y·s + b)))` for
//! FP16 `y`, per-channel FP32 `s` and `b` (the values the apply op stores, widened again).
//!
//! The scalar path widens `y`, multiplies, adds (each rounded to FP32), clamps at zero (NaN and
//! `−0` to `+0`), stores to FP16 (round to nearest even) and widens back, a pass over the
//! tensor each. The vector path does the same per lane in registers: the same conversion
//! instructions as `convert.rs`, a multiply and an add (never fused), and `max(v, 0)`, which
//! returns its second operand, `+0`, for NaN and for zeros of either sign. So both give the
//! same bits.
#![allow(unsafe_code)]

use half::f16;

use super::convert::{self, Level};

/// `x[i] = f32(f16(relu(f32(y[i])·s[k] + b[k])))` with `k = i mod c`, over whole pixels, where
/// the CPU has a vector path for `c` channels (a multiple of its lanes: 16 with AVX-512F, 8 with
/// F16C). Returns false, leaving `x` untouched, where it has none or the lengths do not match
/// (`y` and `x` whole pixels of the same length, `s` and `b` `c` values each): the caller then
/// runs the scalar path.
pub(crate) fn prologue(c: usize, y: &[f16], s: &[f32], b: &[f32], x: &mut [f32]) -> bool {
    prologue_with(convert::level(), c, y, s, b, x)
}

/// [`prologue`] at a given level (one the CPU lacks returns false).
pub(crate) fn prologue_with(
    level: Level,
    c: usize,
    y: &[f16],
    s: &[f32],
    b: &[f32],
    x: &mut [f32],
) -> bool {
    let lanes = match level {
        Level::Avx512 => 16,
        Level::F16c => 8,
        Level::Portable => return false,
    };
    if c == 0
        || !c.is_multiple_of(lanes)
        || s.len() != c
        || b.len() != c
        || y.len() != x.len()
        || !y.len().is_multiple_of(c)
    {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    match level {
        Level::Avx512
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx2") =>
        {
            // SAFETY: the CPU has AVX-512F and AVX2 (checked just above); `c` is a multiple of
            // 16, `y` and `x` hold the same whole pixels of `c` values, `s` and `b` `c` each
            // (checked above).
            unsafe { x86::avx512(c, y, s, b, x) };
            return true;
        }
        Level::F16c
            if std::arch::is_x86_feature_detected!("f16c")
                && std::arch::is_x86_feature_detected!("avx") =>
        {
            // SAFETY: the CPU has F16C and AVX (checked just above); `c` is a multiple of 8,
            // the lengths as above.
            unsafe { x86::f16c(c, y, s, b, x) };
            return true;
        }
        _ => {}
    }
    let _ = (y, s, b, x);
    false
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use core::arch::x86_64::*;
    use half::f16;

    /// Round to nearest even (as `convert.rs`).
    const NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT;

    // Loads and stores through the masked intrinsics with an all-ones mask, as in
    // `convert.rs` (plain unaligned moves), and pointer arithmetic by `wrapping_add`: the
    // unmasked moves and `add` carry precondition checks the release builds keep.

    /// # Safety
    /// The CPU has AVX-512F and AVX2; `c` is a multiple of 16; `y` and `x` hold the same
    /// number of whole pixels of `c` values; `s` and `b` hold `c` values.
    #[target_feature(enable = "avx512f,avx2")]
    pub(super) unsafe fn avx512(c: usize, y: &[f16], s: &[f32], b: &[f32], x: &mut [f32]) {
        for (yp, xp) in y.chunks_exact(c).zip(x.chunks_exact_mut(c)) {
            for j in (0..c).step_by(16) {
                // SAFETY: `j + 16 <= c`, the length of `yp`, `xp`, `s` and `b` (the
                // function's contract); AVX-512F and AVX2 are enabled on this function.
                unsafe {
                    let h = _mm256_maskload_epi32(
                        yp.as_ptr().wrapping_add(j).cast(),
                        _mm256_set1_epi32(-1),
                    );
                    let v = _mm512_mul_ps(
                        _mm512_cvtph_ps(h),
                        _mm512_maskz_loadu_ps(!0, s.as_ptr().wrapping_add(j)),
                    );
                    let v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(!0, b.as_ptr().wrapping_add(j)));
                    let v = _mm512_max_ps(v, _mm512_setzero_ps());
                    let v = _mm512_cvtph_ps(_mm512_cvtps_ph::<NEAREST>(v));
                    _mm512_mask_storeu_ps(xp.as_mut_ptr().wrapping_add(j), !0, v);
                }
            }
        }
    }

    /// # Safety
    /// The CPU has F16C and AVX; `c` is a multiple of 8; the lengths as [`avx512`].
    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn f16c(c: usize, y: &[f16], s: &[f32], b: &[f32], x: &mut [f32]) {
        for (yp, xp) in y.chunks_exact(c).zip(x.chunks_exact_mut(c)) {
            for j in (0..c).step_by(8) {
                // SAFETY: `j + 8 <= c`, the length of `yp`, `xp`, `s` and `b` (the function's
                // contract); F16C and AVX are enabled on this function.
                unsafe {
                    let all = _mm256_set1_epi32(-1);
                    let h = _mm_castps_si128(_mm_maskload_ps(
                        yp.as_ptr().wrapping_add(j).cast(),
                        _mm_set1_epi32(-1),
                    ));
                    let v = _mm256_mul_ps(
                        _mm256_cvtph_ps(h),
                        _mm256_maskload_ps(s.as_ptr().wrapping_add(j), all),
                    );
                    let v = _mm256_add_ps(v, _mm256_maskload_ps(b.as_ptr().wrapping_add(j), all));
                    let v = _mm256_max_ps(v, _mm256_setzero_ps());
                    let v = _mm256_cvtph_ps(_mm256_cvtps_ph::<NEAREST>(v));
                    _mm256_maskstore_ps(xp.as_mut_ptr().wrapping_add(j), all, v);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::convert::tests::has;
    use super::*;

    /// The scalar path written out: widen, multiply, add, clamp, store, widen.
    fn written_out(c: usize, y: &[f16], s: &[f32], b: &[f32]) -> Vec<f32> {
        y.iter()
            .enumerate()
            .map(|(i, v)| {
                let k = i % c;
                let v = v.to_f32() * s[k] + b[k];
                let v = if v > 0.0 { v } else { 0.0 };
                f16::from_f32(v).to_f32()
            })
            .collect()
    }

    #[test]
    fn every_level_matches_the_scalar_path_bit_for_bit() {
        // Every FP16 bit pattern as an input (NaN, infinities, subnormals, both zeros), with
        // scales and biases that overflow, underflow, cancel and tie when rounded to FP16.
        let y: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
        for c in [8, 16, 32, 48] {
            let n = y.len() / c * c;
            let s: Vec<f32> = (0..c)
                .map(|k| [1.0, -1.0, 3.5e4, 1e-6, 0.3, -2.0, 1.0 + 2f32.powi(-11), 0.0][k % 8])
                .collect();
            let b: Vec<f32> = (0..c)
                .map(|k| [0.0, -0.0, 1.0, -3.0, 2f32.powi(-25), 6.0e4, -1e-3, 0.5][(k / 2) % 8])
                .collect();
            let want = written_out(c, &y[..n], &s, &b);
            for level in [Level::Avx512, Level::F16c] {
                let mut got = vec![f32::NAN; n];
                if !prologue_with(level, c, &y[..n], &s, &b, &mut got) {
                    // Only a level this CPU lacks, or 8 channels on the 16-lane path, decline.
                    assert!(
                        level == Level::Avx512 && c % 16 != 0 || !has(level),
                        "{level:?} {c}"
                    );
                    continue;
                }
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(g.to_bits(), w.to_bits(), "{level:?} c {c} [{i}] y {}", y[i]);
                }
            }
        }
    }

    #[test]
    fn shapes_without_a_vector_path_are_declined() {
        let y = vec![f16::ONE; 24];
        let mut x = vec![0.0; 24];
        // 12 channels: not a multiple of 8 lanes; mismatched lengths; no channels.
        assert!(!prologue_with(
            Level::F16c,
            12,
            &y,
            &[1.0; 12],
            &[0.0; 12],
            &mut x
        ));
        assert!(!prologue_with(
            Level::F16c,
            8,
            &y,
            &[1.0; 8],
            &[0.0; 7],
            &mut x
        ));
        assert!(!prologue_with(
            Level::F16c,
            8,
            &y[..16],
            &[1.0; 8],
            &[0.0; 8],
            &mut x
        ));
        assert!(!prologue_with(Level::F16c, 0, &y, &[], &[], &mut x));
        assert!(!prologue_with(
            Level::Portable,
            8,
            &y,
            &[1.0; 8],
            &[0.0; 8],
            &mut x
        ));
        assert!(
            x.iter().all(|&v| v == 0.0),
            "a declined call leaves x untouched"
        );
    }
}
