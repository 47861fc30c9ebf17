//! Tier 1: the sync-free step on the CPU executor.
//!
//! - Overflow injection: 50 steps with NaN/Inf planted at chosen steps skip exactly those
//!   steps, leave W, M, A, E and E16 bit-identical across each skipped step, and move the
//!   loss scale exactly as the fixed policy (8192, 4096, … floored at 1) or the growth rule
//!   says (the expected traces come from a few lines of arithmetic here, not from the crate).
//! - Underflow: why the loss scale exists — small gradients stored in FP16 survive with it
//!   and are lost (rounded away or to nothing) without it.
//! - The schedule: which ranges `finish` covers, in which order; capture/replay equals eager;
//!   stale and foreign graphs are refused; bad configurations are typed errors.

use std::collections::BTreeSet;

use cudnn_cbr_amp::plan::{ByteRange, MemoryPlan, MemoryPlanBuilder, ParamKind, Region};
use cudnn_cbr_amp::range::{
    f32_to_f16, LossScalePolicy, OverflowPolicy, Scalars, ScaleGrowth, SgdConfig,
    DEFAULT_INIT_SCALE,
};
use cudnn_cbr_amp::step::{AmpExecutor, AmpStep, CpuRegions, RangeOp, StepConfig};
use cudnn_cbr_amp::{AmpError, ExecError, PlanError, RangeOpError};
use half::f16;

mod common;
use common::Rng;

// ---------------------------------------------------------------- helpers

/// Two buckets, conv/BN/FC parameters, momentum and EMA regions.
fn small_plan(ema: bool) -> MemoryPlan {
    let mut b = MemoryPlanBuilder::new().with_ema(ema);
    let first = b.bucket("first").unwrap();
    let deep = b.bucket("deep").unwrap();
    b.add("conv1.w", ParamKind::ConvWeight, &[8, 3, 3, 3], first)
        .unwrap();
    b.add("bn1.gamma", ParamKind::BnGamma, &[8], first).unwrap();
    b.add("bn1.beta", ParamKind::BnBeta, &[8], first).unwrap();
    b.add("conv2.w", ParamKind::ConvWeight, &[16, 3, 3, 8], deep)
        .unwrap();
    b.add("bn2.gamma", ParamKind::BnGamma, &[16], deep).unwrap();
    b.add("fc.w", ParamKind::FcWeight, &[10, 16], deep).unwrap();
    b.add("fc.b", ParamKind::FcBias, &[10], deep).unwrap();
    b.finalize().unwrap()
}

/// Random master weights in every parameter's data (padding stays zero).
fn random_weights(regions: &mut CpuRegions, rng: &mut Rng) {
    let names: Vec<String> = regions
        .plan()
        .params()
        .iter()
        .map(|p| p.name().to_owned())
        .collect();
    for name in names {
        for w in regions.param_f32_mut(&name, Region::W).unwrap() {
            *w = 0.5 * rng.unit();
        }
    }
}

/// Where a poisoned step plants its bad value.
#[derive(Debug, Clone, Copy)]
enum Poison {
    /// +Inf in a conv wgrad (FP16, G16): the typical FP16 overflow.
    F16Inf,
    /// -Inf in an FC gradient written FP32 straight into G.
    F32NegInf,
    /// NaN in a BN gradient (FP32, G).
    F32Nan,
}

/// What backward would write at loss scale `scale`: conv wgrads FP16 into G16, the other
/// gradients FP32 into G, all multiplied by the scale; plus the poison, if any.
fn write_grads(regions: &mut CpuRegions, rng: &mut Rng, scale: f32, poison: Option<Poison>) {
    let params: Vec<(String, ParamKind)> = regions
        .plan()
        .params()
        .iter()
        .map(|p| (p.name().to_owned(), p.kind()))
        .collect();
    for (name, kind) in &params {
        if *kind == ParamKind::ConvWeight {
            for g in regions.param_f16_mut(name, Region::G16).unwrap() {
                *g = f32_to_f16(scale * rng.unit());
            }
        } else {
            for g in regions.param_f32_mut(name, Region::G).unwrap() {
                *g = scale * rng.unit();
            }
        }
    }
    match poison {
        None => {}
        Some(Poison::F16Inf) => {
            regions.param_f16_mut("conv2.w", Region::G16).unwrap()[17] = f16::INFINITY
        }
        Some(Poison::F32NegInf) => {
            regions.param_f32_mut("fc.w", Region::G).unwrap()[3] = f32::NEG_INFINITY
        }
        Some(Poison::F32Nan) => {
            regions.param_f32_mut("bn1.gamma", Region::G).unwrap()[0] = f32::NAN
        }
    }
}

/// The bytes of the regions a skipped step must not touch.
fn optimizer_state(regions: &CpuRegions) -> Vec<(Region, Vec<u8>)> {
    [Region::W, Region::M, Region::A, Region::E, Region::E16]
        .into_iter()
        .filter(|&r| regions.plan().has_region(r))
        .map(|r| (r, regions.region_bytes(r).unwrap()))
        .collect()
}

fn all_bytes(regions: &CpuRegions) -> Vec<(Region, Vec<u8>)> {
    Region::ALL
        .into_iter()
        .filter(|&r| regions.plan().has_region(r))
        .map(|r| (r, regions.region_bytes(r).unwrap()))
        .collect()
}

/// What the run observed.
struct Run {
    /// Loss scale in effect at each step (read before it).
    trace: Vec<f32>,
    /// Steps whose `skipped` counter went up.
    skipped: BTreeSet<usize>,
    /// The scalars after the last step.
    last: Scalars,
}

/// 50 steps with the given poisoned steps; asserts the bit-identity of skipped steps and
/// that applied steps do move the weights.
fn run_50(config: StepConfig, poisoned: &[(usize, Poison)]) -> Run {
    let mut regions = CpuRegions::new(small_plan(config.ema_decay.is_some())).unwrap();
    let mut rng = Rng(0x5EED);
    random_weights(&mut regions, &mut rng);
    let mut step = AmpStep::new(regions, config).unwrap();
    step.init_weights().unwrap();
    let mut trace = Vec::new();
    let mut skipped = BTreeSet::new();
    step.request_scalars().unwrap();
    let mut before = step.poll_scalars().unwrap().expect("CPU snapshots at once");
    for t in 0..50 {
        let poison = poisoned.iter().find(|(s, _)| *s == t).map(|&(_, p)| p);
        trace.push(before.loss_scale);
        let state = optimizer_state(step.executor());
        step.begin().unwrap();
        write_grads(step.executor_mut(), &mut rng, before.loss_scale, poison);
        step.finish().unwrap();
        step.request_scalars().unwrap();
        let after = step.poll_scalars().unwrap().unwrap();
        assert_eq!(after.overflow, 0, "the update clears the flag (step {t})");
        if after.skipped == before.skipped + 1 {
            skipped.insert(t);
            assert_eq!(
                after.step, before.step,
                "a skipped step is not counted (step {t})"
            );
            for ((region, was), (_, now)) in state.iter().zip(optimizer_state(step.executor())) {
                assert!(
                    *was == now,
                    "step {t} was skipped but changed region {region}"
                );
            }
        } else {
            assert_eq!(after.skipped, before.skipped, "step {t}");
            assert_eq!(after.step, before.step + 1, "step {t}");
            let now = optimizer_state(step.executor());
            assert_ne!(state[0].1, now[0].1, "applied step {t} left W unchanged");
        }
        // The compute copy always equals the master weights rounded.
        let ex = step.executor();
        let w = ex.f32_region(Region::W).unwrap();
        let a = ex.f16_region(Region::A).unwrap();
        assert!(
            w.iter()
                .zip(a)
                .all(|(w, a)| f32_to_f16(*w).to_bits() == a.to_bits()),
            "A != f16(W) after step {t}"
        );
        before = after;
    }
    Run {
        trace,
        skipped,
        last: before,
    }
}

fn poison_schedule(steps: &[usize]) -> Vec<(usize, Poison)> {
    let kinds = [Poison::F16Inf, Poison::F32NegInf, Poison::F32Nan];
    steps
        .iter()
        .enumerate()
        .map(|(i, &s)| (s, kinds[i % kinds.len()]))
        .collect()
}

// ---------------------------------------------------------------- overflow injection

#[test]
fn fixed_policy_skips_exactly_the_poisoned_steps_and_halves_to_one() {
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
fn growth_policy_follows_the_growth_rule() {
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
fn clip_policy_clamps_inf_instead_of_skipping_but_nan_still_skips() {
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

// ---------------------------------------------------------------- underflow

/// One step of plain SGD (lr 1, W = 0) on a single conv parameter whose true gradient is
/// `grads`, with the wgrad stored FP16 at loss scale `scale`: returns -ΔW, the gradient the
/// optimizer actually applied.
fn applied_gradient(grads: &[f32], scale: f32) -> Vec<f32> {
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
fn a_tiny_gradient_survives_fp16_storage_only_with_the_loss_scale() {
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

// ---------------------------------------------------------------- the schedule

#[test]
fn finish_casts_only_g16_cast_ranges_splits_weight_decay_and_updates_the_scale_last() {
    let plan = small_plan(true);
    let config = StepConfig::new(
        SgdConfig::new(0.1)
            .with_momentum(0.9)
            .with_weight_decay(5e-4),
    )
    .with_ema(0.999);
    let step = AmpStep::new(CpuRegions::new(plan.clone()).unwrap(), config).unwrap();
    let ops = step.finish_ops();
    let whole = ByteRange::new(0, plan.region_len(Region::A));

    let casts: Vec<ByteRange> = ops
        .iter()
        .filter_map(|op| match *op {
            RangeOp::CastF16ToF32 {
                src: Region::G16,
                dst: Region::G,
                span16,
            } => Some(span16),
            _ => None,
        })
        .collect();
    assert_eq!(casts, plan.g16_cast_ranges());
    assert!(plan.g16_hole_bytes() > 0, "the plan has holes to avoid");

    // Order: casts, one check over all of G, SGD launches, EMA, the scale update last.
    let names: Vec<&str> = ops.iter().map(RangeOp::name).collect();
    let first_sgd = names.iter().position(|n| *n == "amp_sgd_step").unwrap();
    assert_eq!(names[casts.len()], "amp_check_nonfinite");
    assert_eq!(ops[casts.len()].span16(), Some(whole));
    assert_eq!(first_sgd, casts.len() + 1);
    assert_eq!(names[names.len() - 2], "amp_ema_update");
    assert_eq!(names[names.len() - 1], "amp_loss_scale_update");

    // SGD covers everything once; weight decay exactly on each bucket's decay range.
    let sgd: Vec<(ByteRange, bool)> = ops
        .iter()
        .filter_map(|op| match *op {
            RangeOp::Sgd { decay, span16, .. } => Some((span16, decay)),
            _ => None,
        })
        .collect();
    let mut at = 0;
    for (span, _) in &sgd {
        assert_eq!(span.start, at, "SGD launches tile W");
        at = span.end;
    }
    assert_eq!(at, whole.end);
    let decayed: Vec<ByteRange> = sgd
        .iter()
        .filter(|(_, decay)| *decay)
        .map(|(s, _)| *s)
        .collect();
    let expect: Vec<ByteRange> = plan
        .buckets()
        .iter()
        .map(|b| plan.decay_range(b.bucket(), Region::A).unwrap())
        .collect();
    assert_eq!(decayed, expect);
    // (The value of the weight decay is read from S when the op runs.)

    // Begin zeroes all of G and G16.
    assert_eq!(
        step.begin_ops(),
        &[
            RangeOp::Zero {
                region: Region::G,
                span16: whole
            },
            RangeOp::Zero {
                region: Region::G16,
                span16: ByteRange::new(0, plan.region_len(Region::G16))
            },
        ]
    );
}

#[test]
fn bn_and_fc_gradients_survive_the_g16_cast_and_padding_stays_zero() {
    let plan = small_plan(true);
    let config = StepConfig::new(SgdConfig::new(0.0)).with_ema(0.5);
    let mut step = AmpStep::new(CpuRegions::new(plan.clone()).unwrap(), config).unwrap();
    let mut rng = Rng(7);
    random_weights(step.executor_mut(), &mut rng);
    step.init_weights().unwrap();
    for _ in 0..3 {
        step.begin().unwrap();
        write_grads(step.executor_mut(), &mut rng, 8192.0, None);
        let bn = step
            .executor()
            .param_f32("bn1.gamma", Region::G)
            .unwrap()
            .to_vec();
        step.finish().unwrap();
        assert_eq!(
            step.executor().param_f32("bn1.gamma", Region::G).unwrap(),
            &bn[..],
            "the G16 cast overwrote a BN gradient in a G16 hole"
        );
    }
    for region in [Region::W, Region::G, Region::M, Region::E] {
        let data = step.executor().f32_region(region).unwrap();
        for v in plan.views(region) {
            let pad = &data[v.elem_offset() + v.elems..(v.offset_bytes + v.slot_bytes) / 4];
            assert!(
                pad.iter().all(|x| x.to_bits() == 0),
                "{region} padding of {}",
                v.name
            );
        }
    }
    // EMA with lr 0: E moves from W towards W, i.e. stays W; E16 = f16(E).
    let ex = step.executor();
    assert_eq!(
        ex.f32_region(Region::E).unwrap(),
        ex.f32_region(Region::W).unwrap()
    );
    let e16: Vec<u16> = ex
        .f16_region(Region::E16)
        .unwrap()
        .iter()
        .map(|h| h.to_bits())
        .collect();
    let from_e: Vec<u16> = ex
        .f32_region(Region::E)
        .unwrap()
        .iter()
        .map(|&e| f32_to_f16(e).to_bits())
        .collect();
    assert_eq!(e16, from_e);
}

#[test]
fn replay_of_captured_graphs_equals_eager_bit_for_bit() {
    let config = StepConfig::new(
        SgdConfig::new(0.05)
            .with_momentum(0.9)
            .with_nesterov(true)
            .with_weight_decay(1e-3),
    )
    .with_ema(0.9);
    let mut base = CpuRegions::new(small_plan(true)).unwrap();
    random_weights(&mut base, &mut Rng(11));
    let mut eager = AmpStep::new(base.clone(), config).unwrap();
    let mut graphed = AmpStep::new(base, config).unwrap();
    eager.init_weights().unwrap();
    graphed.init_weights().unwrap();
    let begin = graphed.capture_begin().unwrap();
    let finish = graphed.capture_finish().unwrap();
    let (mut r1, mut r2) = (Rng(99), Rng(99));
    for t in 0..8 {
        let poison = (t == 3).then_some(Poison::F16Inf);
        let scale = eager.executor().scalars().loss_scale;
        eager.begin().unwrap();
        write_grads(eager.executor_mut(), &mut r1, scale, poison);
        eager.finish().unwrap();
        graphed.replay(&begin).unwrap();
        write_grads(graphed.executor_mut(), &mut r2, scale, poison);
        graphed.replay(&finish).unwrap();
        assert_eq!(
            all_bytes(eager.executor()),
            all_bytes(graphed.executor()),
            "step {t}"
        );
    }
    assert_eq!(graphed.executor().scalars().skipped, 1);
}

#[test]
fn a_learning_rate_schedule_under_graph_replay_equals_eager() {
    // Momentum, weight decay and EMA on, one overflow: every hyper-parameter path is live.
    let config = StepConfig::new(
        SgdConfig::new(0.1)
            .with_momentum(0.9)
            .with_weight_decay(1e-3),
    )
    .with_ema(0.9);
    let mut base = CpuRegions::new(small_plan(true)).unwrap();
    random_weights(&mut base, &mut Rng(5));
    let mut eager = AmpStep::new(base.clone(), config).unwrap();
    let mut graphed = AmpStep::new(base.clone(), config).unwrap();
    let mut constant = AmpStep::new(base, config).unwrap();
    for s in [&mut eager, &mut graphed, &mut constant] {
        s.init_weights().unwrap();
    }
    let begin = graphed.capture_begin().unwrap();
    let finish = graphed.capture_finish().unwrap();
    let (mut r1, mut r2, mut r3) = (Rng(42), Rng(42), Rng(42));
    for t in 0..12 {
        // Cosine-like decay, then momentum and weight decay change too at step 6.
        let lr = 0.1 * (1.0 + (t as f32 * 0.3).cos()) / 2.0 + 1e-3;
        let (mu, wd) = if t < 6 { (0.9, 1e-3) } else { (0.5, 0.0) };
        let poison = (t == 4).then_some(Poison::F16Inf);
        let scale = eager.executor().scalars().loss_scale;
        eager.set_hyper(lr, mu, wd).unwrap();
        eager.begin().unwrap();
        write_grads(eager.executor_mut(), &mut r1, scale, poison);
        eager.finish().unwrap();
        graphed.set_hyper(lr, mu, wd).unwrap();
        graphed.replay(&begin).unwrap();
        write_grads(graphed.executor_mut(), &mut r2, scale, poison);
        graphed.replay(&finish).unwrap();
        assert_eq!(
            all_bytes(eager.executor()),
            all_bytes(graphed.executor()),
            "step {t}: the replayed step must follow the schedule exactly"
        );
        constant.begin().unwrap();
        write_grads(constant.executor_mut(), &mut r3, scale, poison);
        constant.finish().unwrap();
    }
    // The schedule really changed the update (the comparison above is not vacuous).
    assert_ne!(
        eager.executor().f32_region(Region::W).unwrap(),
        constant.executor().f32_region(Region::W).unwrap()
    );
    let s = graphed.executor().scalars();
    assert_eq!((s.skipped, s.momentum, s.weight_decay), (1, 0.5, 0.0));
}

#[test]
fn stale_and_foreign_graphs_are_refused() {
    let config = StepConfig::new(SgdConfig::new(0.1));
    let mut a = AmpStep::new(CpuRegions::new(small_plan(false)).unwrap(), config).unwrap();
    let mut b = AmpStep::new(CpuRegions::new(small_plan(false)).unwrap(), config).unwrap();
    let finish = a.capture_finish().unwrap();
    assert!(matches!(
        b.replay(&finish),
        Err(AmpError::Exec(ExecError::ForeignGraph { .. }))
    ));
    a.replay(&finish).unwrap();
    // The learning rate lives in S: the captured step stays valid.
    a.set_lr(0.05).unwrap();
    a.replay(&finish).unwrap();
    // A change of structure (the overflow policy) makes it stale.
    let clip = StepConfig {
        overflow: OverflowPolicy::clip_inf(),
        ..*a.config()
    };
    a.set_config(clip).unwrap();
    assert_eq!(
        a.replay(&finish).unwrap_err(),
        AmpError::Exec(ExecError::StaleGraph {
            captured: 0,
            current: 1
        })
    );
    // Begin does not depend on the configuration: still fine.
    let begin = a.capture_begin().unwrap();
    a.set_lr(0.01).unwrap();
    a.replay(&begin).unwrap();
    assert_eq!(
        a.executor_mut().capture(&[]).unwrap_err(),
        AmpError::Exec(ExecError::EmptyCapture)
    );
}

#[test]
fn configurations_the_plan_cannot_serve_are_typed_errors() {
    let no_m = {
        let mut b = MemoryPlanBuilder::new().with_momentum_buffer(false);
        let only = b.bucket("only").unwrap();
        b.add("fc.w", ParamKind::FcWeight, &[4, 4], only).unwrap();
        b.finalize().unwrap()
    };
    let err = AmpStep::new(
        CpuRegions::new(no_m.clone()).unwrap(),
        StepConfig::new(SgdConfig::new(0.1).with_momentum(0.9)),
    )
    .unwrap_err();
    assert!(matches!(
        err,
        AmpError::Exec(ExecError::MissingRegion {
            region: Region::M,
            ..
        })
    ));
    assert!(err.to_string().contains("momentum"), "{err}");
    let err = AmpStep::new(
        CpuRegions::new(no_m.clone()).unwrap(),
        StepConfig::new(SgdConfig::new(0.1)).with_ema(0.99),
    )
    .unwrap_err();
    assert!(matches!(
        err,
        AmpError::Exec(ExecError::MissingRegion {
            region: Region::E,
            ..
        })
    ));
    let err = AmpStep::new(
        CpuRegions::new(no_m.clone()).unwrap(),
        StepConfig::new(SgdConfig::new(f32::NAN)),
    )
    .unwrap_err();
    assert!(matches!(
        err,
        AmpError::RangeOp(RangeOpError::InvalidConfig { field: "lr", .. })
    ));
    let mut ok = AmpStep::new(
        CpuRegions::new(no_m).unwrap(),
        StepConfig::new(SgdConfig::new(0.1)),
    )
    .unwrap();
    let err = ok.set_lr(-1.0).unwrap_err();
    assert!(matches!(
        err,
        AmpError::RangeOp(RangeOpError::InvalidConfig { field: "lr", .. })
    ));
    assert_eq!(
        ok.config().sgd.lr,
        0.1,
        "a refused change leaves the step as it was"
    );
}

/// Whether an error is the expected one.
type ErrorCheck = fn(&AmpError) -> bool;

#[test]
fn range_ops_outside_the_plan_are_typed_errors_and_run_nothing() {
    let plan = small_plan(false);
    let len16 = plan.region_len(Region::A);
    let mut ex = CpuRegions::new(plan.clone()).unwrap();
    ex.f32_region_mut(Region::W).unwrap()[0] = 1.0;
    let good = RangeOp::CastF32ToF16 {
        src: Region::W,
        dst: Region::A,
        span16: ByteRange::new(0, len16),
    };
    let cases: Vec<(RangeOp, ErrorCheck)> = vec![
        (
            RangeOp::Zero {
                region: Region::G,
                span16: ByteRange::new(0, len16 + 2),
            },
            |e| matches!(e, AmpError::Exec(ExecError::OutOfBounds { .. })),
        ),
        (
            RangeOp::Zero {
                region: Region::G,
                span16: ByteRange::new(1, 3),
            },
            |e| matches!(e, AmpError::Exec(ExecError::Misaligned { .. })),
        ),
        (
            RangeOp::Zero {
                region: Region::S,
                span16: ByteRange::new(0, 2),
            },
            |e| matches!(e, AmpError::Exec(ExecError::WrongRegion { .. })),
        ),
        (
            RangeOp::CastF16ToF32 {
                src: Region::W,
                dst: Region::A,
                span16: ByteRange::new(0, 2),
            },
            |e| matches!(e, AmpError::Exec(ExecError::WrongRegion { .. })),
        ),
        (
            RangeOp::Ema {
                decay: 0.5,
                span16: ByteRange::new(0, 2),
            },
            |e| {
                matches!(
                    e,
                    AmpError::Exec(ExecError::MissingRegion {
                        region: Region::E,
                        ..
                    })
                )
            },
        ),
        (
            RangeOp::Check {
                policy: OverflowPolicy::ClipInf { bound: -1.0 },
                span16: ByteRange::new(0, 2),
            },
            |e| matches!(e, AmpError::RangeOp(RangeOpError::InvalidConfig { .. })),
        ),
        (
            // G16 is shorter than A: a whole-A span does not fit in it.
            RangeOp::CastF16ToF32 {
                src: Region::G16,
                dst: Region::G,
                span16: ByteRange::new(0, len16),
            },
            |e| matches!(e, AmpError::Exec(ExecError::OutOfBounds { .. })),
        ),
    ];
    for (op, is_expected) in cases {
        let err = ex.run_all(&[good, op]).unwrap_err();
        assert!(is_expected(&err), "{op:?}: {err:?}");
        assert_eq!(
            ex.f16_region(Region::A).unwrap()[0],
            f16::ZERO,
            "a bad list ran its good op"
        );
    }
    ex.run_all(&[good]).unwrap();
    assert_eq!(ex.f16_region(Region::A).unwrap()[0], f16::ONE);
    // Typed views refuse the wrong region type and unknown names.
    assert!(matches!(
        ex.f32_region(Region::A),
        Err(AmpError::Exec(ExecError::WrongRegion { .. }))
    ));
    assert!(matches!(
        ex.param_f16("fc.w", Region::G16),
        Err(AmpError::Plan(PlanError::NotInRegion { .. }))
    ));
    assert!(matches!(
        ex.param_f32("nope", Region::W),
        Err(AmpError::Plan(PlanError::UnknownParam { .. }))
    ));
    assert!(matches!(
        ex.f32_region(Region::E),
        Err(AmpError::Plan(PlanError::RegionAbsent {
            region: Region::E
        }))
    ));
}

#[test]
fn scalars_are_written_by_new_and_snapshotted_on_request() {
    let policy = LossScalePolicy::fixed(256.0);
    let config = StepConfig::new(SgdConfig::new(0.1)).with_loss_scale(policy);
    let mut step = AmpStep::new(CpuRegions::new(small_plan(false)).unwrap(), config).unwrap();
    assert_eq!(step.poll_scalars().unwrap(), None, "nothing requested yet");
    step.request_scalars().unwrap();
    step.begin().unwrap();
    step.executor_mut()
        .param_f32_mut("fc.w", Region::G)
        .unwrap()[0] = f32::INFINITY;
    step.finish().unwrap();
    // The snapshot is S when it was requested, not now.
    assert_eq!(
        step.poll_scalars().unwrap(),
        Some(Scalars::new(&policy).with_sgd(&config.sgd))
    );
    step.request_scalars().unwrap();
    let s = step.poll_scalars().unwrap().unwrap();
    assert_eq!((s.loss_scale, s.skipped, s.step), (128.0, 1, 0));
}

#[test]
fn the_cuda_executor_says_why_it_cannot_run_here() {
    // On a machine without a GPU (CI: a stand-in libcuda that reports no device) opening
    // must be a typed error, never a panic. On a GPU machine it opens.
    match cudnn_cbr_amp::cuda::CudaRegions::open(small_plan(false), 0) {
        Ok(regions) => assert_eq!(regions.plan().params().len(), 7),
        Err(e) => assert!(e.is_unavailable(), "unexpected error: {e}"),
    }
}

// ---------------------------------------------------------------- clipping by global norm

/// One step (lr `lr`, no momentum, no decay, loss scale 1024) from random weights and
/// gradients, with clipping at `max_norm` when given: returns (W before, the unscaled FP32
/// gradients the step read, W after, S after).
fn clipped_step(
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
fn clipping_by_norm_scales_the_update_by_the_norm_formula() {
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
fn clipping_by_norm_still_skips_exactly_the_poisoned_steps() {
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
fn a_clipping_bound_that_is_not_positive_and_finite_is_refused() {
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
