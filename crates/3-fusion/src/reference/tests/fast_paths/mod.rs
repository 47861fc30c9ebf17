//! The CPU executor's fast paths against the straightforward implementations they replaced,
//! kept here as the oracle: FP16 results must be identical bit for bit (the same values are
//! rounded at the same points, and every sum runs in the same order), on shapes that cross the
//! blocking and threading thresholds and on data with zeros of both signs, subnormals,
//! infinities and NaNs (compared as "a NaN": see [`bits`]).

use half::f16;
use rayon::prelude::*;

use super::util::Rng;
use crate::reference::bn::{bn_recompute, BnBwdCoefficients};
use crate::reference::conv::{dgrad_acc, dgrad_all_taps, dgrad_phases, fprop_acc, wgrad_acc};
use crate::reference::element::private::Gemm;
use crate::reference::element::{Mat, Real};
use crate::reference::{
    add, add_into, bn_apply, bn_apply_into, bn_bwd, bn_fwd_train, conv_dgrad, conv_dgrad_into,
    conv_dgrad_with, conv_wgrad, dbn_apply, dbn_apply_into, dgrad_drelu_dbn, dgrad_drelu_dbn_with,
    fprop_genstats, fprop_genstats_with, genstats, relu_bwd, relu_bwd_into, relu_fwd,
    wgrad_with_prologue, wgrad_with_prologue_with, Activation, BnParams, ConvInput, ConvParams,
    ConvScratch, Element, Nhwc, ReluJoin, Residual, RunningStats, SavedBn,
};

mod replaced;
use replaced::*;

/// FP16 data in [-2, 2) with every 17th value special (±0, a subnormal, ±inf, NaN).
fn data(rng: &mut Rng, len: usize) -> Vec<f16> {
    let specials = [
        f16::ZERO,
        f16::NEG_ZERO,
        f16::from_bits(0x0003),
        f16::INFINITY,
        f16::NEG_INFINITY,
        f16::NAN,
    ];
    (0..len)
        .map(|i| {
            if i % 17 == 5 {
                specials[(rng.next_u64() % 6) as usize]
            } else {
                f16::from_f64(rng.uniform(-2.0, 2.0))
            }
        })
        .collect()
}

/// Finite FP16 data (the convolutions' operands: the GEMM's handling of non-finite values is
/// its own business).
fn finite(rng: &mut Rng, len: usize) -> Vec<f16> {
    rng.halfs(len, -2.0, 2.0)
}

/// The bits of each value, every NaN as one canonical NaN: Rust leaves the sign and payload
/// of a NaN result unspecified (the compiler may swap the operands of an addition, and which
/// NaN propagates with them), so only "a NaN" is comparable.
fn bits(v: &[f16]) -> Vec<u16> {
    v.iter()
        .map(|x| if x.is_nan() { 0x7E00 } else { x.to_bits() })
        .collect()
}

/// [`bits`] for FP32.
fn bits32(v: &[f32]) -> Vec<u32> {
    v.iter()
        .map(|x| if x.is_nan() { 0x7FC0_0000 } else { x.to_bits() })
        .collect()
}

/// Shapes on both sides of the block (1024 elements) and task (16K elements) sizes, with
/// channel counts that do and do not divide them.
fn shapes() -> Vec<Nhwc> {
    vec![
        Nhwc::new(1, 1, 1, 1),
        Nhwc::new(2, 3, 5, 3),
        Nhwc::new(2, 7, 9, 17),
        Nhwc::new(8, 16, 16, 16),
        Nhwc::new(3, 11, 13, 32),
        Nhwc::new(4, 10, 10, 1000),
    ]
}

#[test]
fn element_wise_ops_match_the_per_element_maps_bit_for_bit() {
    let mut rng = Rng::new(0xB10C);
    for shape in shapes() {
        let (len, c) = (shape.elems(), shape.c);
        let (y, r, dz) = (
            data(&mut rng, len),
            data(&mut rng, len),
            data(&mut rng, len),
        );
        let (s, b, s2, b2) = (
            data(&mut rng, c),
            data(&mut rng, c),
            data(&mut rng, c),
            data(&mut rng, c),
        );
        for act in [Activation::Relu, Activation::Identity] {
            let residuals = [
                Residual::None,
                Residual::Add(&r),
                Residual::ScaleBias {
                    r: &r,
                    scale: &s2,
                    bias: &b2,
                },
            ];
            for residual in residuals {
                let got = bn_apply(&shape, &y, &s, &b, residual, act).unwrap();
                let want = old_bn_apply(&y, &s, &b, residual, act);
                assert_eq!(bits(&got), bits(&want), "bn_apply {shape:?} {act:?}");
            }
        }
        let want = old_map(len, c, |i, _| f16::from_acc(y[i].to_acc().relu()));
        assert_eq!(
            bits(&relu_fwd(&shape, &y).unwrap()),
            bits(&want),
            "relu_fwd"
        );
        let want = old_map(len, c, |i, _| {
            if y[i].to_acc() > 0.0 {
                dz[i]
            } else {
                f16::ZERO
            }
        });
        assert_eq!(
            bits(&relu_bwd(&shape, &dz, &y).unwrap()),
            bits(&want),
            "relu_bwd"
        );
        let want = old_map(len, c, |i, _| f16::from_acc(y[i].to_acc() + r[i].to_acc()));
        assert_eq!(bits(&add(&shape, &y, &r).unwrap()), bits(&want), "add");
        let (a, bb, cc) = (
            rng.floats(c, -2.0, 2.0),
            rng.floats(c, -2.0, 2.0),
            rng.floats(c, -2.0, 2.0),
        );
        let got = dbn_apply(&shape, &dz, &y, &a, &bb, &cc).unwrap();
        let want = old_dbn_apply(&dz, &y, &a, &bb, &cc);
        assert_eq!(bits(&got), bits(&want), "dbn_apply {shape:?}");
    }
}

#[test]
fn channel_sums_and_bn_ops_match_the_per_row_sums_bit_for_bit() {
    let mut rng = Rng::new(0x5u64);
    for shape in shapes() {
        let (len, c) = (shape.elems(), shape.c);
        // Finite statistics inputs (a NaN would make every comparison below vacuous).
        let (y, dz) = (finite(&mut rng, len), finite(&mut rng, len));
        let stats = genstats(&shape, &y).unwrap();
        let (sum, sqsum) = old_genstats(&shape, &y);
        assert_eq!(bits32(&stats.sum), bits32(&sum), "genstats sum {shape:?}");
        assert_eq!(
            bits32(&stats.sqsum),
            bits32(&sqsum),
            "genstats sqsum {shape:?}"
        );

        let mean = rng.floats(c, -0.5, 0.5);
        let inv_std = rng.floats(c, 0.5, 2.0);
        let gamma = rng.floats(c, 0.5, 1.5);
        let beta = rng.floats(c, -0.5, 0.5);
        let co = BnBwdCoefficients::compute(&shape, &y, &dz, &mean, &inv_std, &gamma);
        let want = old_coefficients(&shape, &y, &dz, &mean, &inv_std, &gamma);
        for (what, got, want) in [
            ("dgamma", &co.dgamma, &want[0]),
            ("dbeta", &co.dbeta, &want[1]),
            ("a", &co.a, &want[2]),
            ("b", &co.b, &want[3]),
            ("c", &co.c, &want[4]),
        ] {
            assert_eq!(bits32(got), bits32(want), "{what} {shape:?}");
        }
        let back = bn_bwd(&shape, &y, &dz, &mean, &inv_std, &gamma).unwrap();
        let want_dx = old_dbn_apply(&dz, &y, &want[2], &want[3], &want[4]);
        assert_eq!(bits(&back.dx), bits(&want_dx), "bn_bwd {shape:?}");

        if shape.pixels() >= 2 {
            let (mut rm, mut rv) = (vec![0f32; c], vec![1f32; c]);
            let params = BnParams {
                epsilon: 1e-5,
                momentum: 0.1,
            };
            let running = RunningStats {
                mean: &mut rm,
                var: &mut rv,
            };
            let fwd = bn_fwd_train(&shape, &y, &gamma, &beta, running, &params).unwrap();
            let (m, s) = (&fwd.saved_mean, &fwd.saved_inv_std);
            let want = old_map(len, c, |i, k| {
                f16::from_acc(bn_recompute(y[i].to_acc(), m[k], s[k], gamma[k], beta[k]))
            });
            assert_eq!(bits(&fwd.out), bits(&want), "bn_fwd_train {shape:?}");
        }
    }
}

/// Conv shapes: the mini network's, strides, dilations, padding wider than the filter's reach,
/// 1×1 and 7×7 filters, and depths past matrixmultiply's 256-deep blocks.
pub(super) fn conv_shapes() -> Vec<ConvParams> {
    vec![
        ConvParams::new(4, 8, 16, 16, 16, 3, 3).with_padding(1, 1),
        ConvParams::new(2, 16, 16, 16, 32, 3, 3)
            .with_padding(1, 1)
            .with_stride(2, 2),
        ConvParams::new(2, 16, 16, 16, 32, 1, 1).with_stride(2, 2),
        ConvParams::new(2, 32, 8, 8, 32, 3, 3).with_padding(1, 1),
        ConvParams::new(2, 3, 19, 17, 5, 7, 7)
            .with_padding(3, 3)
            .with_stride(2, 2),
        ConvParams::new(3, 5, 9, 11, 7, 3, 2)
            .with_padding(2, 0)
            .with_dilation(2, 3),
        ConvParams::new(1, 3, 4, 4, 2, 3, 3).with_padding(4, 4),
    ]
}

#[test]
fn convolutions_match_the_per_tap_gather_bit_for_bit() {
    let mut rng = Rng::new(0xC0);
    for p in conv_shapes() {
        p.validate().unwrap();
        let x = f16::widen_slice(&finite(&mut rng, p.x_elems()));
        let w = f16::widen_slice(&finite(&mut rng, p.w_elems()));
        let dy = f16::widen_slice(&finite(&mut rng, p.y_elems()));
        let got = fprop_acc(&p, &x, &w).unwrap();
        assert_eq!(bits32(&got), bits32(&old_fprop(&p, &x, &w)), "fprop {p:?}");
        let got = dgrad_all_taps(&p, &dy, &w).unwrap();
        assert_eq!(bits32(&got), bits32(&old_dgrad(&p, &dy, &w)), "dgrad {p:?}");
        // wgrad multiplies dwᵀ = colᵀ·dy (the faster orientation) where the old one multiplied
        // dyᵀ·col: the same products, summed in another order, so equal to FP32 rounding.
        let got = wgrad_acc(&p, &x, &dy).unwrap();
        let want = old_wgrad(&p, &x, &dy);
        let scale = want.iter().fold(1.0f32, |m, v| m.max(v.abs()));
        for (i, (g, e)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - e).abs() <= 1e-5 * scale,
                "wgrad {p:?} at {i}: {g} vs {e}"
            );
        }
        assert_eq!(got.len(), want.len(), "wgrad {p:?}");
    }
}

#[test]
fn dgrad_drelu_dbn_matches_the_per_element_map_bit_for_bit() {
    let mut rng = Rng::new(0xD2);
    // Each shape twice: with special values in y_prev (and the joins), and all finite (where
    // the BN-backward sums are not NaN, so their comparison means something).
    for (p, specials) in conv_shapes()
        .into_iter()
        .flat_map(|p| [(p, true), (p, false)])
    {
        let (c, n) = (p.c, p.x_elems());
        let dy = finite(&mut rng, p.y_elems());
        let w = finite(&mut rng, p.w_elems());
        let y_prev = if specials {
            data(&mut rng, n)
        } else {
            finite(&mut rng, n)
        };
        let (resid, branch) = if specials {
            (data(&mut rng, n), data(&mut rng, n))
        } else {
            (finite(&mut rng, n), finite(&mut rng, n))
        };
        let mean = rng.floats(c, -0.5, 0.5);
        let inv_std = rng.floats(c, 0.5, 2.0);
        let gamma = rng.floats(c, 0.5, 1.5);
        let beta = rng.floats(c, -0.5, 0.5);
        let bn = SavedBn {
            mean: &mean,
            inv_std: &inv_std,
            gamma: &gamma,
            beta: &beta,
        };
        let joins = [
            ReluJoin::default(),
            ReluJoin {
                resid: Some(&resid),
                dy_branch: None,
            },
            ReluJoin {
                resid: None,
                dy_branch: Some(&branch),
            },
            ReluJoin {
                resid: Some(&resid),
                dy_branch: Some(&branch),
            },
        ];
        let dxc = dgrad_acc(&p, &f16::widen_slice(&dy), &f16::widen_slice(&w)).unwrap();
        for join in joins {
            let got = dgrad_drelu_dbn(&p, &dy, &w, &y_prev, &bn, &join).unwrap();
            let want = old_map(n, c, |i, ch| {
                let grad = dxc[i] + join.dy_branch.map_or(0.0, |d| d[i].to_acc());
                let z = bn_recompute(
                    y_prev[i].to_acc(),
                    mean[ch],
                    inv_std[ch],
                    gamma[ch],
                    beta[ch],
                ) + join.resid.map_or(0.0, |r| r[i].to_acc());
                f16::from_acc(if z > 0.0 { grad } else { 0.0 })
            });
            assert_eq!(bits(&got.dz), bits(&want), "dz {p:?}");
            // The coefficients summed tile by tile equal the separate pass over the stored dz.
            let co = BnBwdCoefficients::compute(
                &p.input_shape(),
                &y_prev,
                &want,
                &mean,
                &inv_std,
                &gamma,
            );
            for (what, g, e) in [
                ("dgamma", &got.dgamma, &co.dgamma),
                ("dbeta", &got.dbeta, &co.dbeta),
                ("a", &got.a, &co.a),
                ("b", &got.b, &co.b),
                ("c", &got.c, &co.c),
            ] {
                assert_eq!(bits32(g), bits32(e), "{what} {p:?}");
            }
        }
    }
}

#[test]
fn fprop_genstats_and_the_prologue_match_the_separate_passes_bit_for_bit() {
    let mut rng = Rng::new(0xF5);
    for p in conv_shapes() {
        let c = p.c;
        let (x, w) = (finite(&mut rng, p.x_elems()), finite(&mut rng, p.w_elems()));
        let dy = finite(&mut rng, p.y_elems());
        let scale = finite(&mut rng, c);
        let bias = finite(&mut rng, c);
        let inputs = [
            ConvInput::Plain(&x),
            ConvInput::Prologue {
                y_prev: &x,
                scale: &scale,
                bias: &bias,
            },
        ];
        for input in inputs {
            // The replaced composition: the prologue stored as bn_apply stores it, widened,
            // the conv stored, then GenStats over the stored output.
            let x_acc = match input {
                ConvInput::Plain(x) => f16::widen_slice(x),
                ConvInput::Prologue {
                    y_prev,
                    scale,
                    bias,
                } => f16::widen_slice(
                    &bn_apply(
                        &p.input_shape(),
                        y_prev,
                        scale,
                        bias,
                        Residual::None,
                        Activation::Relu,
                    )
                    .unwrap(),
                ),
            };
            let y = f16::store_slice(&fprop_acc(&p, &x_acc, &f16::widen_slice(&w)).unwrap());
            let stats = genstats(&p.output_shape(), &y).unwrap();
            let got = fprop_genstats(&p, input, &w).unwrap();
            assert_eq!(bits(&got.y), bits(&y), "y {p:?}");
            assert_eq!(bits32(&got.stats.sum), bits32(&stats.sum), "sum {p:?}");
            assert_eq!(
                bits32(&got.stats.sqsum),
                bits32(&stats.sqsum),
                "sqsum {p:?}"
            );

            let dw = f16::store_slice(&wgrad_acc(&p, &x_acc, &f16::widen_slice(&dy)).unwrap());
            let got = wgrad_with_prologue(&p, input, &dy).unwrap();
            assert_eq!(bits(&got), bits(&dw), "wgrad {p:?}");
        }
    }
}

/// The strided dgrad by phases sums the same products as the gather over all taps, without
/// the taps that only add zeros: equal up to the GEMM's summation order (f64: to 1e-12 of the
/// largest magnitude; FP32: to 1e-5), on every conv shape (stride 1 included: one phase).
#[test]
fn strided_dgrad_by_phases_matches_the_gather_over_all_taps() {
    let mut rng = Rng::new(0xD9);
    let mut shapes = conv_shapes();
    shapes.push(
        ConvParams::new(3, 4, 9, 10, 6, 3, 3)
            .with_padding(1, 2)
            .with_stride(3, 2),
    );
    shapes.push(
        ConvParams::new(2, 4, 11, 9, 5, 3, 3)
            .with_padding(2, 2)
            .with_stride(2, 2)
            .with_dilation(2, 1),
    );
    for p in shapes {
        p.validate().unwrap();
        let w16 = finite(&mut rng, p.w_elems());
        let dy16 = finite(&mut rng, p.y_elems());
        let (w64, dy64): (Vec<f64>, Vec<f64>) = (
            w16.iter().map(|v| v.to_f64()).collect(),
            dy16.iter().map(|v| v.to_f64()).collect(),
        );
        let want = dgrad_all_taps(&p, &dy64, &w64).unwrap();
        let got = dgrad_phases(&p, &dy64, &w64).unwrap();
        let scale = want.iter().fold(1.0f64, |m, v| m.max(v.abs()));
        for (i, (g, e)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - e).abs() <= 1e-12 * scale,
                "f64 {p:?} at {i}: {g} vs {e}"
            );
        }
        let (w32, dy32) = (f16::widen_slice(&w16), f16::widen_slice(&dy16));
        let got = dgrad_phases(&p, &dy32, &w32).unwrap();
        for (i, (g, e)) in got.iter().zip(&want).enumerate() {
            let g = f64::from(*g);
            assert!(
                (g - e).abs() <= 1e-5 * scale,
                "f32 {p:?} at {i}: {g} vs {e}"
            );
        }
        assert_eq!(got.len(), dgrad_acc(&p, &dy32, &w32).unwrap().len());
    }
}

/// Storage of the wrong size full of garbage (NaNs and large values), as a reused buffer may
/// hold: every op writing into it must overwrite all of it.
fn garbage(len: usize) -> Vec<f16> {
    (0..len)
        .map(|i| {
            if i % 2 == 0 {
                f16::NAN
            } else {
                f16::from_f32(-1000.0)
            }
        })
        .collect()
}

/// The public convolutions against the composition they replaced (the input widened, then the
/// unrounded op, then stored): `conv_dgrad` (each tile now stored as it is made, and `dy`
/// widened into the gather's padded copy) and `conv_wgrad` (`x` widened into it), bit for bit,
/// into fresh and into reused (garbage-filled, wrongly sized) storage.
#[test]
fn conv_dgrad_and_wgrad_match_the_widen_then_convolve_composition_bit_for_bit() {
    let mut rng = Rng::new(0xA7);
    // One scratch through every shape, as storage is reused.
    let mut scratch = ConvScratch::default();
    for p in conv_shapes() {
        let x = finite(&mut rng, p.x_elems());
        let w = finite(&mut rng, p.w_elems());
        let dy = finite(&mut rng, p.y_elems());
        let (wa, dya) = (f16::widen_slice(&w), f16::widen_slice(&dy));
        let want = f16::store_slice(&dgrad_acc(&p, &dya, &wa).unwrap());
        assert_eq!(
            bits(&conv_dgrad(&p, &dy, &w).unwrap()),
            bits(&want),
            "dgrad {p:?}"
        );
        for storage in [garbage(want.len()), garbage(want.len() + 7), garbage(3)] {
            let got = conv_dgrad_into(&p, &dy, &w, storage.clone()).unwrap();
            assert_eq!(bits(&got), bits(&want), "dgrad into {p:?}");
            // The scratch's padded `dy` reused (from the previous shape's and this one's).
            let got = conv_dgrad_with(&p, &dy, &w, &mut scratch, storage).unwrap();
            assert_eq!(bits(&got), bits(&want), "dgrad with scratch {p:?}");
        }
        let want = f16::store_slice(&wgrad_acc(&p, &f16::widen_slice(&x), &dya).unwrap());
        assert_eq!(
            bits(&conv_wgrad(&p, &x, &dy).unwrap()),
            bits(&want),
            "wgrad {p:?}"
        );
    }
}

/// The conv steps with a scratch kept across calls equal the plain ops bit for bit: fprop
/// leaves its (padded) input in the scratch, a wgrad of the same input reads it (by stamp, or
/// by comparing kept copies), a wgrad of any other input (another tensor, a changed value, a
/// stale stamp, another shape) recomputes its own; reused padded storage (from a larger
/// shape, with garbage in the border) changes nothing.
#[test]
fn conv_scratch_reuse_matches_the_plain_ops_bit_for_bit() {
    let mut rng = Rng::new(0x5C);
    let mut scratch = ConvScratch::<f16>::default();
    // One scratch through every shape (large to small and back), as storage is reused.
    let mut shapes = conv_shapes();
    shapes.extend(conv_shapes().into_iter().rev());
    for (i, p) in shapes.into_iter().enumerate() {
        let c = p.c;
        let x = finite(&mut rng, p.x_elems());
        let mut other = x.clone();
        other[x.len() / 2] = f16::from_f32(other[x.len() / 2].to_f32() + 0.5);
        let w = finite(&mut rng, p.w_elems());
        let dy = finite(&mut rng, p.y_elems());
        let (scale, bias) = (finite(&mut rng, c), finite(&mut rng, c));
        let prologue = |y_prev| ConvInput::Prologue {
            y_prev,
            scale: &scale,
            bias: &bias,
        };
        for (input, changed) in [
            (ConvInput::Plain(&x), ConvInput::Plain(&other)),
            (prologue(&x), prologue(&other)),
        ] {
            let want = fprop_genstats(&p, input, &w).unwrap();
            let want_dw = wgrad_with_prologue(&p, input, &dy).unwrap();
            let want_other = wgrad_with_prologue(&p, changed, &dy).unwrap();
            for stamp in [None, Some([i as u64, 1, 2])] {
                let y = garbage(i % 5);
                let got = fprop_genstats_with(&p, input, &w, &mut scratch, stamp, y).unwrap();
                assert_eq!(bits(&got.y), bits(&want.y), "y {p:?}");
                assert_eq!(bits32(&got.stats.sum), bits32(&want.stats.sum), "sum {p:?}");
                assert_eq!(bits32(&got.stats.sqsum), bits32(&want.stats.sqsum));
                // The same input: from the scratch.
                let dw =
                    wgrad_with_prologue_with(&p, input, &dy, &mut scratch, stamp, garbage(i % 7))
                        .unwrap();
                assert_eq!(bits(&dw), bits(&want_dw), "wgrad {p:?} {stamp:?}");
                // Another input (with a new stamp where stamps are used): recomputed.
                let new = stamp.map(|[a, b, c]| [a + 1000, b, c]);
                let dw = wgrad_with_prologue_with(&p, changed, &dy, &mut scratch, new, Vec::new())
                    .unwrap();
                assert_eq!(bits(&dw), bits(&want_other), "changed {p:?} {stamp:?}");
                // A stamp where the forward kept copies, or none where it kept a stamp:
                // recomputed, not trusted.
                let mixed = if stamp.is_some() {
                    None
                } else {
                    Some([7, 7, 7])
                };
                let dw =
                    wgrad_with_prologue_with(&p, changed, &dy, &mut scratch, mixed, garbage(3))
                        .unwrap();
                assert_eq!(bits(&dw), bits(&want_other), "mixed {p:?} {stamp:?}");
            }
        }
        // A wgrad of another shape never reads this one's input.
        let q = ConvParams::new(1, c, 5, 4, 3, 3, 3).with_padding(1, 1);
        let xq = finite(&mut rng, q.x_elems());
        let dyq = finite(&mut rng, q.y_elems());
        let want = wgrad_with_prologue(&q, ConvInput::Plain(&xq), &dyq).unwrap();
        let got = wgrad_with_prologue_with(
            &q,
            ConvInput::Plain(&xq),
            &dyq,
            &mut scratch,
            None,
            Vec::new(),
        )
        .unwrap();
        assert_eq!(bits(&got), bits(&want), "other shape {q:?}");

        // dgrad_drelu_dbn through the scratch's reused `dy` storage, into reused `dz` storage.
        let y_prev = finite(&mut rng, p.x_elems());
        let (mean, inv_std) = (rng.floats(c, -0.5, 0.5), rng.floats(c, 0.5, 2.0));
        let (gamma, beta) = (rng.floats(c, 0.5, 1.5), rng.floats(c, -0.5, 0.5));
        let bn = SavedBn {
            mean: &mean,
            inv_std: &inv_std,
            gamma: &gamma,
            beta: &beta,
        };
        let join = ReluJoin::default();
        let want = dgrad_drelu_dbn(&p, &dy, &w, &y_prev, &bn, &join).unwrap();
        let dz = garbage(p.x_elems() + 3);
        let got = dgrad_drelu_dbn_with(&p, &dy, &w, &y_prev, &bn, &join, &mut scratch, dz).unwrap();
        assert_eq!(bits(&got.dz), bits(&want.dz), "dz {p:?}");
        for (g, e) in [
            (&got.dgamma, &want.dgamma),
            (&got.dbeta, &want.dbeta),
            (&got.a, &want.a),
            (&got.b, &want.b),
            (&got.c, &want.c),
        ] {
            assert_eq!(bits32(g), bits32(e), "dbn {p:?}");
        }
    }
}

/// The element-wise ops into reused storage (garbage, of any length) equal the ops into fresh
/// storage bit for bit.
#[test]
fn element_wise_ops_into_reused_storage_match_bit_for_bit() {
    let mut rng = Rng::new(0xE1);
    for shape in shapes() {
        let (n, c) = (shape.elems(), shape.c);
        let (a, b, y) = (data(&mut rng, n), data(&mut rng, n), data(&mut rng, n));
        let (s, t) = (data(&mut rng, c), data(&mut rng, c));
        let (ca, cb, cc) = (
            rng.floats(c, -2.0, 2.0),
            rng.floats(c, -2.0, 2.0),
            rng.floats(c, -2.0, 2.0),
        );
        for len in [0, n, n + 5] {
            let want = bn_apply(&shape, &y, &s, &t, Residual::Add(&a), Activation::Relu).unwrap();
            let got = bn_apply_into(
                &shape,
                &y,
                &s,
                &t,
                Residual::Add(&a),
                Activation::Relu,
                garbage(len),
            )
            .unwrap();
            assert_eq!(bits(&got), bits(&want), "bn_apply {shape:?}");
            let want = relu_bwd(&shape, &a, &b).unwrap();
            let got = relu_bwd_into(&shape, &a, &b, garbage(len)).unwrap();
            assert_eq!(bits(&got), bits(&want), "relu_bwd {shape:?}");
            let want = add(&shape, &a, &b).unwrap();
            let got = add_into(&shape, &a, &b, garbage(len)).unwrap();
            assert_eq!(bits(&got), bits(&want), "add {shape:?}");
            let want = dbn_apply(&shape, &a, &y, &ca, &cb, &cc).unwrap();
            let got = dbn_apply_into(&shape, &a, &y, &ca, &cb, &cc, garbage(len)).unwrap();
            assert_eq!(bits(&got), bits(&want), "dbn_apply {shape:?}");
        }
    }
}

/// ReLU backward's select on the FP16 bits against the select on the values, over every FP16
/// bit pattern of `x` (both zeros, subnormals, infinities, NaNs) and gradients of every kind
/// (NaN payloads kept): the same bits exactly.
#[test]
fn relu_select_on_bits_matches_the_select_on_values_for_every_fp16() {
    let x: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
    for shift in [0u16, 1, 0x7C01, 0x8000, 0xFFFF] {
        let dy: Vec<f16> = (0..=u16::MAX)
            .map(|b| f16::from_bits(b.wrapping_mul(31).wrapping_add(shift)))
            .collect();
        let want: Vec<u16> = x
            .iter()
            .zip(&dy)
            .map(|(v, d)| if v.to_f32() > 0.0 { d.to_bits() } else { 0 })
            .collect();
        let mut got = vec![f16::NAN; x.len()];
        f16::relu_select(&dy, &x, &mut got);
        assert_eq!(got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want);
    }
}

/// The strided dgrad (by phases, now each image's `dx` made in a buffer of its own and stored
/// from it) against the implementation it replaced, bit for bit, in FP32 and through the
/// public FP16 op.
#[test]
fn strided_dgrad_by_image_matches_the_replaced_phases_bit_for_bit() {
    let mut rng = Rng::new(0xB3);
    let mut shapes: Vec<ConvParams> = conv_shapes()
        .into_iter()
        .filter(|p| p.stride_h > 1 || p.stride_w > 1)
        .collect();
    shapes.push(
        ConvParams::new(3, 4, 9, 10, 6, 3, 3)
            .with_padding(1, 2)
            .with_stride(3, 2),
    );
    for p in shapes {
        let (w, dy) = (finite(&mut rng, p.w_elems()), finite(&mut rng, p.y_elems()));
        let (wa, dya) = (f16::widen_slice(&w), f16::widen_slice(&dy));
        let want = old_dgrad_phases(&p, &dya, &wa);
        assert_eq!(
            bits32(&dgrad_phases(&p, &dya, &wa).unwrap()),
            bits32(&want),
            "{p:?}"
        );
        let got = conv_dgrad_into(&p, &dy, &w, garbage(5)).unwrap();
        assert_eq!(bits(&got), bits(&f16::store_slice(&want)), "fp16 {p:?}");
    }
}

/// An op that finds its thread's conv store in use (rayon's work stealing ran it while another
/// op on the thread waits for its parallel part) works on a fresh store of its own: the same
/// values as with the thread's store, and the outer op's store is left alone.
#[test]
fn an_op_run_inside_another_ops_store_gives_the_same_values() {
    use crate::reference::conv::with_store;
    let mut rng = Rng::new(0x71);
    for p in conv_shapes() {
        let x = finite(&mut rng, p.x_elems());
        let w = finite(&mut rng, p.w_elems());
        let dy = finite(&mut rng, p.y_elems());
        let want_y = fprop_genstats(&p, ConvInput::Plain(&x), &w).unwrap();
        let want_dw = wgrad_with_prologue(&p, ConvInput::Plain(&x), &dy).unwrap();
        let want_dx =
            conv_dgrad_with(&p, &dy, &w, &mut ConvScratch::default(), Vec::new()).unwrap();
        with_store::<f32, _>(|outer| {
            outer.w = vec![7.0; 3];
            let y = fprop_genstats(&p, ConvInput::Plain(&x), &w).unwrap();
            let dw = wgrad_with_prologue(&p, ConvInput::Plain(&x), &dy).unwrap();
            let dx = conv_dgrad_with(&p, &dy, &w, &mut ConvScratch::default(), Vec::new()).unwrap();
            assert_eq!(bits(&y.y), bits(&want_y.y), "y {p:?}");
            assert_eq!(bits(&dw), bits(&want_dw), "dw {p:?}");
            assert_eq!(bits(&dx), bits(&want_dx), "dx {p:?}");
            assert_eq!(
                outer.w,
                vec![7.0; 3],
                "the outer op's store was used by the inner ops"
            );
        });
    }
}
