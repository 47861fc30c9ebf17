//! Loss seed.

use super::*;

/// One FP16 ulp at the magnitude of `x` (subnormal spacing below 2^-14).
pub(super) fn f16_ulp(x: f64) -> f64 {
    let a = x.abs().max(2f64.powi(-14));
    2f64.powi(a.log2().floor() as i32 - 10)
}

proptest! {
    #![proptest_config(small_config())]

    #[test]
    fn softmax_xent_backward_matches_the_naive_definition(
        batch in 1usize..6,
        classes in 1usize..40,
        seed in any::<u64>(),
        scale_pow in 0i32..16,
    ) {
        // Logits in a modest range, FP16 like the FC output; some labels out of range.
        let mut state = seed | 1;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let logits: Vec<f16> = (0..batch * classes)
            .map(|_| f16::from_f32(((next() % 2001) as f32 - 1000.0) / 100.0))
            .collect();
        let labels: Vec<i32> = (0..batch)
            .map(|_| match next() % 8 {
                0 => -100,
                1 => classes as i32,
                _ => (next() % classes as u64) as i32,
            })
            .collect();
        let s = Scalars { loss_scale: 2f32.powi(scale_pow), ..Scalars::default() };
        let mut d = vec![f16::ONE; batch * classes];
        let mut loss = vec![f32::NAN; batch];
        softmax_xent_backward(&logits, &labels, classes, &s, &mut d, Some(&mut loss)).unwrap();

        let coef = f64::from(s.loss_scale) / batch as f64;
        for r in 0..batch {
            let x: Vec<f64> = logits[r * classes..(r + 1) * classes]
                .iter()
                .map(|h| f64::from(h.to_f32()))
                .collect();
            let row = &d[r * classes..(r + 1) * classes];
            let label = labels[r];
            if label < 0 || label as usize >= classes {
                prop_assert!(row.iter().all(|h| h.to_bits() == 0), "ignored row is zero");
                prop_assert_eq!(loss[r], 0.0);
                continue;
            }
            let m = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = x.iter().map(|v| (v - m).exp()).sum();
            for j in 0..classes {
                let y = if j == label as usize { 1.0 } else { 0.0 };
                let naive = coef * ((x[j] - m).exp() / sum - y);
                let got = f64::from(row[j].to_f32());
                // One FP16 ulp of rounding, plus f32's absolute error in `p - y`: next to
                // y = 1 the difference cancels, so its error is ulps of 1, not of the result.
                let tol = f16_ulp(naive) + coef * 4.0 * f64::from(f32::EPSILON);
                prop_assert!((got - naive).abs() <= tol,
                    "row {} class {}: {} vs {}", r, j, got, naive);
            }
            let naive_loss = sum.ln() - (x[label as usize] - m);
            prop_assert!((f64::from(loss[r]) - naive_loss).abs() <= 1e-5 * (1.0 + naive_loss.abs()));
        }
    }
}

#[test]
pub(super) fn softmax_seed_is_scaled_and_checks_its_arguments() {
    // Two classes, equal logits: p = 0.5 each; scale 8192, batch 2: coef 4096.
    let logits = vec![f16::ZERO; 4];
    let s = Scalars::default();
    let mut d = vec![f16::ZERO; 4];
    softmax_xent_backward(&logits, &[0, 1], 2, &s, &mut d, None).unwrap();
    let got: Vec<f32> = d.iter().map(|h| h.to_f32()).collect();
    assert_eq!(got, [-2048.0, 2048.0, 2048.0, -2048.0]);

    assert!(matches!(
        softmax_xent_backward(&logits, &[0, 1], 0, &s, &mut d, None),
        Err(RangeOpError::InvalidConfig {
            field: "classes",
            ..
        })
    ));
    assert!(matches!(
        softmax_xent_backward(&logits[..3], &[0, 1], 2, &s, &mut d, None),
        Err(RangeOpError::LengthMismatch { what: "logits", .. })
    ));
    assert!(matches!(
        softmax_xent_backward(&logits, &[0, 1], 2, &s, &mut d, Some(&mut [0.0])),
        Err(RangeOpError::LengthMismatch { what: "loss", .. })
    ));
}
