//! The loss-gradient seed: softmax cross-entropy backward, scaled by the loss scale.
//!
//! The network's last layer gets `dlogits = scale / batch * (softmax(x) - onehot(label))`
//! in FP16, with the scale read from S on the device: the whole backward pass then runs on
//! scaled gradients without the host knowing the current scale.

use half::f16;

use crate::error::RangeOpError;
use crate::range::cast::{check_len, f32_to_f16};
use crate::range::scalars::Scalars;

/// CPU twin of `amp_softmax_xent_backward`.
///
/// `logits` is `[batch, classes]` row-major FP16, `labels` has `batch` entries, `dlogits`
/// has the shape of `logits`. Per row, in f32: `m = max(x)`, `sum = Σ exp(x - m)`,
/// `p_j = exp(x_j - m) * (1 / sum)`, `d_j = (scale / batch) * (p_j - [j == label])` stored
/// FP16 (round to nearest even); `loss = ln(sum) - (x_label - m)` when `loss` is given.
///
/// A label outside `[0, classes)` (e.g. an ignore index such as -100) gives a zero gradient
/// row and a zero loss, on both executors; the mean still divides by `batch`.
///
/// The device reduces `max` and `sum` in parallel and uses its own `expf`/`logf`, so it
/// agrees with this twin to a few f32 ulps before the FP16 rounding (at most one FP16 ulp
/// after it), not bit for bit.
///
/// # Errors
/// [`RangeOpError::InvalidConfig`] for `classes == 0`,
/// [`RangeOpError::LengthMismatch`] when a slice does not match `batch` or `batch*classes`.
pub fn softmax_xent_backward(
    logits: &[f16],
    labels: &[i32],
    classes: usize,
    s: &Scalars,
    dlogits: &mut [f16],
    loss: Option<&mut [f32]>,
) -> Result<(), RangeOpError> {
    const OP: &str = "softmax_xent_backward";
    if classes == 0 {
        return Err(RangeOpError::InvalidConfig {
            op: OP,
            field: "classes",
            value: "0".into(),
            why: "must be >= 1",
        });
    }
    let batch = labels.len();
    let total = batch
        .checked_mul(classes)
        .ok_or(RangeOpError::InvalidConfig {
            op: OP,
            field: "classes",
            value: classes.to_string(),
            why: "batch * classes overflows",
        })?;
    check_len(OP, "logits", total, logits.len())?;
    check_len(OP, "dlogits", total, dlogits.len())?;
    let mut loss = loss;
    if let Some(l) = loss.as_deref() {
        check_len(OP, "loss", batch, l.len())?;
    }
    // `batch as f32` rounds like the kernel's `(float)batch`.
    let coef = s.loss_scale / batch as f32;
    for (row, &label) in labels.iter().enumerate() {
        let x = &logits[row * classes..(row + 1) * classes];
        let d = &mut dlogits[row * classes..(row + 1) * classes];
        let target = usize::try_from(label).ok().filter(|&t| t < classes);
        let Some(target) = target else {
            d.fill(f16::ZERO);
            if let Some(l) = loss.as_deref_mut() {
                l[row] = 0.0;
            }
            continue;
        };
        let m = x
            .iter()
            .fold(f32::NEG_INFINITY, |acc, v| acc.max(v.to_f32()));
        let sum: f32 = x.iter().map(|v| (v.to_f32() - m).exp()).sum();
        let inv_sum = 1.0f32 / sum;
        for (j, (dj, xj)) in d.iter_mut().zip(x).enumerate() {
            let p = (xj.to_f32() - m).exp() * inv_sum;
            let y = if j == target { 1.0f32 } else { 0.0 };
            *dj = f32_to_f16(coef * (p - y));
        }
        if let Some(l) = loss.as_deref_mut() {
            l[row] = sum.ln() - (x[target].to_f32() - m);
        }
    }
    Ok(())
}
