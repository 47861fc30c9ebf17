//! Tensors of a graph: data types, dims, strides, and the NHWC / per-channel helpers.

// Element types a graph tensor can have: the workspace's one data type enum.
pub(crate) use cudnn_cbr_runtime::DataType;

/// The graph's default types: I/O tensors, virtual intermediates, and math.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PrecisionContext {
    /// Real (stored) tensors without an explicit type.
    pub io: DataType,
    /// Virtual tensors without an explicit type.
    pub intermediate: DataType,
    /// Compute (math) precision of every node.
    pub compute: DataType,
}

impl Default for PrecisionContext {
    /// FP16 I/O, FP32 intermediates, FP32 compute: what every CBR graph uses.
    fn default() -> Self {
        PrecisionContext {
            io: DataType::Half,
            intermediate: DataType::Float,
            compute: DataType::Float,
        }
    }
}

/// Fully packed NHWC strides for dims given in cuDNN's N,C,H,W order (`[C·H·W, 1, W·C, C]`).
/// The same formula gives KRSC strides for a filter `[K,C,R,S]`.
/// Products that overflow saturate at `i64::MAX` (validation then reports the size).
pub fn nhwc_strides(dims: [i64; 4]) -> [i64; 4] {
    let [_, c, h, w] = dims;
    [
        c.saturating_mul(h).saturating_mul(w),
        1,
        w.saturating_mul(c),
        c,
    ]
}

/// Fully packed row-major strides (NCHW for 4-D dims); products that overflow saturate.
pub fn packed_strides(dims: &[i64]) -> Vec<i64> {
    let mut strides = vec![1i64; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1].saturating_mul(dims[i + 1]);
    }
    strides
}

/// Dims of a per-channel vector: `[1, C, 1, 1]`.
pub fn vector_dims(c: i64) -> [i64; 4] {
    [1, c, 1, 1]
}

/// A tensor as the user describes it. Unset dims/strides/dtype are inferred by the graph.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorAttrs {
    /// Name used in error messages (never part of the signature).
    pub name: String,
    /// Dims in cuDNN order (N,C,H,W for activations, K,C,R,S for filters).
    pub dims: Vec<i64>,
    /// Strides in elements, same order as `dims`. Empty = NHWC-packed for 4-D, row-major else.
    pub strides: Vec<i64>,
    /// Element type; `None` takes the precision context's io or intermediate type.
    pub dtype: Option<DataType>,
    /// Whether the tensor is a virtual intermediate (never stored).
    pub is_virtual: bool,
    /// Whether the tensor is a host scalar passed by value at execution.
    pub by_value: bool,
    /// An explicit unique id; `None` lets the graph assign one.
    pub uid: Option<i64>,
}

impl TensorAttrs {
    /// A real tensor with the given name and dims (NHWC-packed strides by default).
    pub fn new(name: impl Into<String>, dims: impl Into<Vec<i64>>) -> Self {
        TensorAttrs {
            name: name.into(),
            dims: dims.into(),
            strides: Vec::new(),
            dtype: None,
            is_virtual: false,
            by_value: false,
            uid: None,
        }
    }

    /// A per-channel vector `[1,C,1,1]` (strides `[C,1,C,C]`).
    pub fn vector(name: impl Into<String>, c: i64) -> Self {
        TensorAttrs::new(name, vector_dims(c))
    }

    /// A host scalar passed by value (`[1,1,1,1]`, strides 1).
    pub fn scalar(name: impl Into<String>, dtype: DataType) -> Self {
        TensorAttrs {
            strides: vec![1, 1, 1, 1],
            dtype: Some(dtype),
            by_value: true,
            ..TensorAttrs::new(name, [1, 1, 1, 1])
        }
    }

    /// Sets the element type.
    pub fn dtype(mut self, dtype: DataType) -> Self {
        self.dtype = Some(dtype);
        self
    }

    /// Sets explicit strides.
    pub fn strides(mut self, strides: impl Into<Vec<i64>>) -> Self {
        self.strides = strides.into();
        self
    }

    /// Sets NCHW-packed (row-major) strides instead of the NHWC default.
    pub fn nchw(mut self) -> Self {
        self.strides = packed_strides(&self.dims);
        self
    }

    /// Sets an explicit unique id.
    pub fn uid(mut self, uid: i64) -> Self {
        self.uid = Some(uid);
        self
    }

    /// Marks the tensor virtual.
    pub fn virtual_(mut self) -> Self {
        self.is_virtual = true;
        self
    }
}

/// Default strides for dims: NHWC-packed for 4-D, row-major otherwise.
pub(crate) fn default_strides(dims: &[i64]) -> Vec<i64> {
    match dims {
        [n, c, h, w] => nhwc_strides([*n, *c, *h, *w]).to_vec(),
        _ => packed_strides(dims),
    }
}

/// Whether `strides` lay out `dims` (N,C,H,W order) channels-last without overlap: C is
/// innermost (stride 1), then W, H, N, each stride at least the extent of the one inside it.
/// Row pitches may be padded. Size-1 dims can have any stride.
pub(crate) fn is_nhwc(dims: &[i64], strides: &[i64]) -> bool {
    if dims.len() != 4 || strides.len() != 4 {
        return false;
    }
    // Inner to outer: C, W, H, N.
    let mut extent = 1i64;
    for i in [1usize, 3, 2, 0] {
        if dims[i] == 1 {
            continue;
        }
        if strides[i] < extent {
            return false;
        }
        extent = strides[i].saturating_mul(dims[i]);
    }
    dims[1] == 1 || strides[1] == 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stride_helpers() {
        assert_eq!(
            nhwc_strides([32, 64, 56, 56]),
            [64 * 56 * 56, 1, 56 * 64, 64]
        );
        assert_eq!(packed_strides(&[2, 3, 4, 5]), vec![60, 20, 5, 1]);
        assert!(is_nhwc(&[2, 3, 4, 5], &nhwc_strides([2, 3, 4, 5])));
        assert!(!is_nhwc(&[2, 3, 4, 5], &packed_strides(&[2, 3, 4, 5])));
        // Per-channel vectors: [C,1,C,C] and [C,1,1,1] both count as NHWC.
        assert!(is_nhwc(&[1, 8, 1, 1], &[8, 1, 8, 8]));
        assert!(is_nhwc(&[1, 8, 1, 1], &[8, 1, 1, 1]));
        // Padded row pitch is still channels-last; C not innermost is not.
        assert!(is_nhwc(&[2, 3, 4, 5], &[3 * 4 * 8, 1, 3 * 8, 3]));
        assert!(!is_nhwc(&[2, 3, 4, 5], &[60, 2, 15, 3]));
    }
}
