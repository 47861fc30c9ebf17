//! Naive `f64` definitions, written from the formulas with direct nested loops and no code
//! shared with the reference ops. The conv ones also return `Σ|term|` per output element, the
//! scale of the accumulation error an implementation may make.

use crate::reference::{ConvParams, Nhwc};

/// Calls `f(n, op, oq, k, ih, iw, c, r, s)` for every (output pixel, filter tap, channel)
/// whose input pixel lies inside the input: the definition of the convolution's sparsity.
fn for_each_term(p: &ConvParams, mut f: impl FnMut([usize; 9])) {
    let (out_h, out_w) = (p.out_h(), p.out_w());
    for n in 0..p.n {
        for op in 0..out_h {
            for oq in 0..out_w {
                for r in 0..p.r {
                    for s in 0..p.s {
                        let ih = (op * p.stride_h + r * p.dil_h) as isize - p.pad_h as isize;
                        let iw = (oq * p.stride_w + s * p.dil_w) as isize - p.pad_w as isize;
                        if ih < 0 || iw < 0 || ih >= p.h as isize || iw >= p.w as isize {
                            continue;
                        }
                        for k in 0..p.k {
                            for c in 0..p.c {
                                f([n, op, oq, k, ih as usize, iw as usize, c, r, s]);
                            }
                        }
                    }
                }
            }
        }
    }
}

fn x_idx(p: &ConvParams, n: usize, h: usize, w: usize, c: usize) -> usize {
    ((n * p.h + h) * p.w + w) * p.c + c
}

fn y_idx(p: &ConvParams, n: usize, op: usize, oq: usize, k: usize) -> usize {
    ((n * p.out_h() + op) * p.out_w() + oq) * p.k + k
}

fn w_idx(p: &ConvParams, k: usize, r: usize, s: usize, c: usize) -> usize {
    ((k * p.r + r) * p.s + s) * p.c + c
}

/// `y[n,p,q,k] = Σ x[n, p·sh − ph + r·dh, q·sw − pw + s·dw, c] · w[k,r,s,c]`; and `Σ|terms|`.
pub fn conv_fprop(p: &ConvParams, x: &[f64], w: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let mut y = vec![0.0; p.y_elems()];
    let mut mag = vec![0.0; p.y_elems()];
    for_each_term(p, |[n, op, oq, k, ih, iw, c, r, s]| {
        let t = x[x_idx(p, n, ih, iw, c)] * w[w_idx(p, k, r, s, c)];
        y[y_idx(p, n, op, oq, k)] += t;
        mag[y_idx(p, n, op, oq, k)] += t.abs();
    });
    (y, mag)
}

/// `dx = ∂(Σ dy·y)/∂x` by scattering every term of the forward sum.
pub fn conv_dgrad(p: &ConvParams, dy: &[f64], w: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let mut dx = vec![0.0; p.x_elems()];
    let mut mag = vec![0.0; p.x_elems()];
    for_each_term(p, |[n, op, oq, k, ih, iw, c, r, s]| {
        let t = dy[y_idx(p, n, op, oq, k)] * w[w_idx(p, k, r, s, c)];
        dx[x_idx(p, n, ih, iw, c)] += t;
        mag[x_idx(p, n, ih, iw, c)] += t.abs();
    });
    (dx, mag)
}

/// `dw = ∂(Σ dy·y)/∂w` by scattering every term of the forward sum.
pub fn conv_wgrad(p: &ConvParams, x: &[f64], dy: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let mut dw = vec![0.0; p.w_elems()];
    let mut mag = vec![0.0; p.w_elems()];
    for_each_term(p, |[n, op, oq, k, ih, iw, c, r, s]| {
        let t = dy[y_idx(p, n, op, oq, k)] * x[x_idx(p, n, ih, iw, c)];
        dw[w_idx(p, k, r, s, c)] += t;
        mag[w_idx(p, k, r, s, c)] += t.abs();
    });
    (dw, mag)
}

/// The values of channel `ch` of an NHWC tensor.
pub fn channel(shape: &Nhwc, t: &[f64], ch: usize) -> Vec<f64> {
    t.iter().skip(ch).step_by(shape.c).copied().collect()
}

/// Two-pass per-channel mean and biased variance.
pub fn mean_var(shape: &Nhwc, y: &[f64]) -> (Vec<f64>, Vec<f64>) {
    (0..shape.c)
        .map(|ch| {
            let v = channel(shape, y, ch);
            let m = v.iter().sum::<f64>() / v.len() as f64;
            let var = v.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / v.len() as f64;
            (m, var)
        })
        .unzip()
}

/// The textbook BN backward, per element:
/// `dx = γ·is/M · (M·dz − Σdz − x̂·Σ(dz·x̂))` with `x̂ = (y − μ)·is`.
/// Returns `(dx, dγ, dβ)`.
pub fn bn_backward(
    shape: &Nhwc,
    y: &[f64],
    dz: &[f64],
    mean: &[f64],
    inv_std: &[f64],
    gamma: &[f64],
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let c = shape.c;
    let m = shape.pixels() as f64;
    let x_hat = |i: usize| (y[i] - mean[i % c]) * inv_std[i % c];
    let mut dgamma = vec![0.0; c];
    let mut dbeta = vec![0.0; c];
    for i in 0..y.len() {
        dgamma[i % c] += dz[i] * x_hat(i);
        dbeta[i % c] += dz[i];
    }
    let dx = (0..y.len())
        .map(|i| {
            let ch = i % c;
            gamma[ch] * inv_std[ch] / m * (m * dz[i] - dbeta[ch] - x_hat(i) * dgamma[ch])
        })
        .collect();
    (dx, dgamma, dbeta)
}
