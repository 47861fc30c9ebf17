//! Tier 1: every range op's CPU twin against a naive definition, the flag-skip and clip
//! semantics, the loss-scale state machine, the S layout, and one whole step driven by a
//! memory plan over host copies of the regions.

use approx::assert_relative_eq;
use cudnn_cbr_amp::kernels::COMMON_HEADER;
use cudnn_cbr_amp::plan::{ByteRange, MemoryPlanBuilder, ParamKind, Region};
use cudnn_cbr_amp::range::{
    cast_f16_to_f32, check_and_clip, check_grads, check_nonfinite, ema_update, f32_to_f16,
    s_layout, sgd_step, softmax_xent_backward, update_loss_scale, zero_bytes, zero_f16, zero_f32,
    LossScalePolicy, OverflowPolicy, Scalars, ScaleUpdate, SgdConfig, StepOutcome,
    DEFAULT_INIT_SCALE, S_REGION_BYTES,
};
use cudnn_cbr_amp::RangeOpError;
use cudnn_fe_sys::DataType;
use half::f16;
use proptest::prelude::*;

/// The twin with `cfg`'s hyper-parameters written into S (where the step keeps them).
fn sgd(
    w: &mut [f32],
    m: Option<&mut [f32]>,
    g: &[f32],
    a: &mut [f16],
    s: &Scalars,
    cfg: &SgdConfig,
) -> Result<StepOutcome, RangeOpError> {
    sgd_step(w, m, g, a, &s.with_sgd(cfg), cfg.nesterov)
}

/// 64 cases to keep the suite fast; `PROPTEST_CASES=5000` for a stress run.
fn small_config() -> ProptestConfig {
    let default = ProptestConfig::default();
    ProptestConfig {
        cases: if std::env::var_os("PROPTEST_CASES").is_some() {
            default.cases
        } else {
            64
        },
        failure_persistence: None,
        ..default
    }
}

/// Finite values of mixed magnitudes, as gradients and weights tend to be.
fn finite_vec(len: usize) -> impl Strategy<Value = Vec<f32>> {
    prop::collection::vec(
        prop_oneof![-1.0f32..1.0, -1e4f32..1e4, (-1e-6f32..1e-6), Just(0.0f32),],
        len,
    )
}

// ---------------------------------------------------------------- S region

#[test]
fn scalars_round_trip_through_the_s_image() {
    let s = Scalars {
        loss_scale: 1024.0,
        overflow: 1,
        growth_tracker: 7,
        step: 123_456,
        skipped: u32::MAX,
        lr: 0.05,
        momentum: 0.9,
        weight_decay: 5e-4,
        ranks: 3,
        clip_norm: 1.5,
        grad_norm: 0.25,
        accum: 7,
        norm_partials: std::array::from_fn(|k| k as f32 + 0.5),
    };
    let bytes = s.to_bytes();
    assert_eq!(bytes.len(), S_REGION_BYTES);
    let partials = s_layout::NORM_PARTIALS..s_layout::NORM_PARTIALS + 4 * s_layout::NORM_BLOCKS;
    assert!(
        bytes[s_layout::ACCUM + 4..partials.start]
            .iter()
            .chain(&bytes[partials.end..])
            .all(|&b| b == 0),
        "reserved bytes are zero"
    );
    assert_eq!(&bytes[s_layout::CLIP_NORM..][..4], &1.5f32.to_le_bytes());
    assert_eq!(&bytes[s_layout::GRAD_NORM..][..4], &0.25f32.to_le_bytes());
    assert_eq!(
        &bytes[partials.start + 4 * 31..][..4],
        &31.5f32.to_le_bytes()
    );
    assert_eq!(&bytes[s_layout::LOSS_SCALE..][..4], &1024f32.to_le_bytes());
    assert_eq!(&bytes[s_layout::STEP..][..4], &123_456u32.to_le_bytes());
    assert_eq!(&bytes[s_layout::LR..][..4], &0.05f32.to_le_bytes());
    assert_eq!(
        &bytes[s_layout::WEIGHT_DECAY..][..4],
        &5e-4f32.to_le_bytes()
    );
    assert_eq!(Scalars::from_bytes(&bytes).unwrap(), s);
    assert_eq!(&bytes[s_layout::RANKS..][..4], &3u32.to_le_bytes());
    assert_eq!(&bytes[s_layout::ACCUM..][..4], &7u32.to_le_bytes());
    // An image that ends before ACCUM (as S images written before the field existed) reads
    // one micro-batch.
    let short = Scalars::from_bytes(&bytes[..s_layout::USED]).unwrap();
    assert_eq!((short.accum, short.unscale()), (0, 1.0 / (1024.0 * 3.0)));
    assert_eq!(
        Scalars::from_bytes(&bytes[..43]).unwrap_err(),
        RangeOpError::ScalarsTooShort {
            got: 43,
            needed: 44
        }
    );
    let fresh = Scalars::default();
    assert_eq!(fresh.loss_scale, DEFAULT_INIT_SCALE);
    assert!(!fresh.overflowed());
}

#[test]
fn s_layout_matches_the_cuda_struct() {
    // The header static_asserts each offset; make sure they are the Rust offsets.
    for (field, offset) in [
        ("loss_scale", s_layout::LOSS_SCALE),
        ("overflow", s_layout::OVERFLOW),
        ("growth_tracker", s_layout::GROWTH_TRACKER),
        ("step", s_layout::STEP),
        ("skipped", s_layout::SKIPPED),
        ("clip_norm", s_layout::CLIP_NORM),
        ("grad_norm", s_layout::GRAD_NORM),
        ("accum", s_layout::ACCUM),
        ("norm_partials", s_layout::NORM_PARTIALS),
    ] {
        let assert = format!("__builtin_offsetof(AmpScalars, {field}) == {offset},");
        assert!(COMMON_HEADER.contains(&assert), "missing `{assert}`");
    }
    // The struct ends with the partial sums of the gradient norm.
    let size = s_layout::NORM_PARTIALS + 4 * s_layout::NORM_BLOCKS;
    assert!(COMMON_HEADER.contains(&format!("sizeof(AmpScalars) == {size}")));
    assert!(COMMON_HEADER.contains(&format!(
        "#define AMP_NORM_BLOCKS {}",
        s_layout::NORM_BLOCKS
    )));
}

// ---------------------------------------------------------------- check / clip

#[test]
fn check_nonfinite_sets_but_never_clears_the_flag() {
    let mut s = Scalars::default();
    assert!(!check_nonfinite(&[0.0, -1.0, 65504.0, f32::MAX], &mut s).overflow);
    assert_eq!(s.overflow, 0);
    for bad in [
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        f32::from_bits(0xff80_0001),
    ] {
        let mut s = Scalars::default();
        assert!(check_nonfinite(&[1.0, bad, 2.0], &mut s).overflow);
        assert_eq!(s.overflow, 1);
        // A later clean bucket does not clear it.
        assert!(!check_nonfinite(&[1.0], &mut s).overflow);
        assert_eq!(s.overflow, 1);
    }
}

#[test]
fn clip_policy_clamps_inf_and_large_values_and_flags_only_nan() {
    let bound = 100.0;
    let mut g = vec![
        1.0,
        100.0,
        100.000_01,
        -250.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        -0.0,
        3e38,
    ];
    let mut s = Scalars::default();
    let out = check_and_clip(&mut g, bound, &mut s).unwrap();
    assert_eq!(g, [1.0, 100.0, 100.0, -100.0, 100.0, -100.0, -0.0, 100.0]);
    assert!(g[6].is_sign_negative());
    assert_eq!(out.clipped, 5);
    assert!(!out.overflow);
    assert_eq!(s.overflow, 0, "Inf alone does not flag under ClipInf");

    let mut g = vec![f32::NAN, f32::INFINITY];
    let out = check_and_clip(&mut g, bound, &mut s).unwrap();
    assert!(out.overflow && g[0].is_nan() && g[1] == bound);
    assert_eq!(s.overflow, 1);

    for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        assert!(matches!(
            check_and_clip(&mut [1.0], bad, &mut s),
            Err(RangeOpError::InvalidConfig { field: "bound", .. })
        ));
    }
    assert_eq!(OverflowPolicy::default(), OverflowPolicy::NanOrInf);
    assert_eq!(
        OverflowPolicy::clip_inf(),
        OverflowPolicy::ClipInf { bound: 65504.0 }
    );
}

proptest! {
    #![proptest_config(small_config())]

    #[test]
    fn check_grads_matches_its_naive_definition(
        mut g in prop::collection::vec(
            prop_oneof![
                4 => -1e5f32..1e5,
                1 => Just(f32::INFINITY),
                1 => Just(f32::NEG_INFINITY),
                1 => Just(f32::NAN),
            ],
            0..200,
        ),
        bound in 1.0f32..5e4,
        clip in any::<bool>(),
    ) {
        let before = g.clone();
        let policy = if clip { OverflowPolicy::ClipInf { bound } } else { OverflowPolicy::NanOrInf };
        let mut s = Scalars::default();
        let out = check_grads(&mut g, policy, &mut s).unwrap();
        let naive_flag = if clip {
            before.iter().any(|x| x.is_nan())
        } else {
            before.iter().any(|x| !x.is_finite())
        };
        prop_assert_eq!(out.overflow, naive_flag);
        prop_assert_eq!(s.overflow, u32::from(naive_flag));
        for (x, y) in before.iter().zip(&g) {
            let expect = if !clip || x.is_nan() || x.abs() <= bound {
                *x
            } else if *x > 0.0 {
                bound
            } else {
                -bound
            };
            prop_assert_eq!(y.to_bits(), expect.to_bits());
        }
    }
}

// ---------------------------------------------------------------- loss scale

/// The policy as a plain state machine, written independently of the twin.
#[derive(Debug, Clone, Copy, PartialEq)]
struct NaiveScaler {
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
fn fixed_policy_starts_at_8192_halves_to_one_and_never_grows() {
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
fn growth_policy_grows_after_interval_and_caps() {
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
fn bad_loss_scale_policies_are_rejected() {
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

// ---------------------------------------------------------------- zero

#[test]
fn zeroing_writes_positive_zero_everywhere() {
    let mut b = vec![0xabu8; 77];
    zero_bytes(&mut b);
    assert!(b.iter().all(|&x| x == 0));
    let mut f = vec![-3.5f32, f32::NAN, -0.0];
    zero_f32(&mut f);
    assert!(f.iter().all(|x| x.to_bits() == 0));
    let mut h = vec![f16::NEG_INFINITY, f16::from_f32(-0.0)];
    zero_f16(&mut h);
    assert!(h.iter().all(|x| x.to_bits() == 0));
}

// ---------------------------------------------------------------- SGD

/// PyTorch's SGD as documented (torch.optim.SGD, dampening 0), on the unscaled gradient
/// `g / scale`, generic over the float type so it runs in f32 (bit-exact contract) and in
/// f64 (accuracy).
fn naive_sgd<T>(w: &mut [T], m: &mut [T], g: &[T], scale: T, c: &SgdConfig)
where
    T: Copy
        + PartialEq
        + From<f32>
        + std::ops::Add<Output = T>
        + std::ops::Sub<Output = T>
        + std::ops::Mul<Output = T>
        + std::ops::Div<Output = T>,
{
    let (lr, mu, wd) = (T::from(c.lr), T::from(c.momentum), T::from(c.weight_decay));
    let zero = T::from(0.0);
    for i in 0..w.len() {
        let mut d = g[i] / scale;
        if wd != zero {
            d = d + wd * w[i];
        }
        if mu != zero {
            m[i] = mu * m[i] + d;
            d = if c.nesterov { d + mu * m[i] } else { m[i] };
        }
        w[i] = w[i] - lr * d;
    }
}

fn sgd_configs() -> impl Strategy<Value = SgdConfig> {
    (
        prop_oneof![Just(0.1f32), Just(0.01f32), 1e-4f32..0.5],
        prop_oneof![Just(0.0f32), Just(0.9f32), 0.0f32..0.99],
        prop_oneof![Just(0.0f32), Just(1e-4f32), 0.0f32..1e-2],
        any::<bool>(),
    )
        .prop_map(|(lr, momentum, wd, nesterov)| {
            SgdConfig::new(lr)
                .with_momentum(momentum)
                .with_weight_decay(wd)
                .with_nesterov(nesterov && momentum > 0.0)
        })
}

proptest! {
    #![proptest_config(small_config())]

    #[test]
    fn sgd_matches_pytorch_sgd_bit_for_bit_over_several_steps(
        w0 in finite_vec(64),
        grads in prop::collection::vec(finite_vec(64), 1..5),
        cfg in sgd_configs(),
        scale_pow in 0i32..16,
    ) {
        // Power-of-two scale: g / scale and g * (1 / scale) are the same f32.
        let scale = 2f32.powi(scale_pow);
        let s = Scalars { loss_scale: scale, ..Scalars::default() };
        let (mut w, mut nw) = (w0.clone(), w0.clone());
        let (mut m, mut nm) = (vec![0f32; w.len()], vec![0f32; w.len()]);
        let mut a = vec![f16::ZERO; w.len()];
        for g in &grads {
            // The stored gradient is scaled, as after the loss seed.
            let gs: Vec<f32> = g.iter().map(|&x| x * scale).collect();
            let out = sgd(&mut w, Some(&mut m), &gs, &mut a, &s, &cfg).unwrap();
            prop_assert_eq!(out, StepOutcome::Applied);
            naive_sgd(&mut nw, &mut nm, &gs, scale, &cfg);
        }
        for i in 0..w.len() {
            prop_assert_eq!(w[i].to_bits(), nw[i].to_bits(), "w[{}]", i);
            prop_assert_eq!(m[i].to_bits(), nm[i].to_bits(), "m[{}]", i);
            prop_assert_eq!(a[i].to_bits(), f32_to_f16(w[i]).to_bits(), "A is f16(W)");
        }
    }

    #[test]
    fn one_sgd_step_is_accurate_against_f64(
        w0 in finite_vec(64),
        m0 in finite_vec(64),
        g in finite_vec(64),
        cfg in sgd_configs(),
        scale in prop_oneof![Just(1.0f32), Just(8192.0f32), 1.0f32..65536.0],
    ) {
        let s = Scalars { loss_scale: scale, ..Scalars::default() };
        let (mut w, mut m) = (w0.clone(), m0.clone());
        let mut a = vec![f16::ZERO; w.len()];
        sgd(&mut w, Some(&mut m), &g, &mut a, &s, &cfg).unwrap();
        let to64 = |v: &[f32]| v.iter().map(|&x| f64::from(x)).collect::<Vec<f64>>();
        let (mut nw, mut nm) = (to64(&w0), to64(&m0));
        naive_sgd(&mut nw, &mut nm, &to64(&g), f64::from(scale), &cfg);
        let (lr, mu, wd) = (f64::from(cfg.lr), f64::from(cfg.momentum), f64::from(cfg.weight_decay));
        for i in 0..w.len() {
            // Each f32 operation errs by at most half an ulp of its own result; bound the sum
            // by the magnitudes of the terms (cancellation makes the result small, not them).
            let d_mag = (f64::from(g[i]) / f64::from(scale)).abs() + wd * f64::from(w0[i]).abs();
            let m_mag = mu * f64::from(m0[i]).abs() + d_mag;
            let step_mag = lr * (d_mag + m_mag * (1.0 + mu));
            let eps = f64::from(f32::EPSILON);
            let tol_m = 4.0 * eps * m_mag + 1e-38;
            let tol_w = 8.0 * eps * (f64::from(w0[i]).abs() + step_mag) + 1e-38;
            prop_assert!((f64::from(m[i]) - nm[i]).abs() <= tol_m, "m[{}] = {} vs {}", i, m[i], nm[i]);
            prop_assert!((f64::from(w[i]) - nw[i]).abs() <= tol_w, "w[{}] = {} vs {}", i, w[i], nw[i]);
        }
    }
}

#[test]
fn sgd_is_bit_exact_with_the_documented_operation_order() {
    let cfg = SgdConfig::new(0.1)
        .with_momentum(0.9)
        .with_weight_decay(5e-4)
        .with_nesterov(true);
    let s = Scalars {
        loss_scale: 3.0, // not a power of two: the twin multiplies by the rounded 1/3
        ..Scalars::default()
    };
    let mut w = vec![0.7f32, -1.3, 1e-3];
    let mut m = vec![0.01f32, 0.0, -2.0];
    let g = vec![0.3f32, 5.0, -7.0];
    let mut a = vec![f16::ZERO; 3];
    let (w0, m0) = (w.clone(), m.clone());
    sgd(&mut w, Some(&mut m), &g, &mut a, &s, &cfg).unwrap();
    let inv = 1.0f32 / 3.0;
    for i in 0..3 {
        let gi = g[i] * inv;
        let gi = gi + 5e-4f32 * w0[i];
        let mi = 0.9f32 * m0[i] + gi;
        let d = gi + 0.9f32 * mi;
        assert_eq!(m[i].to_bits(), mi.to_bits());
        assert_eq!(w[i].to_bits(), (w0[i] - 0.1f32 * d).to_bits());
    }
}

#[test]
fn sgd_skips_entirely_when_the_flag_is_set() {
    let cfg = SgdConfig::new(0.1).with_momentum(0.9);
    let s = Scalars {
        overflow: 1,
        ..Scalars::default()
    };
    let mut w = vec![1.0f32, 2.0];
    let mut m = vec![0.5f32, -0.5];
    let mut a = vec![f16::from_f32(1.0), f16::from_f32(2.0)];
    let g = vec![f32::NAN, f32::INFINITY];
    let before = (w.clone(), m.clone(), a.clone());
    let out = sgd(&mut w, Some(&mut m), &g, &mut a, &s, &cfg).unwrap();
    assert_eq!(out, StepOutcome::Skipped);
    assert_eq!((w, m, a), before);
}

#[test]
fn sgd_without_momentum_needs_no_buffer_and_bad_configs_are_rejected() {
    let s = Scalars::default();
    let mut w = vec![1.0f32; 4];
    let mut a = vec![f16::ZERO; 4];
    let g = vec![8192.0f32; 4];
    sgd(&mut w, None, &g, &mut a, &s, &SgdConfig::new(0.5)).unwrap();
    assert_eq!(w, [0.5; 4], "g / 8192 = 1, w = 1 - 0.5");
    assert!(a.iter().all(|h| h.to_f32() == 0.5));

    let with_m = SgdConfig::new(0.5).with_momentum(0.9);
    assert!(matches!(
        sgd(&mut w, None, &g, &mut a, &s, &with_m),
        Err(RangeOpError::InvalidConfig { field: "m", .. })
    ));
    let bad = [
        (SgdConfig::new(f32::NAN), "lr"),
        (SgdConfig::new(-0.1), "lr"),
        (SgdConfig::new(0.1).with_momentum(1.0), "momentum"),
        (SgdConfig::new(0.1).with_weight_decay(-1.0), "weight_decay"),
        (SgdConfig::new(0.1).with_nesterov(true), "momentum"),
    ];
    let mut m = vec![0f32; 4];
    for (cfg, field) in bad {
        let err = sgd(&mut w, Some(&mut m), &g, &mut a, &s, &cfg).unwrap_err();
        assert!(
            matches!(err, RangeOpError::InvalidConfig { field: f, .. } if f == field),
            "{cfg:?}: {err:?}"
        );
    }
    let cfg = SgdConfig::new(0.1);
    assert!(matches!(
        sgd(&mut w, Some(&mut m), &g[..3], &mut a, &s, &cfg),
        Err(RangeOpError::LengthMismatch { what: "g", .. })
    ));
    assert!(matches!(
        sgd(&mut w, Some(&mut m[..2]), &g, &mut a, &s, &cfg),
        Err(RangeOpError::LengthMismatch { what: "m", .. })
    ));
}

// ---------------------------------------------------------------- EMA

proptest! {
    #![proptest_config(small_config())]

    #[test]
    fn ema_matches_its_naive_definition(
        e0 in finite_vec(48),
        w in finite_vec(48),
        decay in prop_oneof![Just(0.0f32), Just(0.999f32), Just(1.0f32), 0.0f32..1.0],
    ) {
        let mut e = e0.clone();
        let mut e16 = vec![f16::ZERO; e.len()];
        let s = Scalars::default();
        prop_assert_eq!(ema_update(&mut e, &mut e16, &w, &s, decay).unwrap(), StepOutcome::Applied);
        let d = f64::from(decay);
        for i in 0..e.len() {
            let naive = d * f64::from(e0[i]) + (1.0 - d) * f64::from(w[i]);
            let mag = f64::from(e0[i]).abs() + f64::from(w[i]).abs();
            prop_assert!((f64::from(e[i]) - naive).abs() <= 1e-6 * mag + 1e-30,
                "e[{}] = {} vs {}", i, e[i], naive);
            prop_assert_eq!(e16[i].to_bits(), f32_to_f16(e[i]).to_bits());
        }
        if decay == 1.0 {
            prop_assert_eq!(&e, &e0);
        }
        if decay == 0.0 {
            prop_assert_eq!(&e, &w);
        }
    }
}

#[test]
fn ema_skips_on_the_flag_and_rejects_bad_decay() {
    let s = Scalars {
        overflow: 1,
        ..Scalars::default()
    };
    let mut e = vec![1.0f32, 2.0];
    let mut e16 = vec![f16::from_f32(1.0), f16::from_f32(2.0)];
    let before = (e.clone(), e16.clone());
    let out = ema_update(&mut e, &mut e16, &[5.0, 6.0], &s, 0.9).unwrap();
    assert_eq!(out, StepOutcome::Skipped);
    assert_eq!((e.clone(), e16.clone()), before);
    let s = Scalars::default();
    for bad in [-0.1, 1.1, f32::NAN] {
        assert!(matches!(
            ema_update(&mut e, &mut e16, &[5.0, 6.0], &s, bad),
            Err(RangeOpError::InvalidConfig { field: "decay", .. })
        ));
    }
    assert!(ema_update(&mut e, &mut e16[..1], &[5.0, 6.0], &s, 0.5).is_err());
}

// ---------------------------------------------------------------- loss seed

/// One FP16 ulp at the magnitude of `x` (subnormal spacing below 2^-14).
fn f16_ulp(x: f64) -> f64 {
    let a = x.abs().max(2f64.powi(-14));
    2f64.powi(a.log2().floor() as i32 - 10)
}

proptest! {
    #![proptest_config(small_config())]

    #[test]
    fn softmax_xent_backward_matches_the_naive_definition(
        batch in 1usize..6,
        classes in 1usize..40,
        seed in any::<u64>(),
        scale_pow in 0i32..16,
    ) {
        // Logits in a modest range, FP16 like the FC output; some labels out of range.
        let mut state = seed | 1;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let logits: Vec<f16> = (0..batch * classes)
            .map(|_| f16::from_f32(((next() % 2001) as f32 - 1000.0) / 100.0))
            .collect();
        let labels: Vec<i32> = (0..batch)
            .map(|_| match next() % 8 {
                0 => -100,
                1 => classes as i32,
                _ => (next() % classes as u64) as i32,
            })
            .collect();
        let s = Scalars { loss_scale: 2f32.powi(scale_pow), ..Scalars::default() };
        let mut d = vec![f16::ONE; batch * classes];
        let mut loss = vec![f32::NAN; batch];
        softmax_xent_backward(&logits, &labels, classes, &s, &mut d, Some(&mut loss)).unwrap();

        let coef = f64::from(s.loss_scale) / batch as f64;
        for r in 0..batch {
            let x: Vec<f64> = logits[r * classes..(r + 1) * classes]
                .iter()
                .map(|h| f64::from(h.to_f32()))
                .collect();
            let row = &d[r * classes..(r + 1) * classes];
            let label = labels[r];
            if label < 0 || label as usize >= classes {
                prop_assert!(row.iter().all(|h| h.to_bits() == 0), "ignored row is zero");
                prop_assert_eq!(loss[r], 0.0);
                continue;
            }
            let m = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = x.iter().map(|v| (v - m).exp()).sum();
            for j in 0..classes {
                let y = if j == label as usize { 1.0 } else { 0.0 };
                let naive = coef * ((x[j] - m).exp() / sum - y);
                let got = f64::from(row[j].to_f32());
                // One FP16 ulp of rounding, plus f32's absolute error in `p - y`: next to
                // y = 1 the difference cancels, so its error is ulps of 1, not of the result.
                let tol = f16_ulp(naive) + coef * 4.0 * f64::from(f32::EPSILON);
                prop_assert!((got - naive).abs() <= tol,
                    "row {} class {}: {} vs {}", r, j, got, naive);
            }
            let naive_loss = sum.ln() - (x[label as usize] - m);
            prop_assert!((f64::from(loss[r]) - naive_loss).abs() <= 1e-5 * (1.0 + naive_loss.abs()));
        }
    }
}

#[test]
fn softmax_seed_is_scaled_and_checks_its_arguments() {
    // Two classes, equal logits: p = 0.5 each; scale 8192, batch 2: coef 4096.
    let logits = vec![f16::ZERO; 4];
    let s = Scalars::default();
    let mut d = vec![f16::ZERO; 4];
    softmax_xent_backward(&logits, &[0, 1], 2, &s, &mut d, None).unwrap();
    let got: Vec<f32> = d.iter().map(|h| h.to_f32()).collect();
    assert_eq!(got, [-2048.0, 2048.0, 2048.0, -2048.0]);

    assert!(matches!(
        softmax_xent_backward(&logits, &[0, 1], 0, &s, &mut d, None),
        Err(RangeOpError::InvalidConfig {
            field: "classes",
            ..
        })
    ));
    assert!(matches!(
        softmax_xent_backward(&logits[..3], &[0, 1], 2, &s, &mut d, None),
        Err(RangeOpError::LengthMismatch { what: "logits", .. })
    ));
    assert!(matches!(
        softmax_xent_backward(&logits, &[0, 1], 2, &s, &mut d, Some(&mut [0.0])),
        Err(RangeOpError::LengthMismatch { what: "loss", .. })
    ));
}

// ---------------------------------------------------------------- a whole step over a plan

/// Host copies of the regions, indexed like device memory.
struct HostRegions {
    w: Vec<f32>,
    a: Vec<f16>,
    g: Vec<f32>,
    g16: Vec<f16>,
    m: Vec<f32>,
    e: Vec<f32>,
    e16: Vec<f16>,
}

fn elems(r: ByteRange, dtype: DataType) -> std::ops::Range<usize> {
    r.elem_range(dtype)
}

#[test]
fn one_training_step_over_a_plan() {
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
