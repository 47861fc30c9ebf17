//! Overflow injection.

use super::*;

#[test]
pub(super) fn fixed_policy_skips_exactly_the_poisoned_steps_and_halves_to_one() {
    // 22 overflows: enough to halve 8192 down to the floor (13 halvings) and stay there.
    let mut steps: Vec<usize> = vec![2, 3, 7];
    steps.extend(10..=25);
    steps.extend([31, 40, 49]);
    let poisoned = poison_schedule(&steps);
    let config = StepConfig::new(
        SgdConfig::new(0.01)
            .with_momentum(0.9)
            .with_weight_decay(1e-4),
    )
    .with_ema(0.99);
    let run = run_50(config, &poisoned);

    assert_eq!(run.skipped, steps.iter().copied().collect::<BTreeSet<_>>());
    // The expected trace: 8192 until the first overflow, then halved after each, never
    // below 1, never grown.
    let mut expected = Vec::new();
    let mut scale = 8192.0f32;
    for t in 0..50 {
        expected.push(scale);
        if steps.contains(&t) {
            scale = (scale / 2.0).max(1.0);
        }
    }
    assert_eq!(run.trace, expected);
    assert_eq!(run.trace[0], DEFAULT_INIT_SCALE);
    let distinct: Vec<f32> = run.trace.iter().fold(Vec::new(), |mut v, &s| {
        if v.last() != Some(&s) {
            v.push(s);
        }
        v
    });
    let halvings: Vec<f32> = (0..=13).map(|k| 8192.0 / f32::powi(2.0, k)).collect();
    assert_eq!(distinct, halvings, "8192, 4096, …, 2, 1 and nothing else");
    assert_eq!(run.last.loss_scale, 1.0);
    assert_eq!((run.last.step, run.last.skipped), (50 - 22, 22));
}

#[test]
pub(super) fn growth_policy_follows_the_growth_rule() {
    let policy = LossScalePolicy {
        init_scale: 4096.0,
        growth: Some(ScaleGrowth {
            interval: 4,
            factor: 2.0,
            // Gradients are at most 1 in magnitude, so a scale of 2^15 never overflows FP16
            // by itself: only the planted values do.
            max_scale: 32768.0,
        }),
    };
    // Two early overflows (4096 -> 1024), then 26 good steps: five doublings reach the cap
    // and the sixth is capped; then overflows in and after a short run of good steps.
    let steps = [2usize, 3, 30, 34, 44, 45, 46, 47];
    let poisoned = poison_schedule(&steps);
    let config = StepConfig::new(SgdConfig::new(0.01).with_momentum(0.9))
        .with_loss_scale(policy)
        .with_overflow(OverflowPolicy::NanOrInf);
    let run = run_50(config, &poisoned);

    assert_eq!(run.skipped, steps.iter().copied().collect::<BTreeSet<_>>());
    // The rule: an overflow halves (floor 1) and restarts the count; every 4th good step in
    // a row doubles, capped at 2^15.
    let mut expected = Vec::new();
    let (mut scale, mut good_in_a_row) = (4096.0f32, 0u32);
    for t in 0..50 {
        expected.push(scale);
        if steps.contains(&t) {
            scale = (scale / 2.0).max(1.0);
            good_in_a_row = 0;
        } else {
            good_in_a_row += 1;
            if good_in_a_row == 4 {
                scale = (scale * 2.0).min(32768.0);
                good_in_a_row = 0;
            }
        }
    }
    assert_eq!(run.trace, expected);
    assert!(
        run.trace.contains(&32768.0),
        "the run reaches the cap: {:?}",
        run.trace
    );
    assert_eq!(
        (run.last.step, run.last.skipped),
        (50 - steps.len() as u32, steps.len() as u32)
    );
}

#[test]
pub(super) fn clip_policy_clamps_inf_instead_of_skipping_but_nan_still_skips() {
    let plan = small_plan(false);
    let config = StepConfig::new(SgdConfig::new(1.0))
        .with_loss_scale(LossScalePolicy::fixed(4.0))
        .with_overflow(OverflowPolicy::clip_inf());
    let mut step = AmpStep::new(CpuRegions::new(plan).unwrap(), config).unwrap();
    step.init_weights().unwrap();

    // +Inf in a conv wgrad: clamped to 65504 (scaled units), the step is applied.
    step.begin().unwrap();
    step.executor_mut()
        .param_f16_mut("conv1.w", Region::G16)
        .unwrap()[0] = f16::INFINITY;
    step.finish().unwrap();
    let s = step.executor().scalars();
    assert_eq!((s.step, s.skipped, s.loss_scale), (1, 0, 4.0));
    let w = step.executor().param_f32("conv1.w", Region::W).unwrap()[0];
    assert_eq!(w, -(65504.0 / 4.0), "w = 0 - lr * bound / scale");

    // NaN still skips.
    step.begin().unwrap();
    step.executor_mut()
        .param_f32_mut("fc.b", Region::G)
        .unwrap()[1] = f32::NAN;
    step.finish().unwrap();
    let s = step.executor().scalars();
    assert_eq!((s.step, s.skipped, s.loss_scale), (1, 1, 2.0));
}
