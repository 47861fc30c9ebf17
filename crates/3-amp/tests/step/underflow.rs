//! Underflow.

use super::*;

/// One step of plain SGD (lr 1, W = 0) on a single conv parameter whose true gradient is
/// `grads`, with the wgrad stored FP16 at loss scale `scale`: returns -ΔW, the gradient the
/// optimizer actually applied.
pub(super) fn applied_gradient(grads: &[f32], scale: f32) -> Vec<f32> {
    let mut b = MemoryPlanBuilder::new().with_momentum_buffer(false);
    let only = b.bucket("only").unwrap();
    b.add("conv.w", ParamKind::ConvWeight, &[grads.len(), 1, 1], only)
        .unwrap();
    let config =
        StepConfig::new(SgdConfig::new(1.0)).with_loss_scale(LossScalePolicy::fixed(scale));
    let mut step = AmpStep::new(CpuRegions::new(b.finalize().unwrap()).unwrap(), config).unwrap();
    step.begin().unwrap();
    // What a wgrad computed in FP32 and stored FP16 holds: the scaled gradient, rounded.
    for (g, &true_g) in step
        .executor_mut()
        .param_f16_mut("conv.w", Region::G16)
        .unwrap()
        .iter_mut()
        .zip(grads)
    {
        *g = f32_to_f16(scale * true_g);
    }
    step.finish().unwrap();
    assert_eq!(step.executor().scalars().skipped, 0);
    step.executor()
        .param_f32("conv.w", Region::W)
        .unwrap()
        .iter()
        .map(|w| -w)
        .collect()
}

#[test]
pub(super) fn a_tiny_gradient_survives_fp16_storage_only_with_the_loss_scale() {
    // FP16's smallest normal is 2^-14 ≈ 6.1e-5 and its smallest subnormal 2^-24 ≈ 6.0e-8:
    // 1e-7 is only ~1.7 subnormal steps, 1e-8 is below half of one.
    let grads = [1e-7f32, 1.3e-7, 1e-8, -3e-8];
    let scaled = applied_gradient(&grads, 8192.0);
    let unscaled = applied_gradient(&grads, 1.0);

    // With the scale, every gradient lands in FP16's normal range (8192 * 1e-8 ≈ 8.2e-5)
    // and comes back within FP16's rounding error, 2^-11 relative.
    for (&g, &got) in grads.iter().zip(&scaled) {
        assert!(
            ((got - g) / g).abs() <= 1.0 / 2048.0,
            "scaled: {g:e} came back as {got:e}"
        );
    }
    // Without it, 1e-7 is a subnormal with one significant bit left: it comes back 19% off,
    // and 1.3e-7 becomes the very same value — the difference between them is lost.
    assert_eq!(unscaled[0], f32::powi(2.0, -23), "1e-7 -> 2 * 2^-24");
    assert!(((unscaled[0] - grads[0]) / grads[0]).abs() > 0.15);
    assert_eq!(
        unscaled[0], unscaled[1],
        "1e-7 and 1.3e-7 collapse to one FP16 value"
    );
    assert_ne!(scaled[0], scaled[1]);
    // And 1e-8 is gone entirely: the weight does not move at all.
    assert_eq!(unscaled[2], 0.0);
    assert!(scaled[2] > 0.0);
    assert_eq!(unscaled[3], -f32::powi(2.0, -25) * 2.0, "-3e-8 -> -2^-24");
}
