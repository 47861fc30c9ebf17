//! The convolutions (fprop, dgrad, wgrad, with and without the BN-apply + ReLU prologue and
//! GenStats) against their naive `f64` definitions, in both precision modes.
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

fn conv_fprop_case<T: Element>() {
    let fp16 = is_half::<T>();
    let mut rng = Rng::new(11);
    for (name, p) in conv_cases() {
        let x = rng.halfs(p.x_elems(), -1.0, 1.0);
        let w = rng.halfs(p.w_elems(), -1.0, 1.0);
        let (want, mag) = naive::conv_fprop(&p, &wide(&x), &wide(&w));
        let got = wide(&conv_fprop(&p, &to_t::<T>(&x), &to_t::<T>(&w)).unwrap());
        let n = (p.r * p.s * p.c) as f64;
        let bound: Vec<f64> = want
            .iter()
            .zip(&mag)
            .map(|(&v, &m)| sum_bound(fp16, v, m, n))
            .collect();
        assert_within(&format!("fprop {name} fp16={fp16}"), &got, &want, &bound);
    }
}

#[test]
fn conv_fprop_matches_naive() {
    both_modes!(conv_fprop_case);
}

fn conv_dgrad_case<T: Element>() {
    let fp16 = is_half::<T>();
    let mut rng = Rng::new(12);
    for (name, p) in conv_cases() {
        let dy = rng.halfs(p.y_elems(), -1.0, 1.0);
        let w = rng.halfs(p.w_elems(), -1.0, 1.0);
        let (want, mag) = naive::conv_dgrad(&p, &wide(&dy), &wide(&w));
        let got = wide(&conv_dgrad(&p, &to_t::<T>(&dy), &to_t::<T>(&w)).unwrap());
        // Each dx element sums at most r·s·k terms.
        let n = (p.r * p.s * p.k) as f64;
        let bound: Vec<f64> = want
            .iter()
            .zip(&mag)
            .map(|(&v, &m)| sum_bound(fp16, v, m, n))
            .collect();
        assert_within(&format!("dgrad {name} fp16={fp16}"), &got, &want, &bound);
    }
}

#[test]
fn conv_dgrad_matches_naive() {
    both_modes!(conv_dgrad_case);
}

fn conv_wgrad_case<T: Element>() {
    let fp16 = is_half::<T>();
    let mut rng = Rng::new(13);
    for (name, p) in conv_cases() {
        let x = rng.halfs(p.x_elems(), -1.0, 1.0);
        let dy = rng.halfs(p.y_elems(), -1.0, 1.0);
        let (want, mag) = naive::conv_wgrad(&p, &wide(&x), &wide(&dy));
        let got = wide(&conv_wgrad(&p, &to_t::<T>(&x), &to_t::<T>(&dy)).unwrap());
        // Each dw element sums n·out_h·out_w terms.
        let n = p.output_shape().pixels() as f64;
        let bound: Vec<f64> = want
            .iter()
            .zip(&mag)
            .map(|(&v, &m)| sum_bound(fp16, v, m, n))
            .collect();
        assert_within(&format!("wgrad {name} fp16={fp16}"), &got, &want, &bound);
    }
}

#[test]
fn conv_wgrad_matches_naive() {
    both_modes!(conv_wgrad_case);
}

/// The wgrad reduction, the widest one, gives the same bits whatever the thread count.
#[test]
fn conv_wgrad_is_independent_of_thread_count() {
    let (_, p) = conv_cases().pop().unwrap();
    let mut rng = Rng::new(14);
    let x = rng.halfs(p.x_elems(), -1.0, 1.0);
    let dy = rng.halfs(p.y_elems(), -1.0, 1.0);
    let many = conv_wgrad(&p, &x, &dy).unwrap();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let one = pool.install(|| conv_wgrad(&p, &x, &dy).unwrap());
    assert_eq!(many, one);
}

/// Test data for a conv whose input is `relu(y_prev·scale + bias)`.
struct PrologueData {
    y_prev: Vec<f16>,
    scale: Vec<f16>,
    bias: Vec<f16>,
    /// The exact prologue output, in f64.
    x: Vec<f64>,
}

fn prologue_data(rng: &mut Rng, p: &ConvParams) -> PrologueData {
    let y_prev = rng.halfs(p.x_elems(), -2.0, 2.0);
    let scale = rng.halfs(p.c, 0.5, 1.5);
    let bias = rng.halfs(p.c, -0.5, 0.5);
    let x = y_prev
        .iter()
        .enumerate()
        .map(|(i, y)| (y.to_f64() * scale[i % p.c].to_f64() + bias[i % p.c].to_f64()).max(0.0))
        .collect();
    PrologueData {
        y_prev,
        scale,
        bias,
        x,
    }
}

/// Bound for a conv-type sum whose input went through the prologue: in FP16 mode each input
/// value is computed in FP32 (one rounding in the add; the FP16 product is exact) and then
/// stored as FP16 (the documented assumption), so it errs by ≤ (2^-11 + 2·2^-24)·|x| + 2^-25;
/// through the sum that is ≤ (2^-11 + 2·2^-24)·mag + 2^-25·Σ|weight| (weights in [-1, 1]).
fn prologue_bound(fp16: bool, want: f64, mag: f64, n_terms: f64) -> f64 {
    let input = if fp16 {
        (U16 + 2.0 * U32) * mag * (1.0 + 1.01 * n_terms * U32) + SUBNORMAL16 * n_terms
    } else {
        0.0
    };
    sum_bound(fp16, want, mag, n_terms) + (1.0 + U16) * input
}

fn fprop_genstats_case<T: Element>() {
    let fp16 = is_half::<T>();
    let mut rng = Rng::new(21);
    for (name, p) in conv_cases() {
        let d = prologue_data(&mut rng, &p);
        let w = rng.halfs(p.w_elems(), -1.0, 1.0);
        let (y_prev, scale, bias) = (
            to_t::<T>(&d.y_prev),
            to_t::<T>(&d.scale),
            to_t::<T>(&d.bias),
        );
        let input = ConvInput::Prologue {
            y_prev: &y_prev,
            scale: &scale,
            bias: &bias,
        };
        let out = fprop_genstats(&p, input, &to_t::<T>(&w)).unwrap();
        let (want, mag) = naive::conv_fprop(&p, &d.x, &wide(&w));
        let n = (p.r * p.s * p.c) as f64;
        let bound: Vec<f64> = want
            .iter()
            .zip(&mag)
            .map(|(&v, &m)| prologue_bound(fp16, v, m, n))
            .collect();
        let got = wide(&out.y);
        assert_within(
            &format!("prologue fprop {name} fp16={fp16}"),
            &got,
            &want,
            &bound,
        );
        // GenStats sums the stored y: f64 sums (error ~1e-16 relative) rounded once to FP32.
        let shape = p.output_shape();
        let rel = if fp16 { U32 } else { 1e-14 };
        for ch in 0..shape.c {
            let v = naive::channel(&shape, &got, ch);
            let (sum, sqsum): (f64, f64) = (v.iter().sum(), v.iter().map(|y| y * y).sum());
            let abs: f64 = v.iter().map(|y| y.abs()).sum();
            let gs = out.stats.sum[ch].to_f64();
            let gq = out.stats.sqsum[ch].to_f64();
            assert!(
                (gs - sum).abs() <= rel * sum.abs() + 1e-13 * abs,
                "{name}: sum[{ch}] {gs} vs {sum}"
            );
            assert!(
                (gq - sqsum).abs() <= rel * sqsum + 1e-13 * sqsum,
                "{name}: sqsum[{ch}] {gq} vs {sqsum}"
            );
        }
    }
}

#[test]
fn fprop_genstats_with_prologue_matches_naive() {
    both_modes!(fprop_genstats_case);
}

#[test]
fn fprop_genstats_plain_equals_conv_fprop_then_genstats() {
    let (_, p) = conv_cases()[2];
    let mut rng = Rng::new(22);
    let x = rng.halfs(p.x_elems(), -1.0, 1.0);
    let w = rng.halfs(p.w_elems(), -1.0, 1.0);
    let fused = fprop_genstats(&p, ConvInput::Plain(&x), &w).unwrap();
    let y = conv_fprop(&p, &x, &w).unwrap();
    assert_eq!(fused.y, y);
    assert_eq!(fused.stats, genstats(&p.output_shape(), &y).unwrap());
}

fn wgrad_with_prologue_case<T: Element>() {
    let fp16 = is_half::<T>();
    let mut rng = Rng::new(23);
    for (name, p) in conv_cases() {
        let d = prologue_data(&mut rng, &p);
        let dy = rng.halfs(p.y_elems(), -1.0, 1.0);
        let (y_prev, scale, bias) = (
            to_t::<T>(&d.y_prev),
            to_t::<T>(&d.scale),
            to_t::<T>(&d.bias),
        );
        let input = ConvInput::Prologue {
            y_prev: &y_prev,
            scale: &scale,
            bias: &bias,
        };
        let got = wide(&wgrad_with_prologue(&p, input, &to_t::<T>(&dy)).unwrap());
        let (want, mag) = naive::conv_wgrad(&p, &d.x, &wide(&dy));
        let n = p.output_shape().pixels() as f64;
        let bound: Vec<f64> = want
            .iter()
            .zip(&mag)
            .map(|(&v, &m)| prologue_bound(fp16, v, m, n))
            .collect();
        assert_within(
            &format!("prologue wgrad {name} fp16={fp16}"),
            &got,
            &want,
            &bound,
        );
        // The plain form is the plain wgrad.
        let x = to_t::<T>(&rng.halfs(p.x_elems(), -1.0, 1.0));
        let dy = to_t::<T>(&dy);
        assert_eq!(
            wgrad_with_prologue(&p, ConvInput::Plain(&x), &dy).unwrap(),
            conv_wgrad(&p, &x, &dy).unwrap()
        );
    }
}

#[test]
fn wgrad_with_prologue_matches_naive() {
    both_modes!(wgrad_with_prologue_case);
}
