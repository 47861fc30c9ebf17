//! BN (statistics, finalize, apply, backward), ReLU, the residual add and the fused dgrad +
//! dReLU + dBN against their naive `f64` definitions, in both precision modes.
//!
//! Inputs are FP16 (tensors) and FP32 (vectors) values, so both modes and the naive definition
//! see identical numbers. f64 mode must match to f64 summation error; FP16 mode within bounds
//! derived from its rounding points (see `util::sum_bound` and each test's comment).

use half::f16;

use super::naive;
use super::util::*;
use crate::reference::*;

/// Runs `body` in FP16 mode and in f64 mode.
macro_rules! both_modes {
    ($body:ident) => {
        $body::<f16>();
        $body::<f64>();
    };
}

fn bn_apply_case<T: Element>() {
    let fp16 = is_half::<T>();
    let mut rng = Rng::new(31);
    let shape = Nhwc::new(2, 3, 4, 5);
    let (len, c) = (shape.elems(), shape.c);
    let y = rng.halfs(len, -2.0, 2.0);
    let r = rng.halfs(len, -2.0, 2.0);
    let (s, b) = (rng.halfs(c, 0.5, 1.5), rng.halfs(c, -1.0, 1.0));
    let (s2, b2) = (rng.halfs(c, 0.5, 1.5), rng.halfs(c, -1.0, 1.0));
    let (yt, rt) = (to_t::<T>(&y), to_t::<T>(&r));
    let (st, bt, s2t, b2t) = (to_t::<T>(&s), to_t::<T>(&b), to_t::<T>(&s2), to_t::<T>(&b2));
    let (y, r, s, b, s2, b2) = (wide(&y), wide(&r), wide(&s), wide(&b), wide(&s2), wide(&b2));
    for kind in 0..3 {
        for act in [Activation::Relu, Activation::Identity] {
            let residual = match kind {
                0 => Residual::None,
                1 => Residual::Add(&rt),
                _ => Residual::ScaleBias {
                    r: &rt,
                    scale: &s2t,
                    bias: &b2t,
                },
            };
            let got = wide(&bn_apply(&shape, &yt, &st, &bt, residual, act).unwrap());
            let mut want = Vec::new();
            let mut bound = Vec::new();
            for i in 0..len {
                let ch = i % c;
                let (main, extra) = (
                    y[i] * s[ch] + b[ch],
                    [0.0, r[i], r[i] * s2[ch] + b2[ch]][kind],
                );
                let v = main + extra;
                want.push(if act == Activation::Relu {
                    v.max(0.0)
                } else {
                    v
                });
                // At most 3 FP32 roundings (the FP16·FP16 products are exact) over terms of
                // total size `mag`, then one FP16 store; ReLU is 1-Lipschitz.
                let mag = (y[i] * s[ch]).abs()
                    + b[ch].abs()
                    + [0.0, r[i].abs(), (r[i] * s2[ch]).abs() + b2[ch].abs()][kind];
                bound.push(sum_bound(fp16, want[i], mag, 3.0));
            }
            assert_within(
                &format!("apply kind {kind} {act:?} fp16={fp16}"),
                &got,
                &want,
                &bound,
            );
        }
    }
}

#[test]
fn bn_apply_variants_match_naive() {
    both_modes!(bn_apply_case);
}

#[test]
fn relu_and_add_match_definitions() {
    let mut rng = Rng::new(32);
    let shape = Nhwc::new(2, 3, 3, 4);
    let mut x = rng.halfs(shape.elems(), -1.0, 1.0);
    // Exact zeros: the ReLU backward passes no gradient there.
    x[0] = f16::ZERO;
    x[5] = f16::NEG_ZERO;
    let dy = rng.halfs(shape.elems(), -1.0, 1.0);
    let fwd = relu_fwd(&shape, &x).unwrap();
    let bwd = relu_bwd(&shape, &dy, &x).unwrap();
    for i in 0..x.len() {
        let xi = x[i].to_f64();
        assert_eq!(fwd[i].to_f64(), xi.max(0.0), "relu_fwd[{i}]");
        assert_eq!(
            bwd[i].to_f64(),
            if xi > 0.0 { dy[i].to_f64() } else { 0.0 },
            "relu_bwd[{i}]"
        );
    }
    // add: exact sum, one FP16 rounding (the FP32 sum of two FP16 values may round once
    // before it, so allow 2^-24 of the operands as well).
    let sum = wide(&add(&shape, &x, &dy).unwrap());
    let want: Vec<f64> = x
        .iter()
        .zip(&dy)
        .map(|(a, b)| a.to_f64() + b.to_f64())
        .collect();
    let bound: Vec<f64> = x
        .iter()
        .zip(&dy)
        .zip(&want)
        .map(|((a, b), w)| sum_bound(true, *w, a.to_f64().abs() + b.to_f64().abs(), 1.0))
        .collect();
    assert_within("add", &sum, &want, &bound);
}

fn genstats_case<T: Element>() {
    let fp16 = is_half::<T>();
    let mut rng = Rng::new(33);
    // 3·5·7·4: several channels, odd sizes; and a tall one that spans several reduction chunks.
    for shape in [Nhwc::new(3, 5, 7, 4), Nhwc::new(4, 20, 20, 2)] {
        let y = rng.halfs(shape.elems(), -1.0, 2.0);
        let got = genstats(&shape, &to_t::<T>(&y)).unwrap();
        let y = wide(&y);
        // f64 sums err by ~rows·2^-53 relative (negligible); FP16 mode rounds them to FP32.
        let rel = if fp16 { U32 } else { 0.0 };
        for ch in 0..shape.c {
            let v = naive::channel(&shape, &y, ch);
            let sum: f64 = v.iter().sum();
            let sqsum: f64 = v.iter().map(|y| y * y).sum();
            let abs: f64 = v.iter().map(|y| y.abs()).sum();
            assert_close("sum", &[got.sum[ch].to_f64()], &[sum], rel, 1e-13 * abs);
            assert_close(
                "sqsum",
                &[got.sqsum[ch].to_f64()],
                &[sqsum],
                rel,
                1e-13 * sqsum,
            );
        }
    }
}

#[test]
fn genstats_matches_naive() {
    both_modes!(genstats_case);
}

fn bn_finalize_pinned_case<T: Element>() {
    // Two channels, count 4: channel 0 holds 1, 2, 3, 4; channel 1 holds −1, −1, 1, 1.
    // Channel 0: mean 2.5, biased variance 1.25, unbiased 5/3.
    // Channel 1: mean 0, biased variance 1, unbiased 4/3.
    let shape = Nhwc::new(1, 2, 2, 2);
    let y: Vec<T> = [1.0, -1.0, 2.0, -1.0, 3.0, 1.0, 4.0, 1.0]
        .map(T::from_f64)
        .to_vec();
    let stats = genstats(&shape, &y).unwrap();
    let a = |v: f64| <T::Acc as Real>::from_f64(v);
    let (gamma, beta) = ([a(2.0), a(0.5)], [a(1.0), a(-1.0)]);
    let (mut rm, mut rv) = ([a(0.5), a(0.0)], [a(1.0), a(2.0)]);
    let params = BnParams {
        epsilon: 0.25,
        momentum: 0.1,
    };
    let running = RunningStats {
        mean: &mut rm,
        var: &mut rv,
    };
    let out = bn_finalize(&stats, &gamma, &beta, running, 4, &params).unwrap();
    // inv_std = 1/sqrt(var + 0.25): 1/sqrt(1.5) and 1/sqrt(1.25).
    let inv_std = [0.816_496_580_927_726, 0.894_427_190_999_916];
    // eq_scale = γ·inv_std; eq_bias = β − mean·γ·inv_std.
    let eq_scale = [1.632_993_161_855_452, 0.447_213_595_499_958];
    let eq_bias = [-3.082_482_904_638_63, -1.0];
    // running_mean = 0.9·prev + 0.1·mean; running_var = 0.9·prev + 0.1·unbiased.
    let running_mean = [0.7, 0.0];
    let running_var = [0.9 + 1.0 / 6.0, 1.8 + 0.4 / 3.0];
    let fp16 = is_half::<T>();
    let (r32, r16) = if fp16 { (U32, U16) } else { (1e-15, 1e-15) };
    assert_close(
        "saved_mean",
        &wide_acc::<T>(&out.saved_mean),
        &[2.5, 0.0],
        r32,
        0.0,
    );
    assert_close(
        "saved_inv_std",
        &wide_acc::<T>(&out.saved_inv_std),
        &inv_std,
        r32,
        0.0,
    );
    assert_close("eq_scale", &wide(&out.eq_scale), &eq_scale, r16, 0.0);
    assert_close("eq_bias", &wide(&out.eq_bias), &eq_bias, r16, 0.0);
    assert_close("running_mean", &wide_acc::<T>(&rm), &running_mean, r32, 0.0);
    assert_close("running_var", &wide_acc::<T>(&rv), &running_var, r32, 0.0);
}

fn bn_eval_finalize_pinned_case<T: Element>() {
    // Evaluation mode: the running statistics in place of the batch's, the same ε.
    // Channel 0: running mean 0.5, var 1.25 → inv_std 1/sqrt(1.5); channel 1: mean −2,
    // var 1 → inv_std 1/sqrt(1.25).
    let a = |v: f64| <T::Acc as Real>::from_f64(v);
    let (gamma, beta) = ([a(2.0), a(0.5)], [a(1.0), a(-1.0)]);
    let (rm, rv) = ([a(0.5), a(-2.0)], [a(1.25), a(1.0)]);
    let params = BnParams {
        epsilon: 0.25,
        momentum: 0.1,
    };
    let out = bn_eval_finalize(&gamma, &beta, &rm, &rv, &params).unwrap();
    let inv_std = [0.816_496_580_927_726, 0.894_427_190_999_916];
    // eq_scale = γ·inv_std; eq_bias = β − running_mean·γ·inv_std.
    let eq_scale = [1.632_993_161_855_452, 0.447_213_595_499_958];
    let eq_bias = [
        1.0 - 0.5 * 1.632_993_161_855_452,
        -1.0 + 2.0 * 0.447_213_595_499_958,
    ];
    let fp16 = is_half::<T>();
    // f64: the expected values above are themselves computed in f64 (β − μ·scale rounds
    // twice), so a few ulps of slack: 1e-14.
    let (r32, r16) = if fp16 { (U32, U16) } else { (1e-15, 1e-14) };
    assert_close("eq_scale", &wide(&out.eq_scale), &eq_scale, r16, 0.0);
    assert_close("eq_bias", &wide(&out.eq_bias), &eq_bias, r16, 0.0);
    assert_close(
        "mean",
        &wide_acc::<T>(&out.saved_mean),
        &[0.5, -2.0],
        0.0,
        0.0,
    );
    assert_close(
        "inv_std",
        &wide_acc::<T>(&out.saved_inv_std),
        &inv_std,
        r32,
        0.0,
    );
    // A running variance below −ε has no square root: a typed error naming it.
    let bad = [a(-0.5), a(1.0)];
    let err = bn_eval_finalize(&gamma, &beta, &rm, &bad, &params).unwrap_err();
    assert!(
        matches!(
            err,
            ReferenceError::InvalidBnParam {
                param: "running_var",
                ..
            }
        ),
        "{err:?}"
    );
    // A length that differs from γ's too.
    let err = bn_eval_finalize(&gamma, &beta, &rm[..1], &rv, &params).unwrap_err();
    assert!(
        matches!(err, ReferenceError::ShapeMismatch { .. }),
        "{err:?}"
    );
}

#[test]
fn bn_eval_finalize_pinned_semantics() {
    both_modes!(bn_eval_finalize_pinned_case);
}

/// Widens arithmetic-type vectors to f64.
fn wide_acc<T: Element>(v: &[T::Acc]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
}

#[test]
fn bn_finalize_pinned_semantics() {
    both_modes!(bn_finalize_pinned_case);
}

/// Naive batch statistics of `y` and the error bounds FP16 mode may show on them.
struct NaiveBn {
    mean: Vec<f64>,
    var: Vec<f64>,
    inv_std: Vec<f64>,
    /// Bound on |saved_mean − mean|.
    mean_err: Vec<f64>,
    /// Bound on |var_used − var|.
    var_err: Vec<f64>,
    /// Bound on the relative error of saved_inv_std.
    inv_std_rel: Vec<f64>,
}

/// In FP16 mode the sums are FP32 (relative error 2^-24 each), so with `E1 = Σ|y|/M` and
/// `E2 = Σy²/M`: |Δmean| ≤ 2·2^-24·E1 (sum and result rounding), |Δvar| ≤ 4·2^-24·(E2 + E1²)
/// (sqsum rounding plus 2·|mean|·|Δmean|, generously), and inv_std's relative error is
/// ≤ |Δvar| / (2·(var + ε)) + 2^-24 (its own rounding).
fn naive_bn(shape: &Nhwc, y: &[f64], eps: f64, fp16: bool) -> NaiveBn {
    let (mean, var) = naive::mean_var(shape, y);
    let inv_std: Vec<f64> = var.iter().map(|v| 1.0 / (v + eps).sqrt()).collect();
    let u = if fp16 { U32 } else { 1e-15 };
    let mut out = NaiveBn {
        mean_err: vec![],
        var_err: vec![],
        inv_std_rel: vec![],
        mean,
        var,
        inv_std,
    };
    for ch in 0..shape.c {
        let v = naive::channel(shape, y, ch);
        let m = v.len() as f64;
        let e1 = v.iter().map(|x| x.abs()).sum::<f64>() / m;
        let e2 = v.iter().map(|x| x * x).sum::<f64>() / m;
        out.mean_err.push(2.0 * u * e1);
        out.var_err.push(4.0 * u * (e2 + e1 * e1));
        out.inv_std_rel
            .push(out.var_err[ch] / (2.0 * (out.var[ch] + eps)) + u);
    }
    out
}

fn bn_finalize_random_case<T: Element>() {
    let fp16 = is_half::<T>();
    let mut rng = Rng::new(34);
    let shape = Nhwc::new(2, 4, 5, 3);
    let c = shape.c;
    let y = rng.halfs(shape.elems(), -1.0, 2.0);
    let (gamma, beta) = (rng.floats(c, 0.5, 1.5), rng.floats(c, -0.5, 0.5));
    let (rm0, rv0) = (rng.floats(c, -0.5, 0.5), rng.floats(c, 0.5, 1.5));
    let params = BnParams::default();
    let stats = genstats(&shape, &to_t::<T>(&y)).unwrap();
    let (mut rm, mut rv) = (to_acc::<T>(&rm0), to_acc::<T>(&rv0));
    let running = RunningStats {
        mean: &mut rm,
        var: &mut rv,
    };
    let count = shape.pixels();
    let out = bn_finalize(
        &stats,
        &to_acc::<T>(&gamma),
        &to_acc::<T>(&beta),
        running,
        count,
        &params,
    )
    .unwrap();
    let nb = naive_bn(&shape, &wide(&y), params.epsilon, fp16);
    let (u32_, u16_) = if fp16 { (U32, U16) } else { (1e-15, 1e-15) };
    let m = count as f64;
    for ch in 0..c {
        let (g, b) = (f64::from(gamma[ch]), f64::from(beta[ch]));
        let is_err = nb.inv_std_rel[ch] * nb.inv_std[ch];
        let checks = [
            (
                "saved_mean",
                out.saved_mean[ch].to_f64(),
                nb.mean[ch],
                nb.mean_err[ch],
            ),
            (
                "saved_inv_std",
                out.saved_inv_std[ch].to_f64(),
                nb.inv_std[ch],
                is_err,
            ),
            // One FP16 rounding of γ·inv_std, plus inv_std's own error.
            (
                "eq_scale",
                out.eq_scale[ch].to_f64(),
                g * nb.inv_std[ch],
                u16_ * g * nb.inv_std[ch] + g * is_err,
            ),
            (
                "eq_bias",
                out.eq_bias[ch].to_f64(),
                b - nb.mean[ch] * g * nb.inv_std[ch],
                u16_ * (b - nb.mean[ch] * g * nb.inv_std[ch]).abs()
                    + g * (nb.mean_err[ch] * nb.inv_std[ch] + nb.mean[ch].abs() * is_err)
                    + SUBNORMAL16,
            ),
            (
                "running_mean",
                rm[ch].to_f64(),
                0.9 * f64::from(rm0[ch]) + 0.1 * nb.mean[ch],
                0.1 * nb.mean_err[ch] + u32_,
            ),
            (
                "running_var",
                rv[ch].to_f64(),
                0.9 * f64::from(rv0[ch]) + 0.1 * nb.var[ch] * m / (m - 1.0),
                0.1 * nb.var_err[ch] * m / (m - 1.0) + 2.0 * u32_,
            ),
        ];
        for (what, got, want, bound) in checks {
            assert_within(
                &format!("{what}[{ch}] fp16={fp16}"),
                &[got],
                &[want],
                &[bound],
            );
        }
    }
}

#[test]
fn bn_finalize_matches_naive() {
    both_modes!(bn_finalize_random_case);
}

fn bn_fwd_train_case<T: Element>() {
    let fp16 = is_half::<T>();
    let mut rng = Rng::new(35);
    let shape = Nhwc::new(2, 3, 5, 4);
    let c = shape.c;
    let y = rng.halfs(shape.elems(), -1.0, 2.0);
    let (gamma, beta) = (rng.floats(c, 0.5, 1.5), rng.floats(c, -0.5, 0.5));
    let (mut rm, mut rv) = (to_acc::<T>(&vec![0.0; c]), to_acc::<T>(&vec![1.0; c]));
    let running = RunningStats {
        mean: &mut rm,
        var: &mut rv,
    };
    let params = BnParams::default();
    let out = bn_fwd_train(
        &shape,
        &to_t::<T>(&y),
        &to_acc::<T>(&gamma),
        &to_acc::<T>(&beta),
        running,
        &params,
    )
    .unwrap();
    let y = wide(&y);
    let nb = naive_bn(&shape, &y, params.epsilon, fp16);
    let mut want = Vec::new();
    let mut bound = Vec::new();
    for (i, &yi) in y.iter().enumerate() {
        let ch = i % c;
        let (g, b, mu, is) = (
            f64::from(gamma[ch]),
            f64::from(beta[ch]),
            nb.mean[ch],
            nb.inv_std[ch],
        );
        want.push((yi - mu) * is * g + b);
        // Inputs to the normalization: mean and inv_std as bounded above; then 4 FP32 ops over
        // terms of size ≤ (|y| + |μ|)·is·γ + |β|, and one FP16 store.
        let mag = (yi.abs() + mu.abs()) * is * g + b.abs();
        let stats_err = g * (nb.mean_err[ch] * is + (yi - mu).abs() * is * nb.inv_std_rel[ch]);
        bound.push(sum_bound(fp16, want[i], mag, 4.0) + (1.0 + U16) * stats_err);
    }
    assert_within(
        &format!("bn_fwd_train fp16={fp16}"),
        &wide(&out.out),
        &want,
        &bound,
    );
    // The saved statistics and the running update are those of bn_finalize (bounds there).
    let is_err: Vec<f64> = nb
        .inv_std
        .iter()
        .zip(&nb.inv_std_rel)
        .map(|(v, r)| v * r)
        .collect();
    assert_within(
        "saved_mean",
        &wide_acc::<T>(&out.saved_mean),
        &nb.mean,
        &nb.mean_err,
    );
    assert_within(
        "saved_inv_std",
        &wide_acc::<T>(&out.saved_inv_std),
        &nb.inv_std,
        &is_err,
    );
    let want_rm: Vec<f64> = nb.mean.iter().map(|m| 0.1 * m).collect();
    let rm_err: Vec<f64> = nb.mean_err.iter().map(|e| 0.1 * e + U32).collect();
    assert_within("running_mean", &wide_acc::<T>(&rm), &want_rm, &rm_err);
}

#[test]
fn bn_fwd_train_matches_naive() {
    both_modes!(bn_fwd_train_case);
}

/// Checks BN-backward results against the textbook formula evaluated on the same inputs.
///
/// FP16 mode: the coefficients a, b, c are f64 values rounded to FP32 (2^-24 each) and the
/// apply makes 4 FP32 roundings, over terms of size `|a·dz| + |b·y| + |c|` (which may exceed
/// the result: b·y and c cancel), then one FP16 store. dγ and dβ are f64 sums rounded to FP32.
#[allow(clippy::too_many_arguments)]
fn check_bn_backward(
    what: &str,
    fp16: bool,
    shape: &Nhwc,
    y: &[f64],
    dz: &[f64],
    saved: [&[f64]; 3],
    got_dx: &[f64],
    got_dgamma: &[f64],
    got_dbeta: &[f64],
) {
    let [mean, inv_std, gamma] = saved;
    let (dx, dgamma, dbeta) = naive::bn_backward(shape, y, dz, mean, inv_std, gamma);
    let (c, m) = (shape.c, shape.pixels() as f64);
    let bound: Vec<f64> = (0..y.len())
        .map(|i| {
            let ch = i % c;
            let a = gamma[ch] * inv_std[ch];
            let b = a * inv_std[ch] * dgamma[ch] / m;
            let cc = a * dbeta[ch] / m + b * mean[ch].abs();
            let mag = (a * dz[i]).abs() + (b * y[i]).abs() + cc.abs();
            if fp16 {
                sum_bound(fp16, dx[i], mag, 6.0)
            } else {
                // f64 mode evaluates a different expression (coefficients, then a·dz + b·y + c)
                // from the same values: a few dozen f64 roundings over terms of size `mag`.
                64.0 * f64::EPSILON * (mag + dx[i].abs())
            }
        })
        .collect();
    assert_within(&format!("{what}: dx"), got_dx, &dx, &bound);
    let rel = if fp16 { U32 } else { 1e-15 };
    for ch in 0..c {
        let mag: f64 = (0..y.len() / c)
            .map(|j| {
                dz[j * c + ch].abs() * (1.0 + ((y[j * c + ch] - mean[ch]) * inv_std[ch]).abs())
            })
            .sum();
        assert_close(
            &format!("{what}: dgamma[{ch}]"),
            &[got_dgamma[ch]],
            &[dgamma[ch]],
            rel,
            1e-13 * mag,
        );
        assert_close(
            &format!("{what}: dbeta[{ch}]"),
            &[got_dbeta[ch]],
            &[dbeta[ch]],
            rel,
            1e-13 * mag,
        );
    }
}

fn bn_bwd_case<T: Element>() {
    let fp16 = is_half::<T>();
    let mut rng = Rng::new(36);
    let shape = Nhwc::new(2, 4, 3, 5);
    let c = shape.c;
    let y = rng.halfs(shape.elems(), -1.0, 2.0);
    let dz = rng.halfs(shape.elems(), -1.0, 1.0);
    let mean = rng.floats(c, -0.5, 1.0);
    let inv_std = rng.floats(c, 0.5, 2.0);
    let gamma = rng.floats(c, 0.5, 1.5);
    let out = bn_bwd(
        &shape,
        &to_t::<T>(&y),
        &to_t::<T>(&dz),
        &to_acc::<T>(&mean),
        &to_acc::<T>(&inv_std),
        &to_acc::<T>(&gamma),
    )
    .unwrap();
    check_bn_backward(
        &format!("bn_bwd fp16={fp16}"),
        fp16,
        &shape,
        &wide(&y),
        &wide(&dz),
        [&wide32(&mean), &wide32(&inv_std), &wide32(&gamma)],
        &wide(&out.dx),
        &wide_acc::<T>(&out.dgamma),
        &wide_acc::<T>(&out.dbeta),
    );
}

#[test]
fn bn_bwd_matches_textbook_formula() {
    both_modes!(bn_bwd_case);
}

fn dbn_apply_case<T: Element>() {
    let fp16 = is_half::<T>();
    let mut rng = Rng::new(37);
    let shape = Nhwc::new(2, 3, 3, 4);
    let c = shape.c;
    let dz = rng.halfs(shape.elems(), -1.0, 1.0);
    let y = rng.halfs(shape.elems(), -2.0, 2.0);
    let (a, b, cc) = (
        rng.floats(c, -2.0, 2.0),
        rng.floats(c, -2.0, 2.0),
        rng.floats(c, -2.0, 2.0),
    );
    let got = dbn_apply(
        &shape,
        &to_t::<T>(&dz),
        &to_t::<T>(&y),
        &to_acc::<T>(&a),
        &to_acc::<T>(&b),
        &to_acc::<T>(&cc),
    )
    .unwrap();
    let (dz, y, a, b, cc) = (wide(&dz), wide(&y), wide32(&a), wide32(&b), wide32(&cc));
    let want: Vec<f64> = (0..dz.len())
        .map(|i| a[i % c] * dz[i] + b[i % c] * y[i] + cc[i % c])
        .collect();
    // Two FP32 products (FP32·FP16 is not exact) and two adds, then one FP16 store.
    let bound: Vec<f64> = (0..dz.len())
        .map(|i| {
            let mag = (a[i % c] * dz[i]).abs() + (b[i % c] * y[i]).abs() + cc[i % c].abs();
            sum_bound(fp16, want[i], mag, 4.0)
        })
        .collect();
    assert_within(
        &format!("dbn_apply fp16={fp16}"),
        &wide(&got),
        &want,
        &bound,
    );
}

#[test]
fn dbn_apply_matches_naive() {
    both_modes!(dbn_apply_case);
}

fn dgrad_drelu_dbn_case<T: Element>() {
    let fp16 = is_half::<T>();
    let mut rng = Rng::new(41);
    for (name, p) in conv_cases() {
        let c = p.c;
        let dy = rng.halfs(p.y_elems(), -1.0, 1.0);
        let w = rng.halfs(p.w_elems(), -1.0, 1.0);
        let y_prev = rng.halfs(p.x_elems(), -2.0, 2.0);
        let resid = rng.halfs(p.x_elems(), -1.0, 1.0);
        let branch = rng.halfs(p.x_elems(), -1.0, 1.0);
        let (mean, inv_std) = (rng.floats(c, -0.5, 0.5), rng.floats(c, 0.5, 1.5));
        let (gamma, beta) = (rng.floats(c, 0.5, 1.5), rng.floats(c, -0.5, 0.5));
        let (resid_t, branch_t) = (to_t::<T>(&resid), to_t::<T>(&branch));
        let (mean_t, inv_std_t) = (to_acc::<T>(&mean), to_acc::<T>(&inv_std));
        let (gamma_t, beta_t) = (to_acc::<T>(&gamma), to_acc::<T>(&beta));
        let saved = SavedBn {
            mean: &mean_t,
            inv_std: &inv_std_t,
            gamma: &gamma_t,
            beta: &beta_t,
        };
        let (dxc, mag) = naive::conv_dgrad(&p, &wide(&dy), &wide(&w));
        let (y, mean, inv_std, gamma, beta) = (
            wide(&y_prev),
            wide32(&mean),
            wide32(&inv_std),
            wide32(&gamma),
            wide32(&beta),
        );
        for (with_resid, with_branch) in
            [(false, false), (true, false), (false, true), (true, true)]
        {
            let what = format!("{name} resid={with_resid} branch={with_branch} fp16={fp16}");
            let join = ReluJoin {
                resid: with_resid.then_some(resid_t.as_slice()),
                dy_branch: with_branch.then_some(branch_t.as_slice()),
            };
            let (dy_t, w_t, y_t) = (to_t::<T>(&dy), to_t::<T>(&w), to_t::<T>(&y_prev));
            let out = dgrad_drelu_dbn(&p, &dy_t, &w_t, &y_t, &saved, &join).unwrap();
            let got_dz = wide(&out.dz);
            // dz: dgrad (≤ r·s·k terms) plus the branch (one more term) in FP32, stored FP16.
            // Elements whose recomputed ReLU input is within 1e-4 of 0 are skipped: FP32
            // recompute error (~1e-6 here) could flip their mask legitimately.
            let n = (p.r * p.s * p.k + 1) as f64;
            let (mut got, mut want, mut bound) = (vec![], vec![], vec![]);
            for i in 0..y.len() {
                let ch = i % c;
                let z = (y[i] - mean[ch]) * inv_std[ch] * gamma[ch]
                    + beta[ch]
                    + if with_resid { resid[i].to_f64() } else { 0.0 };
                if z.abs() < 1e-4 {
                    continue;
                }
                let b = if with_branch { branch[i].to_f64() } else { 0.0 };
                let g = dxc[i] + b;
                want.push(if z > 0.0 { g } else { 0.0 });
                got.push(got_dz[i]);
                bound.push(if z > 0.0 {
                    sum_bound(fp16, g, mag[i] + b.abs(), n)
                } else {
                    0.0
                });
            }
            assert!(
                got.len() > y.len() * 9 / 10,
                "{what}: too many elements near the ReLU kink"
            );
            assert_within(&format!("{what}: dz"), &got, &want, &bound);
            // The BN part, on the stored dz (the documented semantics): dγ, dβ, and
            // a·dz + b·y + c against the textbook BN backward.
            let dy_prev =
                dbn_apply(&p.input_shape(), &out.dz, &y_t, &out.a, &out.b, &out.c).unwrap();
            check_bn_backward(
                &what,
                fp16,
                &p.input_shape(),
                &y,
                &got_dz,
                [&mean, &inv_std, &gamma],
                &wide(&dy_prev),
                &wide_acc::<T>(&out.dgamma),
                &wide_acc::<T>(&out.dbeta),
            );
        }
    }
}

#[test]
fn dgrad_drelu_dbn_matches_naive_in_every_join_variant() {
    both_modes!(dgrad_drelu_dbn_case);
}
