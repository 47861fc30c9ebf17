//! Finite-difference gradient checks of whole CBR chains in f64 mode, on both routes: the
//! analytic backward (fused patterns 5/4/6 with their residual variants, or the unfused steps)
//! must equal the numerical derivative of the forward, for every input, filter, γ and β entry.

use super::util::Rng;
use crate::reference::*;

/// Central-difference step. With losses of size ~10 summed in f64 the rounding noise of a
/// difference quotient is ~1e-15·10/1e-6 = 1e-8, and the truncation error ~h²·L''' ~ 1e-11;
/// `TOL_ABS`/`TOL_REL` leave two orders of magnitude above that.
const H: f64 = 1e-6;
const TOL_ABS: f64 = 1e-6;
const TOL_REL: f64 = 1e-5;

/// A layer spec: the conv and whether it has an identity shortcut.
type Spec = (ConvParams, bool);

fn make_chain(rng: &mut Rng, specs: &[Spec]) -> CbrChain<f64> {
    let layers = specs
        .iter()
        .map(|&(p, shortcut)| {
            let mut layer = CbrLayer::new(
                p,
                (0..p.w_elems()).map(|_| rng.uniform(-1.0, 1.0)).collect(),
            );
            layer.gamma = (0..p.k).map(|_| rng.uniform(0.5, 1.5)).collect();
            layer.beta = (0..p.k).map(|_| rng.uniform(-0.5, 0.5)).collect();
            layer.shortcut = shortcut;
            layer
        })
        .collect();
    CbrChain::new(layers, BnParams::default()).unwrap()
}

fn loss(chain: &CbrChain<f64>, x: &[f64], weights: &[f64], route: Route) -> f64 {
    let mut chain = chain.clone();
    let fwd = chain.forward(x, route).unwrap();
    weighted_sum_loss(&fwd.output, weights).unwrap()
}

#[track_caller]
fn check(what: &str, analytic: f64, f: impl Fn(f64) -> f64) {
    let numeric = (f(H) - f(-H)) / (2.0 * H);
    assert!(
        (numeric - analytic).abs() <= TOL_ABS + TOL_REL * analytic.abs(),
        "{what}: analytic {analytic}, finite difference {numeric}"
    );
}

fn check_chain(specs: &[Spec], seed: u64) {
    let mut rng = Rng::new(seed);
    let chain = make_chain(&mut rng, specs);
    let x: Vec<f64> = (0..specs[0].0.x_elems())
        .map(|_| rng.uniform(-1.0, 1.0))
        .collect();
    let out_len = specs[specs.len() - 1].0.y_elems();
    let weights: Vec<f64> = (0..out_len).map(|_| rng.uniform(-1.0, 1.0)).collect();
    for route in [Route::Fused, Route::Unfused] {
        let fwd = chain.clone().forward(&x, route).unwrap();
        let grads = chain.backward(&fwd, &x, &weights).unwrap();
        let norm: f64 = grads.dx.iter().map(|g| g * g).sum();
        assert!(
            norm > 1e-4,
            "{route:?}: dx is (nearly) zero, the check would be vacuous"
        );
        for (j, &g) in grads.dx.iter().enumerate() {
            check(&format!("{route:?} dx[{j}]"), g, |d| {
                let mut x = x.clone();
                x[j] += d;
                loss(&chain, &x, &weights, route)
            });
        }
        for (l, lg) in grads.layers.iter().enumerate() {
            let perturbed = |field: fn(&mut CbrLayer<f64>) -> &mut Vec<f64>, j: usize, d: f64| {
                let mut c = chain.clone();
                field(&mut c.layers[l])[j] += d;
                loss(&c, &x, &weights, route)
            };
            for (j, &g) in lg.dw.iter().enumerate() {
                check(&format!("{route:?} layer {l} dw[{j}]"), g, |d| {
                    perturbed(|l| &mut l.w, j, d)
                });
            }
            for (j, &g) in lg.dgamma.iter().enumerate() {
                check(&format!("{route:?} layer {l} dgamma[{j}]"), g, |d| {
                    perturbed(|l| &mut l.gamma, j, d)
                });
            }
            for (j, &g) in lg.dbeta.iter().enumerate() {
                check(&format!("{route:?} layer {l} dbeta[{j}]"), g, |d| {
                    perturbed(|l| &mut l.beta, j, d)
                });
            }
        }
    }
}

#[test]
fn two_layer_chain_gradients_match_finite_differences() {
    // 3x3 pad 1 (C=2 → K=3), then 3x3 stride 2 pad 1 (3 → 2): the second conv's input is the
    // first BN's prologue.
    check_chain(
        &[
            (
                ConvParams::new(2, 2, 5, 5, 3, 3, 3).with_padding(1, 1),
                false,
            ),
            (
                ConvParams::new(2, 3, 5, 5, 2, 3, 3)
                    .with_padding(1, 1)
                    .with_stride(2, 2),
                false,
            ),
        ],
        51,
    );
}

#[test]
fn two_layer_residual_chain_gradients_match_finite_differences() {
    // Both layers have identity shortcuts: layer 0's output is stored, feeds conv 1 and is
    // layer 1's shortcut, so the fused backward uses pattern 5 with `resid` and `dy_branch`.
    check_chain(
        &[
            (
                ConvParams::new(2, 3, 4, 4, 3, 3, 3).with_padding(1, 1),
                true,
            ),
            (ConvParams::new(2, 3, 4, 4, 3, 1, 1), true),
        ],
        52,
    );
}

#[test]
fn three_layer_mixed_chain_gradients_match_finite_differences() {
    // Only the middle layer has a shortcut: pattern 5 sees `dy_branch` alone (at layer 1)
    // and `resid` alone (at layer 2).
    check_chain(
        &[
            (
                ConvParams::new(2, 2, 4, 4, 3, 3, 3).with_padding(1, 1),
                false,
            ),
            (
                ConvParams::new(2, 3, 4, 4, 3, 3, 3).with_padding(1, 1),
                true,
            ),
            (ConvParams::new(2, 3, 4, 4, 2, 1, 1), false),
        ],
        53,
    );
}
