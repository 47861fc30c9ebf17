//! Tier 1: the CPU twins of the network-head kernels (`crates/4-netops/kernels/net_head.cu`) against
//! naive definitions: written as plain index formulas (one output at a time, in the order the
//! kernels use), they must agree bit for bit; against an f64 evaluation of the math they must
//! agree to the rounding of the stored type. Plus the argmax tie rule, the metrics log and the
//! typed errors.

use cudnn_cbr_amp::RangeOpError;
use cudnn_cbr_netops::head::{
    add_f16, argmax_last, fc_backward, fc_forward, gap_backward, gap_forward, head_metrics,
    metrics_log_append, metrics_log_bytes, metrics_log_capacity, metrics_log_read, HeadMetrics,
    HeadShape,
};
use half::f16;

mod common;
use common::Rng;

fn bits32(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn bits16(v: &[f16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Shapes: the main job's head (batch 32, 8×8 pixels, 32 features, 8 classes), odd sizes,
/// and single elements.
const SHAPES: [HeadShape; 4] = [
    HeadShape::new(32, 64, 32, 8),
    HeadShape::new(3, 7, 5, 11),
    HeadShape::new(1, 1, 1, 1),
    HeadShape::new(16, 16, 64, 16),
];

/// One FP16 ulp at |x| (the spacing of FP16 values there; subnormal spacing below 2^-14).
fn ulp16(x: f64) -> f64 {
    let x = x.abs().max(6.103_515_625e-5);
    2f64.powi(x.log2().floor() as i32 - 10)
}

#[test]
fn gap_forward_is_the_mean_over_pixels_in_pixel_order() {
    let mut rng = Rng(1);
    for s in SHAPES {
        let a = rng.f16s(s.activation_elems(), 4.0);
        let mut pooled = vec![f32::NAN; s.pooled_elems()];
        gap_forward(&s, &a, &mut pooled).unwrap();
        for r in 0..s.batch {
            for c in 0..s.features {
                // Naive, the kernel's order: p ascending from +0.0, then one division.
                let mut sum = 0.0f32;
                let mut exact = 0.0f64;
                for p in 0..s.pixels {
                    let v = a[(r * s.pixels + p) * s.features + c].to_f32();
                    sum += v;
                    exact += f64::from(v);
                }
                let got = pooled[r * s.features + c];
                assert_eq!(got.to_bits(), (sum / s.pixels as f32).to_bits(), "{s:?}");
                let exact = exact / s.pixels as f64;
                assert!(
                    (f64::from(got) - exact).abs() <= 1e-6 * (1.0 + exact.abs()) * s.pixels as f64,
                    "{s:?} r{r} c{c}: {got} vs {exact}"
                );
            }
        }
    }
}

#[test]
fn gap_backward_spreads_the_gradient_evenly() {
    let mut rng = Rng(2);
    for s in SHAPES {
        let g = rng.f32s(s.pooled_elems(), 1000.0);
        let mut da = vec![f16::NAN; s.activation_elems()];
        gap_backward(&s, &g, &mut da).unwrap();
        for r in 0..s.batch {
            for p in 0..s.pixels {
                for c in 0..s.features {
                    let want = f16::from_f32(g[r * s.features + c] / s.pixels as f32);
                    let got = da[(r * s.pixels + p) * s.features + c];
                    assert_eq!(got.to_bits(), want.to_bits(), "{s:?} r{r} p{p} c{c}");
                }
            }
        }
    }
}

#[test]
fn gap_backward_is_the_adjoint_of_gap_forward() {
    // <gap(a), g> == <a, gap'(g)> up to rounding: the pair is a consistent forward/backward.
    let mut rng = Rng(3);
    let s = HeadShape::new(4, 9, 6, 3);
    let a = rng.f16s(s.activation_elems(), 1.0);
    let g = rng.f32s(s.pooled_elems(), 1.0);
    let mut pooled = vec![0.0; s.pooled_elems()];
    let mut da = vec![f16::ZERO; s.activation_elems()];
    gap_forward(&s, &a, &mut pooled).unwrap();
    gap_backward(&s, &g, &mut da).unwrap();
    let lhs: f64 = pooled
        .iter()
        .zip(&g)
        .map(|(x, y)| f64::from(*x) * f64::from(*y))
        .sum();
    let rhs: f64 = a
        .iter()
        .zip(&da)
        .map(|(x, y)| f64::from(x.to_f32()) * f64::from(y.to_f32()))
        .sum();
    assert!(
        (lhs - rhs).abs() < 1e-3 * (1.0 + lhs.abs()),
        "{lhs} vs {rhs}"
    );
}

#[test]
fn fc_forward_is_the_dot_in_feature_order_plus_bias_rounded_once() {
    let mut rng = Rng(4);
    for s in SHAPES {
        let x = rng.f32s(s.pooled_elems(), 2.0);
        let w = rng.f32s(s.weight_elems(), 0.5);
        let b = rng.f32s(s.classes, 0.5);
        let mut logits = vec![f16::NAN; s.logits_elems()];
        fc_forward(&s, &x, &w, &b, &mut logits).unwrap();
        for r in 0..s.batch {
            for k in 0..s.classes {
                let mut dot = 0.0f32;
                let mut exact = 0.0f64;
                for j in 0..s.features {
                    dot += w[k * s.features + j] * x[r * s.features + j];
                    exact += f64::from(w[k * s.features + j]) * f64::from(x[r * s.features + j]);
                }
                exact += f64::from(b[k]);
                let got = logits[r * s.classes + k];
                assert_eq!(got.to_bits(), f16::from_f32(dot + b[k]).to_bits(), "{s:?}");
                let err = (f64::from(got.to_f32()) - exact).abs();
                assert!(
                    err <= ulp16(exact) + 1e-5,
                    "{s:?} r{r} k{k}: {got} vs {exact}"
                );
            }
        }
    }
}

#[test]
fn fc_backward_matches_per_output_sums_and_the_f64_gradient() {
    let mut rng = Rng(5);
    for s in SHAPES {
        let g = rng.f16s(s.logits_elems(), 300.0);
        let x = rng.f32s(s.pooled_elems(), 2.0);
        let w = rng.f32s(s.weight_elems(), 0.5);
        let (mut dw, mut db, mut dx) = (
            vec![f32::NAN; s.weight_elems()],
            vec![f32::NAN; s.classes],
            vec![f32::NAN; s.pooled_elems()],
        );
        fc_backward(&s, &g, &x, &w, &mut dw, &mut db, &mut dx).unwrap();
        let (f, c) = (s.features, s.classes);
        let gv = |r: usize, k: usize| g[r * c + k].to_f32();
        for k in 0..c {
            // Naive: one output at a time, each sum ascending from +0.0 (the kernel's threads).
            let mut want = 0.0f32;
            let mut exact = 0.0f64;
            for r in 0..s.batch {
                want += gv(r, k);
                exact += f64::from(gv(r, k));
            }
            assert_eq!(db[k].to_bits(), want.to_bits(), "{s:?} db[{k}]");
            assert!((f64::from(db[k]) - exact).abs() <= 1e-5 * (1.0 + exact.abs()) * 300.0);
            for j in 0..f {
                let mut want = 0.0f32;
                let mut exact = 0.0f64;
                for r in 0..s.batch {
                    want += gv(r, k) * x[r * f + j];
                    exact += f64::from(gv(r, k)) * f64::from(x[r * f + j]);
                }
                assert_eq!(dw[k * f + j].to_bits(), want.to_bits(), "{s:?} dw[{k},{j}]");
                assert!(
                    (f64::from(dw[k * f + j]) - exact).abs() <= 1e-5 * (1.0 + exact.abs()) * 300.0
                );
            }
        }
        for r in 0..s.batch {
            for j in 0..f {
                let mut want = 0.0f32;
                for k in 0..c {
                    want += gv(r, k) * w[k * f + j];
                }
                assert_eq!(dx[r * f + j].to_bits(), want.to_bits(), "{s:?} dx[{r},{j}]");
            }
        }
    }
}

#[test]
fn fc_backward_is_the_gradient_of_fc_forward() {
    // L = Σ g ⊙ (W·x + b) is linear, so its derivatives are exactly dW, db, dx: check them by
    // central differences in f64 of the unrounded forward.
    let mut rng = Rng(6);
    let s = HeadShape::new(3, 1, 4, 5);
    let g = rng.f16s(s.logits_elems(), 1.0);
    let x = rng.f32s(s.pooled_elems(), 1.0);
    let w = rng.f32s(s.weight_elems(), 1.0);
    let b = rng.f32s(s.classes, 1.0);
    let loss = |x: &[f64], w: &[f64], b: &[f64]| -> f64 {
        let mut l = 0.0;
        for r in 0..s.batch {
            for k in 0..s.classes {
                let z: f64 = (0..s.features)
                    .map(|j| w[k * s.features + j] * x[r * s.features + j])
                    .sum::<f64>()
                    + b[k];
                l += f64::from(g[r * s.classes + k].to_f32()) * z;
            }
        }
        l
    };
    let wide = |v: &[f32]| v.iter().map(|&t| f64::from(t)).collect::<Vec<f64>>();
    let (x64, w64, b64) = (wide(&x), wide(&w), wide(&b));
    let (mut dw, mut db, mut dx) = (
        vec![0.0; s.weight_elems()],
        vec![0.0; s.classes],
        vec![0.0; s.pooled_elems()],
    );
    fc_backward(&s, &g, &x, &w, &mut dw, &mut db, &mut dx).unwrap();
    let h = 1e-3;
    let fd = |which: usize, i: usize| {
        let (mut xp, mut wp, mut bp) = (x64.clone(), w64.clone(), b64.clone());
        let (mut xm, mut wm, mut bm) = (x64.clone(), w64.clone(), b64.clone());
        match which {
            0 => {
                xp[i] += h;
                xm[i] -= h;
            }
            1 => {
                wp[i] += h;
                wm[i] -= h;
            }
            _ => {
                bp[i] += h;
                bm[i] -= h;
            }
        }
        (loss(&xp, &wp, &bp) - loss(&xm, &wm, &bm)) / (2.0 * h)
    };
    for (i, v) in dx.iter().enumerate() {
        assert!((f64::from(*v) - fd(0, i)).abs() < 1e-5, "dx[{i}]");
    }
    for (i, v) in dw.iter().enumerate() {
        assert!((f64::from(*v) - fd(1, i)).abs() < 1e-5, "dw[{i}]");
    }
    for (i, v) in db.iter().enumerate() {
        assert!((f64::from(*v) - fd(2, i)).abs() < 1e-5, "db[{i}]");
    }
}

#[test]
fn add_f16_rounds_the_f32_sum_once() {
    let mut rng = Rng(7);
    let a = rng.f16s(1031, 60000.0);
    let b = rng.f16s(1031, 60000.0);
    let mut out = vec![f16::NAN; a.len()];
    add_f16(&a, &b, &mut out).unwrap();
    for i in 0..a.len() {
        let want = f16::from_f32(a[i].to_f32() + b[i].to_f32());
        assert_eq!(out[i].to_bits(), want.to_bits(), "{i}");
    }
    // Overflow goes to Inf, NaN comes out canonical.
    let mut o = [f16::ZERO; 2];
    add_f16(
        &[f16::MAX, f16::from_bits(0x7e01)],
        &[f16::MAX, f16::ONE],
        &mut o,
    )
    .unwrap();
    assert_eq!(bits16(&o), vec![f16::INFINITY.to_bits(), 0x7fff]);
}

#[test]
fn argmax_takes_the_last_maximum_in_total_order() {
    let h = |v: &[f32]| v.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>();
    assert_eq!(argmax_last(&h(&[1.0, 3.0, 2.0])), Some(1));
    assert_eq!(argmax_last(&h(&[3.0, 1.0, 3.0])), Some(2), "ties: the last");
    assert_eq!(argmax_last(&h(&[-0.0, 0.0, -0.0])), Some(1), "+0 > -0");
    assert_eq!(
        argmax_last(&h(&[f32::NAN, 1.0])),
        Some(0),
        "NaN is the largest"
    );
    assert_eq!(argmax_last(&h(&[-5.0])), Some(0));
    assert_eq!(argmax_last(&[]), None);
}

#[test]
fn head_metrics_counts_correct_rows_and_averages_the_loss() {
    let h = |v: &[f32]| v.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>();
    // Rows' argmax: 1, 0, 2 (tie 0/2 → 2), 1.
    let logits = h(&[0.0, 5.0, 1.0, 9.0, 0.0, 1.0, 4.0, 0.0, 4.0, 1.0, 2.0, 0.0]);
    let labels = [1, 0, 0, -100];
    let loss = [0.5f32, 1.0, 2.0, 0.25];
    let m = head_metrics(&logits, &labels, Some(&loss), 3).unwrap();
    assert_eq!(m.accuracy, 2.0 / 4.0);
    assert_eq!(
        m.loss.to_bits(),
        ((((0.5f32 + 1.0) + 2.0) + 0.25) / 4.0).to_bits()
    );
    let m = head_metrics(&logits, &labels, None, 3).unwrap();
    assert_eq!(m.loss, 0.0);
    assert!(matches!(
        head_metrics(&logits, &labels, None, 0),
        Err(RangeOpError::InvalidConfig {
            field: "classes",
            ..
        })
    ));
    assert!(matches!(
        head_metrics(&logits[1..], &labels, None, 3),
        Err(RangeOpError::LengthMismatch { what: "logits", .. })
    ));
}

#[test]
fn the_metrics_log_appends_in_a_ring_and_reads_oldest_first() {
    assert_eq!(metrics_log_bytes(3), 16 + 24);
    assert_eq!(metrics_log_capacity(metrics_log_bytes(3)), 3);
    assert_eq!(metrics_log_capacity(10), 0);
    let mut log = vec![0u8; metrics_log_bytes(3)];
    assert_eq!(metrics_log_read(&log).unwrap().entries, vec![]);
    let m = |i: u32| HeadMetrics {
        loss: i as f32,
        accuracy: 1.0 / (i + 1) as f32,
    };
    for i in 0..2 {
        metrics_log_append(&mut log, m(i)).unwrap();
    }
    let read = metrics_log_read(&log).unwrap();
    assert_eq!((read.count, read.entries.clone()), (2, vec![m(0), m(1)]));
    for i in 2..5 {
        metrics_log_append(&mut log, m(i)).unwrap();
    }
    let read = metrics_log_read(&log).unwrap();
    assert_eq!(read.count, 5);
    assert_eq!(read.entries, vec![m(2), m(3), m(4)]);
    // The byte layout the kernel writes: count, 12 reserved zero bytes, entries.
    assert_eq!(&log[..4], &5u32.to_le_bytes());
    assert!(log[4..16].iter().all(|&b| b == 0));
    // The last append (the fifth, count 4 before it) went to entry 4 % 3 = 1.
    assert_eq!(&log[16 + 8..16 + 12], &4.0f32.to_le_bytes());
    assert!(matches!(
        metrics_log_append(&mut [0u8; 20], m(0)),
        Err(RangeOpError::LengthMismatch { .. })
    ));
}

#[test]
fn shapes_and_lengths_are_checked() {
    let s = HeadShape::new(2, 4, 3, 5);
    let bad = HeadShape::new(2, 0, 3, 5);
    let mut pooled = vec![0.0; s.pooled_elems()];
    let a = vec![f16::ZERO; s.activation_elems()];
    assert!(matches!(
        gap_forward(&bad, &a, &mut pooled),
        Err(RangeOpError::InvalidConfig {
            field: "pixels",
            ..
        })
    ));
    assert!(matches!(
        gap_forward(&s, &a[1..], &mut pooled),
        Err(RangeOpError::LengthMismatch { what: "a", .. })
    ));
    let mut logits = vec![f16::ZERO; s.logits_elems()];
    assert!(matches!(
        fc_forward(&s, &pooled, &[0.0; 14], &[0.0; 5], &mut logits),
        Err(RangeOpError::LengthMismatch { what: "w", .. })
    ));
    let mut da = vec![f16::ZERO; 3];
    assert!(matches!(
        gap_backward(&s, &pooled, &mut da),
        Err(RangeOpError::LengthMismatch { what: "da", .. })
    ));
    assert!(matches!(
        add_f16(&[f16::ZERO; 2], &[f16::ZERO; 3], &mut [f16::ZERO; 2]),
        Err(RangeOpError::LengthMismatch { what: "b", .. })
    ));
    let huge = HeadShape::new(usize::MAX / 2, 4, 4, 4);
    assert!(matches!(
        huge.validate("x"),
        Err(RangeOpError::InvalidConfig { field: "shape", .. })
    ));
    // bits helpers are used so that a failing comparison prints bit patterns.
    assert_eq!(bits32(&[1.0]), vec![0x3f80_0000]);
}
