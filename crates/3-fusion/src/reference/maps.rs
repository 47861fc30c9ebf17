//! The element-wise maps of FP16 tensors in vector lanes: the BN apply (with its residual
//! forms and ReLU), the BN-backward apply and the add, for whole pixels of `c` channels.
//!
//! The scalar paths (`pointwise.rs`) widen each input into a scratch, compute in FP32 with every
//! multiply and add rounded (never fused), and store to FP16 (round to nearest even), a pass
//! each. The vector path does the same per lane in registers: the conversion instructions of
//! `convert.rs`, the same multiplies and adds in the same order, and `max(v, 0)` for the ReLU,
//! which returns its second operand, `+0`, for NaN and for zeros of either sign, as the scalar
//! `relu`. So both give the same bits.
#![allow(unsafe_code)]

use half::f16;

use super::convert::{self, Level};

/// An element-wise map that [`Element::map_lanes`](super::Element::map_lanes) computes in
/// vector lanes, with its per-channel coefficients (`c` values each, of the arithmetic type
/// `A`: FP32 in FP16 mode). `u` is the first input, `v` the second; every operation is
/// rounded to `A`, in the order written.
#[derive(Debug, Clone, Copy)]
pub enum PointwiseMap<'a, A> {
    /// `act(u·s + b)`, `act` the ReLU where `relu` (else none).
    Apply {
        /// Scale.
        s: &'a [A],
        /// Bias.
        b: &'a [A],
        /// Whether a ReLU follows.
        relu: bool,
    },
    /// `act((u·s + b) + v)`.
    ApplyAdd {
        /// Scale.
        s: &'a [A],
        /// Bias.
        b: &'a [A],
        /// Whether a ReLU follows.
        relu: bool,
    },
    /// `act((u·s + b) + (v·s2 + b2))`.
    ApplyScaleBias {
        /// Scale of `u`.
        s: &'a [A],
        /// Bias of `u`.
        b: &'a [A],
        /// Scale of `v`.
        s2: &'a [A],
        /// Bias of `v`.
        b2: &'a [A],
        /// Whether a ReLU follows.
        relu: bool,
    },
    /// `(u·a + v·b) + c`.
    DbnApply {
        /// Coefficient of `u`.
        a: &'a [A],
        /// Coefficient of `v`.
        b: &'a [A],
        /// Constant.
        c: &'a [A],
    },
    /// `u + v` (no coefficients).
    Add,
}

impl<A> PointwiseMap<'_, A> {
    /// The per-channel coefficients.
    fn coefficients(&self) -> Vec<&[A]> {
        match *self {
            PointwiseMap::Apply { s, b, .. } | PointwiseMap::ApplyAdd { s, b, .. } => vec![s, b],
            PointwiseMap::ApplyScaleBias { s, b, s2, b2, .. } => vec![s, b, s2, b2],
            PointwiseMap::DbnApply { a, b, c } => vec![a, b, c],
            PointwiseMap::Add => Vec::new(),
        }
    }

    /// Whether it reads a second input.
    fn binary(&self) -> bool {
        !matches!(self, PointwiseMap::Apply { .. })
    }
}

/// `out = map(u[, v])` over whole pixels of `c` channels, where the CPU has a vector path for
/// `c` (a multiple of 16 with AVX-512F, of 8 with F16C; for the add, which has no per-channel
/// values, the length is what must be such a multiple). Returns false, leaving `out`
/// untouched, where it has none or the lengths do not match (`u`, `v` where the map reads it,
/// and `out` whole pixels of the same length; each coefficient `c` values): the caller then
/// runs the scalar path.
pub(crate) fn map(
    m: PointwiseMap<'_, f32>,
    c: usize,
    u: &[f16],
    v: Option<&[f16]>,
    out: &mut [f16],
) -> bool {
    map_with(convert::level(), m, c, u, v, out)
}

/// [`map`] at a given level (one the CPU lacks returns false).
pub(crate) fn map_with(
    level: Level,
    m: PointwiseMap<'_, f32>,
    c: usize,
    u: &[f16],
    v: Option<&[f16]>,
    out: &mut [f16],
) -> bool {
    // The second input, where the map reads one (an empty one where not: never read).
    let v = match (m.binary(), v) {
        (true, Some(v)) if v.len() == u.len() => v,
        (false, None) => &[][..],
        _ => return false,
    };
    // The add has no coefficients: any whole number of vectors will do.
    let c = match m {
        PointwiseMap::Add if u.len().is_multiple_of(16) => 16,
        PointwiseMap::Add if u.len().is_multiple_of(8) => 8,
        _ => c,
    };
    if c == 0
        || u.len() != out.len()
        || !u.len().is_multiple_of(c)
        || m.coefficients().iter().any(|k| k.len() != c)
    {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let avx512 = level == Level::Avx512
            && std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx2");
        let f16c = level != Level::Portable
            && std::arch::is_x86_feature_detected!("f16c")
            && std::arch::is_x86_feature_detected!("avx");
        if avx512 && c.is_multiple_of(16) {
            // SAFETY: the CPU has AVX-512F and AVX2 (checked just above); `c` is a multiple
            // of 16; `u`, `out` (and `v` where the map reads it) hold the same whole pixels of
            // `c` values and every coefficient `c` values (checked above).
            unsafe { x86::avx512(&m, c, u, v, out) };
            return true;
        }
        if f16c && c.is_multiple_of(8) {
            // SAFETY: the CPU has F16C and AVX (checked just above); `c` is a multiple of 8;
            // the lengths as above.
            unsafe { x86::f16c(&m, c, u, v, out) };
            return true;
        }
    }
    let _ = (level, m, u, v, out);
    false
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::PointwiseMap;
    use core::arch::x86_64::*;
    use half::f16;

    /// Round to nearest even (as `convert.rs`).
    const NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT;

    // Loads and stores through the masked intrinsics with an all-ones mask, as in
    // `convert.rs` (plain unaligned moves), and pointer arithmetic by `wrapping_add`: the
    // unmasked moves and `add` carry precondition checks the release builds keep.

    /// The lanes of one vector width: the few operations the maps need.
    trait Lanes: Copy {
        /// Lanes per vector.
        const N: usize;
        /// `N` FP16 values at `p`, widened.
        unsafe fn load_h(p: *const f16) -> Self;
        /// `N` FP32 values at `p`.
        unsafe fn load(p: *const f32) -> Self;
        /// Rounded to FP16 (nearest even) and stored at `p`.
        unsafe fn store_h(self, p: *mut f16);
        unsafe fn mul(self, o: Self) -> Self;
        unsafe fn add(self, o: Self) -> Self;
        /// `max(self, +0)`: `+0` for NaN and zeros of either sign.
        unsafe fn relu(self) -> Self;
    }

    impl Lanes for __m512 {
        const N: usize = 16;
        #[inline(always)]
        unsafe fn load_h(p: *const f16) -> Self {
            // SAFETY: the caller's contract (16 FP16 values at `p`; AVX-512F and AVX2).
            unsafe { _mm512_cvtph_ps(_mm256_maskload_epi32(p.cast(), _mm256_set1_epi32(-1))) }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            // SAFETY: the caller's contract (16 FP32 values at `p`).
            unsafe { _mm512_maskz_loadu_ps(!0, p) }
        }
        #[inline(always)]
        unsafe fn store_h(self, p: *mut f16) {
            // SAFETY: the caller's contract (room for 16 FP16 values at `p`).
            unsafe {
                let h = _mm512_cvtps_ph::<NEAREST>(self);
                _mm256_maskstore_epi32(p.cast(), _mm256_set1_epi32(-1), h);
            }
        }
        #[inline(always)]
        unsafe fn mul(self, o: Self) -> Self {
            // SAFETY: the CPU has AVX-512F (the caller's contract).
            unsafe { _mm512_mul_ps(self, o) }
        }
        #[inline(always)]
        unsafe fn add(self, o: Self) -> Self {
            // SAFETY: as above.
            unsafe { _mm512_add_ps(self, o) }
        }
        #[inline(always)]
        unsafe fn relu(self) -> Self {
            // SAFETY: as above.
            unsafe { _mm512_max_ps(self, _mm512_setzero_ps()) }
        }
    }

    impl Lanes for __m256 {
        const N: usize = 8;
        #[inline(always)]
        unsafe fn load_h(p: *const f16) -> Self {
            // SAFETY: the caller's contract (8 FP16 values at `p`; F16C and AVX).
            unsafe {
                let h = _mm_castps_si128(_mm_maskload_ps(p.cast(), _mm_set1_epi32(-1)));
                _mm256_cvtph_ps(h)
            }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            // SAFETY: the caller's contract (8 FP32 values at `p`).
            unsafe { _mm256_maskload_ps(p, _mm256_set1_epi32(-1)) }
        }
        #[inline(always)]
        unsafe fn store_h(self, p: *mut f16) {
            // SAFETY: the caller's contract (room for 8 FP16 values at `p`).
            unsafe {
                let h = _mm256_cvtps_ph::<NEAREST>(self);
                _mm_maskstore_ps(p.cast(), _mm_set1_epi32(-1), _mm_castsi128_ps(h));
            }
        }
        #[inline(always)]
        unsafe fn mul(self, o: Self) -> Self {
            // SAFETY: the CPU has AVX (the caller's contract).
            unsafe { _mm256_mul_ps(self, o) }
        }
        #[inline(always)]
        unsafe fn add(self, o: Self) -> Self {
            // SAFETY: as above.
            unsafe { _mm256_add_ps(self, o) }
        }
        #[inline(always)]
        unsafe fn relu(self) -> Self {
            // SAFETY: as above.
            unsafe { _mm256_max_ps(self, _mm256_setzero_ps()) }
        }
    }

    /// `x`, or `max(x, +0)` where `relu`.
    ///
    /// # Safety
    /// The CPU has `L`'s features.
    #[inline(always)]
    unsafe fn act<L: Lanes>(x: L, relu: bool) -> L {
        if relu {
            // SAFETY: the function's contract.
            unsafe { x.relu() }
        } else {
            x
        }
    }

    /// The map over every pixel, `L::N` channels at a time.
    ///
    /// # Safety
    /// The CPU has `L`'s features; `c` is a multiple of `L::N`; `u`, `out` (and `v` where the
    /// map reads it) hold the same whole pixels of `c` values; every coefficient `c` values.
    #[inline(always)]
    unsafe fn run<L: Lanes>(
        m: &PointwiseMap<'_, f32>,
        c: usize,
        u: &[f16],
        v: &[f16],
        out: &mut [f16],
    ) {
        for (p, o) in out.chunks_exact_mut(c).enumerate() {
            let at = p * c;
            for j in (0..c).step_by(L::N) {
                // SAFETY: `at + j + L::N <= u.len()` (and `v.len()` where read, `out.len()`)
                // and `j + L::N <= c`, each coefficient's length (the function's contract);
                // the features are the function's.
                unsafe {
                    // Channel `j..`'s coefficients, and the second input's lanes.
                    macro_rules! k {
                        ($s:expr) => {
                            L::load($s.as_ptr().wrapping_add(j))
                        };
                    }
                    macro_rules! second {
                        () => {
                            L::load_h(v.as_ptr().wrapping_add(at + j))
                        };
                    }
                    let x = L::load_h(u.as_ptr().wrapping_add(at + j));
                    // Each operation in the scalar loop's order (`pointwise.rs`).
                    let r = match *m {
                        PointwiseMap::Apply { s, b, relu } => act(x.mul(k!(s)).add(k!(b)), relu),
                        PointwiseMap::ApplyAdd { s, b, relu } => {
                            act(x.mul(k!(s)).add(k!(b)).add(second!()), relu)
                        }
                        PointwiseMap::ApplyScaleBias { s, b, s2, b2, relu } => {
                            let main = x.mul(k!(s)).add(k!(b));
                            act(main.add(second!().mul(k!(s2)).add(k!(b2))), relu)
                        }
                        PointwiseMap::DbnApply { a, b, c: cc } => {
                            x.mul(k!(a)).add(second!().mul(k!(b))).add(k!(cc))
                        }
                        PointwiseMap::Add => x.add(second!()),
                    };
                    r.store_h(o.as_mut_ptr().wrapping_add(j));
                }
            }
        }
    }

    /// # Safety
    /// The CPU has AVX-512F and AVX2; `c` is a multiple of 16; the lengths as [`run`].
    #[target_feature(enable = "avx512f,avx2")]
    pub(super) unsafe fn avx512(
        m: &PointwiseMap<'_, f32>,
        c: usize,
        u: &[f16],
        v: &[f16],
        out: &mut [f16],
    ) {
        // SAFETY: the function's contract.
        unsafe { run::<__m512>(m, c, u, v, out) }
    }

    /// # Safety
    /// The CPU has F16C and AVX; `c` is a multiple of 8; the lengths as [`run`].
    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn f16c(
        m: &PointwiseMap<'_, f32>,
        c: usize,
        u: &[f16],
        v: &[f16],
        out: &mut [f16],
    ) {
        // SAFETY: the function's contract.
        unsafe { run::<__m256>(m, c, u, v, out) }
    }
}

#[cfg(test)]
mod tests {
    use super::super::convert::tests::has;
    use super::*;

    /// The scalar loops written out: widen, each multiply and add rounded in the order the
    /// variant gives, the ReLU as `v > 0 ? v : +0`, store (round to nearest even).
    fn written_out(m: &PointwiseMap<'_, f32>, c: usize, u: &[f16], v: &[f16]) -> Vec<f16> {
        let act = |x: f32, relu: bool| if !relu || x > 0.0 { x } else { 0.0 };
        u.iter()
            .enumerate()
            .map(|(i, x)| {
                let (k, x) = (i % c, x.to_f32());
                let y = || v[i].to_f32();
                let r = match *m {
                    PointwiseMap::Apply { s, b, relu } => act(x * s[k] + b[k], relu),
                    PointwiseMap::ApplyAdd { s, b, relu } => act(x * s[k] + b[k] + y(), relu),
                    PointwiseMap::ApplyScaleBias { s, b, s2, b2, relu } => {
                        let main = x * s[k] + b[k];
                        let shortcut = y() * s2[k] + b2[k];
                        act(main + shortcut, relu)
                    }
                    PointwiseMap::DbnApply { a, b, c } => x * a[k] + y() * b[k] + c[k],
                    PointwiseMap::Add => x + y(),
                };
                f16::from_f32(r)
            })
            .collect()
    }

    /// Coefficients per channel that overflow, underflow, cancel and tie when rounded to FP16,
    /// both zeros among them; `shift` gives each coefficient of a map its own pattern.
    fn coefficients(c: usize, shift: usize) -> Vec<f32> {
        const VALUES: [f32; 11] = [
            1.0, -1.0, 3.5e4, 1e-6, 0.3, -2.0, 0.0, -0.0, 6.0e4, -1e-3, 0.5,
        ];
        (0..c)
            .map(|k| match (k + shift) % 13 {
                11 => 1.0 + 2f32.powi(-11),
                12 => 2f32.powi(-25),
                j => VALUES[j],
            })
            .collect()
    }

    #[test]
    fn every_map_and_level_matches_the_scalar_loops_bit_for_bit() {
        // Every FP16 bit pattern as `u` (NaN, infinities, subnormals, both zeros), and as `v`
        // in another order, so that every pattern meets many others.
        let u: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
        let v: Vec<f16> = (0..=u16::MAX)
            .map(|i| f16::from_bits(i.wrapping_mul(40_503).rotate_left(5)))
            .collect();
        let mut checked = 0;
        for c in [8, 16, 24, 32, 48] {
            let n = u.len() / c * c;
            let k: Vec<Vec<f32>> = (0..4).map(|j| coefficients(c, 3 * j)).collect();
            let mut maps = vec![PointwiseMap::Add];
            for relu in [true, false] {
                maps.push(PointwiseMap::Apply {
                    s: &k[0],
                    b: &k[1],
                    relu,
                });
                maps.push(PointwiseMap::ApplyAdd {
                    s: &k[0],
                    b: &k[1],
                    relu,
                });
                maps.push(PointwiseMap::ApplyScaleBias {
                    s: &k[0],
                    b: &k[1],
                    s2: &k[2],
                    b2: &k[3],
                    relu,
                });
            }
            maps.push(PointwiseMap::DbnApply {
                a: &k[0],
                b: &k[1],
                c: &k[2],
            });
            for m in &maps {
                let second = m.binary().then_some(&v[..n]);
                let want = written_out(m, c, &u[..n], &v[..n]);
                for level in [Level::Avx512, Level::F16c] {
                    let mut got = vec![f16::from_bits(0x7E5A); n];
                    if !map_with(level, *m, c, &u[..n], second, &mut got) {
                        // Only a level this CPU lacks, or channels the 16 lanes do not divide
                        // (the add has none, and its lengths here are multiples of 16).
                        let add = matches!(m, PointwiseMap::Add);
                        assert!(
                            !has(level) || (level == Level::Avx512 && c % 16 != 0 && !add),
                            "{level:?} c {c} {m:?}"
                        );
                        continue;
                    }
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        // Where two NaNs meet, either may survive (the compiler may order the
                        // operands of a commutative add or multiply either way, on both paths).
                        let both_nan = g.is_nan() && w.is_nan();
                        assert!(
                            g.to_bits() == w.to_bits() || both_nan,
                            "{level:?} c {c} {m:?} [{i}] u {} v {}: {g} vs {w}",
                            u[i],
                            v[i]
                        );
                    }
                    checked += 1;
                }
            }
        }
        // The F16C level runs every case on any x86-64 CPU with F16C (all that CI has).
        if has(Level::F16c) {
            assert!(checked >= 5 * 8, "{checked} cases checked");
        }
    }

    #[test]
    fn shapes_without_a_vector_path_are_declined() {
        let u = vec![f16::ONE; 64];
        let s = vec![1.0f32; 16];
        let mut out = vec![f16::ZERO; 64];
        let apply = PointwiseMap::Apply {
            s: &s,
            b: &s,
            relu: true,
        };
        for level in [Level::Avx512, Level::F16c] {
            // Channels not a multiple of the lanes (8 at most), coefficients of another
            // length, inputs of other lengths, a missing or an extra second input.
            assert!(!map_with(level, apply, 12, &u[..48], None, &mut out[..48]));
            assert!(!map_with(level, apply, 8, &u, None, &mut out));
            assert!(!map_with(level, apply, 16, &u[..32], None, &mut out));
            assert!(!map_with(level, apply, 16, &u, Some(&u), &mut out));
            let add = PointwiseMap::Add;
            assert!(!map_with(level, add, 16, &u, None, &mut out));
            assert!(!map_with(
                level,
                add,
                1,
                &u[..12],
                Some(&u[..12]),
                &mut out[..12]
            ));
            assert!(!map_with(level, add, 0, &u, Some(&u[..32]), &mut out));
        }
        assert!(!map_with(Level::Portable, apply, 16, &u, None, &mut out));
        assert!(
            out.iter().all(|h| h.to_bits() == 0),
            "a declined call leaves out untouched"
        );
    }
}
