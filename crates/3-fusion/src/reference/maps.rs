//! The element-wise maps of FP16 tensors in vector lanes: the BN apply (with its residual
//! forms and ReLU), the BN-backward apply and the add, for whole pixels of `c` channels; and
//! the dReLU of the recomputed BN output over a tile of the fused dgrad ([`drelu_tile`]).
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
use super::fused::SavedBn;

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
    /// Whether every per-channel coefficient holds `c` values (a check per block: no
    /// allocation).
    fn fits(&self, c: usize) -> bool {
        let ok = |k: &[A]| k.len() == c;
        match *self {
            PointwiseMap::Apply { s, b, .. } | PointwiseMap::ApplyAdd { s, b, .. } => {
                ok(s) && ok(b)
            }
            PointwiseMap::ApplyScaleBias { s, b, s2, b2, .. } => ok(s) && ok(b) && ok(s2) && ok(b2),
            PointwiseMap::DbnApply { a, b, c: k } => ok(a) && ok(b) && ok(k),
            PointwiseMap::Add => true,
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
    if c == 0 || u.len() != out.len() || !u.len().is_multiple_of(c) || !m.fits(c) {
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

/// The dReLU of a recomputed BN output over one dgrad tile (whole pixels of `c` channels; the
/// scalar path is `fused.rs`'s `drelu_dbn_rows` and the stores after it). Per element, `k`
/// its channel: `yv = widen(y)`, `z = (((yv − mean)·inv_std)·γ + β) + r`, `g = dxc + d`,
/// `out = f16(z > 0 ? g : +0)`, `res = widen(out)`, where `d` and `r` are the widened
/// `dy_branch` and `resid`, or an FP32 `+0` where absent (the graph's virtual add of a zero).
/// Returns false, writing nothing, where the CPU has no vector path for `c` or the lengths do
/// not match.
#[allow(clippy::too_many_arguments)]
pub(crate) fn drelu_tile(
    c: usize,
    dxc: &[f32],
    y: &[f16],
    dy_branch: Option<&[f16]>,
    resid: Option<&[f16]>,
    bn: &SavedBn<'_, f32>,
    yv: &mut [f32],
    out: &mut [f16],
    res: &mut [f32],
) -> bool {
    let level = convert::level();
    drelu_tile_with(level, c, dxc, y, dy_branch, resid, bn, yv, out, res)
}

/// [`drelu_tile`] at a given level (one the CPU lacks returns false).
#[allow(clippy::too_many_arguments)]
pub(crate) fn drelu_tile_with(
    level: Level,
    c: usize,
    dxc: &[f32],
    y: &[f16],
    dy_branch: Option<&[f16]>,
    resid: Option<&[f16]>,
    bn: &SavedBn<'_, f32>,
    yv: &mut [f32],
    out: &mut [f16],
    res: &mut [f32],
) -> bool {
    let n = dxc.len();
    let same = |len: usize| len == n;
    if c == 0
        || !n.is_multiple_of(c)
        || ![y.len(), yv.len(), out.len(), res.len()]
            .into_iter()
            .all(same)
        || !dy_branch.is_none_or(|d| same(d.len()))
        || !resid.is_none_or(|r| same(r.len()))
        || ![bn.mean, bn.inv_std, bn.gamma, bn.beta]
            .iter()
            .all(|k| k.len() == c)
    {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let t = x86::Tile {
            c,
            dxc,
            y,
            d: dy_branch,
            r: resid,
            bn,
        };
        if level == Level::Avx512
            && c.is_multiple_of(16)
            && std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx2")
        {
            // SAFETY: the CPU has AVX-512F and AVX2 (checked just above); `c` is a multiple of
            // 16; every operand holds `n` values (whole pixels of `c`), the BN's `c` (checked
            // above).
            unsafe { x86::drelu_avx512(&t, yv, out, res) };
            return true;
        }
        if level != Level::Portable
            && c.is_multiple_of(8)
            && std::arch::is_x86_feature_detected!("f16c")
            && std::arch::is_x86_feature_detected!("avx")
        {
            // SAFETY: the CPU has F16C and AVX (checked just above); `c` is a multiple of 8;
            // the lengths as above.
            unsafe { x86::drelu_f16c(&t, yv, out, res) };
            return true;
        }
    }
    let _ = (level, dxc, y, dy_branch, resid, bn, yv, out, res);
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
        /// `N` FP32 values stored at `p`.
        unsafe fn store(self, p: *mut f32);
        unsafe fn sub(self, o: Self) -> Self;
        /// All lanes `+0`.
        unsafe fn zero() -> Self;
        /// `self` where `z > 0` (false for NaN), else `+0`.
        unsafe fn where_positive(self, z: Self) -> Self;
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
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            // SAFETY: the caller's contract (room for 16 FP32 values at `p`).
            unsafe { _mm512_mask_storeu_ps(p, !0, self) }
        }
        #[inline(always)]
        unsafe fn sub(self, o: Self) -> Self {
            // SAFETY: the CPU has AVX-512F (the caller's contract).
            unsafe { _mm512_sub_ps(self, o) }
        }
        #[inline(always)]
        unsafe fn zero() -> Self {
            // SAFETY: as above.
            unsafe { _mm512_setzero_ps() }
        }
        #[inline(always)]
        unsafe fn where_positive(self, z: Self) -> Self {
            // SAFETY: as above. (Ordered, quiet: false for NaN, as the scalar `z > 0`.)
            unsafe {
                let positive = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(z, _mm512_setzero_ps());
                _mm512_maskz_mov_ps(positive, self)
            }
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
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            // SAFETY: the caller's contract (room for 8 FP32 values at `p`).
            unsafe { _mm256_maskstore_ps(p, _mm256_set1_epi32(-1), self) }
        }
        #[inline(always)]
        unsafe fn sub(self, o: Self) -> Self {
            // SAFETY: the CPU has AVX (the caller's contract).
            unsafe { _mm256_sub_ps(self, o) }
        }
        #[inline(always)]
        unsafe fn zero() -> Self {
            // SAFETY: as above.
            unsafe { _mm256_setzero_ps() }
        }
        #[inline(always)]
        unsafe fn where_positive(self, z: Self) -> Self {
            // SAFETY: as above. (Ordered, quiet: false for NaN, as the scalar `z > 0`; the
            // all-ones lanes of the comparison keep `self`'s bits, the others give `+0`.)
            unsafe {
                let positive = _mm256_cmp_ps::<_CMP_GT_OQ>(z, _mm256_setzero_ps());
                _mm256_and_ps(positive, self)
            }
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

    /// The inputs of [`super::drelu_tile`].
    pub(super) struct Tile<'a> {
        pub(super) c: usize,
        pub(super) dxc: &'a [f32],
        pub(super) y: &'a [f16],
        pub(super) d: Option<&'a [f16]>,
        pub(super) r: Option<&'a [f16]>,
        pub(super) bn: &'a super::SavedBn<'a, f32>,
    }

    /// [`super::drelu_tile`], `L::N` channels at a time.
    ///
    /// # Safety
    /// The CPU has `L`'s features; `t.c` is a multiple of `L::N`; `t.dxc`, `t.y`, `t.d` and
    /// `t.r` (where present), `yv`, `out` and `res` hold the same whole pixels of `t.c` values;
    /// the BN's vectors `t.c` values each.
    #[inline(always)]
    unsafe fn drelu<L: Lanes>(t: &Tile<'_>, yv: &mut [f32], out: &mut [f16], res: &mut [f32]) {
        let c = t.c;
        for p in 0..t.dxc.len() / c {
            for j in (0..c).step_by(L::N) {
                let at = p * c + j;
                // SAFETY: `at + L::N <= n`, every operand's length, and `j + L::N <= c`, the
                // BN vectors' (the function's contract); the features are the function's.
                unsafe {
                    let k = |v: &[f32]| L::load(v.as_ptr().wrapping_add(j));
                    let opt = |v: Option<&[f16]>| match v {
                        Some(v) => L::load_h(v.as_ptr().wrapping_add(at)),
                        None => L::zero(),
                    };
                    let y = L::load_h(t.y.as_ptr().wrapping_add(at));
                    y.store(yv.as_mut_ptr().wrapping_add(at));
                    let g = L::load(t.dxc.as_ptr().wrapping_add(at)).add(opt(t.d));
                    let bn = t.bn;
                    let z = y
                        .sub(k(bn.mean))
                        .mul(k(bn.inv_std))
                        .mul(k(bn.gamma))
                        .add(k(bn.beta));
                    let z = z.add(opt(t.r));
                    let o = out.as_mut_ptr().wrapping_add(at);
                    g.where_positive(z).store_h(o);
                    L::load_h(o).store(res.as_mut_ptr().wrapping_add(at));
                }
            }
        }
    }

    /// # Safety
    /// The CPU has AVX-512F and AVX2; `t.c` is a multiple of 16; the lengths as [`drelu`].
    #[target_feature(enable = "avx512f,avx2")]
    pub(super) unsafe fn drelu_avx512(
        t: &Tile<'_>,
        yv: &mut [f32],
        out: &mut [f16],
        res: &mut [f32],
    ) {
        // SAFETY: the function's contract.
        unsafe { drelu::<__m512>(t, yv, out, res) }
    }

    /// # Safety
    /// The CPU has F16C and AVX; `t.c` is a multiple of 8; the lengths as [`drelu`].
    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn drelu_f16c(
        t: &Tile<'_>,
        yv: &mut [f32],
        out: &mut [f16],
        res: &mut [f32],
    ) {
        // SAFETY: the function's contract.
        unsafe { drelu::<__m256>(t, yv, out, res) }
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

    /// `drelu_dbn_rows` and the stores after it, written out: `(yv, out, res)`.
    fn drelu_written_out(
        c: usize,
        dxc: &[f32],
        y: &[f16],
        d: Option<&[f16]>,
        r: Option<&[f16]>,
        bn: &SavedBn<'_, f32>,
    ) -> (Vec<f32>, Vec<f16>, Vec<f32>) {
        let (mut yv, mut out, mut res) = (Vec::new(), Vec::new(), Vec::new());
        for (i, &g) in dxc.iter().enumerate() {
            let k = i % c;
            let x = y[i].to_f32();
            let grad = g + d.map_or(0.0, |d| d[i].to_f32());
            let z = (x - bn.mean[k]) * bn.inv_std[k] * bn.gamma[k] + bn.beta[k];
            let z = z + r.map_or(0.0, |r| r[i].to_f32());
            let o = f16::from_f32(if z > 0.0 { grad } else { 0.0 });
            yv.push(x);
            out.push(o);
            res.push(o.to_f32());
        }
        (yv, out, res)
    }

    #[test]
    fn the_drelu_tile_matches_the_scalar_path_bit_for_bit() {
        // Every FP16 pattern as `y`; the joins in other orders; `dxc` over FP32 patterns that
        // hold NaN, infinities, both zeros, subnormals and values that overflow FP16.
        let y: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
        let d: Vec<f16> = (0..=u16::MAX)
            .map(|i| f16::from_bits(i.wrapping_mul(40_503).rotate_left(3)))
            .collect();
        let r: Vec<f16> = (0..=u16::MAX)
            .map(|i| f16::from_bits(i.wrapping_mul(21_011).rotate_left(7)))
            .collect();
        let dxc: Vec<f32> = (0..=u16::MAX as u32)
            .map(|i| match i % 7 {
                0 => f32::from_bits(i.wrapping_mul(2_654_435_761)),
                1 => -0.0,
                2 => 7.0e4,
                _ => (i as f32 - 30_000.0) * 1.0e-3,
            })
            .collect();
        let mut checked = 0;
        for c in [8, 16, 24, 32, 48] {
            let n = y.len() / c * c;
            let k: Vec<Vec<f32>> = (0..4).map(|j| coefficients(c, 3 * j + 1)).collect();
            let bn = SavedBn {
                mean: &k[0],
                inv_std: &k[1],
                gamma: &k[2],
                beta: &k[3],
            };
            for (dj, rj) in [(false, false), (true, false), (false, true), (true, true)] {
                let dj = dj.then_some(&d[..n]);
                let rj = rj.then_some(&r[..n]);
                let want = drelu_written_out(c, &dxc[..n], &y[..n], dj, rj, &bn);
                for level in [Level::Avx512, Level::F16c] {
                    let mut yv = vec![f32::NAN; n];
                    let mut out = vec![f16::from_bits(0x7E5A); n];
                    let mut res = vec![f32::NAN; n];
                    let (dxc, y) = (&dxc[..n], &y[..n]);
                    if !drelu_tile_with(level, c, dxc, y, dj, rj, &bn, &mut yv, &mut out, &mut res)
                    {
                        assert!(!has(level), "{level:?} c {c} declined");
                        continue;
                    }
                    let bits32 = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    let at = format!("{level:?} c {c} d {} r {}", dj.is_some(), rj.is_some());
                    assert_eq!(bits32(&yv), bits32(&want.0), "yv {at}");
                    // Where both `dxc` and `dy_branch` are NaN, either may survive the add.
                    for (i, (g, w)) in out.iter().zip(&want.1).enumerate() {
                        let both_nan = g.is_nan() && w.is_nan();
                        assert!(g.to_bits() == w.to_bits() || both_nan, "out {at} [{i}]");
                        let (g, w) = (res[i], want.2[i]);
                        assert!(g.to_bits() == w.to_bits() || both_nan, "res {at} [{i}]");
                    }
                    checked += 1;
                }
            }
        }
        if has(Level::F16c) {
            assert!(checked >= 5 * 4, "{checked} cases checked");
        }
        // Lengths that do not match are declined, writing nothing.
        let bn1 = SavedBn {
            mean: &[0.0; 8][..],
            inv_std: &[1.0; 8][..],
            gamma: &[1.0; 8][..],
            beta: &[0.0; 8][..],
        };
        let (mut yv, mut out, mut res) = (vec![0.5; 16], vec![f16::ONE; 16], vec![0.5; 16]);
        let (x, h) = (vec![1.0f32; 16], vec![f16::ONE; 16]);
        for c in [0, 12, 16] {
            assert!(!drelu_tile_with(
                Level::F16c,
                c,
                &x,
                &h,
                None,
                None,
                &bn1,
                &mut yv,
                &mut out,
                &mut res
            ));
        }
        assert!(!drelu_tile_with(
            Level::F16c,
            8,
            &x,
            &h[..8],
            None,
            None,
            &bn1,
            &mut yv,
            &mut out,
            &mut res
        ));
        assert!(!drelu_tile_with(
            Level::Portable,
            8,
            &x,
            &h,
            None,
            None,
            &bn1,
            &mut yv,
            &mut out,
            &mut res
        ));
        assert!(yv.iter().all(|&v| v == 0.5) && out.iter().all(|&v| v == f16::ONE));
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
