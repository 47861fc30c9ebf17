//! Bad inputs give the typed error that names the tensor, never a panic.

use half::f16;

use crate::reference::*;

fn p() -> ConvParams {
    ConvParams::new(2, 3, 5, 5, 4, 3, 3).with_padding(1, 1)
}

fn zeros(n: usize) -> Vec<f16> {
    vec![f16::ZERO; n]
}

/// Asserts a `ShapeMismatch` for `tensor`, and that the message names it.
#[track_caller]
fn assert_mismatch<T: std::fmt::Debug>(
    r: Result<T, ReferenceError>,
    tensor: &'static str,
    expected: usize,
    got: usize,
) {
    let err = r.unwrap_err();
    assert_eq!(
        err,
        ReferenceError::ShapeMismatch {
            tensor,
            expected,
            got
        }
    );
    assert!(err.to_string().contains(&format!("`{tensor}`")), "{err}");
}

#[test]
fn conv_ops_name_the_wrong_tensor() {
    let p = p();
    let (x, w, dy) = (zeros(p.x_elems()), zeros(p.w_elems()), zeros(p.y_elems()));
    assert_mismatch(
        conv_fprop(&p, &x[1..], &w),
        "x",
        p.x_elems(),
        p.x_elems() - 1,
    );
    assert_mismatch(
        conv_fprop(&p, &x, &w[1..]),
        "w",
        p.w_elems(),
        p.w_elems() - 1,
    );
    assert_mismatch(
        conv_dgrad(&p, &dy[1..], &w),
        "dy",
        p.y_elems(),
        p.y_elems() - 1,
    );
    assert_mismatch(
        conv_wgrad(&p, &x, &dy[1..]),
        "dy",
        p.y_elems(),
        p.y_elems() - 1,
    );
    let short = zeros(p.c - 1);
    let input = ConvInput::Prologue {
        y_prev: &x,
        scale: &short,
        bias: &zeros(p.c),
    };
    assert_mismatch(fprop_genstats(&p, input, &w), "scale", p.c, p.c - 1);
    let input = ConvInput::Prologue {
        y_prev: &x[1..],
        scale: &zeros(p.c),
        bias: &zeros(p.c),
    };
    assert_mismatch(
        wgrad_with_prologue(&p, input, &dy),
        "y_prev",
        p.x_elems(),
        p.x_elems() - 1,
    );
}

#[test]
fn zero_dimensions_and_empty_outputs_are_named() {
    let cases = [
        (ConvParams { h: 0, ..p() }, "x", "h"),
        (ConvParams { n: 0, ..p() }, "x", "n"),
        (ConvParams { k: 0, ..p() }, "w", "k"),
        (ConvParams { s: 0, ..p() }, "w", "s"),
        (ConvParams { stride_w: 0, ..p() }, "conv", "stride_w"),
        (ConvParams { dil_h: 0, ..p() }, "conv", "dil_h"),
    ];
    for (params, tensor, dim) in cases {
        let err = conv_fprop::<f16>(&params, &[], &[]).unwrap_err();
        assert_eq!(err, ReferenceError::ZeroDimension { tensor, dim });
        assert!(err.to_string().contains(&format!("`{dim}`")), "{err}");
    }
    // A 7-tall filter over a 5-tall input padded by 0.
    let params = ConvParams::new(1, 1, 5, 5, 1, 7, 1);
    assert_eq!(params.out_h(), 0);
    assert_eq!(
        conv_fprop::<f16>(&params, &[], &[]).unwrap_err(),
        ReferenceError::EmptyOutput {
            axis: "out_h",
            padded: 5,
            filter: 7,
        }
    );
    // Dilation 3 makes a 3-wide filter span 7.
    let params = ConvParams::new(1, 1, 5, 5, 1, 1, 3).with_dilation(1, 3);
    assert!(matches!(
        conv_fprop::<f16>(&params, &[], &[]),
        Err(ReferenceError::EmptyOutput { axis: "out_w", .. })
    ));
    // Element counts that overflow usize are rejected, not wrapped.
    let huge = ConvParams::new(usize::MAX / 2, 4, 4, 4, 1, 1, 1);
    assert_eq!(
        huge.validate(),
        Err(ReferenceError::TooLarge { tensor: "x" })
    );
    let shape = Nhwc::new(2, 0, 3, 4);
    assert_eq!(
        relu_fwd::<f16>(&shape, &[]).unwrap_err(),
        ReferenceError::ZeroDimension {
            tensor: "x",
            dim: "h"
        }
    );
}

#[test]
fn bn_ops_name_the_wrong_tensor() {
    let shape = Nhwc::new(2, 2, 2, 3);
    let y = zeros(shape.elems());
    let stats = genstats(&shape, &y).unwrap();
    let v = vec![0.0f32; 3];
    let (mut rm, mut rv) = (v.clone(), v.clone());
    let params = BnParams::default();
    macro_rules! finalize {
        ($stats:expr, $gamma:expr, $rm:expr, $rv:expr, $count:expr, $params:expr) => {
            bn_finalize(
                $stats,
                $gamma,
                &v,
                RunningStats {
                    mean: $rm,
                    var: $rv,
                },
                $count,
                $params,
            )
        };
    }
    assert_mismatch(
        finalize!(&stats, &v[1..], &mut rm, &mut rv, 8, &params),
        "gamma",
        3,
        2,
    );
    assert_mismatch(
        finalize!(&stats, &v, &mut rm, &mut rv[1..], 8, &params),
        "running_var",
        3,
        2,
    );
    let short = ChannelStats {
        sum: v.clone(),
        sqsum: v[1..].to_vec(),
    };
    assert_mismatch(
        finalize!(&short, &v, &mut rm, &mut rv, 8, &params),
        "sqsum",
        3,
        2,
    );
    let empty = ChannelStats::<f32> {
        sum: vec![],
        sqsum: vec![],
    };
    assert_eq!(
        finalize!(&empty, &[], &mut [], &mut [], 8, &params).unwrap_err(),
        ReferenceError::ZeroDimension {
            tensor: "sum",
            dim: "c"
        }
    );
    assert_eq!(
        finalize!(&stats, &v, &mut rm, &mut rv, 1, &params).unwrap_err(),
        ReferenceError::CountTooSmall { count: 1 }
    );
    for (bad, param) in [
        (
            BnParams {
                epsilon: 0.0,
                ..params
            },
            "epsilon",
        ),
        (
            BnParams {
                epsilon: f64::NAN,
                ..params
            },
            "epsilon",
        ),
        (
            BnParams {
                momentum: 1.5,
                ..params
            },
            "momentum",
        ),
        (
            BnParams {
                momentum: f64::NAN,
                ..params
            },
            "momentum",
        ),
    ] {
        let err = finalize!(&stats, &v, &mut rm, &mut rv, 8, &bad).unwrap_err();
        assert!(
            matches!(err, ReferenceError::InvalidBnParam { param: p, .. } if p == param),
            "{err}"
        );
    }
    assert_mismatch(bn_bwd(&shape, &y, &y[1..], &v, &v, &v), "dz", 24, 23);
    assert_mismatch(
        bn_bwd(&shape, &y, &y, &v, &v[1..], &v),
        "saved_inv_std",
        3,
        2,
    );
    let h = zeros(3);
    let apply = |r: Residual<'_, f16>| bn_apply(&shape, &y, &h, &h, r, Activation::Relu);
    assert_mismatch(apply(Residual::Add(&y[1..])), "residual", 24, 23);
    let bad = Residual::ScaleBias {
        r: &y,
        scale: &h[1..],
        bias: &h,
    };
    assert_mismatch(apply(bad), "residual_scale", 3, 2);
    assert_mismatch(dbn_apply(&shape, &y, &y, &v, &v, &v[1..]), "c", 3, 2);
}

#[test]
fn dgrad_drelu_dbn_names_the_wrong_tensor() {
    let p = p();
    let (dy, w, y) = (zeros(p.y_elems()), zeros(p.w_elems()), zeros(p.x_elems()));
    let v = vec![0.0f32; p.c];
    let saved = SavedBn {
        mean: &v,
        inv_std: &v,
        gamma: &v,
        beta: &v[1..],
    };
    let none = ReluJoin::default();
    assert_mismatch(
        dgrad_drelu_dbn(&p, &dy, &w, &y, &saved, &none),
        "beta",
        p.c,
        p.c - 1,
    );
    let saved = SavedBn { beta: &v, ..saved };
    let join = ReluJoin {
        resid: Some(&y[1..]),
        dy_branch: None,
    };
    assert_mismatch(
        dgrad_drelu_dbn(&p, &dy, &w, &y, &saved, &join),
        "resid",
        p.x_elems(),
        p.x_elems() - 1,
    );
    let join = ReluJoin {
        resid: None,
        dy_branch: Some(&y[2..]),
    };
    assert_mismatch(
        dgrad_drelu_dbn(&p, &dy, &w, &y, &saved, &join),
        "dy_branch",
        p.x_elems(),
        p.x_elems() - 2,
    );
    assert_mismatch(
        dgrad_drelu_dbn(&p, &dy, &w, &y[1..], &saved, &none),
        "y_prev",
        p.x_elems(),
        p.x_elems() - 1,
    );
}

#[test]
fn chain_errors_name_the_layer() {
    let p0 = ConvParams::new(1, 2, 4, 4, 3, 3, 3).with_padding(1, 1);
    let p1 = ConvParams::new(1, 4, 4, 4, 4, 1, 1); // expects 4 channels, gets 3
    let layer = |p: ConvParams| CbrLayer::new(p, zeros(p.w_elems()));
    let err = CbrChain::new(vec![layer(p0), layer(p1)], BnParams::default()).unwrap_err();
    assert_eq!(
        err,
        ReferenceError::IncompatibleShapes {
            tensor: "x",
            expected: [1, 4, 4, 3],
            got: [1, 4, 4, 4],
        }
        .in_layer(1)
    );
    assert!(err.to_string().starts_with("layer 1: tensor `x`"), "{err}");
    // A shortcut around a conv that changes the channel count.
    let mut l0 = layer(p0);
    l0.shortcut = true;
    assert!(matches!(
        CbrChain::new(vec![l0], BnParams::default()),
        Err(ReferenceError::Layer { layer: 0, inner }) if matches!(*inner, ReferenceError::IncompatibleShapes { tensor: "shortcut", .. })
    ));
    let mut l0 = layer(p0);
    l0.gamma.pop();
    assert!(matches!(
        CbrChain::new(vec![l0], BnParams::default()),
        Err(ReferenceError::Layer { layer: 0, inner }) if matches!(*inner, ReferenceError::ShapeMismatch { tensor: "gamma", .. })
    ));
    assert_eq!(
        CbrChain::<f16>::new(vec![], BnParams::default()).unwrap_err(),
        ReferenceError::ZeroDimension {
            tensor: "chain",
            dim: "layers",
        }
    );
    // Forward/backward inputs and a tampered forward record.
    let p1 = ConvParams::new(1, 3, 4, 4, 2, 1, 1);
    let mut chain = CbrChain::new(vec![layer(p0), layer(p1)], BnParams::default()).unwrap();
    let x = zeros(p0.x_elems());
    assert_mismatch(
        chain.forward(&x[1..], Route::Fused),
        "x",
        p0.x_elems(),
        p0.x_elems() - 1,
    );
    let mut fwd = chain.forward(&x, Route::Fused).unwrap();
    let d_out = zeros(p1.y_elems());
    assert_mismatch(
        chain.backward(&fwd, &x, &d_out[1..]),
        "d_out",
        p1.y_elems(),
        p1.y_elems() - 1,
    );
    fwd.layers[0].eq = None;
    assert_eq!(
        chain.backward(&fwd, &x, &d_out).unwrap_err(),
        ReferenceError::MissingForwardState {
            layer: 0,
            what: "eq_scale/eq_bias",
        }
        .in_layer(1)
    );
}

#[test]
fn non_finite_values_flow_through_without_panicking() {
    let p = p();
    let mut x = zeros(p.x_elems());
    x[0] = f16::NAN;
    x[1] = f16::INFINITY;
    let w = vec![f16::ONE; p.w_elems()];
    let y = conv_fprop(&p, &x, &w).unwrap();
    assert!(y[0].is_nan());
    let stats = genstats(&p.output_shape(), &y).unwrap();
    assert!(stats.sum[0].is_nan());
    let relu = relu_fwd(&p.output_shape(), &y).unwrap();
    assert_eq!(relu.len(), y.len());
}
