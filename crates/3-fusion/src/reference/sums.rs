//! Per-channel `f64` sums over NHWC rows: GenStats' `[Σy, Σy²]` and a BN backward's
//! `[Σ dz·x̂, Σ dz]`, added to running sums one row at a time.
//!
//! The vector paths give each channel a lane and add the rows in order, with the scalar loop's
//! operations in the scalar loop's order (a separate multiply and add, never a fused one), so
//! every level gives the same bits: a channel's sums never meet another channel's.
#![allow(unsafe_code)]

use std::ops::Range;

use super::element::Real;

/// What one row adds to a channel's two sums.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Terms<'a, A> {
    /// GenStats: `[y, y·y]`, in `f64`.
    Genstats,
    /// A BN backward in `f64`: `[dz·x̂, dz]` with `x̂ = (y − mean)·inv_std` (per channel).
    Bwd64 {
        /// The saved mean, widened to `f64`.
        mean: &'a [f64],
        /// The saved inverse standard deviation, widened to `f64`.
        inv_std: &'a [f64],
    },
    /// The reduction graph's: `[dz·x̂, dz]` with `x̂ = (y − mean)·inv_std` and `dz·x̂` rounded to
    /// the arithmetic type (its FP32 virtual tensors), then widened and summed in `f64`.
    BwdArith {
        /// The saved mean.
        mean: &'a [A],
        /// The saved inverse standard deviation.
        inv_std: &'a [A],
    },
}

/// The instruction set of the vector paths (see [`level`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Level {
    /// The scalar loop.
    Portable,
    /// AVX: four `f64` lanes.
    Avx,
    /// AVX-512F: eight `f64` lanes.
    Avx512,
}

/// The widest level this CPU runs under the cap in force (`simd.rs`).
pub(crate) fn level() -> Level {
    use super::simd::CpuSimd;
    let cap = super::simd::cap();
    if cap >= CpuSimd::Avx512 && has(Level::Avx512) {
        Level::Avx512
    } else if cap >= CpuSimd::Avx2 && has(Level::Avx) {
        Level::Avx
    } else {
        Level::Portable
    }
}

/// Adds the rows of `y` (and of `dz`, except for GenStats; `acc.len()` channels each) to
/// `acc[channel]`, row after row, at the widest [`level`].
pub(crate) fn add_rows<A: Real>(terms: Terms<'_, A>, y: &[A], dz: &[A], acc: &mut [[f64; 2]]) {
    add_rows_with(level(), terms, y, dz, acc);
}

/// [`add_rows`] at a given level (a level the CPU lacks, an arithmetic type other than `f32`
/// or operands of other lengths run the scalar loop).
pub(crate) fn add_rows_with<A: Real>(
    level: Level,
    terms: Terms<'_, A>,
    y: &[A],
    dz: &[A],
    acc: &mut [[f64; 2]],
) {
    let c = acc.len();
    // The operands as `f32` (none for `f64`).
    let as_f32 = match terms {
        Terms::Genstats => Some(Terms::Genstats),
        Terms::Bwd64 { mean, inv_std } => Some(Terms::Bwd64 { mean, inv_std }),
        Terms::BwdArith { mean, inv_std } => A::as_f32(mean)
            .zip(A::as_f32(inv_std))
            .map(|(mean, inv_std)| Terms::BwdArith { mean, inv_std }),
    }
    .zip(A::as_f32(y).zip(A::as_f32(dz)));
    let vector = match as_f32 {
        Some((t, (y, dz))) if fits(&t, y, dz, c) => vectors(level, &t, y, dz, acc),
        _ => 0,
    };
    scalar(&terms, y, dz, vector..c, acc);
}

/// Whether the operands hold whole rows of `c` channels (and `dz` as many as `y`, the
/// statistics `c` values each), so the vector paths read only within them.
fn fits(terms: &Terms<'_, f32>, y: &[f32], dz: &[f32], c: usize) -> bool {
    let per_channel = match terms {
        Terms::Genstats => true,
        Terms::Bwd64 { mean, inv_std } => mean.len() >= c && inv_std.len() >= c,
        Terms::BwdArith { mean, inv_std } => mean.len() >= c && inv_std.len() >= c,
    };
    let dz_ok = matches!(terms, Terms::Genstats) || dz.len() == y.len();
    c > 0 && y.len().is_multiple_of(c) && dz_ok && per_channel
}

/// The scalar loop over channels `ks` of every row.
fn scalar<A: Real>(
    terms: &Terms<'_, A>,
    y: &[A],
    dz: &[A],
    ks: Range<usize>,
    acc: &mut [[f64; 2]],
) {
    let c = acc.len();
    if ks.is_empty() || c == 0 {
        return;
    }
    let acc = &mut acc[ks.clone()];
    match *terms {
        Terms::Genstats => {
            for yp in y.chunks_exact(c) {
                for (a, v) in acc.iter_mut().zip(&yp[ks.clone()]) {
                    let v = v.to_f64();
                    a[0] += v;
                    a[1] += v * v;
                }
            }
        }
        Terms::Bwd64 { mean, inv_std } => {
            let (mean, inv_std) = (&mean[ks.clone()], &inv_std[ks.clone()]);
            for (yp, dp) in y.chunks_exact(c).zip(dz.chunks_exact(c)) {
                let (yp, dp) = (&yp[ks.clone()], &dp[ks.clone()]);
                for k in 0..acc.len() {
                    let x_hat = (yp[k].to_f64() - mean[k]) * inv_std[k];
                    let d = dp[k].to_f64();
                    acc[k][0] += d * x_hat;
                    acc[k][1] += d;
                }
            }
        }
        Terms::BwdArith { mean, inv_std } => {
            let (mean, inv_std) = (&mean[ks.clone()], &inv_std[ks.clone()]);
            for (yp, dp) in y.chunks_exact(c).zip(dz.chunks_exact(c)) {
                let (yp, dp) = (&yp[ks.clone()], &dp[ks.clone()]);
                for k in 0..acc.len() {
                    let x_hat = (yp[k] - mean[k]) * inv_std[k];
                    acc[k][0] += (dp[k] * x_hat).to_f64();
                    acc[k][1] += dp[k].to_f64();
                }
            }
        }
    }
}

/// The vector paths over the first channels, in whole vectors; returns how many channels they
/// covered (the rest go through the scalar loop). Operands checked by [`fits`].
fn vectors(
    level: Level,
    terms: &Terms<'_, f32>,
    y: &[f32],
    dz: &[f32],
    acc: &mut [[f64; 2]],
) -> usize {
    #[cfg(target_arch = "x86_64")]
    match level {
        Level::Avx512 if has(Level::Avx512) => {
            // SAFETY: the CPU has AVX-512F and AVX (checked just above); `fits` checked that
            // `y` (and `dz`) hold whole rows of `acc.len()` channels and the statistics
            // `acc.len()` values.
            return unsafe { x86::avx512(terms, y, dz, acc) };
        }
        Level::Avx if has(Level::Avx) => {
            // SAFETY: as above, with AVX checked just above.
            return unsafe { x86::avx(terms, y, dz, acc) };
        }
        _ => {}
    }
    let _ = (level, terms, y, dz, acc);
    0
}

/// Whether this CPU has `level`'s instruction sets.
fn has(level: Level) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let avx = std::arch::is_x86_feature_detected!("avx");
        match level {
            Level::Avx512 => avx && std::arch::is_x86_feature_detected!("avx512f"),
            Level::Avx => avx,
            Level::Portable => true,
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        level == Level::Portable
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use core::arch::x86_64::*;

    use super::Terms;

    /// One vector register of `f64` lanes, and the `f32` vector of as many lanes.
    trait Lanes: Copy {
        const N: usize;
        /// # Safety
        /// `p` is valid for `N` reads; the CPU has the vector's instruction set.
        unsafe fn load(p: *const f64) -> Self;
        /// # Safety
        /// `p` is valid for `N` writes; the CPU has the vector's instruction set.
        unsafe fn store(self, p: *mut f64);
        /// `N` `f32` values widened (exact).
        ///
        /// # Safety
        /// `p` is valid for `N` reads; the CPU has the vector's instruction set.
        unsafe fn widen(p: *const f32) -> Self;
        /// # Safety
        /// The CPU has the vector's instruction set.
        unsafe fn add(a: Self, b: Self) -> Self;
        /// # Safety
        /// The CPU has the vector's instruction set.
        unsafe fn sub(a: Self, b: Self) -> Self;
        /// # Safety
        /// The CPU has the vector's instruction set.
        unsafe fn mul(a: Self, b: Self) -> Self;
        /// `[dz·((y − mean)·inv_std), dz]` with the arithmetic in `f32`, widened.
        ///
        /// # Safety
        /// Each pointer is valid for `N` reads; the CPU has the vector's instruction set.
        unsafe fn bwd_arith(
            y: *const f32,
            dz: *const f32,
            mean: *const f32,
            inv_std: *const f32,
        ) -> (Self, Self);
    }

    // Loads and stores go through the masked intrinsics with an all-ones mask, which compile
    // to plain unaligned moves: the unmasked ones go through `ptr::read_unaligned` /
    // `write_unaligned`, whose precondition checks this workspace's release builds keep.

    impl Lanes for __m256d {
        const N: usize = 4;
        #[inline(always)]
        unsafe fn load(p: *const f64) -> Self {
            // SAFETY: the caller's contract.
            unsafe { _mm256_maskload_pd(p, _mm256_set1_epi64x(-1)) }
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f64) {
            // SAFETY: the caller's contract.
            unsafe { _mm256_maskstore_pd(p, _mm256_set1_epi64x(-1), self) }
        }
        #[inline(always)]
        unsafe fn widen(p: *const f32) -> Self {
            // SAFETY: the caller's contract.
            unsafe { _mm256_cvtps_pd(_mm_maskload_ps(p, _mm_set1_epi32(-1))) }
        }
        #[inline(always)]
        unsafe fn add(a: Self, b: Self) -> Self {
            // SAFETY: the caller's contract (the CPU has AVX).
            unsafe { _mm256_add_pd(a, b) }
        }
        #[inline(always)]
        unsafe fn sub(a: Self, b: Self) -> Self {
            // SAFETY: the caller's contract.
            unsafe { _mm256_sub_pd(a, b) }
        }
        #[inline(always)]
        unsafe fn mul(a: Self, b: Self) -> Self {
            // SAFETY: the caller's contract.
            unsafe { _mm256_mul_pd(a, b) }
        }
        #[inline(always)]
        unsafe fn bwd_arith(
            y: *const f32,
            dz: *const f32,
            mean: *const f32,
            inv_std: *const f32,
        ) -> (Self, Self) {
            // SAFETY: the caller's contract.
            unsafe {
                let all = _mm_set1_epi32(-1);
                let x_hat = _mm_mul_ps(
                    _mm_sub_ps(_mm_maskload_ps(y, all), _mm_maskload_ps(mean, all)),
                    _mm_maskload_ps(inv_std, all),
                );
                let d = _mm_maskload_ps(dz, all);
                (_mm256_cvtps_pd(_mm_mul_ps(d, x_hat)), _mm256_cvtps_pd(d))
            }
        }
    }

    impl Lanes for __m512d {
        const N: usize = 8;
        #[inline(always)]
        unsafe fn load(p: *const f64) -> Self {
            // SAFETY: the caller's contract.
            unsafe { _mm512_maskz_loadu_pd(!0, p) }
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f64) {
            // SAFETY: the caller's contract.
            unsafe { _mm512_mask_storeu_pd(p, !0, self) }
        }
        #[inline(always)]
        unsafe fn widen(p: *const f32) -> Self {
            // SAFETY: the caller's contract.
            unsafe { _mm512_cvtps_pd(_mm256_maskload_ps(p, _mm256_set1_epi32(-1))) }
        }
        #[inline(always)]
        unsafe fn add(a: Self, b: Self) -> Self {
            // SAFETY: the caller's contract (the CPU has AVX-512F).
            unsafe { _mm512_add_pd(a, b) }
        }
        #[inline(always)]
        unsafe fn sub(a: Self, b: Self) -> Self {
            // SAFETY: the caller's contract.
            unsafe { _mm512_sub_pd(a, b) }
        }
        #[inline(always)]
        unsafe fn mul(a: Self, b: Self) -> Self {
            // SAFETY: the caller's contract.
            unsafe { _mm512_mul_pd(a, b) }
        }
        #[inline(always)]
        unsafe fn bwd_arith(
            y: *const f32,
            dz: *const f32,
            mean: *const f32,
            inv_std: *const f32,
        ) -> (Self, Self) {
            // SAFETY: the caller's contract.
            unsafe {
                let all = _mm256_set1_epi32(-1);
                let x_hat = _mm256_mul_ps(
                    _mm256_sub_ps(_mm256_maskload_ps(y, all), _mm256_maskload_ps(mean, all)),
                    _mm256_maskload_ps(inv_std, all),
                );
                let d = _mm256_maskload_ps(dz, all);
                (_mm512_cvtps_pd(_mm256_mul_ps(d, x_hat)), _mm512_cvtps_pd(d))
            }
        }
    }

    /// Channels `k0 .. k0 + G·N` of every row, their sums in registers across the rows (`G`
    /// vectors of each sum in flight, to cover the adds' latency).
    ///
    /// # Safety
    /// The CPU has the vector's instruction set; `y` (and `dz`, except for GenStats) hold whole
    /// rows of `acc.len()` channels, the statistics `acc.len()` values, and
    /// `k0 + G·N <= acc.len()`.
    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // constant indices keep the sums in registers
    unsafe fn group<L: Lanes, const G: usize>(
        terms: &Terms<'_, f32>,
        y: &[f32],
        dz: &[f32],
        k0: usize,
        acc: &mut [[f64; 2]],
    ) {
        let c = acc.len();
        let rows = y.len() / c;
        let mut lanes = [[0.0f64; 8]; 2];
        // SAFETY: the caller's contract: channels `k0 .. k0 + G·N` are within every row, the
        // statistics and `acc`; the staging arrays hold 8 ≥ N values. (Pointer arithmetic by
        // `wrapping_add`: `add` carries a precondition check the release builds keep.)
        unsafe {
            let mut s0 = [L::load(lanes[0].as_ptr()); G];
            let mut s1 = s0;
            for g in 0..G {
                for l in 0..L::N {
                    [lanes[0][l], lanes[1][l]] = acc[k0 + g * L::N + l];
                }
                s0[g] = L::load(lanes[0].as_ptr());
                s1[g] = L::load(lanes[1].as_ptr());
            }
            let (yp, dp) = (y.as_ptr().wrapping_add(k0), dz.as_ptr().wrapping_add(k0));
            match *terms {
                Terms::Genstats => {
                    for r in 0..rows {
                        let row = yp.wrapping_add(r * c);
                        for g in 0..G {
                            let v = L::widen(row.wrapping_add(g * L::N));
                            s0[g] = L::add(s0[g], v);
                            s1[g] = L::add(s1[g], L::mul(v, v));
                        }
                    }
                }
                Terms::Bwd64 { mean, inv_std } => {
                    let mut m = s0;
                    let mut is = s0;
                    for g in 0..G {
                        m[g] = L::load(mean.as_ptr().wrapping_add(k0 + g * L::N));
                        is[g] = L::load(inv_std.as_ptr().wrapping_add(k0 + g * L::N));
                    }
                    for r in 0..rows {
                        let (yr, dr) = (yp.wrapping_add(r * c), dp.wrapping_add(r * c));
                        for g in 0..G {
                            let v = L::widen(yr.wrapping_add(g * L::N));
                            let d = L::widen(dr.wrapping_add(g * L::N));
                            let x_hat = L::mul(L::sub(v, m[g]), is[g]);
                            s0[g] = L::add(s0[g], L::mul(d, x_hat));
                            s1[g] = L::add(s1[g], d);
                        }
                    }
                }
                Terms::BwdArith { mean, inv_std } => {
                    let (mp, ip) = (
                        mean.as_ptr().wrapping_add(k0),
                        inv_std.as_ptr().wrapping_add(k0),
                    );
                    for r in 0..rows {
                        let (yr, dr) = (yp.wrapping_add(r * c), dp.wrapping_add(r * c));
                        for g in 0..G {
                            let at = g * L::N;
                            let (p, d) = L::bwd_arith(
                                yr.wrapping_add(at),
                                dr.wrapping_add(at),
                                mp.wrapping_add(at),
                                ip.wrapping_add(at),
                            );
                            s0[g] = L::add(s0[g], p);
                            s1[g] = L::add(s1[g], d);
                        }
                    }
                }
            }
            for g in 0..G {
                s0[g].store(lanes[0].as_mut_ptr());
                s1[g].store(lanes[1].as_mut_ptr());
                for l in 0..L::N {
                    acc[k0 + g * L::N + l] = [lanes[0][l], lanes[1][l]];
                }
            }
        }
    }

    /// Every whole vector of channels, four vectors at a time, then the remaining one to
    /// three; returns the channels covered.
    ///
    /// # Safety
    /// As [`group`], without the bound on `k0`.
    #[inline(always)]
    unsafe fn all<L: Lanes>(
        terms: &Terms<'_, f32>,
        y: &[f32],
        dz: &[f32],
        acc: &mut [[f64; 2]],
    ) -> usize {
        let vectors = acc.len() / L::N;
        let mut k0 = 0;
        // SAFETY: the caller's contract; every group below ends within the `vectors` whole
        // vectors of channels.
        unsafe {
            for _ in 0..vectors / 4 {
                group::<L, 4>(terms, y, dz, k0, acc);
                k0 += 4 * L::N;
            }
            match vectors % 4 {
                1 => group::<L, 1>(terms, y, dz, k0, acc),
                2 => group::<L, 2>(terms, y, dz, k0, acc),
                3 => group::<L, 3>(terms, y, dz, k0, acc),
                _ => {}
            }
        }
        vectors * L::N
    }

    /// # Safety
    /// The CPU has AVX; `y` (and `dz`, except for GenStats) hold whole rows of `acc.len()`
    /// channels and the statistics at least `acc.len()` values.
    #[target_feature(enable = "avx")]
    pub(super) unsafe fn avx(
        terms: &Terms<'_, f32>,
        y: &[f32],
        dz: &[f32],
        acc: &mut [[f64; 2]],
    ) -> usize {
        // SAFETY: the function's contract.
        unsafe { all::<__m256d>(terms, y, dz, acc) }
    }

    /// # Safety
    /// As [`avx`], with AVX-512F too.
    #[target_feature(enable = "avx512f,avx")]
    pub(super) unsafe fn avx512(
        terms: &Terms<'_, f32>,
        y: &[f32],
        dz: &[f32],
        acc: &mut [[f64; 2]],
    ) -> usize {
        // SAFETY: the function's contract.
        unsafe { all::<__m512d>(terms, y, dz, acc) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values that exercise the arithmetic: signs, magnitudes from subnormal to large, zeros,
    /// infinities and NaN.
    fn awkward(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|i| {
                s = s
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                let u = ((s >> 40) as f32) / (1u64 << 24) as f32 - 0.5;
                match i % 97 {
                    13 => f32::NAN,
                    29 => f32::INFINITY,
                    41 => -0.0,
                    53 => 1e-40,
                    67 => 3.0e30,
                    _ => u * 7.0,
                }
            })
            .collect()
    }

    /// The sums written out, one channel and one row at a time.
    fn written_out(terms: &Terms<'_, f32>, y: &[f32], dz: &[f32], acc: &mut [[f64; 2]]) {
        let c = acc.len();
        for r in 0..y.len() / c {
            for k in 0..c {
                let (v, d) = (y[r * c + k], dz.get(r * c + k).copied().unwrap_or(0.0));
                let add: [f64; 2] = match *terms {
                    Terms::Genstats => [f64::from(v), f64::from(v) * f64::from(v)],
                    Terms::Bwd64 { mean, inv_std } => {
                        let x_hat = (f64::from(v) - mean[k]) * inv_std[k];
                        [f64::from(d) * x_hat, f64::from(d)]
                    }
                    Terms::BwdArith { mean, inv_std } => {
                        let x_hat = (v - mean[k]) * inv_std[k];
                        [f64::from(d * x_hat), f64::from(d)]
                    }
                };
                acc[k][0] += add[0];
                acc[k][1] += add[1];
            }
        }
    }

    /// The sums' bits, every NaN alike (which NaN an add of two NaN returns is the
    /// compiler's choice of operand order, on every path).
    fn bits(acc: &[[f64; 2]]) -> Vec<[u64; 2]> {
        acc.iter()
            .map(|a| a.map(|v| if v.is_nan() { u64::MAX } else { v.to_bits() }))
            .collect()
    }

    #[test]
    fn every_level_matches_the_sums_written_out() {
        let levels = [Level::Portable, Level::Avx, Level::Avx512];
        // Channel counts below, at and between whole vectors of both widths, with remainders.
        for c in [1, 3, 4, 5, 8, 12, 16, 17, 24, 32, 36, 40, 64, 72, 100] {
            for rows in [0, 1, 2, 7, 33] {
                let y = awkward(rows * c, 1 + c as u64);
                let dz = awkward(rows * c, 2 + rows as u64);
                let mean32 = awkward(c, 3);
                let inv32: Vec<f32> = awkward(c, 4).iter().map(|v| v.abs() + 0.25).collect();
                let mean64: Vec<f64> = mean32.iter().map(|&v| f64::from(v)).collect();
                let inv64: Vec<f64> = inv32.iter().map(|&v| f64::from(v)).collect();
                let all = [
                    Terms::Genstats,
                    Terms::Bwd64 {
                        mean: &mean64,
                        inv_std: &inv64,
                    },
                    Terms::BwdArith {
                        mean: &mean32,
                        inv_std: &inv32,
                    },
                ];
                for terms in all {
                    // Sums that do not start at zero: the vector paths carry them in and out.
                    let start: Vec<[f64; 2]> = (0..c)
                        .map(|k| [k as f64 * 0.37 - 1.0, 2.0 + k as f64])
                        .collect();
                    let mut want = start.clone();
                    let dz_in: &[f32] = if matches!(terms, Terms::Genstats) {
                        &[]
                    } else {
                        &dz
                    };
                    written_out(&terms, &y, dz_in, &mut want);
                    for level in levels {
                        let mut got = start.clone();
                        add_rows_with(level, terms, &y, dz_in, &mut got);
                        assert_eq!(
                            bits(&got),
                            bits(&want),
                            "{terms:?} c {c} rows {rows} {level:?}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn f64_operands_take_the_scalar_loop_alike() {
        let c = 16;
        let y: Vec<f64> = awkward(5 * c, 9).iter().map(|&v| f64::from(v)).collect();
        let mut got = vec![[0.0; 2]; c];
        add_rows_with(Level::Avx512, Terms::Genstats, &y, &[], &mut got);
        let mut want = vec![[0.0f64; 2]; c];
        for row in y.chunks_exact(c) {
            for (a, &v) in want.iter_mut().zip(row) {
                a[0] += v;
                a[1] += v * v;
            }
        }
        assert_eq!(bits(&got), bits(&want));
    }

    #[test]
    fn the_level_follows_the_cap() {
        let _held = super::super::simd::forced::HELD.lock();
        super::super::simd::forced::set(Some(super::super::simd::CpuSimd::Portable));
        assert_eq!(level(), Level::Portable);
        super::super::simd::forced::set(None);
    }
}
