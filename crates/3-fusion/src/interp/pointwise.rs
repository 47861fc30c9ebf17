//! Pointwise nodes (cuDNN's `y = op(α1·x, α2·b [, t])`, inputs broadcast where a dim is 1)
//! and reductions, in FP32.

use super::error::{node_err, Result};
use super::tensor::Value;
use crate::graph::{PointwiseAttrs, PointwiseMode, ReductionMode};

/// Row-major strides of `dims` with 0 where an input dim of 1 is broadcast.
fn broadcast_strides(input: &[usize], out: &[usize]) -> Option<Vec<usize>> {
    if input.len() != out.len() {
        return None;
    }
    let mut strides = vec![0usize; input.len()];
    let mut acc = 1usize;
    for d in (0..input.len()).rev() {
        if input[d] == out[d] {
            strides[d] = if input[d] == 1 { 0 } else { acc };
        } else if input[d] != 1 {
            return None;
        }
        acc *= input[d];
    }
    Some(strides)
}

/// Logical index of every output element in each input (broadcast).
fn input_indices(out: &[usize], strides: &[usize]) -> Vec<usize> {
    let total: usize = out.iter().product();
    let mut idx = vec![0usize; out.len()];
    let mut v = Vec::with_capacity(total);
    for _ in 0..total {
        v.push(idx.iter().zip(strides).map(|(i, s)| i * s).sum());
        for d in (0..idx.len()).rev() {
            idx[d] += 1;
            if idx[d] < out[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    v
}

/// A pointwise node over `inputs` producing `out_dims`.
pub(super) fn pointwise(
    node: (usize, &'static str),
    attrs: &PointwiseAttrs,
    inputs: &[&Value],
    out_dims: &[usize],
) -> Result<Vec<f32>> {
    let mode = attrs.mode;
    if inputs.len() != mode.arity() {
        return Err(node_err(
            node.0,
            node.1,
            format!(
                "{} takes {} inputs, got {}",
                mode.name(),
                mode.arity(),
                inputs.len()
            ),
        ));
    }
    let mut idx = Vec::with_capacity(inputs.len());
    for (i, v) in inputs.iter().enumerate() {
        let s = broadcast_strides(&v.dims, out_dims).ok_or_else(|| {
            node_err(
                node.0,
                node.1,
                format!(
                    "input {i} dims {:?} do not broadcast to the output's {out_dims:?}",
                    v.dims
                ),
            )
        })?;
        idx.push(input_indices(out_dims, &s));
    }
    let total: usize = out_dims.iter().product();
    let (a1, a2) = (attrs.alpha1, attrs.alpha2);
    let at = |i: usize, e: usize| inputs[i].data[idx[i][e]];
    Ok((0..total)
        .map(|e| match mode {
            PointwiseMode::Add => a1 * at(0, e) + a2 * at(1, e),
            PointwiseMode::Sub => a1 * at(0, e) - a2 * at(1, e),
            PointwiseMode::Mul => (a1 * at(0, e)) * (a2 * at(1, e)),
            PointwiseMode::ReluFwd => (a1 * at(0, e)).max(0.0),
            // Inputs (dy, x): the gradient passes where the forward input was positive.
            PointwiseMode::ReluBwd => {
                if at(1, e) > 0.0 {
                    at(0, e)
                } else {
                    0.0
                }
            }
            PointwiseMode::CmpGt => f32::from(u8::from(a1 * at(0, e) > a2 * at(1, e))),
            // Inputs (x, b, t): x where the mask t is set, else b.
            PointwiseMode::BinarySelect => {
                if at(2, e) != 0.0 {
                    at(0, e)
                } else {
                    at(1, e)
                }
            }
            PointwiseMode::Identity => at(0, e),
        })
        .collect())
}

/// A reduction of `x` to `out_dims` (each dim kept, or 1 = reduced). Sums run in `f64`.
pub(super) fn reduce(
    node: (usize, &'static str),
    mode: ReductionMode,
    x: &Value,
    out_dims: &[usize],
) -> Result<Vec<f32>> {
    let strides = broadcast_strides(out_dims, &x.dims).ok_or_else(|| {
        node_err(
            node.0,
            node.1,
            format!(
                "output dims {out_dims:?} are not the input's {:?} with dims reduced to 1",
                x.dims
            ),
        )
    })?;
    let total: usize = out_dims.iter().product();
    let targets = input_indices(&x.dims, &strides);
    match mode {
        ReductionMode::Add => {
            let mut acc = vec![0f64; total];
            for (&t, &v) in targets.iter().zip(&x.data) {
                acc[t] += f64::from(v);
            }
            Ok(acc.into_iter().map(|v| v as f32).collect())
        }
        ReductionMode::Max => {
            let mut acc = vec![f32::NEG_INFINITY; total];
            for (&t, &v) in targets.iter().zip(&x.data) {
                acc[t] = acc[t].max(v);
            }
            Ok(acc)
        }
    }
}
