//! Clipping by global norm.

use super::*;

/// One step (lr `lr`, no momentum, no decay, loss scale 1024) from random weights and
/// gradients, with clipping at `max_norm` when given: returns (W before, the unscaled FP32
/// gradients the step read, W after, S after).
pub(super) fn clipped_step(
    max_norm: Option<f32>,
    poison: Option<Poison>,
) -> (Vec<f32>, Vec<f32>, Vec<f32>, Scalars) {
    let lr = 0.5;
    let mut config = StepConfig::new(SgdConfig::new(lr).with_momentum(0.0))
        .with_loss_scale(LossScalePolicy::fixed(1024.0));
    if let Some(m) = max_norm {
        config = config.with_clip_norm(m);
    }
    let mut regions = CpuRegions::new(small_plan(false)).unwrap();
    let mut rng = Rng(0xC11F);
    random_weights(&mut regions, &mut rng);
    let mut step = AmpStep::new(regions, config).unwrap();
    step.init_weights().unwrap();
    step.begin().unwrap();
    write_grads(step.executor_mut(), &mut rng, 1024.0, poison);
    let w0 = step.executor().f32_region(Region::W).unwrap().to_vec();
    // What the step reads: G16 cast into G by the step itself; run the casts here on a copy.
    let mut probe = step.executor().clone();
    probe
        .run_all(
            &step
                .finish_ops()
                .iter()
                .copied()
                .filter(|op| matches!(op, RangeOp::CastF16ToF32 { .. }))
                .collect::<Vec<_>>(),
        )
        .unwrap();
    let g = probe.f32_region(Region::G).unwrap().to_vec();
    step.finish().unwrap();
    let w1 = step.executor().f32_region(Region::W).unwrap().to_vec();
    (w0, g, w1, step.executor().scalars())
}

#[test]
pub(super) fn clipping_by_norm_scales_the_update_by_the_norm_formula() {
    // The unclipped step's gradient norm, at f64 from the gradients the step read.
    let (w0, g, w1_free, s_free) = clipped_step(None, None);
    let norm: f64 = g
        .iter()
        .map(|&x| (f64::from(x) / 1024.0).powi(2))
        .sum::<f64>()
        .sqrt();
    assert_eq!(
        s_free.grad_norm, 0.0,
        "no clipping: the norm op does not run"
    );
    assert!(norm > 1.0, "the test needs a norm above the bounds: {norm}");
    for max_norm in [0.25f32, 0.5 * norm as f32, 2.0 * norm as f32] {
        let (w0c, _, w1, s) = clipped_step(Some(max_norm), None);
        assert_eq!(w0c, w0, "same start");
        // The device's norm (FP32 sums in a fixed order of ~2,000 squares) against f64:
        // relative error under 1e-6 (a few FP32 roundings of a sum of positive terms).
        let rel = (f64::from(s.grad_norm) - norm).abs() / norm;
        assert!(rel < 1e-6, "grad_norm {} vs {norm}: {rel:e}", s.grad_norm);
        // PyTorch's clip_grad_norm_: g *= min(1, max_norm / (norm + 1e-6)).
        let factor = (f64::from(max_norm) / (norm + 1e-6)).min(1.0);
        let mut worst = 0f64;
        for ((&a, &b), &gi) in w0.iter().zip(&w1).zip(&g) {
            let update = 0.5 * f64::from(gi) / 1024.0 * factor;
            let want = f64::from(a) - update;
            // FP32 rounds the unscale factor, the clipping factor, the products and the
            // difference once each: a few ulps of the larger term (not of the result, which
            // may cancel).
            let terms = f64::from(a).abs() + update.abs();
            worst = worst.max((f64::from(b) - want).abs() / terms);
        }
        assert!(
            worst < 4.0 * f64::from(f32::EPSILON),
            "{max_norm}: {worst:e}"
        );
        if factor == 1.0 {
            assert_eq!(w1, w1_free, "a bound above the norm changes nothing");
        } else {
            assert_ne!(w1, w1_free, "a bound below the norm changes the update");
        }
        assert_eq!((s.step, s.skipped), (1, 0));
    }
    // The same step twice gives the same bits (a fixed summation order).
    assert_eq!(
        clipped_step(Some(0.25), None).2,
        clipped_step(Some(0.25), None).2
    );
}

#[test]
pub(super) fn clipping_by_norm_still_skips_exactly_the_poisoned_steps() {
    let config = StepConfig::new(SgdConfig::new(0.05).with_momentum(0.9))
        .with_ema(0.99)
        .with_clip_norm(1.0);
    let poisoned = poison_schedule(&[3, 17, 18, 40]);
    let run = run_50(config, &poisoned);
    let want: BTreeSet<usize> = poisoned.iter().map(|&(s, _)| s).collect();
    assert_eq!(run.skipped, want);
    assert_eq!(run.last.clip_norm, 1.0);
    assert!(run.last.grad_norm.is_finite() && run.last.grad_norm > 0.0);
}

#[test]
pub(super) fn a_clipping_bound_that_is_not_positive_and_finite_is_refused() {
    for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        let config = StepConfig::new(SgdConfig::new(0.1)).with_clip_norm(bad);
        let e = AmpStep::new(CpuRegions::new(small_plan(false)).unwrap(), config).unwrap_err();
        assert!(
            matches!(
                e,
                AmpError::RangeOp(RangeOpError::InvalidConfig {
                    field: "clip_norm",
                    ..
                })
            ),
            "{bad}: {e:?}"
        );
    }
}
