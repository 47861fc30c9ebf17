//! The network head of a training step and the residual gradient join: CPU twins of
//! `crates/4-netops/kernels/net_head.cu`.
//!
//! Shapes ([`HeadShape`]): activations are NHWC FP16 `[batch, pixels, features]` (pixels =
//! H·W); pooled features and their gradient FP32 `[batch, features]`; logits and their
//! gradient FP16 `[batch, classes]`; the FC weight FP32 `[classes, features]` (row-major), the
//! bias FP32 `[classes]`.
//!
//! | op | definition (f32 arithmetic, FP16 stores round to nearest even) |
//! |----|------------------------------------------------------------------|
//! | [`gap_forward`] | `pooled[r,c] = (Σ_p f32(a[r,p,c])) / pixels` |
//! | [`gap_backward`] | `da[r,p,c] = f16(dpooled[r,c] / pixels)` |
//! | [`fc_forward`] | `logits[r,k] = f16((Σ_j w[k,j]·x[r,j]) + b[k])` |
//! | [`fc_backward`] | `db[k] = Σ_r g[r,k]`, `dw[k,j] = Σ_r g[r,k]·x[r,j]`, `dx[r,j] = Σ_k g[r,k]·w[k,j]`, `g = f32(dlogits)` |
//! | [`add_f16`] | `out = f16(f32(a) + f32(b))` |
//! | [`head_metrics`] | mean loss and accuracy of one batch ([`argmax_last`]) |
//!
//! Every sum starts at `+0.0` and runs in ascending index order with a separate multiply and
//! add (no FMA); the kernels do exactly that, one thread per output, so both executors agree
//! bit for bit on finite inputs (NaN inputs come out NaN on both, canonical when stored FP16).
//!
//! **Which FC weights.** The FC layer reads its FP32 master weights from region W, not the
//! FP16 copies in A, and writes FP32 `dW`, `db` straight into G (overwriting: G is zeroed by
//! the step's begin, and nothing else writes those slots). The FC is tiny, so FP32 costs
//! nothing, and it keeps the classifier free of an FP16 weight rounding; the logits are
//! stored FP16, as the loss seed (amp's `amp_softmax_xent_backward`) expects.
//!
//! **The metrics log.** [`head_metrics`] is appended on the device to a small buffer (no host
//! sync per step): bytes `0..4` a `u32` count of appended entries, `4..16` reserved (zero),
//! then `capacity` entries of `(loss, accuracy)` as two `f32`. Entry `count % capacity` is
//! written, then the count incremented (wrapping). [`metrics_log_append`] is the twin of that
//! append and [`metrics_log_read`] decodes a log read back to the host.

#![forbid(unsafe_code)]

use cudnn_cbr_amp::range::{cast_f16_to_f32, check_len, f16_to_f32, f32_to_f16};
use cudnn_cbr_amp::RangeOpError;
use half::f16;

/// Dimensions of the head: `batch` images, each `pixels` positions of `features` channels
/// at the last stage, classified into `classes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadShape {
    /// Images.
    pub batch: usize,
    /// Spatial positions per image at the last stage (H·W).
    pub pixels: usize,
    /// Channels of the last stage = FC inputs.
    pub features: usize,
    /// FC outputs.
    pub classes: usize,
}

impl HeadShape {
    /// The shape, unchecked (see [`HeadShape::validate`]).
    pub const fn new(batch: usize, pixels: usize, features: usize, classes: usize) -> Self {
        HeadShape {
            batch,
            pixels,
            features,
            classes,
        }
    }

    /// Every dimension at least 1, and every element count representable.
    ///
    /// # Errors
    /// [`RangeOpError::InvalidConfig`] naming the dimension.
    pub fn validate(&self, op: &'static str) -> Result<(), RangeOpError> {
        for (field, v) in [
            ("batch", self.batch),
            ("pixels", self.pixels),
            ("features", self.features),
            ("classes", self.classes),
        ] {
            if v == 0 {
                return Err(RangeOpError::InvalidConfig {
                    op,
                    field,
                    value: "0".into(),
                    why: "must be >= 1",
                });
            }
        }
        let fits = self
            .batch
            .checked_mul(self.pixels)
            .and_then(|v| v.checked_mul(self.features))
            .and_then(|v| v.checked_mul(4))
            .is_some()
            && self
                .classes
                .checked_mul(self.features.max(self.batch))
                .and_then(|v| v.checked_mul(4))
                .is_some();
        if !fits {
            return Err(RangeOpError::InvalidConfig {
                op,
                field: "shape",
                value: format!("{self:?}"),
                why: "element counts overflow",
            });
        }
        Ok(())
    }

    /// Elements of the last stage's activation `[batch, pixels, features]`.
    pub const fn activation_elems(&self) -> usize {
        self.batch * self.pixels * self.features
    }

    /// Elements of the pooled features `[batch, features]`.
    pub const fn pooled_elems(&self) -> usize {
        self.batch * self.features
    }

    /// Elements of the logits `[batch, classes]`.
    pub const fn logits_elems(&self) -> usize {
        self.batch * self.classes
    }

    /// Elements of the FC weight `[classes, features]`.
    pub const fn weight_elems(&self) -> usize {
        self.classes * self.features
    }
}

/// CPU twin of `net_gap_forward`: `pooled[r,c] = (Σ_p f32(a[r,p,c])) / pixels`, the sum over
/// `p` ascending from `+0.0`.
///
/// # Errors
/// [`RangeOpError::InvalidConfig`] for a bad shape, [`RangeOpError::LengthMismatch`] when a
/// slice does not fit it.
pub fn gap_forward(shape: &HeadShape, a: &[f16], pooled: &mut [f32]) -> Result<(), RangeOpError> {
    const OP: &str = "gap_forward";
    shape.validate(OP)?;
    check_len(OP, "a", shape.activation_elems(), a.len())?;
    check_len(OP, "pooled", shape.pooled_elems(), pooled.len())?;
    let (f, pix) = (shape.features, shape.pixels);
    let div = pix as f32;
    // Each image widened at once (the same values as `f16_to_f32` element by element, with
    // the slice conversion's vector instructions), then summed pixel by pixel.
    let mut wide = vec![0.0f32; f * pix];
    for (img, out) in a.chunks_exact(f * pix).zip(pooled.chunks_exact_mut(f)) {
        cast_f16_to_f32(img, &mut wide)?;
        out.fill(0.0);
        for px in wide.chunks_exact(f) {
            for (o, v) in out.iter_mut().zip(px) {
                *o += v;
            }
        }
        for o in out.iter_mut() {
            *o /= div;
        }
    }
    Ok(())
}

/// CPU twin of `net_gap_backward`: `da[r,p,c] = f16(dpooled[r,c] / pixels)`.
///
/// # Errors
/// As [`gap_forward`].
pub fn gap_backward(
    shape: &HeadShape,
    dpooled: &[f32],
    da: &mut [f16],
) -> Result<(), RangeOpError> {
    const OP: &str = "gap_backward";
    shape.validate(OP)?;
    check_len(OP, "dpooled", shape.pooled_elems(), dpooled.len())?;
    check_len(OP, "da", shape.activation_elems(), da.len())?;
    let (f, pix) = (shape.features, shape.pixels);
    let div = pix as f32;
    // Every pixel of an image gets the same row: computed once, then copied.
    let mut row = vec![f16::ZERO; f];
    for (g, img) in dpooled.chunks_exact(f).zip(da.chunks_exact_mut(f * pix)) {
        for (d, v) in row.iter_mut().zip(g) {
            *d = f32_to_f16(v / div);
        }
        for px in img.chunks_exact_mut(f) {
            px.copy_from_slice(&row);
        }
    }
    Ok(())
}

/// CPU twin of `net_fc_forward`: `logits[r,k] = f16((Σ_j w[k,j]·x[r,j]) + b[k])`, the dot
/// product over `j` ascending from `+0.0`.
///
/// # Errors
/// As [`gap_forward`].
pub fn fc_forward(
    shape: &HeadShape,
    x: &[f32],
    w: &[f32],
    b: &[f32],
    logits: &mut [f16],
) -> Result<(), RangeOpError> {
    const OP: &str = "fc_forward";
    shape.validate(OP)?;
    check_len(OP, "x", shape.pooled_elems(), x.len())?;
    check_len(OP, "w", shape.weight_elems(), w.len())?;
    check_len(OP, "b", shape.classes, b.len())?;
    check_len(OP, "logits", shape.logits_elems(), logits.len())?;
    let f = shape.features;
    for (xr, out) in x
        .chunks_exact(f)
        .zip(logits.chunks_exact_mut(shape.classes))
    {
        for ((o, wk), bk) in out.iter_mut().zip(w.chunks_exact(f)).zip(b) {
            let mut s = 0.0f32;
            for (wj, xj) in wk.iter().zip(xr) {
                s += wj * xj;
            }
            *o = f32_to_f16(s + bk);
        }
    }
    Ok(())
}

/// CPU twin of `net_fc_backward`. With `g = f32(dlogits)`: `db[k] = Σ_r g[r,k]`,
/// `dw[k,j] = Σ_r g[r,k]·x[r,j]`, `dx[r,j] = Σ_k g[r,k]·w[k,j]`, each sum ascending from
/// `+0.0`. All three outputs are overwritten.
///
/// # Errors
/// As [`gap_forward`].
#[allow(clippy::too_many_arguments)]
pub fn fc_backward(
    shape: &HeadShape,
    dlogits: &[f16],
    x: &[f32],
    w: &[f32],
    dw: &mut [f32],
    db: &mut [f32],
    dx: &mut [f32],
) -> Result<(), RangeOpError> {
    const OP: &str = "fc_backward";
    shape.validate(OP)?;
    check_len(OP, "dlogits", shape.logits_elems(), dlogits.len())?;
    check_len(OP, "x", shape.pooled_elems(), x.len())?;
    check_len(OP, "w", shape.weight_elems(), w.len())?;
    check_len(OP, "dw", shape.weight_elems(), dw.len())?;
    check_len(OP, "db", shape.classes, db.len())?;
    check_len(OP, "dx", shape.pooled_elems(), dx.len())?;
    let (f, classes) = (shape.features, shape.classes);
    dw.fill(0.0);
    db.fill(0.0);
    dx.fill(0.0);
    // Rows outermost: every output still accumulates in its own ascending index order.
    for ((g, xr), dxr) in dlogits
        .chunks_exact(classes)
        .zip(x.chunks_exact(f))
        .zip(dx.chunks_exact_mut(f))
    {
        for k in 0..classes {
            let gk = f16_to_f32(g[k]);
            db[k] += gk;
            let wk = &w[k * f..(k + 1) * f];
            let dwk = &mut dw[k * f..(k + 1) * f];
            for j in 0..f {
                dwk[j] += gk * xr[j];
                dxr[j] += gk * wk[j];
            }
        }
    }
    Ok(())
}

/// CPU twin of `net_add_f16`: `out[i] = f16(f32(a[i]) + f32(b[i]))`.
///
/// # Errors
/// [`RangeOpError::LengthMismatch`] when the slices differ in length.
pub fn add_f16(a: &[f16], b: &[f16], out: &mut [f16]) -> Result<(), RangeOpError> {
    const OP: &str = "add_f16";
    check_len(OP, "b", a.len(), b.len())?;
    check_len(OP, "out", a.len(), out.len())?;
    for ((o, x), y) in out.iter_mut().zip(a).zip(b) {
        *o = f32_to_f16(f16_to_f32(*x) + f16_to_f32(*y));
    }
    Ok(())
}

/// The predicted class of one row of logits: the LAST index of the largest `f32` value under
/// the IEEE total order (`f32::total_cmp`, what `Iterator::max_by` returns on ties); `None`
/// for an empty row.
pub fn argmax_last(row: &[f16]) -> Option<usize> {
    row.iter()
        .enumerate()
        .max_by(|a, b| f16_to_f32(*a.1).total_cmp(&f16_to_f32(*b.1)))
        .map(|(k, _)| k)
}

/// One batch's loss and accuracy.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct HeadMetrics {
    /// Mean cross-entropy of the batch (0 when no per-row losses were given).
    pub loss: f32,
    /// Fraction of rows whose [`argmax_last`] is the label.
    pub accuracy: f32,
}

/// CPU twin of the metrics computed by `net_head_metrics`: `loss = (Σ_r loss[r]) / batch`
/// (sum ascending from `+0.0`; 0 when `loss` is `None`) and `accuracy = correct / batch`,
/// a row being correct when its [`argmax_last`] equals its label (a label outside
/// `[0, classes)` never is).
///
/// # Errors
/// [`RangeOpError::InvalidConfig`] for `classes == 0` or no rows,
/// [`RangeOpError::LengthMismatch`] when a slice does not match `labels.len()` rows.
pub fn head_metrics(
    logits: &[f16],
    labels: &[i32],
    loss: Option<&[f32]>,
    classes: usize,
) -> Result<HeadMetrics, RangeOpError> {
    const OP: &str = "head_metrics";
    let batch = labels.len();
    HeadShape::new(batch, 1, 1, classes).validate(OP)?;
    check_len(OP, "logits", batch * classes, logits.len())?;
    let mut loss_sum = 0.0f32;
    if let Some(l) = loss {
        check_len(OP, "loss", batch, l.len())?;
        for v in l {
            loss_sum += v;
        }
    }
    let correct = logits
        .chunks_exact(classes)
        .zip(labels)
        .filter(|(row, &label)| {
            usize::try_from(label).is_ok_and(|label| argmax_last(row) == Some(label))
        })
        .count();
    let n = batch as f32;
    Ok(HeadMetrics {
        loss: loss_sum / n,
        accuracy: correct as f32 / n,
    })
}

/// Bytes before the first entry of a metrics log (the `u32` count and reserved bytes).
pub const METRICS_LOG_HEADER: usize = 16;

/// Bytes of one metrics-log entry (loss and accuracy, two `f32`).
pub const METRICS_LOG_ENTRY: usize = 8;

/// Bytes of a metrics log with room for `capacity` entries.
pub const fn metrics_log_bytes(capacity: usize) -> usize {
    METRICS_LOG_HEADER + METRICS_LOG_ENTRY * capacity
}

/// Entries a metrics log of `bytes` bytes holds (0 when it is too short for the header).
pub const fn metrics_log_capacity(bytes: usize) -> usize {
    bytes.saturating_sub(METRICS_LOG_HEADER) / METRICS_LOG_ENTRY
}

fn check_log(op: &'static str, len: usize) -> Result<usize, RangeOpError> {
    let capacity = metrics_log_capacity(len);
    if capacity == 0 {
        return Err(RangeOpError::LengthMismatch {
            op,
            what: "log (bytes)",
            expected: metrics_log_bytes(1),
            got: len,
        });
    }
    Ok(capacity)
}

/// CPU twin of the append in `net_head_metrics`: writes `m` at entry `count % capacity` of
/// the little-endian log image and increments the count (wrapping). The capacity is what
/// the log's length holds ([`metrics_log_capacity`]).
///
/// # Errors
/// [`RangeOpError::LengthMismatch`] when the log has no room for one entry.
pub fn metrics_log_append(log: &mut [u8], m: HeadMetrics) -> Result<(), RangeOpError> {
    let capacity = check_log("metrics_log_append", log.len())?;
    let count = u32::from_le_bytes([log[0], log[1], log[2], log[3]]);
    let at = METRICS_LOG_HEADER + METRICS_LOG_ENTRY * (count as usize % capacity);
    log[at..at + 4].copy_from_slice(&m.loss.to_le_bytes());
    log[at + 4..at + 8].copy_from_slice(&m.accuracy.to_le_bytes());
    log[..4].copy_from_slice(&count.wrapping_add(1).to_le_bytes());
    Ok(())
}

/// A metrics log read back to the host.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MetricsLog {
    /// Entries appended so far (wrapping `u32`), including any overwritten ones.
    pub count: u32,
    /// The entries still held, oldest first (the last `min(count, capacity)` appended).
    pub entries: Vec<HeadMetrics>,
}

/// Decodes a metrics-log image.
///
/// # Errors
/// [`RangeOpError::LengthMismatch`] when the image is too short for one entry.
pub fn metrics_log_read(log: &[u8]) -> Result<MetricsLog, RangeOpError> {
    let capacity = check_log("metrics_log_read", log.len())?;
    let count = u32::from_le_bytes([log[0], log[1], log[2], log[3]]);
    let held = (count as usize).min(capacity);
    let first = if (count as usize) <= capacity {
        0
    } else {
        count as usize % capacity
    };
    let f = |at: usize| f32::from_le_bytes([log[at], log[at + 1], log[at + 2], log[at + 3]]);
    let entries = (0..held)
        .map(|i| {
            let at = METRICS_LOG_HEADER + METRICS_LOG_ENTRY * ((first + i) % capacity);
            HeadMetrics {
                loss: f(at),
                accuracy: f(at + 4),
            }
        })
        .collect();
    Ok(MetricsLog { count, entries })
}
