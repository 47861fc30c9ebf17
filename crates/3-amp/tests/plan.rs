//! Tier 1: the memory plan. Every bad registration's typed error (and that its message names
//! the parameter), worked layouts with known numbers, and the invariants on many random
//! registrations, checked from the public views rather than by the plan's own `validate`.

use std::collections::HashMap;

use cudnn_cbr_amp::plan::{
    align_up, fp16_slot_bytes, Bucket, ByteRange, GradPath, MemoryPlan, MemoryPlanBuilder,
    ParamKind, Region, SLOT_ALIGN, SLOT_PAD,
};
use cudnn_cbr_amp::range::S_REGION_BYTES;
use cudnn_cbr_amp::PlanError;
use cudnn_cbr_runtime::DataType;
use proptest::prelude::*;

fn one_bucket() -> (MemoryPlanBuilder, Bucket) {
    let mut b = MemoryPlanBuilder::new();
    let bucket = b.bucket("all").unwrap();
    (b, bucket)
}

/// Asserts the error's message names `name` (the point of typed, named errors).
fn names(err: &PlanError, name: &str) {
    let msg = err.to_string();
    assert!(msg.contains(name), "message `{msg}` does not name `{name}`");
}

// ---------------------------------------------------------------- bad registrations

#[test]
fn empty_name_is_rejected_with_its_index() {
    let (mut b, k) = one_bucket();
    b.add("a", ParamKind::BnGamma, &[4], k).unwrap();
    let e = b.add("", ParamKind::BnGamma, &[4], k).unwrap_err();
    assert_eq!(e, PlanError::EmptyName { index: 1 });
    names(&e, "#1");
}

#[test]
fn duplicate_name_is_rejected_and_named() {
    let (mut b, k) = one_bucket();
    b.add("conv1.w", ParamKind::ConvWeight, &[8, 3, 3, 3], k)
        .unwrap();
    let e = b.add("conv1.w", ParamKind::BnGamma, &[8], k).unwrap_err();
    assert_eq!(
        e,
        PlanError::DuplicateName {
            name: "conv1.w".into()
        }
    );
    names(&e, "conv1.w");
    assert_eq!(
        b.len(),
        1,
        "a rejected registration leaves the builder unchanged"
    );
}

#[test]
fn empty_shape_is_rejected_and_named() {
    let (mut b, k) = one_bucket();
    let e = b.add("bn.gamma", ParamKind::BnGamma, &[], k).unwrap_err();
    assert_eq!(
        e,
        PlanError::EmptyShape {
            name: "bn.gamma".into()
        }
    );
    names(&e, "bn.gamma");
}

#[test]
fn zero_dimension_is_rejected_and_named() {
    let (mut b, k) = one_bucket();
    let e = b
        .add("conv.w", ParamKind::ConvWeight, &[8, 0, 3, 3], k)
        .unwrap_err();
    assert!(
        matches!(&e, PlanError::ZeroDim { name, shape } if name == "conv.w" && shape == &[8, 0, 3, 3])
    );
    names(&e, "conv.w");
}

#[test]
fn rank_that_does_not_fit_the_kind_is_rejected() {
    let (mut b, k) = one_bucket();
    let cases: [(&str, ParamKind, &[usize]); 5] = [
        ("bn.gamma", ParamKind::BnGamma, &[4, 4]),
        ("bn.beta", ParamKind::BnBeta, &[1, 4]),
        ("fc.w", ParamKind::FcWeight, &[10]),
        ("fc.b", ParamKind::FcBias, &[10, 1]),
        ("conv.w", ParamKind::ConvWeight, &[8, 9]),
    ];
    for (name, kind, shape) in cases {
        let e = b.add(name, kind, shape, k).unwrap_err();
        assert!(
            matches!(&e, PlanError::RankMismatch { name: n, kind: kk, .. } if n == name && *kk == kind),
            "{e:?}"
        );
        names(&e, name);
    }
    assert!(b.is_empty());
}

#[test]
fn element_count_overflow_is_rejected() {
    let (mut b, k) = one_bucket();
    let e = b
        .add("huge", ParamKind::FcWeight, &[usize::MAX, 2], k)
        .unwrap_err();
    assert!(
        matches!(&e, PlanError::SizeOverflow { name, what: "element count", .. } if name == "huge")
    );
    names(&e, "huge");
}

#[test]
fn fp16_slot_overflow_is_rejected() {
    let (mut b, k) = one_bucket();
    let e = b
        .add("big16", ParamKind::FcBias, &[usize::MAX / 2 + 1], k)
        .unwrap_err();
    assert!(
        matches!(&e, PlanError::SizeOverflow { name, what: "FP16 slot", .. } if name == "big16")
    );
}

#[test]
fn fp32_slot_overflow_is_rejected() {
    let (mut b, k) = one_bucket();
    // elems * 2 + 16 still fits; twice the aligned slot does not.
    let e = b
        .add("big32", ParamKind::FcBias, &[usize::MAX / 4 + 1], k)
        .unwrap_err();
    assert!(
        matches!(&e, PlanError::SizeOverflow { name, what: "FP32 slot", .. } if name == "big32")
    );
}

#[test]
fn region_total_overflow_names_the_parameter_that_overflows() {
    let (mut b, k) = one_bucket();
    // Each FP16 slot is 2^61 + 256 bytes; W+A+G+M = 7× that: one fits, two do not.
    b.add("big1", ParamKind::FcWeight, &[1 << 30, 1 << 30], k)
        .unwrap();
    b.add("big2", ParamKind::FcWeight, &[1 << 30, 1 << 30], k)
        .unwrap();
    let e = b.finalize().unwrap_err();
    assert!(
        matches!(&e, PlanError::SizeOverflow { name, .. } if name == "big2"),
        "{e:?}"
    );
    names(&e, "big2");
}

#[test]
fn registering_after_finalize_is_rejected() {
    let (mut b, k) = one_bucket();
    b.add("conv.w", ParamKind::ConvWeight, &[8, 3, 3, 3], k)
        .unwrap();
    let plan = b.finalize().unwrap();
    let e = b
        .add("late.w", ParamKind::ConvWeight, &[8, 3, 3, 3], k)
        .unwrap_err();
    assert_eq!(
        e,
        PlanError::RegisterAfterFinalize {
            name: "late.w".into()
        }
    );
    names(&e, "late.w");
    assert!(plan.param("late.w").is_none());
    assert_eq!(
        b.bucket("late").unwrap_err(),
        PlanError::BucketAfterFinalize {
            bucket: "late".into()
        }
    );
    assert_eq!(b.finalize().unwrap_err(), PlanError::AlreadyFinalized);
}

#[test]
fn bad_buckets_are_rejected() {
    let mut b = MemoryPlanBuilder::new();
    assert!(matches!(b.bucket(""), Err(PlanError::BadBucketName { .. })));
    let first = b.bucket("first").unwrap();
    assert_eq!(
        b.bucket("first").unwrap_err(),
        PlanError::BadBucketName {
            bucket: "first".into()
        }
    );
    // A handle from a builder with more buckets.
    let mut other = MemoryPlanBuilder::new();
    other.bucket("x").unwrap();
    let foreign = other.bucket("y").unwrap();
    let e = b
        .add("w", ParamKind::FcWeight, &[2, 2], foreign)
        .unwrap_err();
    assert_eq!(
        e,
        PlanError::UnknownBucket {
            name: "w".into(),
            bucket: 1
        }
    );
    names(&e, "`w`");
    // A declared bucket with no parameters.
    b.add("w", ParamKind::FcWeight, &[2, 2], first).unwrap();
    b.bucket("unused").unwrap();
    assert_eq!(
        b.finalize().unwrap_err(),
        PlanError::EmptyBucket {
            bucket: "unused".into()
        }
    );
}

#[test]
fn empty_plan_is_rejected_and_a_failed_finalize_does_not_seal() {
    let mut b = MemoryPlanBuilder::new();
    assert_eq!(b.finalize().unwrap_err(), PlanError::EmptyPlan);
    let k = b.bucket("all").unwrap();
    b.add("fc.b", ParamKind::FcBias, &[10], k).unwrap();
    assert!(b.finalize().is_ok());
}

#[test]
fn queries_that_cannot_be_answered_are_typed_errors() {
    let (mut b, k) = one_bucket();
    b = b.with_momentum_buffer(false);
    b.add("conv.w", ParamKind::ConvWeight, &[8, 3, 3, 3], k)
        .unwrap();
    b.add("fc.w", ParamKind::FcWeight, &[10, 8], k).unwrap();
    let plan = b.finalize().unwrap();

    let e = plan.view("nope", Region::W).unwrap_err();
    assert_eq!(
        e,
        PlanError::UnknownParam {
            name: "nope".into()
        }
    );
    names(&e, "nope");
    let e = plan.view("fc.w", Region::G16).unwrap_err();
    assert_eq!(
        e,
        PlanError::NotInRegion {
            name: "fc.w".into(),
            region: Region::G16
        }
    );
    names(&e, "fc.w");
    for r in [Region::E, Region::E16, Region::M, Region::S] {
        assert!(
            matches!(plan.view("conv.w", r), Err(PlanError::NotInRegion { .. })),
            "{r}"
        );
    }
    assert_eq!(
        plan.region_range(Region::M).unwrap_err(),
        PlanError::RegionAbsent { region: Region::M }
    );
    assert_eq!(
        plan.bucket_range(k, Region::S).unwrap_err(),
        PlanError::RegionAbsent { region: Region::S }
    );
    let mut other = MemoryPlanBuilder::new();
    other.bucket("a").unwrap();
    let ghost = other.bucket("b").unwrap();
    assert_eq!(
        plan.bucket_range(ghost, Region::W).unwrap_err(),
        PlanError::NoSuchBucket { bucket: 1 }
    );
}

// ---------------------------------------------------------------- worked layouts

#[test]
fn slot_rule_numbers() {
    assert_eq!(fp16_slot_bytes(1), Some(256)); // 2 + 16 -> 256
    assert_eq!(fp16_slot_bytes(120), Some(256)); // 240 + 16 = 256 exactly
    assert_eq!(fp16_slot_bytes(121), Some(512)); // 242 + 16 = 258 -> 512
    assert_eq!(fp16_slot_bytes(1728), Some(3584)); // 64x3x3x3: 3456 + 16 = 3472 -> 3584
    assert_eq!(fp16_slot_bytes(usize::MAX / 2 + 1), None);
    assert_eq!(align_up(257, 256), Some(512));
    assert_eq!(align_up(usize::MAX, 256), None);
    assert_eq!(
        align_up(10, 3),
        None,
        "not a power of two: None, not a panic"
    );
}

/// conv1 (first), bn1 (first), conv2 (deep), fc (deep): registration interleaves kinds.
fn small_net(ema: bool) -> (MemoryPlan, Bucket, Bucket) {
    let mut b = MemoryPlanBuilder::new().with_ema(ema);
    let first = b.bucket("first").unwrap();
    let deep = b.bucket("deep").unwrap();
    b.add("bn1.gamma", ParamKind::BnGamma, &[64], first)
        .unwrap();
    b.add("conv1.w", ParamKind::ConvWeight, &[64, 3, 3, 3], first)
        .unwrap();
    b.add("bn1.beta", ParamKind::BnBeta, &[64], first).unwrap();
    b.add("fc.b", ParamKind::FcBias, &[10], deep).unwrap();
    b.add("fc.w", ParamKind::FcWeight, &[10, 64], deep).unwrap();
    b.add("conv2.w", ParamKind::ConvWeight, &[64, 3, 3, 64], deep)
        .unwrap();
    (b.finalize().unwrap(), first, deep)
}

#[test]
fn small_network_layout_is_bucket_major_conv_first() {
    let (plan, first, deep) = small_net(true);
    let order: Vec<&str> = plan.params().iter().map(|p| p.name()).collect();
    assert_eq!(
        order,
        [
            "conv1.w",
            "bn1.gamma",
            "bn1.beta",
            "conv2.w",
            "fc.w",
            "fc.b"
        ]
    );
    // FP16 offsets: conv1 3584, bn 256 + 256, conv2 64*9*64*2 = 73728 + 16 -> 73984,
    // fc.w 1280 + 16 -> 1536, fc.b 256.
    let a: Vec<usize> = plan
        .views(Region::A)
        .iter()
        .map(|v| v.offset_bytes)
        .collect();
    assert_eq!(a, [0, 3584, 3840, 4096, 78080, 79616]);
    assert_eq!(plan.region_len(Region::A), 79872);
    assert_eq!(plan.region_len(Region::W), 2 * 79872);
    assert_eq!(plan.region_len(Region::E16), 79872);
    // G16 ends after conv2; the BN slots of `first` are a hole.
    assert_eq!(plan.region_len(Region::G16), 78080);
    assert_eq!(plan.g16_hole_bytes(), 512);
    assert_eq!(
        plan.g16_cast_ranges(),
        [ByteRange::new(0, 3584), ByteRange::new(4096, 78080)]
    );
    assert_eq!(
        plan.bucket_range(first, Region::G16).unwrap(),
        ByteRange::new(0, 3584)
    );
    assert_eq!(
        plan.bucket_range(deep, Region::G).unwrap(),
        ByteRange::new(8192, 2 * 79872)
    );
    assert_eq!(
        plan.decay_range(deep, Region::A).unwrap(),
        ByteRange::new(4096, 79616)
    );
    assert_eq!(
        plan.decay_range(first, Region::W).unwrap(),
        ByteRange::new(0, 7168)
    );
    let w = plan.view("conv2.w", Region::W).unwrap();
    assert_eq!(
        (w.dtype, w.offset_bytes, w.len_bytes, w.slot_bytes),
        (DataType::Float, 8192, 147456, 147968)
    );
    assert_eq!(w.elem_offset(), 2048);
    assert_eq!(ParamKind::FcWeight.grad_path(), GradPath::DirectF32);
    assert_eq!(ParamKind::ConvWeight.grad_path(), GradPath::ViaG16);
    // Arena: W A G G16 M E E16 S, back to back; GA (gradient accumulation) only when asked,
    // between E16 and S, as long as G.
    let arena = plan.arena_layout();
    let regions: Vec<Region> = arena.iter().map(|r| r.region).collect();
    let without_ga: Vec<Region> = Region::ALL
        .into_iter()
        .filter(|&r| r != Region::GA)
        .collect();
    assert_eq!(regions, without_ga);
    assert!(!plan.has_region(Region::GA));
    let with_ga = plan.clone().with_grad_accumulator().unwrap();
    let ga_regions: Vec<Region> = with_ga.arena_layout().iter().map(|r| r.region).collect();
    assert_eq!(ga_regions, Region::ALL);
    assert_eq!(with_ga.region_len(Region::GA), plan.region_len(Region::G));
    assert_eq!(
        with_ga.total_bytes(),
        plan.total_bytes() + plan.region_len(Region::G)
    );
    with_ga.validate().unwrap();
    let mut expect = 0;
    for r in &arena {
        assert_eq!(r.arena_offset, expect);
        expect += r.len_bytes;
    }
    assert_eq!(plan.total_bytes(), expect);
    assert_eq!(plan.region_len(Region::S), S_REGION_BYTES);
    assert_eq!(plan.total_elems(), 1728 + 64 + 64 + 36864 + 640 + 10);
}

#[test]
fn without_conv_parameters_there_is_no_g16() {
    let (mut b, k) = one_bucket();
    b.add("fc.w", ParamKind::FcWeight, &[10, 64], k).unwrap();
    let plan = b.finalize().unwrap();
    assert!(!plan.has_region(Region::G16));
    assert!(plan.g16_cast_ranges().is_empty());
    assert!(plan.region_range(Region::G16).is_err());
}

#[test]
fn single_bucket_casts_g16_in_one_launch() {
    let (mut b, k) = one_bucket();
    b.add("bn.g", ParamKind::BnGamma, &[8], k).unwrap();
    b.add("c1", ParamKind::ConvWeight, &[8, 3, 3, 3], k)
        .unwrap();
    b.add("fc.w", ParamKind::FcWeight, &[10, 8], k).unwrap();
    b.add("c2", ParamKind::ConvWeight, &[8, 3, 3, 8], k)
        .unwrap();
    let plan = b.finalize().unwrap();
    assert_eq!(
        plan.g16_cast_ranges(),
        [plan.region_range(Region::G16).unwrap()]
    );
    assert_eq!(plan.g16_hole_bytes(), 0);
}

// ---------------------------------------------------------------- random registrations

/// 96 cases to keep the suite fast; `PROPTEST_CASES=5000` for a stress run.
fn config() -> ProptestConfig {
    let default = ProptestConfig::default();
    ProptestConfig {
        cases: if std::env::var_os("PROPTEST_CASES").is_some() {
            default.cases
        } else {
            96
        },
        failure_persistence: None,
        ..default
    }
}

#[derive(Debug, Clone)]
struct Reg {
    kind: ParamKind,
    shape: Vec<usize>,
    bucket: usize,
}

fn kind_and_shape() -> impl Strategy<Value = (ParamKind, Vec<usize>)> {
    prop_oneof![
        prop::collection::vec(1usize..40, 4).prop_map(|s| (ParamKind::ConvWeight, s)),
        (1usize..300).prop_map(|c| (ParamKind::BnGamma, vec![c])),
        (1usize..300).prop_map(|c| (ParamKind::BnBeta, vec![c])),
        (1usize..100, 1usize..200).prop_map(|(o, i)| (ParamKind::FcWeight, vec![o, i])),
        (1usize..300).prop_map(|c| (ParamKind::FcBias, vec![c])),
    ]
}

fn registrations() -> impl Strategy<Value = (usize, Vec<Reg>, bool, bool)> {
    (1usize..5).prop_flat_map(|buckets| {
        (
            Just(buckets),
            prop::collection::vec(
                (kind_and_shape(), 0..buckets).prop_map(|((kind, shape), bucket)| Reg {
                    kind,
                    shape,
                    bucket,
                }),
                buckets..buckets + 30,
            ),
            any::<bool>(),
            any::<bool>(),
        )
    })
}

/// Builds the plan; makes sure every declared bucket has a parameter by assigning the first
/// `buckets` registrations round-robin.
fn build(buckets: usize, regs: &mut [Reg], ema: bool, momentum: bool) -> MemoryPlan {
    let mut b = MemoryPlanBuilder::new()
        .with_ema(ema)
        .with_momentum_buffer(momentum);
    let handles: Vec<Bucket> = (0..buckets)
        .map(|i| b.bucket(&format!("bucket{i}")).unwrap())
        .collect();
    for (i, r) in regs.iter_mut().enumerate() {
        if i < buckets {
            r.bucket = i;
        }
        b.add(&format!("p{i}"), r.kind, &r.shape, handles[r.bucket])
            .unwrap();
    }
    b.finalize().unwrap()
}

fn check_invariants(plan: &MemoryPlan, regs: &[Reg]) {
    plan.validate().unwrap();
    assert_eq!(plan.params().len(), regs.len());

    // Order: bucket-major, conv, then FC weights, then the rest; registration order inside.
    let rank = |k: ParamKind| match k {
        ParamKind::ConvWeight => 0,
        ParamKind::FcWeight => 1,
        _ => 2,
    };
    let mut expected: Vec<usize> = (0..regs.len()).collect();
    expected.sort_by_key(|&i| (regs[i].bucket, rank(regs[i].kind), i));
    let expected: Vec<String> = expected.iter().map(|i| format!("p{i}")).collect();
    let full_regions: Vec<Region> = [
        Region::W,
        Region::A,
        Region::G,
        Region::M,
        Region::E,
        Region::E16,
    ]
    .into_iter()
    .filter(|&r| plan.has_region(r))
    .collect();

    let mut by_region: HashMap<Region, Vec<String>> = HashMap::new();
    for &r in full_regions.iter().chain([Region::G16].iter()) {
        if !plan.has_region(r) {
            continue;
        }
        let dtype = r.dtype().unwrap();
        let len = plan.region_len(r);
        assert_eq!(len % SLOT_ALIGN, 0);
        let mut views = plan.views(r);
        views.sort_by_key(|v| v.offset_bytes);
        let mut prev_end = 0;
        for v in &views {
            let reg = &regs[v.name[1..].parse::<usize>().unwrap()];
            let elems: usize = reg.shape.iter().product();
            assert_eq!(v.elems, elems);
            assert_eq!(v.dtype, dtype);
            assert_eq!(v.len_bytes, elems * dtype.size());
            // Slot rule, recomputed from scratch.
            let slot16 = (elems * 2 + SLOT_PAD).div_ceil(SLOT_ALIGN) * SLOT_ALIGN;
            let scale = dtype.size() / 2;
            assert_eq!(v.slot_bytes, slot16 * scale, "{} in {r}", v.name);
            assert!(v.len_bytes + SLOT_PAD * scale <= v.slot_bytes);
            assert_eq!(v.offset_bytes % SLOT_ALIGN, 0);
            // No overlap.
            assert!(v.offset_bytes >= prev_end, "{} overlaps in {r}", v.name);
            prev_end = v.offset_bytes + v.slot_bytes;
            assert!(prev_end <= len);
            // 2:1 against the FP16 layout (A).
            let a = plan.view(v.name, Region::A).unwrap();
            assert_eq!(v.offset_bytes, a.offset_bytes * scale);
        }
        if r != Region::G16 {
            assert_eq!(prev_end, len, "{r} is dense");
        }
        by_region.insert(r, views.iter().map(|v| v.name.to_owned()).collect());
    }
    // Same order in every full region; G16 is that order restricted to conv.
    for r in &full_regions {
        assert_eq!(by_region[r], expected, "order in {r}");
    }
    let conv_order: Vec<String> = expected
        .iter()
        .filter(|n| plan.param(n).unwrap().kind() == ParamKind::ConvWeight)
        .cloned()
        .collect();
    assert_eq!(
        by_region.get(&Region::G16).cloned().unwrap_or_default(),
        conv_order
    );

    // Bucket ranges cover exactly the bucket's slots in each region.
    for info in plan.buckets() {
        let bucket = info.bucket();
        for &r in &full_regions {
            let range = plan.bucket_range(bucket, r).unwrap();
            for v in plan.views(r) {
                let inside =
                    v.offset_bytes >= range.start && v.offset_bytes + v.slot_bytes <= range.end;
                let outside =
                    v.offset_bytes + v.slot_bytes <= range.start || v.offset_bytes >= range.end;
                assert!(
                    inside || outside,
                    "{} straddles bucket {} in {r}",
                    v.name,
                    info.name()
                );
                assert_eq!(inside, v.bucket == bucket, "{} in {r}", v.name);
            }
            let decay = plan.decay_range(bucket, r).unwrap();
            for v in plan.views(r).iter().filter(|v| v.bucket == bucket) {
                let in_decay = v.offset_bytes >= decay.start && v.offset_bytes < decay.end;
                assert_eq!(in_decay, v.kind.decays(), "{} decay range", v.name);
            }
        }
        if plan.has_region(Region::G16) {
            let range = plan.bucket_range(bucket, Region::G16).unwrap();
            let covered: usize = plan
                .views(Region::G16)
                .iter()
                .filter(|v| v.bucket == bucket)
                .map(|v| v.slot_bytes)
                .sum();
            assert_eq!(range.len(), covered, "G16 run of bucket {}", info.name());
        }
    }

    // The G16 cast covers every conv slot and no other parameter's coordinates.
    let cast = plan.g16_cast_ranges();
    let in_cast = |at: usize| cast.iter().any(|c| c.start <= at && at < c.end);
    for p in plan.params() {
        let covered = in_cast(p.offset16()) && in_cast(p.offset16() + p.slot16() - 1);
        let touched = cast
            .iter()
            .any(|c| c.start < p.offset16() + p.slot16() && p.offset16() < c.end);
        if p.kind() == ParamKind::ConvWeight {
            assert!(covered, "{} not cast", p.name());
        } else {
            assert!(!touched, "cast would clobber {}", p.name());
        }
    }

    // Arena totals.
    let arena = plan.arena_layout();
    let sum: usize = arena.iter().map(|r| r.len_bytes).sum();
    assert_eq!(plan.total_bytes(), sum);
    assert!(arena.iter().all(|r| r.arena_offset % SLOT_ALIGN == 0));
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn random_registrations_keep_every_invariant((buckets, mut regs, ema, momentum) in registrations()) {
        let plan = build(buckets, &mut regs, ema, momentum);
        prop_assert_eq!(plan.has_region(Region::E), ema);
        prop_assert_eq!(plan.has_region(Region::M), momentum);
        check_invariants(&plan, &regs);
    }
}
