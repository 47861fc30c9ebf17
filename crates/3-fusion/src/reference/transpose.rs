//! Matrix transposes for the conv ops' weight arrangements (fprop's `[r*s*c, k]` weights, wgrad's
//! `dwᵀ → dw`), once per op over every weight of the layer: for ResNets' deep layers millions of
//! values, so they are moved in blocks, by 8×8 AVX register transposes where the CPU has AVX2.
//!
//! Element by element a transpose copies values, so every path gives the same result.
#![allow(unsafe_code)]

use super::element::Real;

/// Side of the square blocks moved at a time: a block's rows are read and its columns written
/// as whole cache lines. (Reading a block's columns straight from `src` misses the L1 cache
/// when the row stride maps rows to a few cache sets, as ResNet shapes' strides of 512·9 or
/// 512 values do.)
const BLOCK: usize = 32;

/// `dst [cols, rows] = srcᵀ` for a row-major `src [rows, cols]`; both hold `rows · cols`
/// values (longer slices: the rest is untouched).
///
/// # Panics
/// Where a slice holds fewer than `rows · cols` values (a caller's bug: the conv ops size both
/// from their parameters).
pub(crate) fn transpose<A: Real>(src: &[A], rows: usize, cols: usize, dst: &mut [A]) {
    A::transpose(src, rows, cols, dst);
}

/// [`transpose`] for `f32`: 8×8 AVX register transposes where this CPU has AVX2 (and the
/// executor's SIMD is not capped below it), else [`blocked`].
pub(crate) fn f32s(src: &[f32], rows: usize, cols: usize, dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if super::simd::cap() >= super::simd::CpuSimd::Avx2
        && std::arch::is_x86_feature_detected!("avx2")
    {
        strips(src, rows, cols, dst, |src, j0, strip| {
            // SAFETY: the CPU has AVX2 (checked just above); `strips` hands `src` of exactly
            // `rows · cols` values and `strip`, rows `j0..j0 + strip.len() / rows` of `dst`,
            // within `cols`; `strip` is borrowed mutably, so it does not alias `src`.
            unsafe { x86::strip(src, rows, cols, j0, strip) }
        });
        return;
    }
    blocked(src, rows, cols, dst);
}

/// [`transpose`] by square blocks through a buffer, in safe code (any type; the `f32` path
/// where the CPU has no AVX2).
pub(crate) fn blocked<A: Real>(src: &[A], rows: usize, cols: usize, dst: &mut [A]) {
    strips(src, rows, cols, dst, |src, j0, strip| {
        let mut buf = [[A::ZERO; BLOCK]; BLOCK];
        let bj = strip.len() / rows;
        for i0 in (0..rows).step_by(BLOCK) {
            let bi = BLOCK.min(rows - i0);
            for (i, row) in buf[..bi].iter_mut().enumerate() {
                row[..bj].copy_from_slice(&src[(i0 + i) * cols + j0..][..bj]);
            }
            for j in 0..bj {
                let out = &mut strip[j * rows + i0..][..bi];
                for (o, row) in out.iter_mut().zip(&buf) {
                    *o = row[j];
                }
            }
        }
    });
}

/// Transposes of at least this many values run their strips over rayon's threads (smaller
/// ones inline: a fork-join costs more than moving a few ten thousand values).
const PARALLEL_VALUES: usize = 64 * 1024;

/// Runs `f(src, j0, strip)` for each strip of [`BLOCK`] rows of `dst` (rows `j0..` of
/// `dst [cols, rows]`, the last strip shorter), in parallel for large transposes; `src` is
/// sliced to `rows · cols` values. Each strip is written by one call, so the result does not
/// depend on the threads.
fn strips<A: Send + Sync>(
    src: &[A],
    rows: usize,
    cols: usize,
    dst: &mut [A],
    f: impl Fn(&[A], usize, &mut [A]) + Sync,
) {
    let n = rows
        .checked_mul(cols)
        .expect("transpose: rows · cols overflows");
    let (src, dst) = (&src[..n], &mut dst[..n]);
    if n == 0 {
        return;
    }
    let strip = BLOCK * rows;
    if n >= PARALLEL_VALUES {
        use rayon::prelude::*;
        dst.par_chunks_mut(strip)
            .enumerate()
            .for_each(|(b, s)| f(src, b * BLOCK, s));
    } else {
        for (b, s) in dst.chunks_mut(strip).enumerate() {
            f(src, b * BLOCK, s);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use core::arch::x86_64::*;

    use super::BLOCK;

    /// Rows `j0..j0 + strip.len() / rows` of `dst [cols, rows] = srcᵀ` into `strip`: whole
    /// 32×32 blocks by 8×8 register transposes, the edges value by value.
    ///
    /// # Safety
    /// The CPU has AVX2; `src` holds exactly `rows · cols` values, `strip` a whole number of
    /// rows of `rows` values, and `j0 + strip.len() / rows <= cols`.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn strip(
        src: &[f32],
        rows: usize,
        cols: usize,
        j0: usize,
        strip: &mut [f32],
    ) {
        let bj = strip.len() / rows;
        let (s, d) = (src.as_ptr(), strip.as_mut_ptr());
        for i0 in (0..rows).step_by(BLOCK) {
            let bi = BLOCK.min(rows - i0);
            if bi < BLOCK || bj < BLOCK {
                for i in i0..i0 + bi {
                    for j in 0..bj {
                        strip[j * rows + i] = src[i * cols + j0 + j];
                    }
                }
                continue;
            }
            for i in (i0..i0 + BLOCK).step_by(8) {
                for j in (0..BLOCK).step_by(8) {
                    // SAFETY: rows `i..i + 8` and columns `j0 + j..j0 + j + 8` of `src` (and
                    // the transposed ones of `strip`) lie within this whole block, inside both
                    // slices (the caller's contract); the caller's contract gives AVX2.
                    unsafe { t8x8(s.add(i * cols + j0 + j), cols, d.add(j * rows + i), rows) };
                }
            }
        }
    }

    /// The 8×8 block at `src` (row stride `ss`) transposed into `dst` (row stride `ds`).
    ///
    /// # Safety
    /// The CPU has AVX2; `src + r·ss .. + 8` is readable and `dst + r·ds .. + 8` writable for
    /// `r < 8`, and the two do not overlap.
    #[inline(always)]
    unsafe fn t8x8(src: *const f32, ss: usize, dst: *mut f32, ds: usize) {
        // SAFETY: the caller's contract. (Masked moves with an all-ones mask, which compile to
        // plain ones: the unmasked intrinsics go through `ptr::read_unaligned`, whose
        // precondition check this workspace's release builds keep.)
        unsafe {
            let all = _mm256_set1_epi32(-1);
            let r: [__m256; 8] = core::array::from_fn(|i| _mm256_maskload_ps(src.add(i * ss), all));
            // Pairs of rows interleaved, then pairs of pairs, then the 128-bit halves swapped.
            let t0 = _mm256_unpacklo_ps(r[0], r[1]);
            let t1 = _mm256_unpackhi_ps(r[0], r[1]);
            let t2 = _mm256_unpacklo_ps(r[2], r[3]);
            let t3 = _mm256_unpackhi_ps(r[2], r[3]);
            let t4 = _mm256_unpacklo_ps(r[4], r[5]);
            let t5 = _mm256_unpackhi_ps(r[4], r[5]);
            let t6 = _mm256_unpacklo_ps(r[6], r[7]);
            let t7 = _mm256_unpackhi_ps(r[6], r[7]);
            let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
            let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
            let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
            let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
            let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
            let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
            let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
            let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
            let out = [
                _mm256_permute2f128_ps::<0x20>(u0, u4),
                _mm256_permute2f128_ps::<0x20>(u1, u5),
                _mm256_permute2f128_ps::<0x20>(u2, u6),
                _mm256_permute2f128_ps::<0x20>(u3, u7),
                _mm256_permute2f128_ps::<0x31>(u0, u4),
                _mm256_permute2f128_ps::<0x31>(u1, u5),
                _mm256_permute2f128_ps::<0x31>(u2, u6),
                _mm256_permute2f128_ps::<0x31>(u3, u7),
            ];
            for (j, v) in out.into_iter().enumerate() {
                _mm256_maskstore_ps(dst.add(j * ds), all, v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::simd::{forced, CpuSimd};

    /// The transpose written out, element by element.
    fn naive<A: Copy>(src: &[A], rows: usize, cols: usize, dst: &mut [A]) {
        for i in 0..rows {
            for j in 0..cols {
                dst[j * rows + i] = src[i * cols + j];
            }
        }
    }

    #[test]
    fn every_path_moves_every_value_where_the_transpose_puts_it() {
        let _held = forced::HELD.lock().unwrap_or_else(|e| e.into_inner());
        // Whole blocks, edges in either dimension or both, a block's 8×8 sub-blocks with
        // distinct strides, a vector, an empty matrix, and the ResNet strides of the docs.
        let shapes = [
            (32, 32),
            (64, 96),
            (33, 32),
            (32, 41),
            (70, 45),
            (7, 3),
            (1, 100),
            (0, 5),
            (512, 4608 / 8),
            (96, 512),
        ];
        for (rows, cols) in shapes {
            // Distinct values (the index), so a value in a wrong place shows.
            let src: Vec<f32> = (0..rows * cols).map(|v| v as f32).collect();
            let mut want = vec![f32::NAN; rows * cols];
            naive(&src, rows, cols, &mut want);
            for cap in [CpuSimd::Portable, CpuSimd::Avx2, CpuSimd::Avx512] {
                forced::set(Some(cap));
                // One value past the end, which must stay untouched.
                let mut got = vec![f32::NAN; rows * cols + 1];
                f32s(&src, rows, cols, &mut got);
                forced::set(None);
                assert!(
                    got[rows * cols].is_nan(),
                    "{cap:?} {rows}x{cols}: past the end"
                );
                assert_eq!(got[..rows * cols], want[..], "{cap:?} {rows}x{cols}");
            }
            let src64: Vec<f64> = src.iter().map(|&v| f64::from(v)).collect();
            let mut got64 = vec![f64::NAN; rows * cols];
            transpose(&src64, rows, cols, &mut got64);
            let want64: Vec<f64> = want.iter().map(|&v| f64::from(v)).collect();
            assert_eq!(got64, want64, "f64 {rows}x{cols}");
        }
    }
}
