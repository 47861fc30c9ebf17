//! Gradient accumulation on the CPU executor: N micro-batches per optimizer step
//! (`StepConfig::with_accum`, the plan's GA region).
//!
//! - The accumulated step equals a one-batch step whose G is the micro-batches' FP32 sum (in
//!   the same order) and whose S counts N "ranks": the same unscale `1 / (scale · N)`, so the
//!   same bits.
//! - An overflow in any one micro-batch skips the whole step exactly once (W, M, A untouched),
//!   halves the fixed loss scale once, and leaves GA clear for the next step.
//! - Configurations the plan cannot serve are typed errors.

use cudnn_cbr_amp::plan::{MemoryPlan, MemoryPlanBuilder, ParamKind, Region};
use cudnn_cbr_amp::range::{f16_to_f32, f32_to_f16, Scalars, SgdConfig};
use cudnn_cbr_amp::step::{AmpExecutor, AmpStep, CpuRegions, RangeOp, StepConfig, MAX_ACCUM};
use cudnn_cbr_amp::{AmpError, ExecError, RangeOpError};

mod common;
use common::Rng;

/// Two buckets (so G16 has a hole: bn1's slots), conv/BN/FC parameters, momentum.
fn plan() -> MemoryPlan {
    let mut b = MemoryPlanBuilder::new();
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

fn config() -> StepConfig {
    StepConfig::new(
        SgdConfig::new(0.05)
            .with_momentum(0.9)
            .with_weight_decay(1e-3),
    )
}

/// A step over `plan` from the same weights (seeded `Rng(3)`).
fn step(plan: MemoryPlan, config: StepConfig) -> AmpStep<CpuRegions> {
    let mut regions = CpuRegions::new(plan).unwrap();
    let mut rng = Rng(3);
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
    let mut step = AmpStep::new(regions, config).unwrap();
    step.init_weights().unwrap();
    step
}

/// One micro-batch's gradients as backward writes them at `scale`: conv wgrads FP16 into
/// G16, the rest FP32 into G; `poison` puts +Inf into conv2's wgrad.
fn write_grads(regions: &mut CpuRegions, rng: &mut Rng, scale: f32, poison: bool) {
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
    if poison {
        regions.param_f16_mut("conv2.w", Region::G16).unwrap()[7] = half::f16::INFINITY;
    }
}

/// This micro-batch's FP32 gradient, as the step sees it: G16 cast where conv, else G.
fn micro_gradient(regions: &CpuRegions) -> Vec<f32> {
    let g = regions.f32_region(Region::G).unwrap();
    let g16 = regions.f16_region(Region::G16).unwrap();
    g.iter()
        .enumerate()
        .map(|(i, &x)| x + g16.get(i).map_or(0.0, |&h| f16_to_f32(h)))
        .collect()
}

#[test]
fn an_accumulated_step_equals_one_step_on_the_summed_gradient_bit_for_bit() {
    for n in [2u32, 3, 5] {
        let mut acc = step(
            plan().with_grad_accumulator().unwrap(),
            config().with_accum(n),
        );
        let mut one = step(plan(), config());
        // The reference averages over N through S's rank count: the same denominator
        // `scale · N`, rounded once.
        one.set_ranks(n).unwrap();
        let mut rng = Rng(u64::from(n));
        for t in 0..4 {
            let scale = acc.executor().scalars().loss_scale;
            let mut sum: Option<Vec<f32>> = None;
            for k in 0..n {
                acc.begin().unwrap();
                write_grads(acc.executor_mut(), &mut rng, scale, false);
                let g = micro_gradient(acc.executor());
                // The FP32 running sum in micro-batch order, as the kernel adds.
                sum = Some(match sum {
                    None => g,
                    Some(s) => s.iter().zip(&g).map(|(a, b)| a + b).collect(),
                });
                if k + 1 < n {
                    acc.accumulate().unwrap();
                    assert!(
                        acc.executor().f32_region(Region::GA).unwrap() == sum.as_deref().unwrap(),
                        "n={n} step {t}: GA after micro-batch {k}"
                    );
                } else {
                    acc.finish().unwrap();
                }
            }
            let sum = sum.unwrap();
            // GA is clear after the step; G held the sum the update used.
            assert!(acc
                .executor()
                .f32_region(Region::GA)
                .unwrap()
                .iter()
                .all(|&x| x.to_bits() == 0));
            assert!(acc.executor().f32_region(Region::G).unwrap() == &sum[..]);
            one.begin().unwrap();
            one.executor_mut()
                .f32_region_mut(Region::G)
                .unwrap()
                .copy_from_slice(&sum);
            // The sum is already in G: the finish ops without the G16 cast.
            let ops: Vec<RangeOp> = one
                .finish_ops()
                .iter()
                .filter(|op| !matches!(op, RangeOp::CastF16ToF32 { .. }))
                .copied()
                .collect();
            one.executor_mut().run_all(&ops).unwrap();
            for r in [Region::W, Region::M, Region::A] {
                assert!(
                    acc.executor().region_bytes(r).unwrap()
                        == one.executor().region_bytes(r).unwrap(),
                    "n={n} step {t}: region {r} differs"
                );
            }
            let (a, o) = (acc.executor().scalars(), one.executor().scalars());
            assert_eq!((a.step, a.skipped, a.loss_scale), (o.step, 0, o.loss_scale));
            assert_eq!(a.unscale(), o.unscale());
        }
    }
}

/// The documented trace: fixed policy, scale 8192. Steps of 3 micro-batches; step 1 has an
/// Inf in its second micro-batch, step 3 in its first and its third. Each such step is
/// skipped once (W, M and A bit-identical across it, `skipped` + 1, `step` unchanged) and
/// halves the scale once (8192 → 4096 → 2048), whatever the number of poisoned micro-batches;
/// the clean steps after it apply normally (the drain cleared GA, so nothing carries over).
#[test]
fn an_overflow_in_any_micro_batch_skips_the_step_once_and_halves_the_scale_once() {
    let n = 3;
    let mut acc = step(
        plan().with_grad_accumulator().unwrap(),
        config().with_accum(n),
    );
    let poisoned = |t: usize, k: u32| (t == 1 && k == 1) || (t == 3 && k != 1);
    let mut rng = Rng(77);
    let mut trace = Vec::new();
    for t in 0..6 {
        let before = acc.executor().scalars();
        let state: Vec<Vec<u8>> = [Region::W, Region::M, Region::A]
            .iter()
            .map(|&r| acc.executor().region_bytes(r).unwrap())
            .collect();
        for k in 0..n {
            acc.begin().unwrap();
            write_grads(
                acc.executor_mut(),
                &mut rng,
                before.loss_scale,
                poisoned(t, k),
            );
            if k + 1 < n {
                acc.accumulate().unwrap();
            } else {
                acc.finish().unwrap();
            }
        }
        let after = acc.executor().scalars();
        let now: Vec<Vec<u8>> = [Region::W, Region::M, Region::A]
            .iter()
            .map(|&r| acc.executor().region_bytes(r).unwrap())
            .collect();
        let skipped = after.skipped == before.skipped + 1;
        assert_eq!(skipped, state == now, "step {t}: skipped iff untouched");
        assert_eq!(after.overflow, 0, "the update clears the flag");
        assert!(acc
            .executor()
            .f32_region(Region::GA)
            .unwrap()
            .iter()
            .all(|&x| x == 0.0));
        trace.push((skipped, after.loss_scale, after.step));
    }
    assert_eq!(
        trace,
        [
            (false, 8192.0, 1),
            (true, 4096.0, 1),
            (false, 4096.0, 2),
            (true, 2048.0, 2),
            (false, 2048.0, 3),
            (false, 2048.0, 4),
        ]
    );
}

#[test]
fn accumulation_the_plan_cannot_serve_is_a_typed_error() {
    // No GA in the plan.
    let e = AmpStep::new(CpuRegions::new(plan()).unwrap(), config().with_accum(2)).unwrap_err();
    assert!(
        matches!(
            e,
            AmpError::Exec(ExecError::MissingRegion {
                region: Region::GA,
                ..
            })
        ),
        "{e}"
    );
    let with_ga = plan().with_grad_accumulator().unwrap();
    for bad in [0, MAX_ACCUM + 1, u32::MAX] {
        let e = AmpStep::new(
            CpuRegions::new(with_ga.clone()).unwrap(),
            config().with_accum(bad),
        )
        .unwrap_err();
        assert!(
            matches!(
                e,
                AmpError::RangeOp(RangeOpError::InvalidConfig { field: "accum", .. })
            ),
            "{bad}: {e}"
        );
    }
    // Without accumulation there is nothing to accumulate, and finish casts as always.
    let mut one = step(with_ga.clone(), config());
    assert!(one.accumulate_ops().is_empty());
    one.accumulate().unwrap();
    assert!(matches!(one.finish_ops()[0], RangeOp::CastF16ToF32 { .. }));
    let e = one.capture_accumulate().unwrap_err();
    assert!(matches!(e, AmpError::Exec(ExecError::EmptyCapture)), "{e}");
    // S says how many micro-batches G sums; a change of N is written there and changes the
    // op lists.
    let mut acc = step(with_ga, config().with_accum(4));
    assert_eq!(acc.executor().scalars().accum, 4);
    assert!(matches!(
        acc.finish_ops()[0],
        RangeOp::AccumGrads { drain: true, .. }
    ));
    acc.set_config(config().with_accum(2)).unwrap();
    let s: Scalars = acc.executor().scalars();
    assert_eq!(s.accum, 2);
    assert_eq!(s.unscale(), 1.0 / (s.loss_scale * 2.0));
}

/// S restored from another run (a checkpoint) brings its loss scale and counters, but the
/// group size and accumulation stay this run's: an S of one rank without accumulation,
/// restored into a step of 4 ranks × 2 micro-batches, still unscales by `1 / (scale · 8)`.
#[test]
fn restored_scalars_keep_this_runs_ranks_and_accumulation() {
    let mut s = step(plan(), config()).executor().scalars();
    (s.loss_scale, s.skipped, s.step) = (1024.0, 3, 17);
    let mut group = step(
        plan().with_grad_accumulator().unwrap(),
        config().with_accum(2),
    );
    group.set_ranks(4).unwrap();
    group.restore_scalars(&s).unwrap();
    let got = group.executor().scalars();
    assert_eq!(
        (got.loss_scale, got.skipped, got.step),
        (1024.0, 3, 17),
        "the restored scale and counters"
    );
    assert_eq!(
        (got.ranks, got.accum),
        (4, 2),
        "this run's group and accumulation"
    );
}
