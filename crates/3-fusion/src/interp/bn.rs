//! Batch-norm nodes, from cuDNN's definitions of the ops, per channel `c` of an `[N,C,H,W]`
//! tensor over its `M = N·H·W` elements. Per-element and per-channel arithmetic is FP32; sums
//! over elements run in `f64` and are rounded to FP32 once.
//!
//! - GenStats: `sum = Σx`, `sq_sum = Σx²`.
//! - BN finalize (training): `mean = sum/M`, `var = max(sq_sum/M − mean², 0)` (biased),
//!   `inv_std = 1/√(var + ε)`, `eq_scale = γ·inv_std`, `eq_bias = β − mean·eq_scale`,
//!   `running_mean' = (1−f)·running_mean + f·mean`,
//!   `running_var' = (1−f)·running_var + f·var·M/(M−1)` (`f` the exponential-average factor).
//! - BN backward weights: `x̂ = (x − mean)·inv_std`, `dγ = Σ dy·x̂`, `dβ = Σ dy`, and the
//!   coefficients of `dx = A·dy + B·x + C`: `A = γ·inv_std`, `B = −A·inv_std·dγ/M`,
//!   `C = −A·dβ/M − B·mean`.
//! - NormForward (training): the batch mean and biased variance of `x` itself,
//!   `y = (x − mean)·inv_std·γ + β`, `inv_variance = inv_std`, running stats as finalize.
//! - NormBackward: `dx = γ·inv_std/M·(M·dy − Σdy − x̂·Σ dy·x̂)`, `dγ = Σ dy·x̂`, `dβ = Σ dy`.

use super::error::{node_err, Result};
use super::tensor::Value;

type Node = (usize, &'static str);

/// The `[N,C,H,W]` dims of `x`, checked.
pub(super) fn dims4(node: Node, what: &str, x: &Value) -> Result<[usize; 4]> {
    x.nchw().ok_or_else(|| {
        node_err(
            node.0,
            node.1,
            format!("{what} has dims {:?}, not 4", x.dims),
        )
    })
}

/// A per-channel vector's `c` values, checked.
pub(super) fn vector<'a>(node: Node, what: &str, v: &'a Value, c: usize) -> Result<&'a [f32]> {
    let per_channel = v.data.len() == c && v.dims.iter().filter(|&&d| d != 1).count() <= 1;
    if !per_channel {
        return Err(node_err(
            node.0,
            node.1,
            format!(
                "{what} has dims {:?}, expected {c} per-channel values",
                v.dims
            ),
        ));
    }
    Ok(&v.data)
}

/// A by-value scalar's value.
pub(super) fn scalar(node: Node, what: &str, v: &Value) -> Result<f64> {
    match (v.exact, v.data.as_slice()) {
        (Some(e), _) => Ok(e),
        (None, [x]) => Ok(f64::from(*x)),
        _ => Err(node_err(
            node.0,
            node.1,
            format!("{what} is not a scalar (dims {:?})", v.dims),
        )),
    }
}

/// Calls `f(channel, value)` for every element of an `[N,C,H,W]` tensor.
fn per_element(d: [usize; 4], mut f: impl FnMut(usize, usize)) {
    let [n, c, h, w] = d;
    let plane = h * w;
    for i in 0..n * c * plane {
        f((i / plane) % c, i);
    }
}

/// Per-channel `f64` sums of `term(channel, element)`.
fn channel_sum(d: [usize; 4], mut term: impl FnMut(usize, usize) -> f64) -> Vec<f64> {
    let mut acc = vec![0f64; d[1]];
    per_element(d, |ch, i| acc[ch] += term(ch, i));
    acc
}

/// GenStats: (Σx, Σx²) per channel.
pub(super) fn genstats(node: Node, x: &Value) -> Result<(Vec<f32>, Vec<f32>)> {
    let d = dims4(node, "x", x)?;
    let sum = channel_sum(d, |_, i| f64::from(x.data[i]));
    let sq = channel_sum(d, |_, i| f64::from(x.data[i]) * f64::from(x.data[i]));
    Ok((
        sum.into_iter().map(|v| v as f32).collect(),
        sq.into_iter().map(|v| v as f32).collect(),
    ))
}

/// Batch statistics of one channel and its running-stat update, FP32.
struct Moments {
    mean: f32,
    inv_std: f32,
    running_mean: f32,
    running_var: f32,
}

/// `mean`, `inv_std` and the updated running stats from a channel's sums over `m` elements.
fn moments(sum: f32, sq_sum: f32, m: f32, eps: f32, f: f32, rm: f32, rv: f32) -> Moments {
    let mean = sum / m;
    let var = (sq_sum / m - mean * mean).max(0.0);
    Moments {
        mean,
        inv_std: 1.0 / (var + eps).sqrt(),
        running_mean: (1.0 - f) * rm + f * mean,
        running_var: (1.0 - f) * rv + f * (var * m / (m - 1.0)),
    }
}

/// BN finalize's outputs, in [`crate::graph::Node::outputs`] order.
pub(super) struct Finalized {
    pub eq_scale: Vec<f32>,
    pub eq_bias: Vec<f32>,
    pub mean: Vec<f32>,
    pub inv_std: Vec<f32>,
    pub running_mean: Vec<f32>,
    pub running_var: Vec<f32>,
}

/// The inputs of BN finalize: sum, sq_sum, γ, β, running mean and var (each `[C]`), and
/// ε, f and the element count.
pub(super) struct FinalizeIn<'a> {
    pub sum: &'a [f32],
    pub sq_sum: &'a [f32],
    pub gamma: &'a [f32],
    pub beta: &'a [f32],
    pub running_mean: &'a [f32],
    pub running_var: &'a [f32],
    pub eps: f64,
    pub factor: f64,
    pub count: f64,
}

/// BN finalize (training).
pub(super) fn finalize(node: Node, i: &FinalizeIn<'_>) -> Result<Finalized> {
    check_bn_scalars(node, i.eps, i.factor, i.count)?;
    let (m, eps, f) = (i.count as f32, i.eps as f32, i.factor as f32);
    let mut o = Finalized {
        eq_scale: vec![],
        eq_bias: vec![],
        mean: vec![],
        inv_std: vec![],
        running_mean: vec![],
        running_var: vec![],
    };
    for ch in 0..i.sum.len() {
        let mo = moments(
            i.sum[ch],
            i.sq_sum[ch],
            m,
            eps,
            f,
            i.running_mean[ch],
            i.running_var[ch],
        );
        let scale = i.gamma[ch] * mo.inv_std;
        o.eq_scale.push(scale);
        o.eq_bias.push(i.beta[ch] - mo.mean * scale);
        o.mean.push(mo.mean);
        o.inv_std.push(mo.inv_std);
        o.running_mean.push(mo.running_mean);
        o.running_var.push(mo.running_var);
    }
    Ok(o)
}

fn check_bn_scalars(node: Node, eps: f64, factor: f64, count: f64) -> Result<()> {
    if !(eps.is_finite() && eps > 0.0) {
        return Err(node_err(
            node.0,
            node.1,
            format!("epsilon {eps} must be finite and > 0"),
        ));
    }
    if !(0.0..=1.0).contains(&factor) {
        return Err(node_err(
            node.0,
            node.1,
            format!("exponential-average factor {factor} must lie in [0, 1]"),
        ));
    }
    if count < 2.0 {
        return Err(node_err(
            node.0,
            node.1,
            format!("element count {count} must be at least 2 (unbiased running variance)"),
        ));
    }
    Ok(())
}

/// `Σ dy·x̂` and `Σ dy` per channel, with `x̂ = (x − mean)·inv_std` in FP32.
fn dbn_sums(
    d: [usize; 4],
    x: &[f32],
    dy: &[f32],
    mean: &[f32],
    inv_std: &[f32],
) -> (Vec<f64>, Vec<f64>) {
    let dgamma = channel_sum(d, |ch, i| {
        let x_hat = (x[i] - mean[ch]) * inv_std[ch];
        f64::from(dy[i] * x_hat)
    });
    let dbeta = channel_sum(d, |_, i| f64::from(dy[i]));
    (dgamma, dbeta)
}

/// BN backward weights' outputs: dγ, dβ, A, B, C.
pub(super) fn dbn_weight(
    node: Node,
    x: &Value,
    mean: &Value,
    inv_std: &Value,
    gamma: &Value,
    dy: &Value,
) -> Result<[Vec<f32>; 5]> {
    let d = dims4(node, "x", x)?;
    same_dims(node, x, dy)?;
    let c = d[1];
    let (mean, inv_std, gamma) = (
        vector(node, "mean", mean, c)?,
        vector(node, "inv_std", inv_std, c)?,
        vector(node, "scale", gamma, c)?,
    );
    let (sg, sb) = dbn_sums(d, &x.data, &dy.data, mean, inv_std);
    let m = (d[0] * d[2] * d[3]) as f32;
    let mut out: [Vec<f32>; 5] = Default::default();
    for ch in 0..c {
        let (dg, db) = (sg[ch] as f32, sb[ch] as f32);
        let a = gamma[ch] * inv_std[ch];
        let b = -(a * inv_std[ch] * dg) / m;
        let cc = -(a * db) / m - b * mean[ch];
        for (o, v) in out.iter_mut().zip([dg, db, a, b, cc]) {
            o.push(v);
        }
    }
    Ok(out)
}

fn same_dims(node: Node, x: &Value, dy: &Value) -> Result<()> {
    if x.dims != dy.dims {
        return Err(node_err(
            node.0,
            node.1,
            format!("x has dims {:?} but dy {:?}", x.dims, dy.dims),
        ));
    }
    Ok(())
}

/// NormForward's outputs: y, mean, inv_variance, running mean and var.
pub(super) fn norm_forward(
    node: Node,
    x: &Value,
    gamma: &Value,
    beta: &Value,
    eps: f64,
    factor: f64,
    running: Option<(&Value, &Value)>,
) -> Result<[Vec<f32>; 5]> {
    let d = dims4(node, "x", x)?;
    let c = d[1];
    let m = d[0] * d[2] * d[3];
    check_bn_scalars(node, eps, factor, m as f64)?;
    let (gamma, beta) = (
        vector(node, "scale", gamma, c)?,
        vector(node, "bias", beta, c)?,
    );
    let (rm, rv) = match running {
        Some((rm, rv)) => (
            vector(node, "running_mean", rm, c)?.to_vec(),
            vector(node, "running_var", rv, c)?.to_vec(),
        ),
        None => (vec![0.0; c], vec![0.0; c]),
    };
    let (sum, sq) = genstats(node, x)?;
    let mo: Vec<Moments> = (0..c)
        .map(|ch| {
            moments(
                sum[ch],
                sq[ch],
                m as f32,
                eps as f32,
                factor as f32,
                rm[ch],
                rv[ch],
            )
        })
        .collect();
    let mut y = vec![0f32; x.data.len()];
    per_element(d, |ch, i| {
        y[i] = (x.data[i] - mo[ch].mean) * mo[ch].inv_std * gamma[ch] + beta[ch];
    });
    Ok([
        y,
        mo.iter().map(|m| m.mean).collect(),
        mo.iter().map(|m| m.inv_std).collect(),
        mo.iter().map(|m| m.running_mean).collect(),
        mo.iter().map(|m| m.running_var).collect(),
    ])
}

/// NormBackward's outputs: dx, dγ, dβ.
pub(super) fn norm_backward(
    node: Node,
    dy: &Value,
    x: &Value,
    gamma: &Value,
    mean: &Value,
    inv_std: &Value,
) -> Result<[Vec<f32>; 3]> {
    let d = dims4(node, "x", x)?;
    same_dims(node, x, dy)?;
    let c = d[1];
    let (gamma, mean, inv_std) = (
        vector(node, "scale", gamma, c)?,
        vector(node, "mean", mean, c)?,
        vector(node, "inv_variance", inv_std, c)?,
    );
    let (sg, sb) = dbn_sums(d, &x.data, &dy.data, mean, inv_std);
    let (dg, db): (Vec<f32>, Vec<f32>) = (
        sg.iter().map(|&v| v as f32).collect(),
        sb.iter().map(|&v| v as f32).collect(),
    );
    let m = (d[0] * d[2] * d[3]) as f32;
    let mut dx = vec![0f32; x.data.len()];
    per_element(d, |ch, i| {
        let x_hat = (x.data[i] - mean[ch]) * inv_std[ch];
        dx[i] = gamma[ch] * inv_std[ch] / m * (m * dy.data[i] - db[ch] - x_hat * dg[ch]);
    });
    Ok([dx, dg, db])
}
