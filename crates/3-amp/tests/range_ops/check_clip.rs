//! Check / clip.

use super::*;

#[test]
pub(super) fn check_nonfinite_sets_but_never_clears_the_flag() {
    let mut s = Scalars::default();
    assert!(!check_nonfinite(&[0.0, -1.0, 65504.0, f32::MAX], &mut s).overflow);
    assert_eq!(s.overflow, 0);
    for bad in [
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        f32::from_bits(0xff80_0001),
    ] {
        let mut s = Scalars::default();
        assert!(check_nonfinite(&[1.0, bad, 2.0], &mut s).overflow);
        assert_eq!(s.overflow, 1);
        // A later clean bucket does not clear it.
        assert!(!check_nonfinite(&[1.0], &mut s).overflow);
        assert_eq!(s.overflow, 1);
    }
}

#[test]
pub(super) fn clip_policy_clamps_inf_and_large_values_and_flags_only_nan() {
    let bound = 100.0;
    let mut g = vec![
        1.0,
        100.0,
        100.000_01,
        -250.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        -0.0,
        3e38,
    ];
    let mut s = Scalars::default();
    let out = check_and_clip(&mut g, bound, &mut s).unwrap();
    assert_eq!(g, [1.0, 100.0, 100.0, -100.0, 100.0, -100.0, -0.0, 100.0]);
    assert!(g[6].is_sign_negative());
    assert_eq!(out.clipped, 5);
    assert!(!out.overflow);
    assert_eq!(s.overflow, 0, "Inf alone does not flag under ClipInf");

    let mut g = vec![f32::NAN, f32::INFINITY];
    let out = check_and_clip(&mut g, bound, &mut s).unwrap();
    assert!(out.overflow && g[0].is_nan() && g[1] == bound);
    assert_eq!(s.overflow, 1);

    for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        assert!(matches!(
            check_and_clip(&mut [1.0], bad, &mut s),
            Err(RangeOpError::InvalidConfig { field: "bound", .. })
        ));
    }
    assert_eq!(OverflowPolicy::default(), OverflowPolicy::NanOrInf);
    assert_eq!(
        OverflowPolicy::clip_inf(),
        OverflowPolicy::ClipInf { bound: 65504.0 }
    );
}

proptest! {
    #![proptest_config(small_config())]

    #[test]
    fn check_grads_matches_its_naive_definition(
        mut g in prop::collection::vec(
            prop_oneof![
                4 => -1e5f32..1e5,
                1 => Just(f32::INFINITY),
                1 => Just(f32::NEG_INFINITY),
                1 => Just(f32::NAN),
            ],
            0..200,
        ),
        bound in 1.0f32..5e4,
        clip in any::<bool>(),
    ) {
        let before = g.clone();
        let policy = if clip { OverflowPolicy::ClipInf { bound } } else { OverflowPolicy::NanOrInf };
        let mut s = Scalars::default();
        let out = check_grads(&mut g, policy, &mut s).unwrap();
        let naive_flag = if clip {
            before.iter().any(|x| x.is_nan())
        } else {
            before.iter().any(|x| !x.is_finite())
        };
        prop_assert_eq!(out.overflow, naive_flag);
        prop_assert_eq!(s.overflow, u32::from(naive_flag));
        for (x, y) in before.iter().zip(&g) {
            let expect = if !clip || x.is_nan() || x.abs() <= bound {
                *x
            } else if *x > 0.0 {
                bound
            } else {
                -bound
            };
            prop_assert_eq!(y.to_bits(), expect.to_bits());
        }
    }
}
