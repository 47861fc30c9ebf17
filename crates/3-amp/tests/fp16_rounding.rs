//! Tier 1: the FP32↔FP16 conversions of the range ops against a naive definition.
//!
//! The oracle knows nothing about bit tricks: it lists every finite FP16 value as an `f64`,
//! finds the two neighbours of `|x|` and takes the nearer one, ties to the even bit pattern;
//! from 65520 up (the tie between 65504 and 2^16) the result is Inf.

use cudnn_cbr_amp::range::{
    cast_f16_to_f32, cast_f32_to_f16, f16_to_f32, f32_to_f16, F16_CANONICAL_NAN, F32_CANONICAL_NAN,
};
use cudnn_cbr_amp::RangeOpError;
use half::f16;

/// Value of a non-NaN FP16 bit pattern, from the format's definition.
fn decode(bits: u16) -> f64 {
    let sign = if bits & 0x8000 != 0 { -1.0 } else { 1.0 };
    let exp = i32::from((bits >> 10) & 0x1f);
    let man = f64::from(bits & 0x3ff);
    match exp {
        0 => sign * man * 2f64.powi(-24),
        31 => sign * f64::INFINITY,
        e => sign * (1.0 + man / 1024.0) * 2f64.powi(e - 15),
    }
}

struct Oracle {
    /// Every finite non-negative FP16 value, ascending (index = bit pattern).
    positives: Vec<f64>,
}

impl Oracle {
    fn new() -> Self {
        Oracle {
            positives: (0u16..=0x7bff).map(decode).collect(),
        }
    }

    /// Round-to-nearest-even FP16 bits of a non-NaN `x`.
    fn round(&self, x: f32) -> u16 {
        let sign: u16 = if x.is_sign_negative() { 0x8000 } else { 0 };
        let a = f64::from(x).abs();
        if a >= 65520.0 {
            return sign | 0x7c00;
        }
        // Largest pattern whose value is <= a.
        let lo = self.positives.partition_point(|&v| v <= a) - 1;
        let bits = if lo == self.positives.len() - 1 {
            lo // a in [65504, 65520): rounds down to the maximum
        } else {
            let (below, above) = (a - self.positives[lo], self.positives[lo + 1] - a);
            if below < above || (below == above && lo % 2 == 0) {
                lo
            } else {
                lo + 1
            }
        };
        sign | bits as u16
    }
}

fn to16(x: f32) -> u16 {
    f32_to_f16(x).to_bits()
}

#[test]
fn every_fp16_value_round_trips_exactly() {
    for bits in 0u16..=0xffff {
        let h = f16::from_bits(bits);
        if h.is_nan() {
            continue;
        }
        let x = f16_to_f32(h);
        assert_eq!(f64::from(x), decode(bits), "widening {bits:#06x}");
        assert_eq!(to16(x), bits, "narrowing {bits:#06x}");
    }
}

#[test]
fn midpoints_and_their_neighbours_round_like_the_oracle() {
    let oracle = Oracle::new();
    for bits in 0u16..0x7bff {
        let (a, b) = (decode(bits), decode(bits + 1));
        // Midpoints of adjacent FP16 values need 12 significant bits: exact in f32.
        let mid = ((a + b) / 2.0) as f32;
        assert_eq!(f64::from(mid), (a + b) / 2.0);
        for x in [mid, mid.next_down(), mid.next_up()] {
            for s in [x, -x] {
                assert_eq!(
                    to16(s),
                    oracle.round(s),
                    "x = {s:e} ({:#010x})",
                    s.to_bits()
                );
            }
        }
    }
}

#[test]
fn random_f32_bit_patterns_round_like_the_oracle() {
    let oracle = Oracle::new();
    // xorshift64*: deterministic, cheap, covers every exponent.
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..200_000 {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        let bits = (state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 32) as u32;
        let x = f32::from_bits(bits);
        if x.is_nan() {
            assert_eq!(to16(x), F16_CANONICAL_NAN);
        } else {
            assert_eq!(to16(x), oracle.round(x), "x = {x:e} ({bits:#010x})");
        }
    }
}

#[test]
fn subnormal_edges() {
    let tiny = 2f32.powi(-24); // smallest FP16 subnormal
    assert_eq!(to16(tiny), 0x0001);
    assert_eq!(to16(tiny / 2.0), 0x0000, "2^-25 ties to even: zero");
    assert_eq!(
        to16(-tiny / 2.0),
        0x8000,
        "negative underflow keeps its sign"
    );
    assert_eq!(
        to16((tiny / 2.0).next_up()),
        0x0001,
        "just above the tie rounds up"
    );
    assert_eq!(to16(tiny * 1.5), 0x0002, "1.5 ulp ties to even: 2");
    assert_eq!(to16(tiny * 2.5), 0x0002, "2.5 ulp ties to even: 2");
    assert_eq!(to16(tiny * 1023.0), 0x03ff, "largest subnormal");
    assert_eq!(to16(2f32.powi(-14)), 0x0400, "smallest normal");
    assert_eq!(to16(tiny * 1023.5), 0x0400, "ties up into the normals");
    assert_eq!(to16(f32::from_bits(1)), 0x0000, "FP32 subnormal underflows");
    assert_eq!(to16(-f32::from_bits(0x007f_ffff)), 0x8000);
    assert_eq!(
        f16_to_f32(f16::from_bits(0x0001)),
        tiny,
        "no flush to zero when widening"
    );
    assert_eq!(to16(0.0), 0x0000);
    assert_eq!(to16(-0.0), 0x8000);
}

#[test]
fn largest_finite_and_overflow_to_inf() {
    assert_eq!(to16(65504.0), 0x7bff);
    assert_eq!(to16(65519.996), 0x7bff, "below the tie stays finite");
    assert_eq!(to16(65520.0), 0x7c00, "the tie rounds to even, i.e. Inf");
    assert_eq!(to16(-65520.0), 0xfc00);
    assert_eq!(to16(65536.0), 0x7c00);
    assert_eq!(to16(f32::MAX), 0x7c00);
    assert_eq!(to16(f32::INFINITY), 0x7c00);
    assert_eq!(to16(f32::NEG_INFINITY), 0xfc00);
    assert_eq!(to16(65505.0), 0x7bff);
    assert_eq!(to16(2048.0 + 1.0), 0x6800, "2049 ties to even 2048");
    assert_eq!(to16(2048.0 + 3.0), 0x6802, "2051 ties to even 2052");
    assert_eq!(f16_to_f32(f16::from_bits(0x7c00)), f32::INFINITY);
    assert_eq!(f16_to_f32(f16::from_bits(0xfc00)), f32::NEG_INFINITY);
}

#[test]
fn nan_payloads_become_canonical_in_both_directions() {
    let f32_nans = [
        0x7fc0_0000u32, // default quiet NaN
        0xffc0_0000,    // negative quiet NaN
        0x7f80_0001,    // signalling, smallest payload
        0x7fbf_ffff,    // signalling, largest payload
        0x7fff_ffff,
        0xffff_ffff,
        0x7fc0_2000, // payload bit that survives truncation to FP16
    ];
    for bits in f32_nans {
        assert_eq!(
            to16(f32::from_bits(bits)),
            F16_CANONICAL_NAN,
            "{bits:#010x}"
        );
    }
    let mut count = 0;
    for bits in 0u16..=0xffff {
        if f16::from_bits(bits).is_nan() {
            count += 1;
            let x = f16_to_f32(f16::from_bits(bits));
            assert_eq!(x.to_bits(), F32_CANONICAL_NAN, "{bits:#06x}");
            assert_eq!(to16(x), F16_CANONICAL_NAN);
        }
    }
    assert_eq!(count, 2 * 1023, "every FP16 NaN pattern was seen");
}

#[test]
fn slice_casts_apply_the_scalar_rule_and_check_lengths() {
    let src: Vec<f32> = (0..1000).map(|i| (i as f32 - 500.0) * 131.37).collect();
    let mut h = vec![f16::ZERO; src.len()];
    cast_f32_to_f16(&src, &mut h).unwrap();
    assert!(h.iter().zip(&src).all(|(h, &x)| *h == f32_to_f16(x)));
    let mut back = vec![0f32; src.len()];
    cast_f16_to_f32(&h, &mut back).unwrap();
    assert!(back.iter().zip(&h).all(|(&y, h)| y == f16_to_f32(*h)));

    let err = cast_f32_to_f16(&src, &mut h[..999]).unwrap_err();
    assert!(matches!(
        err,
        RangeOpError::LengthMismatch {
            expected: 1000,
            got: 999,
            ..
        }
    ));
    assert!(cast_f16_to_f32(&h[..3], &mut back).is_err());
}
