//! FP16 ↔ FP32 slice conversions with the widest instructions the CPU has, chosen at run time.
//!
//! The CPU executor widens every FP16 operand to FP32 and rounds every result back, so these
//! two loops are a tenth of a training step. The `half` crate converts eight values per call
//! where the build does not target F16C (and a crate that depends on ours picks its own build
//! flags), so this module dispatches itself: AVX-512F (16 per instruction) where the CPU has
//! it, else F16C (8), else `half`'s portable code. All three give the same bits: widening is
//! exact, and narrowing rounds to nearest even in each (the instructions' immediate
//! `_MM_FROUND_TO_NEAREST_INT`, the IEEE default that `half` implements in software).
#![allow(unsafe_code)]

use half::f16;
use half::slice::HalfFloatSliceExt;

/// The instruction set a conversion runs with (see [`level`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Level {
    /// `half`'s conversions (F16C where the build targets it, else software).
    Portable,
    /// F16C with AVX (8 lanes).
    F16c,
    /// AVX-512F (16 lanes).
    Avx512,
}

/// The widest conversion this CPU runs (feature detection is cached by the standard library).
pub(crate) fn level() -> Level {
    let cap = super::simd::cap();
    #[cfg(target_arch = "x86_64")]
    {
        use super::simd::CpuSimd;
        if cap == CpuSimd::Portable {
            return Level::Portable;
        }
        if cap >= CpuSimd::Avx512
            && std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx2")
        {
            return Level::Avx512;
        }
        if std::arch::is_x86_feature_detected!("f16c") && std::arch::is_x86_feature_detected!("avx")
        {
            return Level::F16c;
        }
    }
    let _ = cap;
    Level::Portable
}

/// The instruction sets the CPU executor runs with on this machine, chosen at run time, e.g.
/// `"AVX-512F FP16 conversions, AVX-512F conv tiles, AVX-512F channel sums, AVX2+FMA GEMM"`:
/// the conversions here (and the prologue, `prologue.rs`, which uses the same instructions),
/// the conv tiles read straight from their padded source (`direct.rs`), the per-channel sums
/// (`sums.rs`), and the `gemm` crate's kernels for the other products (it picks them the same
/// way: FMA where the CPU has it).
pub fn cpu_paths() -> String {
    let conversions = match level() {
        Level::Avx512 => "AVX-512F",
        Level::F16c => "F16C",
        Level::Portable => "portable",
    };
    let tiles = match super::direct::level() {
        super::direct::Level::Avx512 => "AVX-512F conv tiles",
        super::direct::Level::Avx2 => "AVX2+FMA conv tiles",
        super::direct::Level::None => "gathered conv tiles",
    };
    let sums = match super::sums::level() {
        super::sums::Level::Avx512 => "AVX-512F channel sums",
        super::sums::Level::Avx => "AVX channel sums",
        super::sums::Level::Portable => "scalar channel sums",
    };
    #[cfg(target_arch = "x86_64")]
    let gemm = if std::arch::is_x86_feature_detected!("fma") {
        "AVX2+FMA"
    } else {
        "scalar"
    };
    #[cfg(not(target_arch = "x86_64"))]
    let gemm = "the gemm crate's";
    format!("{conversions} FP16 conversions, {tiles}, {sums}, {gemm} GEMM")
}

/// `dst[i] = src[i]` widened, for `i < min(src.len(), dst.len())`.
pub(crate) fn widen(src: &[f16], dst: &mut [f32]) {
    let level = level();
    in_parts(src, dst, |s, d| widen_with(level, s, d));
}

/// `dst[i] = src[i]` rounded to nearest even, for `i < min(src.len(), dst.len())`.
pub(crate) fn narrow(src: &[f32], dst: &mut [f16]) {
    let level = level();
    in_parts(src, dst, |s, d| narrow_with(level, s, d));
}

/// Elements per part of a conversion split over rayon's threads: a whole activation tensor
/// converted between two parallel loops would otherwise leave the other threads waiting; a
/// block converted inside one of those loops (far shorter) stays on its thread.
const PART: usize = 32 * 1024;

/// `convert(src, dst)` over the common length, in parts of [`PART`] elements over the
/// threads where there are several (each element is converted alone, so the parts do not
/// change a bit).
fn in_parts<S: Sync, D: Send>(src: &[S], dst: &mut [D], convert: impl Fn(&[S], &mut [D]) + Sync) {
    let n = src.len().min(dst.len());
    let (src, dst) = (&src[..n], &mut dst[..n]);
    if n < 2 * PART || rayon::current_num_threads() < 2 {
        convert(src, dst);
        return;
    }
    use rayon::prelude::*;
    dst.par_chunks_mut(PART)
        .zip(src.par_chunks(PART))
        .for_each(|(d, s)| convert(s, d));
}

/// [`widen`] at a given level; a level the CPU lacks falls back to [`Level::Portable`].
pub(crate) fn widen_with(level: Level, src: &[f16], dst: &mut [f32]) {
    let n = src.len().min(dst.len());
    let (src, dst) = (&src[..n], &mut dst[..n]);
    #[cfg(target_arch = "x86_64")]
    match level {
        Level::Avx512
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx2") =>
        {
            // SAFETY: the CPU has AVX-512F and AVX2 (checked just above).
            unsafe { x86::widen_avx512(src, dst) };
            return;
        }
        Level::F16c
            if std::arch::is_x86_feature_detected!("f16c")
                && std::arch::is_x86_feature_detected!("avx") =>
        {
            // SAFETY: the CPU has F16C and AVX (checked just above).
            unsafe { x86::widen_f16c(src, dst) };
            return;
        }
        _ => {}
    }
    let _ = level;
    src.convert_to_f32_slice(dst);
}

/// [`narrow`] at a given level; a level the CPU lacks falls back to [`Level::Portable`].
pub(crate) fn narrow_with(level: Level, src: &[f32], dst: &mut [f16]) {
    let n = src.len().min(dst.len());
    let (src, dst) = (&src[..n], &mut dst[..n]);
    #[cfg(target_arch = "x86_64")]
    match level {
        Level::Avx512
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx2") =>
        {
            // SAFETY: the CPU has AVX-512F and AVX2 (checked just above).
            unsafe { x86::narrow_avx512(src, dst) };
            return;
        }
        Level::F16c
            if std::arch::is_x86_feature_detected!("f16c")
                && std::arch::is_x86_feature_detected!("avx") =>
        {
            // SAFETY: the CPU has F16C and AVX (checked just above).
            unsafe { x86::narrow_f16c(src, dst) };
            return;
        }
        _ => {}
    }
    let _ = level;
    dst.convert_from_f32_slice(src);
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use core::arch::x86_64::*;
    use half::f16;
    use half::slice::HalfFloatSliceExt;

    /// Round to nearest even (the rounding field of `vcvtps2ph`'s immediate; MXCSR masks the
    /// floating-point exceptions, so none traps).
    const NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT;

    // Loads and stores below go through the masked intrinsics with an all-ones mask, which
    // compile to plain unaligned moves: the unmasked ones go through `ptr::read_unaligned` /
    // `write_unaligned`, whose precondition checks this workspace's release builds keep (and
    // which then bounce every vector through the stack).

    /// # Safety
    /// The CPU must have AVX-512F and AVX2; `src` and `dst` have the same length.
    #[target_feature(enable = "avx512f,avx2")]
    pub(super) unsafe fn widen_avx512(src: &[f16], dst: &mut [f32]) {
        debug_assert_eq!(src.len(), dst.len());
        let mut s = src.chunks_exact(16);
        let mut d = dst.chunks_exact_mut(16);
        for (s, d) in (&mut s).zip(&mut d) {
            // SAFETY: `s` holds 16 f16 (32 bytes, unaligned load) and `d` 16 f32 (64 bytes,
            // unaligned store); AVX-512F and AVX2 are enabled on this function.
            unsafe {
                let h = _mm256_maskload_epi32(s.as_ptr().cast(), _mm256_set1_epi32(-1));
                _mm512_mask_storeu_ps(d.as_mut_ptr(), !0, _mm512_cvtph_ps(h));
            }
        }
        // Fewer than 16 left: the portable path (exact either way).
        s.remainder().convert_to_f32_slice(d.into_remainder());
    }

    /// # Safety
    /// The CPU must have AVX-512F and AVX2; `src` and `dst` have the same length.
    #[target_feature(enable = "avx512f,avx2")]
    pub(super) unsafe fn narrow_avx512(src: &[f32], dst: &mut [f16]) {
        debug_assert_eq!(src.len(), dst.len());
        let mut s = src.chunks_exact(16);
        let mut d = dst.chunks_exact_mut(16);
        for (s, d) in (&mut s).zip(&mut d) {
            // SAFETY: `s` holds 16 f32 (64 bytes, unaligned load) and `d` 16 f16 (32 bytes,
            // unaligned store); AVX-512F and AVX2 are enabled on this function.
            unsafe {
                let v = _mm512_maskz_loadu_ps(!0, s.as_ptr());
                let h = _mm512_cvtps_ph::<NEAREST>(v);
                _mm256_maskstore_epi32(d.as_mut_ptr().cast(), _mm256_set1_epi32(-1), h);
            }
        }
        d.into_remainder().convert_from_f32_slice(s.remainder());
    }

    /// # Safety
    /// The CPU must have F16C and AVX; `src` and `dst` have the same length.
    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn widen_f16c(src: &[f16], dst: &mut [f32]) {
        debug_assert_eq!(src.len(), dst.len());
        let mut s = src.chunks_exact(8);
        let mut d = dst.chunks_exact_mut(8);
        for (s, d) in (&mut s).zip(&mut d) {
            // SAFETY: `s` holds 8 f16 (16 bytes, unaligned load) and `d` 8 f32 (32 bytes,
            // unaligned store); F16C and AVX are enabled on this function.
            unsafe {
                let h = _mm_castps_si128(_mm_maskload_ps(s.as_ptr().cast(), _mm_set1_epi32(-1)));
                _mm256_maskstore_ps(d.as_mut_ptr(), _mm256_set1_epi32(-1), _mm256_cvtph_ps(h));
            }
        }
        s.remainder().convert_to_f32_slice(d.into_remainder());
    }

    /// # Safety
    /// The CPU must have F16C and AVX; `src` and `dst` have the same length.
    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn narrow_f16c(src: &[f32], dst: &mut [f16]) {
        debug_assert_eq!(src.len(), dst.len());
        let mut s = src.chunks_exact(8);
        let mut d = dst.chunks_exact_mut(8);
        for (s, d) in (&mut s).zip(&mut d) {
            // SAFETY: `s` holds 8 f32 (32 bytes, unaligned load) and `d` 8 f16 (16 bytes,
            // unaligned store); F16C and AVX are enabled on this function.
            unsafe {
                let v = _mm256_maskload_ps(s.as_ptr(), _mm256_set1_epi32(-1));
                let h = _mm_castsi128_ps(_mm256_cvtps_ph::<NEAREST>(v));
                _mm_maskstore_ps(d.as_mut_ptr().cast(), _mm_set1_epi32(-1), h);
            }
        }
        d.into_remainder().convert_from_f32_slice(s.remainder());
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Every FP16 bit pattern widens to the same f32 bits at every level.
    #[test]
    fn every_level_widens_every_f16_alike() {
        let all: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
        let mut want = vec![0f32; all.len()];
        all.convert_to_f32_slice(&mut want);
        for level in [Level::Portable, Level::F16c, Level::Avx512] {
            // Odd lengths and offsets exercise the tails.
            for (start, end) in [(0, all.len()), (3, all.len() - 5), (1, 30)] {
                let mut got = vec![0f32; end - start];
                widen_with(level, &all[start..end], &mut got);
                let same = got
                    .iter()
                    .zip(&want[start..end])
                    .all(|(g, w)| g.to_bits() == w.to_bits());
                assert!(same, "{level:?} [{start}..{end}] widens differently");
            }
        }
    }

    /// Narrowing agrees with `half` at every level on values that stress rounding: every f16,
    /// the midpoints between neighbours (ties to even), values just off them, overflow to
    /// infinity, subnormals, NaNs.
    #[test]
    fn every_level_narrows_like_half() {
        let mut src = Vec::new();
        for bits in 0..=u16::MAX {
            let v = f16::from_bits(bits).to_f32();
            let next = f16::from_bits(bits.wrapping_add(1)).to_f32();
            src.push(v);
            if v.is_finite() && next.is_finite() {
                let mid = (f64::from(v) + f64::from(next)) / 2.0;
                src.push(mid as f32);
                src.push(f32::from_bits((mid as f32).to_bits() + 1));
                src.push(f32::from_bits((mid as f32).to_bits().wrapping_sub(1)));
            }
        }
        src.extend([
            65520.0,
            65519.99,
            -65520.0,
            1e-8,
            -6e-8,
            f32::MIN_POSITIVE,
            f32::NAN,
        ]);
        let want: Vec<u16> = src.iter().map(|&v| f16::from_f32(v).to_bits()).collect();
        for level in [Level::Portable, Level::F16c, Level::Avx512] {
            for (start, end) in [(0, src.len()), (7, src.len() - 3), (2, 17)] {
                let mut got = vec![f16::ZERO; end - start];
                narrow_with(level, &src[start..end], &mut got);
                for (i, (g, w)) in got.iter().zip(&want[start..end]).enumerate() {
                    let (g, w) = (g.to_bits(), *w);
                    // NaN payloads may differ; a NaN must stay a NaN.
                    let both_nan = f16::from_bits(g).is_nan() && f16::from_bits(w).is_nan();
                    assert!(
                        g == w || both_nan,
                        "{level:?}: {} narrows to {g:#06x}, half gives {w:#06x}",
                        src[start + i]
                    );
                }
            }
        }
    }

    /// Conversions long enough to go in parts over the threads give every element what the
    /// one-thread conversion gives, including the part boundaries and a short last part.
    #[test]
    fn conversions_in_parts_match_the_whole() {
        let n = 5 * PART / 2 + 7;
        let wide: Vec<f32> = (0..n).map(|i| (i as f32 - 1e4) * 0.37 + 0.001).collect();
        let mut half = vec![f16::ZERO; n];
        let mut back = vec![0f32; n];
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .expect("a thread pool");
        pool.install(|| {
            narrow(&wide, &mut half);
            widen(&half, &mut back);
        });
        for i in 0..n {
            assert_eq!(
                half[i].to_bits(),
                f16::from_f32(wide[i]).to_bits(),
                "narrow [{i}]"
            );
            assert_eq!(back[i].to_bits(), half[i].to_f32().to_bits(), "widen [{i}]");
        }
        // A destination shorter than the source: only the common length is written.
        let mut short = vec![0f32; n - 3];
        pool.install(|| widen(&half, &mut short));
        assert!(short
            .iter()
            .zip(&half)
            .all(|(s, h)| s.to_bits() == h.to_f32().to_bits()));
    }

    /// This machine's level is at least what its features promise (the test names it).
    #[test]
    fn the_level_matches_the_cpu() {
        let l = level();
        println!("FP16 conversions on this CPU: {l:?}");
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            assert_eq!(l, Level::Avx512);
        }
    }

    /// Whether this CPU has `level`'s instructions.
    pub(crate) fn has(level: Level) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            match level {
                Level::Avx512 => std::arch::is_x86_feature_detected!("avx512f"),
                Level::F16c => std::arch::is_x86_feature_detected!("f16c"),
                Level::Portable => true,
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            level == Level::Portable
        }
    }
}
