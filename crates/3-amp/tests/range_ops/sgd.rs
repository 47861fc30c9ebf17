//! SGD.

use super::*;

/// PyTorch's SGD as documented (torch.optim.SGD, dampening 0), on the unscaled gradient
/// `g / scale`, generic over the float type so it runs in f32 (bit-exact contract) and in
/// f64 (accuracy).
pub(super) fn naive_sgd<T>(w: &mut [T], m: &mut [T], g: &[T], scale: T, c: &SgdConfig)
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

pub(super) fn sgd_configs() -> impl Strategy<Value = SgdConfig> {
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
pub(super) fn sgd_is_bit_exact_with_the_documented_operation_order() {
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
pub(super) fn sgd_skips_entirely_when_the_flag_is_set() {
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
pub(super) fn sgd_without_momentum_needs_no_buffer_and_bad_configs_are_rejected() {
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
