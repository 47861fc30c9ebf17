//! Test helpers: a tiny deterministic RNG, data makers, the conv shapes under test, and
//! tolerance checks.

use half::f16;

use crate::reference::{ConvParams, Element};

/// Unit roundoff of FP16 (half an ulp at 1): one FP16 rounding has relative error ≤ 2^-11.
pub const U16: f64 = 1.0 / 2048.0;
/// Unit roundoff of FP32: 2^-24.
pub const U32: f64 = 1.0 / 16_777_216.0;
/// Largest absolute error of one FP16 rounding in the subnormal range (half of 2^-24).
pub const SUBNORMAL16: f64 = 1.0 / 33_554_432.0;

/// SplitMix64 (Steele, Lea, Flood 2014): small, fast, deterministic.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[lo, hi)`.
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        let unit = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        lo + (hi - lo) * unit
    }

    /// `len` values uniform in `[lo, hi)`, rounded to FP16 so that both precision modes see
    /// exactly the same numbers.
    pub fn halfs(&mut self, len: usize, lo: f64, hi: f64) -> Vec<f16> {
        (0..len)
            .map(|_| f16::from_f64(self.uniform(lo, hi)))
            .collect()
    }

    /// `len` values uniform in `[lo, hi)`, rounded to FP32 (the per-channel vectors).
    pub fn floats(&mut self, len: usize, lo: f64, hi: f64) -> Vec<f32> {
        (0..len).map(|_| self.uniform(lo, hi) as f32).collect()
    }
}

/// Widens any element slice to `f64`.
pub fn wide<T: Element>(v: &[T]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
}

/// Widens FP32 vectors to `f64`.
pub fn wide32(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| f64::from(x)).collect()
}

/// Asserts `|got[i] − want[i]| ≤ bound[i]` for every `i`, reporting the worst violation.
#[track_caller]
pub fn assert_within(what: &str, got: &[f64], want: &[f64], bound: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    assert_eq!(bound.len(), want.len(), "{what}: bound length");
    let mut worst: Option<(usize, f64)> = None;
    for i in 0..want.len() {
        let err = (got[i] - want[i]).abs();
        if err > bound[i] || err.is_nan() {
            let ratio = err / bound[i];
            if worst.is_none_or(|(_, r)| ratio > r || ratio.is_nan()) {
                worst = Some((i, ratio));
            }
        }
    }
    if let Some((i, ratio)) = worst {
        panic!(
            "{what}: element {i}: got {}, want {}, |err| {} > bound {} ({ratio:.2}x)",
            got[i],
            want[i],
            (got[i] - want[i]).abs(),
            bound[i]
        );
    }
}

/// Asserts each element within `rel·|want| + abs`.
#[track_caller]
pub fn assert_close(what: &str, got: &[f64], want: &[f64], rel: f64, abs: f64) {
    let bound: Vec<f64> = want.iter().map(|w| rel * w.abs() + abs).collect();
    assert_within(what, got, want, &bound);
}

/// `‖got − want‖₂ / ‖want‖₂`.
pub fn rel_l2(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let num: f64 = got.iter().zip(want).map(|(g, w)| (g - w) * (g - w)).sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    (num / den).sqrt()
}

/// The conv shapes every conv test runs: 3x3 pad 1, 1x1, stride 2, non-square input and
/// filter, dilation, C ≠ K, and one large enough for several GEMM tiles and wgrad groups.
pub fn conv_cases() -> Vec<(&'static str, ConvParams)> {
    vec![
        (
            "3x3 pad 1, C<K",
            ConvParams::new(2, 3, 5, 5, 4, 3, 3).with_padding(1, 1),
        ),
        ("1x1, non-square, C>K", ConvParams::new(2, 5, 4, 3, 2, 1, 1)),
        (
            "3x3 stride 2 pad 1, non-square",
            ConvParams::new(2, 4, 7, 6, 3, 3, 3)
                .with_padding(1, 1)
                .with_stride(2, 2),
        ),
        (
            "3x2 filter, pad (1,0), stride (1,2)",
            ConvParams::new(1, 2, 6, 5, 3, 3, 2)
                .with_padding(1, 0)
                .with_stride(1, 2),
        ),
        (
            "3x3 dilation 2 pad 2",
            ConvParams::new(1, 3, 6, 6, 2, 3, 3)
                .with_padding(2, 2)
                .with_dilation(2, 2),
        ),
        (
            "1x1 stride 2 (downsample)",
            ConvParams::new(2, 4, 6, 6, 6, 1, 1).with_stride(2, 2),
        ),
        (
            "multi-tile 3x3 pad 1",
            ConvParams::new(2, 3, 24, 24, 4, 3, 3).with_padding(1, 1),
        ),
    ]
}

/// Whether `T` is the FP16 storage type (else the f64 mode).
pub fn is_half<T: Element>() -> bool {
    std::any::TypeId::of::<T>() == std::any::TypeId::of::<f16>()
}

/// FP16 test data in the storage type of the mode under test (exact in both).
pub fn to_t<T: Element>(v: &[f16]) -> Vec<T> {
    v.iter().map(|x| T::from_f64(x.to_f64())).collect()
}

/// FP32 test vectors in the arithmetic type of the mode under test (exact in both).
pub fn to_acc<T: Element>(v: &[f32]) -> Vec<T::Acc> {
    v.iter()
        .map(|&x| <T::Acc as crate::reference::Real>::from_f64(f64::from(x)))
        .collect()
}

/// Error bound for a stored result that is a sum of `n_terms` terms with exact value `want`
/// and `Σ|term| = mag`, where the terms themselves are exact (FP16·FP16 products are exact in
/// FP32).
///
/// FP16 mode: recursive summation in FP32 errs by at most `γ_n·mag ≈ n·2^-24·mag` whatever the
/// order (Higham, Accuracy and Stability, §4.2), and the final FP16 store adds
/// `2^-11·|value| + 2^-25`. f64 mode: the same with `2^-53` and no store.
pub fn sum_bound(fp16: bool, want: f64, mag: f64, n_terms: f64) -> f64 {
    if fp16 {
        U16 * want.abs() + (1.0 + U16) * 1.01 * n_terms * U32 * mag + SUBNORMAL16
    } else {
        1.01 * n_terms * f64::EPSILON * 0.5 * mag + 1e-300
    }
}
