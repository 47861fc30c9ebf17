//! Bad inputs: amp plans and steps.

use super::*;

pub(super) fn amp_rows() -> Vec<Row> {
    vec![
        ("amp plan", "an empty parameter name", || {
            let mut b = MemoryPlanBuilder::new();
            let k = b.bucket("b").unwrap();
            let e = b.add("", ParamKind::BnGamma, &[8], k).unwrap_err();
            assert!(matches!(e, PlanError::EmptyName { .. }), "{e:?}");
            typed(e)
        }),
        ("amp plan", "a parameter registered twice", || {
            let mut b = MemoryPlanBuilder::new();
            let k = b.bucket("b").unwrap();
            b.add("g", ParamKind::BnGamma, &[8], k).unwrap();
            let e = b.add("g", ParamKind::BnGamma, &[8], k).unwrap_err();
            assert!(matches!(e, PlanError::DuplicateName { .. }), "{e:?}");
            typed(e)
        }),
        ("amp plan", "a zero dimension", || {
            let mut b = MemoryPlanBuilder::new();
            let k = b.bucket("b").unwrap();
            let e = b
                .add("w", ParamKind::ConvWeight, &[8, 0, 3, 3], k)
                .unwrap_err();
            assert!(matches!(e, PlanError::ZeroDim { .. }), "{e:?}");
            typed(e)
        }),
        ("amp plan", "a conv weight of rank 1", || {
            let mut b = MemoryPlanBuilder::new();
            let k = b.bucket("b").unwrap();
            let e = b.add("w", ParamKind::ConvWeight, &[8], k).unwrap_err();
            assert!(matches!(e, PlanError::RankMismatch { .. }), "{e:?}");
            typed(e)
        }),
        ("amp plan", "a parameter whose size overflows", || {
            let mut b = MemoryPlanBuilder::new();
            let k = b.bucket("b").unwrap();
            let e = b
                .add("w", ParamKind::ConvWeight, &[1 << 40, 1 << 30, 1, 1], k)
                .unwrap_err();
            assert!(matches!(e, PlanError::SizeOverflow { .. }), "{e:?}");
            typed(e)
        }),
        ("amp plan", "a bucket declared twice", || {
            let mut b = MemoryPlanBuilder::new();
            b.bucket("b").unwrap();
            let e = b.bucket("b").unwrap_err();
            assert!(matches!(e, PlanError::BadBucketName { .. }), "{e:?}");
            typed(e)
        }),
        ("amp plan", "a plan with no parameters", || {
            let e = MemoryPlanBuilder::new().finalize().unwrap_err();
            typed(e)
        }),
        (
            "amp plan",
            "a plan of 17 TB on the CPU executor (checked before allocating)",
            || {
                let mut b = MemoryPlanBuilder::new();
                let k = b.bucket("b").unwrap();
                // 2^40 weights at 16 bytes each over W, G, M, A and G16: 17.6 TB.
                b.add("w", ParamKind::ConvWeight, &[1 << 20, 1 << 20, 1, 1], k)
                    .unwrap();
                let plan = b.finalize().unwrap();
                let e = CpuRegions::new(plan).unwrap_err();
                assert!(
                    matches!(e, AmpError::OutOfMemory { place: "host", .. }),
                    "{e:?}"
                );
                typed(e)
            },
        ),
        ("amp step", "a NaN learning rate", || {
            step_err(SgdConfig {
                lr: f32::NAN,
                ..SgdConfig::new(0.1)
            })
        }),
        ("amp step", "a negative momentum", || {
            step_err(SgdConfig {
                momentum: -0.5,
                ..SgdConfig::new(0.1)
            })
        }),
        ("amp step", "an infinite weight decay", || {
            step_err(SgdConfig {
                weight_decay: f32::INFINITY,
                ..SgdConfig::new(0.1)
            })
        }),
        ("loss scale", "a configured scale of 0", || {
            scale_config_err(0.0)
        }),
        ("loss scale", "a configured scale of +Inf", || {
            scale_config_err(f32::INFINITY)
        }),
        ("loss scale", "a configured scale of NaN", || {
            scale_config_err(f32::NAN)
        }),
        ("loss scale", "a configured scale of -8", || {
            scale_config_err(-8.0)
        }),
        ("loss scale", "a scale of 0 set on a running step", || {
            let mut step = small_step();
            let config =
                StepConfig::new(SgdConfig::new(0.1)).with_loss_scale(LossScalePolicy::fixed(0.0));
            let e = step.set_config(config).unwrap_err();
            assert_eq!(step.config().loss_scale.init_scale, 8192.0);
            scale_field(e, "init_scale")
        }),
        ("loss scale", "S written with a scale of 0", || {
            let mut regions = small_regions();
            let e = regions.write_scalars(&with_scale(0.0)).unwrap_err();
            unchanged(&regions);
            scale_field(e, "loss_scale")
        }),
        ("loss scale", "S written with a scale of +Inf", || {
            let mut regions = small_regions();
            let e = regions
                .write_scalars(&with_scale(f32::INFINITY))
                .unwrap_err();
            unchanged(&regions);
            scale_field(e, "loss_scale")
        }),
        ("loss scale", "S written with a scale of NaN", || {
            let mut regions = small_regions();
            let e = regions.write_scalars(&with_scale(f32::NAN)).unwrap_err();
            unchanged(&regions);
            scale_field(e, "loss_scale")
        }),
        (
            "loss scale",
            "S restored on a step with a scale of -Inf",
            || {
                let mut step = small_step();
                let e = step
                    .restore_scalars(&with_scale(f32::NEG_INFINITY))
                    .unwrap_err();
                unchanged(step.executor());
                scale_field(e, "loss_scale")
            },
        ),
        (
            "loss scale",
            "S restored on a step with a scale of 0",
            || {
                let mut step = small_step();
                let e = step.restore_scalars(&with_scale(0.0)).unwrap_err();
                unchanged(step.executor());
                scale_field(e, "loss_scale")
            },
        ),
        (
            "loss scale",
            "an S image (checkpoint) with a scale of 0",
            || {
                let mut regions = small_regions();
                let bytes = with_scale(0.0).to_bytes();
                let e = regions.load_region_bytes(Region::S, &bytes).unwrap_err();
                unchanged(&regions);
                scale_field(e, "loss_scale")
            },
        ),
        (
            "loss scale",
            "an S image (checkpoint) with a scale of +Inf",
            || {
                let e = Scalars::from_bytes(&with_scale(f32::INFINITY).to_bytes()).unwrap_err();
                scale_field(AmpError::from(e), "loss_scale")
            },
        ),
        ("loss scale", "a restored scale of 4096 (accepted)", || {
            let mut step = small_step();
            step.restore_scalars(&with_scale(4096.0)).unwrap();
            let s = step.executor().scalars();
            assert_eq!((s.loss_scale, s.lr), (4096.0, 0.1));
            Verdict::Recovered("S holds scale 4096 and the step's own learning rate".into())
        }),
    ]
}

pub(super) fn small_regions() -> CpuRegions {
    let mut b = MemoryPlanBuilder::new();
    let k = b.bucket("b").unwrap();
    b.add("g", ParamKind::BnGamma, &[8], k).unwrap();
    CpuRegions::new(b.finalize().unwrap()).unwrap()
}

pub(super) fn small_step() -> AmpStep<CpuRegions> {
    AmpStep::new(small_regions(), StepConfig::new(SgdConfig::new(0.1))).unwrap()
}

pub(super) fn with_scale(loss_scale: f32) -> Scalars {
    Scalars {
        loss_scale,
        ..Scalars::default()
    }
}

/// S still holds what was there before the rejected write: the default scale, 8192.
pub(super) fn unchanged(regions: &CpuRegions) {
    assert_eq!(regions.scalars().loss_scale, 8192.0);
}

pub(super) fn scale_config_err(scale: f32) -> Verdict {
    let e = AmpStep::new(
        small_regions(),
        StepConfig::new(SgdConfig::new(0.1)).with_loss_scale(LossScalePolicy::fixed(scale)),
    )
    .map(|_| ())
    .unwrap_err();
    scale_field(e, "init_scale")
}

pub(super) fn scale_field(e: AmpError, field: &str) -> Verdict {
    assert!(
        matches!(&e, AmpError::RangeOp(RangeOpError::InvalidConfig { field: f, .. }) if *f == field),
        "expected InvalidConfig on `{field}`, got {e:?}"
    );
    typed(e)
}

pub(super) fn step_err(sgd: SgdConfig) -> Verdict {
    let mut b = MemoryPlanBuilder::new();
    let k = b.bucket("b").unwrap();
    b.add("g", ParamKind::BnGamma, &[8], k).unwrap();
    let regions = CpuRegions::new(b.finalize().unwrap()).unwrap();
    let e = AmpStep::new(regions, StepConfig::new(sgd))
        .map(|_| ())
        .unwrap_err();
    assert!(
        e.to_string().to_lowercase().contains("invalid") || matches!(e, AmpError::RangeOp(_)),
        "{e:?}"
    );
    typed(e)
}
