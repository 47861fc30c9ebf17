//! The schedule.

use super::*;

#[test]
pub(super) fn finish_casts_only_g16_cast_ranges_splits_weight_decay_and_updates_the_scale_last() {
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
pub(super) fn bn_and_fc_gradients_survive_the_g16_cast_and_padding_stays_zero() {
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
pub(super) fn replay_of_captured_graphs_equals_eager_bit_for_bit() {
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
pub(super) fn a_learning_rate_schedule_under_graph_replay_equals_eager() {
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
pub(super) fn stale_and_foreign_graphs_are_refused() {
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
pub(super) fn configurations_the_plan_cannot_serve_are_typed_errors() {
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
pub(super) type ErrorCheck = fn(&AmpError) -> bool;

#[test]
pub(super) fn range_ops_outside_the_plan_are_typed_errors_and_run_nothing() {
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
pub(super) fn scalars_are_written_by_new_and_snapshotted_on_request() {
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
pub(super) fn the_cuda_executor_says_why_it_cannot_run_here() {
    // On a machine without a GPU (CI: a stand-in libcuda that reports no device) opening
    // must be a typed error, never a panic. On a GPU machine it opens.
    match cudnn_cbr_amp::cuda::CudaRegions::open(small_plan(false), 0) {
        Ok(regions) => assert_eq!(regions.plan().params().len(), 7),
        Err(e) => assert!(e.is_unavailable(), "unexpected error: {e}"),
    }
}
