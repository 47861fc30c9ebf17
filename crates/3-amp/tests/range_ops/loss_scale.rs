//! Loss scale.

use super::*;

/// The policy as a plain state machine, written independently of the twin.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct NaiveScaler {
    scale: f32,
    good_run: u64,
    step: u64,
    skipped: u64,
}

impl NaiveScaler {
    fn update(&mut self, overflow: bool, growth: Option<(u64, f32, f32)>) {
        if overflow {
            self.scale = (self.scale / 2.0).max(1.0);
            self.good_run = 0;
            self.skipped += 1;
            return;
        }
        self.step += 1;
        self.good_run += 1;
        if let Some((interval, factor, max)) = growth {
            if self.good_run == interval {
                self.scale = (self.scale * factor).min(max);
                self.good_run = 0;
            }
        }
    }
}

#[test]
pub(super) fn fixed_policy_starts_at_8192_halves_to_one_and_never_grows() {
    let policy = LossScalePolicy::default();
    let mut s = Scalars::new(&policy);
    assert_eq!(s.loss_scale, 8192.0);
    for _ in 0..1000 {
        assert_eq!(
            update_loss_scale(&mut s, &policy).unwrap(),
            ScaleUpdate::Kept
        );
    }
    assert_eq!(s.loss_scale, 8192.0, "never grows");
    assert_eq!(s.step, 1000);
    let mut expected = 8192.0;
    for i in 0..20 {
        s.overflow = 1;
        assert_eq!(
            update_loss_scale(&mut s, &policy).unwrap(),
            ScaleUpdate::BackedOff
        );
        expected = f32::max(expected / 2.0, 1.0);
        assert_eq!(s.loss_scale, expected, "after {} overflows", i + 1);
        assert_eq!(s.overflow, 0, "the update clears the flag");
    }
    assert_eq!(s.loss_scale, 1.0);
    assert_eq!((s.step, s.skipped), (1000, 20));
}

#[test]
pub(super) fn growth_policy_grows_after_interval_and_caps() {
    let mut policy = LossScalePolicy::fixed(1024.0).with_growth(3, 2.0);
    policy.growth.as_mut().unwrap().max_scale = 4096.0;
    let mut s = Scalars::new(&policy);
    let mut seen = Vec::new();
    for _ in 0..9 {
        update_loss_scale(&mut s, &policy).unwrap();
        seen.push(s.loss_scale);
    }
    assert_eq!(
        seen,
        [1024.0, 1024.0, 2048.0, 2048.0, 2048.0, 4096.0, 4096.0, 4096.0, 4096.0]
    );
    // Overflow resets the run.
    update_loss_scale(&mut s, &policy).unwrap();
    update_loss_scale(&mut s, &policy).unwrap();
    s.overflow = 1;
    update_loss_scale(&mut s, &policy).unwrap();
    assert_eq!((s.loss_scale, s.growth_tracker), (2048.0, 0));
}

#[test]
pub(super) fn bad_loss_scale_policies_are_rejected() {
    let mut s = Scalars::default();
    let bad = [
        (LossScalePolicy::fixed(0.5), "init_scale"),
        (LossScalePolicy::fixed(f32::NAN), "init_scale"),
        (LossScalePolicy::fixed(f32::INFINITY), "init_scale"),
        (
            LossScalePolicy::default().with_growth(0, 2.0),
            "growth.interval",
        ),
        (
            LossScalePolicy::default().with_growth(10, 1.0),
            "growth.factor",
        ),
        (
            LossScalePolicy::default().with_growth(10, f32::NAN),
            "growth.factor",
        ),
        (
            LossScalePolicy::fixed(1e8).with_growth(10, 2.0),
            "growth.max_scale",
        ),
    ];
    for (policy, field) in bad {
        let err = update_loss_scale(&mut s, &policy).unwrap_err();
        assert!(
            matches!(err, RangeOpError::InvalidConfig { field: f, .. } if f == field),
            "{policy:?}: {err:?}"
        );
    }
}

proptest! {
    #![proptest_config(small_config())]

    #[test]
    fn loss_scale_update_matches_the_naive_state_machine(
        flags in prop::collection::vec(any::<bool>(), 1..300),
        grow in any::<bool>(),
        interval in 1u32..20,
        factor in prop_oneof![Just(2.0f32), Just(4.0f32), Just(1.5f32)],
        init_pow in 0i32..20,
    ) {
        let init = 2f32.powi(init_pow);
        let policy = if grow {
            LossScalePolicy::fixed(init).with_growth(interval, factor)
        } else {
            LossScalePolicy::fixed(init)
        };
        let growth = policy
            .growth
            .map(|g| (u64::from(g.interval), g.factor, g.max_scale));
        let mut s = Scalars::new(&policy);
        let mut naive = NaiveScaler { scale: init, good_run: 0, step: 0, skipped: 0 };
        for &flag in &flags {
            s.overflow = u32::from(flag);
            update_loss_scale(&mut s, &policy).unwrap();
            naive.update(flag, growth);
            prop_assert_eq!(s.loss_scale, naive.scale);
            prop_assert_eq!(u64::from(s.growth_tracker), naive.good_run);
            prop_assert_eq!((u64::from(s.step), u64::from(s.skipped)), (naive.step, naive.skipped));
            prop_assert_eq!(s.overflow, 0);
            prop_assert!(s.loss_scale >= 1.0);
        }
    }
}
