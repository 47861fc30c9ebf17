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
//! for some shapes (tiny products summed across lanes, vector-vector cases): callers use these
//! tiles only where it takes the kernel path (`conv/tile.rs`), and the gather and `gemm`
//! otherwise.
//!
//! A reduced dimension deeper than 512 goes in blocks ([`reduction_blocks`]): each block's sum
//! starts at `+0` and is then stored (the first, unless adding) or added to the destination,
//! as the crate does with its cache-sized blocks. The crate sizes its blocks from the L1 data
//! cache's geometry; these tiles always use the sizes it picks for a 32 KiB 8-way L1 (the
//! usual one, this workspace's test machines' among them), so their bits do not depend on the
//! CPU's caches where the crate's would.
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
    use super::simd::CpuSimd;
    let cap = super::simd::cap();
    if cap >= CpuSimd::Avx512 && has(Level::Avx512) {
        Level::Avx512
    } else if cap >= CpuSimd::Avx2 && has(Level::Avx2) {
        Level::Avx2
    } else {
        Level::None
    }
}

/// `out[i·cout + o] = Σ_s src[p[i] + q[s]] · m[s·cout + o]` (or `+=` where `add`), in the
/// `gemm` crate's per-element order (module docs), at the widest [`level`]. Returns false,
/// leaving `out` untouched (the caller then gathers and multiplies with `gemm`), where this CPU
/// has no direct tiles, `cout` is under [`MIN_COLUMNS`], or an operand does not match its shape
/// (`m` holds `q.len()` rows of `cout`, `out` `p.len()` rows, and every `p[i] + q[s]` indexes
/// `src`).
pub(crate) fn product(
    src: &[f32],
    p: &[usize],
    q: &[usize],
    m: &[f32],
    cout: usize,
    out: &mut [f32],
    add: bool,
) -> bool {
    cout >= MIN_COLUMNS && product_with(level(), src, p, q, m, cout, out, add)
}

/// The fewest output columns [`product`] takes: one AVX2 vector. Fewer (a stem's 3 input
/// channels in its dgrad) would run a lane at a time, slower than `gemm` (a stride-2 7×7
/// dgrad's phases: 2.1× its time).
const MIN_COLUMNS: usize = 8;

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
    if level == Level::None || !has(level) {
        return false;
    }
    // The blocks of the whole product (they depend on its shape), for every part of its rows.
    let blocks = reduction_blocks(p.len(), cout, q.len());
    let rows = |p: &[usize], out: &mut [f32]| {
        for block in blocks.clone() {
            let tile = Tile {
                src: src.as_ptr(),
                q: &q[block.clone()],
                // In bounds: `block.start < q.len()`, and `m` holds `q.len()` rows of `cout`.
                m: m[block.start * cout..].as_ptr(),
                cout,
                // The first block is stored (unless adding), the later ones added.
                add: add || block.start > 0,
            };
            run(level, &tile, p, out);
        }
    };
    let parts = if p.len().saturating_mul(cout).saturating_mul(q.len()) >= SPLIT_WORK {
        rayon::current_num_threads().min(p.len() / PART_ROWS)
    } else {
        1
    };
    if parts > 1 {
        use rayon::prelude::*;
        let part = p.len().div_ceil(parts).next_multiple_of(PART_ROWS);
        out.par_chunks_mut(part * cout)
            .zip(p.par_chunks(part))
            .for_each(|(out, p)| rows(p, out));
    } else {
        rows(p, out);
    }
    true
}

/// Products of at least this many multiply-adds run in parts of their rows over rayon's
/// threads (about a millisecond of one core's work or more): a layer with fewer tiles than
/// threads, such as a ResNet's last stage (a tile or two of rows, thousands deep), then uses
/// every thread. Each output element takes the same operations wherever its row goes, so the
/// bits do not depend on the parts.
const SPLIT_WORK: usize = 1 << 22;

/// Rows per part: a multiple of the AVX-512 tiles' row blocks (8), at least one of them.
const PART_ROWS: usize = 8;

/// The deepest reduction block: what the `gemm` crate's kernel parameters give for `f32` on a
/// 32 KiB 8-way L1 data cache (its FMA kernels' 16×6 microtiles).
pub(crate) const BLOCK_DEPTH: usize = 512;

/// The blocks a reduction `depth` deep is summed in for a product of `m` rows by `n` columns:
/// the `gemm` crate's, for a 32 KiB 8-way L1 (module docs). Products of at most 64×64 take
/// blocks of [`BLOCK_DEPTH`] and a last, shorter one; larger products `⌈depth / 512⌉` blocks of
/// equal depth (the last shorter by the rounding).
pub(crate) fn reduction_blocks(
    m: usize,
    n: usize,
    depth: usize,
) -> impl Iterator<Item = std::ops::Range<usize>> + Clone {
    let size = if m <= 64 && n <= 64 {
        depth.min(BLOCK_DEPTH)
    } else {
        depth.div_ceil(depth.div_ceil(BLOCK_DEPTH).max(1))
    };
    // An empty reduction is one empty block: the tile stores zeros.
    (0..depth.max(1))
        .step_by(size.max(1))
        .map(move |start| start..(start + size).min(depth))
}

/// Whether this CPU has `level`'s instruction sets.
fn has(level: Level) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let avx2 = std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma");
        match level {
            Level::Avx512 => avx2 && std::arch::is_x86_feature_detected!("avx512f"),
            Level::Avx2 => avx2,
            Level::None => false,
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = level;
        false
    }
}

/// One block's tile at `level`, which this CPU has ([`has`]).
fn run(level: Level, tile: &Tile<'_>, p: &[usize], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    match level {
        Level::Avx512 if has(Level::Avx512) => {
            // SAFETY: the CPU has AVX-512F, AVX2 and FMA (checked just above); every index
            // the tile reads or writes was checked by `product_with` (its block of `m`:
            // `tile.q.len()` rows of `cout` from the block's first row; `out`: `p.len()` rows
            // of `cout`; every `p[i] + q[s]` below `src.len()`), and `out` is borrowed
            // mutably, so it aliases neither `src` nor `m`.
            unsafe { x86::run_avx512(tile, p, out.as_mut_ptr()) };
        }
        Level::Avx2 if has(Level::Avx2) => {
            // SAFETY: as above, with AVX2 and FMA checked just above.
            unsafe { x86::run_avx2(tile, p, out.as_mut_ptr()) };
        }
        _ => {}
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (level, tile, p, out);
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
    /// rows in one block of their count (row by row, each row's accumulators would leave the
    /// FMA units waiting on their latency: a 68-row tile's last 4 rows took about as long as
    /// 20 rows in blocks).
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
        const { assert!(R <= 8, "the leftover rows' blocks below go up to 7") };
        let mut chunks = p.chunks_exact(R);
        let mut i = 0;
        for chunk in &mut chunks {
            // SAFETY: the caller's contract, for rows `i..i + R`.
            unsafe { block::<L, R, V>(t, chunk, o, out.add(i * t.cout)) };
            i += R;
        }
        let rest = chunks.remainder();
        // SAFETY: as above, for rows `i..i + rest.len()`.
        unsafe {
            let out = out.add(i * t.cout);
            match rest.len() {
                0 => {}
                1 => block::<L, 1, V>(t, rest, o, out),
                2 => block::<L, 2, V>(t, rest, o, out),
                3 => block::<L, 3, V>(t, rest, o, out),
                4 => block::<L, 4, V>(t, rest, o, out),
                5 => block::<L, 5, V>(t, rest, o, out),
                6 => block::<L, 6, V>(t, rest, o, out),
                7 => block::<L, 7, V>(t, rest, o, out),
                // Fewer than `R <= 8` rows are left (asserted at compile time above).
                _ => unreachable!("more than 7 rows left after blocks of at most 8"),
            }
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
        // 6×2 accumulators (12 of the 16 registers): enough in flight for two FMA units of
        // four cycles' latency, with room for the two filter vectors and the broadcast.
        while o + 16 <= t.cout {
            // SAFETY: the function's contract, for columns `o..o + 16` within `cout`.
            unsafe { columns::<__m256, 6, 2>(t, p, o, out) };
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
        // 8×2 accumulators (16 of the 32 registers): twice what keeps two 512-bit FMA units of
        // four cycles' latency busy, so a late load does not stall them.
        while o + 32 <= t.cout {
            // SAFETY: the function's contract, for columns `o..o + 32` within `cout`.
            unsafe { columns::<__m512, 8, 2>(t, p, o, out) };
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

    /// The sum written out: per reduction block, `acc = fma(src, m, acc)` from `+0` in `s`
    /// order, stored (the first block, without `base`) or added to the output (`out + acc`;
    /// the output starts as `base` where given).
    fn naive(
        src: &[f32],
        p: &[usize],
        q: &[usize],
        m: &[f32],
        cout: usize,
        base: Option<&[f32]>,
    ) -> Vec<f32> {
        let mut out = base.map_or_else(|| vec![0.0f32; p.len() * cout], <[f32]>::to_vec);
        for block in reduction_blocks(p.len(), cout, q.len()) {
            for (i, &pi) in p.iter().enumerate() {
                for o in 0..cout {
                    let mut acc = 0.0f32;
                    for s in block.clone() {
                        acc = src[pi + q[s]].mul_add(m[s * cout + o], acc);
                    }
                    let dst = &mut out[i * cout + o];
                    *dst = if block.start == 0 && base.is_none() {
                        acc
                    } else {
                        *dst + acc
                    };
                }
            }
        }
        out
    }

    #[test]
    fn reductions_deeper_than_512_go_in_the_gemm_crates_blocks() {
        // (Vectors of ranges, as `collect` makes them.)
        #[allow(clippy::single_range_in_vec_init)]
        let blocks = |m, n, depth| reduction_blocks(m, n, depth).collect::<Vec<_>>();
        // Up to 512 deep: one block (an empty reduction too: the tile stores zeros).
        assert_eq!(blocks(128, 64, 512), vec![0..512]);
        assert_eq!(blocks(128, 64, 0), vec![0..0]);
        // Deeper, past 64×64 outputs: ⌈depth / 512⌉ blocks of equal depth.
        assert_eq!(blocks(128, 64, 576), [0..288, 288..576]);
        assert_eq!(blocks(65, 8, 1152), [0..384, 384..768, 768..1152]);
        assert_eq!(
            blocks(128, 512, 2304),
            [0..461, 461..922, 922..1383, 1383..1844, 1844..2304]
        );
        assert_eq!(blocks(16, 512, 4608).len(), 9);
        // At most 64×64 outputs: 512 deep, then the rest.
        assert_eq!(blocks(64, 64, 576), [0..512, 512..576]);
        assert_eq!(blocks(3, 40, 1100), [0..512, 512..1024, 1024..1100]);
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

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
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
            // Every count of rows left after the blocks of 8 (AVX-512) and 6 (AVX2): 13, 12,
            // 25, 7, 30, 9 above leave 5, 4, 1, 7, 6, 1 and 1, 0, 1, 1, 0, 3; these 2, 3, 6
            // and 4, 5, 2.
            (10, 20, 48),
            (11, 40, 32),
            (14, 16, 64),
            // Reductions in blocks: 512 + 188 (at most 64×64 outputs), 367 + 367 + 366.
            (9, 700, 40),
            (70, 1100, 24),
        ]
        .iter()
        .enumerate()
        {
            let src = values(4096, case as u32);
            let m = values(depth * cout, 100 + case as u32);
            let p: Vec<usize> = (0..rows).map(|i| (i * 37) % 2000).collect();
            let q: Vec<usize> = (0..depth).map(|d| (d * 11) % 1500).collect();
            let want = naive(&src, &p, &q, &m, cout, None);
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
                // Adding to a destination: `dst + acc` per block, each rounded once.
                let base = values(rows * cout, 7);
                let want_sum = naive(&src, &p, &q, &m, cout, Some(&base));
                let mut sum = base.clone();
                assert!(product_with(level, &src, &p, &q, &m, cout, &mut sum, true));
                assert_eq!(bits(&sum), bits(&want_sum), "{level:?} add");
            }
        }
    }

    #[test]
    fn a_product_split_over_threads_gives_the_sum_written_out() {
        // 200 rows × 40 columns × 600 deep: 4.8 M multiply-adds, split in parts of 56 rows
        // (the last 32) over 4 threads, in the whole product's reduction blocks (300 + 300; a
        // part alone, at most 64×64 outputs, would take 512 + 88).
        let (rows, depth, cout) = (200, 600, 40);
        assert!(rows * depth * cout >= SPLIT_WORK);
        let src = values(4096, 21);
        let m = values(depth * cout, 22);
        let p: Vec<usize> = (0..rows).map(|i| (i * 13) % 2000).collect();
        let q: Vec<usize> = (0..depth).map(|d| (d * 7) % 1500).collect();
        let want = naive(&src, &p, &q, &m, cout, None);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(4)
            .build()
            .expect("a pool of 4 threads");
        for level in [Level::Avx2, Level::Avx512] {
            let mut out = vec![f32::NAN; rows * cout];
            if !pool.install(|| product_with(level, &src, &p, &q, &m, cout, &mut out, false)) {
                // This CPU lacks the level: nothing to compare.
                continue;
            }
            assert_eq!(bits(&out), bits(&want), "{level:?}");
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
