//! Checking a network description before any arithmetic on it: sizes, strides, pools and
//! the element counts of every buffer.

use crate::net::spec::{NetSpec, PoolSpec};
use cudnn_cbr_fusion::cbr::ConvShape;
use cudnn_cbr_fusion::{Error, Result};

pub(super) fn invalid(layer: &str, field: &str, problem: String) -> Error {
    Error::InvalidConfig {
        layer: layer.into(),
        field: field.into(),
        problem,
    }
}

/// Checks a description before any arithmetic on it.
pub fn validate(spec: &NetSpec, batch: usize, hw: usize) -> Result<()> {
    let name = spec.name.as_str();
    for (field, v) in [
        ("batch", batch),
        ("hw", hw),
        ("in_channels", spec.in_channels),
        ("classes", spec.classes),
        ("stem.out", spec.stem.out),
        ("stem.kernel", spec.stem.kernel),
        ("stem.stride", spec.stem.stride),
    ] {
        if v == 0 {
            return Err(invalid(name, field, "must be >= 1, got 0".into()));
        }
    }
    // Every extent must fit the conv shape type (i64) with room for its arithmetic; the
    // products of extents are checked where they are formed (`elems`).
    let limit = 1usize << 31;
    for (field, v) in [
        ("batch", batch),
        ("hw", hw),
        ("in_channels", spec.in_channels),
        ("classes", spec.classes),
        ("stem.out", spec.stem.out),
        ("stem.kernel", spec.stem.kernel),
        ("stem.stride", spec.stem.stride),
        ("stem.pad", spec.stem.pad),
    ] {
        if v > limit {
            return Err(invalid(name, field, format!("{v} is beyond {limit}")));
        }
    }
    if let Some(p) = spec.stem.max_pool {
        validate_pool(name, &p)?;
    }
    // The input is the one buffer whose size follows from these extents alone.
    elems(name, "hw", [batch, hw, spec.in_channels])?;
    if spec.stages.iter().all(|s| s.is_empty()) {
        return Err(invalid(name, "stages", "hold no block".into()));
    }
    let mut ch = spec.stem.out;
    for (i, stage) in spec.stages.iter().enumerate() {
        for (j, b) in stage.iter().enumerate() {
            let at = format!("{name} s{i}.b{j}");
            if b.in_ch != ch {
                return Err(invalid(
                    &at,
                    "in_ch",
                    format!("is {} but the previous output has {ch} channels", b.in_ch),
                ));
            }
            for (field, v) in [("width", b.width), ("out", b.out), ("stride", b.stride)] {
                if v == 0 {
                    return Err(invalid(&at, field, "must be >= 1, got 0".into()));
                }
                if v > limit {
                    return Err(invalid(&at, field, format!("{v} is beyond {limit}")));
                }
            }
            if !b.projection && (b.in_ch != b.out || b.stride != 1) {
                return Err(invalid(
                    &at,
                    "projection",
                    format!(
                        "an identity shortcut needs in_ch == out and stride 1, got {} -> {} stride {}",
                        b.in_ch, b.out, b.stride
                    ),
                ));
            }
            ch = b.out;
        }
    }
    Ok(())
}

/// Checks a max-pool window before any size is computed from it: kernel and stride ≥ 1 and at
/// most 2^31, padding at most half the kernel (PyTorch's rule: every window then holds a
/// real pixel, so padding never wins).
pub fn validate_pool(layer: &str, p: &PoolSpec) -> Result<()> {
    let limit = 1usize << 31;
    if p.kernel == 0
        || p.stride == 0
        || p.pad > p.kernel / 2
        || p.kernel > limit
        || p.stride > limit
    {
        return Err(invalid(
            layer,
            "stem.max_pool",
            format!(
                "needs 1 <= kernel <= {limit}, 1 <= stride <= {limit} and pad <= kernel / 2, \
                 got {}x{}/{} pad {}",
                p.kernel, p.kernel, p.stride, p.pad
            ),
        ));
    }
    Ok(())
}

/// Output size of a window op (`None` when the window does not fit or a size wraps).
pub(super) fn out_size(input: usize, kernel: usize, stride: usize, pad: usize) -> Option<usize> {
    let padded = input.checked_add(pad.checked_mul(2)?)?;
    if stride == 0 || padded < kernel {
        return None;
    }
    Some((padded - kernel) / stride + 1)
}

/// Elements of a `batch`×`hw`×`hw`×`ch` activation, checked: the product must not wrap and its
/// FP32 copy must fit [`ConvShape::MAX_TENSOR_BYTES`].
pub(super) fn elems(layer: &str, field: &str, [batch, hw, ch]: [usize; 3]) -> Result<usize> {
    let max = ConvShape::MAX_TENSOR_BYTES as usize / 4;
    batch
        .checked_mul(hw)
        .and_then(|e| e.checked_mul(hw))
        .and_then(|e| e.checked_mul(ch))
        .filter(|&e| e <= max)
        .ok_or_else(|| {
            invalid(
                layer,
                field,
                format!(
                    "{batch}x{hw}x{hw}x{ch} elements are beyond {max} (no buffer of more than \
                     {} bytes can be allocated)",
                    ConvShape::MAX_TENSOR_BYTES
                ),
            )
        })
}

/// `e` with `name` as its layer, where it names a field of a layer config.
pub(super) fn in_layer(name: &str, e: Error) -> Error {
    match e {
        Error::InvalidConfig { field, problem, .. } => Error::InvalidConfig {
            layer: name.into(),
            field,
            problem,
        },
        other => other,
    }
}
