//! The two precision modes: the element types ops are generic over.
//!
//! Every op is written once, generic over an [`Element`] (the storage type of activations,
//! filters and the FP16 per-channel vectors) and its [`Real`] partner `Element::Acc` (the type
//! of arithmetic and of the FP32 per-channel vectors):
//!
//! | mode | `Element` (GPU: FP16 storage) | `Acc` (GPU: FP32 compute) | used for |
//! |---|---|---|---|
//! | FP16 | [`half::f16`] | `f32` | the oracle for GPU parity, the CPU executor |
//! | f64 | `f64` | `f64` | finite-difference checks, exact comparisons |
//!
//! In FP16 mode [`Element::from_acc`] is the round-to-nearest-even store the GPU does wherever a
//! graph writes an FP16 tensor; in f64 mode it is the identity, so the same code computes the
//! exact (up to f64) function.
//!
//! The two traits are sealed: only these two pairs exist.

use std::fmt::Debug;
use std::ops::{Add, AddAssign, Div, Mul, Neg, Sub};

use half::f16;
use half::slice::HalfFloatSliceExt;
use ndarray::{ArrayView2, ArrayViewMut2, ShapeBuilder};

use super::convert;
use super::error::{ReferenceError, Result};
use super::fused::SavedBn;
use super::maps::PointwiseMap;

/// The storage type of tensors (FP16 on the GPU): [`half::f16`] or `f64`.
pub trait Element:
    Copy + Send + Sync + Debug + PartialEq + Default + 'static + private::Sealed
{
    /// The arithmetic type paired with this storage type: `f32` for `f16`, `f64` for `f64`.
    type Acc: Real<Storage = Self>;

    /// Widens a stored value to the arithmetic type (exact).
    fn to_acc(self) -> Self::Acc;

    /// Stores an arithmetic value: round to nearest even for `f16`, identity for `f64`.
    fn from_acc(value: Self::Acc) -> Self;

    /// `self > 0` (false for zeros of either sign and NaN), as `self.to_acc() > 0`.
    #[inline]
    fn is_positive(self) -> bool {
        self.to_acc() > Self::Acc::ZERO
    }

    /// Widens to `f64` (exact).
    fn to_f64(self) -> f64 {
        self.to_acc().to_f64()
    }

    /// Rounds an `f64` to this type (one rounding, to nearest even).
    fn from_f64(value: f64) -> Self;

    /// Widens a whole slice to the arithmetic type.
    fn widen_slice(src: &[Self]) -> Vec<Self::Acc> {
        src.iter().map(|v| v.to_acc()).collect()
    }

    /// Stores a whole slice of arithmetic values (see [`Element::from_acc`]).
    fn store_slice(src: &[Self::Acc]) -> Vec<Self> {
        src.iter().map(|&v| Self::from_acc(v)).collect()
    }

    /// Widens `src` into `dst` (equal lengths; the same values as [`Element::to_acc`]).
    fn widen_into(src: &[Self], dst: &mut [Self::Acc]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = s.to_acc();
        }
    }

    /// Stores `src` into `dst` (equal lengths; the same values as [`Element::from_acc`]).
    fn store_into(src: &[Self::Acc], dst: &mut [Self]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = Self::from_acc(s);
        }
    }

    /// ReLU backward's select: `out[i] = dy[i]` where `x[i]` [`Element::is_positive`], else
    /// `+0` (equal lengths).
    fn relu_select(dy: &[Self], x: &[Self], out: &mut [Self]) {
        for ((o, v), d) in out.iter_mut().zip(x).zip(dy) {
            *o = if v.is_positive() { *d } else { Self::default() };
        }
    }

    /// The BN-apply prologue of whole pixels of `c` channels in vector lanes, where this type
    /// has them: `x = widen(store(relu(widen(y)·s + b)))` with `s`, `b` per channel (the
    /// multiply and the add each rounded). False, leaving `x` untouched, where it has none
    /// (the default): the caller then computes it pass by pass, to the same values.
    fn prologue_lanes(
        c: usize,
        y: &[Self],
        s: &[Self::Acc],
        b: &[Self::Acc],
        x: &mut [Self::Acc],
    ) -> bool {
        let _ = (c, y, s, b, x);
        false
    }

    /// An element-wise map of whole pixels of `c` channels in vector lanes, where this type
    /// has them (`maps.rs`): `out = m(u[, v])`, each operation rounded as the scalar loops
    /// round it. False, leaving `out` untouched, where it has none (the default): the caller
    /// then computes it pass by pass, to the same values.
    fn map_lanes(
        m: PointwiseMap<'_, Self::Acc>,
        c: usize,
        u: &[Self],
        v: Option<&[Self]>,
        out: &mut [Self],
    ) -> bool {
        let _ = (m, c, u, v, out);
        false
    }

    /// The dReLU of a recomputed BN output over one dgrad tile of whole pixels of `c`
    /// channels in vector lanes, where this type has them (`maps.rs`'s `drelu_tile`: `yv` the
    /// widened `y`, `out` the stored result, `res` it widened). False, writing nothing, where it
    /// has none (the default): the caller then computes it pass by pass, to the same values.
    #[allow(clippy::too_many_arguments)]
    fn drelu_lanes(
        c: usize,
        dxc: &[Self::Acc],
        y: &[Self],
        dy_branch: Option<&[Self]>,
        resid: Option<&[Self]>,
        bn: &SavedBn<'_, Self::Acc>,
        yv: &mut [Self::Acc],
        out: &mut [Self],
        res: &mut [Self::Acc],
    ) -> bool {
        let _ = (c, dxc, y, dy_branch, resid, bn, yv, out, res);
        false
    }

    /// The raw bits, for exact comparisons (zeros of both signs and NaN payloads told apart).
    fn bits(self) -> u64;

    /// Whether `a` and `b` hold the same bits, element for element.
    fn same_bits(a: &[Self], b: &[Self]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(p, q)| p.bits() == q.bits())
    }
}

/// The arithmetic type (FP32 on the GPU): `f32` or `f64`.
pub trait Real:
    Copy
    + Send
    + Sync
    + Debug
    + Default
    + PartialOrd
    + 'static
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + AddAssign
    + private::Gemm
{
    /// The storage type paired with this arithmetic type: `f16` for `f32`, `f64` for `f64`.
    type Storage: Element<Acc = Self>;

    /// Additive identity.
    const ZERO: Self;

    /// Multiplicative identity.
    const ONE: Self;

    /// Rounds an `f64` to this type (to nearest even).
    fn from_f64(value: f64) -> Self;

    /// Widens to `f64` (exact).
    fn to_f64(self) -> f64;

    /// `max(self, 0)`; NaN maps to 0.
    fn relu(self) -> Self {
        if self > Self::ZERO {
            self
        } else {
            Self::ZERO
        }
    }
}

impl Element for f16 {
    type Acc = f32;

    #[inline]
    fn to_acc(self) -> f32 {
        self.to_f32()
    }

    #[inline]
    fn from_acc(value: f32) -> Self {
        f16::from_f32(value)
    }

    #[inline]
    fn bits(self) -> u64 {
        u64::from(self.to_bits())
    }

    /// On the bits, as a mask (`dy`'s bits or all zeros), which vectorizes where the
    /// generic select on `f16` values did not.
    fn relu_select(dy: &[Self], x: &[Self], out: &mut [Self]) {
        let n = out.len().min(x.len()).min(dy.len());
        let (dy, x) = (&dy.reinterpret_cast()[..n], &x.reinterpret_cast()[..n]);
        let out = &mut out.reinterpret_cast_mut()[..n];
        for i in 0..n {
            // `is_positive`: bits 0x0001..=0x7C00.
            let keep = u16::from(x[i].wrapping_sub(1) < 0x7C00);
            out[i] = dy[i] & keep.wrapping_neg();
        }
    }

    /// With F16C or AVX-512F conversions, where `c` is a multiple of their lanes
    /// (`prologue.rs`).
    fn prologue_lanes(c: usize, y: &[Self], s: &[f32], b: &[f32], x: &mut [f32]) -> bool {
        super::prologue::prologue(c, y, s, b, x)
    }

    /// With F16C or AVX-512F conversions, where `c` is a multiple of their lanes (`maps.rs`).
    fn map_lanes(
        m: PointwiseMap<'_, f32>,
        c: usize,
        u: &[Self],
        v: Option<&[Self]>,
        out: &mut [Self],
    ) -> bool {
        super::maps::map(m, c, u, v, out)
    }

    /// With F16C or AVX-512F conversions, where `c` is a multiple of their lanes (`maps.rs`).
    fn drelu_lanes(
        c: usize,
        dxc: &[f32],
        y: &[Self],
        dy_branch: Option<&[Self]>,
        resid: Option<&[Self]>,
        bn: &SavedBn<'_, f32>,
        yv: &mut [f32],
        out: &mut [Self],
        res: &mut [f32],
    ) -> bool {
        super::maps::drelu_tile(c, dxc, y, dy_branch, resid, bn, yv, out, res)
    }

    fn same_bits(a: &[Self], b: &[Self]) -> bool {
        // The bits as `u16` slices, compared as bytes.
        a.reinterpret_cast() == b.reinterpret_cast()
    }

    /// On the bits: the positive values are `0x0001..=0x7C00` (up to +inf; NaNs above).
    #[inline]
    fn is_positive(self) -> bool {
        self.to_bits().wrapping_sub(1) < 0x7C00
    }

    fn from_f64(value: f64) -> Self {
        f16::from_f64(value)
    }

    fn widen_slice(src: &[Self]) -> Vec<f32> {
        let mut out = vec![0.0; src.len()];
        convert::widen(src, &mut out);
        out
    }

    fn store_slice(src: &[f32]) -> Vec<Self> {
        let mut out = vec![f16::ZERO; src.len()];
        convert::narrow(src, &mut out);
        out
    }

    // The widest conversion instructions the CPU has, chosen at run time (exact widening;
    // round to nearest even, as `f16::from_f32`): `convert.rs`.
    #[inline]
    fn widen_into(src: &[Self], dst: &mut [f32]) {
        convert::widen(src, dst);
    }

    #[inline]
    fn store_into(src: &[f32], dst: &mut [Self]) {
        convert::narrow(src, dst);
    }
}

impl Element for f64 {
    type Acc = f64;

    #[inline]
    fn bits(self) -> u64 {
        self.to_bits()
    }

    #[inline]
    fn to_acc(self) -> f64 {
        self
    }

    #[inline]
    fn from_acc(value: f64) -> Self {
        value
    }

    fn from_f64(value: f64) -> Self {
        value
    }

    fn widen_slice(src: &[Self]) -> Vec<f64> {
        src.to_vec()
    }

    fn store_slice(src: &[f64]) -> Vec<Self> {
        src.to_vec()
    }

    #[inline]
    fn widen_into(src: &[Self], dst: &mut [f64]) {
        dst.copy_from_slice(src);
    }

    #[inline]
    fn store_into(src: &[f64], dst: &mut [Self]) {
        dst.copy_from_slice(src);
    }
}

impl Real for f32 {
    type Storage = f16;
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;

    #[inline]
    fn from_f64(value: f64) -> Self {
        value as f32
    }

    #[inline]
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
}

impl Real for f64 {
    type Storage = f64;
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;

    fn from_f64(value: f64) -> Self {
        value
    }

    fn to_f64(self) -> f64 {
        self
    }
}

pub(crate) use private::Mat;

pub(crate) mod private {
    use super::Result;

    /// A strided read-only matrix over a slice: element `(i, j)` is `data[i * row_stride + j * col_stride]`.
    #[derive(Debug, Clone, Copy)]
    pub struct Mat<'a, A> {
        pub data: &'a [A],
        pub row_stride: usize,
        pub col_stride: usize,
    }

    impl<'a, A> Mat<'a, A> {
        /// A row-major matrix with `cols` columns.
        pub fn row_major(data: &'a [A], cols: usize) -> Self {
            Mat {
                data,
                row_stride: cols,
                col_stride: 1,
            }
        }
    }

    /// Seals [`super::Element`]: only `f16` and `f64` are storage types.
    pub trait Sealed {}
    impl Sealed for half::f16 {}
    impl Sealed for f64 {}

    /// The GEMM of an arithmetic type; also seals [`super::Real`] (only `f32` and `f64`).
    ///
    /// `c (m x n, row-major) = a (m x k) * b (k x n) + beta * c`.
    pub trait Gemm: Sized {
        fn gemm(
            m: usize,
            k: usize,
            n: usize,
            a: Mat<'_, Self>,
            b: Mat<'_, Self>,
            beta: Self,
            c: &mut [Self],
        ) -> Result<()>;

        /// Whether [`Gemm::direct`] can ever take a tile (`f32` only).
        const DIRECT: bool = false;

        /// A conv tile straight from its padded source, with the bits of gathering it and
        /// calling [`Gemm::gemm`] (`direct.rs`); false where it does not run (then the caller
        /// gathers and multiplies).
        fn direct(
            _src: &[Self],
            _p: &[usize],
            _q: &[usize],
            _m: &[Self],
            _cout: usize,
            _out: &mut [Self],
            _add: bool,
        ) -> bool {
            false
        }

        /// `dst [cols, rows] = srcᵀ` for a row-major `src [rows, cols]`
        /// (`transpose.rs`).
        fn transpose(src: &[Self], rows: usize, cols: usize, dst: &mut [Self]);

        /// The slice as `f32` values where this type is `f32` (the vector paths of
        /// `sums.rs` take those), else `None`.
        fn as_f32(_v: &[Self]) -> Option<&[f32]> {
            None
        }
    }
}

/// Implements the GEMM for `f64` through ndarray's safe front end to matrixmultiply
/// (matrixmultiply's own `sgemm`/`dgemm` are `unsafe fn`, which this crate does not call).
macro_rules! impl_gemm {
    ($t:ty) => {
        impl private::Gemm for $t {
            fn gemm(
                m: usize,
                k: usize,
                n: usize,
                a: Mat<'_, Self>,
                b: Mat<'_, Self>,
                beta: Self,
                c: &mut [Self],
            ) -> Result<()> {
                let bad = |_| ReferenceError::Internal {
                    what: "GEMM operand does not match its shape",
                };
                let a =
                    ArrayView2::from_shape((m, k).strides((a.row_stride, a.col_stride)), a.data)
                        .map_err(bad)?;
                let b =
                    ArrayView2::from_shape((k, n).strides((b.row_stride, b.col_stride)), b.data)
                        .map_err(bad)?;
                let mut c = ArrayViewMut2::from_shape((m, n), c).map_err(bad)?;
                ndarray::linalg::general_mat_mul(1.0, &a, &b, beta, &mut c);
                Ok(())
            }

            fn transpose(src: &[Self], rows: usize, cols: usize, dst: &mut [Self]) {
                super::transpose::blocked(src, rows, cols, dst);
            }
        }
    };
}
impl_gemm!(f64);

impl private::Gemm for f32 {
    /// Through the `gemm` crate (faer's kernels), which multiplies the conv's skinny shapes
    /// (8-32 output channels, 72-288 deep) about twice as fast as matrixmultiply; each
    /// operand's extent is checked against its slice first.
    fn gemm(
        m: usize,
        k: usize,
        n: usize,
        a: Mat<'_, Self>,
        b: Mat<'_, Self>,
        beta: Self,
        c: &mut [Self],
    ) -> Result<()> {
        let bad = ReferenceError::Internal {
            what: "GEMM operand does not match its shape",
        };
        // The largest index a strided matrix reads, if it fits in isize strides.
        let fits = |mat: &Mat<'_, f32>, rows: usize, cols: usize| {
            let last = (rows - 1)
                .checked_mul(mat.row_stride)
                .zip((cols - 1).checked_mul(mat.col_stride))
                .and_then(|(r, c)| r.checked_add(c));
            last.is_some_and(|last| last < mat.data.len())
                && isize::try_from(mat.row_stride).is_ok()
                && isize::try_from(mat.col_stride).is_ok()
        };
        if c.len() != m.checked_mul(n).ok_or(bad.clone())? {
            return Err(bad);
        }
        if m == 0 || n == 0 {
            return Ok(());
        }
        if k == 0 {
            for v in c.iter_mut() {
                *v = if beta == 0.0 { 0.0 } else { beta * *v };
            }
            return Ok(());
        }
        if !fits(&a, m, k) || !fits(&b, k, n) || isize::try_from(n).is_err() {
            return Err(bad);
        }
        // `gemm` computes dst = alpha·dst + beta·lhs·rhs (dst read only if asked), with
        // element (i, j) of an operand at i·rs + j·cs.
        #[allow(unsafe_code)]
        // SAFETY: every index the call reads or writes lies in its slice: `a` (m x k) and
        // `b` (k x n) were checked above to keep their largest strided index below their
        // length, and `c` is exactly m x n row-major (row stride n, column stride 1); `c` is
        // borrowed mutably, so it aliases neither operand; the strides fit in isize.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                c.as_mut_ptr(),
                1,
                n as isize,
                beta != 0.0,
                a.data.as_ptr(),
                a.col_stride as isize,
                a.row_stride as isize,
                b.data.as_ptr(),
                b.col_stride as isize,
                b.row_stride as isize,
                beta,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
        Ok(())
    }

    const DIRECT: bool = true;

    fn direct(
        src: &[Self],
        p: &[usize],
        q: &[usize],
        m: &[Self],
        cout: usize,
        out: &mut [Self],
        add: bool,
    ) -> bool {
        super::direct::product(src, p, q, m, cout, out, add)
    }

    fn transpose(src: &[Self], rows: usize, cols: usize, dst: &mut [Self]) {
        super::transpose::f32s(src, rows, cols, dst);
    }

    fn as_f32(v: &[Self]) -> Option<&[f32]> {
        Some(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_store_rounds_to_nearest_even() {
        // 1 + 2^-11 lies exactly between 1 and the next FP16 value 1 + 2^-10: ties go to even (1).
        let tie = 1.0f32 + 2f32.powi(-11);
        assert_eq!(f16::from_acc(tie), f16::ONE);
        // Slightly above the tie rounds up.
        let above = 1.0f32 + 2f32.powi(-11) + 2f32.powi(-20);
        assert_eq!(f16::from_acc(above).to_f32(), 1.0 + 2f32.powi(-10));
        // The slice store agrees with the scalar store.
        assert_eq!(
            f16::store_slice(&[tie, above]),
            vec![f16::from_acc(tie), f16::from_acc(above)]
        );
    }

    #[test]
    fn is_positive_on_the_bits_matches_the_comparison_for_every_f16() {
        for h in 0..=u16::MAX {
            let v = f16::from_bits(h);
            assert_eq!(v.is_positive(), v.to_f32() > 0.0, "{h:#06x}");
        }
    }

    #[test]
    fn gemm_handles_strided_operands() {
        // a = [[1, 2], [3, 4]] stored column-major, b = identity; c = a.
        let a = [1.0f64, 3.0, 2.0, 4.0];
        let b = [1.0f64, 0.0, 0.0, 1.0];
        let mut c = [0.0f64; 4];
        let a = Mat {
            data: &a,
            row_stride: 1,
            col_stride: 2,
        };
        <f64 as private::Gemm>::gemm(2, 2, 2, a, Mat::row_major(&b, 2), 0.0, &mut c).unwrap();
        assert_eq!(c, [1.0, 2.0, 3.0, 4.0]);
    }

    #[test]
    fn f32_gemm_matches_the_naive_product_and_checks_its_operands() {
        // Small integers: every product and sum is exact in f32, whatever the order.
        let (m, k, n) = (37, 19, 23);
        let a: Vec<f32> = (0..m * k).map(|i| ((i * 7) % 11) as f32 - 5.0).collect();
        let b: Vec<f32> = (0..k * n).map(|i| ((i * 5) % 13) as f32 - 6.0).collect();
        // a as stored column-major (row stride 1, column stride m); b row-major.
        let a_t: Vec<f32> = (0..m * k).map(|i| a[(i % m) * k + i / m]).collect();
        let a_cm = Mat {
            data: &a_t,
            row_stride: 1,
            col_stride: m,
        };
        for beta in [0.0f32, 1.0, 2.0] {
            let mut c: Vec<f32> = (0..m * n)
                .map(|i| if beta == 0.0 { f32::NAN } else { i as f32 })
                .collect();
            let want: Vec<f32> = (0..m * n)
                .map(|idx| {
                    let (i, j) = (idx / n, idx % n);
                    let dot: f32 = (0..k).map(|l| a[i * k + l] * b[l * n + j]).sum();
                    dot + if beta == 0.0 { 0.0 } else { beta * idx as f32 }
                })
                .collect();
            <f32 as private::Gemm>::gemm(m, k, n, a_cm, Mat::row_major(&b, n), beta, &mut c)
                .unwrap();
            assert_eq!(c, want, "beta {beta}");
        }
        // An operand shorter than its shape, or a wrong output length, is refused.
        let mut c = vec![0.0f32; m * n];
        let short = Mat::row_major(&a[..m * k - 1], k);
        assert!(
            <f32 as private::Gemm>::gemm(m, k, n, short, Mat::row_major(&b, n), 0.0, &mut c)
                .is_err()
        );
        assert!(<f32 as private::Gemm>::gemm(
            m,
            k,
            n,
            Mat::row_major(&a, k),
            Mat::row_major(&b, n),
            0.0,
            &mut c[1..]
        )
        .is_err());
    }
}
