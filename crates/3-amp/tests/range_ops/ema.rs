//! EMA.

use super::*;

proptest! {
    #![proptest_config(small_config())]

    #[test]
    fn ema_matches_its_naive_definition(
        e0 in finite_vec(48),
        w in finite_vec(48),
        decay in prop_oneof![Just(0.0f32), Just(0.999f32), Just(1.0f32), 0.0f32..1.0],
    ) {
        let mut e = e0.clone();
        let mut e16 = vec![f16::ZERO; e.len()];
        let s = Scalars::default();
        prop_assert_eq!(ema_update(&mut e, &mut e16, &w, &s, decay).unwrap(), StepOutcome::Applied);
        let d = f64::from(decay);
        for i in 0..e.len() {
            let naive = d * f64::from(e0[i]) + (1.0 - d) * f64::from(w[i]);
            let mag = f64::from(e0[i]).abs() + f64::from(w[i]).abs();
            prop_assert!((f64::from(e[i]) - naive).abs() <= 1e-6 * mag + 1e-30,
                "e[{}] = {} vs {}", i, e[i], naive);
            prop_assert_eq!(e16[i].to_bits(), f32_to_f16(e[i]).to_bits());
        }
        if decay == 1.0 {
            prop_assert_eq!(&e, &e0);
        }
        if decay == 0.0 {
            prop_assert_eq!(&e, &w);
        }
    }
}

#[test]
pub(super) fn ema_skips_on_the_flag_and_rejects_bad_decay() {
    let s = Scalars {
        overflow: 1,
        ..Scalars::default()
    };
    let mut e = vec![1.0f32, 2.0];
    let mut e16 = vec![f16::from_f32(1.0), f16::from_f32(2.0)];
    let before = (e.clone(), e16.clone());
    let out = ema_update(&mut e, &mut e16, &[5.0, 6.0], &s, 0.9).unwrap();
    assert_eq!(out, StepOutcome::Skipped);
    assert_eq!((e.clone(), e16.clone()), before);
    let s = Scalars::default();
    for bad in [-0.1, 1.1, f32::NAN] {
        assert!(matches!(
            ema_update(&mut e, &mut e16, &[5.0, 6.0], &s, bad),
            Err(RangeOpError::InvalidConfig { field: "decay", .. })
        ));
    }
    assert!(ema_update(&mut e, &mut e16[..1], &[5.0, 6.0], &s, 0.5).is_err());
}
