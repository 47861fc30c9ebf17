//! A whole step over a plan.

use super::*;

/// Host copies of the regions, indexed like device memory.
pub(super) struct HostRegions {
    w: Vec<f32>,
    a: Vec<f16>,
    g: Vec<f32>,
    g16: Vec<f16>,
    m: Vec<f32>,
    e: Vec<f32>,
    e16: Vec<f16>,
}

pub(super) fn elems(r: ByteRange, dtype: DataType) -> std::ops::Range<usize> {
    r.elem_range(dtype)
}

#[test]
pub(super) fn one_training_step_over_a_plan() {
    let mut b = MemoryPlanBuilder::new().with_ema(true);
    let first = b.bucket("first").unwrap();
    let deep = b.bucket("deep").unwrap();
    b.add("conv1.w", ParamKind::ConvWeight, &[8, 3, 3, 3], first)
        .unwrap();
    b.add("bn1.gamma", ParamKind::BnGamma, &[8], first).unwrap();
    b.add("conv2.w", ParamKind::ConvWeight, &[8, 3, 3, 8], deep)
        .unwrap();
    b.add("fc.w", ParamKind::FcWeight, &[10, 8], deep).unwrap();
    let plan = b.finalize().unwrap();
    let len = |r: Region| plan.region_len(r) / r.dtype().unwrap().size();
    let mut h = HostRegions {
        w: vec![0.0; len(Region::W)],
        a: vec![f16::ZERO; len(Region::A)],
        g: vec![0.0; len(Region::G)],
        g16: vec![f16::ZERO; len(Region::G16)],
        m: vec![0.0; len(Region::M)],
        e: vec![0.0; len(Region::E)],
        e16: vec![f16::ZERO; len(Region::E16)],
    };
    // Initial weights: 0.25 in every parameter's data (padding stays zero).
    for v in plan.views(Region::W) {
        h.w[v.elem_offset()..][..v.elems].fill(0.25);
        h.e[v.elem_offset()..][..v.elems].fill(0.25);
    }
    let policy = LossScalePolicy::default();
    let mut s = Scalars::new(&policy);
    let cfg = SgdConfig::new(0.5).with_momentum(0.9);

    for (step, poison) in [(0, false), (1, true), (2, false)] {
        zero_f32(&mut h.g);
        // Backward: conv wgrads FP16 into G16, FC grads FP32 straight into G, all scaled.
        let scale = s.loss_scale;
        for v in plan.views(Region::G16) {
            h.g16[v.elem_offset()..][..v.elems].fill(f16::from_f32(scale));
        }
        let fc = plan.view("fc.w", Region::G).unwrap();
        h.g[fc.elem_offset()..][..fc.elems].fill(2.0 * scale);
        let bn = plan.view("bn1.gamma", Region::G).unwrap();
        h.g[bn.elem_offset()..][..bn.elems].fill(-scale);
        if poison {
            h.g16[plan.view("conv2.w", Region::G16).unwrap().elem_offset()] = f16::INFINITY;
        }
        // G16 -> G over the cast ranges only.
        for r16 in plan.g16_cast_ranges() {
            let src = &h.g16[elems(r16, DataType::Half)];
            cast_f16_to_f32(src, &mut h.g[elems(r16.to_fp32(), DataType::Float)]).unwrap();
        }
        assert_eq!(
            h.g[fc.elem_offset()],
            2.0 * scale,
            "the cast left FC grads alone"
        );
        assert_eq!(
            h.g[bn.elem_offset()],
            -scale,
            "the cast left BN grads alone"
        );
        // Check per bucket, deep first (it finishes first in backward).
        for bucket in [deep, first] {
            let r = plan.bucket_range(bucket, Region::G).unwrap();
            check_grads(
                &mut h.g[elems(r, DataType::Float)],
                OverflowPolicy::NanOrInf,
                &mut s,
            )
            .unwrap();
        }
        assert_eq!(s.overflowed(), poison, "step {step}");
        let w_before = h.w.clone();
        let out = sgd(&mut h.w, Some(&mut h.m), &h.g, &mut h.a, &s, &cfg).unwrap();
        ema_update(&mut h.e, &mut h.e16, &h.w, &s, 0.5).unwrap();
        update_loss_scale(&mut s, &policy).unwrap();
        if poison {
            assert_eq!(out, StepOutcome::Skipped);
            assert_eq!(h.w, w_before);
            assert_eq!(s.loss_scale, 4096.0);
        } else {
            assert_eq!(out, StepOutcome::Applied);
        }
    }
    // Two applied steps with unscaled grads 1 (conv), 2 (fc), -1 (bn), momentum 0.9, lr 0.5.
    let expect = |g: f32| {
        let m1 = g;
        let w1 = 0.25 - 0.5 * m1;
        let m2 = 0.9 * m1 + g;
        w1 - 0.5 * m2
    };
    for (name, g) in [
        ("conv1.w", 1.0),
        ("conv2.w", 1.0),
        ("fc.w", 2.0),
        ("bn1.gamma", -1.0),
    ] {
        let v = plan.view(name, Region::W).unwrap();
        let a = plan.view(name, Region::A).unwrap();
        assert_relative_eq!(h.w[v.elem_offset()], expect(g), max_relative = 1e-6);
        assert_eq!(h.a[a.elem_offset()], f32_to_f16(h.w[v.elem_offset()]));
    }
    // Padding never left zero.
    for v in plan.views(Region::W) {
        let pad = v.elem_offset() + v.elems..v.elem_offset() + v.slot_bytes / 4;
        assert!(
            h.w[pad.clone()].iter().all(|&x| x == 0.0),
            "{} padding",
            v.name
        );
        assert!(h.e[pad].iter().all(|&x| x == 0.0));
    }
    assert_eq!((s.step, s.skipped, s.overflow), (2, 1, 0));
}
