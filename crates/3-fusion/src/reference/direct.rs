//! Convolution tiles straight from the padded source, without the column matrix: the same
//! bits as gathering the column matrix and multiplying it with the `gemm` crate.
//!
//! Each conv op multiplies a column matrix `col` (every row a pixel, every column `d` one
//! channel of one filter tap) with a dense matrix. Through the padded layout of
//! `conv/gather.rs`, element `(row, d)` of `col` is `src[base(row) + eoff(d)]`: a row's base pixel
//! plus a fixed offset per column. So a tile's product can read `src` where the gather would
//! have copied it from:
//!
//! `acc[i][o] = Σ_s src[p[i] + q[s]] · m[s][o]`
//!
//! - fprop and stride-1 dgrad: `i` a row (`p` = row bases), `s` a column (`q` = column
//!   offsets), `m` the filter as `[depth, cout]`; the tile is stored.
//! - wgrad: `i` a column, `s` a row, `m` the tile's `dy` rows; the tile is added to `dwᵀ`.
//!
//! Why the bits match: the `gemm` crate's FMA kernels (which it runs on every CPU with FMA)
//! start each output element at `+0`, add the products of the reduced dimension one at a time,
//! in order, each with one fused multiply-add, and then store it (`1·acc`) or add it to the
//! destination (`fma(1, acc, dst)`, which is `acc + dst` rounded once). These kernels do the
//! same per element, in vector lanes of any width (an element never meets another lane), so
//! AVX2 and AVX-512 give the same bits. The crate takes other paths, with other arithmetic,
//! for some shapes (a reduced dimension over 512 split in cache-sized blocks, tiny products
//! summed across lanes, vector-vector cases): callers use these tiles only where it takes
//! the kernel path (`conv/tile.rs`), and the gather and `gemm` otherwise.
#![allow(unsafe_code)]

/// The instruction set the tiles run with (see [`level`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Level {
    /// No direct tiles: the gather and `gemm` (no FMA, or not x86-64).
    None,
    /// AVX2 with FMA (8 lanes).
    Avx2,
    /// AVX-512F (16 lanes; its 8-lane remainders with AVX2).
    Avx512,
}

/// The widest tiles this CPU runs (feature detection is cached by the standard library).
pub(crate) fn level() -> Level {
    let cap = super::simd::cap();
    #[cfg(target_arch = "x86_64")]
    {
        use super::simd::CpuSimd;
        let avx2 = cap >= CpuSimd::Avx2
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma");
        if avx2 && cap >= CpuSimd::Avx512 && std::arch::is_x86_feature_detected!("avx512f") {
            return Level::Avx512;
        }
        if avx2 {
            return Level::Avx2;
        }
    }
    let _ = cap;
    Level::None
}

/// `out[i·cout + o] = Σ_s src[p[i] + q[s]] · m[s·cout + o]` (or `+=` where `add`), in the
/// `gemm` crate's per-element order (module docs), at the widest [`level`]. Returns false,
/// leaving `out` untouched, where this CPU has no direct tiles or an operand does not match
/// its shape (`m` holds `q.len()` rows of `cout`, `out` `p.len()` rows, and every
/// `p[i] + q[s]` indexes `src`).
pub(crate) fn product(
    src: &[f32],
    p: &[usize],
    q: &[usize],
    m: &[f32],
    cout: usize,
    out: &mut [f32],
    add: bool,
) -> bool {
    product_with(level(), src, p, q, m, cout, out, add)
}

/// [`product`] at a given level; a level the CPU lacks returns false.
#[allow(clippy::too_many_arguments)]
pub(crate) fn product_with(
    level: Level,
    src: &[f32],
    p: &[usize],
    q: &[usize],
    m: &[f32],
    cout: usize,
    out: &mut [f32],
    add: bool,
) -> bool {
    let fits = |a: Option<&usize>, b: Option<&usize>| match (a, b) {
        (Some(&a), Some(&b)) => a.checked_add(b).is_some_and(|last| last < src.len()),
        // An empty side: nothing is read.
        _ => true,
    };
    if Some(m.len()) != q.len().checked_mul(cout)
        || Some(out.len()) != p.len().checked_mul(cout)
        || !fits(p.iter().max(), q.iter().max())
    {
        return false;
    }
    let tile = Tile {
        src: src.as_ptr(),
        q,
        m: m.as_ptr(),
        cout,
        add,
    };
    #[cfg(target_arch = "x86_64")]
    match level {
        Level::Avx512
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma") =>
        {
            // SAFETY: the CPU has AVX-512F, AVX2 and FMA (checked just above); every index
            // the tile reads or writes was checked above (`m`: `q.len()` rows of `cout`;
            // `out`: `p.len()` rows of `cout`; every `p[i] + q[s]` below `src.len()`), and
            // `out` is borrowed mutably, so it aliases neither `src` nor `m`.
            unsafe { x86::run_avx512(&tile, p, out.as_mut_ptr()) };
            return true;
        }
        Level::Avx2
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma") =>
        {
            // SAFETY: as above, with AVX2 and FMA checked just above.
            unsafe { x86::run_avx2(&tile, p, out.as_mut_ptr()) };
            return true;
        }
        _ => {}
    }
    let _ = (level, tile);
    false
}

/// The operands of [`product`] every block shares.
struct Tile<'a> {
    src: *const f32,
    q: &'a [usize],
    m: *const f32,
    cout: usize,
    add: bool,
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use core::arch::x86_64::*;

    use super::Tile;

    /// One vector register of `f32` lanes.
    trait Lanes: Copy {
        const N: usize;
        /// # Safety
        /// The CPU has the vector's instruction set.
        unsafe fn zero() -> Self;
        /// # Safety
        /// `p` is valid for `N` reads; the CPU has the vector's instruction set.
        unsafe fn load(p: *const f32) -> Self;
        /// # Safety
        /// `p` is valid for one read; the CPU has the vector's instruction set.
        unsafe fn splat(p: *const f32) -> Self;
        /// `a·b + c`, rounded once.
        ///
        /// # Safety
        /// The CPU has the vector's instruction set.
        unsafe fn fma(a: Self, b: Self, c: Self) -> Self;
        /// `*p = self`, or `*p = *p + self` where `add` (masked moves, as in `load`).
        ///
        /// # Safety
        /// `p` is valid for `N` reads and writes; the CPU has the vector's instruction set.
        unsafe fn put(self, p: *mut f32, add: bool);
    }

    impl Lanes for __m256 {
        const N: usize = 8;
        #[inline(always)]
        unsafe fn zero() -> Self {
            // SAFETY: the caller's contract (the CPU has AVX).
            unsafe { _mm256_setzero_ps() }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            // SAFETY: the caller's contract. (An all-ones mask, which compiles to a plain load:
            // `_mm256_loadu_ps` goes through `ptr::read_unaligned`, whose precondition check
            // this workspace's release builds keep, in the innermost loop.)
            unsafe { _mm256_maskload_ps(p, _mm256_set1_epi32(-1)) }
        }
        #[inline(always)]
        unsafe fn splat(p: *const f32) -> Self {
            // SAFETY: the caller's contract. (Through raw-pointer loads: a dereference would
            // carry the build's alignment check into the innermost loop.)
            unsafe { _mm256_broadcastss_ps(_mm_load_ss(p)) }
        }
        #[inline(always)]
        unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
            // SAFETY: the caller's contract (the CPU has FMA).
            unsafe { _mm256_fmadd_ps(a, b, c) }
        }
        #[inline(always)]
        unsafe fn put(self, p: *mut f32, add: bool) {
            // SAFETY: the caller's contract.
            unsafe {
                let all = _mm256_set1_epi32(-1);
                let v = if add {
                    _mm256_add_ps(_mm256_maskload_ps(p, all), self)
                } else {
                    self
                };
                _mm256_maskstore_ps(p, all, v);
            }
        }
    }

    impl Lanes for __m512 {
        const N: usize = 16;
        #[inline(always)]
        unsafe fn zero() -> Self {
            // SAFETY: the caller's contract (the CPU has AVX-512F).
            unsafe { _mm512_setzero_ps() }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            // SAFETY: the caller's contract (an all-ones mask, as above).
            unsafe { _mm512_maskz_loadu_ps(!0, p) }
        }
        #[inline(always)]
        unsafe fn splat(p: *const f32) -> Self {
            // SAFETY: the caller's contract (raw-pointer loads, as above).
            unsafe { _mm512_broadcastss_ps(_mm_load_ss(p)) }
        }
        #[inline(always)]
        unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
            // SAFETY: the caller's contract (the CPU has AVX-512F).
            unsafe { _mm512_fmadd_ps(a, b, c) }
        }
        #[inline(always)]
        unsafe fn put(self, p: *mut f32, add: bool) {
            // SAFETY: the caller's contract.
            unsafe {
                let v = if add {
                    _mm512_add_ps(_mm512_maskz_loadu_ps(!0, p), self)
                } else {
                    self
                };
                _mm512_mask_storeu_ps(p, !0, v);
            }
        }
    }

    /// `R` rows `p[..R]` by `V` vectors of columns from `o`.
    ///
    /// # Safety
    /// As [`run_avx2`], with `p` holding `R` values and columns `o..o + V·L::N` within `cout`.
    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // constant indices keep the accumulators in registers
    unsafe fn block<L: Lanes, const R: usize, const V: usize>(
        t: &Tile<'_>,
        p: &[usize],
        o: usize,
        out: *mut f32,
    ) {
        // (Pointer arithmetic by `wrapping_add`: `add` carries a precondition check this
        // workspace's release builds keep, in the innermost loop.)
        // SAFETY: every pointer below stays within the operands (the caller's contract:
        // `p[i] + q[s]` indexes `src`, row `s` of `m` and row `i` of `out` hold `cout`
        // columns, of which this block touches `o..o + V·L::N`).
        unsafe {
            let mut rows = [t.src; R];
            for i in 0..R {
                rows[i] = t.src.wrapping_add(p[i]);
            }
            let mut acc = [[L::zero(); V]; R];
            let mut m_row = t.m.wrapping_add(o);
            for &qs in t.q {
                let mut mv = [L::zero(); V];
                for v in 0..V {
                    mv[v] = L::load(m_row.wrapping_add(v * L::N));
                }
                for i in 0..R {
                    let x = L::splat(rows[i].wrapping_add(qs));
                    for v in 0..V {
                        acc[i][v] = L::fma(mv[v], x, acc[i][v]);
                    }
                }
                m_row = m_row.wrapping_add(t.cout);
            }
            for i in 0..R {
                for v in 0..V {
                    acc[i][v].put(out.wrapping_add(i * t.cout + o + v * L::N), t.add);
                }
            }
        }
    }

    /// Columns `o..o + V·L::N` for every row of `p`: blocks of `R` rows, then the remaining
    /// rows one by one.
    ///
    /// # Safety
    /// As [`block`].
    #[inline(always)]
    unsafe fn columns<L: Lanes, const R: usize, const V: usize>(
        t: &Tile<'_>,
        p: &[usize],
        o: usize,
        out: *mut f32,
    ) {
        let mut chunks = p.chunks_exact(R);
        let mut i = 0;
        for chunk in &mut chunks {
            // SAFETY: the caller's contract, for rows `i..i + R`.
            unsafe { block::<L, R, V>(t, chunk, o, out.add(i * t.cout)) };
            i += R;
        }
        for pi in chunks.remainder().chunks(1) {
            // SAFETY: as above, for row `i`.
            unsafe { block::<L, 1, V>(t, pi, o, out.add(i * t.cout)) };
            i += 1;
        }
    }

    /// The columns no vector covers, one fused multiply-add at a time (the same arithmetic
    /// per element as a lane).
    ///
    /// # Safety
    /// As [`block`], for columns `o..cout`.
    #[inline(always)]
    unsafe fn scalar_columns(t: &Tile<'_>, p: &[usize], o: usize, out: *mut f32) {
        for (i, &pi) in p.iter().enumerate() {
            for col in o..t.cout {
                let mut acc = 0.0f32;
                // SAFETY: the caller's contract (row `i`, column `col < cout`).
                unsafe {
                    let row = t.src.add(pi);
                    for (s, &qs) in t.q.iter().enumerate() {
                        acc = (*row.add(qs)).mul_add(*t.m.add(s * t.cout + col), acc);
                    }
                    let dst = out.add(i * t.cout + col);
                    *dst = if t.add { *dst + acc } else { acc };
                }
            }
        }
    }

    /// # Safety
    /// The CPU has AVX2 and FMA; every `p[i] + t.q[s]` indexes `t.src`; `t.m` holds
    /// `t.q.len()` rows of `t.cout` values and `out` `p.len()` rows of `t.cout`, writable and
    /// aliasing neither operand.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn run_avx2(t: &Tile<'_>, p: &[usize], out: *mut f32) {
        let mut o = 0;
        while o + 16 <= t.cout {
            // SAFETY: the function's contract, for columns `o..o + 16` within `cout`.
            unsafe { columns::<__m256, 4, 2>(t, p, o, out) };
            o += 16;
        }
        if o + 8 <= t.cout {
            // SAFETY: as above, columns `o..o + 8`.
            unsafe { columns::<__m256, 8, 1>(t, p, o, out) };
            o += 8;
        }
        // SAFETY: as above, columns `o..cout`.
        unsafe { scalar_columns(t, p, o, out) };
    }

    /// # Safety
    /// As [`run_avx2`], with AVX-512F too.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) unsafe fn run_avx512(t: &Tile<'_>, p: &[usize], out: *mut f32) {
        let mut o = 0;
        while o + 32 <= t.cout {
            // SAFETY: the function's contract, for columns `o..o + 32` within `cout`.
            unsafe { columns::<__m512, 4, 2>(t, p, o, out) };
            o += 32;
        }
        if o + 16 <= t.cout {
            // SAFETY: as above, columns `o..o + 16`.
            unsafe { columns::<__m512, 8, 1>(t, p, o, out) };
            o += 16;
        }
        if o + 8 <= t.cout {
            // SAFETY: as above, columns `o..o + 8` (AVX2 is enabled too).
            unsafe { columns::<__m256, 8, 1>(t, p, o, out) };
            o += 8;
        }
        // SAFETY: as above, columns `o..cout`.
        unsafe { scalar_columns(t, p, o, out) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sum written out: `acc = fma(src, m, acc)` from `+0` in `s` order.
    fn naive(src: &[f32], p: &[usize], q: &[usize], m: &[f32], cout: usize) -> Vec<f32> {
        let mut out = vec![0.0f32; p.len() * cout];
        for (i, &pi) in p.iter().enumerate() {
            for o in 0..cout {
                let mut acc = 0.0f32;
                for (s, &qs) in q.iter().enumerate() {
                    acc = src[pi + qs].mul_add(m[s * cout + o], acc);
                }
                out[i * cout + o] = acc;
            }
        }
        out
    }

    fn values(n: usize, seed: u32) -> Vec<f32> {
        let mut state = seed.wrapping_mul(2_654_435_761).wrapping_add(12345);
        (0..n)
            .map(|_| {
                state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                ((state >> 8) as f32 / (1u32 << 24) as f32 - 0.5) * 3.0
            })
            .collect()
    }

    #[test]
    fn every_level_matches_the_sum_written_out_bit_for_bit() {
        let levels = [Level::Avx2, Level::Avx512];
        for (case, &(rows, depth, cout)) in [
            (13usize, 7usize, 1usize),
            (6, 9, 8),
            (12, 72, 16),
            (25, 144, 32),
            (7, 33, 40),
            (30, 5, 56),
            (1, 288, 24),
        ]
        .iter()
        .enumerate()
        {
            let src = values(4096, case as u32);
            let m = values(depth * cout, 100 + case as u32);
            let p: Vec<usize> = (0..rows).map(|i| (i * 37) % 2000).collect();
            let q: Vec<usize> = (0..depth).map(|d| (d * 11) % 1500).collect();
            let want = naive(&src, &p, &q, &m, cout);
            for level in levels {
                let mut out = vec![f32::NAN; rows * cout];
                if !product_with(level, &src, &p, &q, &m, cout, &mut out, false) {
                    // This CPU lacks the level: nothing to compare.
                    continue;
                }
                let same = out
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{level:?}, rows {rows} depth {depth} cout {cout}");
                // Adding to a destination: `dst + acc`, rounded once.
                let base = values(rows * cout, 7);
                let mut sum = base.clone();
                assert!(product_with(level, &src, &p, &q, &m, cout, &mut sum, true));
                for ((s, b), w) in sum.iter().zip(&base).zip(&want) {
                    assert_eq!(s.to_bits(), (b + w).to_bits(), "{level:?} add");
                }
            }
        }
    }

    #[test]
    fn operands_off_their_shapes_are_refused() {
        let src = values(64, 1);
        let m = values(4 * 8, 2);
        let mut out = vec![0.0; 2 * 8];
        // An index past the source.
        assert!(!product(
            &src,
            &[0, 60],
            &[0, 1, 2, 4],
            &m,
            8,
            &mut out,
            false
        ));
        // `m` one row short.
        assert!(!product(
            &src,
            &[0, 1],
            &[0, 1, 2, 3, 4],
            &m,
            8,
            &mut out,
            false
        ));
        // `out` the wrong length.
        assert!(!product(&src, &[0], &[0, 1, 2, 3], &m, 8, &mut out, false));
        assert!(out.iter().all(|&v| v == 0.0));
    }
}
